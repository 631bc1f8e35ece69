"""Vocab-parallel cross-entropy: the loss of vocab-sharded logits without gathering them.

Rank ``r`` holds logits ``z[:, V_r]`` for its vocabulary slice ``V_r = [r V/p, (r+1) V/p)``::

    m   = max_r max_{v in V_r} z_v                  (all-reduce MAX)
    S   = sum_r sum_{v in V_r} exp(z_v - m)         (all-reduce SUM)
    z_y = sum_r [y in V_r] z_y                      (all-reduce SUM)
    loss = mean over non-ignored tokens of log S + m - z_y

The backward needs no communication: ``d loss / d z_v = (softmax_v - [v == y]) / n`` locally.
Unlike ``torch.distributed.tensor.parallel.loss_parallel`` it does not need the backward to run
inside a context manager, so Lightning's own ``backward`` call works.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logits: Tensor, target: Tensor, start: int, ignore_index: int, group: Any
    ) -> Tensor:
        z = logits.float()
        m = z.max(dim=-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        z = z - m.unsqueeze(-1)
        local = target - start
        inside = (local >= 0) & (local < z.shape[-1]) & (target != ignore_index)
        local = torch.where(inside, local, torch.zeros_like(local))
        picked = z.gather(-1, local.unsqueeze(-1)).squeeze(-1) * inside
        exp = z.exp()
        total = exp.sum(dim=-1)
        dist.all_reduce(picked, group=group)
        dist.all_reduce(total, group=group)
        valid = target != ignore_index
        count = valid.sum().clamp(min=1)
        loss = ((total.log() - picked) * valid).sum() / count
        ctx.save_for_backward(exp / total.unsqueeze(-1), local, inside, valid, count)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        softmax, local, inside, valid, count = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, local.unsqueeze(-1), -inside.to(g.dtype).unsqueeze(-1))
        g = g * (valid.to(g.dtype) / count * grad).unsqueeze(-1)
        return g.to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: Tensor, target: Tensor, *, ignore_index: int = -100
) -> Tensor:
    """Mean token cross-entropy of ``logits [..., V]`` against ``target [...]``.

    ``logits`` is either a plain tensor (``F.cross_entropy``) or a DTensor sharded on the vocab
    dim (``Shard(-1)``, as the LM head returns under tensor parallelism); targets are global ids.
    Tokens equal to ``ignore_index`` do not count.
    """
    if not isinstance(logits, DTensor):
        flat = logits.reshape(-1, logits.shape[-1]).float()
        return F.cross_entropy(flat, target.reshape(-1), ignore_index=ignore_index)
    placement = logits.placements[0]
    if logits.device_mesh.ndim != 1 or not (
        isinstance(placement, Shard) and placement.dim in (-1, logits.ndim - 1)
    ):
        raise ValueError(
            f"logits must be sharded on the vocab dim of a 1-D mesh (got {placement})."
        )
    mesh = logits.device_mesh
    local = logits.to_local()
    start = mesh.get_local_rank() * local.shape[-1]
    flat = local.reshape(-1, local.shape[-1])
    return _VocabParallelCrossEntropy.apply(
        flat, target.reshape(-1), start, ignore_index, mesh.get_group()
    )
