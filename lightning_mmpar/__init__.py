"""lightning_mmpar: tensor, pipeline, expert and data parallelism for multimodal Lightning models.

Importing the package registers the ``"mm_parallel"`` strategy with Lightning.
"""

from lightning_mmpar.config import ParallelConfig
from lightning_mmpar.topology import ParallelDims
from lightning_mmpar.trainer_topology import TrainerTopology

__all__ = ["ParallelConfig", "ParallelDims", "TrainerTopology"]
__version__ = "0.1.0"

from lightning.pytorch.strategies import StrategyRegistry as _StrategyRegistry

from lightning_mmpar.parallel import MOVED_TO_STRATEGY as _MOVED_TO_STRATEGY
from lightning_mmpar.strategy import MultimodalParallelStrategy
from lightning_mmpar.strategy import ShardedCheckpointHooks as _ShardedCheckpointHooks
from lightning_mmpar.strategy.gradient_stash import GradientStash as _GradientStash

_MOVED_TO_STRATEGY.update(
    ShardedCheckpointHooks=_ShardedCheckpointHooks, GradientStash=_GradientStash
)  # the deprecated aliases in parallel/ (one release)

if MultimodalParallelStrategy.strategy_name not in _StrategyRegistry:
    MultimodalParallelStrategy.register_strategies(_StrategyRegistry)

__all__ += ["MultimodalParallelStrategy"]
