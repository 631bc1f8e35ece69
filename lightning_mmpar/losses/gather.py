"""Autograd-aware all-gather over one process group (the data-parallel group of the losses).

Forward: every rank contributes ``x_r`` of shape ``[n_r, ...]`` (``n_r`` may differ between
ranks) and receives ``cat([x_0, ..., x_{p-1}])``. Backward: the gradient of the concatenation is
summed over the group and each rank keeps its own rows, i.e. ``dL/dx_r = sum_q dL_q/dx_r``. When
every rank computes the same global loss ``L`` this gives ``p * dL/dx_r``; data-parallel gradient
averaging (DDP, FSDP) divides that by ``p`` again (see ``docs/losses_and_data.md``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_mmpar.parallel import comm


def group_size(group: dist.ProcessGroup | None) -> int:
    """Size of ``group``; 1 when ``group`` is None (the losses' "no group": nothing is gathered,
    unlike :mod:`~lightning_mmpar.parallel.comm` where None is the world) or without processes."""
    return 1 if group is None else comm.group_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank inside ``group``; 0 when :func:`group_size` is 1."""
    return 0 if group_size(group) == 1 else comm.group_rank(group)


def gather_sizes(n: int, device: torch.device, group: dist.ProcessGroup | None) -> list[int]:
    """Every rank's row count ``n`` in ``group`` (``[n]`` when the group has size 1)."""
    if group_size(group) == 1:
        return [n]
    local = torch.tensor([n], dtype=torch.long, device=device)
    return torch.cat(comm.all_gather(local, group)).tolist()


class _GatherWithGrad(torch.autograd.Function):
    """All-gather rows in forward; sum over the group and keep own rows in backward."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, sizes: list[int]
    ) -> torch.Tensor:
        longest = max(sizes)
        # all_gather needs equal shapes: pad every contribution to the longest one.
        padded = x.new_zeros((longest, *x.shape[1:]))
        padded[: x.shape[0]] = x
        parts = comm.all_gather(padded, group)
        ctx.group, ctx.sizes, ctx.rank = group, sizes, comm.group_rank(group)
        return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        # gloo has no reduce_scatter: all-reduce the full gradient, then keep our rows.
        grad = comm.all_reduce(grad.contiguous().clone(), "sum", ctx.group)
        start = sum(ctx.sizes[: ctx.rank])
        return grad[start : start + ctx.sizes[ctx.rank]], None, None


def gather_with_grad(
    x: torch.Tensor, group: dist.ProcessGroup | None, sizes: list[int] | None = None
) -> torch.Tensor:
    """Concatenate ``x`` (dim 0) from every rank of ``group``, differentiably.

    ``sizes`` (every rank's row count, from :func:`gather_sizes`) saves one small collective
    when several tensors of the same batch are gathered. Returns ``x`` itself when the group
    has size 1 (or is None).
    """
    if group_size(group) == 1:
        return x
    assert group is not None
    if sizes is None:
        sizes = gather_sizes(x.shape[0], x.device, group)
    if sizes[group_rank(group)] != x.shape[0]:
        raise ValueError(
            f"sizes[{group_rank(group)}] ({sizes[group_rank(group)]}) must equal this rank's "
            f"row count ({x.shape[0]}); pass the sizes returned by gather_sizes for this batch."
        )
    out = _GatherWithGrad.apply(x, group, sizes)
    assert isinstance(out, torch.Tensor)
    return out


def gather_no_grad(
    x: torch.Tensor, group: dist.ProcessGroup | None, sizes: list[int] | None = None
) -> torch.Tensor:
    """Concatenate ``x`` (dim 0) from every rank of ``group`` without a gradient path."""
    with torch.no_grad():
        return gather_with_grad(x.detach(), group, sizes)
