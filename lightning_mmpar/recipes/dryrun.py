"""A dry run of a recipe YAML at its real scale on one CPU machine, next to the planner's counts:
``python -m lightning_mmpar.recipes.dryrun --config recipes/clip_llama_16gpu.yaml [--gpus 16]
[--ranks 0,8]``.

Each chosen rank of the YAML's world is set up in this one process, one after the other: torch's
fake process group (``torch.testing._internal.distributed.fake_pg``: collectives return at once,
nothing is moved) stands in for the world, the model is built on the meta device (no storage),
and the strategy's own set-up runs as under ``trainer.fit``: a Lightning ``Trainer`` with the
YAML's strategy and precision, ``MultimodalParallelStrategy.setup_environment`` (the mesh, handed
to the module), Lightning's ``configure_model`` call, the precision plugin's ``convert_module``
and ``MultimodalParallelStrategy._parallelize`` (the one
:func:`~lightning_mmpar.parallel.parallelize.parallelize` path: tensor and expert parallelism,
the pipeline split, FSDP2) on the meta device (the deferred tower load and the replicas'
broadcast need storage and are skipped: :class:`~lightning_mmpar.parallel.parallelize.
ParallelizeOptions`).

Per rank it prints, **measured** on what the set-up left (the local shards of this rank's
pipeline chunks under pp, else of the module): parameter bytes, gradient bytes (one gradient per
trainable local shard) and optimizer bytes (the module's own optimizer, built by the strategy's
``setup_optimizers`` and stepped once on zero gradients: AdamW's two moments and ``step`` per
parameter, on the meta device), the pipeline blocks the rank holds; next to them the planner's
**predicted** counts for the same layout (:func:`lightning_mmpar.layout.memory.state_bytes`,
:func:`lightning_mmpar.layout.memory.stage_blocks`); the bytes of every collective of one
optimizer step, predicted (:func:`lightning_mmpar.layout.comm.comm_bytes`), and beside them
the part the set-up fixes, **measured** from the built model (:func:`measure_comm`: FSDP2's
all-gathers and reduce-scatters from its parameter groups, the all-reduce of the parameters no
unit manages, DDP's gradient all-reduce from the trainable shards, a vision rank's all-reduce
of its tower) against the planner's part for the same purposes
(:func:`lightning_mmpar.layout.comm.comm_parts`, ``SET_UP_PURPOSES``); and, **predicted
only**, the activation estimate (:func:`lightning_mmpar.layout.cost.activation_bytes`) and the
activation-dependent collectives (tp activations, pipeline boundaries, the MoE all-to-all, the
loss): no forward or backward runs - on meta tensors and a fake group whose peers never answer,
the pipeline engine cannot exchange its stages' output shapes and MoE layers cannot route
tokens: both read values. Those are checked against a real run by the reduced-world test,
``tests/recipes/test_parity_matrix.py`` (``CommCounter`` on gloo: every key of every rank of
31 small layouts, exact).
A measured count that differs from the prediction is printed with ``MISMATCH`` and makes the
exit status 1, except the one difference the set-up cannot show: a vocab-parallel embedding's
gradient comes back whole from torch's ``RowwiseParallel`` embedding (``tp`` times its shard;
only when FSDP does not shard it), which the planner counts (in the gradient bytes, and in
DDP's all-reduce) and a run without backward cannot see - printed as ``explained``.

Before anything is built the layout is checked as the recipe's launch does
(:func:`lightning_mmpar.layout.validate` with the model's facts,
:func:`lightning_mmpar.recipes.planner.layout_facts`): a layout that would fail at set-up exits
with status 2 and one line naming the reason.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.trainer.call import _call_configure_model
from torch import nn

from lightning_mmpar.layout import ParallelLayout, validate
from lightning_mmpar.layout.comm import (
    SET_UP_PURPOSES,
    comm_bytes,
    comm_parts,
    fsdp_gathers,
    gradient_syncs,
)
from lightning_mmpar.layout.cost import activation_bytes, default_graph
from lightning_mmpar.layout.memory import (
    StateBytes,
    fsdp_group,
    local_shape,
    stage_blocks,
    state_bytes,
)
from lightning_mmpar.layout.towers_cost import (
    language_layout,
    split_towers,
    tower_cost,
    vision_comm_bytes,
    vision_layout,
)
from lightning_mmpar.recipes.module import ClipLlamaModule
from lightning_mmpar.recipes.partition import _strategy_args, build_module, load_recipe
from lightning_mmpar.recipes.planner import base_layout, layout_facts, spec_cache
from lightning_mmpar.recipes.yaml_layout import yaml_layout
from lightning_mmpar.strategy import MultimodalParallelStrategy

__all__ = [
    "Planned",
    "RankReport",
    "build_rank",
    "format_rank",
    "main",
    "measure",
    "measure_comm",
    "optimizer_bytes",
    "plan_layout",
    "report_rank",
]

_NOT_STRATEGY = ("process_group_backend", "timeout")
"""Strategy arguments of a real launch that mean nothing on the fake process group."""


@dataclass(frozen=True)
class Planned:
    """The YAML's layout on ``gpus`` devices and the planner's model of it."""

    config: dict[str, Any]
    layout: ParallelLayout
    spec: Any
    """The planner's ``ModelSpec`` (:func:`~lightning_mmpar.recipes.planner.spec_cache`)."""
    text_length: int

    @property
    def gpus(self) -> int:
        """Every rank of the launch: the layout's tp x pp x dp and its vision ranks."""
        return self.layout.world + self.layout.vision_ranks


@dataclass(frozen=True)
class RankReport:
    """One rank's measured and predicted counts (bytes; blocks as pipeline block indices)."""

    rank: int
    coords: dict[str, int]
    measured: StateBytes
    predicted: StateBytes
    blocks: list[int]
    predicted_blocks: list[int]
    full_grad_extra: int
    """Predicted gradient bytes no set-up can show: vocab-parallel embeddings' whole gradients
    (``ParamSpec.full_grad``), ``tp - 1`` extra shards each, when FSDP does not shard them."""
    activations: int
    comm: dict[str, int]
    seconds: float
    stage_table: str | None = None
    """The strategy's stage plan (``StagePlan.table()``; ``None`` without a pipeline)."""
    transfer: dict[str, int] = field(default_factory=dict)
    """Non-colocated towers, a vision rank: the planner's bytes per step on its links
    (``embeddings out``, ``gradients in``, ``pixels in``: ``layout.towers_cost.tower_cost``);
    predicted only, as the activation-dependent collectives."""
    comm_measured: dict[str, int] = field(default_factory=dict)
    """The collectives of one step the set-up fixes (:func:`measure_comm`), by key."""
    comm_set_up: dict[str, int] = field(default_factory=dict)
    """The planner's part of :attr:`comm` for the same purposes
    (:data:`~lightning_mmpar.layout.comm.SET_UP_PURPOSES`; a vision rank: its all-reduce)."""
    comm_explained: dict[str, int] = field(default_factory=dict)
    """Predicted bytes no set-up can show: under DDP, the vocab-parallel embeddings' whole
    gradients (as :attr:`full_grad_extra`) in every gradient all-reduce."""

    def mismatches(self) -> list[str]:
        """What differs beyond :attr:`full_grad_extra` (empty: the counts agree)."""
        m, p = self.measured, self.predicted
        out = []
        if self.blocks != self.predicted_blocks:
            out.append(f"blocks {self.blocks} vs predicted {self.predicted_blocks}")
        if m.parameters != p.parameters:
            out.append(f"parameters {m.parameters} vs predicted {p.parameters}")
        if m.gradients + self.full_grad_extra != p.gradients:
            out.append(f"gradients {m.gradients} vs predicted {p.gradients}")
        if m.optimizer != p.optimizer:
            out.append(f"optimizer {m.optimizer} vs predicted {p.optimizer}")
        for key in sorted(self.comm_measured.keys() | self.comm_set_up.keys()):
            got, want = self.comm_measured.get(key, 0), self.comm_set_up.get(key, 0)
            if got + self.comm_explained.get(key, 0) != want:
                out.append(f"{key} {got} vs predicted {want}")
        return out


def plan_layout(config: dict[str, Any], gpus: int) -> Planned:
    """The YAML's layout on ``gpus`` devices as the planner prices it (its base: the YAML's
    precision, partition and vision mode), checked as the recipe's launch checks it.

    Raises:
        ValueError: the YAML's degrees do not divide ``gpus``, or a layout the strategy or the
            model refuses (:func:`lightning_mmpar.layout.validate`'s message).
    """
    module, data = build_module(config)
    text_length = int(data.max_length)
    precision = str((config.get("trainer") or {}).get("precision", "32-true"))
    layout = yaml_layout(config, base_layout(config, module, precision), gpus)
    if isinstance(layout, str):
        raise ValueError(f"the YAML's layout: {layout}")
    validate(layout, layout_facts(module, text_length)(layout))
    return Planned(config, layout, spec_cache(module, text_length)(layout), text_length)


@contextlib.contextmanager
def _rank_env(rank: int, devices: int) -> Iterator[None]:
    """``LOCAL_RANK`` / ``NODE_RANK`` of ``rank`` while set up (Lightning's ranks read them);
    Lightning's process-wide ``rank_zero_only.rank`` (the strategy sets it to ``rank``) is put
    back afterwards, so this process logs as before."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    saved = {k: os.environ.get(k) for k in ("LOCAL_RANK", "NODE_RANK")}
    holders: list[Any] = [rank_zero_only, fabric_rank_zero]
    ranks = [getattr(f, "rank", 0) for f in holders]
    os.environ.update(LOCAL_RANK=str(rank % devices), NODE_RANK=str(rank // devices))
    try:
        yield
    finally:
        for holder, value in zip(holders, ranks, strict=True):
            holder.rank = value
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _trainer(config: dict[str, Any], gpus: int) -> Trainer:
    """A Lightning ``Trainer`` with the YAML's strategy and precision on ``gpus`` CPU devices
    (one node: the fake group spans them all; node boundaries change no count)."""
    args = {k: v for k, v in _strategy_args(config).items() if k not in _NOT_STRATEGY}
    precision = (config.get("trainer") or {}).get("precision", "32-true")
    return Trainer(
        accelerator="cpu",
        devices=gpus,
        strategy=MultimodalParallelStrategy(**args),
        precision=precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        max_epochs=-1,  # the schedule's length without the data: max_steps
        max_steps=int((config.get("trainer") or {}).get("max_steps", -1) or -1),
    )


def build_rank(config: dict[str, Any], gpus: int, rank: int) -> tuple[Trainer, ClipLlamaModule]:
    """Set up rank ``rank`` of ``gpus`` as ``trainer.fit`` does, on the fake process group and
    the meta device (module docstring); returns the trainer (its strategy holds the pipeline
    and the dims) and the module. Destroy the process group before the next rank."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=gpus)
    with _quiet():
        trainer = _trainer(config, gpus)
    module, data = build_module(config, meta=False)
    module.text_length = int(data.max_length)  # the partitioner's caption length
    strategy = trainer.strategy
    assert isinstance(strategy, MultimodalParallelStrategy)
    trainer._data_connector.attach_data(module, datamodule=data)
    strategy.connect(module)
    module.trainer = trainer
    with _rank_env(rank, gpus), _quiet():
        strategy.setup_environment()
        with torch.device("meta"):  # Lightning's call, without storage
            _call_configure_model(trainer)
        trainer.precision_plugin.convert_module(module)  # in place (bf16-true: a cast)
        try:
            if not strategy._tower_split(module):  # a vision rank holds the tower, whole
                strategy._parallelize(module, device=torch.device("meta"))
        except SystemExit:  # the strategy's refusal leaves ranks other than 0 quietly
            raise RuntimeError(
                f"rank {rank}: the strategy refused this set-up; --ranks 0 raises its reason."
            ) from None
    return trainer, module


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Lightning's info lines (devices, precision, the stage table: printed once by
    :func:`main`) silenced while a rank is set up."""
    logger = logging.getLogger("lightning.pytorch")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def _local_bytes(p: torch.Tensor) -> int:
    t = p.to_local() if hasattr(p, "to_local") else p
    return int(t.numel() * t.element_size())


def _pieces(strategy: MultimodalParallelStrategy, module: nn.Module) -> list[nn.Module]:
    """This rank's pipeline chunks (pp > 1), else the module."""
    return list(strategy.pipeline.chunks) if strategy.pipeline is not None else [module]


def measure(strategy: MultimodalParallelStrategy, module: nn.Module) -> StateBytes:
    """Parameter and gradient bytes of the local shards this rank holds (module docstring),
    each parameter counted once, and the optimizer state :func:`optimizer_bytes` measures."""
    seen: set[int] = set()
    params = trainable = 0
    for piece in _pieces(strategy, module):
        for p in piece.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            size = _local_bytes(p)
            params += size
            if p.requires_grad:
                trainable += size
    return StateBytes(params, trainable, optimizer_bytes(strategy))


def optimizer_bytes(strategy: MultimodalParallelStrategy) -> int:
    """The module's own optimizers (``configure_optimizers`` through the strategy's
    ``setup_optimizers``, as at fit set-up) after one step on zero gradients of each
    parameter's local shard: the bytes of every tensor of their state (AdamW: two moments
    and a ``step`` per parameter), on the meta device."""
    assert strategy.lightning_module is not None
    strategy.setup_optimizers(strategy.lightning_module.trainer)
    total = 0
    for optimizer in strategy.optimizers:
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = torch.zeros_like(p)
        optimizer.step()
        for state in optimizer.state.values():
            total += sum(_local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return total


def measure_comm(
    strategy: MultimodalParallelStrategy, module: nn.Module, layout: ParallelLayout
) -> dict[str, int]:
    """Bytes per ``"<dim>.<kind>"`` of the collectives of one optimizer step that the set-up
    fixes, from this rank's built model (nccl-tests' sizes, as
    :func:`~lightning_mmpar.layout.comm.comm_bytes`): per FSDP2 unit (its parameter groups) an
    all-gather of every parameter's padded shard times the group size, in the gather dtype
    (``MixedPrecisionPolicy.param_dtype``, else the parameter's), ``fsdp_gathers(layout)``
    times (forward and backward's re-gather), and a reduce-scatter of the trainable ones in
    the reduce dtype per batch - ``dp`` units, or ``edp`` for the expert units; the trainable
    parameters no unit manages (0-dim ones) all-reduced per batch; under ``ddp`` every
    trainable dense local shard all-reduced ``gradient_syncs(layout)`` times and the expert
    shards per batch over ``edp``. The counts per step come from the same helpers the planner
    uses; the units, sizes and dtypes are the set-up's."""
    from torch.distributed.fsdp import FSDPModule

    from lightning_mmpar.parallel.expert_data import is_expert_parameter

    if layout.dp_size == 1 or layout.data_parallel == "none":
        return {}
    out: dict[str, int] = {}
    managed: set[int] = set()
    trainable: dict[int, torch.Tensor] = {}
    for piece in _pieces(strategy, module):
        trainable.update({id(p): p for p in piece.parameters() if p.requires_grad})
        for m in piece.modules():
            if isinstance(m, FSDPModule):
                for group in m._get_fsdp_state()._fsdp_param_groups:
                    managed |= _fsdp_unit_bytes(group, layout, out)
    acc = layout.accumulate
    for p in trainable.values():
        if id(p) in managed:
            continue
        if is_expert_parameter(p):
            key, n = "edp.all_reduce", (acc if layout.edp > 1 else 0)
        elif layout.data_parallel == "ddp":
            key, n = "dp.all_reduce", gradient_syncs(layout)
        else:
            key, n = "dp.all_reduce", acc  # FSDP: the parameters no unit manages
        if n:
            out[key] = out.get(key, 0) + n * _local_bytes(p)
    return out


def _fsdp_unit_bytes(group: Any, layout: ParallelLayout, out: dict[str, int]) -> set[int]:
    """Add one FSDP2 parameter group's all-gather and reduce-scatter bytes per step to ``out``
    (:func:`measure_comm`); returns the ids of its sharded parameters."""
    names = tuple(group.mesh_info.mesh.mesh_dim_names or ())
    dim = next((d for d in ("edp", "vision") if d in names), "dp")  # vision: the tower's own
    ranks = int(group.mesh_info.shard_mesh_size)
    policy = group.mp_policy
    gathered = reduced = 0
    ids: set[int] = set()
    for fp in group.fsdp_params:
        param = fp.sharded_param
        ids.add(id(param))
        numel = ranks * math.prod(fp.padded_sharded_param_size)
        gather_dtype = policy.param_dtype or param.dtype
        gathered += numel * gather_dtype.itemsize
        if param.requires_grad:
            reduced += numel * (policy.reduce_dtype or gather_dtype).itemsize
    if ranks > 1:
        for kind, n in (
            ("all_gather", fsdp_gathers(layout) * gathered),
            ("reduce_scatter", layout.accumulate * reduced),
        ):
            if n:
                out[f"{dim}.{kind}"] = out.get(f"{dim}.{kind}", 0) + n
    return ids


def _vision_comm(module: nn.Module, layout: ParallelLayout) -> dict[str, int]:
    """A vision rank's collectives of one step over the vision ranks, measured from its built
    tower (``vision_ranks > 1``; keys ``vision.<kind>``): ``ddp``, the all-reduce of its
    trainable parameters; ``fsdp``, each block unit's all-gathers and reduce-scatter
    (:func:`_fsdp_unit_bytes`; one gather per batch for a frozen tower, which runs no
    backward) and the all-reduce of the trainable parameters no unit manages (0-dim)."""
    from torch.distributed.fsdp import FSDPModule

    if layout.vision_ranks < 2:
        return {}
    trainable = [p for p in module.parameters() if p.requires_grad]
    if layout.vision_data_parallel == "ddp":
        out = {"vision.all_reduce": sum(_local_bytes(p) for p in trainable)}
        return {k: n for k, n in out.items() if n}
    out, managed = {}, set()
    for m in module.modules():
        if isinstance(m, FSDPModule):
            for group in m._get_fsdp_state()._fsdp_param_groups:
                managed |= _fsdp_unit_bytes(group, vision_layout(layout), out)
    if not trainable and "vision.all_gather" in out:
        out["vision.all_gather"] //= 2
    out["vision.all_reduce"] = sum(_local_bytes(p) for p in trainable if id(p) not in managed)
    return {k: n for k, n in out.items() if n}


def _set_up_part(parts: dict[str, dict[str, int]]) -> dict[str, int]:
    """The planner's bytes per key for :data:`~lightning_mmpar.layout.comm.SET_UP_PURPOSES`."""
    out = {k: sum(v.get(w, 0) for w in SET_UP_PURPOSES) for k, v in parts.items()}
    return {k: v for k, v in out.items() if v}


def held_blocks(strategy: MultimodalParallelStrategy) -> list[int]:
    """Pipeline block indices of this rank's stages (every block without a pipeline)."""
    if strategy.pipeline is None:
        return list(range(len(strategy.lightning_module.pipeline_blocks())))
    ranges = strategy.pipeline.stage_ranges
    return sorted(i for s in strategy.pipeline.stage_ids for i in ranges[s])


def _full_grad_extra(spec: Any, layout: ParallelLayout, coords: dict[str, int]) -> int:
    """The predicted gradient bytes of vocab-parallel embeddings beyond their local shard."""
    blocks = set(stage_blocks(spec, layout, coords["pp"]))
    extra = 0
    for p in spec.params:
        if p.block in blocks and p.trainable and p.full_grad and layout.tp > 1:
            if fsdp_group(p, layout) == 1:
                n = 1
                for d in local_shape(p, layout, coords):
                    n *= d
                extra += n * p.element_size * (layout.tp - 1)
    return extra


def report_rank(planned: Planned, rank: int) -> RankReport:
    """Set up ``rank`` (:func:`build_rank`), measure it and predict it; the process group is
    destroyed afterwards. Non-colocated towers (``vision_ranks``): :func:`_tower_report`."""
    start = time.perf_counter()
    layout = planned.layout
    trainer, module = build_rank(planned.config, planned.gpus, rank)
    try:
        strategy = trainer.strategy
        assert isinstance(strategy, MultimodalParallelStrategy)
        if rank >= layout.world:  # one of the last vision_ranks ranks
            coords = {"vision": rank - layout.world}
        else:
            coords = dict(strategy.parallel_dims.rank_coords(rank))
        measured, blocks = measure(strategy, module), held_blocks(strategy)
        if rank < layout.world:
            comm_measured = measure_comm(strategy, module, language_layout(layout))
        else:  # a vision rank: its tower's sync over the vision ranks
            comm_measured = _vision_comm(module, layout)
        table = strategy.stage_plan.table() if strategy.stage_plan is not None else None
    finally:
        dist.destroy_process_group()
    report = RankReport(
        rank=rank,
        coords=coords,
        measured=measured,
        predicted=measured,  # the planner's, below
        blocks=blocks,
        predicted_blocks=[],
        full_grad_extra=0,
        activations=0,
        comm={},
        seconds=time.perf_counter() - start,
        stage_table=table,
        comm_measured=comm_measured,
    )
    if layout.vision_ranks:
        return _tower_report(planned, report)
    spec, pp = planned.spec, coords["pp"]
    return replace(
        report,
        predicted=state_bytes(spec, layout, coords),
        predicted_blocks=sorted(stage_blocks(spec, layout, pp)),
        full_grad_extra=_full_grad_extra(spec, layout, coords),
        activations=activation_bytes(spec, layout, pp),
        comm=comm_bytes(spec, layout, pp),
        comm_set_up=_set_up_part(comm_parts(spec, layout, pp)),
        comm_explained=_ddp_explained(layout, _full_grad_extra(spec, layout, coords)),
    )


def _ddp_explained(layout: ParallelLayout, full_grad_extra: int) -> dict[str, int]:
    """Under ``ddp`` the vocab-parallel embeddings' whole gradients are all-reduced whole: the
    predicted bytes beyond their shards in every gradient all-reduce of the step."""
    if layout.data_parallel != "ddp" or layout.dp_size == 1 or not full_grad_extra:
        return {}
    return {"dp.all_reduce": gradient_syncs(layout) * full_grad_extra}


def _tower_report(planned: Planned, report: RankReport) -> RankReport:
    """A rank of a non-colocated layout, blocks numbered as in the whole model: a vision rank
    (the tower, a full copy or its FSDP2 shards over the vision ranks: the planner's
    ``tower_cost`` and ``vision_comm_bytes``) or a
    language rank (the other blocks under the layout's tp x pp x dp; its block 0, the
    parameterless ``TowerInlet``, block 0 of the planner's language side too, not listed)."""
    layout = planned.layout
    vision, language = split_towers(planned.spec)
    k = len(vision.blocks)
    if "vision" in report.coords:
        # bytes only: any rate gives the same ones
        tower = tower_cost(planned.spec, layout, (1.0, 0.0), default_graph(planned.gpus))
        sync = vision_comm_bytes(planned.spec, layout)
        return replace(
            report,
            predicted=state_bytes(vision, vision_layout(layout), {"dp": report.coords["vision"]}),
            predicted_blocks=list(range(k)),
            activations=tower.activations,
            comm=sync,
            comm_set_up=sync,
            transfer={
                "embeddings out": tower.embedding_bytes,
                "gradients in": tower.gradient_bytes,
                "pixels in": tower.pixel_bytes,
            },
        )
    lang, coords = language_layout(layout), report.coords
    return replace(
        report,
        blocks=[k + b - 1 for b in report.blocks if b > 0],
        predicted=state_bytes(language, lang, coords),
        predicted_blocks=sorted(
            k + b - 1 for b in stage_blocks(language, lang, coords["pp"]) if b > 0
        ),
        full_grad_extra=_full_grad_extra(language, lang, coords),
        activations=activation_bytes(language, lang, coords["pp"]),
        comm=comm_bytes(language, lang, coords["pp"]),
        comm_set_up=_set_up_part(comm_parts(language, lang, coords["pp"])),
        comm_explained=_ddp_explained(lang, _full_grad_extra(language, lang, coords)),
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def format_rank(r: RankReport) -> list[str]:
    """The lines printed for one rank."""
    where = " ".join(f"{k} {v}" for k, v in r.coords.items())
    lines = [f"rank {r.rank} ({where}), set up in {r.seconds:.1f} s"]
    lines.append(f"  blocks: {_ranges(r.blocks)} (planner: {_ranges(r.predicted_blocks)})")
    for name in ("parameters", "gradients", "optimizer"):
        got, want = getattr(r.measured, name), getattr(r.predicted, name)
        note = "agree" if got == want else f"differ by {want - got:+,}"
        if name == "gradients" and got + r.full_grad_extra == want and got != want:
            note = "explained: vocab-parallel embedding gradients come back whole (tp x shard)"
        lines.append(
            f"  {name:<11} measured {got:>16,} B ({_mib(got)})  predicted {want:>16,} B  {note}"
        )
    lines.append(f"  activations predicted {r.activations:,} B ({_mib(r.activations)}) at peak")
    comm = ", ".join(f"{k} {v:,}" for k, v in sorted(r.comm.items())) or "none"
    lines.append(f"  collectives of one step, predicted (bytes): {comm}")
    for key in sorted(r.comm_measured.keys() | r.comm_set_up.keys()):
        got, want = r.comm_measured.get(key, 0), r.comm_set_up.get(key, 0)
        extra = r.comm_explained.get(key, 0)
        note = "agree" if got == want else f"differ by {want - got:+,}"
        if got != want and got + extra == want:
            note = "explained: vocab-parallel embedding gradients all-reduced whole"
        lines.append(
            f"    {key:<17} measured {got:>16,} B  predicted {want:>16,} B"
            f" (its set-up part)  {note}"
        )
    if r.transfer:
        moved = ", ".join(f"{k} {v:,}" for k, v in r.transfer.items())
        lines.append(f"  tower transfer of one step, predicted (bytes): {moved}")
    lines += [f"  MISMATCH {m}" for m in r.mismatches()]
    return lines


def _ranges(blocks: Sequence[int]) -> str:
    """``[0, 1, 2, 5, 6]`` -> ``0-2,5-6``."""
    out: list[str] = []
    for b in blocks:
        if out and out[-1].endswith(f"-{b - 1}"):
            out[-1] = out[-1].rsplit("-", 1)[0] + f"-{b}"
        elif out and out[-1] == str(b - 1):
            out[-1] += f"-{b}"
        else:
            out.append(str(b))
    return ",".join(out) or "none"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m lightning_mmpar.recipes.dryrun",
        description="Set up every rank (or --ranks) of a recipe YAML on one CPU machine (meta "
        "device, fake process group) and print each rank's measured parameter, gradient and "
        "optimizer bytes next to the planner's predictions.",
    )
    p.add_argument("--config", required=True, help="recipe YAML (the LightningCLI config)")
    p.add_argument("--gpus", type=int, help="world size (default: the YAML's devices x nodes)")
    p.add_argument("--ranks", help="comma-separated ranks to set up (default: all)")
    return p


def _world(config: dict[str, Any], gpus: int | None) -> int:
    if gpus is not None:
        if gpus < 1:
            raise ValueError(f"--gpus ({gpus}) must be >= 1.")
        return gpus
    trainer = config.get("trainer") or {}
    devices = trainer.get("devices", 1)
    if not isinstance(devices, int):
        raise ValueError(f"trainer.devices ({devices!r}) is not a count; pass --gpus.")
    return devices * int(trainer.get("num_nodes", 1) or 1)


def _ranks(text: str | None, world: int) -> list[int]:
    if text is None:
        return list(range(world))
    try:
        ranks = [int(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise ValueError(f"--ranks ({text!r}) must be comma-separated integers.") from None
    bad = [r for r in ranks if not 0 <= r < world]
    if bad or not ranks:
        raise ValueError(f"--ranks ({text!r}): each must be in 0..{world - 1} (--gpus {world}).")
    return ranks


def main(argv: Sequence[str] | None = None) -> int:
    """Run the dry run; 0 when every count agrees, 1 on a mismatch, 2 (one line on stderr)
    for invalid arguments or a layout refused before anything is built."""
    args = _parser().parse_args(argv)
    try:
        config = load_recipe(args.config)
        world = _world(config, args.gpus)
        ranks = _ranks(args.ranks, world)
        planned = plan_layout(config, world)
    except ValueError as err:
        print(f"dryrun: refused: {err}", file=sys.stderr)
        return 2
    from lightning_mmpar.layout.planner import describe

    print(f"{args.config} on {world} ranks: {describe(planned.layout)}")
    failed = 0
    for i, rank in enumerate(ranks):
        r = report_rank(planned, rank)
        if i == 0 and r.stage_table is not None:
            print(f"the strategy's stage plan:\n{r.stage_table}")
        print("\n".join(format_rank(r)), flush=True)
        failed += bool(r.mismatches())
    print(f"{len(ranks) - failed} of {len(ranks)} ranks agree with the planner")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
