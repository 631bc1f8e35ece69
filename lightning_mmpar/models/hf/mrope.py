"""Multimodal rotary positions (M-RoPE) of Qwen2-VL / Qwen2.5-VL's language model.

Every token has three position ids ``(t, h, w)``, built with the batch
(:func:`lightning_mmpar.data.qwen_packing.mrope_positions`, transformers' ``get_rope_index``).
Text tokens carry the same value three times
(plain 1-D RoPE), an image's tokens their temporal / row / column index on the merged patch grid,
offset by the position where the image starts; the text after an image continues at
``start + max(h, w) / merge``. The rotary frequencies ``inv_freq [d / 2]`` are split into
``mrope_section = (s_t, s_h, s_w)`` chunks (``s_t + s_h + s_w = d / 2``); chunk ``k`` rotates by
the position of axis ``k``. Same math as transformers' ``Qwen2VLRotaryEmbedding`` and
``Qwen2VLModel.get_rope_index`` (Wang et al. 2024, "Qwen2-VL"). Qwen3-VL interleaves the
axes over the frequencies instead (:func:`~lightning_mmpar.models.hf.qwen3_vl_moe.
interleaved_mrope_cos_sin`); :class:`MRopeAttention` runs either.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_mmpar.models.language import LanguageConfig, LlamaAttention, RMSNorm, apply_rope

__all__ = ["MRopeAttention", "mrope_cos_sin"]


def mrope_cos_sin(
    positions: Tensor, dim: int, theta: float, section: Sequence[int], dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """``(cos, sin) [B, T, dim]`` for ``positions [B, 3, T]`` (t, h, w): frequency chunk ``k``
    of ``section`` rotates by axis ``k``'s position, the angles duplicated over both halves.

    Raises:
        ValueError: ``sum(section) != dim / 2``.
    """
    if sum(section) * 2 != dim:
        raise ValueError(
            f"mrope_section {list(section)} sums to {sum(section)}, not head_dim / 2 = "
            f"{dim // 2}; fix rope_parameters.mrope_section in the config."
        )
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)  # [B, 3, T, d/2]
    chunks = freqs.split(list(section), dim=-1)
    freqs = torch.cat([c[:, k % 3] for k, c in enumerate(chunks)], dim=-1)  # [B, T, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class MRopeAttention(LlamaAttention):
    """Qwen2's self-attention: :class:`LlamaAttention` (GQA, same projection names, so the
    language tensor-parallel plan applies unchanged) with biases on q/k/v only and M-RoPE
    positions ``[B, 3, T]``. Runs the packed path only: ``attn_mask [B, 1, T, T]`` (block-causal
    over packed samples, :func:`lightning_mmpar.models.ragged.block_causal_mask`).

    Args:
        config: the decoder's widths, heads, ``rope_theta`` and ``rms_norm_eps``.
        mrope_section: frequency counts of the t / h / w axes (sum = head_dim / 2).
        cos_sin: the rotary table ``(positions [B, 3, T], dim, theta, section, dtype) ->
            (cos, sin) [B, T, dim]``: :func:`mrope_cos_sin` (sectioned, Qwen2-VL) or Qwen3-VL's
            interleaved one.
        qk_norm: RMSNorm over each head's q and k (``q_norm``, ``k_norm``) before the rotation
            (Qwen3).
        o_proj_bias: ``o_proj``'s bias; ``None`` keeps :class:`LlamaAttention`'s
            (``attention_bias``).
    """

    def __init__(
        self,
        config: LanguageConfig,
        mrope_section: Sequence[int],
        *,
        cos_sin: Callable[..., tuple[Tensor, Tensor]] = mrope_cos_sin,
        qk_norm: bool = False,
        o_proj_bias: bool | None = False,
    ) -> None:
        super().__init__(config)
        if o_proj_bias is not None:
            d, hd = config.hidden_size, config.dim_per_head
            self.o_proj = nn.Linear(config.num_attention_heads * hd, d, bias=o_proj_bias)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = qk_norm
        self.cos_sin = cos_sin
        self.mrope_section = tuple(mrope_section)

    def _qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``q [B, H, T, hd]``, ``k, v [B, H_kv, T, hd]`` (q/k per-head RMSNorm'd if
        ``qk_norm``)."""
        if not self.qk_norm:
            return (
                self._heads(self.q_proj(x)),
                self._heads(self.k_proj(x)),
                self._heads(self.v_proj(x)),
            )
        heads = (-1, self.head_dim)
        q = self.q_norm(self.q_proj(x).unflatten(-1, heads)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).unflatten(-1, heads)).transpose(1, 2)
        return q, k, self._heads(self.v_proj(x))

    def _packed(
        self,
        x: Tensor,
        image: Tensor | None,
        attn_mask: Tensor,
        position_ids: Tensor | None,
        image_position_ids: Tensor | None,
    ) -> Tensor:
        if position_ids is None or position_ids.ndim != 3:
            raise ValueError(
                f"{type(self).__name__} needs position_ids [B, 3, T] (M-RoPE t/h/w positions; "
                "lightning_mmpar.data.QwenVLCollator builds them)."
            )
        q, k, v = self._qkv(x)
        cos, sin = self.cos_sin(
            position_ids, self.head_dim, self.rope_theta, self.mrope_section, q.dtype
        )
        cos, sin = cos[:, None], sin[:, None]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k = k.repeat_interleave(self.groups, dim=1)
        v = v.repeat_interleave(self.groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.o_proj(out.transpose(1, 2).flatten(2))
