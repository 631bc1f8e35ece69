"""Pipeline blocks of the CLIP-LLaMA recipe: the fusion model's modules, three text streams.

The fusion model's own blocks (:meth:`FusionModel.pipeline_blocks`) carry one text stream, the
*fused* one (text attending to image tokens through the adapters). Contrastive and MML losses
need image-independent text features (otherwise the "text" feature can copy the image and the
contrastive task is trivial, ALBEF's reason for a unimodal text encoder), and zero-shot
classification needs the class prompts encoded the same way. The recipe's blocks therefore wrap
the same modules (no copies) and carry, batch-first so micro-batching splits them::

    inputs   (images, ids, last, p_ids, p_last)
    vision   (x_v, ids, last, p_ids, p_last)                 VisionStem / VisionLayer
    pool     (tok_v, pooled, ids, last, p_ids, p_last)       VisionPool
    bridge   (img, pooled, h, ht, last, hp, p_last)          projector, embed_tokens
    aligner  h <- adapter(h, img); ht, hp unchanged          Adapter
    language h <- layer(h, img); ht <- layer(ht); hp <- layer(hp) (eval only)
    head     RecipeOutput                                     norm, lm_head, heads, EMA heads

``h`` is the fused stream (captioning), ``ht`` the text-only stream (contrastive/MML), ``hp`` the
class prompts ``[B, C, T, D]`` (every row holds the same C prompts; only row 0 is computed and
broadcast, and only in eval mode, so training pays nothing for it).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_mmpar.losses.mml import MomentumHeads
from lightning_mmpar.models.fusion import FusionModel
from lightning_mmpar.models.vision import embed_patches, pool_tokens

MAX_LOGIT_SCALE = 100.0
"""CLIP's clamp of the exponentiated logit scale."""


class RecipeOutput(NamedTuple):
    """What the last block hands the loss."""

    logits: Tensor
    """``[B, T, V]`` caption logits of the fused stream (vocab-sharded DTensor under TP)."""
    image_features: Tensor
    """``[B, C]`` l2-normalised image features."""
    text_features: Tensor
    """``[B, C]`` l2-normalised text-only features (contrastive, MML, retrieval)."""
    logit_scale: Tensor
    """``[B]`` copies of ``min(exp(t), 100)`` (batch-shaped so pipeline outputs can be merged)."""
    momentum_image: Tensor
    """``[B, C]`` EMA-head image features (no gradient)."""
    momentum_text: Tensor
    """``[B, C]`` EMA-head text features (no gradient)."""
    class_features: Tensor
    """``[K, C]`` l2-normalised class-prompt features (zeros in training mode)."""


def _broadcast_rows(x: Tensor, rows: int) -> Tensor:
    return x.unsqueeze(0).expand(rows, *x.shape).contiguous()


class Stem(nn.Module):
    """Patch/class/positional embedding and ``ln_pre``."""

    def __init__(self, model: FusionModel) -> None:
        super().__init__()
        v = model.vision
        self.conv1, self.ln_pre = v.conv1, v.ln_pre
        self.class_embedding, self.positional_embedding = v.class_embedding, v.positional_embedding

    def forward(self, images: Tensor, *rest: Tensor) -> tuple[Tensor, ...]:
        x = embed_patches(
            images, self.conv1, self.class_embedding, self.positional_embedding, self.ln_pre
        )
        return (x, *rest)


class VisionLayer(nn.Module):
    """One ViT residual block on ``x_v``."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: Tensor, *rest: Tensor) -> tuple[Tensor, ...]:
        return (self.block(x), *rest)


class Pool(nn.Module):
    """``ln_post``, pooling and ``proj``: patch tokens and the pooled image embedding."""

    def __init__(self, model: FusionModel) -> None:
        super().__init__()
        self.ln_post, self.proj = model.vision.ln_post, model.vision.proj
        self.config = model.vision.config

    def forward(self, x: Tensor, *rest: Tensor) -> tuple[Tensor, ...]:
        pooled, tokens = pool_tokens(x, self.ln_post, self.proj, self.config)
        return (tokens, pooled, *rest)


class Bridge(nn.Module):
    """``img = projector(tok_v)``; the fused and text-only streams start from ``embed(ids)``."""

    def __init__(self, model: FusionModel) -> None:
        super().__init__()
        self.projector, self.embed_tokens = model.projector, model.language.embed_tokens

    def forward(
        self,
        tokens: Tensor,
        pooled: Tensor,
        ids: Tensor,
        last: Tensor,
        p_ids: Tensor,
        p_last: Tensor,
    ) -> tuple[Tensor, ...]:
        h = self.embed_tokens(ids)
        dim = h.shape[-1]
        if self.training:
            hp = h.new_zeros(*p_ids.shape, dim)
        else:
            hp = _broadcast_rows(self.embed_tokens(p_ids[0]), p_ids.shape[0])
        return self.projector(tokens), pooled, h, h.clone(), last, hp, p_last


class Adapter(nn.Module):
    """One cross-modal adapter on the fused stream only."""

    def __init__(self, adapter: nn.Module) -> None:
        super().__init__()
        self.adapter = adapter

    def forward(self, img: Tensor, pooled: Tensor, h: Tensor, *rest: Tensor) -> tuple[Tensor, ...]:
        return (img, pooled, self.adapter(h, img), *rest)


class Decoder(nn.Module):
    """One LLaMA layer on all streams: fused (with ``img`` under joint attention), text, prompts."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(
        self,
        img: Tensor,
        pooled: Tensor,
        h: Tensor,
        ht: Tensor,
        last: Tensor,
        hp: Tensor,
        p_last: Tensor,
    ) -> tuple[Tensor, ...]:
        if not self.training:
            hp = _broadcast_rows(self.layer(hp[0]), hp.shape[0])
        return img, pooled, self.layer(h, img), self.layer(ht), last, hp, p_last


class Head(nn.Module):
    """Final norm, LM head, the contrastive heads and their EMA copies (``momentum``)."""

    def __init__(self, model: FusionModel, momentum: float) -> None:
        super().__init__()
        self.norm, self.lm_head = model.language.norm, model.language.lm_head
        self.image_head, self.text_head = model.image_head, model.text_head
        self.logit_scale = model.logit_scale
        self.momentum = MomentumHeads(
            image_head=model.image_head, text_head=model.text_head.proj, momentum=momentum
        )

    def _text(self, h: Tensor, last: Tensor) -> Tensor:
        rows = torch.arange(h.shape[0], device=h.device)
        return self.norm(h)[rows, last]

    def forward(
        self,
        img: Tensor,
        pooled: Tensor,
        h: Tensor,
        ht: Tensor,
        last: Tensor,
        hp: Tensor,
        p_last: Tensor,
    ) -> tuple[Tensor, ...]:
        """A plain tuple in :class:`RecipeOutput` order (pipeline stages reject NamedTuples)."""
        text_embed = self._text(ht, last)
        m_img, m_txt = self.momentum(pooled, text_embed)
        if self.training:
            classes = pooled.new_zeros(hp.shape[1], m_img.shape[-1])
        else:
            classes = F.normalize(self.text_head.proj(self._text(hp[0], p_last[0])), dim=-1)
        return tuple(
            RecipeOutput(
                logits=self.lm_head(self.norm(h)),
                image_features=F.normalize(self.image_head(pooled), dim=-1),
                text_features=F.normalize(self.text_head.proj(text_embed), dim=-1),
                logit_scale=self.logit_scale.exp().clamp(max=MAX_LOGIT_SCALE).expand(h.shape[0]),
                momentum_image=m_img,
                momentum_text=m_txt,
                class_features=classes,
            )
        )

    def ema_update(self) -> None:
        """One EMA step of the momentum heads towards the live heads."""
        self.momentum.update(self.image_head, self.text_head.proj)


def recipe_blocks(model: FusionModel, momentum: float) -> list[nn.Module]:
    """The recipe's ordered blocks over ``model`` (build after tensor parallelism)."""
    blocks: list[nn.Module] = [Stem(model)]
    blocks += [VisionLayer(b) for b in model.vision.transformer.resblocks]
    blocks += [Pool(model), Bridge(model)]
    blocks += [Adapter(a) for a in model.adapters]
    blocks += [Decoder(layer) for layer in model.language.layers]
    blocks.append(Head(model, momentum))
    return blocks
