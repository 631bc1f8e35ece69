"""The CLIP-ViT + cross-modal adapter + LLaMA fusion model: every stream its training needs.

Data flow (the blocks and their streams: :mod:`lightning_mmpar.models.blocks`)::

    images -> vision (open_clip ViT) -> tokens [B, N, D_v], pooled [B, E_v]
    tokens -> projector Linear(D_v -> D) -> img [B, N, D]
    fused stream      h  = embed(ids) -> adapters(h, img) -> decoder layers(h, img) -> norm
                      -> lm_head -> logits [B, T, V]                       (captioning)
    text-only stream  ht = embed(ids) -> decoder layers(ht) -> norm -> ht[last]
                      -> text_head -> text features [B, C]                 (contrastive, MML)
    prompt stream     (eval only) class prompts like ht -> class features [K, C]  (zero-shot)
    pooled image -> image_head -> image features [B, C]
    EMA copies of image_head / text_head.proj -> momentum features (MML targets)

:meth:`FusionModel.forward` runs exactly :meth:`FusionModel.pipeline_blocks` in order, the same
blocks a pipeline-parallel strategy cuts into stages.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal, cast

import torch
from torch import Tensor, nn

from lightning_mmpar.models.adapter import AdapterConfig, CrossModalAdapter, TanhGate
from lightning_mmpar.models.blocks import (
    MAX_LOGIT_SCALE,
    AdapterLayer,
    Bridge,
    DecoderLayer,
    FusionBlock,
    FusionOutput,
    Head,
    VisionLayer,
    VisionPool,
    VisionStem,
    clamp_logit_scale_,
)
from lightning_mmpar.models.heads import MomentumHeads, TextPooler, ema_update
from lightning_mmpar.models.language import (
    LanguageConfig,
    LanguageModel,
    LlamaDecoderLayer,
    ModalityTemperature,
    RMSNorm,
)
from lightning_mmpar.models.projector import ProjectorAct, ProjectorKind, build_projector
from lightning_mmpar.models.vision import LayerScale, VisionBlock, VisionConfig, VisionTower

__all__ = [
    "MAX_LOGIT_SCALE",
    "FusionConfig",
    "FusionModel",
    "FusionOutput",
    "TextPooler",
    "freeze_for_finetuning",
    "weight_decay_split",
]


@dataclass(kw_only=True)
class FusionConfig:
    """The three towers and the contrastive heads."""

    vision: VisionConfig = field(default_factory=VisionConfig)
    """The open_clip ViT."""
    language: LanguageConfig = field(default_factory=LanguageConfig)
    """The LLaMA decoder."""
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    """The cross-modal adapter blocks."""
    contrastive_dim: int = 512
    """Width of the normalised image/text features."""
    logit_scale_init: float = 1 / 0.07
    """Initial CLIP logit scale (stored as its log)."""
    fusion: Literal["cross_attention", "spliced"] = "cross_attention"
    """How a ragged batch's images reach the language model (one-image batches always use the
    adapters): ``cross_attention`` (Flamingo: each text token attends, in the adapters, to the
    images of its own sample at or before it; the marker stays a text token) or ``spliced``
    (LLaVA / Qwen-VL: the ``image_token_id`` embeddings are replaced by the image's patch
    tokens; the adapters still run with the cross-attention rule; ``num_blocks=0`` for plain
    LLaVA)."""
    image_token_id: int | None = None
    """The image marker / image token id; required with ``fusion="spliced"``."""
    projector: ProjectorKind = "linear"
    """Vision-to-language projector: ``linear`` or LLaVA-1.5's two-layer ``mlp2x``
    (:mod:`lightning_mmpar.models.projector`)."""
    projector_act: ProjectorAct = "gelu"
    """Activation between the ``mlp2x`` projector's layers."""
    projector_bias: bool = True
    """Biases on the projector's linear layers."""

    def __post_init__(self) -> None:
        if self.fusion not in ("cross_attention", "spliced"):
            raise ValueError(
                f"FusionConfig.fusion ({self.fusion!r}) must be 'cross_attention' or 'spliced'."
            )
        if self.fusion == "spliced" and self.image_token_id is None:
            raise ValueError(
                "FusionConfig.image_token_id is None but fusion='spliced' needs it: set it to "
                "the collator's image_token_id."
            )


def _last_index(ids: Tensor, mask: Tensor | None) -> Tensor:
    """``[...]`` index of each row's last token: ``sum(mask) - 1`` (right padding)."""
    if mask is None:
        return torch.full(ids.shape[:-1], ids.shape[-1] - 1, device=ids.device)
    return mask.long().sum(dim=-1) - 1


class FusionModel(nn.Module):
    """CLIP-ViT + projector + cross-modal adapters + LLaMA, with contrastive heads.

    Args:
        config: tower sizes, adapter, contrastive width, initial logit scale.
        momentum: EMA momentum ``m`` of the momentum heads (ALBEF: 0.995).

    The momentum heads (:attr:`momentum_heads`, EMA copies of ``image_head`` and
    ``text_head.proj``) are not parameters of the model: they get no gradient and stay out of its
    state dict, so the model's keys are the towers' (open_clip / LLaMA) and the heads'. The head
    block registers them, so a module that holds the blocks (the recipe) checkpoints them. After
    loading trained heads into a fresh model, :meth:`reset_momentum` restarts the copies there.
    """

    def __init__(self, config: FusionConfig, *, momentum: float = 0.995) -> None:
        super().__init__()
        self.config = config
        dim = config.language.hidden_size
        self.vision = VisionTower(config.vision)
        self.projector = build_projector(
            config.vision.token_width,
            dim,
            config.projector,
            config.projector_act,
            config.projector_bias,
        )
        self.adapters = nn.ModuleList(
            CrossModalAdapter(dim, config.adapter) for _ in range(config.adapter.num_blocks)
        )
        self.language = LanguageModel(config.language)
        self.image_head = nn.Linear(config.vision.output_dim, config.contrastive_dim, bias=False)
        self.text_head = TextPooler(dim, config.contrastive_dim)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(config.logit_scale_init)))
        heads = MomentumHeads(
            image_head=self.image_head, text_head=self.text_head.proj, momentum=momentum
        )
        self._momentum = (heads,)  # a tuple: not registered (see the class docstring)
        self.text_stream = True
        """The decoder layers also run the text-only stream (the text features the contrastive
        and MML terms read). False (the recipe, when both weights are 0: LLaVA's caption-only
        objective) passes the embeddings through instead: the logits are unchanged, the text
        features pool the embeddings, the decoder's work halves. Read when
        :meth:`pipeline_blocks` builds the blocks. A mixture-of-experts decoder always runs it."""

    @property
    def momentum_heads(self) -> MomentumHeads:
        """EMA copies of the contrastive heads (MML targets)."""
        return self._momentum[0]

    def _apply(self, fn: Callable[..., object], recurse: bool = True) -> FusionModel:
        """``to()``, ``float()``... also move the (unregistered) momentum heads."""
        super()._apply(fn, recurse)
        self.momentum_heads._apply(fn, recurse)
        return self

    def reset_momentum(self) -> None:
        """Copy the live heads into their EMA copies (in place)."""
        ema_update(self.momentum_heads.image_head, self.image_head, 0.0)
        ema_update(self.momentum_heads.text_head, self.text_head.proj, 0.0)

    def ema_update(self) -> None:
        """One EMA step of the momentum heads towards the live heads (after an optimizer step)."""
        self.momentum_heads.update(self.image_head, self.text_head.proj)

    def after_optimizer_step(self) -> None:
        """Call once per optimizer step (not per accumulated batch): clamp the logit scale
        parameter to ``[0, ln 100]`` (CLIP, open_clip), then one EMA step of the momentum
        heads. The recipe does the same through its head block."""
        clamp_logit_scale_(self.logit_scale)
        self.ema_update()

    @staticmethod
    def pipeline_inputs(
        images: Tensor,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        prompt_ids: Tensor | None = None,
        prompt_mask: Tensor | None = None,
    ) -> tuple[Tensor, ...]:
        """The tuple block 0 takes: ``(images, ids, last, p_ids [B, K, T_p], p_last [B, K])``.

        Masks are right-padding masks (``None``: no padding) and pick each row's last token.
        ``prompt_ids [K, T_p]`` are the class prompts of zero-shot classification (eval mode);
        without them the first caption stands in (``K = 1``).
        """
        if prompt_ids is None:
            prompt_ids = input_ids[:1]
            prompt_mask = None if attention_mask is None else attention_mask[:1]
        b = input_ids.shape[0]
        p_last = _last_index(prompt_ids, prompt_mask)
        return (
            images,
            input_ids,
            _last_index(input_ids, attention_mask),
            prompt_ids.unsqueeze(0).expand(b, -1, -1).contiguous(),
            p_last.unsqueeze(0).expand(b, -1).contiguous(),
        )

    @staticmethod
    def ragged_inputs(batch: Mapping[str, Tensor]) -> tuple[Tensor, ...]:
        """The tuple block 0 takes for a ragged batch (:class:`~lightning_mmpar.data.
        MultimodalCollator`): ``(pixel_values [B, I, C, H, W], image_mask [B, I], input_ids,
        position_ids, sample_ids [B, T], image_sample, image_position [B, I])``.

        Raises:
            ValueError: a key missing, or ``pixel_values`` not 5-d.
        """
        keys: tuple[str, ...] = ("pixel_values", "image_mask", "input_ids", "position_ids")
        keys += ("sample_ids", "image_sample", "image_position")
        missing = [k for k in keys if k not in batch]
        if missing or batch["pixel_values"].ndim != 5:
            raise ValueError(
                f"a ragged batch needs {list(keys)} with pixel_values [B, I, C, H, W]; missing "
                f"{missing} (use lightning_mmpar.data.MultimodalCollator)."
            )
        return tuple(batch[k] for k in keys)

    def forward_ragged(self, batch: Mapping[str, Tensor]) -> FusionOutput:
        """All blocks on a ragged batch (:meth:`ragged_inputs`). Features are per image slot:
        ``image_features`` / ``text_features`` / momentum features ``[B, I, C]`` (the slot's
        image and its sample's text), ``logits [B, T, V]``, ``class_features`` zeros ``[1, C]``
        (no prompt stream)."""
        state = self.ragged_inputs(batch)
        for block in self.pipeline_blocks():
            state = block(*state)
        return FusionOutput(*state)

    def pipeline_blocks(self) -> list[FusionBlock]:
        """Ordered blocks (vision, aligner, language, head), each mapping a tuple to a tuple.

        New wrappers on every call, over the model's own modules, in the model's train/eval
        mode. Cut them after tensor parallelism; once a data-parallel wrapper (FSDP2) has
        sharded the blocks, run the blocks rather than :meth:`forward`.
        """
        blocks: list[FusionBlock] = [VisionStem(self.vision)]
        blocks += [VisionLayer(cast(VisionBlock, b)) for b in self.vision.transformer.resblocks]
        spliced = self.config.image_token_id if self.config.fusion == "spliced" else None
        bridge = Bridge(self.projector, self.language.embed_tokens, image_token_id=spliced)
        blocks += [VisionPool(self.vision), bridge]
        blocks += [AdapterLayer(cast(CrossModalAdapter, a)) for a in self.adapters]
        blocks += [
            DecoderLayer(cast(LlamaDecoderLayer, d), text_stream=self.text_stream)
            for d in self.language.layers
        ]
        blocks.append(
            Head(
                language=self.language,
                image_head=self.image_head,
                text_head=self.text_head,
                logit_scale=self.logit_scale,
                momentum=self.momentum_heads,
            )
        )
        for block in blocks:
            block.training = self.training  # the wrapper only; its modules keep their own mode
        return blocks

    def block_parameter_names(self, blocks: list[FusionBlock]) -> list[dict[str, str]]:
        """For each block, ``{block parameter name: model parameter name}`` (the momentum
        heads, not model parameters, are left out)."""
        names = {id(p): n for n, p in self.named_parameters()}
        return [
            {n: names[id(p)] for n, p in b.named_parameters() if id(p) in names} for b in blocks
        ]

    def forward(
        self,
        images: Tensor,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        prompt_ids: Tensor | None = None,
        prompt_mask: Tensor | None = None,
    ) -> FusionOutput:
        """All blocks in order on ``images [B, 3, H, W]`` and ``input_ids [B, T]``."""
        state = self.pipeline_inputs(images, input_ids, attention_mask, prompt_ids, prompt_mask)
        for block in self.pipeline_blocks():
            state = block(*state)
        return FusionOutput(*state)


def freeze_for_finetuning(
    model: FusionModel, *, train_vision: bool = False, train_decoder_layers: int = 2
) -> None:
    """Freeze the ViT and all decoder layers but the first ``train_decoder_layers``.

    This package's fine-tuning policy for pretrained towers: a frozen vision encoder as in LLaVA
    (Liu et al. 2023) and Flamingo (Alayrac et al. 2022).

    Projector, adapters, contrastive heads and the logit scale stay trainable; the embedding,
    final norm and LM head are frozen with the later decoder layers.
    """
    model.vision.requires_grad_(train_vision)
    model.language.requires_grad_(False)
    for layer in model.language.layers[:train_decoder_layers]:
        layer.requires_grad_(True)


NO_DECAY_MODULES: tuple[type[nn.Module], ...] = (
    nn.LayerNorm,
    nn.GroupNorm,
    nn.modules.batchnorm._NormBase,
    nn.RMSNorm,
    RMSNorm,
    TanhGate,
    LayerScale,
    ModalityTemperature,
)
"""Modules whose own parameters never get weight decay: norms, gates and scales."""
NO_DECAY_NAMES: frozenset[str] = frozenset(
    {"bias", "class_embedding", "positional_embedding", "logit_scale", "log_scale"}
)
"""Parameter names (last component) that never get weight decay, whatever their shape: every
bias (the ViT's fused q/k/v bias is ``[3, D]``), the ViT's class and positional embeddings and
the logit scale."""


def weight_decay_split(module: nn.Module) -> tuple[list[str], list[str]]:
    """``(decay, no_decay)``: names of ``module``'s trainable parameters, split by role.

    No decay for biases, norm weights, positional and class embeddings, gates, per-modality
    temperatures, layer scales and the logit scale (:data:`NO_DECAY_MODULES`,
    :data:`NO_DECAY_NAMES`), and for any other parameter with fewer than 2 dims; decay for the
    weights of linear, convolution and token-embedding layers and the ViT's ``proj``. open_clip's
    rule (``exclude = p.ndim < 2 or "bn" in n or "ln" in n or "bias" in n or "logit_scale" in
    n``) extended by role, because shape alone decays the fused ``[3, D]`` q/k/v bias and the
    ``[N, D]`` positional embedding. Works on any module holding the fusion model's parts (the
    recipe's blocks, FSDP2- or TP-wrapped: module types and names are kept). Frozen parameters
    are left out of both lists.
    """
    decay: list[str] = []
    no_decay: list[str] = []
    seen: set[int] = set()
    for prefix, sub in module.named_modules():
        by_role = isinstance(sub, NO_DECAY_MODULES)
        for name, p in sub.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            full = f"{prefix}.{name}" if prefix else name
            skip = by_role or name in NO_DECAY_NAMES or name.endswith("_bias") or p.ndim < 2
            (no_decay if skip else decay).append(full)
    return decay, no_decay
