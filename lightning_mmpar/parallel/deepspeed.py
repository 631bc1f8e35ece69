"""DeepSpeed JSON interop: map a DeepSpeed config onto an engine and strategy arguments.

Users coming from Megatron-DeepSpeed bring a JSON such as::

    {"train_micro_batch_size_per_gpu": 8,
     "zero_optimization": {"stage": 3, "overlap_comm": true},
     "tensor_parallel": {"tp_size": 4}}

The mapping (:func:`map_deepspeed_config`, a pure function) is:

=============================  ===============================================================
``zero_optimization.stage``    engine
=============================  ===============================================================
0 (or no section)              ``mm_parallel`` with ``data_parallel="ddp"``
1, 2                           DeepSpeed's own engine (Lightning's ``DeepSpeedStrategy`` with the
                               JSON as its config; its CUDA-only check lifted for CPU), no tensor
                               or pipeline parallelism
3                              ``mm_parallel`` with ``data_parallel="fsdp"`` (FSDP2 plays ZeRO-3:
                               parameters, gradients and optimizer state sharded over dp); a note
                               is logged
=============================  ===============================================================

``tensor_parallel.tp_size`` (or ``autotp_size``) becomes ``tensor_parallel``. Combinations the
package cannot honour raise a ``ValueError`` naming the key, the value and the fix.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal

from lightning.pytorch.strategies import DeepSpeedStrategy, Strategy
from typing_extensions import override

Engine = Literal["deepspeed", "mm_parallel"]
MM_PARALLEL_KEYS: tuple[str, ...] = (
    "tensor_parallel", "pipeline_parallel", "expert_parallel", "virtual_pipeline",
    "micro_batches", "schedule",
)  # fmt: skip
"""Layout arguments carried over from an ``mm_parallel`` strategy given next to the JSON."""
ZERO3_NOTE = (
    "DeepSpeed ZeRO-3 is mapped to FSDP2 (torch fully_shard over the data-parallel mesh): it "
    "composes with tensor and pipeline parallelism, DeepSpeed's ZeRO-3 engine does not here. "
    "overlap_comm/bucket sizes are FSDP2's own; the other JSON keys are ignored."
)


@dataclass(kw_only=True)
class DeepSpeedPlan:
    """What a DeepSpeed JSON maps to."""

    engine: Engine
    """``deepspeed`` (DeepSpeed's engine) or ``mm_parallel``."""
    zero_stage: int
    """The ZeRO stage read from the JSON."""
    strategy_kwargs: dict[str, Any] = field(default_factory=dict)
    """Arguments of ``MultimodalParallelStrategy`` (engine ``mm_parallel``) or of
    :class:`CPUCapableDeepSpeedStrategy` (engine ``deepspeed``: ``config``, the JSON)."""
    note: str | None = None
    """Logged when the strategy is built (e.g. ZeRO-3 -> FSDP2)."""


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


def _stage(config: dict[str, Any]) -> int:
    zero = config.get("zero_optimization") or {}
    if not isinstance(zero, dict):
        raise ValueError(f"zero_optimization ({zero!r}) must be an object such as {{'stage': 2}}.")
    stage = zero.get("stage", 0)
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


def map_deepspeed_config(
    config: dict[str, Any], *, layout: dict[str, Any] | None = None
) -> DeepSpeedPlan:
    """Map a DeepSpeed JSON (and an ``mm_parallel`` layout given next to it) to a plan.

    Args:
        config: the parsed DeepSpeed JSON.
        layout: ``MultimodalParallelStrategy`` arguments from the recipe (``tensor_parallel``,
            ``pipeline_parallel``...); the JSON's ``tp_size`` must agree with a tensor_parallel > 1.

    Raises:
        ValueError: unknown stage, ZeRO-3 offload, ZeRO-1/2 with tensor/pipeline/expert
            parallelism, or a tp_size that contradicts the layout.
    """
    if not isinstance(config, dict):
        raise ValueError(f"a DeepSpeed config must be a JSON object, got {type(config).__name__}.")
    layout = {k: v for k, v in (layout or {}).items() if k in MM_PARALLEL_KEYS}
    stage, tp = _stage(config), _tp_size(config)
    given = layout.get("tensor_parallel", 1)
    if tp is not None and given not in (1, tp):
        raise ValueError(
            f"tensor_parallel.tp_size ({tp}) in the DeepSpeed JSON contradicts the strategy's "
            f"tensor_parallel ({given}); make them equal or drop one."
        )
    tp = tp or given
    if stage in (1, 2):
        model_parallel = {
            k: v
            for k, v in {**layout, "tensor_parallel": tp}.items()
            if k.endswith("parallel") and v != 1
        }
        if model_parallel:
            raise ValueError(
                f"zero_optimization.stage {stage} runs on DeepSpeed's engine, which "
                f"lightning_mmpar does not combine with {model_parallel}; use stage 3 (FSDP2 with "
                "tensor/pipeline parallelism) or set those sizes to 1."
            )
        return DeepSpeedPlan(
            engine="deepspeed", zero_stage=stage, strategy_kwargs={"config": config}
        )
    data_parallel = "fsdp" if stage == 3 else "ddp"
    kwargs = {**layout, "tensor_parallel": tp, "data_parallel": data_parallel}
    return DeepSpeedPlan(
        engine="mm_parallel",
        zero_stage=stage,
        strategy_kwargs=kwargs,
        note=ZERO3_NOTE if stage == 3 else None,
    )


class CPUCapableDeepSpeedStrategy(DeepSpeedStrategy):
    """Lightning's ``DeepSpeedStrategy`` without its CUDA-only check.

    DeepSpeed runs on CPU when ``DS_ACCELERATOR=cpu`` is set before it is imported (its CPU
    accelerator communicates over gloo); this class sets it when no GPU is visible.
    """

    strategy_name = "deepspeed_cpu"

    @override
    def setup_environment(self) -> None:
        from lightning.pytorch.accelerators import CUDAAccelerator

        if not isinstance(self.accelerator, CUDAAccelerator):
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
            Strategy.setup_environment(self)  # the parent minus its CUDA check
            self.setup_distributed()
            return
        super().setup_environment()

    @override
    def setup_distributed(self) -> None:
        from lightning.pytorch.accelerators import CUDAAccelerator

        if isinstance(self.accelerator, CUDAAccelerator):
            super().setup_distributed()
            return
        from lightning.fabric.utilities.seed import reset_seed

        # the parent also checks CUDA device indices, which CPU devices do not have
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    @override
    def _setup_model_and_optimizer(
        self, model: Any, optimizer: Any, lr_scheduler: Any = None
    ) -> tuple[Any, Any]:
        from lightning_mmpar.compat import deepspeed_broadcast_zero_dim

        deepspeed_broadcast_zero_dim()
        if self.root_device.type == "cuda":
            return super()._setup_model_and_optimizer(model, optimizer, lr_scheduler)
        import argparse

        import deepspeed

        # the parent passes device_rank=root_device.index, which is None on CPU
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.local_rank),
            config=self.config,
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, ds_optimizer

    @override
    def _get_process_group_backend(self) -> str:
        from lightning.pytorch.accelerators import CUDAAccelerator

        if isinstance(self.accelerator, CUDAAccelerator):
            return super()._get_process_group_backend()
        return "gloo"
