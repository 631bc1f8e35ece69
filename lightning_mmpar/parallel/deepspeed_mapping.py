"""DeepSpeed JSON mapping: a DeepSpeed config onto an engine, strategy and Trainer arguments.

Users coming from Megatron-DeepSpeed bring a JSON such as::

    {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4,
     "gradient_clipping": 1.0, "bf16": {"enabled": true},
     "zero_optimization": {"stage": 3, "overlap_comm": true},
     "tensor_parallel": {"tp_size": 4}}

The mapping (:func:`map_deepspeed_config`, a pure function) of ``zero_optimization.stage``:
0 -> ``mm_parallel`` with ``data_parallel="ddp"``; not given (no section, or no ``stage`` in it)
-> ``mm_parallel`` keeping the layout's ``data_parallel`` (``ddp`` without one); 1, 2 ->
DeepSpeed's own engine (Lightning's ``DeepSpeedStrategy`` with the JSON as its config, its
CUDA-only check lifted for CPU: :mod:`lightning_mmpar.parallel.deepspeed_strategy`), no tensor
or pipeline parallelism; 3 -> ``mm_parallel`` with ``data_parallel="fsdp"`` (FSDP2 plays
ZeRO-3), a note is logged. A ZeRO stage over a data-parallel size of 1 shards nothing: an info
line (:attr:`DeepSpeedPlan.info`) says so.

On every engine (DeepSpeed's `config-json <https://www.deepspeed.ai/docs/config-json/>`_ keys):
``gradient_accumulation_steps`` -> ``Trainer(accumulate_grad_batches)``, ``gradient_clipping``
-> ``gradient_clip_val``, ``bf16``/``fp16.enabled`` -> ``precision`` (``bf16-mixed`` /
``16-mixed``, ``32-true`` when a section says ``enabled: false``),
``train_micro_batch_size_per_gpu`` -> the per-data-parallel-rank batch size, and
``train_batch_size`` checked (or the missing one of the three derived) as DeepSpeed does:
``train_batch_size = micro * accumulation * data-parallel size``. Under pipeline parallelism the
keys mean what DeepSpeed's ``PipelineEngine`` makes them mean: ``train_micro_batch_size_per_gpu``
is one pipeline micro-batch and ``gradient_accumulation_steps`` the micro-batches of one
optimizer step (one pipeline flush): ``micro_batches = steps``, a batch of ``micro * steps``
samples per data-parallel rank, ``accumulate_grad_batches = 1`` (a JSON without the steps keeps
the layout's micro-batches).
``tensor_parallel.tp_size`` (or ``autotp_size``) becomes ``tensor_parallel``. Keys Lightning
refuses in the engine's JSON (``gradient_accumulation_steps``: it takes it from the Trainer)
are dropped from the engine's JSON (``strategy_kwargs["config"]``). Every other key is reported in
:attr:`DeepSpeedPlan.unmapped`: an unknown key with the closest known one (``difflib``), a known
key without a counterpart here (``mm_parallel`` engines) by name. Combinations the package
cannot honour raise a ``ValueError`` naming the key, the value and the fix.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Literal

from lightning_mmpar.layout import ParallelLayout

__all__ = [
    "MM_PARALLEL_KEYS",
    "ZERO3_NOTE",
    "DeepSpeedPlan",
    "map_deepspeed_config",
    "resolve_batch",
]

Engine = Literal["deepspeed", "mm_parallel"]
MM_PARALLEL_KEYS: tuple[str, ...] = (
    "tensor_parallel",
    "pipeline_parallel",
    "expert_parallel",
    "virtual_pipeline",
    "micro_batches",
    "schedule",
)
"""Layout arguments carried over from an ``mm_parallel`` strategy given next to the JSON."""
ZERO3_NOTE = (
    "DeepSpeed ZeRO-3 is mapped to FSDP2 (torch fully_shard over the data-parallel mesh): it "
    "composes with tensor and pipeline parallelism, DeepSpeed's ZeRO-3 engine does not here. "
    "overlap_comm/bucket sizes are FSDP2's own."
)
TOP_LEVEL_KEYS: frozenset[str] = frozenset(
    """train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps optimizer
    scheduler communication_data_type seq_parallel_communication_data_type prescale_gradients
    gradient_predivide_factor sparse_gradients fp16 bf16 amp torch_autocast gradient_clipping
    zero_optimization zero_allow_untested_optimizer zero_force_ds_cpu_optimizer
    activation_checkpointing aio steps_per_print wall_clock_breakdown dump_state
    memory_breakdown flops_profiler tensorboard wandb csv_monitor comet comms_logger elasticity
    autotuning sparse_attention data_efficiency curriculum_learning checkpoint data_types
    compression_training pipeline tensor_parallel hybrid_engine nebula disable_allgather
    dataloader_drop_last weight_quantization eigenvalue progressive_layer_drop
    quantize_training use_data_before_expert_parallelism graph_harvesting compile""".split()
)
"""Top-level keys of DeepSpeed's config JSON (deepspeed.ai/docs/config-json, DeepSpeed 0.19)."""
ZERO_KEYS: frozenset[str] = frozenset(
    """stage allgather_partitions allgather_bucket_size overlap_comm reduce_scatter
    reduce_bucket_size contiguous_gradients offload_param offload_optimizer cpu_offload
    cpu_offload_param cpu_offload_use_pin_memory stage3_max_live_parameters
    stage3_max_reuse_distance stage3_prefetch_bucket_size stage3_param_persistence_threshold
    stage3_model_persistence_threshold stage3_gather_16bit_weights_on_model_save
    stage3_gather_fp16_weights_on_model_save stage3_module_granularity_threshold
    stage3_allgather_sequential stage3_use_all_reduce_for_fetch_params sub_group_size
    elastic_checkpoint ignore_unused_parameters round_robin_gradients legacy_stage1
    load_from_fp32_weights zero_hpz_partition_size zero_quantized_weights
    zero_quantized_nontrainable_weights zero_quantized_gradients mics_shard_size
    mics_hierarchical_params_gather memory_efficient_linear pipeline_loading_checkpoint
    override_module_apply log_trace_cache_warnings leaf_module parameter_alignment
    enable_sanity_checks compute_grad_norm use_multi_rank_bucket_allreduce zenflow
    save_muon_momentum_buffer_in_memory""".split()
)
"""Keys of ``zero_optimization`` (DeepSpeed 0.19's ``DeepSpeedZeroConfig`` fields and aliases)."""
MAPPED_KEYS: frozenset[str] = frozenset(
    """train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps
    gradient_clipping fp16 bf16 zero_optimization tensor_parallel""".split()
)
# Keys Lightning's DeepSpeedStrategy refuses in its config (it takes them from the Trainer):
LIGHTNING_REFUSES: tuple[str, ...] = ("gradient_accumulation_steps",)
NESTED_MAPPED = {
    "fp16": ("enabled",),
    "bf16": ("enabled",),
    "tensor_parallel": ("tp_size", "autotp_size"),
}
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


@dataclass(kw_only=True)
class DeepSpeedPlan:
    """What a DeepSpeed JSON maps to."""

    engine: Engine
    """``deepspeed`` (DeepSpeed's engine) or ``mm_parallel``."""
    zero_stage: int | None  # None: the JSON gives no stage
    strategy_kwargs: dict[str, Any] = field(default_factory=dict)
    """Arguments of ``MultimodalParallelStrategy`` (engine ``mm_parallel``) or of
    :class:`~lightning_mmpar.parallel.deepspeed_strategy.CPUCapableDeepSpeedStrategy` (engine
    ``deepspeed``: ``config``, the engine's JSON)."""
    note: str | None = None  # logged when the strategy is built (ZeRO-3 -> FSDP2)
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)
    """``accumulate_grad_batches``, ``gradient_clip_val``, ``precision`` the JSON sets."""
    batch_size: int | None = None
    """Samples per batch and per data-parallel rank (``train_micro_batch_size_per_gpu``)."""
    unmapped: list[str] = field(default_factory=list)
    """One message per key that is unknown, or known to DeepSpeed but without effect here."""
    info: list[str] = field(default_factory=list)
    """Info lines for the user: the batch under pipeline parallelism (micro-batches of
    ``train_micro_batch_size_per_gpu``), a ZeRO stage that shards nothing (data-parallel size
    1)."""


def closest(key: str, known: frozenset[str] | set[str]) -> str:
    """``"; did you mean 'x'?"`` for the nearest known key (``difflib``), else ``""``."""
    match = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    return f"; did you mean {match[0]!r}?" if match else ""


def _positive_int(key: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{key} ({value!r}) must be a positive integer in the DeepSpeed JSON.")
    return value


def _tp_size(config: dict[str, Any]) -> int | None:
    section = config.get("tensor_parallel") or {}
    if not isinstance(section, dict):
        raise ValueError(
            f"tensor_parallel ({section!r}) must be an object such as {{'tp_size': 2}}."
        )
    sizes = {k: section[k] for k in ("tp_size", "autotp_size") if k in section}
    if len(set(sizes.values())) > 1:
        raise ValueError(
            f"tensor_parallel.tp_size and autotp_size disagree ({sizes}); give one of them."
        )
    size = next(iter(sizes.values()), None)
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
        raise ValueError(f"tensor_parallel.tp_size ({size!r}) must be a positive integer.")
    return size


def _stage(config: dict[str, Any]) -> int | None:
    zero = config.get("zero_optimization") or {}
    if not isinstance(zero, dict):
        raise ValueError(f"zero_optimization ({zero!r}) must be an object such as {{'stage': 2}}.")
    if "stage" not in zero:
        return None
    stage = zero["stage"]
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise ValueError(
            f"zero_optimization.stage ({stage!r}) is not a ZeRO stage; use 0, 1, 2 or 3."
        )
    for key in ("offload_param", "offload_optimizer"):
        device = (zero.get(key) or {}).get("device", "none")
        if stage == 3 and device not in (None, "none"):
            raise ValueError(
                f"zero_optimization.{key}.device ({device!r}) with stage 3 is not supported: "
                "stage 3 runs as FSDP2, which has no DeepSpeed offload; remove the offload or "
                "use stage 1/2 (DeepSpeed's engine) without tensor parallelism."
            )
    return int(stage)


def resolve_batch(
    config: dict[str, Any], world: int | None, accumulation: int = 1
) -> tuple[int | None, int | None]:
    """``(micro batch per data-parallel rank, accumulation steps)`` from the JSON's batch keys,
    with DeepSpeed's rule (``runtime/config.py``) ``train_batch_size = micro * accumulation *
    world``, ``world`` the data-parallel size (``None``: unknown, rule skipped): two keys give
    the third, three must agree. ``accumulation`` (the Trainer's) stands in for a missing
    ``gradient_accumulation_steps``; ``None`` in the result: not set by the JSON.

    Raises:
        ValueError: a non-positive value, or keys that do not satisfy the rule (naming them).
    """
    total, micro, steps = (_positive_int(k, config[k]) if k in config else None for k in BATCH_KEYS)
    if total is None or world is None:
        return micro, steps
    if micro is not None and steps is None:
        if total % (micro * world):
            raise ValueError(
                f"train_batch_size ({total}) must be a multiple of train_micro_batch_size_per_gpu "
                f"({micro}) * data-parallel size ({world}); set it to {micro * world} times the "
                "accumulation steps."
            )
        return micro, total // (micro * world)
    steps_used = steps or accumulation
    if micro is None:
        if total % (steps_used * world):
            raise ValueError(
                f"train_batch_size ({total}) must be a multiple of gradient_accumulation_steps "
                f"({steps_used}) * data-parallel size ({world}); set "
                "train_micro_batch_size_per_gpu instead."
            )
        return total // (steps_used * world), steps
    if micro * steps_used * world != total:
        raise ValueError(
            f"train_batch_size ({total}) != train_micro_batch_size_per_gpu ({micro}) * "
            f"gradient_accumulation_steps ({steps_used}) * data-parallel size ({world}) = "
            f"{micro * steps_used * world}; fix one of them or drop train_batch_size."
        )
    return micro, steps


def _precision(config: dict[str, Any]) -> str | None:
    enabled = {}
    for key in ("fp16", "bf16"):
        if key not in config:
            continue
        section = config[key]
        value = section.get("enabled", False) if isinstance(section, dict) else section
        if not isinstance(value, bool):
            raise ValueError(
                f"{key}.enabled ({value!r}) must be true or false; 'auto' is a Hugging Face "
                "Trainer placeholder that DeepSpeed itself does not resolve."
            )
        enabled[key] = value
    if enabled.get("fp16") and enabled.get("bf16"):
        raise ValueError("fp16.enabled and bf16.enabled are both true; enable one of them.")
    if not enabled:
        return None
    return "16-mixed" if enabled.get("fp16") else "bf16-mixed" if enabled.get("bf16") else "32-true"


def _unmapped(config: dict[str, Any], engine: Engine, handled: frozenset[str]) -> list[str]:
    """Messages for unknown keys (with the nearest known one) on any engine, and for known keys
    with no counterpart here when the engine is ``mm_parallel``."""
    notes: list[str] = []
    ours = engine == "mm_parallel"
    for key in config:
        if key not in TOP_LEVEL_KEYS:
            notes.append(f"unknown DeepSpeed key {key!r}{closest(key, TOP_LEVEL_KEYS)}")
        elif ours and key not in MAPPED_KEYS | handled:
            notes.append(f"{key!r} has no counterpart under mm_parallel and is ignored")
    zero = config.get("zero_optimization") or {}
    for key in zero:
        name = f"zero_optimization.{key}"
        if key not in ZERO_KEYS:
            notes.append(f"unknown DeepSpeed key {name!r}{closest(key, ZERO_KEYS)}")
        elif ours and key not in ("stage", "offload_param", "offload_optimizer"):
            notes.append(f"{name!r} is DeepSpeed's own; mm_parallel (FSDP2/DDP) ignores it")
    if ours:
        for section, keep in NESTED_MAPPED.items():
            value = config.get(section)
            for key in value if isinstance(value, dict) else ():
                if key not in keep:
                    notes.append(f"'{section}.{key}' has no counterpart under mm_parallel")
    return notes


def _engine(stage: int | None, layout: dict[str, Any]) -> Engine:
    """``deepspeed`` for ZeRO-1/2 (refused with any model-parallel size > 1 in ``layout``),
    else ``mm_parallel``."""
    if stage not in (1, 2):
        return "mm_parallel"
    model_parallel = {k: v for k, v in layout.items() if k.endswith("parallel") and v != 1}
    if model_parallel:
        raise ValueError(
            f"zero_optimization.stage {stage} runs on DeepSpeed's engine, which "
            f"lightning_mmpar does not combine with {model_parallel}; use stage 3 (FSDP2 with "
            "tensor/pipeline parallelism) or set those sizes to 1."
        )
    return "deepspeed"


def _trainer_kwargs(config: dict[str, Any], steps: int | None) -> dict[str, Any]:
    """``accumulate_grad_batches`` (``steps``), ``gradient_clip_val`` and ``precision`` the
    JSON sets."""
    trainer: dict[str, Any] = {}
    if steps is not None:
        trainer["accumulate_grad_batches"] = steps
    if "gradient_clipping" in config:
        clip = config["gradient_clipping"]
        if not isinstance(clip, int | float) or isinstance(clip, bool) or clip < 0:
            raise ValueError(f"gradient_clipping ({clip!r}) must be a number >= 0 (0: no clip).")
        trainer["gradient_clip_val"] = float(clip)
    precision = _precision(config)
    if precision is not None:
        trainer["precision"] = precision
    return trainer


def map_deepspeed_config(
    config: dict[str, Any],
    *,
    layout: dict[str, Any] | None = None,
    world_size: int | None = None,
    accumulation: int = 1,
    handled: frozenset[str] = frozenset(),
) -> DeepSpeedPlan:
    """Map a DeepSpeed JSON (and an ``mm_parallel`` layout given next to it) to a plan.

    Args:
        config: the parsed DeepSpeed JSON.
        layout: ``MultimodalParallelStrategy`` arguments from the recipe (``tensor_parallel``,
            ``pipeline_parallel``, ``data_parallel``...); the JSON's ``tp_size`` must agree with
            a tensor_parallel > 1; ``data_parallel`` is kept when the JSON gives no ZeRO stage.
        world_size: processes (``devices * num_nodes``): the data-parallel size of the
            ``train_batch_size`` rule is ``world_size / (tp * pp)``; ``None`` skips that rule.
        accumulation: the Trainer's ``accumulate_grad_batches``, used when the JSON has none
            (under pipeline parallelism the layout's micro-batches stand in instead).
        handled: top-level keys the caller maps itself (the recipe: ``optimizer``,
            ``scheduler``), not reported as unmapped.

    Raises:
        ValueError: unknown stage, ZeRO-3 offload, ZeRO-1/2 with tensor/pipeline/expert
            parallelism, a tp_size that contradicts the layout, batch keys that break
            DeepSpeed's rule, both fp16 and bf16 enabled.
    """
    if not isinstance(config, dict):
        raise ValueError(f"a DeepSpeed config must be a JSON object, got {type(config).__name__}.")
    base_dp = (layout or {}).get("data_parallel")
    layout = {k: v for k, v in (layout or {}).items() if k in MM_PARALLEL_KEYS}
    stage, tp = _stage(config), _tp_size(config)
    given = layout.get("tensor_parallel", 1)
    if tp is not None and given not in (1, tp):
        raise ValueError(
            f"tensor_parallel.tp_size ({tp}) in the DeepSpeed JSON contradicts the strategy's "
            f"tensor_parallel ({given}); make them equal or drop one."
        )
    tp = tp or given
    engine = _engine(stage, {**layout, "tensor_parallel": tp})
    pp = layout.get("pipeline_parallel", 1)
    dp = world_size // (tp * pp) if world_size and world_size % (tp * pp) == 0 else None
    batch = _batch_plan(config, {**layout, "tensor_parallel": tp}, dp, accumulation)
    plan = DeepSpeedPlan(
        engine=engine,
        zero_stage=stage,
        trainer_kwargs=_trainer_kwargs(config, batch.get("accumulate_grad_batches")),
        batch_size=batch.get("batch_size"),
        unmapped=_unmapped(config, engine, handled),
        info=_info(stage, dp, world_size, tp, pp, batch.get("info")),
    )
    if engine == "deepspeed":
        engine_json = {k: v for k, v in config.items() if k not in LIGHTNING_REFUSES}
        if plan.batch_size is not None:
            engine_json["train_micro_batch_size_per_gpu"] = plan.batch_size
        plan.strategy_kwargs = {"config": engine_json}
        return plan
    data_parallel = {3: "fsdp", 0: "ddp", None: base_dp or "ddp"}[stage]
    plan.strategy_kwargs = {**layout, "tensor_parallel": tp, "data_parallel": data_parallel}
    if "micro_batches" in batch:
        plan.strategy_kwargs["micro_batches"] = batch["micro_batches"]
    plan.note = ZERO3_NOTE if stage == 3 else None
    return plan


def _batch_plan(
    config: dict[str, Any], layout: dict[str, Any], dp: int | None, accumulation: int
) -> dict[str, Any]:
    """``batch_size`` (per dp rank and batch), ``accumulate_grad_batches``, ``micro_batches``
    (pipeline) and an ``info`` line, as far as the JSON sets them.

    DeepSpeed's meaning on both engines: ``train_micro_batch_size_per_gpu`` samples per
    micro-batch, ``gradient_accumulation_steps`` micro-batches per optimizer step. Without
    pipeline parallelism a micro-batch is one Lightning batch and the steps are Lightning's
    accumulation. Under pipeline parallelism (DeepSpeed's ``PipelineEngine.train_batch``: one
    flush of ``gradient_accumulation_steps`` micro-batches per step) the steps are the pipeline's
    ``micro_batches``, a batch holds ``micro * steps`` samples and nothing is accumulated on top;
    a JSON without steps keeps the layout's micro-batches (its default: ``pipeline_parallel``).
    """
    pp = layout.get("pipeline_parallel", 1)
    if pp == 1:
        micro, steps = resolve_batch(config, dp, accumulation)
        out: dict[str, Any] = {"batch_size": micro, "accumulate_grad_batches": steps}
        return {k: v for k, v in out.items() if v is not None}
    current = ParallelLayout(
        pp=pp,
        virtual=layout.get("virtual_pipeline", 1),
        micro_batches=layout.get("micro_batches"),
        schedule=layout.get("schedule", "1f1b"),
    ).num_micro_batches
    micro, steps = resolve_batch(config, dp, current)
    if micro is None and steps is None:
        return {}
    n = steps or current
    out = {"micro_batches": n} if steps is not None else {}
    out |= {"accumulate_grad_batches": 1} if steps is not None else {}
    out |= {"batch_size": micro * n} if micro is not None else {}
    size = f"{micro}" if micro is not None else "data.batch_size / micro_batches"
    out["info"] = (
        f"pipeline parallelism (pp {pp}): a step runs {n} micro-batches of {size} samples per "
        "data-parallel rank and one pipeline flush, as DeepSpeed's PipelineEngine does "
        "(train_micro_batch_size_per_gpu = the micro-batch, gradient_accumulation_steps = the "
        "micro-batches per step): " + ", ".join(f"{k}={v}" for k, v in out.items() if k != "info")
    )
    return out


def _info(
    stage: int | None, dp: int | None, world: int | None, tp: int, pp: int, batch: str | None
) -> list[str]:
    """Info lines: a ZeRO stage that shards nothing (a data-parallel size of 1), the pipeline's
    batch (``batch``)."""
    info = [batch] if batch else []
    if stage in (1, 2, 3) and dp == 1:
        what = {1: "optimizer state", 2: "optimizer state and gradients"}.get(
            stage, "parameters, gradients and optimizer state"
        )
        engine = "FSDP2" if stage == 3 else "DeepSpeed's engine"
        info.append(
            f"zero_optimization.stage {stage} shards nothing here: the data-parallel size is 1 "
            f"({world} processes / (tp {tp} x pp {pp})), so {engine} keeps the whole "
            f"{what} on every rank; add processes (trainer.devices x num_nodes) to shard it."
        )
    return info
