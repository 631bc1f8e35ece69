"""The CLIP-LLaMA recipe's options (the ``model:`` section of its YAML), as typed dataclasses.

``FusionPlanOptions`` (the ``model.plan:`` section) belongs to the fusion model's parallel plan
(:mod:`lightning_mmpar.plans.fusion`) and is re-exported here, with its deprecated name
``TensorParallelOptions`` (the former ``model.tensor_parallel:`` section).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from lightning_mmpar.losses.mml import MMLConfig
from lightning_mmpar.plans.fusion import FusionPlanOptions, TensorParallelOptions

__all__ = [
    "FinetuneConfig",
    "FusionPlanOptions",
    "LossConfig",
    "OptimConfig",
    "PretrainedConfig",
    "TensorParallelOptions",
    "check_image_size",
]


@dataclass(kw_only=True)
class PretrainedConfig:
    """Local checkpoints of the towers (:mod:`lightning_mmpar.recipes.pretrained`); adapter and
    heads start fresh. A pretrained tower's sizes come from its file and replace the YAML's."""

    vision: str | None = None
    """open_clip ViT: a ``local-dir:`` directory (``open_clip_config.json`` + weights) or a
    state-dict file (``.safetensors`` / ``.pt`` / ``.bin``; the YAML's sizes are then checked)."""
    language: str | None = None
    """transformers Llama directory (``config.json`` + ``model.safetensors``)."""
    hf: str | None = None
    """A transformers vision-language checkpoint directory (``config.json`` + safetensors, e.g.
    ``LlavaForConditionalGeneration.save_pretrained``; :mod:`lightning_mmpar.models.hf`): the
    whole model (ViT, projector, decoder) and its sizes and fusion from it; only the
    contrastive heads start fresh. A Qwen2-VL / Qwen2.5-VL directory trains as its own model
    (:mod:`lightning_mmpar.recipes.qwen_module`). Excludes ``vision`` and ``language``."""

    def __post_init__(self) -> None:
        if self.hf and (self.vision or self.language):
            raise ValueError(
                f"model.pretrained.hf ({self.hf!r}) holds the whole model: leave "
                f"model.pretrained.vision ({self.vision!r}) and language ({self.language!r}) "
                "unset."
            )

    @property
    def used(self) -> bool:
        """Whether any part is pretrained."""
        return bool(self.vision or self.language or self.hf)

    @property
    def parts(self) -> tuple[str, ...]:
        """The fusion model's children read from checkpoints (the rest start fresh)."""
        if self.hf:
            return ("vision", "projector", "language")
        return tuple(t for t in ("vision", "language") if getattr(self, t))


@dataclass(kw_only=True)
class FinetuneConfig:
    """Which parts train: by default the ViT frozen, the adapter and first two decoder layers.

    This package's fine-tuning policy for pretrained towers: a frozen vision encoder as in LLaVA
    (Liu et al. 2023) and Flamingo (Alayrac et al. 2022), new layers and the first decoder
    layers trained."""

    train_vision: bool = False
    """Train the ViT. The default policy freezes it (pretrained towers); with from-scratch towers a
    frozen random ViT limits accuracy, so the CPU recipe turns this on."""
    train_decoder_layers: int = 2
    """Train the first N LLaMA decoder layers (the rest are frozen); -1 trains all."""
    train_embeddings: bool = False
    """Train ``embed_tokens``, the final norm and ``lm_head`` (frozen by the default policy)."""
    train_projector: bool = True
    """Train the projector (vision tokens -> decoder width; LLaVA's ``multi_modal_projector``).
    False freezes it (e.g. LLaVA-style decoder-only tuning)."""

    def __post_init__(self) -> None:
        if self.train_decoder_layers < -1:
            raise ValueError(
                f"train_decoder_layers ({self.train_decoder_layers}) must be >= 0, or -1 for all."
            )


@dataclass(kw_only=True)
class LossConfig:
    """Weights of the three loss terms (each is logged on its own)."""

    contrastive_weight: float = 1.0
    """Multiplier of the CLIP InfoNCE term (dp-group gather)."""
    caption_weight: float = 1.0
    """Multiplier of the caption (LM) cross-entropy."""
    mml: MMLConfig = field(default_factory=MMLConfig)
    """Momentum-distillation term: ``weight`` and EMA ``momentum`` of the momentum heads."""
    negatives: Literal["global_batch", "micro_batch"] = "global_batch"
    """Negatives of the contrastive and MML terms. ``global_batch``: the whole global batch
    (every dp rank and micro-batch), the loss of one process in every layout; under pipeline
    parallelism this costs one extra forward-only pass per step (the gradient cache, Gao et al.
    2021). ``micro_batch``: each pipeline micro-batch (dp-gathered) on its own, no extra
    forward, a different (weaker) loss when ``micro_batches > 1``. Same at pp 1."""

    def __post_init__(self) -> None:
        for name in ("contrastive_weight", "caption_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} ({getattr(self, name)}) must be >= 0; 0 disables it.")
        if self.negatives not in ("global_batch", "micro_batch"):
            raise ValueError(
                f"negatives ({self.negatives!r}) must be 'global_batch' (the whole batch, one "
                "extra forward under pipeline parallelism) or 'micro_batch' (cheaper, per "
                "micro-batch)."
            )


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW with linear warm-up and cosine decay to ``min_lr_ratio * lr``."""

    lr: float = 1e-3
    """Peak learning rate."""
    weight_decay: float = 0.01
    """AdamW weight decay (not applied to norms, biases, gates and the logit scale)."""
    warmup_steps: int = 20
    """Linear warm-up steps."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of ``lr`` (cosine schedule over ``max_steps``)."""
    lr_vision: float | None = None
    """Peak learning rate of the ViT's parameters; ``None``: ``lr``."""
    lr_language: float | None = None
    """Peak learning rate of the LLaMA decoder's parameters (embeddings, layers, norm, LM head,
    joint-attention extras); ``None``: ``lr``."""
    lr_adapter: float | None = None
    """Peak learning rate of the fresh parts: projector, adapters, contrastive heads, logit
    scale; ``None``: ``lr``."""
    lr_projector: float | None = None
    """Peak learning rate of the projector alone (its own ``projector`` parameter groups; LLaVA
    trains it above the decoder's rate); ``None``: the projector is in the adapter groups
    (``lr_adapter``)."""

    def __post_init__(self) -> None:
        for name in ("lr", "lr_vision", "lr_language", "lr_adapter", "lr_projector"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"optim.{name} ({value}) must be >= 0 (None: optim.lr).")


def check_image_size(data_image_size: int, model_image_size: int) -> None:
    """The data's images must have the ViT's input size.

    Raises:
        ValueError: the two sizes differ, naming both fields.
    """
    if data_image_size != model_image_size:
        raise ValueError(
            f"data.image_size ({data_image_size}) must equal model.fusion.vision.image_size "
            f"({model_image_size}); set both to the same value."
        )
