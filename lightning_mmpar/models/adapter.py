"""Cross-modal adapter: text hidden states attend to projected image tokens.

One :class:`CrossModalAdapter` block (Flamingo's gated cross-attention dense block, Alayrac et
al. 2022)::

    h = h + tanh(a_attn) * dropout(xattn(norm_q h, norm_kv img))
    h = h + tanh(a_ffn)  * dropout(ffn(norm_ffn h))

with ``xattn`` multi-head attention whose queries come from text and keys/values from the image
tokens (no mask: every text token sees every image token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_mmpar.models.language import RMSNorm, modality_ids
from lightning_mmpar.models.moe import MoEFeedForward
from lightning_mmpar.models.moe_routing import MoEConfig


@dataclass(kw_only=True)
class AdapterConfig:
    """Shape and initialisation of the cross-modal adapter blocks."""

    num_blocks: int = 1
    """Adapter blocks between the projector and the decoder layers."""
    heads: int = 12
    """Cross-attention heads."""
    width: int = 768
    """Cross-attention inner width (``heads * head_dim``)."""
    ffn_width: int = 3072
    """Inner width of the gated FFN (GELU)."""
    dropout: float = 0.1
    """Dropout on both residual branches (use 0.0 for bitwise parity checks)."""
    init_std: float = 0.02
    """Std of the normal init of every adapter projection weight (biases start at 0)."""
    gate_init: float = 0.1
    """Initial value ``a`` of both ``tanh(a)`` residual gates (see :class:`TanhGate`)."""
    moe: MoEConfig | None = None
    """``None``: the gated FFN is a GELU MLP; else a :class:`MoEFeedForward` (SwiGLU experts,
    routed by the ``text`` router; ``modalities`` must include ``"text"``) whose aux losses
    reach the parameters through the backward pass."""

    def __post_init__(self) -> None:
        if self.width % self.heads != 0:
            raise ValueError(
                f"AdapterConfig.width ({self.width}) must be divisible by heads ({self.heads})."
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"AdapterConfig.dropout ({self.dropout}) must be in [0, 1).")
        if self.moe is not None and "text" not in self.moe.modalities:
            raise ValueError(
                f"AdapterConfig.moe.modalities ({self.moe.modalities!r}) must include 'text': "
                "the adapter FFN routes the text stream with the 'text' router."
            )


class TanhGate(nn.Module):
    """``y = tanh(alpha) * x`` with a scalar ``alpha``.

    Flamingo starts ``alpha`` at 0, which keeps the frozen LM exact at step one but also blocks
    every gradient into the adapter, projector and vision tower at step one (``d y / d x =
    tanh(0) = 0``; only ``alpha`` itself moves). We start at ``alpha = 0.1`` by default:
    ``tanh(0.1) ~ 0.0997`` lets gradients cross the vision/language boundary from the first step,
    while the branch output (weights of std 0.02) perturbs the language model by well under 1%.
    """

    def __init__(self, init: float) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.tensor(float(init)))

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.alpha).to(x.dtype) * x


class CrossAttention(nn.Module):
    """``y = softmax(q k^T / sqrt(d)) v W_o^T``; ``q = h W_q^T``, ``k, v = img W_k^T, img W_v^T``.

    Local head counts come from the projection widths, so the module runs on head shards.
    """

    def __init__(self, dim: int, width: int, heads: int) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.q_proj = nn.Linear(dim, width)
        self.k_proj = nn.Linear(dim, width)
        self.v_proj = nn.Linear(dim, width)
        self.o_proj = nn.Linear(width, dim)

    def _heads(self, x: Tensor) -> Tensor:
        return x.unflatten(-1, (-1, self.head_dim)).transpose(1, 2)

    def forward(self, text: Tensor, image: Tensor, attn_mask: Tensor | None = None) -> Tensor:
        """``text [B, T, D]``, ``image [B, N, D]`` -> ``[B, T, D]``. ``attn_mask [B, 1, T, N]``
        (bool, True = attend; a ragged batch's own-sample, preceding-image rule): a text token
        that may attend to no image token gets a zero context (its output is ``o_proj``'s
        bias), also when ``N = 0``; every projection stays on the autograd graph.

        ``N = 0`` (a ragged batch with no image slot) runs k/v on one zero image token that no
        text token sees: a zero-size token dimension never reaches a projection, whose
        tensor-parallel DTensor reshape cannot propagate a sharding over zero elements (torch
        raises ``integer modulo by zero`` there)."""
        if image.shape[1] == 0:
            image = image.new_zeros(image.shape[0], 1, image.shape[2]) + 0.0 * image.sum()
            b, t = text.shape[:2]
            attn_mask = torch.zeros(b, 1, t, 1, dtype=torch.bool, device=text.device)
        q = self._heads(self.q_proj(text))
        k, v = self._heads(self.k_proj(image)), self._heads(self.v_proj(image))
        if attn_mask is None:
            out = F.scaled_dot_product_attention(q, k, v)
        else:
            visible = attn_mask.any(dim=-1, keepdim=True)  # [B, 1, T, 1]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask | ~visible)
            out = out * visible.to(out.dtype)
        return self.o_proj(out.transpose(1, 2).flatten(2))


class AdapterMLP(nn.Module):
    """``y = gelu(x W_1^T + b_1) W_2^T + b_2``."""

    def __init__(self, dim: int, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, width)
        self.fc2 = nn.Linear(width, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class CrossModalAdapter(nn.Module):
    """One gated cross-attention + gated FFN block over text width ``dim``."""

    def __init__(self, dim: int, config: AdapterConfig) -> None:
        super().__init__()
        self.norm_q = RMSNorm(dim)
        self.norm_kv = nn.LayerNorm(dim)
        self.attn = CrossAttention(dim, config.width, config.heads)
        self.attn_gate = TanhGate(config.gate_init)
        self.norm_ffn = RMSNorm(dim)
        self.mlp: AdapterMLP | MoEFeedForward
        if config.moe is None:
            self.mlp = AdapterMLP(dim, config.ffn_width)
        else:
            self.mlp = MoEFeedForward(dim, config.moe, attach_aux_loss=True)
        self.ffn_gate = TanhGate(config.gate_init)
        self.dropout = nn.Dropout(config.dropout)
        dense = self.mlp.children() if isinstance(self.mlp, AdapterMLP) else ()
        for module in (*self.attn.children(), *dense):
            assert isinstance(module, nn.Linear)
            nn.init.normal_(module.weight, std=config.init_std)
            nn.init.zeros_(module.bias)

    @property
    def moe(self) -> MoEFeedForward | None:
        """The mixture-of-experts FFN, or ``None`` for the GELU MLP."""
        return self.mlp if isinstance(self.mlp, MoEFeedForward) else None

    def forward(
        self,
        text: Tensor,
        image: Tensor,
        padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
    ) -> Tensor:
        """``text [B, T, D]``, ``image [B, N, D]`` -> ``[B, T, D]``; ``padding_mask [B, T]``
        (True = padding) keeps padded text out of MoE routing; ``attn_mask [B, 1, T, N]``: which
        image tokens each text token sees (ragged batches; :meth:`CrossAttention.forward`)."""
        attn = self.attn(self.norm_q(text), self.norm_kv(image), attn_mask=attn_mask)
        h = text + self.attn_gate(self.dropout(attn))
        x = self.norm_ffn(h)
        if isinstance(self.mlp, MoEFeedForward):
            ids = modality_ids(self.mlp, x, "text")
            return h + self.ffn_gate(self.dropout(self.mlp(x, ids, padding_mask)))
        return h + self.ffn_gate(self.dropout(self.mlp(x)))
