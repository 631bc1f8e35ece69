"""Choosing a layout, model-agnostic: block costs in, stage partitions out (pure Python).

:func:`plan_stages` cuts a model's costed pipeline blocks (:class:`BlockSpec`) into
``pipeline_parallel * virtual_pipeline`` stages by mode (``equal``, ``ratio``, ``balanced``,
``memory``, explicit boundaries) and returns a :class:`StagePlan`;
``python -m lightning_mmpar.recipes.partition`` prints a recipe YAML's plans side by side.
"""

from lightning_mmpar.layout.devices import (
    COLLECTIVES,
    LINK_CLASSES,
    DeviceGraph,
    LinkClass,
    collective_seconds,
    load_topology,
)
from lightning_mmpar.layout.partition import (
    Partition,
    compare_modes,
    default_ratio,
    equal_ranges,
    parse_partition,
    plan_stages,
    tower_of,
)
from lightning_mmpar.layout.placement import (
    DEFAULT_TRAFFIC,
    MESH_AXES,
    Placement,
    group_positions,
    machine_placement,
    megatron_placement,
    place,
    placement_seconds,
)
from lightning_mmpar.layout.stages import (
    BlockSpec,
    StagePlan,
    measure_blocks,
    parameter_bytes,
    side_by_side,
)

__all__ = [
    "COLLECTIVES",
    "DEFAULT_TRAFFIC",
    "LINK_CLASSES",
    "MESH_AXES",
    "BlockSpec",
    "DeviceGraph",
    "LinkClass",
    "Partition",
    "Placement",
    "StagePlan",
    "collective_seconds",
    "compare_modes",
    "default_ratio",
    "equal_ranges",
    "group_positions",
    "load_topology",
    "machine_placement",
    "measure_blocks",
    "megatron_placement",
    "parameter_bytes",
    "parse_partition",
    "place",
    "placement_seconds",
    "plan_stages",
    "side_by_side",
    "tower_of",
]
