"""Mechanisms for any model and any plan: the one parallelize path (:mod:`.parallelize`: a plan
applied TP -> EP -> checkpointing -> pipeline split -> FSDP2), tensor-parallel styles, the
pipeline engine and its schedules (:mod:`.pipeline`), FSDP2 / DDP (:mod:`.data`), expert weights
under data parallelism (:mod:`.expert_data`), DCP checkpoints, the DeepSpeed engine,
device-aware collectives (:mod:`.comm`), the numerics core (:mod:`.numerics`) and the
model-parallel RNG (:mod:`.random`). Nothing here imports a model, a plan, the strategy, a
recipe or a callback (import-linter contracts in pyproject.toml).
"""

from lightning_mmpar.parallel.checkpoint import (
    load_sharded,
    newest_checkpoint,
    save_sharded,
    validate_checkpoint,
)
from lightning_mmpar.parallel.comm_count import CommCounter, state_bytes_of
from lightning_mmpar.parallel.data import (
    apply_fsdp,
    broadcast_parameters,
    fsdp_managed,
    has_fsdp,
    replicated_parameters,
    shard_blocks,
    shard_placement,
    sync_gradients,
)
from lightning_mmpar.parallel.deepspeed_mapping import (
    MM_PARALLEL_KEYS,
    DeepSpeedPlan,
    map_deepspeed_config,
    resolve_batch,
)
from lightning_mmpar.parallel.deepspeed_strategy import CPUCapableDeepSpeedStrategy
from lightning_mmpar.parallel.experts import (
    AllToAllDispatcher,
    apply_expert_parallel,
    expert_parallel_block,
    expert_placement,
    locality_group_ranks,
    permute_experts,
    placement_order,
)
from lightning_mmpar.parallel.finite import NonFiniteGuard, nonfinite_weights
from lightning_mmpar.parallel.gradient_cache import BatchLossModule, RNGReplay
from lightning_mmpar.parallel.moved import install as _install_moved_modules
from lightning_mmpar.parallel.numerics import (
    clip_grad_norm_,
    global_grad_norm,
    vocab_parallel_cross_entropy,
)
from lightning_mmpar.parallel.parallelize import (
    ParallelizeOptions,
    ParallelPlan,
    apply_model_parallel,
    parallelize,
)
from lightning_mmpar.parallel.pipeline import (
    PipelineChunk,
    PipelineEngine,
    PipelineModule,
    PipelineSteps,
    partition,
)
from lightning_mmpar.parallel.pipeline.schedules import (
    SCHEDULE_CLASSES,
    ZERO_BUBBLE,
    StageObserver,
    build_schedule,
    check_stage_ranges,
    schedule_class,
    stage_ranks,
    unsplit_parameters,
)
from lightning_mmpar.parallel.random import (
    ParallelDropout,
    RNGStatesTracker,
    checkpoint_rng_contexts,
    get_rng_tracker,
    model_parallel_manual_seed,
    region_seeds,
)
from lightning_mmpar.parallel.tensor import (
    FusedQKVColwiseParallel,
    HeadShardedReplicate,
    SequenceLengthCheck,
    StyleGroup,
    apply_styles,
    full_gradients,
    full_state_dict,
)

_install_moved_modules()  # old paths of moved modules (parallel.moved.MOVED) warn and still work

__all__ = [
    "MM_PARALLEL_KEYS",
    "SCHEDULE_CLASSES",
    "ZERO_BUBBLE",
    "AllToAllDispatcher",
    "BatchLossModule",
    "CPUCapableDeepSpeedStrategy",
    "CommCounter",
    "DeepSpeedPlan",
    "FusedQKVColwiseParallel",
    "HeadShardedReplicate",
    "NonFiniteGuard",
    "ParallelDropout",
    "ParallelPlan",
    "ParallelizeOptions",
    "PipelineChunk",
    "PipelineEngine",
    "PipelineModule",
    "PipelineSteps",
    "RNGReplay",
    "RNGStatesTracker",
    "SequenceLengthCheck",
    "StageObserver",
    "StyleGroup",
    "apply_expert_parallel",
    "apply_fsdp",
    "apply_model_parallel",
    "apply_styles",
    "broadcast_parameters",
    "build_schedule",
    "check_stage_ranges",
    "checkpoint_rng_contexts",
    "clip_grad_norm_",
    "expert_parallel_block",
    "expert_placement",
    "fsdp_managed",
    "full_gradients",
    "full_state_dict",
    "get_rng_tracker",
    "global_grad_norm",
    "has_fsdp",
    "load_sharded",
    "locality_group_ranks",
    "map_deepspeed_config",
    "model_parallel_manual_seed",
    "newest_checkpoint",
    "nonfinite_weights",
    "parallelize",
    "partition",
    "permute_experts",
    "placement_order",
    "region_seeds",
    "replicated_parameters",
    "resolve_batch",
    "save_sharded",
    "schedule_class",
    "shard_blocks",
    "shard_placement",
    "stage_ranks",
    "state_bytes_of",
    "sync_gradients",
    "unsplit_parameters",
    "validate_checkpoint",
    "vocab_parallel_cross_entropy",
]


MOVED_TO_STRATEGY: dict[str, object] = {}
"""Names that moved from ``parallel/`` to the strategy package, filled by
``lightning_mmpar/__init__.py`` after it imports the strategy: the deprecated aliases below read
this table, so ``parallel/`` never imports the strategy. Removed in the next release."""


def moved_to_strategy(old: str, name: str) -> object:
    """The strategy's ``name`` for the deprecated path ``old``, with a ``DeprecationWarning``.

    Raises:
        AttributeError: ``name`` did not move (or the package was not imported whole).
    """
    import warnings

    if name not in MOVED_TO_STRATEGY:
        raise AttributeError(f"module {old!r} has no attribute {name!r}")
    target = MOVED_TO_STRATEGY[name]
    warnings.warn(
        f"{old}.{name} moved to {target.__module__}.{name}; import it from there.",  # type: ignore[attr-defined]
        DeprecationWarning,
        stacklevel=3,
    )
    return target


def __getattr__(name: str) -> object:
    """Deprecated alias: ``ShardedCheckpointHooks`` moved to :mod:`lightning_mmpar.strategy`."""
    if name != "ShardedCheckpointHooks":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return moved_to_strategy(__name__, name)
