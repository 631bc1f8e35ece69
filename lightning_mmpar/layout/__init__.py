"""Choosing a layout, model-agnostic: block costs in, stage partitions out (pure Python).

:func:`plan_stages` cuts a model's costed pipeline blocks (:class:`BlockSpec`) into
``pipeline_parallel * virtual_pipeline`` stages by mode (``equal``, ``ratio``, ``balanced``,
``memory``, explicit boundaries) and returns a :class:`StagePlan`;
``python -m lightning_mmpar.recipes.partition`` prints a recipe YAML's plans side by side.
"""

from lightning_mmpar.layout.comm import comm_bounds, comm_bytes, world_dim
from lightning_mmpar.layout.devices import (
    COLLECTIVES,
    LINK_CLASSES,
    DeviceGraph,
    LinkClass,
    collective_seconds,
    load_topology,
)
from lightning_mmpar.layout.memory import (
    StateBytes,
    local_shape,
    shard_dim,
    stage_blocks,
    state_bytes,
)
from lightning_mmpar.layout.model import (
    Boundary,
    Collective,
    LayoutSpec,
    LossSpec,
    ModelSpec,
    ParamSpec,
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
    "Boundary",
    "Collective",
    "DeviceGraph",
    "LayoutSpec",
    "LinkClass",
    "LossSpec",
    "ModelSpec",
    "ParamSpec",
    "Partition",
    "Placement",
    "StagePlan",
    "StateBytes",
    "collective_seconds",
    "comm_bounds",
    "comm_bytes",
    "compare_modes",
    "default_ratio",
    "equal_ranges",
    "group_positions",
    "load_topology",
    "local_shape",
    "machine_placement",
    "measure_blocks",
    "megatron_placement",
    "parameter_bytes",
    "parse_partition",
    "place",
    "placement_seconds",
    "plan_stages",
    "shard_dim",
    "side_by_side",
    "stage_blocks",
    "state_bytes",
    "tower_of",
    "world_dim",
]
