"""Save and stop cleanly on a pre-emption signal (SLURM's SIGTERM / ``--signal=USR1@<s>``).

Every rank installs handlers for ``signals`` when training starts; a handler only sets a flag
(no collective, no I/O inside a signal handler). At the end of every ``check_every_n_steps``-th
training batch all ranks agree with one all-reduce (``max`` of the flags over the default
group), so a signal that reached any one rank (SLURM signals every task, Lightning's launcher
only the process it runs in) stops all of them at the same step: they save one checkpoint with
``trainer.save_checkpoint`` (a sharded, atomically committed DCP checkpoint under
``mm_parallel``), set ``trainer.should_stop`` and ``fit`` returns normally, so the job exits
with code 0. Relaunching the same command with ``ckpt_path: last`` (or ``auto`` through the
recipe CLI, :func:`lightning_mmpar.parallel.checkpoint.newest_checkpoint`) resumes
exactly from that step, including the data loader's position.

The checkpoint goes to ``<dirpath>/last.ckpt``: ``dirpath`` defaults to the first
:class:`~lightning.pytorch.callbacks.ModelCheckpoint`'s directory, else
``<default_root_dir>/checkpoints``. Those ModelCheckpoints are told that this step is saved
(``_last_global_step_saved``), so they do not write it again while the run winds down.

Replaces Lightning's own SIGTERM handling for the duration of training: Lightning 2.6 raises
``SIGTERMException`` (exit without a checkpoint) and broadcasts from inside its handler; on
SIGUSR1 under SLURM with ``auto_requeue`` it saves an ``hpc_ckpt`` and runs ``scontrol
requeue`` on rank 0 only. Here ``requeue=True`` does the same after the checkpoint is written:
global rank 0 runs ``scontrol requeue <job>`` (``SLURM_ARRAY_JOB_ID_SLURM_ARRAY_TASK_ID`` for an
array task, else ``SLURM_JOB_ID``), and the requeued job relaunches the same command
(``ckpt_path: auto`` resumes); by default nothing is requeued (resubmit from the job script,
e.g. ``sbatch --requeue`` with ``--signal=B:USR1@120`` and a ``trap``).
Handlers are restored when training ends. A signal that arrives during validation takes effect
at the next training batch end. Model: PyTorch Lightning's requeue logic and torchtitan's
``checkpoint.interval`` + signal-driven save.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from typing_extensions import override

from lightning_mmpar.callbacks.cadence import OptimizerStepCadence
from lightning_mmpar.parallel import comm

__all__ = ["Preemption"]

log = logging.getLogger(__name__)

_SIGNALS = {
    "SIGTERM": signal.SIGTERM,
    "SIGUSR1": signal.SIGUSR1,
    "SIGUSR2": signal.SIGUSR2,
    "SIGINT": signal.SIGINT,
    "SIGHUP": signal.SIGHUP,
}


class Preemption(Callback):
    """On any rank's pre-emption signal: all ranks save ``last.ckpt`` at one step and stop.

    Args:
        signals: names of the signals that mean "pre-empted" (``SIGTERM``, ``SIGUSR1``,
            ``SIGUSR2``, ``SIGINT``, ``SIGHUP``).
        dirpath: where ``last.ckpt`` goes; default: the first ModelCheckpoint's directory, else
            ``<default_root_dir>/checkpoints``.
        check_every_n_steps: agree every this many optimizer steps, at the end of the batch that
            stepped (one all-reduce of one element each time; the save happens at the first
            agreed step after a signal, never in the middle of gradient accumulation).
        requeue: after saving, global rank 0 requeues the SLURM job with ``scontrol requeue``
            (module docstring); needs a SLURM job (``SLURM_JOB_ID``) and ``scontrol`` on the
            ``PATH`` when training starts.

    Attributes:
        saved_path: the checkpoint written on pre-emption (``None`` if none was).
        stopped_at: the global step it was written at (``-1`` if none).

    Raises:
        ValueError: an unknown signal name or ``check_every_n_steps < 1``; with ``requeue``,
            at ``on_train_start``: no ``SLURM_JOB_ID`` or no ``scontrol`` (nothing to requeue).
        RuntimeError: ``scontrol requeue`` failed (its exit code and output; the checkpoint is
            saved by then).
    """

    def __init__(
        self,
        signals: Sequence[str] = ("SIGTERM", "SIGUSR1"),
        dirpath: str | None = None,
        check_every_n_steps: int = 1,
        requeue: bool = False,
    ) -> None:
        unknown = [s for s in signals if s not in _SIGNALS]
        if unknown or not signals:
            raise ValueError(
                f"Preemption(signals={list(signals)!r}): unknown or no signal names {unknown}; "
                f"use some of {sorted(_SIGNALS)}."
            )
        if check_every_n_steps < 1:
            raise ValueError(
                f"Preemption(check_every_n_steps={check_every_n_steps}) must be >= 1 (1: agree "
                "after every training batch)."
            )
        self.signals = [_SIGNALS[s] for s in signals]
        self.dirpath = dirpath
        self.check_every_n_steps = check_every_n_steps
        self.requeue = requeue
        self.requeued: str | None = None
        """The SLURM job id requeued on pre-emption (rank 0; ``None`` if none was)."""
        self.received: signal.Signals | None = None
        self.saved_path: Path | None = None
        self.stopped_at = -1
        self._previous: dict[signal.Signals, Any] = {}
        self._cadence = OptimizerStepCadence()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(signum)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After Lightning registered its own handlers (just before the loop): ours replace them.
        self.received, self._cadence.last_step = None, trainer.global_step
        if self.requeue:
            slurm_job_id()  # refuse now, not at pre-emption time
        for sig in self.signals:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handle)

    def _restore_handlers(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore_handlers()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._restore_handlers()

    def agreed(self, trainer: pl.Trainer) -> bool:
        """Whether any rank received a signal: an all-reduce ``max`` of a ``[1]`` int32 flag over
        the default group (:func:`lightning_mmpar.parallel.comm.all_reduce`; none without one)."""
        flag = torch.tensor([int(self.received is not None)], dtype=torch.int32)
        return bool(comm.all_reduce(flag, "max").item())

    def checkpoint_path(self, trainer: pl.Trainer) -> Path:
        """``<dirpath>/last.ckpt`` (class docstring)."""
        dirpath: str | Path | None = self.dirpath
        if dirpath is None:
            checkpoints = trainer.checkpoint_callbacks
            dirs = [c.dirpath for c in checkpoints if isinstance(c, ModelCheckpoint)]
            dirpath = next((d for d in dirs if d), None)
        if dirpath is None:
            dirpath = str(Path(trainer.default_root_dir) / "checkpoints")
        return Path(dirpath) / f"{ModelCheckpoint.CHECKPOINT_NAME_LAST}.ckpt"

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        # Only right after an optimizer step (global_step just changed): never mid-accumulation.
        step = trainer.global_step
        if not self._cadence.due(step, self.check_every_n_steps):
            return
        if not self.agreed(trainer):
            return
        path = self.checkpoint_path(trainer)
        who = self.received.name if self.received is not None else "another rank's signal"
        if trainer.is_global_zero:
            log.warning(
                "Pre-emption (%s): saving %s at global step %d and stopping.",
                who,
                path,
                trainer.global_step,
            )
        trainer.save_checkpoint(path, weights_only=False)  # the full state, to resume
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint):
                callback._last_global_step_saved = trainer.global_step  # saved: no second copy
        self.saved_path, self.stopped_at = path, trainer.global_step
        trainer.should_stop = True
        if trainer.is_global_zero and self.requeue:
            self.requeued = requeue_slurm_job()
            log.warning("Pre-emption: saved %s; requeued SLURM job %s.", path, self.requeued)
        elif trainer.is_global_zero:
            log.warning(
                "Pre-emption: saved %s; relaunch with ckpt_path=last (or auto) to resume.", path
            )


def slurm_job_id() -> str:
    """The id ``scontrol requeue`` takes: ``<array job>_<task>`` for an array task, else
    ``SLURM_JOB_ID`` (Lightning's rule).

    Raises:
        ValueError: not in a SLURM job, or no ``scontrol`` on the ``PATH``.
    """
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    job = f"{array}_{task}" if array and task else os.environ.get("SLURM_JOB_ID")
    if not job:
        raise ValueError(
            "Preemption(requeue=True): SLURM_JOB_ID is not set, so there is no job to requeue; "
            "run under SLURM (sbatch --requeue) or set requeue=False."
        )
    if shutil.which("scontrol") is None:
        raise ValueError(
            "Preemption(requeue=True): no scontrol on the PATH to requeue SLURM job "
            f"{job}; put SLURM's binaries on the PATH or set requeue=False."
        )
    return job


def requeue_slurm_job() -> str:
    """Run ``scontrol requeue <job>`` (:func:`slurm_job_id`); return the job id.

    Raises:
        ValueError: as :func:`slurm_job_id`.
        RuntimeError: ``scontrol`` exited non-zero (its code and output).
    """
    job = slurm_job_id()
    result = subprocess.run(
        ["scontrol", "requeue", job], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"scontrol requeue {job} failed (exit {result.returncode}): "
            f"{(result.stdout + result.stderr).strip()[-2000:]}"
        )
    return job
