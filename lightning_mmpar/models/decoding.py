"""Incremental (KV-cached) decoding of the fusion model's caption stream and of the LLaMA tower.

Greedy captioning reads the logits of the *fused* stream only (``Head``: ``lm_head(norm(h))``);
the text-only and class-prompt streams, the pooled embedding and the contrastive heads do not
take part. A cached decode therefore runs, per generated token:

* the ViT, the bridge's projector and every decoder layer's image keys/values **once** (the
  prefill step: the image tokens ``img [B, N, D]`` and, under joint attention, the rotated and
  temperature-scaled image keys are stored);
* the new token's embedding, the adapters (cross-attention of that token over the image keys
  and values, kept from the prefill), each
  decoder layer's attention of the new query over the cached ``[image; text]`` keys and values
  (the new key/value appended), its feed-forward, the final norm and ``lm_head``.

This is the Transformer decoder's key/value cache (Vaswani et al. 2017; as in transformers'
``DynamicCache``, ``LlamaForCausalLM.generate(use_cache=True)``). The math is
:class:`~lightning_mmpar.models.language.LlamaAttention`'s with the queries restricted to the new
positions: RoPE at absolute positions (image tokens at ``0..N-1``, text after them under joint
attention), key rows scaled by their modality's temperature, GQA by repetition. Heads are read
from the projection widths, so a tensor-parallel head shard caches its own heads only (the
``o_proj`` row-parallel reduction is the projection's own, as in a full forward).

Each pipeline block has a decode counterpart (:func:`decode_block`) on a small state:
``(images,)`` -> ``(x_v,)`` (vision) -> ``(tokens,)`` (pool) -> ``(h, img)`` (bridge, prefill) or
``(h,)`` (later steps) -> ``(logits,)`` (head), so a pipeline stage sends only the new token's
hidden state after the prefill. Not supported (:func:`check_cacheable` says why): mixture-of-
experts feed-forward layers (routing capacity couples the tokens of a batch) and dropout in
training mode.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_mmpar.models.adapter import CrossModalAdapter
from lightning_mmpar.models.blocks import (
    AdapterLayer,
    Bridge,
    DecoderLayer,
    Head,
    VisionLayer,
    VisionPool,
    VisionStem,
)
from lightning_mmpar.models.language import (
    LanguageModel,
    LlamaAttention,
    LlamaDecoderLayer,
    apply_rope,
    rope_cos_sin,
)
from lightning_mmpar.models.moe import MoEFeedForward

__all__ = [
    "DecodeCache",
    "LayerCache",
    "cached_adapter",
    "cached_attention",
    "cached_decoder_layer",
    "check_cacheable",
    "decode_block",
    "language_decode_step",
]


@dataclass
class LayerCache:
    """One attention layer's cache: ``keys, values [B, H_kv_local, n_image + S, d]`` (keys
    rotated and temperature-scaled, not yet repeated for GQA)."""

    keys: Tensor | None = None
    values: Tensor | None = None
    n_image: int = 0
    """Image key columns at the front (joint attention), fixed at the prefill."""

    @property
    def text_length(self) -> int:
        """Text positions cached so far."""
        return 0 if self.keys is None else self.keys.shape[2] - self.n_image


@dataclass
class DecodeCache:
    """Everything a decode step reuses: per-layer key/value caches (keyed by the layer's
    ``id``, so one cache serves any subset of blocks: a pipeline stage's), the image tokens
    ``img [B, N, D]`` and the number of text tokens already decoded (``length``)."""

    layers: dict[int, LayerCache] = field(default_factory=dict)
    img: Tensor | None = None
    length: int = 0
    steps: int = 0
    """Decode steps taken (0 before the prefill)."""

    def advance(self, new_tokens: int) -> None:
        """End of a decode step of ``new_tokens`` tokens (every pipeline rank calls it)."""
        self.length += new_tokens
        self.steps += 1

    def layer(self, module: nn.Module) -> LayerCache:
        """The cache of ``module`` (created empty on first use)."""
        return self.layers.setdefault(id(module), LayerCache())


def check_cacheable(blocks: list[nn.Module]) -> str | None:
    """Why ``blocks`` cannot be decoded with a cache (``None``: they can).

    Mixture-of-experts layers are refused: their token capacity and routing depend on every
    token of a batch, so one token at a time can route differently from the full forward.
    """
    for block in blocks:
        for m in block.modules():
            if isinstance(m, MoEFeedForward):
                return "a mixture-of-experts layer (routing couples the tokens of a batch)"
    return None


def _heads(x: Tensor, head_dim: int) -> Tensor:
    return x.unflatten(-1, (-1, head_dim)).transpose(1, 2)


def cached_attention(
    attn: LlamaAttention, x: Tensor, cache: LayerCache, image: Tensor | None = None
) -> Tensor:
    """``attn``'s output for the new positions ``x [B, S, D]`` (already normed) given the
    cached ones; ``image [B, N, D]`` (normed) on the first call only, under joint attention.

    Equals the last ``S`` rows of ``attn(x_all, image)`` for the whole prefix ``x_all`` (same
    RoPE angles, temperature and causal mask); the new keys/values are appended to ``cache``.
    """
    hd = attn.head_dim
    q, k, v = _heads(attn.q_proj(x), hd), _heads(attn.k_proj(x), hd), _heads(attn.v_proj(x), hd)
    joint = attn.temperature is not None
    if cache.keys is None and joint and image is not None:
        cache.n_image = image.shape[1]
    n_image, start, s = cache.n_image, cache.text_length, x.shape[1]
    if cache.keys is None and n_image:
        assert image is not None and attn.temperature is not None
        cos, sin = rope_cos_sin(
            torch.arange(n_image, device=x.device), hd, attn.rope_theta, q.dtype
        )
        keys = apply_rope(_heads(attn.k_proj(image), hd), cos, sin)
        cache.keys = attn.temperature(keys, n_image)  # the module: its TP hooks apply
        cache.values = _heads(attn.v_proj(image), hd)
    pos = torch.arange(n_image + start, n_image + start + s, device=x.device)
    cos, sin = rope_cos_sin(pos, hd, attn.rope_theta, q.dtype)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if attn.temperature is not None:
        k = attn.temperature(k, 0)  # text key rows
    if cache.keys is None:
        cache.keys, cache.values = k, v
    else:
        assert cache.values is not None
        cache.keys = torch.cat([cache.keys, k], dim=2)
        cache.values = torch.cat([cache.values, v], dim=2)
    keys = cache.keys.repeat_interleave(attn.groups, dim=1)
    values = cache.values.repeat_interleave(attn.groups, dim=1)  # type: ignore[union-attr]
    mask = None
    if s > 1:  # causal among the new text positions; all earlier keys visible
        total = keys.shape[2]
        cols = torch.arange(total, device=x.device)[None, :]
        mask = cols <= (total - s + torch.arange(s, device=x.device))[:, None]
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    return attn.o_proj(out.transpose(1, 2).flatten(2))  # type: ignore[no-any-return]


def cached_adapter(
    adapter: CrossModalAdapter, h: Tensor, cache: LayerCache, image: Tensor
) -> Tensor:
    """:class:`~lightning_mmpar.models.adapter.CrossModalAdapter` on the new positions
    ``h [B, S, D]``: the image keys and values ``k, v = norm_kv(img) W_k^T, W_v^T`` are computed
    at the first call and kept in ``cache`` (cross-attention: no text keys, no mask)."""
    if adapter.moe is not None:
        raise ValueError(
            "cached decoding of a mixture-of-experts adapter is not supported; decode without "
            "the cache (use_cache=False)."
        )
    attn, hd = adapter.attn, adapter.attn.head_dim
    if cache.keys is None:
        kv = adapter.norm_kv(image)
        cache.keys, cache.values = _heads(attn.k_proj(kv), hd), _heads(attn.v_proj(kv), hd)
        cache.n_image = image.shape[1]
    q = _heads(attn.q_proj(adapter.norm_q(h)), hd)
    assert cache.values is not None
    out = F.scaled_dot_product_attention(q, cache.keys, cache.values)
    h = h + adapter.attn_gate(adapter.dropout(attn.o_proj(out.transpose(1, 2).flatten(2))))
    return h + adapter.ffn_gate(adapter.dropout(adapter.mlp(adapter.norm_ffn(h))))  # type: ignore[no-any-return]


def cached_decoder_layer(
    layer: LlamaDecoderLayer, x: Tensor, cache: LayerCache, image: Tensor | None = None
) -> Tensor:
    """:class:`LlamaDecoderLayer` on the new positions ``x [B, S, D]`` with ``cache``;
    ``image [B, N, D]`` (joint attention keys, un-normed) needed on the first call only."""
    if layer.moe is not None:
        raise ValueError(
            "cached decoding of a mixture-of-experts decoder layer is not supported; decode "
            "without the cache (use_cache=False)."
        )
    img = None
    if layer.image_norm is not None and image is not None:
        img = layer.image_norm(image)
    h = x + cached_attention(layer.self_attn, layer.input_layernorm(x), cache, img)
    return h + layer.mlp(layer.post_attention_layernorm(h))  # type: ignore[no-any-return]


def language_decode_step(model: LanguageModel, ids: Tensor, cache: DecodeCache) -> Tensor:
    """Logits ``[B, S, V]`` of the new tokens ``ids [B, S]`` of a text-only LLaMA decode
    (``LlamaForCausalLM`` with ``use_cache=True``); ``cache.length`` advances by ``S``."""
    h = model.embed_tokens(ids)
    for layer in model.layers:
        assert isinstance(layer, LlamaDecoderLayer)
        h = cached_decoder_layer(layer, h, cache.layer(layer))
    cache.advance(ids.shape[1])
    return model.lm_head(model.norm(h))  # type: ignore[no-any-return]


def decode_block(
    block: nn.Module, state: tuple[Tensor, ...], ids: Tensor, cache: DecodeCache
) -> tuple[Tensor, ...]:
    """One pipeline block's decode step on the small decode state (module docstring).

    ``ids [B, S]`` are the step's new token ids (every stage knows them); ``state`` is what the
    previous block returned (``(images,)`` into block 0 at the prefill, ``()`` into the vision
    blocks afterwards: they are skipped). Call this rank's blocks in order, then
    :meth:`DecodeCache.advance` once per step.

    Raises:
        TypeError: ``block`` is not one of the fusion model's pipeline blocks.
    """
    prefill = cache.steps == 0
    if isinstance(block, (VisionStem, VisionLayer, VisionPool)):
        if not prefill:
            return ()
        out = block(*state)
        return out[:1]  # patch tokens only (VisionPool: (tokens, pooled, ...))
    if isinstance(block, Bridge):
        h = block.embed_tokens(ids)
        if prefill:
            cache.img = block.projector(state[0])
            return (h, cache.img)
        return (h,)
    h = state[0]
    if len(state) > 1:  # the prefill carries the image tokens to every later stage
        cache.img = state[1]
    img = cache.img
    assert img is not None, "the prefill step carries the image tokens"
    if isinstance(block, AdapterLayer):
        h = cached_adapter(block.adapter, h, cache.layer(block.adapter), img)
    elif isinstance(block, DecoderLayer):
        h = cached_decoder_layer(block.layer, h, cache.layer(block.layer), img)
    elif isinstance(block, Head):
        return (block.lm_head(block.norm(h)),)
    else:
        raise TypeError(f"decode_block: {type(block).__name__} is not a fusion pipeline block.")
    return (h, img) if len(state) > 1 else (h,)
