"""Data parallelism on the ``dp`` mesh: FSDP2 ``fully_shard`` (ZeRO-3 role) or gradient all-reduce.

FSDP2 averages gradients with a reduce-scatter inside backward. Parameters it does not manage
(``data_parallel="ddp"``, or parameters held directly by the root module) are averaged by
:func:`sync_gradients`: one coalesced all-reduce per dtype over the dp group,
``g <- (1/dp) * sum_r g_r``, which is what DDP computes.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from lightning_mmpar.parallel import comm


def has_fsdp(module: nn.Module) -> bool:
    """Whether any submodule is already sharded with ``fully_shard``."""
    return any(isinstance(m, FSDPModule) for m in module.modules())


def fsdp_managed(module: nn.Module) -> set[int]:
    """Ids of the parameters managed by some ``fully_shard`` unit under ``module``."""
    return {id(p) for m in module.modules() if isinstance(m, FSDPModule) for p in m.parameters()}


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def shard_blocks(blocks: Iterable[nn.Module], root: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    """``fully_shard`` each block (one all-gather unit each), then ``root`` over what remains."""
    for block in blocks:
        if _has_params(block) and not isinstance(block, FSDPModule):
            fully_shard(block, mesh=dp_mesh)
    if _has_params(root):
        fully_shard(root, mesh=dp_mesh)
    return root


def apply_fsdp(module: nn.Module, dp_mesh: DeviceMesh) -> None:
    """Shard a plain module tree: every child of every ``ModuleList`` (transformer layers), then
    every direct child of ``module`` that holds parameters. Parameters registered directly on
    ``module`` stay replicated; :func:`sync_gradients` averages them."""
    lists = [m for m in module.modules() if isinstance(m, nn.ModuleList)]
    for layers in lists:
        for layer in layers:
            if _has_params(layer) and not isinstance(layer, FSDPModule):
                fully_shard(layer, mesh=dp_mesh)
    for child in module.children():
        if isinstance(child, nn.ModuleList | nn.ModuleDict):
            continue  # containers have no forward; their layers are sharded above
        if _has_params(child) and not isinstance(child, FSDPModule):
            fully_shard(child, mesh=dp_mesh)


def replicated_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Trainable parameters that no FSDP unit averages."""
    managed = fsdp_managed(module)
    return [p for p in module.parameters() if p.requires_grad and id(p) not in managed]


@torch.no_grad()
def broadcast_parameters(params: Iterable[Tensor], group: dist.ProcessGroup | None) -> None:
    """Copy group rank 0's values into every replica (what DDP does at construction); each
    DTensor's local shard is broadcast (replicas hold the same shard)."""
    for p in params:
        comm.broadcast(comm.to_local(p.data), src=0, group=group)


@torch.no_grad()
def sync_gradients(params: Iterable[Tensor], group: dist.ProcessGroup | None) -> None:
    """Average gradients over ``group`` with one coalesced all-reduce per dtype (local shards of
    DTensor gradients)."""
    if comm.group_size(group) == 1:
        return
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for p in params:
        if p.grad is not None:
            g = comm.to_local(p.grad)
            by_dtype.setdefault(g.dtype, []).append(g)
    for grads in by_dtype.values():
        flat = comm.all_reduce(torch.cat([g.reshape(-1) for g in grads]), "avg", group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
