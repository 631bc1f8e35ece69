"""The layout of a run, as one plain value, and the one function that checks it.

A *layout* is how a run spreads over its ranks: the parallel degrees (``tp``, ``pp``, ``ep``,
``dp``, ``virtual``), the pipeline schedule and its micro-batches, the data-parallel engine, and
the options whose validity depends on them (partition, sequence parallelism, the vision tower's
mode, FSDP2 policies). :class:`ParallelLayout` holds it; the strategy
(``lightning_mmpar.config.ParallelConfig``), the pre-launch check
(``lightning_mmpar.recipes.preflight``) and the planner (:mod:`lightning_mmpar.layout.planner`)
all check it with :func:`validate`, so a layout one of them accepts the others accept too, and
a layout they refuse is refused with the same message.

What a layout is checked against comes in as :class:`LayoutFacts`: the world size, the batch,
and what the model tells (sizes tensor parallelism splits, experts, pipeline blocks, the text
length), extracted by the model's plan (``lightning_mmpar.plans.fusion.fusion_facts``), so this
module holds no model knowledge. A fact left ``None`` (unknown) skips the rules that need it.

Peers: torchtitan's ``ParallelDims._validate`` (degrees vs world), Megatron-LM's
``validate_args`` (degrees, schedule and micro-batch rules) and ``TransformerConfig``
(heads vs tensor parallelism), each refusing a layout at start-up with a message.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_mmpar.layout.partition import parse_partition
from lightning_mmpar.layout.schedules import MULTI_STAGE_SCHEDULES as _MULTI_STAGE
from lightning_mmpar.layout.schedules import ROUND_SCHEDULES as _ROUNDS
from lightning_mmpar.layout.schedules import SCHEDULES as _SCHEDULES
from lightning_mmpar.layout.schedules import SPLIT_BACKWARD_SCHEDULES as _SPLIT_BACKWARD
from lightning_mmpar.layout.schedules import V_SCHEDULES as _V_SCHEDULES
from lightning_mmpar.layout.schedules import min_micro_batches as _min_micro_batches

__all__ = [
    "LayoutFacts",
    "LayoutSpec",
    "ParallelLayout",
    "TpSize",
    "check_vision_batch",
    "validate",
]

PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "fp8")
"""Precisions the cost model has figures for (``Trainer(precision=...)``)."""
VISION_PARALLEL = ("tp", "replicate", "dp")
"""How the vision tower runs inside a tensor-parallel group
(``lightning_mmpar.plans.fusion_vision``)."""
DATA_PARALLEL = ("fsdp", "ddp", "none")
"""Data-parallel engines: FSDP2, DDP, or none (one replica)."""
VISION_DATA_PARALLEL = ("ddp", "fsdp")
"""The vision tower's engine on its own ranks (``vision_ranks``): full copies with summed
gradients, or FSDP2 over the vision ranks."""
_STRATEGY_NAMES = {
    "tp": "tensor_parallel",
    "pp": "pipeline_parallel",
    "ep": "expert_parallel",
    "virtual": "virtual_pipeline",
    "micro_batches": "micro_batches",
    "dp": "dp",
    "micro_batch_size": "micro_batch_size",
    "accumulate": "accumulate_grad_batches",
}
"""Field -> the name a user writes (the strategy's argument, Lightning's Trainer flag)."""

TpSize = tuple[str, str, int]
"""``(module, field, value)``: a model size tensor parallelism splits, e.g.
``("language.layers.*.self_attn", "LanguageConfig.num_key_value_heads", 8)``."""


@dataclass(frozen=True)
class ParallelLayout:
    """One layout: the strategy's layout arguments and the run options that change
    communication or memory (the cost model's input). Plain data: :func:`validate` checks it.

    ``dp`` is ``None`` when the world size is not known yet (the strategy before launch:
    ``dp = world_size / (tp * pp)``).
    """

    tp: int = 1
    """Tensor-parallel degree (``tensor_parallel``)."""
    pp: int = 1
    """Pipeline-parallel degree (``pipeline_parallel``)."""
    dp: int | None = 1
    """Data-parallel replicas; ``None``: follows from the world size."""
    ep: int = 1
    """Expert-parallel degree (``expert_parallel``), carved out of ``dp``."""
    virtual: int = 1
    """Pipeline stages per pipeline rank (``virtual_pipeline``)."""
    micro_batches: int | None = None
    """Micro-batches per batch on a dp rank (the pipeline's ``n_microbatches``); ``None``: the
    schedule's default, :attr:`num_micro_batches`."""
    micro_batch_size: int = 1
    """Samples per micro-batch (a dp rank's batch is ``micro_batches * micro_batch_size``)."""
    accumulate: int = 1
    """Lightning's ``accumulate_grad_batches``: batches per optimizer step."""
    schedule: str = "1f1b"
    """Pipeline schedule (``lightning_mmpar.config.SCHEDULES``)."""
    partition: str | tuple[int, ...] = "equal"
    """How blocks become stages (:func:`~lightning_mmpar.layout.partition.parse_partition`)."""
    vision_parallel: str = "tp"
    """The vision tower inside a tp group: ``tp``, ``replicate`` or ``dp``."""
    sequence_parallel: bool = False
    """Text residual stream sharded along the sequence over tp."""
    data_parallel: str = "fsdp"
    """Data-parallel engine: ``fsdp``, ``ddp`` or ``none``."""
    activation_checkpointing: bool = False
    """The strategy's ``activation_checkpointing="layers"``: the model's layers (the plan's
    ``layers``; for the fusion model every block but the stem, pooler, bridge and head) are
    recomputed in backward."""
    precision: str = "32-true"
    """Lightning's ``Trainer(precision=...)`` (the cost model's arithmetic and bytes)."""
    clip: bool = False
    """Gradient clipping by the global norm (one float64 all-reduce per optimizer step)."""
    mixed_precision: Any = field(default=None, hash=False)
    """The strategy's FSDP2 ``mixed_precision`` policy (``None``: off)."""
    offload_optimizer: bool = False
    """The strategy's FSDP2 CPU offload of parameters, gradients and optimizer state."""
    vision_ranks: int = 0
    """Ranks that run the vision tower alone (the strategy's ``vision_ranks``, Megatron-Bridge
    MIMO's non-colocated encoder); ``0``: colocated, every rank holds its share of every tower.
    Not counted in :attr:`world` (the language ranks)."""
    vision_data_parallel: str = "ddp"
    """The vision tower's data parallelism over its ``vision_ranks`` (the strategy's
    ``vision_data_parallel``): ``ddp`` (a full copy per vision rank, gradients summed) or
    ``fsdp`` (FSDP2: parameters, gradients and optimizer state sharded over the vision ranks,
    gradients reduce-scattered). Needs ``vision_ranks >= 2`` for ``fsdp``."""

    @property
    def num_micro_batches(self) -> int:
        """:attr:`micro_batches`, by default ``pp`` (the schedule's minimum when higher:
        ``pp * virtual`` for ``dualpipev``); 1 without pipeline parallelism."""
        if self.micro_batches is not None:
            return self.micro_batches
        if self.pp == 1:
            return 1
        return max(self.pp, _min_micro_batches(self.schedule, self.pp, self.virtual))

    @property
    def num_stages(self) -> int:
        """Pipeline stages: ``pp * virtual``."""
        return self.pp * self.virtual

    @property
    def dp_size(self) -> int:
        """``dp`` as a number; raises ``ValueError`` while it is unknown (``None``)."""
        if self.dp is None:
            raise ValueError(
                "dp (None) is not known yet: it follows from the world size; pass dp, or "
                "validate the layout with LayoutFacts(world_size=...)."
            )
        return self.dp

    @property
    def world(self) -> int:
        """Ranks of the layout: ``tp * pp * dp`` (``dp`` known: :attr:`dp_size`)."""
        return self.tp * self.pp * self.dp_size

    @property
    def edp(self) -> int:
        """Data-parallel degree of expert weights: ``dp // ep``."""
        return self.dp_size // self.ep

    @property
    def local_batch(self) -> int:
        """Samples per batch on one dp rank: ``num_micro_batches * micro_batch_size``."""
        return self.num_micro_batches * self.micro_batch_size

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step: ``dp * local_batch * accumulate``."""
        return self.dp_size * self.local_batch * self.accumulate

    def strategy_args(self) -> dict[str, Any]:
        """``MultimodalParallelStrategy`` ``init_args`` of this layout (a recipe YAML fragment);
        defaults left out."""
        out: dict[str, Any] = {}
        for key, value, default in (
            ("tensor_parallel", self.tp, 1),
            ("pipeline_parallel", self.pp, 1),
            ("expert_parallel", self.ep, 1),
            ("virtual_pipeline", self.virtual, 1),
            ("data_parallel", self.data_parallel, "fsdp"),
            ("vision_ranks", self.vision_ranks, 0),
            ("vision_data_parallel", self.vision_data_parallel, "ddp"),
        ):
            if value != default:
                out[key] = value
        if self.pp > 1:
            out["micro_batches"] = self.num_micro_batches
            out["schedule"] = self.schedule
            if self.partition != "equal":
                part = self.partition
                out["partition"] = list(part) if isinstance(part, tuple) else part
        return out


@dataclass(frozen=True)
class LayoutSpec(ParallelLayout):
    """Deprecated name of :class:`ParallelLayout`, which :func:`validate` checks; a
    ``LayoutSpec`` still validates itself on construction (no facts), with a
    ``DeprecationWarning``."""

    def __post_init__(self) -> None:
        warnings.warn(
            "lightning_mmpar.layout.LayoutSpec is deprecated: use ParallelLayout and "
            "lightning_mmpar.layout.validate (LayoutSpec will be removed in the next release).",
            DeprecationWarning,
            stacklevel=3,
        )
        validate(self)


@dataclass(frozen=True, kw_only=True)
class LayoutFacts:
    """What a layout is checked against; ``None`` (or empty) = unknown, its rules skipped."""

    world_size: int | None = None
    """Processes of the run (``devices * num_nodes``)."""
    batch_size: int | None = None
    """Samples per batch on one data-parallel rank."""
    batch_name: str = "data.batch_size"
    """What the user sets the batch with (named in the messages)."""
    pipeline_blocks: int | None = None
    """The model's pipeline blocks (at most one stage each)."""
    tp_sizes: tuple[TpSize, ...] = ()
    """Sizes tensor parallelism splits, whatever the vision tower's mode."""
    vision_tp_sizes: tuple[TpSize, ...] = ()
    """Sizes it splits under ``vision_parallel='tp'`` only."""
    vision_layers: int | None = None
    """Blocks of the vision tower (``vision_parallel='dp'`` gathers after the last)."""
    experts: tuple[tuple[str, int], ...] | None = None
    """``(field, num_experts)`` of each mixture-of-experts part; ``()``: the model has none."""
    no_experts: str = "the model has no mixture-of-experts layers; use a model with MoE FFNs"
    """Said when ``expert_parallel > 1`` finds no MoE layers: where the user would add them."""
    sequence_length: int | None = None
    """Text tokens per sample (what sequence parallelism splits)."""
    sequence_name: str = "data.max_length"
    """What the user sets the text length with."""
    no_sequence_parallel: str | None = None
    """Why the model refuses sequence parallelism (``None``: it does not), e.g. spliced image
    tokens, which replace embedding rows a sequence shard does not hold."""


def validate(layout: ParallelLayout, facts: LayoutFacts | None = None) -> None:
    """Check ``layout`` against ``facts`` (default: none known).

    In order: the values themselves (degrees positive ints, known names), the pipeline
    (virtual stages, schedule, micro-batches, partition; ``micro_batches`` above 1 or another
    schedule than ``"1f1b"`` without one), the FSDP2 policies, the world (its
    size divisible by ``tp * pp``, ``ep`` dividing ``dp``, the engine vs ``dp``), the model
    (sizes vs ``tp``, experts vs ``ep``, text vs sequence parallelism, stages vs blocks) and the
    batch (vs micro-batches; images vs ``tp`` under ``vision_parallel='dp'``).

    Raises:
        ValueError: the first rule broken; the message names the field, the value and the fix.
    """
    facts = facts if facts is not None else LayoutFacts()
    _check_values(layout)
    _check_pipeline(layout)
    _check_partition(layout)
    _check_fsdp_policies(layout)
    _check_towers(layout)
    _check_world(layout, facts.world_size)
    _check_model(layout, facts)
    _check_batch(layout, facts)


def _check_values(layout: ParallelLayout) -> None:
    """Positive int degrees and counts; known schedule, engine, vision mode and precision."""
    for name, value in (
        ("tp", layout.tp),
        ("pp", layout.pp),
        ("ep", layout.ep),
        ("virtual", layout.virtual),
        ("micro_batches", layout.micro_batches),
        ("dp", layout.dp),
        ("micro_batch_size", layout.micro_batch_size),
        ("accumulate", layout.accumulate),
    ):
        if value is None and name in ("micro_batches", "dp"):
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(
                f"{_STRATEGY_NAMES[name]} ({value!r}) must be a positive integer; "
                "use 1 to disable it."
            )
    if layout.schedule not in _SCHEDULES:
        raise ValueError(
            f"schedule ({layout.schedule!r}) is not a known pipeline schedule; "
            f"choose one of {', '.join(_SCHEDULES)}."
        )
    if layout.data_parallel not in DATA_PARALLEL:
        raise ValueError(
            f"data_parallel ({layout.data_parallel!r}) is not a known engine; "
            f"choose one of {', '.join(DATA_PARALLEL)}."
        )
    if layout.vision_parallel not in VISION_PARALLEL:
        raise ValueError(
            f"vision_parallel ({layout.vision_parallel!r}) must be 'tp' or 'replicate' or 'dp': "
            "shard the ViT by heads, keep a full copy per tensor-parallel rank, or split the "
            "images over them."
        )
    if layout.precision not in PRECISIONS:
        raise ValueError(
            f"precision ({layout.precision!r}) has no cost-model figures; use one of "
            f"{', '.join(PRECISIONS)}."
        )


def _check_pipeline(layout: ParallelLayout) -> None:
    """Virtual stages vs pipeline and schedule; the schedule's micro-batch rules."""
    pp, v, name = layout.pp, layout.virtual, layout.schedule
    if v > 1 and pp == 1:
        raise ValueError(
            f"virtual_pipeline ({v}) needs pipeline_parallel > 1 (got 1); "
            "set pipeline_parallel >= 2 or virtual_pipeline=1."
        )
    if v > 1 and name not in _MULTI_STAGE:
        raise ValueError(
            f"virtual_pipeline ({v}) needs a multi-stage schedule (got {name!r}); set "
            f"schedule to one of {', '.join(sorted(_MULTI_STAGE))} or virtual_pipeline=1."
        )
    if pp == 1:
        _check_no_pipeline(layout)
        return
    if name in _MULTI_STAGE and v == 1:
        raise ValueError(
            f"schedule={name!r} needs virtual_pipeline >= 2 (got 1); "
            "set virtual_pipeline=2 or use schedule='1f1b'."
        )
    if name in _V_SCHEDULES and v != 2:
        raise ValueError(
            f"schedule={name!r} needs virtual_pipeline=2 (got {v}): its V stage order holds "
            "exactly two stages per pipeline rank; set virtual_pipeline=2."
        )
    n, low = layout.num_micro_batches, _min_micro_batches(name, pp, v)
    if n < low:
        what = "pipeline_parallel" if low == pp else "the pipeline stages"
        size = f"{pp}" if low == pp else f"{low} = pipeline_parallel * virtual_pipeline"
        raise ValueError(
            f"micro_batches ({n}) must be >= {what} ({size}) for the {name} schedule; "
            f"set micro_batches to at least {low}."
        )
    rounds = max(1, n // pp)
    if name in _ROUNDS and n % rounds != 0:
        raise ValueError(
            f"micro_batches ({n}) must be a multiple of its rounds ({rounds} = "
            f"micro_batches // pipeline_parallel) for {name}; use {rounds * pp}."
        )


def _check_no_pipeline(layout: ParallelLayout) -> None:
    """Pipeline options that cannot act without a pipeline: ``micro_batches`` above 1 (each
    batch runs whole) and a schedule other than the default ``"1f1b"`` (nothing to schedule).
    Megatron-LM's ``validate_args`` likewise refuses pipeline-only options without a pipeline."""
    n, name = layout.micro_batches, layout.schedule
    if n is not None and n > 1:
        raise ValueError(
            f"micro_batches ({n}) cannot act with pipeline_parallel=1: each batch runs whole. "
            "Set pipeline_parallel >= 2, or leave micro_batches unset (null); "
            "Trainer(accumulate_grad_batches=...) accumulates several batches per step."
        )
    if name != "1f1b":
        raise ValueError(
            f"schedule ({name!r}) cannot act with pipeline_parallel=1: there is no pipeline to "
            "schedule. Set pipeline_parallel >= 2, or leave schedule unset (the default "
            "'1f1b')."
        )


def _check_partition(layout: ParallelLayout) -> None:
    """The partition parses and, under a pipeline, fits the stage count."""
    parse_partition(layout.partition, layout.num_stages if layout.pp > 1 else None)


def _check_fsdp_policies(layout: ParallelLayout) -> None:
    """FSDP2 policies need the FSDP engine, and not expert parallelism (expert weights are
    sharded by their own units outside the policies)."""
    for name, value, off in (
        ("mixed_precision", layout.mixed_precision, None),
        ("offload_optimizer", layout.offload_optimizer, False),
    ):
        if value not in (None, False) and layout.data_parallel != "fsdp":
            raise ValueError(
                f"{name}={value!r} is an FSDP2 policy but data_parallel="
                f"{layout.data_parallel!r}; set data_parallel='fsdp' or {name}={off}."
            )
    uses_fsdp = layout.mixed_precision is not None or layout.offload_optimizer
    if uses_fsdp and layout.ep > 1:
        raise ValueError(
            f"mixed_precision / offload_optimizer with expert_parallel={layout.ep}: "
            "expert weights are sharded by their own FSDP units outside these policies; "
            "set expert_parallel=1 or leave mixed_precision=None, offload_optimizer=False."
        )


def _check_towers(layout: ParallelLayout) -> None:
    """``vision_ranks``: a non-negative int; above 0 only with what the non-colocated data flow
    supports (no expert parallelism, no split weight-gradient schedule, no sequence
    parallelism)."""
    v = layout.vision_ranks
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(
            f"vision_ranks ({v!r}) must be a non-negative integer: the ranks that run the "
            "vision tower alone; use 0 to keep it on every rank (colocated)."
        )
    _check_vision_engine(layout.vision_data_parallel, v)
    if v == 0:
        return
    if layout.ep > 1:
        raise ValueError(
            f"vision_ranks ({v}) with expert_parallel ({layout.ep}) is not supported: set "
            "expert_parallel=1 or vision_ranks=0 (colocated)."
        )
    if layout.schedule in _SPLIT_BACKWARD and layout.pp > 1:
        raise ValueError(
            f"vision_ranks ({v}) with schedule={layout.schedule!r} is not supported: its split "
            "weight-gradient backward never computes the gradient of the received image "
            "embeddings; choose schedule='1f1b', 'gpipe', 'interleaved_1f1b' or 'looped_bfs', "
            "or vision_ranks=0."
        )
    if layout.sequence_parallel and layout.tp > 1:
        raise ValueError(
            f"vision_ranks ({v}) with sequence_parallel (True) is not supported: the received "
            "image embeddings' gradient would be a sequence shard; set sequence_parallel "
            "false or vision_ranks=0."
        )


def _check_vision_engine(engine: str, v: int) -> None:
    """``vision_data_parallel``: a known engine; ``fsdp`` only over two or more vision ranks
    (with ``vision_ranks=0`` the tower follows ``data_parallel``; over one rank FSDP2 shards
    nothing and would only add its hooks: refused rather than silently a full copy)."""
    if engine not in VISION_DATA_PARALLEL:
        raise ValueError(
            f"vision_data_parallel ({engine!r}) is not a known engine for the vision ranks; "
            f"choose one of {', '.join(repr(e) for e in VISION_DATA_PARALLEL)}."
        )
    if engine == "fsdp" and v == 0:
        raise ValueError(
            "vision_data_parallel ('fsdp') needs vision_ranks >= 2 (got 0): it shards the "
            "vision tower over its own ranks; set vision_ranks=2 or more, or leave "
            "vision_data_parallel='ddp' (a colocated tower follows data_parallel)."
        )
    if engine == "fsdp" and v == 1:
        raise ValueError(
            "vision_data_parallel ('fsdp') with vision_ranks (1): FSDP2 over one rank shards "
            "nothing (the rank holds the whole tower either way); set vision_ranks=2 or more, "
            "or vision_data_parallel='ddp'."
        )


def _check_vision_world(layout: ParallelLayout, world: int) -> int:
    """The language ranks of ``world`` (``world - vision_ranks``), checked: at least one
    model-parallel group, and the language data-parallel replicas and the vision ranks
    dividing one another (each vision rank serves ``dp / vision_ranks`` replicas, or each
    replica's images split over ``vision_ranks / dp`` vision ranks)."""
    v, model = layout.vision_ranks, layout.tp * layout.pp
    language = world - v
    if language < model or language % model:
        raise ValueError(
            f"world_size ({world}) minus vision_ranks ({v}) leaves {language} language ranks, "
            f"which must be a positive multiple of tensor_parallel * pipeline_parallel "
            f"({layout.tp} * {layout.pp} = {model}); run on {v + model} (or {v} + a multiple "
            f"of {model}) processes, or change vision_ranks."
        )
    dp = language // model
    if dp % v and v % dp:
        raise ValueError(
            f"vision_ranks ({v}) and the language data-parallel replicas ({dp} = {language} "
            f"language ranks / (tensor_parallel * pipeline_parallel {model})) must divide one "
            f"another; {_vision_world_fixes(v, model, world)}."
        )
    return language


def _vision_world_fixes(v: int, model: int, world: int) -> str:
    """The fixes of a ``vision_ranks`` that does not divide (or is not divided by) the
    language replicas: the counts that fit this world size, and the world sizes that fit this
    count (``model``: tensor_parallel * pipeline_parallel)."""

    def fits(vision: int, replicas: int) -> bool:
        return replicas >= 1 and (replicas % vision == 0 or vision % replicas == 0)

    here = [
        x for x in range(1, world) if (world - x) % model == 0 and fits(x, (world - x) // model)
    ]
    worlds = [v + model * r for r in range(1, 4 * v + 1) if fits(v, r)][:4]
    keep = f"keep vision_ranks={v} on {' / '.join(map(str, worlds))} processes"
    if not here:
        return f"no vision_ranks fits {world} processes: {keep}"
    return f"at {world} processes use vision_ranks in {here}, or {keep}"


def _check_world(layout: ParallelLayout, world: int | None) -> None:
    """The world vs the degrees (``dp`` from the world size, or the layout's)."""
    tp, pp, model = layout.tp, layout.pp, layout.tp * layout.pp
    dp = layout.dp
    if world is not None and layout.vision_ranks:
        world = _check_vision_world(layout, world)
    if world is not None:
        if world % model != 0:
            raise ValueError(
                f"world_size ({world}) must be divisible by tensor_parallel * "
                f"pipeline_parallel ({tp} * {pp} = {model}); change the number of "
                f"devices to a multiple of {model} or reduce the model-parallel sizes."
            )
        if dp is not None and dp != world // model:
            raise ValueError(
                f"dp ({dp}) must be world_size / (tensor_parallel * pipeline_parallel) "
                f"({world} / {model} = {world // model}); set dp={world // model}."
            )
        dp = world // model
    if dp is not None:
        _check_data_parallel(layout, dp)


def _check_data_parallel(layout: ParallelLayout, dp: int) -> None:
    """``ep`` divides ``dp``; the engine can run ``dp`` replicas."""
    tp, pp, model = layout.tp, layout.pp, layout.tp * layout.pp
    world = dp * model
    if dp % layout.ep != 0:
        raise ValueError(
            f"expert_parallel ({layout.ep}) must divide the data-parallel size ({dp} = "
            f"world_size {world} / (tensor_parallel {tp} * pipeline_parallel {pp})); choose "
            f"expert_parallel from {[d for d in range(1, dp + 1) if dp % d == 0]}."
        )
    if dp == 1:
        return
    split = layout.schedule in _SPLIT_BACKWARD and pp > 1
    if split and layout.data_parallel == "fsdp":
        raise ValueError(
            f"schedule={layout.schedule!r} cannot run with data_parallel='fsdp' over {dp} "
            "data-parallel replicas on this torch: its split weight-gradient backward "
            "bypasses FSDP2's per-block gradient reduce-scatter (measured: wrong gradients "
            "at dp 2 x pp 2). "
            "Set data_parallel='ddp', or choose schedule='interleaved_1f1b' or 'looped_bfs'."
        )
    if layout.data_parallel == "none":
        raise ValueError(
            f"data_parallel ('none') cannot run {dp} data-parallel replicas "
            f"(world_size {world} / (tensor_parallel {tp} * pipeline_parallel {pp})): their "
            "gradients would never be averaged. Set data_parallel='fsdp' or 'ddp', or run on "
            f"{model} processes (devices * num_nodes)."
        )


def _tp_fix(name: str, value: int, tp: int) -> str:
    """The two ways out: the field's nearest multiples of ``tp``, or a smaller ``tp``."""
    low, high = value // tp * tp, (value // tp + 1) * tp
    tps = " or ".join(str(d) for d in range(1, tp) if value % d == 0 and tp % d == 0)
    near = f"{low} or {high}" if low > 0 else f"{high}"
    return f"nearest valid {name.rsplit('.', 1)[-1]}: {near}; or tensor_parallel {tps}"


def _check_model(layout: ParallelLayout, facts: LayoutFacts) -> None:
    """Sizes vs ``tp``, experts vs ``ep``, text vs sequence parallelism, stages vs blocks."""
    tp, layers = layout.tp, facts.vision_layers
    if layout.vision_parallel == "dp" and layers is not None and layers < 1:
        raise ValueError(
            f"vision_parallel='dp' gathers the images after the last ViT block, but "
            f"VisionConfig.layers is {layers}; use layers >= 1 or vision_parallel='replicate'."
        )
    sharded = layout.vision_parallel == "tp" and not layout.vision_ranks  # own ranks: whole
    vision = facts.vision_tp_sizes if sharded else ()
    for module, name, value in (*vision, *facts.tp_sizes):
        if value % tp != 0:
            raise ValueError(
                f"{module}: {name} ({value}) must be divisible by the tensor-parallel size "
                f"({tp}); {_tp_fix(name, value, tp)}."
            )
    if facts.experts is not None:
        _check_experts(layout, facts.experts, facts.no_experts)
    length = facts.sequence_length
    if layout.sequence_parallel and tp > 1 and length is not None and length % tp:
        raise ValueError(
            f"sequence_parallel (True) shards the text ({length} tokens) over tp ({tp}), "
            f"which does not divide it; set {facts.sequence_name} to a multiple of {tp} "
            f"(e.g. {-(-length // tp) * tp}) or "
            "sequence_parallel false."
        )
    if layout.sequence_parallel and tp > 1 and facts.no_sequence_parallel:
        raise ValueError(
            f"sequence_parallel (True) is not supported: {facts.no_sequence_parallel}; set "
            "sequence_parallel false."
        )
    blocks, stages = facts.pipeline_blocks, layout.num_stages
    if layout.pp > 1 and blocks is not None and stages > blocks:
        raise ValueError(
            f"pipeline stages ({stages} = pipeline_parallel * virtual_pipeline) exceed the "
            f"model's pipeline blocks ({blocks}); use at most {blocks} stages or a deeper "
            f"model. With pipeline_parallel={layout.pp}: virtual_pipeline <= "
            f"{blocks // layout.pp}."
        )


def _check_experts(layout: ParallelLayout, experts: Sequence[tuple[str, int]], no: str) -> None:
    """``ep > 1`` needs MoE layers whose expert counts it divides; no sequence parallelism
    with MoE layers (they route whole sequences on every tp rank)."""
    ep = layout.ep
    if not experts and ep > 1:
        raise ValueError(
            f"expert_parallel ({ep}) needs mixture-of-experts layers, but {no} or set "
            "expert_parallel=1."
        )
    for name, count in experts:
        if count % ep:
            raise ValueError(
                f"{name} ({count}) must be divisible by expert_parallel ({ep}); use a multiple "
                f"of {ep} experts or another ep."
            )
    if experts and layout.sequence_parallel and layout.tp > 1:
        raise ValueError(
            "plan.sequence_parallel (True) is not supported with mixture-of-experts "
            "layers: they route whole sequences on every tp rank; set it to false."
        )


def _check_batch(layout: ParallelLayout, facts: LayoutFacts) -> None:
    """The batch splits into equal micro-batches (torch's pipeline stages fix activation
    shapes at the first step); under ``vision_parallel='dp'`` each splits over ``tp``."""
    batch, name = facts.batch_size, facts.batch_name
    if batch is None:
        return
    n, piped = layout.num_micro_batches, layout.pp > 1
    if piped and batch % n:
        raise ValueError(
            f"{name} ({batch}) must be divisible by micro_batches ({n}) under pipeline "
            f"parallelism; use a multiple of {n}, e.g. {max(n, batch // n * n)} "
            "(drop_last=True avoids a short last batch)."
        )
    if layout.vision_parallel != "dp" or layout.tp == 1 or layout.vision_ranks:
        return
    if piped:
        check_vision_batch(
            batch // n, layout.tp, f"each micro-batch ({name} {batch} / micro_batches {n})"
        )
    else:
        check_vision_batch(batch, layout.tp, f"each batch ({name} {batch})")


def check_vision_batch(batch: int, tp: int, what: str = "the micro-batch") -> None:
    """``vision_parallel='dp'`` splits every (micro-)batch's images (``what``) over the ``tp``
    ranks (a rule of :func:`validate`; the strategy also runs it on every batch).

    Raises:
        ValueError: ``batch`` not a multiple of ``tp``, naming both and the fix.
    """
    if batch % tp:
        fit = max(tp, batch // tp * tp)
        raise ValueError(
            f"vision_parallel='dp' splits the images of {what} over the tensor-parallel ranks: "
            f"its size ({batch}) must be divisible by tensor_parallel ({tp}); use a multiple of "
            f"{tp} images per micro-batch (e.g. {fit}: data.batch_size per data-parallel rank a "
            f"multiple of micro_batches * {tp}, drop_last=True) or vision_parallel='replicate'."
        )
