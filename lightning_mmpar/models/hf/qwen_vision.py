"""Qwen2-VL / Qwen2.5-VL vision tower: a ViT over dynamic-resolution patches with 2-D rotary
positions, (2.5) window attention, and the 2x2 patch merger.

Batch-first, row-packed layout (what :class:`lightning_mmpar.data.QwenVLCollator` emits): row
``b`` holds the patches of its images one after another, ``pixel_values [B, P, C*T*p*p]``
(zero padding after the last image), and ``image_grid_thw [B, I, 3]`` the patch grid
``(t, h, w)`` of each image slot (zeros: empty slot). Patches are in the Qwen processor's
order: each ``merge x merge`` block of neighbouring patches is contiguous, blocks row-major.

Attention is restricted by segment ids instead of transformers' ``cu_seqlens`` (the same set
of keys per query, so the same math): a patch attends to the patches of its own image frame
(Qwen2-VL, and Qwen2.5-VL's ``fullatt_block_indexes``) or of its own window of
``window_size / patch_size`` patches (Qwen2.5-VL's other blocks). transformers' 2.5 reorders
the patches window by window before the blocks and back after the merger; with a mask the order
never matters, so no reorder is needed. Sources: transformers' ``modeling_qwen2_vl.py``,
``modeling_qwen2_5_vl.py``, ``vision_utils.py`` (Wang et al. 2024; Bai et al. 2025).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_mmpar.models.language import RMSNorm, apply_rope

__all__ = [
    "PatchLayout",
    "QwenPatchEmbed",
    "QwenPatchMerger",
    "QwenVisionBlock",
    "QwenVisionConfig",
    "QwenVisionTower",
    "patch_layout",
    "segment_mask",
    "vision_cos_sin",
]

ACTIVATIONS = ("quick_gelu", "gelu", "gelu_pytorch_tanh", "silu")
"""The ViT MLP activations (transformers' ``ACT2FN`` names) this tower computes."""


def activation(name: str, x: Tensor) -> Tensor:
    """``ACT2FN[name](x)`` for the names of :data:`ACTIVATIONS`."""
    if name == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    if name == "gelu":
        return F.gelu(x)
    if name == "gelu_pytorch_tanh":
        return F.gelu(x, approximate="tanh")
    return F.silu(x)


@dataclass(kw_only=True)
class QwenVisionConfig:
    """Shape of the Qwen-VL ViT (transformers' ``Qwen2VLVisionConfig`` /
    ``Qwen2_5_VLVisionConfig``, renamed where the two disagree)."""

    depth: int = 32
    """ViT blocks."""
    width: int = 1280
    """ViT width (2-VL ``embed_dim``, 2.5 ``hidden_size``)."""
    heads: int = 16
    """Attention heads."""
    mlp_width: int = 5120
    """MLP inner width (2-VL ``embed_dim * mlp_ratio``, 2.5 ``intermediate_size``)."""
    out_width: int = 3584
    """Merger output = the language model's width (2-VL ``hidden_size``, 2.5
    ``out_hidden_size``)."""
    in_channels: int = 3
    """Image channels."""
    patch_size: int = 14
    """Patch side in pixels."""
    temporal_patch_size: int = 2
    """Frames per patch (an image is repeated to this many frames by the processor)."""
    spatial_merge_size: int = 2
    """The merger joins ``merge x merge`` neighbouring patches into one language token."""
    rope_theta: float = 10000.0
    """Base of the 2-D rotary frequencies."""
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    """Block and merger norms: LayerNorm (2-VL) or RMSNorm (2.5), eps 1e-6."""
    mlp: Literal["fc", "swiglu"] = "fc"
    """Block MLP: ``fc2(act(fc1 x))`` (2-VL) or ``down(act(gate x) * up x)`` with biases (2.5)."""
    hidden_act: str = "quick_gelu"
    """MLP activation, one of :data:`ACTIVATIONS`."""
    window_size: int | None = None
    """Window side in pixels (2.5: 112); ``None``: every block attends over the whole frame."""
    fullatt_block_indexes: tuple[int, ...] = ()
    """With ``window_size``: the blocks that attend over the whole frame."""

    def __post_init__(self) -> None:
        if self.width % self.heads:
            raise ValueError(
                f"QwenVisionConfig.width ({self.width}) must be divisible by heads ({self.heads})."
            )
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"vision hidden_act {self.hidden_act!r} is not supported; use one of "
                f"{list(ACTIVATIONS)}."
            )
        if self.window_size is not None:
            unit = self.spatial_merge_size * self.patch_size
            if self.window_size % unit or self.window_size < unit:
                raise ValueError(
                    f"vision window_size ({self.window_size}) must be a positive multiple of "
                    f"spatial_merge_size * patch_size ({unit})."
                )

    @property
    def patch_dim(self) -> int:
        """Values per patch ``C * T * p * p`` (the last dim of ``pixel_values``)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    def windowed(self, block: int) -> bool:
        """Whether ``block`` attends within windows (else within the whole frame)."""
        return self.window_size is not None and block not in self.fullatt_block_indexes


@dataclass
class PatchLayout:
    """Per-patch facts of a row-packed batch (every tensor ``[B, P, ...]``, long)."""

    position: Tensor
    """``[B, P, 2]`` (row, column) of each patch in its image's patch grid (0 on padding)."""
    frame: Tensor
    """``[B, P]`` segment of the patch's image frame, -1 on padding."""
    window: Tensor
    """``[B, P]`` segment of the patch's attention window (= ``frame`` without windows)."""


def _image_layout(t: int, h: int, w: int, merge: int, units: int) -> tuple[Tensor, ...]:
    """``(row, column, frame, window)`` ``[t h w]`` of one image in processor order; ``units``:
    window side in merged units (0: no windows)."""
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    shape = (h // merge, merge, w // merge, merge)
    rows = rows.reshape(shape).transpose(1, 2).flatten().repeat(t)
    cols = cols.reshape(shape).transpose(1, 2).flatten().repeat(t)
    frame = torch.arange(t).repeat_interleave(h * w)
    if not units:
        return rows, cols, frame, frame
    across = -(-(w // merge) // units)  # windows per grid row
    down = -(-(h // merge) // units)
    window = (rows // merge // units) * across + (cols // merge // units)
    return rows, cols, frame, frame * (across * down) + window


def patch_layout(grid_thw: Tensor, patches: int, config: QwenVisionConfig) -> PatchLayout:
    """The :class:`PatchLayout` of ``grid_thw [B, I, 3]`` (zeros: empty slot) over ``patches``
    patch positions per row.

    Raises:
        ValueError: a row's images need more than ``patches`` patches, or a grid side does not
            divide by ``spatial_merge_size``.
    """
    merge = config.spatial_merge_size
    units = 0
    if config.window_size is not None:
        units = config.window_size // merge // config.patch_size
    b = grid_thw.shape[0]
    position = torch.zeros(b, patches, 2, dtype=torch.long)
    frame = torch.full((b, patches), -1, dtype=torch.long)
    window = torch.full((b, patches), -1, dtype=torch.long)
    for r, row in enumerate(grid_thw.tolist()):
        start, seg_f, seg_w = 0, 0, 0
        for t, h, w in row:
            if t * h * w == 0:
                continue
            if h % merge or w % merge:
                raise ValueError(
                    f"image_grid_thw row {r}: grid {(t, h, w)} must have h and w divisible by "
                    f"spatial_merge_size ({merge}); use the Qwen image processor."
                )
            n = t * h * w
            if start + n > patches:
                raise ValueError(
                    f"image_grid_thw row {r}: its images have more than the {patches} patches "
                    "of pixel_values; collate with QwenVLCollator."
                )
            rows, cols, f, win = _image_layout(t, h, w, merge, units)
            position[r, start : start + n] = torch.stack([rows, cols], dim=-1)
            frame[r, start : start + n] = f + seg_f
            window[r, start : start + n] = win + seg_w
            seg_f, seg_w = seg_f + int(f.max()) + 1, seg_w + int(win.max()) + 1
            start += n
    device = grid_thw.device
    return PatchLayout(position.to(device), frame.to(device), window.to(device))


def segment_mask(segment: Tensor) -> Tensor:
    """``[B, 1, P, P]`` bool: patch ``q`` sees patch ``k`` iff both are in the same segment
    (``segment [B, P]``, -1 padding); a padding patch sees itself (no empty softmax row)."""
    same = (segment[:, :, None] == segment[:, None, :]) & (segment[:, None, :] >= 0)
    eye = torch.eye(segment.shape[1], dtype=torch.bool, device=segment.device)
    return (same | (eye & (segment[:, :, None] < 0)))[:, None]


def vision_cos_sin(position: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """``(cos, sin) [B, 1, P, head_dim]`` of the axial 2-D RoPE: ``inv_freq`` over ``head_dim
    / 2`` dims; row angles then column angles, duplicated over both halves
    (``Qwen2VLVisionRotaryEmbedding``)."""
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))
    freqs = position.float()[..., None] * inv_freq.to(position.device)  # [B, P, 2, d/4]
    freqs = freqs.flatten(-2)  # rows then columns: [B, P, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    return emb.cos(), emb.sin()


def _norm(config: QwenVisionConfig, dim: int) -> nn.Module:
    if config.norm == "rmsnorm":
        return RMSNorm(dim, 1e-6)
    return nn.LayerNorm(dim, eps=1e-6)


class QwenVisionAttention(nn.Module):
    """Bidirectional self-attention over a segment mask with 2-D RoPE; q/k/v are separate
    projections (transformers' fused ``qkv`` is split on import), so head sharding is column
    parallel q/k/v and row parallel ``proj``. Heads come from the local projection width."""

    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        d = config.width
        self.head_dim = d // config.heads
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        """``x [B, P, D]``, ``cos, sin [B, 1, P, d]``, ``mask [B, 1, P, P]`` -> ``[B, P, D]``."""
        q, k, v = (
            p(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        # in float32 like transformers' apply_rotary_pos_emb_vision
        q = apply_rope(q.float(), cos, sin).to(v.dtype)
        k = apply_rope(k.float(), cos, sin).to(v.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(out.transpose(1, 2).flatten(2))


class QwenVisionMLP(nn.Module):
    """``fc2(act(fc1 x))`` (``mlp="fc"``) or ``down(act(gate x) * up x)`` (``"swiglu"``)."""

    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        d, f = config.width, config.mlp_width
        self.act, self.swiglu = config.hidden_act, config.mlp == "swiglu"
        if self.swiglu:
            self.gate_proj, self.up_proj = nn.Linear(d, f), nn.Linear(d, f)
            self.down_proj = nn.Linear(f, d)
        else:
            self.fc1, self.fc2 = nn.Linear(d, f), nn.Linear(f, d)

    def forward(self, x: Tensor) -> Tensor:
        if self.swiglu:
            return self.down_proj(activation(self.act, self.gate_proj(x)) * self.up_proj(x))
        return self.fc2(activation(self.act, self.fc1(x)))


class QwenVisionBlock(nn.Module):
    """``h = x + attn(norm1 x)``; ``y = h + mlp(norm2 h)``."""

    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        self.norm1 = _norm(config, config.width)
        self.attn = QwenVisionAttention(config)
        self.norm2 = _norm(config, config.width)
        self.mlp = QwenVisionMLP(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        h = x + self.attn(self.norm1(x), cos, sin, mask)
        return h + self.mlp(self.norm2(h))


class QwenPatchMerger(nn.Module):
    """``mlp(ln_q(x))`` over each ``merge x merge`` block of consecutive patches:
    ``[B, P, D] -> [B, P / merge^2, D_out]`` with ``mlp = Linear(4D, 4D), GELU, Linear(4D,
    D_out)`` (transformers' ``PatchMerger``; module names kept)."""

    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        self.unit = config.spatial_merge_size**2
        wide = config.width * self.unit
        self.ln_q = _norm(config, config.width)
        self.mlp = nn.Sequential(
            nn.Linear(wide, wide), nn.GELU(), nn.Linear(wide, config.out_width)
        )

    def forward(self, x: Tensor, frame: Tensor) -> tuple[Tensor, Tensor]:
        """``(tokens [B, P / merge^2, D_out], valid [B, P / merge^2])``: ``valid`` marks the
        merged tokens of images (``frame [B, P]`` >= 0), not of padding."""
        h = self.ln_q(x)
        tokens = self.mlp(h.reshape(h.shape[0], h.shape[1] // self.unit, -1))
        return tokens, frame[:, :: self.unit] >= 0


class QwenPatchEmbed(nn.Module):
    """The patch embedding (``proj``: transformers' Conv3d with kernel = stride is a linear map
    of the flattened ``C T p p`` patch; its weight flattened) and the batch's
    :class:`PatchLayout` from the image grids."""

    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        self.config = config
        self.proj = nn.Linear(config.patch_dim, config.width, bias=False)

    def forward(self, pixel_values: Tensor, grid_thw: Tensor) -> tuple[Tensor, ...]:
        """``pixel_values [B, P, C T p p]``, ``grid_thw [B, I, 3]`` -> ``(x [B, P, D],
        position [B, P, 2], frame [B, P], window [B, P])``."""
        layout = patch_layout(grid_thw, pixel_values.shape[1], self.config)
        x = self.proj(pixel_values.to(self.proj.weight.dtype))
        return x, layout.position, layout.frame, layout.window


class QwenVisionTower(nn.Module):
    """Patch embedding, the blocks and the merger."""

    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = QwenPatchEmbed(config)
        self.blocks = nn.ModuleList(QwenVisionBlock(config) for _ in range(config.depth))
        self.merger = QwenPatchMerger(config)

    def forward(self, pixel_values: Tensor, grid_thw: Tensor) -> tuple[Tensor, Tensor]:
        """``pixel_values [B, P, C T p p]``, ``grid_thw [B, I, 3]`` -> merged tokens
        ``[B, P / merge^2, D_out]`` and which of them are images (``[B, P / merge^2]``)."""
        x, position, frame, window = self.patch_embed(pixel_values, grid_thw)
        head_dim = self.config.width // self.config.heads
        cos, sin = vision_cos_sin(position, head_dim, self.config.rope_theta)
        full, windows = segment_mask(frame), segment_mask(window)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, windows if self.config.windowed(i) else full)
        return self.merger(x, frame)
