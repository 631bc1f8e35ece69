"""Choosing a layout, model-agnostic: block costs in, stage partitions out (pure Python).

:func:`plan_stages` cuts a model's costed pipeline blocks (:class:`BlockSpec`) into
``pipeline_parallel * virtual_pipeline`` stages by mode (``equal``, ``ratio``, ``balanced``,
``memory``, explicit boundaries) and returns a :class:`StagePlan`;
``python -m lightning_mmpar.recipes.partition`` prints a recipe YAML's plans side by side.
"""

from lightning_mmpar.layout.partition import (
    Partition,
    compare_modes,
    default_ratio,
    equal_ranges,
    parse_partition,
    plan_stages,
    tower_of,
)
from lightning_mmpar.layout.stages import (
    BlockSpec,
    StagePlan,
    measure_blocks,
    parameter_bytes,
    side_by_side,
)

__all__ = [
    "BlockSpec",
    "Partition",
    "StagePlan",
    "compare_modes",
    "default_ratio",
    "equal_ranges",
    "measure_blocks",
    "parameter_bytes",
    "parse_partition",
    "plan_stages",
    "side_by_side",
    "tower_of",
]
