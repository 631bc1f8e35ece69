"""Gradient statistics used by :class:`GradientDriftMonitor`: local capture and noise scale."""

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
