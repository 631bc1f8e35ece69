"""What the recipe needs from whichever strategy runs it: tp mesh, vl and dp groups, stages.

Under ``mm_parallel`` the groups come from ``trainer.strategy.parallel_dims``; under any other
strategy (DDP, DeepSpeed, one device) there is no tensor or pipeline parallelism and every rank
is a data-parallel rank (``WORLD``, or no group at all in a single process).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from lightning_mmpar.recipes.config import OptimConfig
from lightning_mmpar.strategy import MultimodalParallelStrategy


def _ours(trainer: Trainer | None) -> MultimodalParallelStrategy | None:
    strategy = getattr(trainer, "strategy", None)
    return strategy if isinstance(strategy, MultimodalParallelStrategy) else None


def _trainer(module: LightningModule) -> Trainer | None:
    return module._trainer


def tp_mesh(module: LightningModule) -> DeviceMesh | None:
    """``device_mesh["tp"]`` when the strategy set a mesh with tp > 1, else None."""
    mesh = module.device_mesh
    if mesh is None or "tp" not in (mesh.mesh_dim_names or ()) or mesh["tp"].size() == 1:
        return None
    return mesh["tp"]


def vl_group(module: LightningModule) -> dist.ProcessGroup | None:
    """The strategy's dedicated vision-language group (same ranks as tp), if ours."""
    ours = _ours(_trainer(module))
    return ours.parallel_dims.vl_group if ours is not None else None


def dp_group(trainer: Trainer) -> dist.ProcessGroup | None:
    """The data-parallel group: ``mm_parallel``'s dp mesh, else WORLD; None for one rank."""
    ours = _ours(trainer)
    if ours is not None:
        mesh = ours.parallel_dims.get_mesh("dp")
        return mesh.get_group() if mesh.size() > 1 else None
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


def pipeline_parallel(trainer: Trainer | None) -> int:
    """Pipeline degree of the run (1 for other strategies)."""
    ours = _ours(trainer)
    return ours.parallel_dims.pp if ours is not None else 1


def owns_last_stage(trainer: Trainer | None) -> bool:
    """Whether this rank runs the last pipeline stage (always true without a pipeline)."""
    ours = _ours(trainer)
    pipeline = ours.pipeline if ours is not None else None
    return pipeline is None or pipeline.has_last


def from_last_stage(trainer: Trainer, values: Tensor, owner: bool) -> Tensor:
    """Broadcast ``values`` from the pipeline rank that owns the last stage to its pp peers."""
    ours = _ours(trainer)
    if ours is None or ours.parallel_dims.pp == 1:
        return values
    group = ours.parallel_dims.get_mesh("pp").get_group()
    src = ours.config.num_stages - 1
    out = values.clone() if owner else torch.zeros_like(values)
    dist.broadcast(out, group_src=src % ours.parallel_dims.pp, group=group)
    return out


def dp_sum(trainer: Trainer, values: Tensor) -> Tensor:
    """Sum over the data-parallel group."""
    group = dp_group(trainer)
    if group is None:
        return values
    out = values.clone()
    dist.all_reduce(out, group=group)
    return out


def warmup_cosine(optim: OptimConfig, total: int) -> Callable[[int], float]:
    """``lr(step) / lr``: linear warm-up, then cosine to ``min_lr_ratio``."""

    def factor(step: int) -> float:
        if step < optim.warmup_steps:
            return (step + 1) / max(1, optim.warmup_steps)
        progress = min(1.0, (step - optim.warmup_steps) / max(1, total - optim.warmup_steps))
        cos = 0.5 * (1 + math.cos(math.pi * progress))
        return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * cos

    return factor


def layout(trainer: Trainer) -> dict[str, Any]:
    """``{"strategy", "world", "tp", "pp", "dp", "ep", "virtual"}`` of the run."""
    ours = _ours(trainer)
    world = trainer.world_size
    if ours is None:
        return {
            "strategy": type(trainer.strategy).__name__,
            "world": world,
            "tp": 1,
            "pp": 1,
            "dp": world,
            "ep": 1,
            "virtual": 1,
        }
    d, c = ours.parallel_dims, ours.config
    return {
        "strategy": f"mm_parallel/{c.data_parallel}",
        "world": world,
        "tp": d.tp,
        "pp": d.pp,
        "dp": d.dp,
        "ep": d.ep,
        "virtual": c.virtual_pipeline,
    }
