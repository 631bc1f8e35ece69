"""Per-model parallel plans: what TP/SP, expert parallelism, checkpointed layers, pipeline blocks
and FSDP units each model family gets, as data (:class:`ParallelPlan`); the strategy applies a
LightningModule's plan (its ``parallel_plan(dims)``) with
:func:`lightning_mmpar.parallel.parallelize.parallelize`."""

from lightning_mmpar.plans.fusion import (
    FusionPlanOptions,
    TensorParallelOptions,
    apply_tensor_parallel,
    check_fusion_layout,
    fusion_facts,
    fusion_plan,
    parallelize_fusion,
    validate_tensor_parallel,
)
from lightning_mmpar.plans.fusion_cost import fusion_model_spec
from lightning_mmpar.plans.fusion_vision import (
    VISION_PARALLEL,
    apply_vision_data_parallel,
    check_vision_batch,
)
from lightning_mmpar.plans.plan import (
    ParallelPlan,
    apply_plan,
    checkpoint_activations,
    plan_meshes,
    tp_meshes,
)
from lightning_mmpar.plans.qwen3_moe_vl import check_qwen3_moe_vl_layout, qwen3_moe_vl_plan
from lightning_mmpar.plans.qwen_vl import check_qwen_vl_layout, qwen_vl_plan
from lightning_mmpar.plans.toy import parallelize_toy, toy_plan

__all__ = [
    "VISION_PARALLEL",
    "FusionPlanOptions",
    "ParallelPlan",
    "TensorParallelOptions",
    "apply_plan",
    "apply_tensor_parallel",
    "apply_vision_data_parallel",
    "check_fusion_layout",
    "check_qwen3_moe_vl_layout",
    "check_qwen_vl_layout",
    "check_vision_batch",
    "checkpoint_activations",
    "fusion_facts",
    "fusion_model_spec",
    "fusion_plan",
    "parallelize_fusion",
    "parallelize_toy",
    "plan_meshes",
    "qwen3_moe_vl_plan",
    "qwen_vl_plan",
    "toy_plan",
    "tp_meshes",
    "validate_tensor_parallel",
]
