"""The recipe's LightningModule for a Qwen3-VL-MoE directory (``model.pretrained.hf``).

:class:`~lightning_mmpar.recipes.module.ClipLlamaModule` becomes
:class:`Qwen3MoeVLRecipeModule` when ``model.pretrained.hf`` names a directory whose
``config.json`` ``model_type`` is ``qwen3_vl_moe`` (:meth:`handles_hf`, as
:class:`~lightning_mmpar.recipes.qwen_module.QwenVLRecipeModule` does for Qwen2-VL /
Qwen2.5-VL). Everything is :class:`QwenVLRecipeModule`'s (batches, caption loss, freezing,
per-tower learning rates: the DeepStack mergers go with the patch merger) but the model:

* :class:`~lightning_mmpar.models.hf.qwen3_vl_moe.Qwen3MoeVLModel` (sizes from the
  directory's ``config.json``) built on the meta device, its MoE buffers initialised
  (:func:`~lightning_mmpar.models.hf.qwen3_convert.init_moe_buffers`);
* planned by :func:`~lightning_mmpar.plans.qwen3_moe_vl.qwen3_moe_vl_plan` (``model.plan.
  vision_parallel`` tp / replicate; the experts over ``expert_parallel``);
* each rank reading only its slices, stages, FSDP shards and experts
  (:func:`~lightning_mmpar.recipes.pretrained.load_towers` through
  :func:`~lightning_mmpar.recipes.pretrained_files.transformers_qwen_vl`'s views).
"""

from __future__ import annotations

from typing import Any, cast

import torch

from lightning_mmpar.models.hf.qwen3_convert import (
    init_moe_buffers,
    is_qwen3_moe_vl_dir,
    qwen3_moe_vl_config,
)
from lightning_mmpar.models.hf.qwen3_vl_moe import Qwen3MoeVLConfig, Qwen3MoeVLModel
from lightning_mmpar.parallel.parallelize import ParallelPlan
from lightning_mmpar.plans.qwen3_moe_vl import qwen3_moe_vl_plan
from lightning_mmpar.recipes.qwen_module import QwenVLRecipeModule

__all__ = ["Qwen3MoeVLRecipeModule"]


class Qwen3MoeVLRecipeModule(QwenVLRecipeModule):
    """:class:`QwenVLRecipeModule` over a Qwen3-VL-MoE checkpoint (module docstring); build it
    through ``ClipLlamaModule(pretrained=...)`` or directly with the same arguments.

    Raises:
        ValueError: ``pretrained.hf`` unset; a config value the model does not compute
            (:func:`~lightning_mmpar.models.hf.qwen3_convert.qwen3_moe_vl_config`, naming the
            field).
    """

    @classmethod
    def handles_hf(cls, path: str | None) -> bool:
        """A Qwen3-VL-MoE directory (``config.json``'s ``model_type``)."""
        return is_qwen3_moe_vl_dir(path)

    def _model_config(self, config: Any) -> Qwen3MoeVLConfig:  # type: ignore[override]
        return qwen3_moe_vl_config(config)

    def _meta_model(self) -> Qwen3MoeVLModel:
        with torch.device("meta"):
            model = Qwen3MoeVLModel(self.qwen_config)
        return init_moe_buffers(model)

    def _plan(self, **options: Any) -> ParallelPlan:
        return qwen3_moe_vl_plan(cast(Qwen3MoeVLModel, self.qwen_model), **options)
