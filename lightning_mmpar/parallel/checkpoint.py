"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), written atomically.

A checkpoint is a directory: DCP shards of the model and optimizer state, keyed by the
parameters' fully qualified names (pipeline stages keep their original names), plus
``meta.pt`` with Lightning's loop and callback state (rank 0's) and ``ranks/rank_<r:05d>.pt`` with
each rank's own callback and loop state and its layout (:func:`restore_rank_state`). Because DCP
reshards on load, a checkpoint saved in one layout (tp2 pp2) loads into another (tp1 pp1) and
back.

Per-rank state: Lightning builds ``checkpoint["callbacks"]`` and ``checkpoint["loops"]`` on
every rank, and they differ by rank: a callback's statistics of its own pipeline stage or tensor
shard, the position of a dp replica's stateful DataLoader (torchdata's ``StatefulDataLoader``,
saved by Lightning in the fit loop's state). Restoring (:func:`restore_rank_state`):

* same layout (world size, tp, pp, ep, virtual stages): every rank gets its own state back;
* another layout, same data-parallel size: the loop state of a saved rank with the same dp
  coordinate (so the data resumes exactly), rank 0's callback state, with a warning;
* another data-parallel size, or a checkpoint without per-rank files: rank 0's state for both,
  with a warning (the epoch continues after as many batches per replica as were done, but the
  sharding differs, so the rest of that epoch is not the uninterrupted run's).

Atomicity: every rank writes into ``<path>.partial``; once all ranks are done, rank 0 moves the
previous ``<path>`` aside to ``<path>.previous``, renames ``.partial`` to ``<path>`` and deletes
``.previous``. Renames within one directory are atomic, so a crash at any moment leaves either
the new checkpoint at ``<path>``, or the previous one at ``<path>`` or ``<path>.previous``
(:func:`resolve` finds it); a crash while writing leaves the previous checkpoint untouched.
"""

from __future__ import annotations

import logging
import os
import shutil
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

from lightning_mmpar.parallel.checkpoint_check import (
    HPARAMS_KEY,
    METADATA_FILE,
    CheckedCheckpoint,
    check_state_keys,
    damaged_files,
    hparams_diff,
    inspect_checkpoint,
    root_error,
)
from lightning_mmpar.topology import ParallelDims

log = logging.getLogger(__name__)

# Flat keys ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr") let every pipeline rank save and
# load its own parameters' optimizer state and hyper-parameters, in any layout.
OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

RANKS_DIR = "ranks"
PER_RANK_KEYS = ("callbacks", "loops")
"""Keys of Lightning's checkpoint dict that every rank writes for itself."""
LAYOUT_KEYS = ("world_size", "tp", "pp", "ep", "virtual_pipeline")
"""Layout entries that must match for a rank to get its own state back."""
PARTIAL_SUFFIX = ".partial"
PREVIOUS_SUFFIX = ".previous"


def _sibling(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def remove(path: Path) -> None:
    """Delete a checkpoint file or directory if it exists."""
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def partial_path(path: Path) -> Path:
    """Where ranks write before the checkpoint is committed."""
    return _sibling(path, PARTIAL_SUFFIX)


def commit(path: Path) -> None:
    """Rank 0 only, after every rank finished writing ``partial_path(path)``: swap it in."""
    partial, previous = partial_path(path), _sibling(path, PREVIOUS_SUFFIX)
    remove(previous)
    if path.exists():
        os.replace(path, previous)
    os.replace(partial, path)
    remove(previous)


def resolve(path: Path) -> Path:
    """The loadable checkpoint for ``path``: itself, or the previous one if a commit was cut
    short between its two renames."""
    previous = _sibling(path, PREVIOUS_SUFFIX)
    if not path.exists() and previous.exists():
        log.warning(
            "checkpoint %s was being replaced when a save stopped; loading %s", path, previous
        )
        return previous
    if not path.exists():
        raise FileNotFoundError(
            f"checkpoint {str(path)!r} does not exist; check the path (a run writes them under "
            "<default_root_dir>/lightning_logs/version_N/checkpoints/; the recipe CLI's "
            "--ckpt_path auto takes the newest complete one there)."
        )
    return path


def set_sampler_epoch(dataloader: Any, epoch_progress: Any) -> None:
    """Set the epoch of ``dataloader``'s (batch) sampler to the fit loop's current one.

    On a mid-epoch resume Lightning (2.6) creates the training iterator, where a torchdata
    ``StatefulDataLoader`` fast-forwards to its saved position, before it calls ``set_epoch``:
    a ``DistributedSampler`` would still shuffle with epoch 0 and the resumed run would replay
    the wrong permutation. Called from the strategy's ``process_dataloader``, which Lightning
    runs before creating the iterator; ``set_epoch`` is idempotent for a fresh epoch.
    """
    epoch = int(epoch_progress.current.processed)
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    for sampler in (getattr(dataloader, "sampler", None), getattr(batch_sampler, "sampler", None)):
        set_epoch = getattr(sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)


def rank_layout(dims: ParallelDims, virtual_pipeline: int, rank: int) -> dict[str, int]:
    """What decides whether a rank's saved callback/loop state is its own on load; ``rank`` is
    the mesh position (``ParallelDims.position(global_rank)``), so a rank's own state follows its
    coordinates across placements."""
    return {
        "world_size": dims.world_size,
        "tp": dims.tp,
        "pp": dims.pp,
        "ep": dims.ep,
        "virtual_pipeline": virtual_pipeline,
        "rank": rank,
    }


def rank_file(path: Path, rank: int) -> Path:
    """The file of ``rank``'s own state in checkpoint ``path``."""
    return path / RANKS_DIR / f"rank_{rank:05d}.pt"


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
    :func:`rank_file` for :func:`restore_rank_state`.
    """
    state: dict[str, Any] = {"state_dict": get_model_state_dict(model)}
    for i, opt in enumerate(optimizers):
        state[f"optimizer_{i}"] = get_optimizer_state_dict(model, opt, options=OPTIM_OPTIONS)
    dcp.save(state, checkpoint_id=path)
    if rank_state is not None:
        _check_layout(rank_state.get("layout"))
        file = rank_file(path, int(rank_state["layout"]["rank"]))
        file.parent.mkdir(exist_ok=True)
        torch.save(rank_state, file)
    if is_rank_zero:
        torch.save(metadata, path / METADATA_FILE)


def _check_layout(layout: Any) -> None:
    missing = [k for k in (*LAYOUT_KEYS, "rank") if not isinstance(layout, dict) or k not in layout]
    if missing:
        raise ValueError(
            f"rank_state['layout'] ({layout!r}) lacks {missing}; pass a dict with "
            f"{[*LAYOUT_KEYS, 'rank']}."
        )


def _dims(layout: dict[str, Any]) -> ParallelDims:
    return ParallelDims(
        world_size=int(layout["world_size"]),
        tp=int(layout["tp"]),
        pp=int(layout["pp"]),
        ep=int(layout["ep"]),
    )


def restore_rank_state(path: Path, metadata: dict[str, Any], layout: dict[str, Any]) -> list[str]:
    """Replace ``metadata``'s ``callbacks`` / ``loops`` (rank 0's) by this rank's own, in place.

    ``layout`` is the current one (keys as in :func:`save_sharded`'s ``rank_state``). Rules in
    the module docstring. Returns the warnings to show (empty when every rank got its own state
    back). Raises ``FileNotFoundError`` if the checkpoint has per-rank files of this very
    layout but not this rank's (an incomplete copy of the checkpoint).
    """
    _check_layout(layout)
    own = rank_file(path, int(layout["rank"]))
    if own.exists():
        saved: dict[str, Any] = torch.load(own, weights_only=False)
        if all(saved["layout"][k] == layout[k] for k in LAYOUT_KEYS):
            metadata.update({k: saved[k] for k in PER_RANK_KEYS if k in saved})
            return []
    first = rank_file(path, 0)
    if not first.exists():
        if (path / RANKS_DIR).exists():
            raise FileNotFoundError(f"{first} is missing: copy the whole checkpoint directory.")
        return [
            f"checkpoint {path} has no per-rank state (written before per-rank saving): every "
            "rank restores rank 0's callback and loop state."
        ]
    saved_layout = torch.load(first, weights_only=False)["layout"]
    was = {k: saved_layout[k] for k in LAYOUT_KEYS}
    now = {k: layout[k] for k in LAYOUT_KEYS}
    if was == now:
        raise FileNotFoundError(f"{own} is missing: copy the whole checkpoint directory.")
    notes = [
        f"checkpoint {path} was written in layout {was}, this run is {now}: every rank restores "
        "rank 0's callback state (per-rank statistics and decisions start from rank 0's)."
    ]
    was_dims, now_dims = _dims(saved_layout), _dims(layout)
    if was_dims.dp == now_dims.dp:
        dp_rank = now_dims.rank_coords(int(layout["rank"]))["dp"]
        twin = next(
            r for r in range(was_dims.world_size) if was_dims.rank_coords(r)["dp"] == dp_rank
        )
        twin_state = torch.load(rank_file(path, twin), weights_only=False)
        if "loops" in twin_state:
            metadata["loops"] = twin_state["loops"]
    else:
        notes.append(
            f"data-parallel size changed ({was_dims.dp} -> {now_dims.dp}): the "
            "data loaders resume from rank 0's position with a new sharding, so the rest of "
            "this epoch differs from an uninterrupted run."
        )
    return notes


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
