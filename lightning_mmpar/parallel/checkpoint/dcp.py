"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): save, check, load.

A checkpoint is a directory: DCP shards of the model and optimizer state, keyed by the
parameters' fully qualified names (pipeline stages keep their original names), plus
``meta.pt`` with Lightning's loop and callback state (rank 0's) and ``ranks/rank_<r:05d>.pt`` with
each rank's own callback and loop state and its layout (:mod:`.rank_state`). Because DCP
reshards on load, a checkpoint saved in one layout (tp2 pp2) loads into another (tp1 pp1) and
back. Writing is atomic (:mod:`.atomic`); the checks that name a bad file or a differing
setting are in :mod:`.check`. Sources: PyTorch's DCP and ``get_model_state_dict`` /
``get_optimizer_state_dict`` APIs, as torchtitan's checkpointer uses them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from lightning_mmpar.parallel.checkpoint.atomic import resolve
from lightning_mmpar.parallel.checkpoint.check import (
    HPARAMS_KEY,
    METADATA_FILE,
    CheckedCheckpoint,
    check_state_keys,
    damaged_files,
    hparams_diff,
    inspect_checkpoint,
    root_error,
)
from lightning_mmpar.parallel.checkpoint.rank_state import write_rank_state

__all__ = ["OPTIM_OPTIONS", "load_sharded", "save_sharded", "validate_checkpoint"]

# Flat keys ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr") let every pipeline rank save and
# load its own parameters' optimizer state and hyper-parameters, in any layout.
OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def save_sharded(
    path: Path,
    model: nn.Module,
    optimizers: Sequence[Optimizer],
    metadata: dict[str, Any],
    is_rank_zero: bool,
    rank_state: dict[str, Any] | None = None,
) -> None:
    """Write model + optimizer shards with DCP and ``metadata`` (rank 0) into ``path``.

    ``rank_state`` (every rank, optional): ``{"layout": {world_size, tp, pp, ep,
    virtual_pipeline, rank}, "callbacks": ..., "loops": ...}``, written to
    :func:`~lightning_mmpar.parallel.checkpoint.rank_file` for
    :func:`~lightning_mmpar.parallel.checkpoint.restore_rank_state`.
    """
    state: dict[str, Any] = {"state_dict": get_model_state_dict(model)}
    for i, opt in enumerate(optimizers):
        state[f"optimizer_{i}"] = get_optimizer_state_dict(model, opt, options=OPTIM_OPTIONS)
    dcp.save(state, checkpoint_id=path)
    if rank_state is not None:
        write_rank_state(path, rank_state)
    if is_rank_zero:
        torch.save(metadata, path / METADATA_FILE)


def validate_checkpoint(
    path: str | Path, hparams: Mapping[str, Any] | None = None, *, ignore: Sequence[str] = ()
) -> Path:
    """Check that ``path`` is a complete mm_parallel checkpoint; return the loadable path.

    Cheap (file sizes and the small ``.metadata`` / ``meta.pt``, no tensor reads) and needs no
    process group. ``path`` is resolved like
    :func:`~lightning_mmpar.parallel.checkpoint.resolve` (``<path>.previous`` after a save cut
    short between its two renames).

    Args:
        path: the checkpoint directory.
        hparams: the LightningModule's ``hparams`` for this run; when given and ``meta.pt`` holds
            ``hyper_parameters``, every differing field (nested dataclasses and dicts as dotted
            names) is an error.
        ignore: dotted-name prefixes left out of that comparison (e.g. ``("optim",)`` to resume
            with another learning rate); keys starting with ``_`` (Lightning's
            ``_class_path``, ``_instantiator``) are always left out.

    Raises:
        FileNotFoundError: ``path``, ``.metadata``, ``meta.pt`` or a shard file is missing.
        ValueError: ``path`` is a single file (a Lightning / ``torch.save`` checkpoint) or a
            folder of checkpoints (the candidates are named), ``.metadata`` or ``meta.pt`` is
            unreadable, a shard is shorter than its items' ``offset + length`` (truncated), or
            the hyper-parameters differ (``name: checkpoint X, this run Y``).
    """
    checked = inspect_checkpoint(resolve(Path(path)))
    diff = hparams_diff(checked.meta.get(HPARAMS_KEY), hparams, ignore)
    if diff:
        raise ValueError(
            f"checkpoint {str(checked.path)!r} was written with other hyper-parameters than this "
            f"run: {'; '.join(diff)}. Set these values as in the checkpoint to resume from it "
            "(or start without ckpt_path)."
        )
    return checked.path


def load_sharded(
    path: Path, model: nn.Module, optimizers: Sequence[Optimizer], strict: bool = True
) -> dict[str, Any]:
    """Load shards into ``model`` and ``optimizers`` in the current layout; return the metadata.

    Only the keys the current layout holds are read, so any saved layout loads into any other.
    First the checks of :func:`validate_checkpoint` (without failing on hyper-parameters alone),
    then the keys and global shapes of the model's and optimizers' state against DCP's metadata.

    Raises:
        FileNotFoundError, ValueError: as :func:`validate_checkpoint`; a ``ValueError`` listing
            missing keys and shape mismatches (a few each, with counts) and the hyper-parameter
            differences (``model.hparams`` against ``meta.pt``'s); a ``ValueError`` naming the
            damaged shard file(s) when a read fails (e.g. a zero-filled shard).
    """
    checked = inspect_checkpoint(path)
    model_state = {"state_dict": get_model_state_dict(model)}
    optim_states = {
        f"optimizer_{i}": get_optimizer_state_dict(model, opt, options=OPTIM_OPTIONS)
        for i, opt in enumerate(optimizers)
    }
    problems = check_state_keys(checked.dcp, model_state, "model")
    if not problems:  # the optimizers' keys follow the model's: check them once it matches
        problems = check_state_keys(checked.dcp, optim_states, "optimizer")
    if problems:
        diff = hparams_diff(checked.meta.get(HPARAMS_KEY), getattr(model, "hparams", None))
        because = f" Hyper-parameters that differ: {'; '.join(diff)}." if diff else ""
        raise ValueError(
            f"checkpoint {str(path)!r} does not fit this model: {'; '.join(problems)}.{because} "
            "Build the model as in the checkpoint (same layers, widths, vocabulary, frozen "
            "parts) or pass a checkpoint of this model."
        )
    _read(checked, model_state)
    set_model_state_dict(model, model_state["state_dict"], options=StateDictOptions(strict=strict))
    for i, opt in enumerate(optimizers):
        key = f"optimizer_{i}"
        optim_state = {key: optim_states[key]}
        _read(checked, optim_state)
        set_optimizer_state_dict(
            model, opt, optim_state_dict=optim_state[key], options=OPTIM_OPTIONS
        )
    return checked.meta


def _read(checked: CheckedCheckpoint, state: dict[str, Any]) -> None:
    """``dcp.load`` whose read errors name the damaged shard files (found only on failure)."""
    try:
        dcp.load(state, checkpoint_id=checked.path)
    except (Exception, CheckpointException) as e:  # DCP's is a BaseException
        bad = damaged_files(checked.path, checked.dcp)
        if bad:
            files = ", ".join(
                f"{str(checked.path / name)!r} ({len(keys)} item(s), e.g. {keys[0]})"
                for name, keys in bad.items()
            )
            raise ValueError(
                f"checkpoint {str(checked.path)!r} is damaged: shard file(s) {files} do not hold "
                "intact data where .metadata says. Copy the checkpoint again from its source or "
                "pass another checkpoint."
            ) from None
        raise ValueError(
            f"reading checkpoint {str(checked.path)!r} failed: {root_error(e)} (every item of "
            "its shard files is intact)."
        ) from None
