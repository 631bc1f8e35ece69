"""The one parallelize path: a model's :class:`ParallelPlan` (data) and :func:`parallelize`.

A LightningModule describes how its model is parallelized with an optional method
``parallel_plan(dims) -> ParallelPlan | None`` (:data:`PLAN_HOOK`; the package's plans are built
in :mod:`lightning_mmpar.plans`); the ``mm_parallel`` strategy calls :func:`parallelize` once,
in ``setup``, with that plan and its own options, in torchtitan's order (``parallelize_llama``;
its MoE models add expert parallelism after TP; pipelining as in ``pipeline_llm``, before FSDP):

1. tensor (and sequence) parallelism: the plan's DTensor styles, after its model-parallel
   dropout regions (:func:`install_parallel_dropout`);
2. expert parallelism: the plan's mixture-of-experts layers over the ``ep`` mesh, then the
   plan's own steps (:attr:`ParallelPlan.after_model_parallel`: hooks that are not DTensor
   styles, reading this rank's slices of meta parameters);
3. activation checkpointing and ``torch.compile`` per block (:mod:`.activation`: the strategy's
   ``activation_checkpointing``, else the plan's deprecated model-side choice);
4. the pipeline split into stages (:class:`~lightning_mmpar.parallel.pipeline.PipelineEngine`);
5. FSDP2 once per block of this rank's stages plus the root (:mod:`.data`), or replication:
   torch's DDP on the chunk at ``tp == pp == 1``, else gradients all-reduced after backward
   (:mod:`.replication`). Before any sharding every replica gets its dp group's rank-0 state
   (parameters, frozen ones too, and persistent buffers:
   :func:`.replication.broadcast_module_state`).

TP comes first because FSDP shards the DTensors TP made (2-D ``(dp, tp)`` parameters),
checkpointing before FSDP so a recomputed forward runs inside its unit's all-gathered
parameters, and the split before FSDP so each rank shards only its own stages' blocks.

A module that applies tensor parallelism itself in ``configure_model`` (Lightning
``ModelParallelStrategy`` style) provides no plan, or one without styles: steps 3-5 still apply.
Under another strategy (DDP, DeepSpeed, Lightning's ``ModelParallelStrategy``), which calls no
``parallelize``, a module applies steps 1-2 of its own plan in ``configure_model``
(:func:`apply_model_parallel`, when :func:`applies_plans` is false), as the recipe does.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from lightning_mmpar.config import ParallelConfig
from lightning_mmpar.layout import StagePlan
from lightning_mmpar.parallel import activation, deferred, replication
from lightning_mmpar.parallel import data as dpar
from lightning_mmpar.parallel.comm import group_device
from lightning_mmpar.parallel.data import GradientSync
from lightning_mmpar.parallel.expert_data import check_expert_layers, prepare_expert_gradients
from lightning_mmpar.parallel.experts import apply_expert_parallel
from lightning_mmpar.parallel.fsdp_options import MemoryOptions
from lightning_mmpar.parallel.pipeline import PipelineChunk, PipelineEngine, PipelineModule
from lightning_mmpar.parallel.pipeline.stages import stage_plan_for
from lightning_mmpar.parallel.random import ParallelDropout, seed_regions
from lightning_mmpar.parallel.tensor import StyleGroup, apply_styles
from lightning_mmpar.parallel.unit_order import UnitOrderGuard
from lightning_mmpar.topology import ParallelDims

__all__ = [
    "PLAN_HOOK",
    "ParallelPlan",
    "ParallelizeOptions",
    "Parallelized",
    "ShardFn",
    "UnappliedDegreeError",
    "applies_plans",
    "apply_model_parallel",
    "check_degrees_applied",
    "check_pipeline_module",
    "checkpoint_and_compile",
    "data_parallel_step",
    "install_parallel_dropout",
    "module_plan",
    "parallelize",
    "plan_meshes",
    "split_pipeline",
    "tp_meshes",
]

PLAN_HOOK = "parallel_plan"
"""Name of the optional LightningModule method ``(dims: ParallelDims) -> ParallelPlan | None``."""

ShardFn = Callable[..., nn.Module]
"""``shard(piece, blocks=None) -> piece``: FSDP2 over one piece of the model
(:func:`lightning_mmpar.parallel.data.shard_data_parallel` with the layout and options bound)."""

_APPLIED = "_mmpar_model_parallel"  # set on a root once steps 1-2 ran (idempotent)


@dataclass(frozen=True, kw_only=True)
class ParallelPlan:
    """How one model is parallelized, as data; built by a model family's plan (``plans.*``).

    Paths are relative to :attr:`root` (``None``: the module :func:`parallelize` is given).
    """

    tensor_parallel: tuple[StyleGroup, ...] = ()
    """TP/SP styles, applied in order (on the ``tp`` mesh, or ``vl`` for the vision-language
    group: :func:`plan_meshes`)."""
    dropout_regions: tuple[tuple[str, str], ...] = ()
    """``(path of an nn.Dropout, RNG region)`` pairs (empty: dropout left as it is)."""
    expert_parallel: tuple[str, ...] = ()
    """Paths of the MoE layers sharded over the ``ep`` mesh when it has more than one rank
    (:func:`~lightning_mmpar.parallel.experts.apply_expert_parallel`; experts replicated over
    ``tp``)."""
    after_model_parallel: tuple[Callable[[ParallelDims], None], ...] = ()
    """Steps run with the run's dims once TP and EP are applied, before activation
    checkpointing, the pipeline split and FSDP: forward hooks that are not DTensor styles (the
    fusion ViT's data-parallel split and gather), reading this rank's tensor-parallel slices
    into meta parameters (the recipe's pretrained towers)."""
    layers: tuple[str, ...] = ()
    """Paths of the model's repeated layers: what ``activation_checkpointing="layers"``
    recomputes (empty: every block)."""
    checkpointing: activation.Checkpointing = None
    """The module's own activation-checkpointing choice, used when the strategy's
    ``activation_checkpointing`` is ``None``; set only by the deprecated model-side option
    (``model.plan.activation_checkpointing: true`` -> ``"layers"``)."""
    pipeline_blocks: Callable[[], Sequence[nn.Module]] | None = None
    """The model's ordered pipeline blocks (also its FSDP units); ``None``: not pipelined."""
    root: nn.Module | None = None
    """The module the paths are relative to (``None``: the module being parallelized)."""
    activation_checkpointing: tuple[str, ...] = ()
    """Deprecated: paths checkpointed whatever the options; name them in :attr:`layers` and
    choose ``activation_checkpointing="layers"`` (the strategy's option) instead."""

    def __post_init__(self) -> None:
        activation.check_checkpointing(self.checkpointing)
        if self.activation_checkpointing:
            warnings.warn(
                "ParallelPlan(activation_checkpointing=paths) is deprecated: give the paths as "
                "ParallelPlan(layers=...) and choose the strategy's activation_checkpointing="
                "'layers'.",
                DeprecationWarning,
                stacklevel=3,
            )

    def fsdp_units(self) -> list[nn.Module]:
        """One ``fully_shard`` unit per pipeline block (the strategy applies them after the
        pipeline split); empty for a model without blocks."""
        return list(self.pipeline_blocks()) if self.pipeline_blocks is not None else []


@dataclass(frozen=True)
class ParallelizeOptions:
    """What :func:`parallelize` takes from the strategy besides the plan."""

    config: ParallelConfig
    """Degrees, pipeline schedule and partition, data-parallel engine."""
    memory: MemoryOptions = field(default_factory=MemoryOptions)
    """Precision and memory options (FSDP2 policies, checkpointing, compilation)."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """This rank's device (pipeline buffers, deferred parameters). ``meta``: a dry run
    (:mod:`lightning_mmpar.recipes.dryrun`): every step runs on meta parameters, except the
    module's ``load_sharded_parameters`` hook and the replicas' broadcast, which need storage
    (skipped)."""
    check_unit_order: bool = True
    """Guard the FSDP2 units of a module without ``pipeline_blocks`` against ranks entering
    different units (:class:`~lightning_mmpar.parallel.unit_order.UnitOrderGuard`); ``False``:
    no guard (a module that never skips a unit)."""


@dataclass
class Parallelized:
    """What :func:`parallelize` built, for the strategy's steps and backward."""

    pipeline: PipelineEngine | None = None
    """The pipeline engine (``pipeline_parallel > 1``)."""
    chunk: PipelineChunk | None = None
    """All blocks as one chunk (a ``PipelineModule`` at ``pipeline_parallel == 1``)."""
    stage_plan: StagePlan | None = None
    """The partition in use (``pipeline_parallel > 1``)."""
    grad_sync: GradientSync = field(default_factory=GradientSync)
    """The gradients no FSDP unit or DDP reduces and their all-reduces after backward (tp, dp,
    edp)."""
    replicated: nn.Module | None = None
    """The module torch's DDP replicates (``data_parallel="ddp"`` where
    :func:`~lightning_mmpar.parallel.replication.ddp_fallback` allows it: the chunk at
    ``pipeline_parallel == 1``), else ``None``."""
    unit_order: UnitOrderGuard | None = None
    """A module without ``pipeline_blocks`` sharded by FSDP2 over several data-parallel ranks:
    the check that every rank enters the same FSDP2 unit next (a part skipped on some ranks
    only raises one clear error, not a hang: :mod:`~lightning_mmpar.parallel.unit_order`)."""


def module_plan(module: Any, dims: ParallelDims) -> ParallelPlan | None:
    """``module.parallel_plan(dims)`` (:data:`PLAN_HOOK`) when the module defines it, else
    ``None``. Raises what the module's method raises (``ValueError`` for sizes that do not
    divide by the layout's degrees, say)."""
    hook = getattr(module, PLAN_HOOK, None)
    return hook(dims) if callable(hook) else None


def applies_plans(trainer: Any) -> bool:
    """Whether ``trainer``'s strategy calls :func:`parallelize` with the module's plan in its
    ``setup`` (``mm_parallel``); read by duck typing. ``False`` without a trainer: a module then
    applies its plan's model-parallel part itself (:func:`apply_model_parallel`)."""
    strategy = getattr(trainer, "strategy", None)
    return bool(getattr(strategy, "applies_parallel_plans", False))


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


def apply_model_parallel(
    root: nn.Module,
    dims: ParallelDims,
    plan: ParallelPlan,
    meshes: Mapping[str, DeviceMesh] | None = None,
) -> nn.Module:
    """Steps 1-2 of :func:`parallelize` on ``root`` in place: parallel dropout (when ``dims``
    spans more than one process), TP styles on ``meshes`` (default :func:`plan_meshes`; none
    when ``dims.tp == 1``), expert parallelism on ``dims.get_mesh("ep")`` (when ``dims.ep >
    1``), then :attr:`ParallelPlan.after_model_parallel`. Once per root (a second call returns
    it unchanged). Returns ``root``. Raises what the styles and steps raise."""
    if getattr(root, _APPLIED, False):
        return root
    if dims.world_size > 1:
        install_parallel_dropout(root, plan.dropout_regions, dims)
    meshes = plan_meshes(dims) if meshes is None else meshes
    if meshes:
        apply_styles(root, plan.tensor_parallel, meshes)
    if dims.ep > 1:
        for path in plan.expert_parallel:
            apply_expert_parallel(root.get_submodule(path), dims.get_mesh("ep"))
    for step in plan.after_model_parallel:
        step(dims)
    setattr(root, _APPLIED, True)
    return root


def checkpoint_and_compile(
    module: nn.Module, plan: ParallelPlan | None, memory: MemoryOptions | None = None
) -> None:
    """Step 3 of :func:`parallelize`: ``torch.compile`` every block of ``module``
    (``memory.compile_blocks``) and checkpoint the blocks ``memory.activation_checkpointing``
    selects, else those of the plan's own :attr:`~ParallelPlan.checkpointing`; ``"layers"``:
    the plan's :attr:`~ParallelPlan.layers` (every block when it names none). In place, once.

    Raises ``ValueError`` when the kinds named match no block, or for ``"layers"`` that are not
    blocks themselves together with ``compile_blocks`` (the checkpoint would run inside a
    compiled block: torch refuses its model-parallel RNG replay there).
    """
    memory = memory or MemoryOptions()
    blocks = activation.model_blocks(module)
    backend = activation.check_backend(memory.compile_blocks)
    spec = memory.activation_checkpointing
    if spec is None and plan is not None:
        spec = plan.checkpointing
    root = module if plan is None or plan.root is None else plan.root
    if plan is not None and plan.activation_checkpointing:  # deprecated: always applied
        units = [root.get_submodule(p) for p in plan.activation_checkpointing]
        activation.wrap_blocks(units, set(range(len(units))), None)
    if spec != activation.LAYERS or plan is None or not plan.layers:
        activation.apply_block_options(blocks, spec, backend)
        return
    layers = [root.get_submodule(p) for p in plan.layers]
    index = {id(b): i for i, b in enumerate(blocks)}
    if all(id(m) in index for m in layers):  # the layers are blocks (the toy's)
        activation.wrap_blocks(blocks, {index[id(m)] for m in layers}, backend)
        return
    if backend is not None:
        raise ValueError(
            "activation_checkpointing='layers' recomputes the model's layers inside its blocks, "
            f"and compile_blocks={memory.compile_blocks!r} compiles those blocks: torch refuses "
            "the checkpoint's RNG replay inside a compiled region. With compile_blocks use 'all'"
            ", an integer k or block kinds (whole blocks), or leave compile_blocks off."
        )
    activation.apply_block_options(blocks, None, None)
    activation.wrap_blocks(layers, set(range(len(layers))), None)


def check_pipeline_module(module: Any, config: ParallelConfig) -> None:
    """Raise ``TypeError`` when ``config.pipeline_parallel > 1`` and ``module`` does not
    implement :class:`~lightning_mmpar.parallel.pipeline.PipelineModule`."""
    if config.pipeline_parallel > 1 and not isinstance(module, PipelineModule):
        raise TypeError(
            f"pipeline_parallel={config.pipeline_parallel} needs {type(module).__name__} to "
            "implement pipeline_blocks(), pipeline_inputs() and pipeline_loss() "
            "(lightning_mmpar.parallel.pipeline.PipelineModule); or set pipeline_parallel=1."
        )


TP_MESH_NAMES = ("tp", "vl", "tensor_parallel")
"""Mesh dimension names of the tensor-parallel ranks (the ``vl`` mesh holds the same ranks;
``tensor_parallel`` is Lightning ``ModelParallelStrategy``'s name)."""
PLAN_DOCS = "docs/strategy.md#one-parallelize-path-parallel_plandims-and-parallelize"
"""Where a module's plan (``parallel_plan`` or ``configure_model``) is documented."""


class UnappliedDegreeError(ValueError):
    """A parallel degree above 1 that leaves the module as it was (``tensor_parallel > 1`` and
    no parameter sharded over ``tp``, ``expert_parallel > 1`` and no expert layer): found alike
    on every rank, after the plan is applied. The ``mm_parallel`` strategy raises it on rank 0
    only and stops the other ranks quietly."""


def tp_sharded(module: nn.Module) -> bool:
    """Whether some parameter of ``module`` is a DTensor sharded (``Shard``) over a
    tensor-parallel mesh dimension (:data:`TP_MESH_NAMES`)."""
    for param in module.parameters():
        if not isinstance(param, DTensor):
            continue
        names = param.device_mesh.mesh_dim_names or ()
        for name, placement in zip(names, param.placements, strict=False):
            if name in TP_MESH_NAMES and isinstance(placement, Shard):
                return True
    return False


def unapplied_tp_message(tp: int, name: str, why: str) -> str:
    """The refusal of ``tensor_parallel=tp`` for module class ``name``: ``why`` it cannot act,
    what its ranks would do and the fixes (a plan, docs link, or ``tensor_parallel=1``)."""
    return (
        f"tensor_parallel={tp} has no effect on {name}: {why}, so its {tp} tensor-parallel "
        "ranks would train identical full copies doing the same work. Give it a plan: a "
        "parallel_plan(dims) method returning a ParallelPlan with tensor_parallel styles, or "
        "parallelize_module(..., self.device_mesh['tp'], ...) in configure_model() "
        f"({PLAN_DOCS}); or set tensor_parallel=1."
    )


def check_degrees_applied(module: nn.Module, dims: ParallelDims) -> None:
    """Refuse a degree the module's plan (or its ``configure_model``) left without effect, once
    steps 1-2 of :func:`parallelize` ran: ``dims.tp > 1`` with no parameter sharded over
    ``tp`` (:func:`tp_sharded`), ``dims.ep > 1`` with no expert-parallel layer
    (:func:`~lightning_mmpar.parallel.expert_data.check_expert_layers`). torchtitan and
    Megatron-LM shard by construction; a Lightning module may skip its plan silently.

    Raises:
        UnappliedDegreeError: naming the option, the module and the fix.
    """
    name = type(module).__name__
    if dims.tp > 1 and not tp_sharded(module):
        why = "no parameter is sharded over the 'tp' mesh after its configure_model() and plan"
        raise UnappliedDegreeError(unapplied_tp_message(dims.tp, name, why))
    try:
        check_expert_layers(module, dims.ep)
    except ValueError as err:
        raise UnappliedDegreeError(str(err)) from None


def data_parallel_step(
    module: nn.Module, dims: ParallelDims, options: ParallelizeOptions
) -> ShardFn | None:
    """FSDP2 for each piece of ``module``, or ``None`` when nothing is sharded: another
    ``data_parallel`` than ``"fsdp"``, one data-parallel rank with no memory option that needs
    FSDP2 (``memory.needs_fsdp``), or a module that sharded itself in ``configure_model``."""
    config, memory = options.config, options.memory
    wanted = config.data_parallel == "fsdp" and (dims.dp > 1 or memory.needs_fsdp)
    if not wanted or dpar.has_fsdp(module):
        return None
    fsdp_kwargs = memory.fsdp_kwargs(options.device)

    def shard(piece: nn.Module, blocks: Sequence[nn.Module] | None = None) -> nn.Module:
        return dpar.shard_data_parallel(piece, dims, blocks, **fsdp_kwargs)

    return shard


def split_pipeline(
    module: Any, dims: ParallelDims, options: ParallelizeOptions, shard: ShardFn | None
) -> Parallelized:
    """Steps 4-5: cut ``module`` into this rank's pipeline pieces and apply ``shard`` to each
    (FSDP2 one unit per block); a module that is no ``PipelineModule`` is one piece, sharded as
    a tree.

    ``pipeline_parallel > 1``: the stage plan of ``config.partition``
    (:func:`~lightning_mmpar.parallel.pipeline.stages.stage_plan_for`) and a
    :class:`~lightning_mmpar.parallel.pipeline.PipelineEngine` on the ``pp`` group that shards
    its chunks before it builds the stages. Collective over ``pp`` and ``dp``."""
    config, device = options.config, options.device
    if config.pipeline_parallel > 1:
        plan = stage_plan_for(module, config)
        wrap = None if shard is None else lambda chunk: shard(chunk, chunk.blocks)
        pp_group = dims.get_mesh("pp").get_group()
        engine = PipelineEngine(module, config, pp_group, device, wrap, stage_ranges=plan.ranges)
        return Parallelized(pipeline=engine, stage_plan=plan)
    if isinstance(module, PipelineModule):
        chunk = PipelineChunk(list(module.pipeline_blocks()))
        if shard is not None:
            shard(chunk, chunk.blocks)
        ddp = replication.ddp_fallback(dims, config) is None and not dpar.has_fsdp(chunk)
        ddp = ddp and device.type != "meta"  # a dry run builds no DDP
        replicated = replication.replicate_module(chunk, dims, device) if ddp else None
        return Parallelized(chunk=chunk, replicated=replicated)
    if shard is None:
        return Parallelized()
    shard(module)
    if device.type == "meta" or not options.check_unit_order:  # a dry run, or opted out
        return Parallelized()
    return Parallelized(unit_order=UnitOrderGuard.of(module, dims.get_group("dp")))


def parallelize(
    module: nn.Module,
    dims: ParallelDims,
    plan: ParallelPlan | None,
    options: ParallelizeOptions,
) -> Parallelized:
    """Parallelize ``module`` (a LightningModule) in place: TP -> EP -> activation
    checkpointing / compile -> pipeline split -> FSDP2 or replicate (module docstring), then the
    module's ``load_sharded_parameters`` hook (:mod:`.deferred`; the replicated parameters it
    filled broadcast then) and the gradients no FSDP unit or DDP reduces
    (:class:`~lightning_mmpar.parallel.data.GradientSync`). Replicas start from their group's
    rank 0 state, broadcast before any sharding, as DDP does. ``plan`` ``None``: a module
    without one (steps 1-2 skipped). ``options.device`` on ``meta`` (a dry run): the hook, the
    broadcasts and DDP are skipped, the parameters stay on the meta device. Collective over
    ``tp``, ``ep``, ``pp``, ``dp`` and ``edp``.

    Raises:
        TypeError: ``pipeline_parallel > 1`` for a module that is not a ``PipelineModule``.
        UnappliedDegreeError: ``tp`` or ``ep`` above 1 left without effect by the plan
            (:func:`check_degrees_applied`).
        ValueError: from the plan's styles and steps, the block options, the expert layers
            against ``dims.ep`` or the pipeline partition.
    """
    check_pipeline_module(module, options.config)
    if plan is not None:
        apply_model_parallel(module if plan.root is None else plan.root, dims, plan)
    check_degrees_applied(module, dims)
    checkpoint_and_compile(module, plan, options.memory)  # before any sharding
    prepare_expert_gradients(module, dims.ep)
    dry = options.device.type == "meta"  # a dry run: no storage to load into or broadcast
    if not dry:  # replicas start equal (before FSDP2 shards them)
        replication.broadcast_module_state(module, dims)
    shard = data_parallel_step(module, dims, options)
    done = split_pipeline(module, dims, options, shard)
    data_parallel = options.config.data_parallel
    if not dry and deferred.defers(module):
        deferred.load_deferred(module, options.device)  # sharded meta params: their shards
        GradientSync.of(module, dims, data_parallel).broadcast(dims)  # and the replicated ones
    reduced = replication.replicated_by_ddp(done.replicated)
    done.grad_sync = GradientSync.of(module, dims, data_parallel, reduced)
    # a module without blocks may skip a part on some ranks (module docstring of unit_order)
    done.grad_sync.fill_missing = not isinstance(module, PipelineModule)
    return done
