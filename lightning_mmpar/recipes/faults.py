"""A dead or hung rank: one block on the console, the collective tracebacks in log files.

When a rank dies (``kill -9``, the kernel's OOM killer, a crashed node) or hangs, every other
rank fails in its next collective with a gloo / NCCL error, and each printed its traceback
(hundreds of lines, none naming the rank that died). The recipe CLI instead:

* at set-up (:class:`RankFaults`, a callback the CLI adds): every rank puts ``host pid`` into
  the process group's store and reads every other rank's (one ``set`` and ``world_size`` ``get``
  calls once per fit);
* on a collective failure (:func:`is_collective_failure`) in any rank: the traceback goes to
  ``<default_root_dir>/faults/rank_<r>.log``; the ranks that are gone are found (a child process
  of this one: its exit status from ``Popen``, as Lightning's launcher holds the other local
  ranks, the signal named as torch elastic names it: :class:`~torch.distributed.elastic.
  multiprocessing.errors.ProcessFailure`; another process on this host: no longer running; a
  rank on another host: it did not answer within :data:`ANSWER_S` seconds); one surviving rank
  (rank 0 when it launched the others, else the first to claim the report in the store; when
  the store is gone with rank 0, the lowest local rank alive) prints one block
  (:func:`fault_block`): which rank, host, pid and how it ended or that the collective timed
  out, the newest complete checkpoint, the command that resumes from it and where the
  tracebacks are. The job exits with status 1.

Lightning's launcher (``_SubprocessScriptLauncher``) watches its child ranks from a thread
every 5 s and SIGKILLs all of them, itself included, when one fails; that thread is made to
print the block first (:func:`_observe_with_report`), so a kill of a child rank is reported
whichever comes first, the launcher's poll or the launcher rank's own collective error.
Under torchrun, the elastic agent prints its own summary (rank, host, exit code and signal of
the failed rank: torch's ``ChildFailedError``) after this block.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from typing_extensions import override

from lightning_mmpar.recipes.resume import newest_run_checkpoint

__all__ = [
    "ANSWER_S",
    "RankFaults",
    "fault_block",
    "is_collective_failure",
    "report_failure",
    "resume_command",
    "watch",
]

ANSWER_S = 3.0
"""Seconds a reporting rank waits for the other survivors to say they are alive."""
_KEY = "lightning_mmpar/faults"
_COLLECTIVE = re.compile(
    r"gloo|nccl|ProcessGroup|Connection (reset|closed) by peer|Broken pipe|Socket Timeout",
    re.IGNORECASE,
)


@dataclass
class _Run:
    """What a failing rank needs: filled by :class:`RankFaults` at set-up."""

    trainer: pl.Trainer | None = None
    rank: int = 0
    world_size: int = 1
    table: dict[int, tuple[str, int]] = field(default_factory=dict)
    store: Any = None
    reported: threading.Lock = field(default_factory=threading.Lock)
    done: threading.Event = field(default_factory=threading.Event)


_RUN = _Run()


def is_collective_failure(err: BaseException) -> bool:
    """Whether ``err`` (or an exception it was raised from) is a failed collective: torch's
    ``DistError`` family (store and NCCL watchdog timeouts included), or a ``RuntimeError``
    naming gloo / NCCL / a process group, or a connection closed or reset by the peer."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, dist.DistError):
            return True
        if isinstance(seen, RuntimeError) and _COLLECTIVE.search(str(seen)):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def resume_command(argv: list[str], env: Mapping[str, str] | None = None) -> str:
    """The command that resumes this run: the recipe with ``argv`` (``sys.argv[1:]``) and
    ``--ckpt_path auto`` (replacing any ``--ckpt_path``), under torchrun when it launched this
    process (``TORCHELASTIC_RUN_ID``: repeat its options)."""
    environ = os.environ if env is None else env
    args: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--ckpt_path":
            skip = True
            continue
        if not arg.startswith("--ckpt_path="):
            args.append(arg)
    prefix = "python -m"
    if "TORCHELASTIC_RUN_ID" in environ:
        prefix = "torchrun <the same torchrun options> -m"
    return f"{prefix} lightning_mmpar.recipes.clip_llama {shlex.join(args)} --ckpt_path auto"


def fault_block(
    dead: dict[int, str],
    table: dict[int, tuple[str, int]],
    *,
    rank: int,
    step: int | None,
    error: str,
    checkpoint: tuple[int, Path] | None,
    command: str,
    log_dir: Path,
    raised: Mapping[int, str] | None = None,
) -> str:
    """The block a surviving rank prints: ``dead`` maps a rank to how it ended ("killed by
    SIGKILL", "exited with code 1", "no longer running", ...; empty: every rank answered, so a
    collective timed out or a rank hangs), ``table`` a rank to its ``(host, pid)``, ``raised``
    a dead rank to the error it raised (``"FileNotFoundError: ..."``: written by
    :class:`RankFaults` before it exited), which resuming alone would raise again."""
    raised = {r: e for r, e in (raised or {}).items() if r in dead}
    lines = ["", "=" * 78]
    for r, how in sorted(dead.items()):
        host, pid = table.get(r, ("?", -1))
        lines.append(f"lightning_mmpar: rank {r} (host {host}, pid {pid}) {how}.")
        if r in raised:
            lines.append(f"  rank {r} raised {raised[r]}")
    if not table:
        lines.append(
            "lightning_mmpar: the process group failed while it was being set up (a rank did "
            "not start or join within the process-group timeout, trainer.strategy.init_args."
            "timeout, or died before)."
        )
    elif not dead:
        lines.append(
            "lightning_mmpar: a collective failed but every rank answered: a rank is hung or "
            "a collective timed out (the process-group timeout, trainer.strategy.init_args."
            "timeout)."
        )
    where = f"at global step {step}" if step is not None else "during set-up"
    lines.append(f"  rank {rank} stopped {where}: {error}")
    if checkpoint is None:
        lines.append("  last complete checkpoint: none (the run starts afresh when resumed)")
    else:
        lines.append(f"  last complete checkpoint: {checkpoint[1]} (global step {checkpoint[0]})")
    if raised:
        ranks = ", ".join(str(r) for r in sorted(raised))
        lines.append(f"  resume, once what rank {ranks} raised is fixed: {command}")
    else:
        lines.append(f"  resume: {command}")
    lines.append(f"  tracebacks of every rank: {log_dir}/rank_<r>.log")
    lines.append("=" * 78)
    return "\n".join(lines)


def watch(trainer: pl.Trainer) -> RankFaults:
    """Report this ``trainer``'s failures (its ``default_root_dir`` holds the logs, its
    checkpoint folders the checkpoint named); returns the callback to add to it."""
    _RUN.trainer = trainer
    return RankFaults()


class RankFaults(Callback):
    """Records every rank's host and pid at set-up (module docstring); added by the recipe CLI
    to every fit (:func:`watch`). Without a process group it does nothing."""

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        _RUN.trainer = trainer
        if not dist.is_initialized():
            return
        _RUN.rank, _RUN.world_size = dist.get_rank(), dist.get_world_size()
        store = dist.distributed_c10d._get_default_store()
        store.set(f"{_KEY}/rank/{_RUN.rank}", f"{socket.gethostname()} {os.getpid()}")
        for r in range(_RUN.world_size):
            host, pid = store.get(f"{_KEY}/rank/{r}").decode().rsplit(" ", 1)
            _RUN.table[r] = (host, int(pid))
        _RUN.store = store
        _error_file(_RUN.rank).unlink(missing_ok=True)  # a previous run's
        _observe_with_report(getattr(trainer.strategy, "launcher", None))

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """An error of this rank's own (not a failed collective: a missing file, a bad
        batch, ...): its line to ``faults/rank_<r>.error`` and its traceback to
        ``faults/rank_<r>.log``, so the rank that reports the job's end names it."""
        if not dist.is_initialized() or is_collective_failure(exception):
            return
        _log_traceback(exception)
        _error_file(_RUN.rank).write_text(_one_line(exception) + "\n")


def _observe_with_report(launcher: Any) -> None:
    """Make Lightning's child-process observer thread print the block before it kills the job."""
    procs = getattr(launcher, "procs", None)
    if not procs:
        return
    for thread in threading.enumerate():
        run = getattr(thread, "_run", None)
        if thread.name == "child-process-observer" and run is not None:

            def checked(run: Any = run) -> bool:
                if any(p.poll() not in (None, 0) for p in procs):
                    _report("its launcher saw a local rank exit")
                return bool(run())

            thread._run = checked  # type: ignore[attr-defined]


def _children() -> dict[int, Any]:
    """Local ranks this process launched (Lightning's launcher), by global rank."""
    trainer = _RUN.trainer
    procs = getattr(getattr(trainer, "strategy", None), "launcher", None)
    procs = getattr(procs, "procs", None) or []
    pids = {pid: r for r, (_, pid) in _RUN.table.items()}
    return {pids[p.pid]: p for p in procs if p.pid in pids}


def _how_ended(rank: int, children: dict[int, Any]) -> str | None:
    """How ``rank`` ended, as far as this process can tell; ``None``: it looks alive."""
    host, pid = _RUN.table.get(rank, ("", -1))
    if rank in children:
        code = children[rank].poll()
        if code is None:
            return None
        if code < 0:
            failure = ProcessFailure(local_rank=rank, pid=pid, exitcode=code, error_file="")
            return f"was killed by {failure.signal_name()}"
        return f"exited with code {code}"
    if host == socket.gethostname() and pid > 0:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "is no longer running (its exit status is its launcher's: srun, torchrun)"
        except PermissionError:
            return None
    return None


def _dead_ranks(store_ok: bool) -> dict[int, str]:
    children = _children()
    dead = {}
    for r in range(_RUN.world_size):
        if r == _RUN.rank:
            continue
        how = _how_ended(r, children)
        if how is not None:
            dead[r] = how
    if dead or not store_ok:
        return dead
    deadline = time.monotonic() + ANSWER_S
    others = [f"{_KEY}/alive/{r}" for r in range(_RUN.world_size) if r != _RUN.rank]
    while time.monotonic() < deadline and not _RUN.store.check(others):
        time.sleep(0.1)
    for r in range(_RUN.world_size):
        if r != _RUN.rank and not _RUN.store.check([f"{_KEY}/alive/{r}"]):
            dead[r] = f"did not answer within {ANSWER_S:g} s (dead, or blocked)"
    return dead


def _claim() -> tuple[bool, bool]:
    """``(this rank reports, the store answers)``: rank 0 when it launched this rank (Lightning's
    launcher), else the first rank to claim the report in the store; without the store (it
    lived in rank 0's process), the lowest local rank still running."""
    store = _RUN.store
    if store is None:  # failed while the process group was set up: global rank 0 reports
        return _launched_as_rank_0(), False
    try:
        store.set_timeout(timedelta(seconds=ANSWER_S))
        store.set(f"{_KEY}/alive/{_RUN.rank}", "1")
        if _RUN.rank != 0 and os.getppid() == _RUN.table.get(0, ("", -1))[1]:
            return False, True  # rank 0 launched this rank: it knows how its children ended
        return store.add(f"{_KEY}/reporter", 1) == 1, True
    except Exception:  # the store's process is gone (rank 0): any error means that
        alive = [r for r in _RUN.table if _how_ended(r, {}) is None or r == _RUN.rank]
        return _RUN.rank == min(alive, default=_RUN.rank), False


def _launched_as_rank_0() -> bool:
    """Whether this process's launcher made it global rank 0 (torchrun's ``RANK``, SLURM's
    ``SLURM_PROCID``, else Lightning's ``NODE_RANK`` and ``LOCAL_RANK``; none set: yes)."""
    for name in ("RANK", "SLURM_PROCID"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name]) == 0
    return all(os.environ.get(n, "0") in ("", "0") for n in ("NODE_RANK", "LOCAL_RANK"))


def _report(error: str) -> None:
    """Print the block once per job (module docstring); a second caller in this process waits
    until the first is done (Lightning's observer thread kills the process right after)."""
    if not _RUN.reported.acquire(blocking=False):
        _RUN.done.wait(timeout=2 * ANSWER_S + 10)
        return
    try:
        _report_once(error)
    finally:
        _RUN.done.set()


def _report_once(error: str) -> None:
    mine, store_ok = _claim()
    if not mine:
        return
    trainer = _RUN.trainer
    dead = _dead_ranks(store_ok)
    if not store_ok and not dead and _RUN.table and _RUN.rank != 0:
        dead = {0: "is unreachable (its process held the store of the process group)"}
    block = fault_block(
        dead,
        _RUN.table,
        rank=_RUN.rank,
        step=None if trainer is None else trainer.global_step,
        error=error,
        checkpoint=_checkpoint(trainer),
        command=resume_command(sys.argv[1:]),
        log_dir=_log_dir(trainer),
        raised=_raised(dead),
    )
    print(block, file=sys.stderr, flush=True)


def _checkpoint(trainer: pl.Trainer | None) -> tuple[int, Path] | None:
    return None if trainer is None else newest_run_checkpoint(trainer)


def _log_dir(trainer: pl.Trainer | None) -> Path:
    root = Path(trainer.default_root_dir) if trainer is not None else Path.cwd()
    return root / "faults"


def _error_file(rank: int) -> Path:
    """Where ``rank`` writes the error it raised (:meth:`RankFaults.on_exception`)."""
    return _log_dir(_RUN.trainer) / f"rank_{rank}.error"


def _raised(dead: Mapping[int, str]) -> dict[int, str]:
    """The errors the ``dead`` ranks wrote before they exited (a rank on a host without the
    shared ``default_root_dir`` wrote none here)."""
    files = {r: _error_file(r) for r in dead}
    return {r: f.read_text().strip() for r, f in files.items() if f.is_file()}


def _one_line(err: BaseException) -> str:
    """``"<Type>: <first line of the message>"``, at most 160 characters of message."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    first = re.sub(r"^\[[^\]]*:\d+\]\s*", "", first)  # gloo's "[.../pair.cc:561] " prefix
    return f"{type(err).__name__}: {first[:160]}"


def _log_traceback(err: BaseException) -> None:
    """Append ``err``'s traceback to ``<default_root_dir>/faults/rank_<r>.log``."""
    log_dir = _log_dir(_RUN.trainer)
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"rank_{_RUN.rank}.log"
    with log.open("a") as f:
        f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} rank {_RUN.rank} pid {os.getpid()}\n")
        f.write("".join(traceback.format_exception(err)))


def report_failure(err: BaseException) -> int:
    """Handle a collective failure in this rank (module docstring): the traceback to
    ``<default_root_dir>/faults/rank_<r>.log``, the block on one surviving rank's stderr.
    Returns the exit status (1)."""
    _log_traceback(err)
    _report(_one_line(err))
    return 1
