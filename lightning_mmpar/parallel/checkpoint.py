"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), written atomically.

A checkpoint is a directory: DCP shards of the model and optimizer state, keyed by the
parameters' fully qualified names (pipeline stages keep their original names), plus
``meta.pt`` with Lightning's loop and callback state. Because DCP reshards on load, a checkpoint
saved in one layout (tp2 pp2) loads into another (tp1 pp1) and back.

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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

log = logging.getLogger(__name__)

# Flat keys ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr") let every pipeline rank save and
# load its own parameters' optimizer state and hyper-parameters, in any layout.
OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

METADATA_FILE = "meta.pt"
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
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    return path


def save_sharded(
    path: Path,
    model: nn.Module,
    optimizers: Sequence[Optimizer],
    metadata: dict[str, Any],
    is_rank_zero: bool,
) -> None:
    """Write model + optimizer shards with DCP and ``metadata`` (rank 0) into ``path``."""
    state: dict[str, Any] = {"state_dict": get_model_state_dict(model)}
    for i, opt in enumerate(optimizers):
        state[f"optimizer_{i}"] = get_optimizer_state_dict(model, opt, options=OPTIM_OPTIONS)
    dcp.save(state, checkpoint_id=path)
    if is_rank_zero:
        torch.save(metadata, path / METADATA_FILE)


def load_sharded(
    path: Path, model: nn.Module, optimizers: Sequence[Optimizer], strict: bool = True
) -> dict[str, Any]:
    """Load shards into ``model`` and ``optimizers`` in the current layout; return the metadata.

    Only the keys the current layout holds are read, so any saved layout loads into any other.
    """
    model_state = {"state_dict": get_model_state_dict(model)}
    dcp.load(model_state, checkpoint_id=path)
    set_model_state_dict(model, model_state["state_dict"], options=StateDictOptions(strict=strict))
    for i, opt in enumerate(optimizers):
        key = f"optimizer_{i}"
        optim_state = {key: get_optimizer_state_dict(model, opt, options=OPTIM_OPTIONS)}
        dcp.load(optim_state, checkpoint_id=path)
        set_optimizer_state_dict(
            model, opt, optim_state_dict=optim_state[key], options=OPTIM_OPTIONS
        )
    metadata: dict[str, Any] = torch.load(path / METADATA_FILE, weights_only=False)
    return metadata
