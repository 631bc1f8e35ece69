"""The ``mm_parallel`` strategy: :class:`MultimodalParallelStrategy` and its mixins."""

from lightning_mmpar.strategy.checkpoint_hooks import ShardedCheckpointHooks
from lightning_mmpar.strategy.mm_parallel import MultimodalParallelStrategy

__all__ = ["MultimodalParallelStrategy", "ShardedCheckpointHooks"]
