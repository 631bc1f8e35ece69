"""mm_parallel launched three ways: Lightning's subprocess launcher, torchrun, SLURM (srun env).

Each run trains the toy LM for 3 steps with tp=2 or pp=2 on 2 CPU processes; the losses must
equal the single-process reference and the Trainer must have picked the expected cluster
environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_mmpar.testing import free_port
from tests.distributed.parallel import parity_worker as pw

pytestmark = pytest.mark.distributed
SCRIPT = str(Path(__file__).parent / "launch_script.py")
ROOT = Path(__file__).resolve().parents[2]


def _clean_env() -> dict[str, str]:
    drop = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", *drop))}
    env["OMP_NUM_THREADS"] = "1"
    path = env.get("PYTHONPATH")  # the script imports tests.distributed.parallel.parity_worker
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), path] if path else [str(ROOT)])
    return env


def _result(outputs: list[str]) -> dict[str, object]:
    lines = [ln for out in outputs for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert len(lines) == 1, outputs
    return json.loads(lines[0][len("RESULT ") :])


def _check(result: dict[str, object], env: str) -> None:
    assert result["env"] == env
    expected = pw.reference(steps=3)["losses"]
    losses = result["losses"]
    assert isinstance(losses, list) and len(losses) == 3
    for got, want in zip(losses, expected, strict=True):
        assert abs(got - want) / want < 1e-5, (losses, expected)


def _run(cmd: list[str], env: dict[str, str]) -> str:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_lightning_subprocess_launcher() -> None:
    env = _clean_env()
    env["MASTER_PORT"] = str(free_port())
    _check(_result([_run([sys.executable, SCRIPT, "tp2"], env)]), "LightningEnvironment")


def test_torchrun() -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        SCRIPT,
        "pp2",
    ]
    _check(_result([_run(cmd, _clean_env())]), "TorchElasticEnvironment")


def test_slurm_environment() -> None:
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = _clean_env() | {
            "SLURM_NTASKS": "2",
            "SLURM_NTASKS_PER_NODE": "2",
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank),
            "SLURM_NODEID": "0",
            "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NAME": "mmpar",
            "SLURM_NODELIST": "127.0.0.1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, SCRIPT, "tp2"],
                env=env,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        )
    outputs = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, out[-3000:] + err[-3000:]
        outputs.append(out)
    _check(_result(outputs), "SLURMEnvironment")
