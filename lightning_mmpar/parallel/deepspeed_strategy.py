"""Lightning's ``DeepSpeedStrategy`` on CPU as well: the engine of ZeRO-1/2 DeepSpeed JSONs.

:func:`~lightning_mmpar.parallel.deepspeed_mapping.map_deepspeed_config` sends ZeRO stages 1
and 2 to DeepSpeed's own engine; :class:`CPUCapableDeepSpeedStrategy` runs it on GPUs as
Lightning does and, with no GPU visible, on CPU processes (DeepSpeed's CPU accelerator over
gloo), so the interop is tested without a GPU.
"""

from __future__ import annotations

import os
from typing import Any

from lightning.pytorch.strategies import DeepSpeedStrategy, Strategy
from typing_extensions import override

__all__ = ["CPUCapableDeepSpeedStrategy"]


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
