"""Global gradient norm and clipping across every parallel dimension.

Each parameter's gradient is a plain tensor (replicated over its peers) or a DTensor (sharded
over tp and/or dp); ``vector_norm`` of a DTensor is the norm of the whole tensor. Pipeline
ranks hold disjoint parameters, so their squared norms add up over the pp group:
``||g|| = sqrt(sum_pp sum_p ||g_p||^2)``. Clipping scales every gradient by
``min(1, max_norm / (||g|| + 1e-6))``, which is what ``torch.nn.utils.clip_grad_norm_`` does
on one device.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor


def global_grad_norm(params: Iterable[Tensor], pp_group: dist.ProcessGroup | None) -> Tensor:
    """L2 norm of all gradients of the model, identical on every rank (float64)."""
    sq = torch.zeros((), dtype=torch.float64)
    for p in params:
        if p.grad is None:
            continue
        norm = torch.linalg.vector_norm(p.grad)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        sq = sq + norm.detach().double().cpu() ** 2
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        device = "cuda" if dist.get_backend(pp_group) == "nccl" else "cpu"
        sq = sq.to(device)
        dist.all_reduce(sq, group=pp_group)
    return sq.sqrt().cpu()


@torch.no_grad()
def clip_grad_norm(
    params: Iterable[Tensor], max_norm: float, pp_group: dist.ProcessGroup | None
) -> Tensor:
    """Scale gradients so their global norm is at most ``max_norm``; return the norm before."""
    params = [p for p in params if p.grad is not None]
    total = global_grad_norm(params, pp_group)
    coef = min(1.0, max_norm / (float(total) + 1e-6))
    if coef < 1.0:
        for p in params:
            assert p.grad is not None
            p.grad.mul_(coef)
    return total
