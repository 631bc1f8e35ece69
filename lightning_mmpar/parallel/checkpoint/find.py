"""The newest complete sharded checkpoint under a directory: what a relaunch resumes from.

A checkpoint is complete when :func:`~lightning_mmpar.parallel.checkpoint.inspect_checkpoint`
accepts it (DCP's ``.metadata``, every shard as long as it says, ``meta.pt``), i.e. its atomic
commit finished. ``<name>.partial`` directories (a save cut short) are never candidates; a
``<name>.previous`` one counts when its ``<name>`` is missing (a commit cut short between its two
renames, :func:`~lightning_mmpar.parallel.checkpoint.resolve`). Newest means the highest
``global_step`` in ``meta.pt``, then the latest modification time of ``meta.pt``: so a relaunch
picks the pre-emption checkpoint over an older periodic one, and a run's logger version
directories (``lightning_logs/version_<n>/checkpoints``) are all searched.
"""

from __future__ import annotations

import logging
from pathlib import Path

from lightning_mmpar.parallel.checkpoint.atomic import PARTIAL_SUFFIX, PREVIOUS_SUFFIX
from lightning_mmpar.parallel.checkpoint.check import (
    DCP_METADATA,
    METADATA_FILE,
    inspect_checkpoint,
    root_error,
)

__all__ = ["AUTO", "complete_checkpoints", "newest_checkpoint"]

log = logging.getLogger(__name__)

AUTO = "auto"
"""The ``ckpt_path`` value that means "the newest complete checkpoint, else a fresh start"."""


def complete_checkpoints(root: str | Path) -> list[tuple[int, float, Path]]:
    """``(global_step, mtime of meta.pt, path)`` of every complete checkpoint under ``root``
    (recursively), sorted oldest first. Incomplete or damaged ones are logged and left out;
    a missing ``root`` gives ``[]``."""
    found: list[tuple[int, float, Path]] = []
    root = Path(root)
    if not root.is_dir():
        return found
    for marker in root.rglob(DCP_METADATA):
        path = marker.parent
        if path.name.endswith(PARTIAL_SUFFIX) or any(
            p.name.endswith(PARTIAL_SUFFIX) for p in path.parents
        ):
            continue
        if (
            path.name.endswith(PREVIOUS_SUFFIX)
            and path.with_name(path.name[: -len(PREVIOUS_SUFFIX)]).exists()
        ):
            continue
        try:
            checked = inspect_checkpoint(path)
        except (OSError, ValueError) as err:
            log.warning("skipping incomplete checkpoint %s: %s", path, root_error(err))
            continue
        step = checked.meta.get("global_step", -1)
        mtime = (path / METADATA_FILE).stat().st_mtime
        found.append((int(step) if isinstance(step, int) else -1, mtime, path))
    return sorted(found)


def newest_checkpoint(root: str | Path) -> Path | None:
    """The complete checkpoint under ``root`` with the highest global step (ties: the newest
    ``meta.pt``); ``None`` when there is none (a first launch)."""
    found = complete_checkpoints(root)
    return found[-1][2] if found else None
