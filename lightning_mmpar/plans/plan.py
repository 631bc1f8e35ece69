"""A model's parallel plan as data, and the one function that applies it.

A :class:`ParallelPlan` says, for one built model, *what* each parallelism does to it:

* ``tensor_parallel``: :class:`~lightning_mmpar.parallel.tensor.StyleGroup` s, DTensor styles per
  submodule on a named 1-D mesh (``tp``, or ``vl`` for the vision-language group);
* ``activation_checkpointing``: the submodules whose activations are recomputed in backward
  instead of stored (non-reentrant checkpointing, applied as hooks: parameter names unchanged);
* ``dropout_regions``: which ``nn.Dropout`` submodules become
  :class:`~lightning_mmpar.parallel.random.ParallelDropout` and in which RNG region
  (``replicated`` for TP-replicated activations, ``tensor-parallel`` for TP-sharded ones), so
  masks follow the activation's layout (Megatron's model-parallel RNG);
* ``expert_parallel``: the mixture-of-experts layers whose experts are sharded over the ``ep``
  mesh with all-to-all dispatch (:func:`~lightning_mmpar.parallel.experts.apply_expert_parallel`;
  experts are replicated over ``tp``);
* ``pipeline_blocks``: the model's ordered blocks. They are also the FSDP units: the strategy
  cuts the blocks into pipeline stages and then applies FSDP2 ``fully_shard`` once per block of
  this rank's stages (:func:`lightning_mmpar.parallel.data.shard_blocks`), plus once on the root
  for what remains.

:func:`apply_plan` applies the plan in torchtitan's order (``parallelize_llama``): tensor
parallelism -> activation checkpointing -> (the strategy, later) pipeline split -> FSDP. TP comes
first because FSDP shards the DTensors TP made (2-D ``(dp, tp)`` parameters), and checkpointing
before FSDP so the recomputed forward runs inside the FSDP unit's all-gathered parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_mmpar import compat
from lightning_mmpar.parallel.comm import group_device
from lightning_mmpar.parallel.experts import apply_expert_parallel
from lightning_mmpar.parallel.random import ParallelDropout, checkpoint_rng_contexts, seed_regions
from lightning_mmpar.parallel.tensor import StyleGroup, apply_styles
from lightning_mmpar.topology import ParallelDims

__all__ = [
    "ParallelPlan",
    "apply_plan",
    "checkpoint_activations",
    "install_parallel_dropout",
    "plan_meshes",
    "tp_meshes",
]


@dataclass(frozen=True, kw_only=True)
class ParallelPlan:
    """How one model is parallelized; built by a model family's plan function (``plans.*``)."""

    tensor_parallel: tuple[StyleGroup, ...] = ()
    """TP/SP styles, applied in order."""
    activation_checkpointing: tuple[str, ...] = ()
    """Paths of the submodules recomputed in backward (empty: no checkpointing)."""
    dropout_regions: tuple[tuple[str, str], ...] = ()
    """``(path of an nn.Dropout, RNG region)`` pairs (empty: dropout left as it is)."""
    pipeline_blocks: Callable[[], Sequence[nn.Module]] | None = None
    """The model's ordered pipeline blocks (also its FSDP units); ``None``: not pipelined."""
    expert_parallel: tuple[str, ...] = ()
    """Paths of the MoE layers sharded over the ``ep`` mesh when it has more than one rank."""

    def fsdp_units(self) -> list[nn.Module]:
        """One ``fully_shard`` unit per pipeline block (the strategy applies them after the
        pipeline split); empty for a model without blocks."""
        return list(self.pipeline_blocks()) if self.pipeline_blocks is not None else []


def checkpoint_activations(root: nn.Module, paths: Sequence[str]) -> nn.Module:
    """Recompute each listed submodule's forward in backward instead of storing its activations.

    Uses torch's composable, non-reentrant ``checkpoint`` (forward pre/post hooks: module tree
    and parameter names unchanged; the default generators and the model-parallel RNG tracker's
    regions replayed, so dropout masks match). Applying it twice
    to one module raises torch's error. Returns ``root``.
    """
    for path in paths:
        compat.checkpoint_module(root.get_submodule(path), context_fn=checkpoint_rng_contexts)
    return root


def install_parallel_dropout(
    root: nn.Module, regions: Sequence[tuple[str, str]], dims: ParallelDims
) -> nn.Module:
    """Replace each listed ``nn.Dropout`` of ``root`` by a
    :class:`~lightning_mmpar.parallel.random.ParallelDropout` (same ``p``, mode) drawing in the
    given region with ``dims``' coordinates, and seeds the regions afresh from
    ``torch.initial_seed()`` unless they were seeded explicitly (collective over the tp group
    when it installs any); returns ``root``.

    Raises ``ValueError`` when a path is not an ``nn.Dropout`` or a region is unknown.
    """
    for path, region in regions:
        old = root.get_submodule(path)
        if not isinstance(old, nn.Dropout):
            raise ValueError(
                f"dropout_regions: {path} is a {type(old).__name__}, not an nn.Dropout; list "
                "only dropout modules."
            )
        parent, _, name = path.rpartition(".")
        new = ParallelDropout.from_dropout(old, region=region, dims=dims)
        root.get_submodule(parent).register_module(name, new)
    if regions:
        seed_regions(dims)
    return root


def apply_plan(
    module: nn.Module,
    plan: ParallelPlan,
    meshes: Mapping[str, DeviceMesh],
    dims: ParallelDims | None = None,
) -> nn.Module:
    """Apply ``plan`` to ``module`` in place: parallel dropout (when ``dims`` spans more than
    one process), TP styles on ``meshes`` (none given: no TP), expert parallelism on
    ``dims.get_mesh("ep")`` (when ``dims.ep > 1``), then activation checkpointing. FSDP is the
    strategy's, after the pipeline split. Returns ``module``."""
    if dims is not None and dims.world_size > 1:
        install_parallel_dropout(module, plan.dropout_regions, dims)
    if meshes:
        apply_styles(module, plan.tensor_parallel, meshes)
    if dims is not None and dims.ep > 1:
        for path in plan.expert_parallel:
            apply_expert_parallel(module.get_submodule(path), dims.get_mesh("ep"))
    return checkpoint_activations(module, plan.activation_checkpointing)


def tp_meshes(
    tp_mesh: DeviceMesh, vl_group: dist.ProcessGroup | None = None
) -> dict[str, DeviceMesh]:
    """``{"tp": tp_mesh, "vl": ...}``: the vision-language mesh on ``vl_group`` (same ranks as
    ``tp_mesh``, its own communicator), or ``tp_mesh`` itself when ``vl_group`` is ``None``.

    Raises ``ValueError`` for a mesh that is not 1-D or a ``vl_group`` of other ranks.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"tp_mesh must be 1-D (got {tp_mesh.ndim} dims); pass mesh['tp'].")
    vl_mesh = tp_mesh
    if vl_group is not None:
        if dist.get_process_group_ranks(vl_group) != tp_mesh.mesh.tolist():
            raise ValueError("vl_group must hold the same ranks, in the same order, as tp_mesh.")
        vl_mesh = DeviceMesh.from_group(vl_group, tp_mesh.device_type, mesh_dim_names=("vl",))
    return {"tp": tp_mesh, "vl": vl_mesh}


def plan_meshes(dims: ParallelDims) -> dict[str, DeviceMesh]:
    """The meshes a plan runs on for ``dims``: empty when ``dims.tp == 1`` (nothing to shard).

    Dims that built their own mesh (``mm_parallel``) give ``mesh["tp"]`` and their dedicated
    ``vl`` mesh (same root mesh, so FSDP2 on the dp mesh composes with both); dims describing
    another strategy's layout (Lightning's ``ModelParallelStrategy``) give a new 1-D mesh on
    its tp group, which also serves as the ``vl`` mesh (enough for TP;
    FSDP2 over that strategy's own dp mesh would want its ``tensor_parallel`` sub-mesh, which
    :meth:`ParallelDims.of` does not keep).
    """
    if dims.tp == 1:
        return {}
    if dims.is_built:
        return {"tp": dims.get_mesh("tp"), "vl": dims.vl_mesh}
    group = dims.get_group("tp")
    assert group is not None, "a dimension of size > 1 has a process group"
    return tp_meshes(DeviceMesh.from_group(group, group_device(group).type))
