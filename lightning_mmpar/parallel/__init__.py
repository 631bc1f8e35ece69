"""Mechanisms for any model and any plan: tensor-parallel styles, the pipeline engine, FSDP2 /
DDP, DCP checkpoints, the DeepSpeed engine, device-aware collectives (:mod:`.comm`) and the
numerics core (:mod:`.numerics`). Nothing here imports a model, a plan, the strategy, a recipe
or a callback (import-linter contracts in pyproject.toml).
"""

from lightning_mmpar.parallel.checkpoint import load_sharded, save_sharded
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
from lightning_mmpar.parallel.deepspeed import (
    MM_PARALLEL_KEYS,
    CPUCapableDeepSpeedStrategy,
    DeepSpeedPlan,
    map_deepspeed_config,
)
from lightning_mmpar.parallel.numerics import (
    clip_grad_norm_,
    global_grad_norm,
    vocab_parallel_cross_entropy,
)
from lightning_mmpar.parallel.pipeline import (
    PipelineChunk,
    PipelineEngine,
    PipelineModule,
    PipelineSteps,
    partition,
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

__all__ = [
    "MM_PARALLEL_KEYS",
    "CPUCapableDeepSpeedStrategy",
    "DeepSpeedPlan",
    "FusedQKVColwiseParallel",
    "HeadShardedReplicate",
    "PipelineChunk",
    "PipelineEngine",
    "PipelineModule",
    "PipelineSteps",
    "SequenceLengthCheck",
    "StyleGroup",
    "apply_fsdp",
    "apply_styles",
    "broadcast_parameters",
    "clip_grad_norm_",
    "fsdp_managed",
    "full_gradients",
    "full_state_dict",
    "global_grad_norm",
    "has_fsdp",
    "load_sharded",
    "map_deepspeed_config",
    "partition",
    "replicated_parameters",
    "save_sharded",
    "shard_blocks",
    "shard_placement",
    "sync_gradients",
    "vocab_parallel_cross_entropy",
]
