"""Choosing a layout, model-agnostic (pure Python): the layout value and its validation, block
costs, stage partitions, the device graph, rank placement, the pipeline schedules' facts
(:mod:`.schedules`: names, stage -> rank maps, in-flight micro-batches, the bubble), the cost
model and the planner.

:class:`ParallelLayout` is a run's layout (degrees, schedule, engines) and :func:`validate` the
one check of it, against :class:`LayoutFacts` (world, batch, what the model tells), run by the
strategy, the recipe's pre-launch check and the planner alike.

:func:`plan_stages` cuts a model's costed pipeline blocks (:class:`BlockSpec`) into
``pipeline_parallel * virtual_pipeline`` stages by mode (``equal``, ``ratio``, ``balanced``,
``memory``, explicit boundaries) and returns a :class:`StagePlan`;
``python -m lightning_mmpar.recipes.partition`` prints a recipe YAML's plans side by side.
:class:`DeviceGraph` reads ``nvidia-smi topo -m`` or a YAML description, :func:`place` orders
ranks on it, :func:`comm_bytes` / :func:`state_bytes` / :func:`predict` cost a
:class:`ParallelLayout` of a :class:`ModelSpec`, :func:`memory_excess` splits a rank's state
above the ideal ``full / ranks`` by cause, and :func:`plan` ranks the layouts of a world;
``python -m lightning_mmpar.recipes.planner`` is its CLI (docs/planner.md).
"""

from lightning_mmpar.layout.comm import (
    comm_bounds,
    comm_bytes,
    comm_calls,
    comm_parts,
    comm_profile,
    dispatched_calls,
    world_dim,
)
from lightning_mmpar.layout.cost import (
    DEVICES,
    DeviceSpec,
    Prediction,
    RankMemory,
    activation_bytes,
    compute_seconds,
    default_graph,
    predict,
)
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
    layout_stage_plan,
    local_shape,
    shard_dim,
    stage_blocks,
    state_bytes,
)
from lightning_mmpar.layout.memory_ideal import (
    DESIGN_CAUSES,
    MemoryExcess,
    memory_excess,
    replicated_kind,
)
from lightning_mmpar.layout.model import (
    Boundary,
    Collective,
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
from lightning_mmpar.layout.planner import (
    Rejected,
    candidate_layouts,
    describe,
    divisors,
    plan,
    refusal,
)
from lightning_mmpar.layout.schedules import (
    bubble_fraction,
    in_flight,
    rank_in_flight,
    stage_ranks,
    step_units,
)
from lightning_mmpar.layout.stages import (
    BlockSpec,
    StagePlan,
    measure_blocks,
    parameter_bytes,
    side_by_side,
)
from lightning_mmpar.layout.value import (
    LayoutFacts,
    LayoutSpec,
    ParallelLayout,
    TpSize,
    check_vision_batch,
    validate,
)

__all__ = [
    "COLLECTIVES",
    "DEFAULT_TRAFFIC",
    "DESIGN_CAUSES",
    "DEVICES",
    "LINK_CLASSES",
    "MESH_AXES",
    "BlockSpec",
    "Boundary",
    "Collective",
    "DeviceGraph",
    "DeviceSpec",
    "LayoutFacts",
    "LayoutSpec",
    "LinkClass",
    "LossSpec",
    "MemoryExcess",
    "ModelSpec",
    "ParallelLayout",
    "ParamSpec",
    "Partition",
    "Placement",
    "Prediction",
    "RankMemory",
    "Rejected",
    "StagePlan",
    "StateBytes",
    "TpSize",
    "activation_bytes",
    "bubble_fraction",
    "candidate_layouts",
    "check_vision_batch",
    "collective_seconds",
    "comm_bounds",
    "comm_bytes",
    "comm_calls",
    "comm_parts",
    "comm_profile",
    "compare_modes",
    "compute_seconds",
    "default_graph",
    "default_ratio",
    "describe",
    "dispatched_calls",
    "divisors",
    "equal_ranges",
    "group_positions",
    "in_flight",
    "layout_stage_plan",
    "load_topology",
    "local_shape",
    "machine_placement",
    "measure_blocks",
    "megatron_placement",
    "memory_excess",
    "parameter_bytes",
    "parse_partition",
    "place",
    "placement_seconds",
    "plan",
    "plan_stages",
    "predict",
    "rank_in_flight",
    "refusal",
    "replicated_kind",
    "shard_dim",
    "side_by_side",
    "stage_blocks",
    "stage_ranks",
    "state_bytes",
    "step_units",
    "tower_of",
    "validate",
    "world_dim",
]
