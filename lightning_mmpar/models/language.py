"""Language tower: a LLaMA decoder with transformers' math (RMSNorm, RoPE, GQA, SwiGLU).

Module names follow ``LlamaForCausalLM`` without the ``model.`` prefix (``embed_tokens``,
``layers.N.self_attn.q_proj``, ..., ``norm``, ``lm_head``); ``convert.py`` maps the keys.

Optional joint attention (this package's option): text queries attend over ``[image; text]``
keys, image keys and values coming from the projected image tokens through the same
``k_proj``/``v_proj``. Each key column is scaled by its modality's temperature,
``softmax(q k_j^T / sqrt(d) * t_{m(j)})``, which equals scaling the key rows
``k_j <- t_{m(j)} k_j`` before a plain softmax attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_mmpar.models.moe import MoEFeedForward
from lightning_mmpar.models.moe_routing import MoEConfig


@dataclass(kw_only=True)
class LanguageConfig:
    """Shape of the LLaMA decoder, in ``LlamaConfig`` vocabulary."""

    vocab_size: int = 32000
    """Vocabulary size (rows of ``embed_tokens`` and ``lm_head``)."""
    hidden_size: int = 4096
    """Model width ``D``."""
    intermediate_size: int = 11008
    """SwiGLU inner width."""
    num_hidden_layers: int = 32
    """Decoder layers."""
    num_attention_heads: int = 32
    """Query heads."""
    num_key_value_heads: int = 32
    """Key/value heads (GQA); must divide ``num_attention_heads``."""
    head_dim: int | None = None
    """Per-head width; default ``hidden_size // num_attention_heads``."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """RoPE base."""
    attention_bias: bool = False
    """Biases on q/k/v/o projections."""
    mlp_bias: bool = False
    """Biases on the SwiGLU projections."""
    joint_attention: bool = False
    """Let text queries also attend to the image tokens (keys ``[image; text]``)."""
    image_temperature: float = 1.0
    """Logit scale of image key columns in joint attention."""
    text_temperature: float = 0.7
    """Logit scale of text key columns in joint attention (1.0 reproduces plain LLaMA)."""
    learnable_temperature: bool = False
    """Train the two temperatures (one pair per layer)."""
    moe: MoEConfig | None = None
    """Mixture-of-experts feed-forward layers: ``None`` keeps every FFN dense;
    else the FFN of every ``moe_layer_freq``-th layer is a :class:`MoEFeedForward` with this
    config (its ``modalities`` must include ``"text"``; ``"vision"`` routes the image tokens under
    joint attention)."""
    moe_layer_freq: int = 1
    """With ``moe``: layer ``i`` is MoE when ``i % moe_layer_freq == 0`` (Megatron-core's
    ``moe_layer_freq``; 1 = every layer, 2 = layers 0, 2, 4, ...)."""

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"LanguageConfig.num_attention_heads ({self.num_attention_heads}) must be "
                f"divisible by num_key_value_heads ({self.num_key_value_heads})."
            )
        if isinstance(self.moe_layer_freq, bool) or not (
            isinstance(self.moe_layer_freq, int) and self.moe_layer_freq >= 1
        ):
            raise ValueError(
                f"LanguageConfig.moe_layer_freq ({self.moe_layer_freq!r}) must be an integer >= "
                "1; use 1 for MoE in every layer, 2 for every other layer."
            )
        if self.moe is not None and "text" not in self.moe.modalities:
            raise ValueError(
                f"LanguageConfig.moe.modalities ({self.moe.modalities!r}) must include 'text': "
                "the decoder routes its text tokens with the 'text' router."
            )

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder layer ``index`` has a mixture-of-experts FFN."""
        return self.moe is not None and index % self.moe_layer_freq == 0

    @property
    def dim_per_head(self) -> int:
        """Resolved per-head width."""
        return self.head_dim or self.hidden_size // self.num_attention_heads


class RMSNorm(nn.Module):
    """``y = w * x / sqrt(mean(x^2) + eps)``, computed in float32 (LlamaRMSNorm)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_cos_sin(
    positions: Tensor, dim: int, theta: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """Llama default RoPE: ``inv_freq = theta^(-2i/d)``, angles duplicated over both halves."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x cos + rotate_half(x) sin`` on ``[B, H, S, d]`` with ``cos, sin`` of ``[S, d]``."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def joint_attention_mask(n_image: int, n_text: int, device: torch.device) -> Tensor:
    """Boolean ``[T, N + T]``: every image key, causal over text keys."""
    text = torch.ones(n_text, n_text, dtype=torch.bool, device=device).tril()
    image = torch.ones(n_text, n_image, dtype=torch.bool, device=device)
    return torch.cat([image, text], dim=1)


class ModalityTemperature(nn.Module):
    """Per-key-modality logit scale: ``k_j <- t_img k_j`` (image keys), ``t_txt k_j`` (text).

    ``temperature = [t_img, t_txt]``; scaling key rows scales the logit columns exactly as
    ``q k^T / sqrt(d) * t``. Input ``k`` is ``[B, H, N + T, d]`` with the image keys first.
    """

    def __init__(self, image: float, text: float, learnable: bool) -> None:
        super().__init__()
        self.temperature = nn.Parameter(torch.tensor([image, text]), requires_grad=learnable)

    def forward(self, k: Tensor, n_image: int) -> Tensor:
        if n_image == 0:  # text keys only (no zero-size slice: a DTensor gradient rejects it)
            return k * self.temperature[1:].to(k.dtype)
        n_text = k.shape[-2] - n_image
        scale = torch.cat(
            [self.temperature[:1].expand(n_image), self.temperature[1:].expand(n_text)]
        )
        return k * scale[:, None].to(k.dtype)


class LlamaAttention(nn.Module):
    """GQA self-attention with RoPE; optional joint attention over ``[image; text]`` keys.

    ``q = x W_q^T`` (``H`` heads), ``k, v`` with ``H_kv`` heads repeated ``H / H_kv`` times,
    causal softmax, ``y = o W_o^T``. Local head counts come from the projection widths, so the
    module runs unchanged on head shards.
    """

    def __init__(self, config: LanguageConfig) -> None:
        super().__init__()
        d, hd, bias = config.hidden_size, config.dim_per_head, config.attention_bias
        self.head_dim = hd
        self.rope_theta = config.rope_theta
        self.groups = config.num_attention_heads // config.num_key_value_heads
        self.q_proj = nn.Linear(d, config.num_attention_heads * hd, bias=bias)
        self.k_proj = nn.Linear(d, config.num_key_value_heads * hd, bias=bias)
        self.v_proj = nn.Linear(d, config.num_key_value_heads * hd, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * hd, d, bias=bias)
        self.temperature: ModalityTemperature | None = None
        if config.joint_attention:
            self.temperature = ModalityTemperature(
                config.image_temperature, config.text_temperature, config.learnable_temperature
            )

    def _heads(self, x: Tensor) -> Tensor:
        return x.unflatten(-1, (-1, self.head_dim)).transpose(1, 2)

    def forward(
        self,
        x: Tensor,
        image: Tensor | None = None,
        *,
        attn_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        image_position_ids: Tensor | None = None,
    ) -> Tensor:
        """``x [B, T, D]`` -> ``[B, T, D]``. A packed (ragged) batch passes ``attn_mask`` (bool,
        True = attend) ``[B, 1, T, N + T]`` over ``[image; text]`` keys (``N`` = image tokens
        of ``image``, 0 without joint attention): block-diagonal causal over text, each
        sample's own images; ``position_ids [B, T]`` (RoPE positions of the text) and
        ``image_position_ids [N]`` (of the image keys)."""
        if attn_mask is not None:
            return self._packed(x, image, attn_mask, position_ids, image_position_ids)
        q, k, v = (
            self._heads(self.q_proj(x)),
            self._heads(self.k_proj(x)),
            self._heads(self.v_proj(x)),
        )
        n_text = x.shape[1]
        n_image = 0 if image is None or self.temperature is None else image.shape[1]
        pos = torch.arange(n_image + n_text, device=q.device)
        cos, sin = rope_cos_sin(pos, self.head_dim, self.rope_theta, q.dtype)
        q = apply_rope(q, cos[n_image:], sin[n_image:])
        if n_image:
            assert image is not None and self.temperature is not None
            k = torch.cat([self._heads(self.k_proj(image)), k], dim=2)
            v = torch.cat([self._heads(self.v_proj(image)), v], dim=2)
        k = apply_rope(k, cos, sin)
        if self.temperature is not None:
            k = self.temperature(k, n_image)
        k = k.repeat_interleave(self.groups, dim=1)
        v = v.repeat_interleave(self.groups, dim=1)
        if n_image:
            mask = joint_attention_mask(n_image, n_text, q.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).flatten(2))

    def _packed(
        self,
        x: Tensor,
        image: Tensor | None,
        attn_mask: Tensor,
        position_ids: Tensor | None,
        image_position_ids: Tensor | None,
    ) -> Tensor:
        """Self-attention over packed samples (see :meth:`forward`)."""
        q, k, v = (
            self._heads(self.q_proj(x)),
            self._heads(self.k_proj(x)),
            self._heads(self.v_proj(x)),
        )
        b, t = x.shape[:2]
        if position_ids is None:
            position_ids = torch.arange(t, device=x.device).expand(b, t)
        cos, sin = rope_cos_sin(position_ids.reshape(-1), self.head_dim, self.rope_theta, q.dtype)
        cos, sin = cos.view(b, 1, t, -1), sin.view(b, 1, t, -1)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        n_image = 0 if image is None or self.temperature is None else image.shape[1]
        if n_image:
            assert image is not None and image_position_ids is not None
            ci, si = rope_cos_sin(image_position_ids, self.head_dim, self.rope_theta, q.dtype)
            k = torch.cat([apply_rope(self._heads(self.k_proj(image)), ci, si), k], dim=2)
            v = torch.cat([self._heads(self.v_proj(image)), v], dim=2)
        if self.temperature is not None:
            k = self.temperature(k, n_image)
        k = k.repeat_interleave(self.groups, dim=1)
        v = v.repeat_interleave(self.groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.o_proj(out.transpose(1, 2).flatten(2))


class LlamaMLP(nn.Module):
    """SwiGLU: ``y = (silu(x W_g^T) * x W_u^T) W_d^T``."""

    def __init__(self, config: LanguageConfig) -> None:
        super().__init__()
        d, f, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(d, f, bias=bias)
        self.up_proj = nn.Linear(d, f, bias=bias)
        self.down_proj = nn.Linear(f, d, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """``h = x + attn(norm_1 x [, image_norm img])``; ``y = h + mlp(norm_2 h)``.

    ``mlp`` is a SwiGLU :class:`LlamaMLP`, or a :class:`MoEFeedForward` when ``moe`` is True
    (its aux losses reach the parameters through the backward pass: ``attach_aux_loss``).
    """

    def __init__(self, config: LanguageConfig, *, moe: bool = False) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp: LlamaMLP | MoEFeedForward
        if moe:
            assert config.moe is not None
            self.mlp = MoEFeedForward(config.hidden_size, config.moe, attach_aux_loss=True)
        else:
            self.mlp = LlamaMLP(config)
        self.image_norm: RMSNorm | None = None
        if config.joint_attention:
            self.image_norm = RMSNorm(config.hidden_size, eps)

    @property
    def moe(self) -> MoEFeedForward | None:
        """The mixture-of-experts FFN, or ``None`` for a dense layer."""
        return self.mlp if isinstance(self.mlp, MoEFeedForward) else None

    def attend(self, x: Tensor, image: Tensor | None = None, **packed: Tensor | None) -> Tensor:
        """The attention half: ``x + attn(norm_1 x [, image_norm img])``; ``packed``: the
        ``attn_mask`` and ``position_ids`` of a packed batch (text keys only)."""
        if packed.get("attn_mask") is not None:
            if self.image_norm is not None and image is not None:
                image = self.image_norm(image)
                return x + self.self_attn(self.input_layernorm(x), image, **packed)
            return x + self.self_attn(self.input_layernorm(x), **packed)
        if self.image_norm is not None and image is not None:
            return x + self.self_attn(self.input_layernorm(x), self.image_norm(image))
        return x + self.self_attn(self.input_layernorm(x))

    def forward(
        self,
        x: Tensor,
        image: Tensor | None = None,
        padding_mask: Tensor | None = None,
        **packed: Tensor | None,
    ) -> Tensor:
        """``x [B, T, D]`` (text), ``image [B, N, D]`` (joint attention keys) -> ``[B, T, D]``;
        ``padding_mask [B, T]`` (True = padding) keeps padded tokens out of MoE routing;
        ``packed``: ``attn_mask`` / ``position_ids`` of a packed batch
        (:meth:`LlamaAttention.forward`)."""
        h = self.attend(x, image, **packed)
        if isinstance(self.mlp, MoEFeedForward):
            ids = modality_ids(self.mlp, h, "text")
            return h + self.mlp(self.post_attention_layernorm(h), ids, padding_mask)
        return h + self.mlp(self.post_attention_layernorm(h))


def modality_ids(moe: MoEFeedForward, like: Tensor, name: str) -> Tensor:
    """``[B, S]`` long (``like [B, S, ...]``) filled with modality ``name``'s router id in
    ``moe.config.modalities``."""
    index = moe.config.modalities.index(name)
    return torch.full(like.shape[:2], index, dtype=torch.long, device=like.device)


def padding_after(last: Tensor, length: int) -> Tensor:
    """``[B, length]`` bool, True after each row's last token ``last [B]`` (right padding)."""
    return torch.arange(length, device=last.device)[None, :] > last[:, None]


def moe_streams(
    layer: LlamaDecoderLayer,
    img: Tensor,
    h: Tensor,
    ht: Tensor,
    text_padding: Tensor,
    *,
    fused_packed: dict[str, Tensor] | None = None,
    text_packed: dict[str, Tensor] | None = None,
    image_padding: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """One MoE decoder layer on the fusion model's streams: attention per stream, then ONE
    mixture-of-experts call over ``[img; h; ht]`` (one routing, one all-to-all under expert
    parallelism). ``img [B, N, D]`` image tokens, ``h`` fused and ``ht`` text-only streams
    ``[B, T, D]``, ``text_padding [B, T]`` (True after each row's last token; never routed).

    Image tokens go to the ``vision`` router under joint attention when the config has one (their
    residual stream then evolves through the layer: one router per modality); text
    tokens of both streams go to the ``text`` router. A packed batch passes the attention
    keywords of each stream (``fused_packed``, ``text_packed``: :meth:`LlamaAttention.forward`)
    and ``image_padding [B, N]`` (True: an empty image slot's tokens, never routed). Returns
    ``(img, h, ht)``.
    """
    moe = layer.moe
    assert moe is not None
    fused = layer.attend(h, img, **(fused_packed or {}))
    text = layer.attend(ht, img.new_zeros(ht.shape[0], 0, img.shape[-1]), **(text_packed or {}))
    route_image = layer.image_norm is not None and "vision" in moe.config.modalities
    parts = ([img] if route_image else []) + [fused, text]
    kinds = (["vision"] if route_image else []) + ["text", "text"]
    ids = [modality_ids(moe, p, k) for p, k in zip(parts, kinds, strict=True)]
    if image_padding is None:
        image_padding = torch.zeros_like(ids[0], dtype=torch.bool)
    pads = ([image_padding] if route_image else []) + [
        text_padding,
        text_padding,
    ]
    x = layer.post_attention_layernorm(torch.cat(parts, 1))
    y = moe(x, torch.cat(ids, 1), torch.cat(pads, 1))
    outs = [p + d for p, d in zip(parts, y.split([p.shape[1] for p in parts], 1), strict=True)]
    new_img = outs.pop(0) if route_image else img
    return new_img, outs[0], outs[1]


class LanguageModel(nn.Module):
    """LLaMA decoder with LM head: ``logits = lm_head(norm(layers(embed(ids))))``.

    ``lm_head`` is a separate parameter even when the source checkpoint ties it to
    ``embed_tokens`` (ties do not survive vocab-parallel sharding).
    """

    def __init__(self, config: LanguageConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, moe=config.is_moe_layer(i))
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: Tensor, image: Tensor | None = None) -> Tensor:
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h, image)
        return self.lm_head(self.norm(h))
