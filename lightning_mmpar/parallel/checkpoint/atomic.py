"""Atomic commit of a checkpoint directory: write aside, then swap in by renames.

Every rank writes into ``<path>.partial`` (:func:`partial_path`); once all ranks are done, rank 0
(:func:`commit`) moves the previous ``<path>`` aside to ``<path>.previous``, renames ``.partial``
to ``<path>`` and deletes ``.previous``. Renames within one directory are atomic, so a crash at
any moment leaves either the new checkpoint at ``<path>``, or the previous one at ``<path>`` or
``<path>.previous`` (:func:`resolve` finds it); a crash while writing leaves the previous
checkpoint untouched.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

__all__ = ["PARTIAL_SUFFIX", "PREVIOUS_SUFFIX", "commit", "partial_path", "remove", "resolve"]

log = logging.getLogger(__name__)

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
