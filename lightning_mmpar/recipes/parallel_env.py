"""What the recipe needs from whichever strategy runs it: dp group, pipeline stages, layout.

Every answer comes from :meth:`lightning_mmpar.topology.ParallelDims.of` (duck typing, no
strategy class): under ``mm_parallel`` its own dims; under any other strategy (DDP, DeepSpeed,
one device) no pipeline, and every rank is a data-parallel rank of the world group. Collectives
run through :mod:`lightning_mmpar.parallel.comm` (tensors on the group's device).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_mmpar.layout.schedules import stage_layout
from lightning_mmpar.parallel import comm
from lightning_mmpar.recipes.config import OptimConfig
from lightning_mmpar.topology import ParallelDims

__all__ = [
    "dp_group",
    "dp_sum",
    "from_last_stage",
    "layout",
    "owns_last_stage",
    "pipeline_parallel",
    "warmup_cosine",
]


def dp_group(trainer: Any) -> dist.ProcessGroup | None:
    """The data-parallel group: ``mm_parallel``'s dp mesh, another strategy's world group;
    ``None`` when there is a single data-parallel rank (losses and metrics gather nothing)."""
    dims = ParallelDims.of(trainer)
    if dims.dp == 1:
        return None
    group = dims.get_group("dp")
    return group if group is not None else dist.group.WORLD


def pipeline_parallel(trainer: Any) -> int:
    """Pipeline degree of the run (1 for other strategies)."""
    return ParallelDims.of(trainer).pp


def _last_stage_rank(trainer: Any, dims: ParallelDims) -> int:
    """Pipeline rank of the last stage: ``pp - 1`` in the loop layout, 0 in the V layout of
    ZBV / DualPipeV (the engine's ``last_rank``; from the strategy's schedule before it exists)."""
    strategy = trainer.strategy
    engine = getattr(strategy, "pipeline", None)
    if engine is not None:
        return int(engine.last_rank)
    schedule = getattr(getattr(strategy, "config", None), "schedule", "1f1b")
    return 0 if stage_layout(schedule) == "v" else dims.pp - 1


def owns_last_stage(trainer: Any) -> bool:
    """Whether this rank runs the last pipeline stage (always true without a pipeline)."""
    dims = ParallelDims.of(trainer)
    return dims.pp == 1 or dims.local_rank("pp") == _last_stage_rank(trainer, dims)


def from_last_stage(trainer: Any, values: Tensor, owner: bool) -> Tensor:
    """``values`` of the pipeline rank that owns the last stage, on every pp peer (a copy)."""
    dims = ParallelDims.of(trainer)
    if dims.pp == 1:
        return values
    out = values.clone() if owner else torch.zeros_like(values)
    return comm.broadcast(out, src=_last_stage_rank(trainer, dims), group=dims.get_group("pp"))


def dp_sum(trainer: Any, values: Tensor) -> Tensor:
    """Sum of ``values`` over the data-parallel group (a copy)."""
    group = dp_group(trainer)
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


def layout(trainer: Any) -> dict[str, Any]:
    """``{"strategy", "world", "tp", "pp", "dp", "ep", "virtual"}`` of the run."""
    strategy = trainer.strategy
    dims = ParallelDims.of(trainer)
    config = getattr(strategy, "config", None)
    name = type(strategy).__name__
    if isinstance(getattr(strategy, "parallel_dims", None), ParallelDims):
        name = f"mm_parallel/{getattr(config, 'data_parallel', '?')}"
    return {
        "strategy": name,
        "world": trainer.world_size,
        "tp": dims.tp,
        "pp": dims.pp,
        "dp": dims.dp,
        "ep": dims.ep,
        "virtual": int(getattr(config, "virtual_pipeline", 1)),
    }
