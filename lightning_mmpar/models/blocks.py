"""Pipeline blocks of the fusion model: thin wrappers over its modules, three text streams.

Block ``i`` takes the tuple block ``i - 1`` returned (block 0 takes
:meth:`~lightning_mmpar.models.fusion.FusionModel.pipeline_inputs`); every tensor is batch-first,
so micro-batching splits each of them::

    inputs    (images, ids, last, p_ids, p_last)
    vision    (x_v, ids, last, p_ids, p_last)                  VisionStem, VisionLayer
    pool      (tok_v, pooled, ids, last, p_ids, p_last)        VisionPool
    bridge    (img, pooled, h, ht, last, hp, p_last)           Bridge
    aligner   h <- adapter(h, img); ht, hp unchanged           AdapterLayer
    language  h <- layer(h, img); ht <- layer(ht); hp <- layer(hp) (eval only)   DecoderLayer
    head      FusionOutput                                     Head

``h`` is the *fused* stream (text attending to image tokens; captioning), ``ht`` the *text-only*
stream: contrastive and MML need image-independent text features, otherwise the text feature
can copy the image and the contrastive task is trivial (ALBEF's reason for a unimodal text
encoder). ``hp`` holds the class prompts ``[B, K, T_p, D]`` for zero-shot classification:
every row holds the same ``K`` prompts, so only row 0 is computed and broadcast, and only in
eval mode (training pays nothing for it). ``ids [B, T]`` are token ids, ``last [B]`` the index
of each row's last text token, ``p_ids [B, K, T_p]`` / ``p_last [B, K]`` the same for prompts.

Blocks reference the model's own modules and parameters (no copies); build them after tensor
parallelism has been applied to the model. Each has a ``kind`` (``vision``, ``aligner``,
``language``, ``head``) and :meth:`FusionBlock.cost` (see :mod:`lightning_mmpar.models.block_cost`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_mmpar.models import language as llama
from lightning_mmpar.models.adapter import AdapterMLP, CrossModalAdapter
from lightning_mmpar.models.block_cost import BlockCost, CostTally, linear_weight
from lightning_mmpar.models.heads import MomentumHeads, TextPooler
from lightning_mmpar.models.language import LanguageModel, LlamaDecoderLayer, LlamaMLP
from lightning_mmpar.models.projector import projector_linears
from lightning_mmpar.models.ragged import (
    block_causal_mask,
    image_cross_mask,
    occupied,
    on_images,
    sample_last_index,
    scatter_slots,
    splice_images,
)
from lightning_mmpar.models.vision import VisionBlock, VisionTower, embed_patches, pool_tokens

__all__ = [
    "MAX_LOGIT_SCALE",
    "AdapterLayer",
    "Bridge",
    "DecoderLayer",
    "FusionBlock",
    "FusionOutput",
    "Head",
    "RaggedStreams",
    "Streams",
    "VisionLayer",
    "VisionPool",
    "VisionStem",
    "clamp_logit_scale_",
    "owned",
]

MAX_LOGIT_SCALE = 100.0
"""CLIP's cap of the logit scale ``exp(t)``: the *parameter* ``t`` is clamped to
``[0, ln 100]`` after every optimizer step (:func:`clamp_logit_scale_`), never the output."""


@torch.no_grad()
def clamp_logit_scale_(log_scale: Tensor, max_scale: float = MAX_LOGIT_SCALE) -> Tensor:
    """Clamp the log-scale parameter ``t`` in place to ``[0, ln max_scale]``; returns it.

    CLIP and open_clip (``model.logit_scale.clamp_(0, math.log(100))`` after
    ``optimizer.step()``) clamp the parameter, not ``exp(t)``: clamping the output would give
    ``t`` a zero gradient at the cap, so a scale that reached it could never come back down.
    Call after every optimizer step on the rank that owns the parameter. A DTensor (FSDP2)
    is clamped shard by shard (an element-wise op, no communication).
    """
    return log_scale.clamp_(0.0, math.log(max_scale))


class FusionOutput(NamedTuple):
    """What the head block returns (the fusion model's output)."""

    logits: Tensor
    """``[B, T, V]`` caption logits of the fused stream (vocab-sharded DTensor under TP)."""
    image_features: Tensor
    """``[B, C]`` l2-normalised image features."""
    text_features: Tensor
    """``[B, C]`` l2-normalised text-only features (contrastive, MML, retrieval)."""
    logit_scale: Tensor
    """``[B]`` copies of ``exp(t)`` (batch-shaped so pipeline outputs can be merged); ``t`` is
    kept in ``[0, ln 100]`` by :func:`clamp_logit_scale_` after each optimizer step."""
    momentum_image: Tensor
    """``[B, C]`` EMA-head image features (no gradient)."""
    momentum_text: Tensor
    """``[B, C]`` EMA-head text features (no gradient)."""
    class_features: Tensor
    """``[K, C]`` l2-normalised class-prompt features (zeros in training mode)."""


class Streams(NamedTuple):
    """The state between the bridge and the head (every tensor batch-first)."""

    img: Tensor
    """``[B, N, D]`` projected image tokens."""
    pooled: Tensor
    """``[B, E]`` pooled image embedding."""
    h: Tensor
    """``[B, T, D]`` fused stream."""
    ht: Tensor
    """``[B, T, D]`` text-only stream."""
    last: Tensor
    """``[B]`` index of each row's last text token."""
    hp: Tensor
    """``[B, K, T_p, D]`` class-prompt stream (zeros in training mode)."""
    p_last: Tensor
    """``[B, K]`` index of each prompt's last token."""


class RaggedStreams(NamedTuple):
    """The state between the bridge and the head for a ragged batch (every tensor batch-first;
    :mod:`lightning_mmpar.models.ragged`)."""

    img: Tensor
    """``[B, I, N, D]`` projected image tokens per image slot (zeros in empty slots)."""
    pooled: Tensor
    """``[B, I, E]`` pooled image embedding per slot."""
    h: Tensor
    """``[B, T, D]`` fused stream (spliced: image tokens in place of the markers)."""
    ht: Tensor
    """``[B, T, D]`` text-only stream."""
    position_ids: Tensor
    """``[B, T]`` positions restarting at 0 per packed sample."""
    sample_ids: Tensor
    """``[B, T]`` sample index within the row, -1 on pad."""
    image_mask: Tensor
    """``[B, I]`` slot holds an image."""
    image_sample: Tensor
    """``[B, I]`` sample of each image (-1: empty slot)."""
    image_position: Tensor
    """``[B, I]`` token index of each image's marker (-1: empty slot)."""


def _ragged(x: Tensor, legacy_ndim: int) -> bool:
    """A ragged batch's state carries one more (image slot) dim than the one-image one."""
    return x.ndim == legacy_ndim + 1


def _broadcast_rows(x: Tensor, rows: int) -> Tensor:
    return x.unsqueeze(0).expand(rows, *x.shape).contiguous()


def owned(x: Tensor) -> Tensor:
    """``x``, copied when it is a view (a linear layer over a 4-d input, ``expand``,
    ``unflatten``): a block returns no view of another tensor, which FSDP2 warns "can cause
    backward to fail or produce wrong gradients" (its pre-backward hooks go on the outputs).
    The values are unchanged."""
    return x.clone() if x._base is not None else x


def _no_image(x: Tensor, img: Tensor) -> Tensor:
    """Zero image tokens ``[B, 0, D]`` for a text-only stream: the layer attends to text only
    (as without an image) and keeps its two-input signature, which sequence-parallel plans
    of joint-attention layers expect."""
    return img.new_zeros(x.shape[0], 0, img.shape[-1])


class FusionBlock(nn.Module):
    """A pipeline block: ``forward(*state) -> tuple`` plus its kind and cost."""

    kind: str = ""
    """``vision``, ``aligner``, ``language`` or ``head``."""

    def cost(self, image_tokens: int, text_length: int, *, bytes_per_element: int = 4) -> BlockCost:
        """Training FLOPs and kept activation bytes per sample, from the shapes.

        ``image_tokens`` is the number of patch tokens ``N`` (the ViT adds its class token),
        ``text_length`` the caption length ``T``; training runs the fused and the text-only
        stream (a decoder layer with ``text_stream`` off: the fused one; the prompt stream is
        eval-only and not counted).
        """
        tally = CostTally()
        self._tally(tally, image_tokens, text_length)
        return tally.result(bytes_per_element)

    def _tally(self, tally: CostTally, n: int, t: int) -> None:
        raise NotImplementedError


class VisionStem(FusionBlock):
    """Patch/class/positional embedding and ``ln_pre``."""

    kind = "vision"

    def __init__(self, vision: VisionTower) -> None:
        super().__init__()
        self.conv1, self.ln_pre = vision.conv1, vision.ln_pre
        self.class_embedding = vision.class_embedding
        self.positional_embedding = vision.positional_embedding

    def forward(self, images: Tensor, *rest: Tensor) -> tuple[Tensor, ...]:
        """``images [B, 3, H, W]``, or ragged ``pixel_values [B, I, 3, H, W]`` with
        ``image_mask`` next (the occupied slots embedded as one batch)."""
        if _ragged(images, 4):
            return (on_images(self._embed, images, rest[0]), *rest)
        return (self._embed(images), *rest)

    def _embed(self, images: Tensor) -> Tensor:
        return embed_patches(
            images, self.conv1, self.class_embedding, self.positional_embedding, self.ln_pre
        )

    def _tally(self, tally: CostTally, n: int, t: int) -> None:
        w = self.conv1.weight  # [W, 3, p, p]: a [3 p p] -> [W] product per patch
        tally.matmul(n, w[0].numel(), w.shape[0], train=w.requires_grad)
        if isinstance(self.ln_pre, nn.LayerNorm):
            tally.keep((n + 1) * w.shape[0])


class VisionLayer(FusionBlock):
    """One ViT residual block on ``x_v``."""

    kind = "vision"

    def __init__(self, block: VisionBlock) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: Tensor, *rest: Tensor) -> tuple[Tensor, ...]:
        if _ragged(x, 3):  # [B, I, V, W]: the occupied slots as one batch
            return (on_images(self.block, x, rest[0]), *rest)
        return (self.block(x), *rest)

    def _tally(self, tally: CostTally, n: int, t: int) -> None:
        b, v = self.block, n + 1
        qkv = b.attn.in_proj.weight  # [3, W, W]
        width = qkv.shape[1]
        tally.keep(v * width)  # ln_1
        tally.matmul(v, qkv.shape[2], 3 * width, train=qkv.requires_grad)
        tally.attention(v, v, width)
        tally.linear(v, b.attn.out_proj)
        tally.keep(v * width)  # ln_2
        fc, proj = b.mlp.get_submodule("c_fc"), b.mlp.get_submodule("c_proj")
        tally.linear(v, fc)
        tally.keep(v * linear_weight(fc).shape[0])  # activation function
        tally.linear(v, proj)


class VisionPool(FusionBlock):
    """``ln_post``, pooling and ``proj``: patch tokens and the pooled image embedding."""

    kind = "vision"

    def __init__(self, vision: VisionTower) -> None:
        super().__init__()
        self.ln_post, self.proj = vision.ln_post, vision.proj
        self.config = vision.config

    def forward(self, x: Tensor, *rest: Tensor) -> tuple[Tensor, ...]:
        if _ragged(x, 3):
            mask = rest[0]
            sel, dummy = occupied(x, mask)
            pooled, tokens = pool_tokens(sel, self.ln_post, self.proj, self.config)
            return (scatter_slots(tokens, mask, dummy), scatter_slots(pooled, mask, dummy), *rest)
        pooled, tokens = pool_tokens(x, self.ln_post, self.proj, self.config)
        return (owned(tokens), owned(pooled), *rest)

    def _tally(self, tally: CostTally, n: int, t: int) -> None:
        width, out = self.proj.shape
        tally.keep((1 if self.config.final_ln_after_pool else n + 1) * width)  # ln_post
        tally.matmul(1, width, out, train=self.proj.requires_grad)


class Bridge(FusionBlock):
    """``img = projector(tok_v)``; the fused and text-only streams start from ``embed(ids)``;
    in eval mode the prompt stream starts from ``embed(p_ids[0])``."""

    kind = "aligner"

    def __init__(
        self,
        projector: nn.Module,
        embed_tokens: nn.Embedding,
        *,
        image_token_id: int | None = None,
    ) -> None:
        super().__init__()
        self.projector, self.embed_tokens = projector, embed_tokens
        self.image_token_id = image_token_id
        """Spliced fusion of ragged batches: the id whose embeddings image tokens replace
        (``None``: cross-attention fusion, markers stay text tokens)."""

    def forward(self, tokens: Tensor, pooled: Tensor, *rest: Tensor) -> tuple[Tensor, ...]:
        if _ragged(tokens, 3):
            return self._ragged(tokens, pooled, *rest)
        return self._one_image(tokens, pooled, *rest)

    def _ragged(
        self,
        tokens: Tensor,
        pooled: Tensor,
        image_mask: Tensor,
        ids: Tensor,
        position_ids: Tensor,
        sample_ids: Tensor,
        image_sample: Tensor,
        image_position: Tensor,
    ) -> tuple[Tensor, ...]:
        img = owned(self.projector(tokens))
        ht = self.embed_tokens(ids)
        h = ht
        if self.image_token_id is not None:
            if ht.shape[1] != ids.shape[1]:
                raise ValueError(
                    "spliced fusion (FusionConfig.fusion='spliced') does not run under sequence "
                    "parallelism: the embedding output is a sequence shard; set "
                    "sequence_parallel=False or use fusion='cross_attention'."
                )
            h = splice_images(ht, ids, img, image_mask, self.image_token_id)
        else:
            h = ht.clone()
        streams = RaggedStreams(
            img, pooled, h, ht, position_ids, sample_ids, image_mask, image_sample, image_position
        )
        return tuple(streams)

    def _one_image(
        self,
        tokens: Tensor,
        pooled: Tensor,
        ids: Tensor,
        last: Tensor,
        p_ids: Tensor,
        p_last: Tensor,
    ) -> tuple[Tensor, ...]:
        h = self.embed_tokens(ids)
        if self.training:
            hp = h.new_zeros(*p_ids.shape, h.shape[-1])
        else:
            hp = _broadcast_rows(self.embed_tokens(p_ids[0]), p_ids.shape[0])
        img = owned(self.projector(tokens))
        return tuple(Streams(img, pooled, h, h.clone(), last, hp, p_last))

    def _tally(self, tally: CostTally, n: int, t: int) -> None:
        for i, layer in enumerate(projector_linears(self.projector)):  # embedding: a gather
            if i:
                tally.keep(n * linear_weight(layer).shape[1])  # the MLP's activation
            tally.linear(n, layer)


class AdapterLayer(FusionBlock):
    """One cross-modal adapter on the fused stream only."""

    kind = "aligner"

    def __init__(self, adapter: CrossModalAdapter) -> None:
        super().__init__()
        self.adapter = adapter

    def forward(self, *state: Tensor) -> tuple[Tensor, ...]:
        if _ragged(state[0], 3):
            return self._ragged(RaggedStreams(*state))
        s = Streams(*state)
        pad = llama.padding_after(s.last, s.h.shape[1])  # used by an MoE FFN only
        return tuple(s._replace(h=self.adapter(s.h, s.img, pad)))

    def _ragged(self, s: RaggedStreams) -> tuple[Tensor, ...]:
        """Each text token attends to its own sample's images at or before it."""
        n = s.img.shape[2]
        mask = image_cross_mask(s.sample_ids, s.image_mask, s.image_sample, s.image_position, n)
        h = self.adapter(s.h, s.img.flatten(1, 2), s.sample_ids < 0, attn_mask=mask)
        return tuple(s._replace(h=h))

    def _tally(self, tally: CostTally, n: int, t: int) -> None:
        a = self.adapter
        dim, width = a.attn.q_proj.weight.shape[1], a.attn.q_proj.weight.shape[0]
        tally.keep((t + n) * dim)  # norm_q (text), norm_kv (image)
        tally.linear(t, a.attn.q_proj)
        tally.linear(n, a.attn.k_proj)
        tally.linear(n, a.attn.v_proj)
        tally.attention(t, n, width)
        tally.linear(t, a.attn.o_proj)
        tally.keep(t * dim)  # norm_ffn
        if a.moe is not None:
            tally.moe(t, dim, a.moe.config, train=a.moe.experts.w_gate.requires_grad)
            return
        assert isinstance(a.mlp, AdapterMLP)
        tally.linear(t, a.mlp.fc1)
        tally.keep(t * a.mlp.fc1.weight.shape[0])  # GELU
        tally.linear(t, a.mlp.fc2)


class DecoderLayer(FusionBlock):
    """One LLaMA layer on every stream: fused (with ``img`` under joint attention), text-only,
    and in eval mode the class prompts. ``text_stream=False`` passes the text-only stream
    through unchanged (a dense layer; :attr:`FusionModel.text_stream`)."""

    kind = "language"

    def __init__(self, layer: LlamaDecoderLayer, *, text_stream: bool = True) -> None:
        super().__init__()
        self.layer = layer
        self.text_stream = text_stream

    def _text(self, ht: Tensor, run: Callable[[], Tensor]) -> Tensor:
        """The text-only stream after this layer: ``run()``, or ``ht`` when it is off."""
        return run() if self.text_stream else ht

    def forward(self, *state: Tensor) -> tuple[Tensor, ...]:
        if _ragged(state[0], 3):
            return self._ragged(RaggedStreams(*state))
        s = Streams(*state)
        hp = s.hp
        if not self.training:
            prompts = hp[0]
            pad = llama.padding_after(s.p_last[0], prompts.shape[1])
            hp = _broadcast_rows(self.layer(prompts, _no_image(prompts, s.img), pad), hp.shape[0])
        if self.layer.moe is not None:
            pad = llama.padding_after(s.last, s.h.shape[1])
            img, h, ht = llama.moe_streams(self.layer, s.img, s.h, s.ht, pad)
            return tuple(s._replace(img=img, h=h, ht=ht, hp=hp))
        fused = self.layer(s.h, s.img)
        ht = self._text(s.ht, lambda: self.layer(s.ht, _no_image(s.ht, s.img)))
        return tuple(s._replace(h=fused, ht=ht, hp=hp))

    def _ragged(self, s: RaggedStreams) -> tuple[Tensor, ...]:
        """Block-diagonal causal attention over the packed samples, per-sample positions.

        Joint attention: the fused stream's keys are ``[image tokens of every slot; text]``,
        a text token sees its own sample's images at or before it; each image's tokens sit at
        RoPE positions ``0 .. N-1`` and the text at ``N + position_ids`` (the one-image
        layout, image before text). The text-only stream sees text only (positions from 0)."""
        causal = block_causal_mask(s.sample_ids)
        text_kw = {"attn_mask": causal, "position_ids": s.position_ids}
        fused_kw, img = text_kw, s.img.flatten(1, 2)
        b, i, n = s.img.shape[:3]
        if self.layer.image_norm is not None:
            cross = image_cross_mask(
                s.sample_ids, s.image_mask, s.image_sample, s.image_position, n
            )
            fused_kw = {
                "attn_mask": torch.cat([cross, causal], dim=-1),
                "position_ids": s.position_ids + n,
                "image_position_ids": torch.arange(n, device=img.device).repeat(i),
            }
        pad = s.sample_ids < 0
        if self.layer.moe is not None:
            image_pad = (~s.image_mask).repeat_interleave(n, dim=1)
            img, h, ht = llama.moe_streams(
                self.layer,
                img,
                s.h,
                s.ht,
                pad,
                fused_packed=fused_kw,
                text_packed=text_kw,
                image_padding=image_pad,
            )
            return tuple(s._replace(img=owned(img.unflatten(1, (i, n))), h=h, ht=ht))
        h = self.layer(s.h, img, None, **fused_kw)
        none = img.new_zeros(b, 0, img.shape[-1])
        ht = self._text(s.ht, lambda: self.layer(s.ht, none, None, **text_kw))
        return tuple(s._replace(h=h, ht=ht))

    def _tally(self, tally: CostTally, n: int, t: int) -> None:
        joint = self.layer.image_norm is not None
        text = self.text_stream or self.layer.moe is not None
        for image_tokens in (n if joint else 0, 0)[: 2 if text else 1]:  # fused, text-only
            self._stream(tally, t, image_tokens)

    def _stream(self, tally: CostTally, t: int, n: int) -> None:
        attn, mlp = self.layer.self_attn, self.layer.mlp
        dim, width = attn.q_proj.weight.shape[1], attn.q_proj.weight.shape[0]
        tally.keep(t * dim)  # input_layernorm
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            tally.linear(t, proj)
        if n:
            tally.keep(n * dim)  # image_norm
            tally.linear(n, attn.k_proj)
            tally.linear(n, attn.v_proj)
        tally.attention(t, t + n, width)
        tally.linear(t, attn.o_proj)
        tally.keep(t * dim)  # post_attention_layernorm
        moe = self.layer.moe
        if moe is None:
            assert isinstance(mlp, LlamaMLP)
            tally.linear(t, mlp.gate_proj)
            tally.linear(t, mlp.up_proj)
            tally.keep(2 * t * mlp.gate_proj.weight.shape[0])  # SiLU input, up-projection
            tally.linear(t, mlp.down_proj)
            return
        train = moe.experts.w_gate.requires_grad  # image tokens routed too under joint attention
        tally.moe(t + n, dim, moe.config, train=train)


class Head(FusionBlock):
    """Final norm, LM head, the contrastive heads and their EMA copies (``momentum``)."""

    kind = "head"

    def __init__(
        self,
        *,
        language: LanguageModel,
        image_head: nn.Linear,
        text_head: TextPooler,
        logit_scale: nn.Parameter,
        momentum: MomentumHeads,
    ) -> None:
        super().__init__()
        self.norm, self.lm_head = language.norm, language.lm_head
        self.image_head, self.text_head = image_head, text_head
        self.logit_scale = logit_scale
        self.momentum = momentum

    def forward(self, *state: Tensor) -> tuple[Tensor, ...]:
        """A plain tuple in :class:`FusionOutput` order (pipeline stages reject NamedTuples)."""
        if _ragged(state[0], 3):
            return self._ragged(RaggedStreams(*state))
        s = Streams(*state)
        text_embed, text = self.text_head(self.norm(s.ht), s.last)
        m_img, m_txt = self.momentum(s.pooled, text_embed)
        if self.training:
            classes = s.pooled.new_zeros(s.hp.shape[1], m_img.shape[-1])
        else:
            classes = F.normalize(self.text_head(self.norm(s.hp[0]), s.p_last[0])[1], dim=-1)
        return self._output(s.h, s.pooled, text, (m_img, m_txt), classes)

    def _ragged(self, s: RaggedStreams) -> tuple[Tensor, ...]:
        """Features per image slot ``[B, I, C]``: the slot's image and its sample's text (the
        text-only stream at the sample's last token); zeros for empty slots' images."""
        last = sample_last_index(s.sample_ids, s.image_sample)
        text_embed, text = self.text_head(self.norm(s.ht), last)
        m_img, m_txt = self.momentum(s.pooled, text_embed)
        classes = s.pooled.new_zeros(1, m_img.shape[-1])
        return self._output(s.h, s.pooled, text, (m_img, m_txt), classes)

    def _output(
        self,
        h: Tensor,
        pooled: Tensor,
        text: Tensor,
        momentum: tuple[Tensor, Tensor],
        classes: Tensor,
    ) -> tuple[Tensor, ...]:
        """The heads on the fused stream ``h``, the pooled images and the pooled text: a plain
        tuple in :class:`FusionOutput` order (one-image and ragged batches alike)."""
        scale = self.logit_scale.exp()  # clamped as a parameter after each optimizer step
        return tuple(
            FusionOutput(
                logits=self.lm_head(self.norm(h)),
                image_features=F.normalize(self.image_head(pooled), dim=-1),
                text_features=F.normalize(text, dim=-1),
                logit_scale=owned(scale.expand(h.shape[0])),
                momentum_image=momentum[0],
                momentum_text=momentum[1],
                class_features=classes,
            )
        )

    def ema_update(self) -> None:
        """One EMA step of the momentum heads towards the live heads."""
        self.momentum.update(self.image_head, self.text_head.proj)

    def after_optimizer_step(self) -> None:
        """What follows every optimizer step (not every batch: with gradient accumulation
        ``k`` a per-batch update would make the EMA momentum ``m^k``): clamp the logit scale
        (:func:`clamp_logit_scale_`), then one EMA step of the momentum heads."""
        clamp_logit_scale_(self.logit_scale)
        self.ema_update()

    def _tally(self, tally: CostTally, n: int, t: int) -> None:
        tally.keep(2 * t * self.lm_head.weight.shape[1])  # final norm of h and ht
        tally.linear(t, self.lm_head)
        tally.linear(1, self.image_head)
        tally.linear(1, self.text_head.proj)
        tally.linear(1, self.momentum.image_head, grad=False)
        tally.linear(1, self.momentum.text_head, grad=False)
