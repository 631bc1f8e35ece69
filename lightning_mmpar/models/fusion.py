"""The CLIP-ViT + cross-modal adapter + LLaMA fusion model and its pipeline-block protocol.

Data flow::

    images -> vision (open_clip ViT) -> tokens [B, N, D_v], pooled [B, E_v]
    tokens -> projector Linear(D_v -> D) -> adapters(text h, image tokens) -> decoder layers
    -> norm -> lm_head -> logits [B, T, V]
    pooled image -> image_head -> l2-normalised image features  [B, C]
    h at the last text token -> text_head -> l2-normalised text features [B, C]

Pipeline protocol: :meth:`FusionModel.pipeline_blocks` returns the ordered list of blocks; block
``i`` takes the tuple returned by block ``i - 1`` (block 0 takes
:meth:`FusionModel.pipeline_inputs`) and returns a tuple of tensors:

=================  ==================================================  ========
block              input -> output                                    kind
=================  ==================================================  ========
``VisionStem``     ``(images, ids, last) -> (x_v, ids, last)``         vision
``VisionLayer``    ``(x_v, ids, last) -> (x_v, ids, last)``            vision
``VisionPool``     ``(x_v, ids, last) -> (tok_v, pooled, ids, last)``  vision
``Bridge``         ``(tok_v, pooled, ids, last) -> (img, pooled, h, last)``  aligner
``HiddenLayer``    ``(img, pooled, h, last) -> (img, pooled, h, last)``  aligner: adapter
``HiddenLayer``    ``(img, pooled, h, last) -> (img, pooled, h, last)``  language: decoder
``Head``           ``(img, pooled, h, last) -> (logits, img_f, txt_f, scale)``  language
=================  ==================================================  ========

``ids`` are token ids ``[B, T]``, ``last`` the index of each row's last text token ``[B]``.
Blocks reference the model's own modules (no copies); build them after tensor parallelism has been
applied to the model. :meth:`FusionModel.block_parameter_names` maps block parameter names back
to the model's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_mmpar.models.adapter import AdapterConfig, CrossModalAdapter
from lightning_mmpar.models.language import LanguageConfig, LanguageModel
from lightning_mmpar.models.vision import (
    VisionBlock,
    VisionConfig,
    VisionTower,
    embed_patches,
    pool_tokens,
)


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


class FusionOutput(NamedTuple):
    """Forward result. ``logits`` is a vocab-sharded DTensor under tensor parallelism."""

    logits: Tensor
    """``[B, T, V]`` next-token logits."""
    image_features: Tensor
    """``[B, C]`` l2-normalised image features."""
    text_features: Tensor
    """``[B, C]`` l2-normalised text features."""
    logit_scale: Tensor
    """Scalar CLIP logit scale ``exp(log_scale)`` for the contrastive loss."""


class TextPooler(nn.Module):
    """``f = h[b, last_b] W^T``: the hidden state of each row's last text token, projected."""

    def __init__(self, dim: int, out_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, out_dim, bias=False)

    def forward(self, h: Tensor, last_index: Tensor) -> Tensor:
        rows = torch.arange(h.shape[0], device=last_index.device)
        return self.proj(h[rows, last_index])


class FusionModel(nn.Module):
    """CLIP-ViT + projector + cross-modal adapters + LLaMA, with contrastive heads."""

    def __init__(self, config: FusionConfig) -> None:
        super().__init__()
        self.config = config
        dim = config.language.hidden_size
        self.vision = VisionTower(config.vision)
        self.projector = nn.Linear(config.vision.width, dim)
        self.adapters = nn.ModuleList(
            CrossModalAdapter(dim, config.adapter) for _ in range(config.adapter.num_blocks)
        )
        self.language = LanguageModel(config.language)
        self.image_head = nn.Linear(config.vision.output_dim, config.contrastive_dim, bias=False)
        self.text_head = TextPooler(dim, config.contrastive_dim)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(config.logit_scale_init)))

    def pipeline_inputs(
        self, images: Tensor, input_ids: Tensor, attention_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The tuple block 0 takes; ``attention_mask`` (right padding) picks each last token."""
        if attention_mask is None:
            last = torch.full(
                (input_ids.shape[0],), input_ids.shape[1] - 1, device=input_ids.device
            )
        else:
            last = attention_mask.long().sum(dim=1) - 1
        return images, input_ids, last

    def pipeline_blocks(self) -> list[nn.Module]:
        """Ordered blocks (vision, aligner, language), each mapping a tuple to a tuple."""
        blocks: list[nn.Module] = [VisionStem(self.vision)]
        blocks += [VisionLayer(cast(VisionBlock, b)) for b in self.vision.transformer.resblocks]
        blocks += [VisionPool(self.vision), Bridge(self.projector, self.language.embed_tokens)]
        blocks += [HiddenLayer(a, "aligner") for a in self.adapters]
        blocks += [HiddenLayer(d, "language") for d in self.language.layers]
        blocks.append(Head(self))
        return blocks

    def block_parameter_names(self, blocks: list[nn.Module]) -> list[dict[str, str]]:
        """For each block, ``{block parameter name: model parameter name}``."""
        names = {id(p): n for n, p in self.named_parameters()}
        return [{n: names[id(p)] for n, p in b.named_parameters()} for b in blocks]

    def forward(
        self, images: Tensor, input_ids: Tensor, attention_mask: Tensor | None = None
    ) -> FusionOutput:
        state: tuple[Tensor, ...] = self.pipeline_inputs(images, input_ids, attention_mask)
        for block in self.pipeline_blocks():
            state = block(*state)
        return FusionOutput(*state)


class VisionStem(nn.Module):
    """Patch/class/positional embedding and ``ln_pre``."""

    kind = "vision"

    def __init__(self, vision: VisionTower) -> None:
        super().__init__()
        self.conv1, self.ln_pre = vision.conv1, vision.ln_pre
        self.class_embedding = vision.class_embedding
        self.positional_embedding = vision.positional_embedding

    def forward(self, images: Tensor, ids: Tensor, last: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        x = embed_patches(
            images, self.conv1, self.class_embedding, self.positional_embedding, self.ln_pre
        )
        return x, ids, last


class VisionLayer(nn.Module):
    """One ViT residual block on ``x_v``."""

    kind = "vision"

    def __init__(self, block: VisionBlock) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: Tensor, ids: Tensor, last: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.block(x), ids, last


class VisionPool(nn.Module):
    """``ln_post``, pooling and ``proj``: patch tokens and the pooled image embedding."""

    kind = "vision"

    def __init__(self, vision: VisionTower) -> None:
        super().__init__()
        self.ln_post, self.proj = vision.ln_post, vision.proj
        self.config = vision.config

    def forward(
        self, x: Tensor, ids: Tensor, last: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        pooled, tokens = pool_tokens(x, self.ln_post, self.proj, self.config)
        return tokens, pooled, ids, last


class Bridge(nn.Module):
    """``img = tok_v W_p^T + b_p`` (projector) and ``h = embed_tokens(ids)``."""

    kind = "aligner"

    def __init__(self, projector: nn.Linear, embed_tokens: nn.Embedding) -> None:
        super().__init__()
        self.projector, self.embed_tokens = projector, embed_tokens

    def forward(
        self, tokens: Tensor, pooled: Tensor, ids: Tensor, last: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return self.projector(tokens), pooled, self.embed_tokens(ids), last


class HiddenLayer(nn.Module):
    """One layer on the text stream, ``h <- layer(h, img)``; the other tensors pass through.

    ``kind`` is ``"aligner"`` for a :class:`CrossModalAdapter` (text attends to ``img``) and
    ``"language"`` for a LLaMA decoder layer (``img`` used only by joint attention).
    """

    def __init__(self, layer: nn.Module, kind: str) -> None:
        super().__init__()
        self.layer = layer
        self.kind = kind

    def forward(
        self, img: Tensor, pooled: Tensor, h: Tensor, last: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return img, pooled, self.layer(h, img), last


class Head(nn.Module):
    """Final norm, LM head and the two normalised contrastive features."""

    kind = "language"

    def __init__(self, model: FusionModel) -> None:
        super().__init__()
        self.norm, self.lm_head = model.language.norm, model.language.lm_head
        self.image_head, self.text_head = model.image_head, model.text_head
        self.logit_scale = model.logit_scale

    def forward(
        self, img: Tensor, pooled: Tensor, h: Tensor, last: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        h = self.norm(h)
        image = F.normalize(self.image_head(pooled), dim=-1)
        text = F.normalize(self.text_head(h, last), dim=-1)
        return self.lm_head(h), image, text, self.logit_scale.exp()


def freeze_for_finetuning(
    model: FusionModel, *, train_vision: bool = False, train_decoder_layers: int = 2
) -> None:
    """TECHNIQUES 1.5 policy: freeze the ViT and all but the first ``train_decoder_layers``.

    Projector, adapters, contrastive heads and the logit scale stay trainable; the embedding,
    final norm and LM head are frozen with the later decoder layers.
    """
    model.vision.requires_grad_(train_vision)
    model.language.requires_grad_(False)
    for layer in model.language.layers[:train_decoder_layers]:
        layer.requires_grad_(True)
