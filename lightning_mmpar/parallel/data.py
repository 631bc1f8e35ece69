"""Data parallelism of dense parameters on ``dp``: FSDP2 ``fully_shard`` (ZeRO-3 role) or
gradient all-reduce (DDP's role).

FSDP2 averages gradients with a reduce-scatter inside backward; under ``data_parallel="ddp"``
torch's DDP does in the layouts where it applies (:mod:`lightning_mmpar.parallel.replication`).
Parameters neither manages (``ddp`` in the other layouts, parameters held directly by the root
module, and 0-dim parameters) are averaged by :func:`sync_gradients`: one coalesced all-reduce
per dtype over the dp group, ``g <- (1/dp) * sum_r g_r``, which is what DDP computes.
:class:`GradientSync` holds those parameters and runs their all-reduces after backward.

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

Expert weights have their own data-parallel group (``edp``) and live in
:mod:`lightning_mmpar.parallel.expert_data`; the MoE layers' per-step state in
:mod:`lightning_mmpar.parallel.moe_state`.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import Shard

from lightning_mmpar.parallel import comm, expert_data
from lightning_mmpar.topology import ParallelDims

__all__ = [
    "PARTIAL_OVER_TP",
    "GradientSync",
    "apply_fsdp",
    "broadcast_parameters",
    "fill_missing_gradients",
    "fsdp_managed",
    "has_fsdp",
    "partial_over_tp_parameters",
    "replicated_parameters",
    "shard_blocks",
    "shard_data_parallel",
    "shard_placement",
    "sync_gradients",
]


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


def _fully_shard(module: nn.Module, dp_mesh: DeviceMesh, **fsdp_kwargs: Any) -> None:
    """``fully_shard`` with 0-dim parameters and expert weights (averaged over their own
    ``edp`` group: :mod:`~lightning_mmpar.parallel.expert_data`) ignored,
    :func:`shard_placement` per parameter, ``fsdp_kwargs`` (``mp_policy``, ``offload_policy``:
    :class:`~lightning_mmpar.parallel.fsdp_options.MemoryOptions`) passed on."""
    dp = dp_mesh.size()
    params = list(module.parameters())
    ignored = {p for p in params if p.ndim == 0 or expert_data.is_expert_parameter(p)}
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
    :func:`~lightning_mmpar.parallel.expert_data.expert_parameters`)."""
    managed = fsdp_managed(module)
    return [
        p
        for p in module.parameters()
        if p.requires_grad and id(p) not in managed and not expert_data.is_expert_parameter(p)
    ]


@torch.no_grad()
def broadcast_parameters(params: Iterable[Tensor], group: dist.ProcessGroup | None) -> None:
    """Copy group rank 0's values into every replica (what DDP does at construction); each
    DTensor's local shard is broadcast (replicas hold the same shard)."""
    for p in params:
        comm.broadcast(comm.to_local(p.data), src=0, group=group)


@torch.no_grad()
def fill_missing_gradients(params: Iterable[Tensor], group: dist.ProcessGroup | None) -> None:
    """Give a zero gradient to each parameter of ``params`` that has none on this rank but has
    one on a peer of ``group`` (a module skipped on this rank only); a parameter without a
    gradient on every rank keeps ``None``. One all-reduce of one flag per parameter (torch
    DDP's used-parameter map under ``find_unused_parameters``). ``params``: the same list, in
    the same order, on every rank. Collective over ``group``."""
    params = list(params)
    if not params or comm.group_size(group) == 1:
        return
    used = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
    comm.all_reduce(used, "max", group)
    for p, anywhere in zip(params, used.tolist(), strict=True):
        if anywhere and p.grad is None:
            p.grad = torch.zeros_like(p)


@torch.no_grad()
def sync_gradients(
    params: Iterable[Tensor],
    group: dist.ProcessGroup | None,
    op: comm.ReduceOp = "avg",
    fill_missing: bool = False,
) -> None:
    """Average (``op="sum"``: sum) gradients over ``group`` with one coalesced all-reduce per
    dtype (local shards of DTensor gradients). ``fill_missing``: first
    :func:`fill_missing_gradients`, so a parameter some ranks did not use cannot make the
    ranks' buffers differ in size (without it, every rank must hold the same gradients)."""
    if comm.group_size(group) == 1:
        return
    if fill_missing:
        params = list(params)
        fill_missing_gradients(params, group)
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


def shard_data_parallel(
    module: nn.Module,
    dims: ParallelDims,
    blocks: Iterable[nn.Module] | None = None,
    **fsdp_kwargs: Any,
) -> nn.Module:
    """FSDP2 for ``module`` (a pipeline stage's chunk or a whole model): its expert modules over
    ``edp`` when ``dims.edp > 1`` (:func:`~lightning_mmpar.parallel.expert_data.shard_experts`),
    then ``blocks`` one unit each and ``module`` over what remains (:func:`shard_blocks`), or,
    without ``blocks``, the plain module tree (:func:`apply_fsdp`), over ``dp``. ``fsdp_kwargs``:
    ``mp_policy`` / ``offload_policy``. Collective over ``dp`` (and ``edp``); returns ``module``."""
    if dims.edp > 1:
        expert_data.shard_experts(module, dims.get_mesh("edp"))
    if blocks is None:
        apply_fsdp(module, dims.get_mesh("dp"), **fsdp_kwargs)
        return module
    return shard_blocks(blocks, module, dims.get_mesh("dp"), **fsdp_kwargs)


@dataclass
class GradientSync:
    """The gradients no FSDP2 unit reduces, and the all-reduce each needs after backward.

    ``partial_over_tp``: :data:`PARTIAL_OVER_TP` parameters, summed over ``tp`` (each tp rank
    computed its share of the batch); ``replicated``: dense parameters no FSDP unit or torch
    DDP manages (all of them under ``data_parallel="ddp"`` where
    :func:`~lightning_mmpar.parallel.replication.ddp_fallback` keeps this path), averaged over
    ``dp``; ``experts``: expert
    weights no FSDP unit manages, averaged over ``edp`` (DDP's all-reduce, Megatron's
    expert-data-parallel reduction). Build with :meth:`of` after sharding.
    """

    partial_over_tp: list[nn.Parameter] = field(default_factory=list)
    replicated: list[nn.Parameter] = field(default_factory=list)
    experts: list[nn.Parameter] = field(default_factory=list)
    fill_missing: bool = False
    """``replicated`` gradients missing on some ranks are reduced as zeros
    (:func:`fill_missing_gradients`: one more small all-reduce per step); set for modules whose
    parts the strategy cannot tell always run (no ``pipeline_blocks``)."""

    @classmethod
    def of(
        cls,
        module: nn.Module,
        dims: ParallelDims,
        data_parallel: str,
        reduced: Collection[int] = frozenset(),
    ) -> GradientSync:
        """The lists of ``module`` (sharded already) under ``dims``; ``data_parallel="none"`` or
        ``dims.dp == 1``: no dp / edp all-reduce. ``reduced``: ids of parameters torch's DDP
        reduces in backward (:func:`~lightning_mmpar.parallel.replication.replicate_module`), left
        out of ``replicated``."""
        partial = partial_over_tp_parameters(module) if dims.tp > 1 else []
        if dims.dp == 1 or data_parallel == "none":
            return cls(partial_over_tp=partial)
        dense = [p for p in replicated_parameters(module) if id(p) not in reduced]
        return cls(partial, dense, expert_data.expert_parameters(module))

    def broadcast(self, dims: ParallelDims) -> None:
        """Group rank 0's values into every replica, ``dp`` and ``edp`` (what DDP does at
        construction). Collective over those groups when they have parameters to sync."""
        if self.replicated:
            broadcast_parameters(self.replicated, dims.get_group("dp"))
        if self.experts:
            broadcast_parameters(self.experts, dims.get_group("edp"))

    def sync(self, dims: ParallelDims) -> None:
        """After backward: the sums and means above (each a no-op on a one-rank group)."""
        if self.partial_over_tp:  # each tp rank's share of the batch: sum over tp
            sync_gradients(self.partial_over_tp, dims.get_group("tp"), "sum")
        if self.replicated:
            sync_gradients(self.replicated, dims.get_group("dp"), fill_missing=self.fill_missing)
        if self.experts:  # expert weights: mean over their edp replicas (ep ranks differ)
            sync_gradients(self.experts, dims.get_group("edp"))


_MOVED = {
    **dict.fromkeys(
        (
            "check_expert_layers",
            "expert_modules",
            "expert_parameters",
            "is_expert_parameter",
            "scale_expert_gradients",
            "shard_experts",
        ),
        "lightning_mmpar.parallel.expert_data",
    ),
    **dict.fromkeys(
        ("average_density_estimates", "set_aux_loss_scale", "update_expert_biases"),
        "lightning_mmpar.parallel.moe_state",
    ),
}
"""Names that moved out of this module -> their module (deprecated aliases, one release)."""


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"lightning_mmpar.parallel.data.{name} moved to {_MOVED[name]}.{name}; import it from "
        "there (the old path goes in the next release).",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(_MOVED[name]), name)
