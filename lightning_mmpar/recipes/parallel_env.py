"""Collectives the recipe runs over its layout, and its learning-rate schedule.

Where this rank stands (dp group, pipeline degree, last stage) comes from
:meth:`lightning_mmpar.trainer_topology.TrainerTopology.of` (duck typing, no strategy class):
under ``mm_parallel`` its own dims and pipeline engine; under any other strategy (DDP,
DeepSpeed, one device) no pipeline, and every rank is a data-parallel rank of the world group.
Collectives run through :mod:`lightning_mmpar.parallel.comm` (tensors on the group's device).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_mmpar.parallel import comm
from lightning_mmpar.recipes.options import OptimConfig
from lightning_mmpar.trainer_topology import TrainerTopology

__all__ = ["dp_sum", "from_last_stage", "warmup_cosine"]


def from_last_stage(trainer: Any, values: Tensor, owner: bool) -> Tensor:
    """``values`` of the pipeline rank that owns the last stage, on every pp peer (a copy)."""
    topology = TrainerTopology.of(trainer)
    if topology.dims.pp == 1:
        return values
    out = values.clone() if owner else torch.zeros_like(values)
    group = topology.dims.get_group("pp")
    return comm.broadcast(out, src=topology.last_stage_rank, group=group)


def dp_sum(trainer: Any, values: Tensor) -> Tensor:
    """Sum of ``values`` over the data-parallel group (a copy)."""
    group = TrainerTopology.of(trainer).dp_group
    if group is None:
        return values
    return comm.all_reduce(values.clone(), "sum", group)


def warmup_cosine(optim: OptimConfig, total: int) -> Callable[[int], float]:
    """``lr(step) / lr``: linear warm-up, then cosine to ``min_lr_ratio``."""

    def factor(step: int) -> float:
        if step < optim.warmup_steps:
            return (step + 1) / max(1, optim.warmup_steps)
        progress = min(1.0, (step - optim.warmup_steps) / max(1, total - optim.warmup_steps))
        cos = 0.5 * (1 + math.cos(math.pi * progress))
        return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * cos

    return factor


_MOVED: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "dp_group": ("TrainerTopology.of(trainer).dp_group", lambda t: TrainerTopology.of(t).dp_group),
    "owns_last_stage": (
        "TrainerTopology.of(trainer).owns_last_stage",
        lambda t: TrainerTopology.of(t).owns_last_stage,
    ),
    "pipeline_parallel": (
        "TrainerTopology.of(trainer).dims.pp",
        lambda t: TrainerTopology.of(t).dims.pp,
    ),
    "layout": ("TrainerTopology.of(trainer).as_dict()", lambda t: TrainerTopology.of(t).as_dict()),
}
"""Deprecated accessors (one release): name -> (replacement, what it returns for a trainer)."""


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    replacement, answer = _MOVED[name]
    warnings.warn(
        f"lightning_mmpar.recipes.parallel_env.{name}(trainer) is deprecated; use {replacement} "
        "(lightning_mmpar.trainer_topology), the one accessor of a run's layout.",
        DeprecationWarning,
        stacklevel=2,
    )
    return answer
