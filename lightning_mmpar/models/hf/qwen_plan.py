"""Qwen-VL checkpoints as the layout planner prices them: a :class:`FusionConfig` of the same
shapes, read from ``config.json`` alone.

The planner and the partitioner (``python -m lightning_mmpar.recipes.planner --hf-config``)
cost a :class:`~lightning_mmpar.models.fusion.FusionModel` on the meta device. Qwen2-VL,
Qwen2.5-VL and Qwen3-VL-MoE train as their own models
(:class:`~lightning_mmpar.models.hf.qwen2_vl.QwenVLModel`,
:class:`~lightning_mmpar.models.hf.qwen3_vl_moe.Qwen3MoeVLModel`), so the planner prices a
fusion model with their dimensions instead (:func:`qwen_plan_fusion_config`):

* **ViT**: the checkpoint's width, depth, heads and patch size; its MLP's parameters (a SwiGLU
  MLP of inner width ``I``, Qwen2.5-VL, as a two-matrix MLP of ``1.5 I``); ``image_tokens``
  language tokens per image (dynamic resolution: a planner input, default
  :data:`DEFAULT_IMAGE_TOKENS`), so a square image of ``sqrt(image_tokens) * merge`` patches
  per side; the ``merge x merge`` patch merger as ``VisionConfig.spatial_merge``;
* **projector**: ``mlp2x`` from the merged width (``merge^2 x`` the ViT's) to the language
  model's (Qwen's merger is ``4W -> 4W -> D``: ``mlp2x`` is ``4W -> D -> D``);
* **language model**: the checkpoint's decoder (GQA, head_dim, q/k/v biases), the experts of
  Qwen3-VL-MoE as ``LanguageConfig.moe`` (every layer MoE, dropless, plain linear router).

Priced differently from the real model (the planner's figures are upper bounds on these):
Qwen2.5-VL's window attention (its windowed blocks are priced as full attention); M-RoPE
(elementwise, priced as RoPE); Qwen3-VL's DeepStack mergers (three more ``4W -> 4W -> D``
MLPs, about 92 M parameters on the 30B-A3B, not priced) and its learned position grid; the
fusion decoder runs its mixture-of-experts layers on the text-only stream too
(:attr:`FusionModel.text_stream`), so Qwen3-VL-MoE's decoder is priced at twice its work.
"""

from __future__ import annotations

import math
from typing import Any

from lightning_mmpar.models.adapter import AdapterConfig
from lightning_mmpar.models.fusion import FusionConfig
from lightning_mmpar.models.hf.qwen3_convert import QWEN3_MOE_FAMILIES, qwen3_moe_vl_config
from lightning_mmpar.models.hf.qwen_convert import QWEN_FAMILIES, qwen_vl_config
from lightning_mmpar.models.vision import VisionConfig

__all__ = ["DEFAULT_IMAGE_TOKENS", "is_qwen_config", "qwen_plan_fusion_config"]

DEFAULT_IMAGE_TOKENS = 256
"""Language tokens per image when the planner is given none: a 448 x 448 image at patch 14
(512 x 512 at patch 16) after the 2 x 2 merger."""


def is_qwen_config(config: Any) -> bool:
    """Whether a transformers config is a Qwen-VL family this module prices."""
    kind = getattr(config, "model_type", None)
    return kind in QWEN_FAMILIES or kind in QWEN3_MOE_FAMILIES


def _side(image_tokens: int) -> int:
    side = math.isqrt(image_tokens) if image_tokens >= 1 else 0
    if side < 1 or side * side != image_tokens:
        raise ValueError(
            f"image_tokens ({image_tokens}) must be a square number >= 1 of language tokens "
            f"per image (a square image after the merger), e.g. {max(1, side) ** 2}."
        )
    return side


def _vision(vision: Any, image_tokens: int) -> VisionConfig:
    """The ViT of a Qwen vision config of ours (``QwenVisionConfig`` / ``Qwen3VisionConfig``)."""
    merge = vision.spatial_merge_size
    swiglu = getattr(vision, "mlp", "fc") == "swiglu"
    inner = 1.5 * vision.mlp_width if swiglu else vision.mlp_width
    return VisionConfig(
        image_size=_side(image_tokens) * merge * vision.patch_size,
        patch_size=vision.patch_size,
        width=vision.width,
        layers=vision.depth,
        heads=vision.heads,
        mlp_ratio=inner / vision.width,
        output_dim=vision.width,
        no_ln_pre=True,
        act="quick_gelu" if vision.hidden_act == "quick_gelu" else "gelu",
        spatial_merge=merge,
    )


def qwen_plan_fusion_config(config: Any, image_tokens: int = DEFAULT_IMAGE_TOKENS) -> FusionConfig:
    """The :class:`FusionConfig` the planner prices for a transformers Qwen2-VL, Qwen2.5-VL
    or Qwen3-VL-MoE config (module docstring), at ``image_tokens`` language tokens per image.

    Raises:
        ValueError: not a Qwen-VL config; a value the Qwen readers refuse
            (:func:`~lightning_mmpar.models.hf.qwen_convert.qwen_vl_config`,
            :func:`~lightning_mmpar.models.hf.qwen3_convert.qwen3_moe_vl_config`, naming the
            field); dense layers among Qwen3-VL-MoE's expert layers (``mlp_only_layers``);
            ``image_tokens`` not a square number.
    """
    if not is_qwen_config(config):
        raise ValueError(
            f"config.json model_type {getattr(config, 'model_type', None)!r} is not a Qwen-VL "
            f"family; expected one of {sorted(QWEN_FAMILIES | QWEN3_MOE_FAMILIES)}."
        )
    if config.model_type in QWEN_FAMILIES:
        ours: Any = qwen_vl_config(config)
    else:
        ours = qwen3_moe_vl_config(config)
        if ours.dense_layers:
            raise ValueError(
                f"text_config.mlp_only_layers {list(ours.dense_layers)}: the planner prices "
                "every decoder layer as a mixture-of-experts layer; a config with dense layers "
                "among them is not priced (use mlp_only_layers: [])."
            )
    return FusionConfig(
        vision=_vision(ours.vision, image_tokens),
        language=ours.language,
        adapter=AdapterConfig(num_blocks=0),
        contrastive_dim=ours.vision.width,
        fusion="spliced",
        image_token_id=int(ours.image_token_id),
        projector="mlp2x",
        projector_act="gelu",
    )
