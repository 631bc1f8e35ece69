"""Pre-emption, cadence and a dead rank, through the recipe CLI (gloo, CPU, tiny towers).

* SIGTERM to the launching process of a tp 2 x pp 2 run (Lightning's launcher: the 3 other
  ranks get no signal) after its first periodic checkpoint (``every_n_train_steps``): all 4
  ranks agree, save ``last.ckpt`` at one step before ``max_steps`` and exit 0; relaunching the
  same command (``--ckpt_path auto``) resumes there and ends with weights and optimizer state
  bitwise equal to an uninterrupted run of the same command (its 4 ranks in a spawned world:
  :mod:`tests.recipes.cli_worker`); the resumed run's TensorBoard events (Lightning's default
  logger) hold throughput, MFU and the peak memory of all 4 ranks;
* SIGKILL of rank 1 of a 2-process run (Lightning's launcher: rank 0 started rank 1): the job
  exits non-zero within seconds (the process-group timeout is 3 minutes), the
  console holds one block naming the rank, host, pid, signal, the last complete checkpoint and
  the resume command, and no traceback (rank 0's is in ``faults/rank_0.log``).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from lightning_mmpar.parallel.checkpoint import complete_checkpoints, newest_checkpoint
from lightning_mmpar.testing import free_port, spawn
from tests.recipes import cli_worker

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[2]
CPU_YAML = str(ROOT / "recipes" / "clip_llama_cpu.yaml")
STEPS, EVERY = 12, 4
WAIT = 900.0  # seconds: wall clock on a loaded 2-core machine; the CPU time is ~40 s a launch
PG_TIMEOUT = 30.0
PEAK = 1e9  # FLOP/s per device: a stated figure, so that MFU is logged on a CPU


def _env(**extra: str) -> dict[str, str]:
    drop = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", *drop))}
    return env | {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **extra}


def _command(tmp: Path, root: Path, devices: int = 4, **strategy: Any) -> list[str]:
    every = EVERY if devices == 4 else 2
    trainer = {
        "max_steps": STEPS,
        "limit_val_batches": 0,
        "log_every_n_steps": 2,
        "enable_progress_bar": False,
        "default_root_dir": str(root),
        "devices": devices,
        "callbacks": [
            {
                "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                "init_args": {"save_last": True, "save_top_k": 0, "every_n_train_steps": every},
            },
            {"class_path": "lightning_mmpar.callbacks.preemption.Preemption"},
            {
                "class_path": "lightning_mmpar.recipes.throughput.RecipeThroughput",
                "init_args": {"peak_flops_per_device": PEAK, "window_size": 2},
            },
            {"class_path": "lightning_mmpar.callbacks.peak_memory.PeakMemory"},
        ],
    }
    if strategy:
        trainer["strategy"] = {
            "class_path": "lightning_mmpar.strategy.MultimodalParallelStrategy",
            "init_args": strategy,
        }
    overrides = tmp / f"{root.name}.yaml"
    overrides.write_text(yaml.safe_dump({"trainer": trainer, "data": {"batch_size": 24}}))
    return [
        sys.executable,
        "-m",
        "lightning_mmpar.recipes.clip_llama",
        "fit",
        "--config",
        CPU_YAML,
        "--config",
        str(overrides),
        "--ckpt_path",
        "auto",
    ]


_STARTED: list[subprocess.Popen[bytes]] = []


@pytest.fixture(autouse=True)
def _no_orphans() -> Any:
    """Kill every process group a test started, pass or fail: Lightning's launcher is rank 0
    and ranks 1-3 are its children, so killing the launcher alone would leave them waiting in
    a collective and starve the rest of the suite of CPU and memory."""
    yield
    while _STARTED:
        proc = _STARTED.pop()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()


def _start(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: the launcher and the ranks it starts
    )
    _STARTED.append(proc)
    return proc


def _finish(proc: subprocess.Popen[bytes], log: Path) -> str:
    try:
        rc = proc.wait(timeout=WAIT)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    text = log.read_text(errors="replace")
    assert rc == 0, text[-4000:]
    return text


def _wait_for_checkpoint(root: Path, procs: list[subprocess.Popen[bytes]], log: Path) -> None:
    deadline = time.monotonic() + WAIT
    while not complete_checkpoints(root):
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            for p in procs:
                p.kill()
            raise AssertionError("no checkpoint appeared:\n" + log.read_text()[-4000:])
        time.sleep(0.05)


def _final_state(root: Path, tmp: Path) -> tuple[dict[str, Any], int]:
    path = newest_checkpoint(root)
    assert path is not None, root
    out = tmp / f"{root.name}.pt"
    dcp_to_torch_save(path, out)
    meta = torch.load(path / "meta.pt", weights_only=False)
    return torch.load(out, weights_only=False), int(meta["global_step"])


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}
    return {prefix: tree}


def test_sigterm_saves_and_the_same_command_resumes_exactly(tmp_path: Path) -> None:
    run, ref = tmp_path / "run", tmp_path / "ref"
    env = _env(MASTER_PORT=str(free_port()))
    log = tmp_path / "preempted.log"
    proc = _start(_command(tmp_path, run), log, env)
    _wait_for_checkpoint(run, [proc], log)
    proc.send_signal(signal.SIGTERM)  # rank 0 only: the others learn it from the all-reduce
    text = _finish(proc, log)
    assert "Pre-emption (SIGTERM)" in text, text[-4000:]
    saved = newest_checkpoint(run)
    assert saved is not None and saved.name == "last.ckpt"
    stopped = int(torch.load(saved / "meta.pt", weights_only=False)["global_step"])
    assert EVERY < stopped < STEPS, stopped  # after the periodic save, before the end

    env["MASTER_PORT"] = str(free_port())
    resumed = tmp_path / "resumed.log"
    text = _finish(_start(_command(tmp_path, run), resumed, env), resumed)
    assert f"resuming from {saved} (global step {stopped})" in text, text[-4000:]
    # the uninterrupted reference: the same command, its 4 ranks in a spawned world (the CLI in
    # each rank's process: no launcher and interpreters to start; the numerics are the same)
    spawn(cli_worker.world, 4, {"ref": _command(tmp_path, ref)[3:]}, timeout=WAIT)

    (got, got_step), (want, want_step) = _final_state(run, tmp_path), _final_state(ref, tmp_path)
    assert got_step == want_step == STEPS
    got_flat, want_flat = _flat(got), _flat(want)
    assert got_flat.keys() == want_flat.keys()
    tensors = [k for k, v in want_flat.items() if isinstance(v, torch.Tensor)]
    assert len([k for k in tensors if k.startswith("state_dict.")]) > 10, tensors[:5]
    assert any(".exp_avg" in k for k in tensors), tensors[:5]  # the optimizer state too
    different = [k for k in tensors if not torch.equal(got_flat[k], want_flat[k])]
    assert not different, different[:5]
    _check_logged(run, resumed)


def _check_logged(root: Path, log: Path) -> None:
    """Lightning's default logger (TensorBoard) got throughput, MFU and every rank's peak memory,
    and nobody warned about loggers."""
    assert (
        "logger"
        not in "".join(ln for ln in log.read_text().splitlines() if "Warning" in ln).lower()
    )
    newest = max(root.rglob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime)
    events = EventAccumulator(str(newest.parent))  # the resumed run's
    events.Reload()
    tags = set(events.Tags()["scalars"])
    ranks = {f"memory/peak_gib_rank{r}" for r in range(4)}
    rates = {f"train/device/{k}" for k in ("mfu", "samples_per_sec", "items_per_sec")}
    assert rates | ranks <= tags, tags  # dp 1: one replica, so Lightning logs device/ names only
    mfu = events.Scalars("train/device/mfu")[-1].value
    flops = events.Scalars("train/device/flops_per_sec")[-1].value
    assert 0 < mfu < 1 and mfu == pytest.approx(flops / (4 * PEAK), rel=1e-5)  # replica: 4 ranks
    assert all(events.Scalars(tag)[-1].value > 0.05 for tag in ranks)  # GiB


def test_sigkill_of_one_rank_prints_one_block_and_ends_the_job(tmp_path: Path) -> None:
    """``kill -9`` of rank 1 of a 2-process run under Lightning's launcher (rank 0 launched
    rank 1): the job ends within seconds, not at the process-group timeout, and the console
    holds one block naming rank 1, its host, the signal, the last checkpoint and the resume
    command; the gloo tracebacks are in the log files it names, not on the console."""
    root = tmp_path / "killed"
    # a long process-group timeout: rank 1 starts after rank 0's imports (slow on a loaded
    # machine), and the job must end at once after the kill, not at the timeout
    cmd = _command(
        tmp_path, root, devices=2, tensor_parallel=2, pipeline_parallel=1, timeout="0:03:00"
    )
    log = tmp_path / "console.log"
    proc = _start(cmd, log, _env(MASTER_PORT=str(free_port())))
    _wait_for_checkpoint(root, [proc], log)
    children = psutil.Process(proc.pid).children()
    assert len(children) == 1, children  # rank 1, launched by rank 0
    children[0].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    rc = proc.wait(timeout=60)
    elapsed = time.monotonic() - killed_at
    text = log.read_text(errors="replace")
    assert rc != 0 and elapsed < 30, (rc, elapsed, text[-4000:])
    host = socket.gethostname()
    blocks = re.findall(r"lightning_mmpar: rank (\d+) \(host (\S+), pid (\d+)\) (.*)\.", text)
    assert blocks == [("1", host, str(children[0].pid), "was killed by SIGKILL")], text[-4000:]
    saved = newest_checkpoint(root)
    assert saved is not None and f"last complete checkpoint: {saved} (global step" in text
    assert "resume: python -m lightning_mmpar.recipes.clip_llama fit --config" in text, text
    assert text.count("--ckpt_path auto") == 1, text[-4000:]
    assert "Traceback" not in text, text[-4000:]
    assert "gloo/transport" not in text, text[-4000:]  # no raw gloo message either
    rank0 = root / "faults" / "rank_0.log"
    assert f"tracebacks of every rank: {root / 'faults'}/rank_<r>.log" in text, text[-4000:]
    assert "Traceback" in rank0.read_text() and "gloo" in rank0.read_text()
    print(f"rank 0 exited with code {rc} {elapsed:.1f} s after rank 1 was killed")
