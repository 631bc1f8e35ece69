"""Gradient statistics used by :class:`GradientDriftMonitor`: local capture, global norms,
noise scale.

Global norms without one collective per parameter: a rank holding the local piece ``g_r`` of a
parameter's gradient adds ``w * |g_r|^2`` to its sum, with ``w = S * pp / world`` where ``S``
is the number of shards (product of the mesh sizes of the DTensor's ``Shard`` placements;
1 for a plain tensor) and ``pp`` the pipeline degree. The parameter lives on the ``world / pp``
ranks of one pipeline stage, each shard on ``world / (pp * S)`` of them, so the world sum of
these contributions is exactly ``|g|^2`` - the pipeline stages' norms add up as they would
with an all-reduce over the pp group, and replicated copies (TP-replicated norms, DP replicas)
count once. Under Lightning's FSDP (flat shards that partition the parameter) ``w = 1``.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor


def noise_scale_terms(
    small_sq: float, big_sq: float, b_small: float, b_big: float
) -> tuple[float, float]:
    """Unbiased ``(|G|^2, tr(S))`` from mean squared norms at batch sizes ``b_small < b_big``."""
    if b_big <= b_small:
        raise ValueError(f"b_big ({b_big}) must exceed b_small ({b_small}).")
    g2 = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    trace = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
    return g2, trace


def local_tensor(t: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class LocalGradCapture:
    """Tensor hooks recording each parameter's squared local gradient norm before sync."""

    def __init__(self, named: Sequence[tuple[str, Tensor]]) -> None:
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.shapes = [list(local_tensor(p).shape) for _, p in named]
        self.sq: Tensor | None = None
        self.fired = [0] * len(named)
        self.handles = [p.register_hook(partial(self._hook, i)) for i, (_, p) in enumerate(named)]

    def _hook(self, i: int, grad: Tensor) -> None:
        n = torch.linalg.vector_norm(local_tensor(grad).detach()).double()
        if self.sq is None or self.sq.device != n.device:
            self.sq = torch.zeros(len(self.names), dtype=torch.float64, device=n.device)
        self.sq[i] += n * n
        self.fired[i] += 1

    def take(self) -> tuple[list[float], int]:
        """Per-parameter summed squares since the last call, and the number of backwards."""
        sq = self.sq.tolist() if self.sq is not None else [0.0] * len(self.names)
        count = max(self.fired, default=0)
        self.sq, self.fired = None, [0] * len(self.names)
        return sq, count

    def remove(self) -> None:
        """Unregister all hooks."""
        for h in self.handles:
            h.remove()


def _dims(trainer: Any) -> Any:
    dims = getattr(trainer.strategy, "parallel_dims", None)
    return dims if dims is not None and hasattr(dims, "get_mesh") else None


def pipeline_degree(trainer: Any) -> int:
    """Pipeline-parallel size (1 outside ``mm_parallel``)."""
    dims = _dims(trainer)
    return int(dims.pp) if dims is not None else 1


def pipeline_micro_batches(trainer: Any) -> int:
    """Micro-batches per step when the strategy runs a pipeline schedule (pp > 1), else 1."""
    engine = getattr(trainer.strategy, "pipeline", None)
    return int(engine.config.num_micro_batches) if engine is not None else 1


def shard_count(p: Tensor) -> int:
    """Number of distinct shards of a DTensor parameter (1 for a plain tensor)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return 1
    mesh = p.device_mesh
    n = 1
    for i, pm in enumerate(p.placements):
        if pm.is_shard():
            n *= mesh.size(i)
    return n


def norm_weights(trainer: Any, params: Sequence[Tensor], world: int) -> list[float]:
    """Per parameter ``w = S * pp / world`` (module docstring); ``1`` under Lightning FSDP."""
    from lightning.pytorch.strategies import FSDPStrategy

    if isinstance(trainer.strategy, FSDPStrategy):
        return [1.0] * len(params)
    pp = pipeline_degree(trainer)
    return [shard_count(p) * pp / world for p in params]


def stage_groups(trainer: Any) -> list[Any]:
    """Groups whose successive all-reduces sum over the ranks of one pipeline stage."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return []
    dims = _dims(trainer)
    if dims is None:
        return [dist.group.WORLD]
    return [dims.get_mesh(n).get_group() for n in ("dp", "tp") if getattr(dims, n) > 1]


def clip_grads_(params: Sequence[Tensor], max_norm: float, total_norm: float) -> float:
    """Scale gradients by ``min(1, max_norm / (total_norm + 1e-6))`` (``clip_grad_norm_``'s
    rule, applied with a precomputed *global* norm); returns the coefficient."""
    coef = min(1.0, max_norm / (total_norm + 1e-6))
    if coef < 1.0:
        grads = [local_tensor(p.grad) for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, coef)
    return coef


def grad_norms(named: Sequence[tuple[str, Tensor]]) -> list[float]:
    """Norm of each gradient (local shard for DTensors) with one fused kernel and host sync."""
    grads = [local_tensor(p.grad) for _, p in named if p.grad is not None]
    if not grads:
        return []
    # _foreach_norm groups tensors by device/dtype; accumulation is in the grad's dtype
    return [float(v) for v in torch.stack(torch._foreach_norm(grads)).double().tolist()]


def batch_size_of(batch: Any) -> int | None:
    if isinstance(batch, Tensor):
        return int(batch.shape[0]) if batch.ndim else None
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, list | tuple):
        for item in batch:
            b = batch_size_of(item)
            if b is not None:
                return b
    return None
