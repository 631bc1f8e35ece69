"""Qwen3-VL vision tower: the Qwen2-VL ViT (2-D rotary positions, frame-masked attention, the
2x2 patch merger) plus what Qwen3-VL adds.

* a learned position embedding ``pos_embed [S^2, D]`` on an ``S x S`` grid, resampled to each
  image's ``h x w`` patch grid by bilinear interpolation (``align_corners=True``) and added
  after the patch embedding (which has a bias here);
* DeepStack (Meng et al. 2024): after the ViT blocks of ``deepstack_indexes``, a merger of their
  own (LayerNorm over the ``merge^2 D`` merged width, "post-shuffle") turns the patches into
  language-width tokens that the first decoder layers add to the image tokens' hidden states.

No window attention; LayerNorm, ``fc2(gelu_tanh(fc1 x))`` blocks. Same batch-first, row-packed
layout as :mod:`lightning_mmpar.models.hf.qwen_vision` (``pixel_values [B, P, C T p p]``,
``image_grid_thw [B, I, 3]``). Source: transformers' ``modeling_qwen3_vl_moe.py`` and
``vision_utils.get_vision_interpolation_indices_and_weights`` (the logits this tower matches).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_mmpar.models.hf.qwen_vision import (
    QwenPatchEmbed,
    QwenPatchMerger,
    QwenVisionBlock,
    QwenVisionConfig,
    patch_layout,
    segment_mask,
    vision_cos_sin,
)

__all__ = [
    "Qwen3DeepstackMerger",
    "Qwen3PatchEmbed",
    "Qwen3VisionConfig",
    "Qwen3VisionTower",
    "grid_sizes",
    "interpolation_taps",
]


@dataclass(kw_only=True)
class Qwen3VisionConfig(QwenVisionConfig):
    """:class:`QwenVisionConfig` (Qwen3-VL defaults) with the learned position grid and the
    DeepStack layers (transformers' ``Qwen3VLMoeVisionConfig``)."""

    depth: int = 27
    width: int = 1152
    mlp_width: int = 4304
    out_width: int = 2048
    patch_size: int = 16
    hidden_act: str = "gelu_pytorch_tanh"
    num_position_embeddings: int = 2304
    """Rows of ``pos_embed``: an ``S x S`` grid, ``S = int(sqrt(num_position_embeddings))``."""
    deepstack_indexes: tuple[int, ...] = (8, 16, 24)
    """ViT blocks whose output a DeepStack merger feeds to decoder layer 0, 1, ... (in order)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window_size is not None or self.norm != "layernorm" or self.mlp != "fc":
            raise ValueError(
                "Qwen3VisionConfig: window_size must be None, norm 'layernorm' and mlp 'fc' "
                "(Qwen3-VL's ViT has no windows, LayerNorm and an fc1/fc2 MLP)."
            )
        bad = [i for i in self.deepstack_indexes if not 0 <= i < self.depth]
        if bad or len(set(self.deepstack_indexes)) != len(self.deepstack_indexes):
            raise ValueError(
                f"vision_config.deepstack_visual_indexes {list(self.deepstack_indexes)} must be "
                f"distinct ViT block indexes in [0, depth = {self.depth})."
            )
        if self.num_position_embeddings < 1:
            raise ValueError(
                f"vision_config.num_position_embeddings ({self.num_position_embeddings}) must "
                "be >= 1."
            )

    @property
    def grid_side(self) -> int:
        """``S``: side of the learned position grid."""
        return int(self.num_position_embeddings**0.5)


def grid_sizes(grid_thw: Tensor, patches: int) -> Tensor:
    """``[B, P, 2]`` long: the ``(h, w)`` patch grid of each patch's image (``(1, 1)`` on
    padding), for ``grid_thw [B, I, 3]`` over ``patches`` positions per row."""
    b = grid_thw.shape[0]
    sizes = torch.ones(b, patches, 2, dtype=torch.long)
    for r, row in enumerate(grid_thw.tolist()):
        start = 0
        for t, h, w in row:
            n = t * h * w
            sizes[r, start : start + n] = torch.tensor([h, w])
            start += n
    return sizes.to(grid_thw.device)


def interpolation_taps(index: Tensor, size: Tensor, side: int) -> tuple[Tensor, Tensor]:
    """Bilinear ``align_corners=True`` taps of target positions ``index`` on an axis of
    ``size`` into a ``side``-long source axis: ``(taps [..., 2] long, weights [..., 2])``
    (transformers' ``_interpolation_axis_taps_weights``, ``F.interpolate``'s math)."""
    src = index.to(torch.float32) * (side - 1) / torch.clamp(size - 1, min=1)
    floor = torch.floor(src)
    offsets = torch.arange(0, 2, device=index.device)
    taps = (floor.long()[..., None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[..., None] - floor[..., None] - offsets).abs()).clamp(min=0)
    return taps, weights


class Qwen3PatchEmbed(QwenPatchEmbed):
    """The patch embedding (with bias) plus the learned position grid resampled to each image:
    ``x = proj(patch) + sum_taps w pos_embed[tap]``."""

    def __init__(self, config: Qwen3VisionConfig) -> None:
        super().__init__(config)
        self.proj = nn.Linear(config.patch_dim, config.width, bias=True)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.width)
        self.side = config.grid_side

    def forward(self, pixel_values: Tensor, grid_thw: Tensor) -> tuple[Tensor, ...]:
        """``pixel_values [B, P, C T p p]``, ``grid_thw [B, I, 3]`` -> ``(x [B, P, D],
        position [B, P, 2], frame [B, P])``."""
        layout = patch_layout(grid_thw, pixel_values.shape[1], self.config)
        sizes = grid_sizes(grid_thw, pixel_values.shape[1])
        h_taps, h_w = interpolation_taps(layout.position[..., 0], sizes[..., 0], self.side)
        w_taps, w_w = interpolation_taps(layout.position[..., 1], sizes[..., 1], self.side)
        index = (h_taps[..., :, None] * self.side + w_taps[..., None, :]).flatten(-2)
        weight = (h_w[..., :, None] * w_w[..., None, :]).flatten(-2)  # [B, P, 4]
        pos = (self.pos_embed(index) * weight[..., None]).sum(-2)
        x = self.proj(pixel_values.to(self.proj.weight.dtype))
        return x + pos.to(x.dtype), layout.position, layout.frame


class Qwen3DeepstackMerger(QwenPatchMerger):
    """A DeepStack merger: ``mlp(ln_q(x merged))`` with the LayerNorm over the merged width
    ``merge^2 D`` (transformers' ``use_postshuffle_norm=True``): ``[B, P, D] -> [B, P / merge^2,
    D_out]``."""

    def __init__(self, config: Qwen3VisionConfig) -> None:
        super().__init__(config)
        self.ln_q = nn.LayerNorm(config.width * self.unit, eps=1e-6)

    def forward(self, x: Tensor, frame: Tensor) -> tuple[Tensor, Tensor]:
        h = self.ln_q(x.reshape(x.shape[0], x.shape[1] // self.unit, -1))
        return self.mlp(h), frame[:, :: self.unit] >= 0


class Qwen3VisionTower(nn.Module):
    """Patch embedding (``patch_embed.proj``, ``patch_embed.pos_embed``), the blocks, the
    merger and ``deepstack_merger_list`` (one per ``deepstack_indexes`` entry)."""

    def __init__(self, config: Qwen3VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = Qwen3PatchEmbed(config)
        self.blocks = nn.ModuleList(QwenVisionBlock(config) for _ in range(config.depth))
        self.merger = QwenPatchMerger(config)
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3DeepstackMerger(config) for _ in config.deepstack_indexes
        )

    def forward(self, pixel_values: Tensor, grid_thw: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """-> merged tokens ``[B, P / merge^2, D_out]``, which are images ``[B, P / merge^2]``,
        the DeepStack features ``[B, P / merge^2, L, D_out]`` (``L = len(deepstack_indexes)``)."""
        x, position, frame = self.patch_embed(pixel_values, grid_thw)
        cos, sin = vision_cos_sin(position, self.config.width // self.config.heads, self.theta)
        mask = segment_mask(frame)
        deep = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, mask)
            if i in self.config.deepstack_indexes:
                j = self.config.deepstack_indexes.index(i)
                deep.append(self.deepstack_merger_list[j](x, frame)[0])
        tokens, valid = self.merger(x, frame)
        stacked = torch.stack(deep, dim=2) if deep else tokens.new_zeros(*tokens.shape[:2], 0, 1)
        return tokens, valid, stacked

    @property
    def theta(self) -> float:
        """Base of the 2-D rotary frequencies."""
        return self.config.rope_theta
