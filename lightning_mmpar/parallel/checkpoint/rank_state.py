"""Each rank's own callback and loop state in a checkpoint, and its restore in any layout.

Lightning builds ``checkpoint["callbacks"]`` and ``checkpoint["loops"]`` on every rank, and they
differ by rank: a callback's statistics of its own pipeline stage or tensor shard, the position of
a dp replica's stateful DataLoader (torchdata's ``StatefulDataLoader``, saved by Lightning in the
fit loop's state). Each rank writes them with its layout to ``ranks/rank_<r:05d>.pt``
(:func:`write_rank_state`). Restoring (:func:`restore_rank_state`):

* same layout (world size, tp, pp, ep, virtual stages): every rank gets its own state back;
* another layout, same data-parallel size: the loop state of a saved rank with the same dp
  coordinate (so the data resumes exactly), rank 0's callback state, with a warning;
* another data-parallel size, or a checkpoint without per-rank files: rank 0's state for both,
  with a warning (the epoch continues after as many batches per replica as were done, but the
  sharding differs, so the rest of that epoch is not the uninterrupted run's).

A mid-epoch resume also needs the sampler's epoch set before the loader fast-forwards
(:func:`set_sampler_epoch`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightning_mmpar.topology import ParallelDims

__all__ = [
    "LAYOUT_KEYS",
    "PER_RANK_KEYS",
    "RANKS_DIR",
    "check_layout",
    "layout_key",
    "rank_file",
    "rank_layout",
    "restore_rank_state",
    "set_sampler_epoch",
    "write_rank_state",
]

RANKS_DIR = "ranks"
PER_RANK_KEYS = ("callbacks", "loops")
"""Keys of Lightning's checkpoint dict that every rank writes for itself."""
LAYOUT_KEYS = ("world_size", "tp", "pp", "ep", "virtual_pipeline")
"""Layout entries that must match for a rank to get its own state back."""


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


def write_rank_state(path: Path, rank_state: dict[str, Any]) -> None:
    """Write ``rank_state`` (``{"layout": {world_size, tp, pp, ep, virtual_pipeline, rank},
    "callbacks": ..., "loops": ...}``) to :func:`rank_file` of its layout's rank.

    Raises:
        ValueError: ``rank_state["layout"]`` lacks one of those keys.
    """
    check_layout(rank_state.get("layout"))
    file = rank_file(path, int(rank_state["layout"]["rank"]))
    file.parent.mkdir(exist_ok=True)
    torch.save(rank_state, file)


def check_layout(layout: Any) -> None:
    """Raise ``ValueError`` unless ``layout`` is a dict with every key of :func:`rank_layout`."""
    missing = [k for k in (*LAYOUT_KEYS, "rank") if not isinstance(layout, dict) or k not in layout]
    if missing:
        raise ValueError(
            f"rank_state['layout'] ({layout!r}) lacks {missing}; pass a dict with "
            f"{[*LAYOUT_KEYS, 'rank']}."
        )


def layout_key(layout: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``layout`` that must match for a rank's own state: :data:`LAYOUT_KEYS`
    and ``vision_ranks`` (non-colocated towers; 0, colocated, when absent)."""
    return {k: layout[k] for k in LAYOUT_KEYS} | {"vision_ranks": layout.get("vision_ranks", 0)}


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
    check_layout(layout)
    own = rank_file(path, int(layout["rank"]))
    if own.exists():
        saved: dict[str, Any] = torch.load(own, weights_only=False)
        if layout_key(saved["layout"]) == layout_key(layout):
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
    was, now = layout_key(saved_layout), layout_key(layout)
    if was == now:
        raise FileNotFoundError(f"{own} is missing: copy the whole checkpoint directory.")
    notes = [
        f"checkpoint {path} was written in layout {was}, this run is {now}: every rank restores "
        "rank 0's callback state (per-rank statistics and decisions start from rank 0's)."
    ]
    was_dims, now_dims = _dims(saved_layout), _dims(layout)
    if was_dims.dp == now_dims.dp and int(layout["rank"]) < now_dims.world_size:
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
