"""Data parallelism on the ``dp`` mesh: FSDP2 ``fully_shard`` (ZeRO-3 role) or gradient all-reduce.

FSDP2 averages gradients with a reduce-scatter inside backward. Parameters it does not manage
(``data_parallel="ddp"``, parameters held directly by the root module, and 0-dim parameters)
are averaged by :func:`sync_gradients`: one coalesced all-reduce per dtype over the dp group,
``g <- (1/dp) * sum_r g_r``, which is what DDP computes.

Any parameter shape works under FSDP2:

* 0-dim parameters (tanh gates, CLIP's logit scale) are refused by ``fully_shard`` ("doesn't
  support scalar parameters"), so every unit passes them as ``ignored_params``: they stay plain,
  replicated tensors, :func:`replicated_parameters` lists them and :func:`sync_gradients`
  averages their gradients (``ignored_params`` is torch's own escape hatch; reshaping them to
  ``[1]`` would change the model's state-dict shapes and cost an all-gather for one number).
* Every other parameter is sharded by :func:`shard_placement`: ``Shard(0)`` when dim 0 splits
  evenly over dp (torch's default), else the largest dim that does (a fused q/k/v ``[3, D, D]``
  at dp 2 shards ``D``: torchtitan's ``Shard(1)`` for experts, "to avoid padding"), else
  ``Shard(0)`` with FSDP's padding (a one-element ``[1]`` or a ``[1, 3]`` at dp 2: the last
  ranks hold empty shards).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Shard

from lightning_mmpar.parallel import comm


def has_fsdp(module: nn.Module) -> bool:
    """Whether any submodule is already sharded with ``fully_shard``."""
    return any(isinstance(m, FSDPModule) for m in module.modules())


def fsdp_managed(module: nn.Module) -> set[int]:
    """Ids of the parameters managed by some ``fully_shard`` unit under ``module``.

    0-dim parameters are never managed: torch's ``fully_shard`` raises on them unless they are
    in its ``ignored_params`` (ours always are)."""
    return {
        id(p)
        for m in module.modules()
        if isinstance(m, FSDPModule)
        for p in m.parameters()
        if p.ndim > 0
    }


def shard_placement(param: Tensor, dp: int) -> Shard:
    """FSDP2's placement of ``param`` over ``dp`` ranks (module docstring).

    The dims are those of this rank's local tensor (a tensor-parallel DTensor's shard, which is
    what FSDP2 splits). Returns ``Shard(0)`` if dim 0 divides by ``dp``, else ``Shard(d)`` for
    the largest dim ``d`` that does (the first such on ties), else ``Shard(0)`` (padded).
    Raises ``ValueError`` for a 0-dim ``param`` (keep it out of FSDP) or ``dp < 1``.
    """
    shape = tuple(comm.to_local(param).shape)
    if not shape:
        raise ValueError(
            "param is 0-dim; FSDP2 cannot shard it: pass it in fully_shard's ignored_params "
            "and average its gradient with sync_gradients."
        )
    if dp < 1:
        raise ValueError(f"dp ({dp}) must be a positive integer; pass the data-parallel mesh size.")
    if shape[0] % dp == 0:
        return Shard(0)
    even = [d for d, n in enumerate(shape) if n % dp == 0]
    if not even:
        return Shard(0)
    return Shard(max(even, key=lambda d: (shape[d], -d)))


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def is_expert_parameter(param: Tensor) -> bool:
    """Whether ``param`` is an expert weight sharded over the ``ep`` mesh alone (set up by
    :func:`lightning_mmpar.parallel.experts.apply_expert_parallel`, not yet sharded over edp)."""
    return isinstance(param, DTensor) and tuple(param.device_mesh.mesh_dim_names or ()) == ("ep",)


def expert_modules(module: nn.Module) -> list[nn.Module]:
    """Submodules holding expert-parallel weights directly (an MoE layer's ``experts``)."""
    return [
        m
        for m in module.modules()
        if any(is_expert_parameter(p) for p in m.parameters(recurse=False))
    ]


def check_expert_layers(module: nn.Module, ep: int) -> None:
    """Raise ``ValueError`` when ``ep > 1`` but ``module`` has no expert-parallel layer (the
    model's plan shards its MoE experts over ``ep`` in ``configure_model``)."""
    if ep > 1 and not expert_modules(module):
        raise ValueError(
            f"expert_parallel ({ep}) needs a model with expert-parallel MoE layers, but "
            f"{type(module).__name__} has none after configure_model(); configure MoE layers "
            "(e.g. model.fusion.language.moe) or set expert_parallel=1."
        )


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


def shard_experts(module: nn.Module, edp_mesh: DeviceMesh) -> None:
    """FSDP2 over the expert-data-parallel mesh for every expert module under ``module``
    (Megatron's ``expert_data_parallel`` group; torchtitan's ``dp_shard_mod_ep``): each expert
    weight, already ``Shard(0)`` over ``ep``, becomes a 2-D ``(edp, ep)`` DTensor whose
    reduce-scatter averages over the ``edp`` replicas (:func:`scale_expert_gradients` makes that
    the mean over all ``dp`` ranks)."""
    for m in expert_modules(module):
        if not isinstance(m, FSDPModule):
            fully_shard(m, mesh=edp_mesh, shard_placement_fn=lambda p: Shard(0))


def scale_expert_gradients(module: nn.Module, ep: int) -> None:
    """Set ``gradient_scale = 1 / ep`` on every expert module under ``module``.

    The all-to-all backward sums the gradients of every ep rank's tokens into each expert's
    owner; scaled by ``1 / ep`` in the graph, an average over the ``edp`` replicas (FSDP2's
    reduce-scatter or :func:`sync_gradients`) then gives ``(1 / dp) sum_r g_r``, the dense
    parameters' mean, and stays right under gradient accumulation (averaging is idempotent)."""
    for m in expert_modules(module):
        setattr(m, "gradient_scale", 1.0 / ep)  # noqa: B010 - any expert module class


def _fully_shard(module: nn.Module, dp_mesh: DeviceMesh, **fsdp_kwargs: Any) -> None:
    """``fully_shard`` with 0-dim parameters and expert weights (averaged over their own
    ``edp`` group: :func:`shard_experts` or the strategy's all-reduce) ignored,
    :func:`shard_placement` per parameter, ``fsdp_kwargs`` (``mp_policy``, ``offload_policy``:
    :class:`~lightning_mmpar.parallel.fsdp_options.MemoryOptions`) passed on."""
    dp = dp_mesh.size()
    params = list(module.parameters())
    ignored = {p for p in params if p.ndim == 0 or is_expert_parameter(p)}
    if ignored and len(ignored) == len(params):
        return  # nothing to shard: the scalars stay replicated
    # fully_shard registers new DTensor parameters: carry the partial-over-tp mark over
    partial = {n for n, p in module.named_parameters() if getattr(p, PARTIAL_OVER_TP, False)}
    fully_shard(
        module,
        mesh=dp_mesh,
        shard_placement_fn=lambda p: shard_placement(p, dp),
        ignored_params=ignored or None,
        **fsdp_kwargs,
    )
    for name, p in module.named_parameters():
        if name in partial:
            setattr(p, PARTIAL_OVER_TP, True)


def shard_blocks(
    blocks: Iterable[nn.Module], root: nn.Module, dp_mesh: DeviceMesh, **fsdp_kwargs: Any
) -> nn.Module:
    """``fully_shard`` each block (one all-gather unit each), then ``root`` over what remains.

    0-dim parameters stay replicated (:func:`replicated_parameters`)."""
    for block in blocks:
        if _has_params(block) and not isinstance(block, FSDPModule):
            _fully_shard(block, dp_mesh, **fsdp_kwargs)
    if _has_params(root):
        _fully_shard(root, dp_mesh, **fsdp_kwargs)
    return root


def apply_fsdp(module: nn.Module, dp_mesh: DeviceMesh, **fsdp_kwargs: Any) -> None:
    """Shard a plain module tree: every child of every ``ModuleList`` (transformer layers), then
    every direct child of ``module`` that holds parameters. Parameters registered directly on
    ``module`` and 0-dim parameters stay replicated; :func:`sync_gradients` averages them."""
    lists = [m for m in module.modules() if isinstance(m, nn.ModuleList)]
    for layers in lists:
        for layer in layers:
            if _has_params(layer) and not isinstance(layer, FSDPModule):
                _fully_shard(layer, dp_mesh, **fsdp_kwargs)
    for child in module.children():
        if isinstance(child, nn.ModuleList | nn.ModuleDict):
            continue  # containers have no forward; their layers are sharded above
        if _has_params(child) and not isinstance(child, FSDPModule):
            _fully_shard(child, dp_mesh, **fsdp_kwargs)


def replicated_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Trainable dense parameters that no FSDP unit averages (expert weights excluded:
    :func:`expert_parameters`)."""
    managed = fsdp_managed(module)
    return [
        p
        for p in module.parameters()
        if p.requires_grad and id(p) not in managed and not is_expert_parameter(p)
    ]


def expert_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Trainable expert weights sharded over ``ep`` that no FSDP unit reduces."""
    return [p for p in module.parameters() if p.requires_grad and is_expert_parameter(p)]


@torch.no_grad()
def broadcast_parameters(params: Iterable[Tensor], group: dist.ProcessGroup | None) -> None:
    """Copy group rank 0's values into every replica (what DDP does at construction); each
    DTensor's local shard is broadcast (replicas hold the same shard)."""
    for p in params:
        comm.broadcast(comm.to_local(p.data), src=0, group=group)


@torch.no_grad()
def sync_gradients(
    params: Iterable[Tensor], group: dist.ProcessGroup | None, op: comm.ReduceOp = "avg"
) -> None:
    """Average (``op="sum"``: sum) gradients over ``group`` with one coalesced all-reduce per
    dtype (local shards of DTensor gradients)."""
    if comm.group_size(group) == 1:
        return
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for p in params:
        if p.grad is not None:
            g = comm.to_local(p.grad)
            by_dtype.setdefault(g.dtype, []).append(g)
    for grads in by_dtype.values():
        flat = comm.all_reduce(torch.cat([g.reshape(-1) for g in grads]), op, group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


PARTIAL_OVER_TP = "_mmpar_partial_over_tp"
"""Attribute a plan sets (``True``) on parameters whose gradient each tensor-parallel rank
computes from its own share of the batch (a tower run data-parallel inside the tp group): the
strategy sums their gradients over ``tp`` after backward."""


def partial_over_tp_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Trainable parameters of ``module`` marked :data:`PARTIAL_OVER_TP`, each once."""
    seen: dict[int, nn.Parameter] = {}
    for p in module.parameters():
        if p.requires_grad and getattr(p, PARTIAL_OVER_TP, False):
            seen.setdefault(id(p), p)
    return list(seen.values())
