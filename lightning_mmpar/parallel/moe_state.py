"""State of MoE layers kept in step over the data-parallel ranks, run by the training loop.

Duck-typed over any MoE layer (no import of :mod:`lightning_mmpar.models`):

* :func:`set_aux_loss_scale`: the factor of the aux-loss gradient each layer injects in
  backward (the strategy sets ``1 / accumulate_grad_batches`` at set-up, so aux-loss gradients
  follow the main loss);
* :func:`update_expert_biases`: the aux-loss-free balancing step (DeepSeek-V3), one all-reduce
  of every layer's pending load over the dp group per optimizer step;
* :func:`average_density_estimates`: density-driven top-k estimates made one over the dp group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_mmpar.parallel import comm

__all__ = ["average_density_estimates", "set_aux_loss_scale", "update_expert_biases"]


def set_aux_loss_scale(module: nn.Module, scale: float) -> None:
    """Set ``aux_loss_scale`` on every MoE layer under ``module`` (the factor of the aux-loss
    gradient its output injects in backward)."""
    for m in module.modules():
        if hasattr(m, "aux_loss_scale"):
            setattr(m, "aux_loss_scale", scale)  # noqa: B010 - any MoE layer class


@torch.no_grad()
def update_expert_biases(module: nn.Module, group: dist.ProcessGroup | None) -> int:
    """The aux-loss-free balancing step of every MoE layer under ``module`` that uses it
    (``config.load_balancing == "aux_free"``; DeepSeek-V3, Megatron-core's
    ``moe_router_enable_expert_bias``): ``pending_load`` summed over ``group`` (the data-parallel
    group: one all-reduce for all layers), then ``update_expert_bias()``. Call once per optimizer
    step on every rank of the group. Returns the number of layers updated."""
    layers = [
        m
        for m in module.modules()
        if getattr(getattr(m, "config", None), "load_balancing", None) == "aux_free"
        and isinstance(getattr(m, "pending_load", None), Tensor)
    ]
    if not layers:
        return 0
    loads: list[Tensor] = [getattr(m, "pending_load") for m in layers]  # noqa: B009 - duck typed
    flat = comm.all_reduce(torch.cat([t.reshape(-1) for t in loads]), "sum", group)
    offset = 0
    for m, t in zip(layers, loads, strict=True):
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
        getattr(m, "update_expert_bias")()  # noqa: B009
    return len(layers)


@torch.no_grad()
def average_density_estimates(module: nn.Module, group: dist.ProcessGroup | None) -> int:
    """Make every density-driven top-k estimate (a submodule with ``estimate`` and ``seen``
    buffers, :class:`~lightning_mmpar.models.GradientDensity`) the mean over the ranks of
    ``group`` that measured each position (``seen``: any rank did), so the data-parallel ranks
    route with one estimate and a checkpoint (one copy per buffer) restores it exactly. One
    all-reduce; returns the number of modules."""
    found = [
        m
        for m in module.modules()
        if isinstance(getattr(m, "estimate", None), Tensor)
        and isinstance(getattr(m, "seen", None), Tensor)
    ]
    if not found or comm.group_size(group) == 1:
        return len(found)
    pairs = [(getattr(m, "estimate"), getattr(m, "seen")) for m in found]  # noqa: B009
    flat = torch.cat([t for e, seen in pairs for t in ((e * seen).reshape(-1), seen.reshape(-1))])
    flat = comm.all_reduce(flat.float(), "sum", group)
    offset = 0
    for estimate, seen in pairs:  # mean over the ranks that measured each position
        n = estimate.numel()
        total, count = flat[offset : offset + n], flat[offset + n : offset + 2 * n]
        estimate.copy_((total / count.clamp_min(1)).view_as(estimate))
        seen.copy_((count > 0).view_as(seen))
        offset += 2 * n
    return len(found)
