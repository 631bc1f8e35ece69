"""Predicted step time, memory and MFU of a layout from a model's costed blocks (pure Python).

:func:`predict` = compute (FLOPs over ``peak x efficiency`` of a :data:`DEVICES` entry) +
communication (:func:`lightning_mmpar.layout.comm.comm_bytes` timed by
:func:`lightning_mmpar.layout.devices.collective_seconds` on the placed groups, no overlap) +
the pipeline bubble (:func:`lightning_mmpar.layout.schedules.bubble_fraction`, the formula the
``PipelineTimeline`` callback logs too)::

    step = (compute + tp + ep + pp comm) / (1 - bubble) + dp comm
    MFU  = model FLOPs / (step x world x peak)       (PaLM, Chowdhery et al. 2022, app. B)

and memory per rank = :func:`lightning_mmpar.layout.memory.state_bytes` (exact) +
:func:`activation_bytes` at the schedule's peak. Formulas and assumptions: docs/planner.md.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from lightning_mmpar.layout.comm import comm_profile
from lightning_mmpar.layout.devices import DeviceGraph, collective_seconds
from lightning_mmpar.layout.memory import layout_stage_plan, state_bytes
from lightning_mmpar.layout.placement import group_positions
from lightning_mmpar.layout.schedules import bubble_fraction, in_flight, stage_ranks
from lightning_mmpar.layout.stages import BlockSpec
from lightning_mmpar.layout.towers_cost import (
    TowerCost,
    language_layout,
    run_ahead_seconds,
    split_towers,
    tower_cost,
    vision_comm_bytes,
)
from lightning_mmpar.layout.value import validate

__all__ = [
    "DEVICES",
    "DeviceSpec",
    "Prediction",
    "RankMemory",
    "activation_bytes",
    "compute_seconds",
    "default_graph",
    "predict",
]

GIB = 2**30


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator: dense peak TFLOP/s by precision, memory, and the fraction of the peak
    that training matmuls reach (``efficiency``: compute seconds = FLOPs / (peak x it))."""

    name: str
    tflops: dict[str, float]  # dense (no 2:4 sparsity) peak by fp32, tf32, bf16, fp8
    memory_gib: float  # as nvidia-smi reports the total
    efficiency: float = 0.6  # achieved / peak of a training step's kernels (assumed)
    overhead: float = 0.0  # fixed seconds per block per micro-batch, forward + backward
    source: str = ""
    call_overhead: float = 0.0
    """Host seconds per collective call issued through DTensor or FSDP2
    (:func:`~lightning_mmpar.layout.comm.dispatched_calls`: sharding propagation, copy-in /
    copy-out, hooks) taken from compute on a CPU rank; 0 on accelerators, where it overlaps
    the kernels. A plain call's host cost is in the link's measured latency."""
    shared: float = 1.0
    """Ranks per compute unit (> 1 when processes outnumber CPU cores): the machine's
    throughput then bounds a step, ``step >= shared x mean rank busy seconds + comm``."""

    def peak(self, precision: str) -> float:
        """Peak FLOP/s for a Lightning precision (``32-true``: fp32, ``bf16-*``: bf16, ``fp8``);
        ``ValueError`` for a precision the device has no figure for."""
        key = _PEAK_KEY.get(precision)
        if key is None or key not in self.tflops:
            raise ValueError(
                f"precision {precision!r} has no peak figure on {self.name} (figures: "
                f"{sorted(self.tflops)}); use one of "
                f"{sorted(p for p, k in _PEAK_KEY.items() if k in self.tflops)}."
            )
        return self.tflops[key] * 1e12


_PEAK_KEY = {
    "32-true": "fp32",
    "tf32": "tf32",
    "bf16-mixed": "bf16",
    "bf16-true": "bf16",
    "fp8": "fp8",
}
ACTIVATION_ELEMENT_BYTES = {"32-true": 4, "tf32": 4, "bf16-mixed": 2, "bf16-true": 2, "fp8": 2}
"""Bytes per kept activation element (fp8: torchao keeps bf16 activations, casts per matmul)."""
_NVIDIA = "NVIDIA datasheet, dense (half the 'with sparsity' figure)"
DEVICES: dict[str, DeviceSpec] = {
    "a100": DeviceSpec(
        "A100-SXM4-80GB",
        {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0},
        80.0,
        source=f"{_NVIDIA}: A100 Tensor Core GPU datasheet (2021)",
    ),
    "h100": DeviceSpec(
        "H100-SXM5-80GB",
        {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp8": 1979.0},
        79.6,
        source=f"{_NVIDIA}: H100 Tensor Core GPU datasheet (2023)",
    ),
    "h200": DeviceSpec(
        "H200-SXM-141GB",
        {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp8": 1979.0},
        140.4,
        source=f"{_NVIDIA}: H200 Tensor Core GPU datasheet (2024)",
    ),
    "b200": DeviceSpec(
        "B200-SXM-180GB",
        {"fp32": 75.0, "tf32": 1100.0, "bf16": 2250.0, "fp8": 4500.0},
        179.1,
        source=f"{_NVIDIA}: HGX B200 datasheet (2024), per GPU = 1/8",
    ),
    # Measured (`python benchmarks/bench_planner.py --measure-cpu`, one thread, fp32 matmuls of
    # the CPU recipe's shapes; overhead: block_overhead(); call_overhead: host work per DTensor /
    # FSDP2 call, benchmarks/call_overhead.py), 2-core VM under load; the benchmark
    # measures its own figures in the run it predicts (docs/results/planner.json).
    "cpu": DeviceSpec(
        "CPU core (fp32, one thread)",
        {"fp32": 0.052},
        16.0,
        efficiency=1.0,
        overhead=2.9e-3,
        source="measured, benchmarks/bench_planner.py",
        call_overhead=5e-3,
    ),  # benchmarks/call_overhead.py, 4 processes
}
"""Devices by ``--device`` name (memory ``nvidia-smi`` totals; the H200 one as on an H200 SXM)."""

_NOT_RECOMPUTED = ("vision.stem", "vision.pool", "bridge", "head")
"""Blocks that ``activation_checkpointing="layers"`` leaves alone: the fusion plan's ``layers``
(``plans.fusion.checkpoint_units``) are the other blocks' modules
(tests/unit/parallel/test_parallelize)."""
REPLICATED_SHARE = 10 / 34
"""Share of a transformer layer's kept activations that tensor parallelism without sequence
parallelism leaves whole on every rank (norm and dropout inputs, the column-parallel inputs):
``10 s b h`` of ``34 s b h`` (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", eq. 2-4; attention scores not counted, flash kernels)."""


def _tp_share(block: BlockSpec, layout: Any, kept: bool) -> float:
    """The share of a block's work (``kept=False``) or kept activations (``kept=True``) one
    tensor-parallel rank carries."""
    tp = layout.tp
    if tp == 1:
        return 1.0
    if block.kind == "vision" and layout.vision_parallel == "replicate":
        return 1.0
    if block.kind == "vision" and layout.vision_parallel == "dp":
        return 1.0 / tp  # 1 / tp of the images, whole blocks
    if kept and not layout.sequence_parallel:
        return REPLICATED_SHARE + (1 - REPLICATED_SHARE) / tp
    return 1.0 / tp


def _stages_of(model: Any, layout: Any) -> tuple[list[range], list[int], list[int]]:
    """Block ranges, pipeline rank and in-flight micro-batches of every stage."""
    plan = layout_stage_plan(model, layout)  # memoised
    ranks = stage_ranks(layout.schedule, layout.pp, layout.virtual)
    return (
        plan.ranges,
        ranks,
        in_flight(layout.schedule, layout.pp, layout.virtual, layout.num_micro_batches),
    )


def activation_bytes(model: Any, layout: Any, pp_rank: int = 0) -> int:
    """Kept activation bytes of pipeline rank ``pp_rank`` at the schedule's peak.

    Per stage on the rank: ``sum(BlockSpec.activation_bytes) x micro_batch_size x in_flight``
    (:func:`lightning_mmpar.layout.schedules.in_flight`: the stage's share of its rank's peak),
    times the element size of ``layout.precision`` / 4 (the specs count fp32), times the
    tensor-parallel share (``1 / tp``, with sequence parallelism; without it
    :data:`REPLICATED_SHARE` stays whole; the ViT under ``vision_parallel='replicate'`` is
    not divided). Activation checkpointing keeps only the inputs of recomputed blocks
    (``ModelSpec.boundaries`` of the block before) and adds the largest such block's activations of
    one micro-batch (recomputed in its backward).

    ``model``: a ``ModelSpec`` (``.blocks``, ``.boundaries``); ``layout``: a
    ``ParallelLayout``. Raises ``ValueError`` from :func:`plan_stages` for a pipeline the blocks
    cannot fill.
    """
    ranges, ranks, flight = _stages_of(model, layout)
    scale = ACTIVATION_ELEMENT_BYTES.get(layout.precision, 4) / 4 * layout.micro_batch_size
    inputs = _input_bytes(model)
    total, recompute = 0.0, 0.0
    for r, rank, k in zip(ranges, ranks, flight, strict=True):
        if rank != pp_rank:
            continue
        for i in r:
            block = model.blocks[i]
            kept = block.activation_bytes * _tp_share(block, layout, kept=True)
            if layout.activation_checkpointing and block.name not in _NOT_RECOMPUTED:
                recompute = max(recompute, kept)
                kept = inputs[i] * (1 / layout.tp if layout.sequence_parallel else 1.0)
            total += kept * k
    return round((total + recompute) * scale)


def _input_bytes(model: Any) -> Sequence[float]:
    """Per-sample bytes entering each block (kept under checkpointing): the previous block's
    outputs (``ModelSpec.boundaries``; image tokens passed on unchanged count at every block,
    an over-estimate); without boundaries an eighth of the block's activations."""
    bounds = getattr(model, "boundaries", ())
    if bounds:
        sizes = [float(sum(t.bytes_per_sample for t in b)) for b in bounds]
        return (0.0, *sizes[:-1])
    return tuple(b.activation_bytes / 8 for b in model.blocks)


def _rank_flops(model: Any, layout: Any) -> tuple[list[float], list[float], float]:
    """FLOPs per optimizer step of each pipeline rank (one tp shard, recomputation included),
    its block runs per micro-batch (a forward counts 1/3 of forward + backward), and the global
    model FLOPs. Extra forwards: a recomputed block's (activation checkpointing) and, with a
    pipeline, every block's forward-only pass of the gradient cache (the recipe's contrastive
    features of the whole batch before the schedule runs; :mod:`lightning_mmpar.layout.comm`
    counts its collectives too)."""
    ranges, ranks, _ = _stages_of(model, layout)
    samples = layout.micro_batch_size * layout.num_micro_batches * layout.accumulate
    per_rank, runs = [0.0] * layout.pp, [0.0] * layout.pp
    cached = 1 / 3 if layout.pp > 1 else 0.0
    for r, rank in zip(ranges, ranks, strict=True):
        for i in r:
            block = model.blocks[i]
            again = layout.activation_checkpointing and block.name not in _NOT_RECOMPUTED
            extra = (4 / 3 if again else 1.0) + cached  # a forward: ~1/3 of forward + backward
            per_rank[rank] += block.flops * _tp_share(block, layout, kept=False) * extra * samples
            runs[rank] += extra
    return per_rank, runs, sum(b.flops for b in model.blocks) * samples * layout.dp


def compute_seconds(model: Any, layout: Any, device: DeviceSpec) -> list[float]:
    """Compute seconds per optimizer step of each pipeline rank (no bubble): its FLOPs over
    ``peak x efficiency``, plus ``device.overhead`` per block per micro-batch."""
    rate = device.peak(layout.precision) * device.efficiency
    flops, runs, _ = _rank_flops(model, layout)
    batches = layout.num_micro_batches * layout.accumulate
    return [f / rate + device.overhead * n * batches for f, n in zip(flops, runs, strict=True)]


@dataclass(frozen=True)
class RankMemory:
    """Bytes on the fullest rank: exact state (parameters, gradients, optimizer) + activations;
    ``pp_rank`` -1: a vision rank of a non-colocated layout."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    pp_rank: int = 0

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations

    def describe(self) -> str:
        """``93.1 GiB (pipeline rank 0: parameters 41.2 + gradients ... + activations 21.0)``."""
        parts = ("parameters", "gradients", "optimizer", "activations")
        terms = " + ".join(f"{p} {getattr(self, p) / GIB:.1f}" for p in parts)
        where = "a vision rank" if self.pp_rank < 0 else f"pipeline rank {self.pp_rank}"
        return f"{self.total / GIB:.1f} GiB ({where}: {terms})"


@dataclass(frozen=True)
class Prediction:
    """:func:`predict`'s answer for one layout (per optimizer step)."""

    layout: Any
    memory: RankMemory  # the fullest rank's bytes
    comm_bytes: dict[str, int]  # per step by "<dim>.<kind>", the largest over pipeline ranks
    comm_seconds: dict[str, float]  # per step by dimension (tp, ep, pp, dp)
    compute_seconds: float  # the slowest pipeline rank's, no bubble
    bubble: float
    step_seconds: float
    mfu: float
    fits: bool
    reason: str = ""  # why it does not fit (empty when it does)
    placement: Any = None  # the rank order predicted (None: Megatron's)
    breakdown: dict[str, float] = field(default_factory=dict)
    """``step_seconds`` in parts that add up to it (:func:`step_breakdown`)."""
    idle: dict[str, float] = field(default_factory=dict)
    """Non-colocated layouts: seconds per step each side (``language ranks``, ``vision
    ranks``) waits for the other (:mod:`lightning_mmpar.layout.towers_cost`); empty otherwise."""

    @property
    def comm_total_bytes(self) -> int:
        return sum(self.comm_bytes.values())


_DIMS = ("tp", "ep", "edp", "dp", "pp")
_BATCHED = ("pp.send", "pp.recv")
"""Point-to-point keys: a micro-batch's tensors at a stage boundary go as one batched op."""
_P2P = {
    "send": "send_recv",
    "recv": "send_recv",
    "broadcast": "all_gather",
    "all_to_all_v": "all_to_all",
}


def predict(
    model: Any,
    layout: Any,
    device: DeviceSpec,
    graph: Any = None,
    placement: Any = None,
    *,
    memory_gib: float | None = None,
    tower_overlap: bool = False,
) -> Prediction:
    """Predict one layout's step time, memory per rank, communication and MFU (module doc).
    A layout with ``vision_ranks``: :func:`_noncolocated` (``tower_overlap``: its pipelined
    variant).

    ``model``: a ``ModelSpec``; ``layout``: a ``ParallelLayout``; ``graph``: a ``DeviceGraph`` of
    ``>= layout.world`` devices (None: :func:`default_graph`); ``placement``: a ``Placement``
    (None: Megatron's order); ``memory_gib``: what ``fits`` checks (None: the device's).

    Raises:
        ValueError: a layout :func:`~lightning_mmpar.layout.value.validate` refuses, the graph
            has fewer devices than the layout's world, a precision the device has no figure
            for, or a pipeline the model's blocks cannot fill.
    """
    validate(layout)
    if layout.vision_ranks:
        return _noncolocated(model, layout, device, graph, placement, memory_gib, tower_overlap)
    world = layout.world
    graph = _graph_of(layout, graph)
    order = tuple(placement.devices) if placement is not None else tuple(range(world))
    bubble = bubble_fraction(layout.schedule, layout.pp, layout.virtual, layout.num_micro_batches)
    compute = compute_seconds(model, layout, device)
    critical, exposed, busy, wire, memories, per_rank = [], [], [], [], [], []
    worst_bytes, worst_secs = dict[str, int](), dict[str, float]()
    for r in range(layout.pp):
        nbytes, calls, dispatched = comm_profile(model, layout, r)  # one count: hot path
        secs = _comm_seconds(graph, layout, order, r, nbytes, calls)
        per_rank.append(secs)
        for key, n in nbytes.items():
            worst_bytes[key] = max(worst_bytes.get(key, 0), int(n))
        for dim, s in secs.items():
            worst_secs[dim] = max(worst_secs.get(dim, 0.0), s)
        busy.append(compute[r] + device.call_overhead * dispatched)
        critical.append(busy[r] + sum(secs.get(d, 0.0) for d in ("tp", "ep", "pp")))
        exposed.append(sum(s for d, s in secs.items() if d not in ("tp", "ep", "pp")))
        wire.append(sum(secs.values()))
        state = state_bytes(model, layout, {"pp": r, "tp": 0, "dp": 0, "ep": 0})
        acts = activation_bytes(model, layout, r)
        memories.append(RankMemory(state.parameters, state.gradients, state.optimizer, acts, r))
    step = max(critical) / (1 - bubble) + max(exposed)
    r = critical.index(max(critical))
    parts = step_breakdown(compute[r], busy[r], per_rank[r], bubble, max(exposed))
    step = _shared_cores(device, step, busy, max(wire), parts)
    model_flops, peak = _rank_flops(model, layout)[2], device.peak(layout.precision)
    memory = max(memories, key=lambda m: m.total)
    limit = device.memory_gib if memory_gib is None else memory_gib
    fits = memory.total <= limit * GIB
    reason = "" if fits else f"needs {memory.describe()} > {limit:g} GiB"
    return Prediction(
        layout=layout,
        memory=memory,
        comm_bytes=worst_bytes,
        comm_seconds=worst_secs,
        compute_seconds=max(compute),
        bubble=bubble,
        step_seconds=step,
        placement=placement,
        mfu=model_flops / (step * world * peak) if step > 0 else 0.0,
        fits=fits,
        reason=reason,
        breakdown=parts,
    )


def _noncolocated(
    model: Any,
    layout: Any,
    device: DeviceSpec,
    graph: Any = None,
    placement: Any = None,
    memory_gib: float | None = None,
    overlap: bool = False,
) -> Prediction:
    """:func:`predict` for ``layout.vision_ranks > 0``
    (:mod:`lightning_mmpar.layout.towers_cost`): the language ranks' prediction on the
    language blocks (``placement`` orders them), the vision side's (``tower_cost``), the step
    as run (``overlap=False``: serial with ``accumulate == 1``, the vision rank one batch
    ahead otherwise, ``run_ahead_seconds``) or its pipelined bound (``True``). ``breakdown``
    adds up to the step; ``idle`` gives each side's wait;
    ``memory`` is the fuller of a language and a vision rank; ``comm_bytes`` adds
    ``towers.send`` / ``towers.recv`` (vision rank 0's embeddings out, gradients and pixels
    in) and the vision ranks' own collectives (``vision.all_reduce``; under
    ``vision_data_parallel="fsdp"`` ``vision.all_gather`` and ``vision.reduce_scatter`` too:
    :func:`~lightning_mmpar.layout.towers_cost.vision_comm_bytes`).

    Raises:
        ValueError: as :func:`predict`, or from ``split_towers``.
    """
    v = layout.vision_ranks
    graph = graph if graph is not None else default_graph(layout.world + v)
    _, language = split_towers(model)
    lang = predict(
        language, language_layout(layout), device, graph, placement, memory_gib=memory_gib
    )
    rate = (device.peak(layout.precision) * device.efficiency, device.overhead)
    element = ACTIVATION_ELEMENT_BYTES.get(layout.precision, 4)
    tower = tower_cost(model, layout, rate, graph, element)
    vision_memory = RankMemory(*tower.state, tower.activations, -1)
    side = tower.busy
    if overlap:
        step = max(side, lang.step_seconds) + tower.transfer
        parts = _overlapped_parts(lang, tower)
        idle = {"language ranks": step - lang.step_seconds, "vision ranks": step - side}
    elif layout.accumulate > 1:  # the vision rank one batch ahead inside each window
        step = run_ahead_seconds(tower, lang.step_seconds, layout.accumulate)
        parts = _run_ahead_parts(lang, tower, step)
        idle = {"language ranks": step - lang.step_seconds, "vision ranks": step - side}
    else:
        step = side + tower.transfer + lang.step_seconds
        parts = {f"vision {k}": s for k, s in _vision_parts(tower).items()}
        parts.update(lang.breakdown)
        wait = tower.transfer
        idle = {"language ranks": side + wait, "vision ranks": lang.step_seconds + wait}
    memory = max(lang.memory, vision_memory, key=lambda m: m.total)
    limit = device.memory_gib if memory_gib is None else memory_gib
    fits = memory.total <= limit * GIB
    flops = sum(b.flops for b in model.blocks) * layout.global_batch
    peak = device.peak(layout.precision) * (layout.world + v)
    comm = dict(lang.comm_bytes)
    comm["towers.send"] = tower.embedding_bytes
    comm["towers.recv"] = tower.gradient_bytes + tower.pixel_bytes
    comm.update({"vision.all_reduce": 0, **vision_comm_bytes(model, layout)})
    seconds = dict(lang.comm_seconds) | {"towers": tower.transfer, "vision dp": tower.sync}
    return replace(
        lang,
        layout=layout,
        memory=memory,
        comm_bytes=comm,
        comm_seconds=seconds,
        compute_seconds=max(lang.compute_seconds, tower.forward + tower.backward),
        step_seconds=step,
        mfu=flops / (step * peak) if step > 0 else 0.0,
        fits=fits,
        reason="" if fits else f"needs {memory.describe()} > {limit:g} GiB",
        breakdown=parts,
        idle=idle,
    )


def _vision_parts(tower: TowerCost) -> dict[str, float]:
    return {
        "forward": tower.forward,
        "backward": tower.backward,
        "dp communication": tower.sync,
        "embedding transfer": tower.transfer,
    }


def _busier_side_parts(lang: Prediction, tower: TowerCost) -> dict[str, float]:
    """The parts of the side with more work per step (the vision ranks' without the
    transfer)."""
    if tower.busy > lang.step_seconds:
        own = _vision_parts(tower).items()
        return {f"vision {k}": s for k, s in own if k != "embedding transfer"}
    return dict(lang.breakdown)


def _overlapped_parts(lang: Prediction, tower: TowerCost) -> dict[str, float]:
    """The critical side's parts, then the exposed transfer."""
    parts = _busier_side_parts(lang, tower)
    parts["vision embedding transfer"] = tower.transfer
    return parts


def _run_ahead_parts(lang: Prediction, tower: TowerCost, step: float) -> dict[str, float]:
    """The busier side's own parts, then what it waits for the other (transfers included)."""
    parts = _busier_side_parts(lang, tower)
    parts["waiting for the other side"] = step - sum(parts.values())
    return parts


def _graph_of(layout: Any, graph: Any) -> Any:
    """``graph``, or :func:`default_graph` of the layout's world; ``ValueError`` when it has
    fewer devices than the layout's world."""
    world = layout.world
    graph = graph if graph is not None else default_graph(world)
    if graph.num_devices < world:
        raise ValueError(
            f"the topology has {graph.num_devices} devices, the layout needs {world} "
            "(tp * pp * dp); give a topology of the whole job or a smaller layout."
        )
    return graph


def _shared_cores(
    device: DeviceSpec, step: float, busy: list[float], wire: float, parts: dict[str, float]
) -> float:
    """Ranks time-sharing cores (``device.shared > 1``): idle ranks lend theirs, busy ones
    share, so the step is at least ``shared x mean busy + wire``; the excess is recorded in
    ``parts`` as ``cores shared by ranks``."""
    if device.shared <= 1:
        return step
    shared = device.shared * sum(busy) / len(busy) + wire
    if shared > step:
        parts["cores shared by ranks"] = shared - step
    return max(step, shared)


def step_breakdown(
    compute: float, busy: float, comm: dict[str, float], bubble: float, exposed: float
) -> dict[str, float]:
    """The parts of :func:`predict`'s step on the critical pipeline rank, in seconds: its
    compute, kernel-launch overhead (``busy - compute``), its blocking tp / ep / pp
    communication, the pipeline bubble (the critical path's ``bubble / (1 - bubble)``) and the
    data-parallel communication left exposed (``exposed``); their sum is the step."""
    parts = {"compute": compute, "launch overhead": busy - compute}
    blocking = {d: comm.get(d, 0.0) for d in ("tp", "ep", "pp")}
    parts.update({f"{d} communication": s for d, s in blocking.items()})
    critical = busy + sum(blocking.values())
    parts["pipeline bubble"] = critical * bubble / (1 - bubble)
    parts["dp communication (exposed)"] = exposed
    return parts


def _comm_seconds(
    graph: Any,
    layout: Any,
    order: Sequence[int],
    pp_rank: int,
    nbytes: dict[str, int],
    calls: dict[str, int],
) -> dict[str, float]:
    """Seconds per dimension of pipeline rank ``pp_rank``'s collectives, each key timed on the
    slowest of the rank's groups of its dimension as ``calls[key]`` equal messages
    (:func:`lightning_mmpar.layout.comm.comm_calls`), each paying the latency; a stage's sends
    of a micro-batch are one batched op (``batch_isend_irecv``): one latency."""
    shape, per_pp = (layout.pp, layout.dp // layout.ep, layout.ep, layout.tp), layout.dp * layout.tp
    out: dict[str, float] = {}
    for key, n in nbytes.items():
        dim, _, kind = key.partition(".")
        if dim not in _DIMS or not n or kind == "barrier":
            continue
        k = max(1, calls.get(key, 1))
        if key in _BATCHED:  # a micro-batch's tensors at a boundary go as one batched P2P op
            k = layout.num_micro_batches * layout.accumulate * layout.virtual
        groups = [g for g in _groups(shape, dim) if dim == "pp" or g[0] // per_pp == pp_rank]
        kind = _P2P.get(kind, kind)
        t = k * max(collective_seconds(graph, kind, [order[p] for p in g], n / k) for g in groups)
        label = "dp" if dim == "edp" else dim
        out[label] = out.get(label, 0.0) + t
    return out


@functools.lru_cache(maxsize=16)
def default_graph(world: int) -> DeviceGraph:
    """:func:`predict`'s default: NVSwitch nodes of ``world`` (<= 8) or ``gcd(world, 8)``, NET."""
    return DeviceGraph.uniform(world, world if world <= 8 else math.gcd(world, 8))


@functools.lru_cache(maxsize=256)
def _groups(shape: tuple[int, ...], dim: str) -> list[list[int]]:
    return group_positions(shape, dim)
