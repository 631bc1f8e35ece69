"""Gradient statistics used by :class:`GradientDriftMonitor`: local capture, norm weights,
the groups of a pipeline stage, noise scale.

Global norms come from the numerics core
(:func:`lightning_mmpar.parallel.numerics.global_norm_from_local`): each rank weights its local
squared norms by ``w = S * pp / world`` (``S`` shards of a DTensor, ``pp`` pipeline stages) so
that one world all-reduce gives the norm of the whole model, replicated copies counted once and
pipeline stages added up. Under Lightning's FSDP (flat shards that partition each parameter)
``w = 1``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor

from lightning_mmpar.parallel import comm, numerics
from lightning_mmpar.trainer_topology import TrainerTopology


def noise_scale_terms(
    small_sq: float, big_sq: float, b_small: float, b_big: float
) -> tuple[float, float]:
    """Unbiased ``(|G|^2, tr(S))`` from mean squared norms at batch sizes ``b_small < b_big``."""
    if b_big <= b_small:
        raise ValueError(f"b_big ({b_big}) must exceed b_small ({b_small}).")
    g2 = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    trace = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
    return g2, trace


class LocalGradCapture:
    """Tensor hooks recording each parameter's squared local gradient norm before sync."""

    def __init__(self, named: Sequence[tuple[str, Tensor]]) -> None:
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.shapes = [list(comm.to_local(p).shape) for _, p in named]
        self.sq: Tensor | None = None
        self.fired = [0] * len(named)
        self.handles = [p.register_hook(partial(self._hook, i)) for i, (_, p) in enumerate(named)]

    def _hook(self, i: int, grad: Tensor) -> None:
        n = torch.linalg.vector_norm(comm.to_local(grad).detach()).double()
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


def pipeline_micro_batches(trainer: Any) -> int:
    """``TrainerTopology.of(trainer).micro_batches`` (for :mod:`.grad_drift`'s call sites)."""
    return TrainerTopology.of(trainer).micro_batches


def lightning_fsdp(trainer: Any) -> bool:
    """``TrainerTopology.of(trainer).lightning_fsdp`` (for :mod:`.grad_drift`'s call sites)."""
    return TrainerTopology.of(trainer).lightning_fsdp


def norm_weights(trainer: Any, params: Sequence[Tensor]) -> list[float]:
    """Per parameter ``w = S * pp / world`` (module docstring); ``1`` under Lightning FSDP."""
    topology = TrainerTopology.of(trainer)
    if topology.lightning_fsdp:
        return [1.0] * len(params)
    return numerics.grad_norm_weights(params, pp=topology.dims.pp)


def stage_groups(trainer: Any) -> list[Any]:
    """``TrainerTopology.of(trainer).stage_groups`` (for :mod:`.grad_drift`'s call sites)."""
    return TrainerTopology.of(trainer).stage_groups


def log_due(trainer: Any) -> bool:
    """Whether Lightning sends this step's logged values to the loggers (``log_every_n_steps``
    cadence, as ``Trainer`` decides it right after ``on_train_batch_end``). ``LightningModule.log``
    costs ~1 ms of Python per call on a CPU: the callbacks log only on such steps."""
    conn = getattr(trainer, "_logger_connector", None)
    if conn is None or getattr(trainer, "fast_dev_run", False):
        return True
    return bool(conn.should_update_logs)


def safe_sqrt(v: float) -> float:
    """``sqrt`` that passes NaN and negative rounding residue through unchanged."""
    return math.sqrt(v) if v >= 0 else v


def reduce_module_norms(sq: dict[str, float], groups: list[Any]) -> dict[str, float]:
    """Global norm per module from weighted local squares: summed over ``groups`` (those of
    :attr:`~lightning_mmpar.trainer_topology.TrainerTopology.stage_groups`: ``w = S / ranks
    per stage``, so the stage's sum is the global square).
    Collective over each group."""
    if sq and groups:
        vec = torch.tensor(list(sq.values()), dtype=torch.float64)
        for g in groups:  # dp then tp: together the ranks of this pipeline stage
            comm.all_reduce(vec, "sum", g)
        sq = dict(zip(sq, vec.tolist(), strict=True))
    return {m: safe_sqrt(v) for m, v in sq.items()}


def batch_size_of(batch: Any) -> int | None:
    """First dimension of the first tensor in ``batch`` (nested lists, tuples, dicts)."""
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
