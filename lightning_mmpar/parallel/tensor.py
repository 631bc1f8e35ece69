"""Tensor parallelism for any model: two DTensor styles, one applier, and gathering helpers.

Megatron's two patterns on DTensor (``torch.distributed.tensor.parallel``):

* column parallel ``Y = X A``, ``A = [A_1 ... A_p]`` split along its second dim (output features);
  the input is replicated (copy forward, all-reduce of its gradient backward: Megatron's ``f``);
* row parallel ``Y = sum_r X_r A_r``, ``A`` split along its first dim (input features); the
  partial sums are all-reduced (or reduce-scattered along the sequence under sequence parallel).

torch ships both (``ColwiseParallel``, ``RowwiseParallel``); this module adds the two styles the
package's models need on top (a fused q/k/v projection sharded by whole heads, and a replicated
parameter applied to head-sharded activations) and :func:`apply_styles`, which applies a plan's
``(submodule, mesh, styles)`` groups. Which module gets which style is a model's plan
(:mod:`lightning_mmpar.plans`); nothing here knows a model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from lightning_mmpar.parallel import comm

__all__ = [
    "FusedQKVColwiseParallel",
    "HeadShardedReplicate",
    "SequenceLengthCheck",
    "StyleGroup",
    "apply_styles",
    "full_gradients",
    "full_state_dict",
    "gather_rows",
    "local_rows",
]


class FusedQKVColwiseParallel(ParallelStyle):
    """Column parallel for a fused q/k/v projection held ``[3, D, D_in]``, by whole heads.

    ``weight [3, D, D_in]`` and ``bias [3, D]`` become ``Shard(1)`` DTensors: rank ``r`` holds
    ``[W_q,r; W_k,r; W_v,r]`` (its ``H / p`` heads of each), while the DTensor's global value stays
    the canonical, TP-size-independent weight (``full_tensor().flatten(0, 1)`` is open_clip's
    ``in_proj_weight``), so DCP checkpoints reshard across TP sizes. The input is read as
    ``Replicate`` (its gradient, partial per rank, is all-reduced) and ``q, k, v`` come back as
    local ``[..., D / p]`` tensors for the attention's local heads.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        src = self.src_data_rank

        def partition(_name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, p in list(mod.named_parameters(recurse=False)):
                dt = distribute_tensor(p.detach(), mesh, [Shard(1)], src_data_rank=src)
                mod.register_parameter(pname, nn.Parameter(dt, requires_grad=p.requires_grad))

        def inputs(_mod: nn.Module, args: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
            x = args[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            return (x, *args[1:])

        def outputs(_mod: nn.Module, out: tuple[DTensor, ...], _mesh: DeviceMesh) -> Any:
            return tuple(t.to_local() for t in out)

        return distribute_module(module, device_mesh, partition, inputs, outputs)  # type: ignore[arg-type]


class HeadShardedReplicate(ParallelStyle):
    """A replicated parameter applied to a head-sharded tensor (a per-head temperature, say).

    Parameters become ``Replicate`` DTensors and the first input (``[B, H/p, S, d]`` local) is
    read as ``Shard(1)``; the parameter's gradient, a sum over heads, comes out ``Partial`` and
    is all-reduced, so every rank holds the full-model gradient.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(_name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, p in list(mod.named_parameters(recurse=False)):
                dt = distribute_tensor(p.detach(), mesh, [Replicate()])
                mod.register_parameter(pname, nn.Parameter(dt, requires_grad=p.requires_grad))

        def inputs(_mod: nn.Module, args: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
            return (DTensor.from_local(args[0], mesh, [Shard(1)], run_check=False), *args[1:])

        def outputs(_mod: nn.Module, out: DTensor, _mesh: DeviceMesh) -> Tensor:
            return out.to_local()

        return distribute_module(module, device_mesh, partition, inputs, outputs)  # type: ignore[arg-type]


class SequenceLengthCheck(ParallelStyle):
    """No sharding: checks that the first input's dim 1 (the sequence) divides by the mesh size.

    Sequence parallelism shards activations ``[B, T, D]`` along ``T``; a ``T`` that does not
    divide by the tensor-parallel size would fail deep inside a reduce-scatter. This style puts a
    forward pre-hook on the module where the sequence enters (the token embedding) that raises a
    ``ValueError`` naming the length, the size and the padded length to use.
    """

    def __init__(self, input_name: str = "input_ids") -> None:
        super().__init__()
        self.input_name = input_name

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp, name = device_mesh.size(), self.input_name

        def hook(_module: nn.Module, args: tuple[Any, ...]) -> None:
            length = args[0].shape[1]
            if length % tp != 0:
                raise ValueError(
                    f"sequence_parallel needs the text length ({length}) divisible by the "
                    f"tensor-parallel size ({tp}); pad {name} to {-(-length // tp) * tp} tokens."
                )

        module.register_forward_pre_hook(hook)
        return module


@dataclass(frozen=True)
class StyleGroup:
    """Styles for the submodules of one module, applied on one named mesh (a plan's unit).

    ``styles`` maps paths relative to ``path`` to styles, as ``parallelize_module`` takes them, or
    is one style for the module at ``path`` itself.
    """

    path: str
    """Submodule path from the root (``""``: the root itself)."""
    mesh: str
    """Name of the 1-D mesh it runs on, a key of :func:`apply_styles`'s ``meshes`` (``tp``...)."""
    styles: Mapping[str, ParallelStyle] | ParallelStyle
    """What ``parallelize_module`` applies."""

    def names(self) -> list[str]:
        """Full paths (from the root) of the modules this group styles."""
        if isinstance(self.styles, ParallelStyle):
            return [self.path]
        return [f"{self.path}.{k}" if self.path else k for k in self.styles]


def apply_styles(
    root: nn.Module, groups: Sequence[StyleGroup], meshes: Mapping[str, DeviceMesh]
) -> nn.Module:
    """Apply every group, in order, to ``root``'s submodules in place; returns ``root``.

    Raises ``KeyError`` naming the group when its mesh is not in ``meshes``, and
    ``AttributeError`` (from ``get_submodule``) when a path does not exist.
    """
    for group in groups:
        if group.mesh not in meshes:
            raise KeyError(
                f"style group {group.path!r} runs on mesh {group.mesh!r}, which is not among the "
                f"meshes given ({', '.join(meshes)})."
            )
        styles = group.styles if isinstance(group.styles, ParallelStyle) else dict(group.styles)
        parallelize_module(root.get_submodule(group.path), meshes[group.mesh], styles)
    return root


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """Unsharded state dict: ``model.state_dict()`` with every DTensor gathered (collective over
    its mesh). Equals the unsharded model's ``state_dict()`` at every TP size when the plan keeps
    parameters in their canonical layout (as :class:`FusedQKVColwiseParallel` does).
    """
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach()
        for k, v in model.state_dict().items()
    }


def full_gradients(model: nn.Module) -> dict[str, Tensor]:
    """Unsharded gradients by parameter name, shaped like the unsharded model's parameters
    (collective, like :func:`full_state_dict`; a ``Partial`` gradient comes back reduced);
    parameters without a gradient are left out."""
    grads: dict[str, Tensor] = {}
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        grad = param.grad
        grads[name] = grad.full_tensor() if isinstance(grad, DTensor) else grad
    return grads


def local_rows(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Rank ``r``'s rows ``[r B / P, (r + 1) B / P)`` of ``x [B, ...]`` over a group of ``P``
    ranks (a view: differentiable, no communication); ``x`` itself when ``P == 1``.

    Raises ``ValueError`` when ``B`` is not a multiple of ``P`` (callers catch it to name their
    own fix, as :mod:`lightning_mmpar.plans.fusion_vision` does).
    """
    size = comm.group_size(group)
    if size == 1:
        return x
    if x.shape[0] % size:
        raise ValueError(f"local_rows: {x.shape[0]} rows do not split over {size} ranks.")
    n = x.shape[0] // size
    return x[comm.group_rank(group) * n : (comm.group_rank(group) + 1) * n]


class _GatherRows(torch.autograd.Function):
    """All-gather along dim 0; backward keeps this rank's rows of the (replicated) gradient."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:  # type: ignore[override]
        ctx.group, ctx.rows = group, x.shape[0]  # no tensor saved: checkpoint-neutral
        return torch.cat(comm.all_gather(x.contiguous(), group), dim=0)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        start = comm.group_rank(ctx.group) * ctx.rows
        return grad[start : start + ctx.rows], None


def gather_rows(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Concatenate every rank's ``x [b, ...]`` (equal shapes) along dim 0: ``[P b, ...]`` in
    group-rank order, the inverse of :func:`local_rows`; ``x`` itself when ``P == 1``.

    Backward: the gradient of the result must be the same on every rank (the gathered tensor
    feeds replicated computation, e.g. a tensor-parallel model's replicated activations), so each
    rank takes its own ``b`` rows of it, no reduction (Megatron-LM's
    ``gather_from_sequence_parallel_region`` with ``tensor_parallel_output_grad=False``).
    Parameters upstream of ``x`` then hold gradients of this rank's rows only; sum them over
    ``group`` after backward (:data:`lightning_mmpar.parallel.data.PARTIAL_OVER_TP`).
    """
    if comm.group_size(group) == 1:
        return x
    out: Tensor = _GatherRows.apply(x, group)
    return out
