"""Expert weights under data parallelism: their own group (``edp``), gradient scale and shards.

Expert parallelism is carved out of the data-parallel ranks (``dp = edp * ep``, Megatron's
``expert_data_parallel`` group; torchtitan's ``dp_shard_mod_ep``): an expert weight, already
``Shard(0)`` over the 1-D ``ep`` mesh
(:func:`lightning_mmpar.parallel.experts.apply_expert_parallel`), has ``edp`` replicas, not
``dp``. This module finds those weights (:func:`is_expert_parameter`,
:func:`expert_modules`), shards them with FSDP2 over ``edp`` (:func:`shard_experts`) or lists
them for an all-reduce over ``edp`` (:func:`expert_parameters`), and scales their gradients so
that the ``edp`` average equals the dense parameters' ``dp`` mean
(:func:`scale_expert_gradients`). The dense parameters' data parallelism is
:mod:`lightning_mmpar.parallel.data`.
"""

from __future__ import annotations

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Shard

__all__ = [
    "check_expert_layers",
    "expert_modules",
    "expert_parameters",
    "is_expert_parameter",
    "prepare_expert_gradients",
    "scale_expert_gradients",
    "shard_experts",
]


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


def scale_expert_gradients(module: nn.Module, ep: int) -> None:
    """Set ``gradient_scale = 1 / ep`` on every expert module under ``module``.

    The all-to-all backward sums the gradients of every ep rank's tokens into each expert's
    owner; scaled by ``1 / ep`` in the graph, an average over the ``edp`` replicas (FSDP2's
    reduce-scatter or :func:`lightning_mmpar.parallel.data.sync_gradients`) then gives
    ``(1 / dp) sum_r g_r``, the dense parameters' mean, and stays right under gradient
    accumulation (averaging is idempotent)."""
    for m in expert_modules(module):
        setattr(m, "gradient_scale", 1.0 / ep)  # noqa: B010 - any expert module class


def prepare_expert_gradients(module: nn.Module, ep: int) -> None:
    """:func:`check_expert_layers`, then :func:`scale_expert_gradients`: the expert side of
    data parallelism, before any sharding. Raises ``ValueError`` as the former."""
    check_expert_layers(module, ep)
    scale_expert_gradients(module, ep)


def shard_experts(module: nn.Module, edp_mesh: DeviceMesh) -> None:
    """FSDP2 over the expert-data-parallel mesh for every expert module under ``module``: each
    expert weight, already ``Shard(0)`` over ``ep``, becomes a 2-D ``(edp, ep)`` DTensor whose
    reduce-scatter averages over the ``edp`` replicas (:func:`scale_expert_gradients` makes that
    the mean over all ``dp`` ranks)."""
    for m in expert_modules(module):
        if not isinstance(m, FSDPModule):
            fully_shard(m, mesh=edp_mesh, shard_placement_fn=lambda p: Shard(0))


def expert_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Trainable expert weights sharded over ``ep`` that no FSDP unit reduces."""
    return [p for p in module.parameters() if p.requires_grad and is_expert_parameter(p)]
