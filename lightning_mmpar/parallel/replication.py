"""Data-parallel replicas: identical at set-up, and reduced by torch's DDP where it applies.

Set-up (:func:`broadcast_module_state`): every replica starts from its data-parallel group's
rank 0, as torch's ``DistributedDataParallel`` does at construction (``_sync_module_states``):
every parameter, trainable or frozen, and every persistent buffer (what a checkpoint holds, so a
run that loads weights on rank 0 only trains one model), before FSDP2 shards anything
(``fully_shard`` broadcasts nothing: each rank would keep its own slice of its own values).
Dense tensors go over ``dp``, expert weights and the buffers of expert modules over ``edp`` (their
replicas: :mod:`~lightning_mmpar.parallel.expert_data`); a tensor-parallel DTensor's local shard
is broadcast (the ``dp`` peers hold the same shard). Non-persistent buffers are derived state a
rank may own (the MoE router's locality mask, its pending load) and are left alone; meta tensors
(deferred parameters, filled by the module's own hook later) and expanded views (one element
seen many times, ``ones(1).expand(n)``: no collective can write into them) too.

Gradients (:func:`replicate_module`) under ``data_parallel="ddp"``: torch's composable
``replicate`` (``torch.distributed._composable.replicate``: a ``DistributedDataParallel`` over
the module's parameters, its forward hooks on the module) over the ``dp`` group, so bucketed
all-reduces overlap backward (torchtitan's ``apply_ddp``), and gradient accumulation skips them
(:func:`set_gradient_sync`, DDP's ``no_sync``). With ``gradient_as_bucket_view``: after the
reduce each gradient is a view of its flat bucket, with the same values (no copy from bucket
to gradient; torch's DDP documentation: peak memory lower by the gradients' size), so the
non-finite guard reads a few buckets (:mod:`~lightning_mmpar.parallel.finite`). Expert modules
are ``ignored_modules``: their weights average over ``edp``, not ``dp``, after backward
(:class:`~lightning_mmpar.parallel.data.GradientSync`). :func:`ddp_fallback` names the layouts
where the package keeps its own all-reduce after backward instead.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_mmpar import compat
from lightning_mmpar.config import ParallelConfig
from lightning_mmpar.parallel import comm, expert_data
from lightning_mmpar.parallel.data import fsdp_managed
from lightning_mmpar.topology import ParallelDims

__all__ = [
    "BROADCAST_BUCKET_BYTES",
    "broadcast_module_state",
    "ddp_covers_world",
    "ddp_fallback",
    "module_state",
    "replicate_module",
    "replicated_by_ddp",
    "set_gradient_sync",
]

BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024
"""Bytes per coalesced broadcast at set-up (``DistributedDataParallel.broadcast_bucket_size``)."""


def _persistent_buffers(module: nn.Module) -> Iterable[tuple[nn.Module, Tensor]]:
    for m in module.modules():
        skip: set[str] = getattr(m, "_non_persistent_buffers_set", set())
        for name, b in m.named_buffers(recurse=False):
            if b is not None and name not in skip:
                yield m, b


def _expanded(t: Tensor) -> bool:
    """Whether ``t`` is an expanded view (stride 0 along a dim of size > 1, as
    ``ones(1).expand(n)``), which no collective can write into."""
    return any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape, strict=True))


def module_state(module: nn.Module) -> tuple[list[Tensor], list[Tensor]]:
    """``(dense, experts)``: every parameter (frozen ones too) and persistent buffer of
    ``module``, each once, meta tensors, expanded views (:func:`_expanded`: derived, one value)
    and parameters an FSDP2 unit shards already (a module that sharded itself) left out;
    ``experts`` holds the expert weights
    (:func:`~lightning_mmpar.parallel.expert_data.is_expert_parameter`) and the buffers of the
    expert modules, ``dense`` the rest. Local tensors (a DTensor's shard)."""
    owners = {id(m) for m in expert_data.expert_modules(module)}
    seen = fsdp_managed(module)
    dense: list[Tensor] = []
    experts: list[Tensor] = []
    pairs: list[tuple[Tensor, bool]]
    pairs = [(p, expert_data.is_expert_parameter(p)) for p in module.parameters()]
    pairs += [(b, id(m) in owners) for m, b in _persistent_buffers(module)]
    for t, is_expert in pairs:
        if id(t) in seen or t.is_meta or _expanded(t):
            continue
        seen.add(id(t))
        (experts if is_expert else dense).append(comm.to_local(t.detach()))
    return dense, experts


@torch.no_grad()
def _broadcast(tensors: list[Tensor], group: dist.ProcessGroup | None) -> None:
    """Group rank 0's values into ``tensors`` on every rank: coalesced (DDP's
    ``_broadcast_coalesced``) for those on the group's device, one by one for the others."""
    if not tensors or comm.group_size(group) == 1:
        return
    device = comm.group_device(group)
    local = [t for t in tensors if t.device.type == device.type]
    if local:
        compat.broadcast_coalesced(local, group, BROADCAST_BUCKET_BYTES)
    for t in tensors:
        if t.device.type != device.type:
            comm.broadcast(t, src=0, group=group)


def broadcast_module_state(module: nn.Module, dims: ParallelDims) -> None:
    """Copy each data-parallel group's rank 0 state into every replica (module docstring):
    :func:`module_state`'s dense tensors over ``dp``, expert ones over ``edp``. Call before
    FSDP2 shards anything. Collective over ``dp`` and ``edp`` (no-ops on one rank)."""
    dense, experts = module_state(module)
    if dims.dp > 1:
        _broadcast(dense, dims.get_group("dp"))
    if dims.edp > 1:
        _broadcast(experts, dims.get_group("edp"))


def ddp_fallback(dims: ParallelDims, config: ParallelConfig) -> str | None:
    """Why ``data_parallel="ddp"`` keeps the package's all-reduce after backward in this layout
    instead of torch's DDP, or ``None`` when torch's DDP applies (``pp == tp == 1``).

    * ``tp > 1``: parameters are DTensors; torch's DDP and ``replicate`` swap them for local
      tensors (``torch.distributed.tensor.parallel.ddp``), which the optimizer, global-norm
      clipping and the sharded checkpoints see; torchtitan refuses DDP past one dimension too.
    * ``pp > 1``: torch's stage runs every micro-batch's backward but the last under
      ``no_sync``, so only that one overlaps; the zero-bubble schedules split backward into
      input and weight passes and the gradient cache runs forward-only passes of the stages,
      outside DDP's one forward, one backward contract.
    """
    if config.data_parallel != "ddp" or dims.dp == 1:
        return "no data-parallel replicas to reduce"
    if dims.tp > 1:
        return "tensor_parallel > 1: DTensor parameters"
    if dims.pp > 1:
        return "pipeline_parallel > 1: the schedule runs the stages' backward"
    return None


def replicate_module(
    module: nn.Module, dims: ParallelDims, device: torch.device
) -> nn.Module | None:
    """Torch's composable ``replicate`` on ``module`` (in place) over the ``dp`` group, expert
    modules ignored (module docstring); ``None`` (nothing done) when ``module`` has no trainable
    parameter outside them. Buffers are not broadcast in forward (``forward_sync_buffers=False``,
    as before: a rank's buffers evolve with its own batches) and the set-up broadcast is
    :func:`broadcast_module_state`'s (``init_sync=False``); gradients are views of DDP's buckets
    (``gradient_as_bucket_view=True``: a gradient set to ``None``, as an optimizer's
    ``zero_grad`` does, becomes one again at the next reduce). ``replicate`` builds its
    ``DistributedDataParallel`` at the first forward. Returns ``module``."""
    ignored = expert_data.expert_modules(module)
    skip = {id(p) for m in ignored for p in m.parameters()}
    if not any(p.requires_grad and id(p) not in skip for p in module.parameters()):
        return None
    compat.replicate(
        module,
        ignored,
        process_group=dims.get_group("dp"),
        device_id=device,
        init_sync=False,
        gradient_as_bucket_view=True,
    )
    return module


def ddp_covers_world(module: nn.Module | None, dims: ParallelDims) -> bool:
    """Whether :func:`replicate_module`'s DDP (``module``; ``None``: none) reduces every
    gradient over every rank of the world: ``tp == pp == ep == 1`` and ``dp`` the whole world
    (no vision ranks beside it). After backward each rank then holds the same gradients (expert
    weights, outside DDP, are averaged over ``edp`` = ``dp`` first), so the global gradient
    norm is the local one: clipping needs no collective, as under torch's DDP alone."""
    if module is None or dims.tp * dims.pp * dims.ep != 1:
        return False
    return dims.dp == comm.group_size(None)


def replicated_by_ddp(module: nn.Module | None) -> set[int]:
    """Ids of the parameters whose gradients :func:`replicate_module`'s DDP reduces (empty for
    ``None``)."""
    if module is None:
        return set()
    skip = {id(p) for m in expert_data.expert_modules(module) for p in m.parameters()}
    return {id(p) for p in module.parameters() if id(p) not in skip}


def set_gradient_sync(module: nn.Module | None, enabled: bool) -> None:
    """Whether the next backward of a :func:`replicate_module` module all-reduces (``False``:
    accumulate locally, DDP's ``no_sync``); read at its next forward. No-op for ``None``."""
    if module is not None:
        module.set_requires_gradient_sync(enabled)  # type: ignore[operator]
