"""``ckpt_path: auto``: resume from the newest complete checkpoint of this run, if any.

The recipe CLI replaces ``auto`` by :func:`auto_ckpt_path` before anything is launched, so the
same command starts a run and, relaunched after a pre-emption or a crash, resumes it (every
process resolves it alike: the files do not change before the processes start). Searched: each
ModelCheckpoint's ``dirpath`` when set and ``trainer.default_root_dir`` (recursively, so the
logger's ``version_<n>/checkpoints`` folders of earlier launches count);
:func:`~lightning_mmpar.parallel.checkpoint.newest_checkpoint` says what counts as complete
and newest. Lightning's own ``ckpt_path: last`` looks only in the current logger version's
folder, which a relaunch changes unless ModelCheckpoint's ``dirpath`` is fixed.
"""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info

from lightning_mmpar.parallel.checkpoint import AUTO, complete_checkpoints

__all__ = ["AUTO", "auto_ckpt_path", "newest_run_checkpoint"]


def _roots(trainer: Trainer) -> list[str]:
    dirs = [c.dirpath for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)]
    return [*(str(d) for d in dirs if d), str(trainer.default_root_dir)]


def newest_run_checkpoint(trainer: Trainer) -> tuple[int, Path] | None:
    """``(global step, path)`` of the newest complete checkpoint under the run's checkpoint
    folders (module docstring), ``None`` when there is none."""
    found = sorted({x for r in _roots(trainer) for x in complete_checkpoints(Path(r))})
    return (found[-1][0], found[-1][2]) if found else None


def auto_ckpt_path(trainer: Trainer) -> str | None:
    """The newest complete checkpoint under the run's checkpoint folders (module docstring);
    ``None`` (start from scratch, said in the log) when there is none."""
    newest = newest_run_checkpoint(trainer)
    if newest is None:
        roots = _roots(trainer)
        rank_zero_info(f"ckpt_path=auto: no complete checkpoint under {roots}; starting afresh.")
        return None
    step, path = newest
    rank_zero_info(f"ckpt_path=auto: resuming from {path} (global step {step}).")
    return str(path)
