"""Vision tower: a ViT with open_clip's ``VisionTransformer`` parameter names and math.

An open_clip visual state dict (``open_clip_model.visual.state_dict()``) loads into
:class:`VisionTower` with ``load_state_dict(strict=True)`` without conversion. Supported open_clip
options: learnable positional embedding, ``pool_type`` ``tok``/``avg``, ``final_ln_after_pool``,
``no_ln_pre``, LayerScale, GELU or QuickGELU; not supported: attentional pooling, the
``custom`` block type (qk-norm, scaled-cosine attention) and patch dropout.

Attention keeps open_clip's fused ``attn.in_proj_weight`` / ``attn.in_proj_bias`` keys (rows
``[W_q; W_k; W_v]``), stored in :class:`FusedQKV` as ``[3, D, D]`` / ``[3, D]`` (open_clip's
``[3 D, D]`` / ``[3 D]`` viewed with q, k, v on dim 0). State dicts carry that ``[3, D, D]`` shape,
so a tensor-parallel shard of whole heads (``Shard(1)``) is a plain DTensor whose global value is
the canonical weight at every TP size; open_clip's ``[3 D, D]`` loads unchanged (the load hook
reshapes it) and :func:`open_clip_shape` / ``export_open_clip_visual`` give it back. The
forward derives the local head count from the projection width, so the same code runs on the full
weight or on a head shard.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(kw_only=True)
class VisionConfig:
    """Shape of the ViT, in open_clip's ``vision_cfg`` vocabulary."""

    image_size: int = 224
    """Square input resolution in pixels."""
    patch_size: int = 16
    """Square patch size; ``(image_size // patch_size) ** 2`` patch tokens."""
    width: int = 768
    """Embedding width ``D_v``."""
    layers: int = 12
    """Number of residual attention blocks."""
    heads: int = 12
    """Attention heads per block (``width`` must divide by it)."""
    mlp_ratio: float = 4.0
    """FFN inner width = ``int(width * mlp_ratio)``."""
    output_dim: int = 512
    """Width of the pooled feature after ``proj``."""
    pool_type: Literal["tok", "avg"] = "tok"
    """Pooled feature: class token (``tok``) or mean of the patch tokens (``avg``)."""
    final_ln_after_pool: bool = False
    """Apply ``ln_post`` to the pooled feature only (tokens stay un-normalised), as open_clip."""
    no_ln_pre: bool = False
    """Drop the LayerNorm before the transformer."""
    ls_init_value: float | None = None
    """LayerScale init value; ``None`` disables LayerScale."""
    act: Literal["gelu", "quick_gelu"] = "gelu"
    """FFN activation: ``gelu`` (open_clip default) or ``quick_gelu`` (OpenAI weights)."""
    keep_class_token: bool = False
    """The token output keeps the class token first (``1 + grid**2`` tokens: LLaVA's
    ``vision_feature_select_strategy="full"``); default: the ``grid**2`` patch tokens."""
    spatial_merge: int = 1
    """Patch tokens merged per side before the projector (Qwen2-VL's ``spatial_merge_size``,
    InternVL's pixel shuffle): each ``m x m`` neighbourhood of the grid becomes one token of
    width ``m^2 * width`` (:attr:`token_width`), ``(grid / m)^2`` tokens per image; 1: none."""

    def __post_init__(self) -> None:
        if self.width % self.heads != 0:
            raise ValueError(
                f"VisionConfig.width ({self.width}) must be divisible by heads ({self.heads})."
            )
        m = self.spatial_merge
        if not isinstance(m, int) or m < 1 or (self.image_size // self.patch_size) % m:
            raise ValueError(
                f"VisionConfig.spatial_merge ({m!r}) must be an int >= 1 dividing the grid "
                f"({self.image_size // self.patch_size} patches per side); use 1 for none."
            )
        if m > 1 and self.keep_class_token:
            raise ValueError(
                f"VisionConfig.spatial_merge ({m}) merges patch tokens only: set "
                "keep_class_token=False."
            )
        if self.image_size % self.patch_size != 0:
            raise ValueError(
                f"VisionConfig.image_size ({self.image_size}) must be a multiple of patch_size "
                f"({self.patch_size})."
            )

    @property
    def grid(self) -> int:
        """Patches per side."""
        return self.image_size // self.patch_size

    @property
    def tokens(self) -> int:
        """Tokens per image in the token output (:attr:`keep_class_token`,
        :attr:`spatial_merge`)."""
        return (self.grid // self.spatial_merge) ** 2 + int(self.keep_class_token)

    @property
    def merged_patches(self) -> int:
        """Patch tokens per image after :attr:`spatial_merge` (no class token): the image
        tokens the cost model prices the language model on."""
        return (self.grid // self.spatial_merge) ** 2

    @property
    def token_width(self) -> int:
        """Width of a token of the token output: ``spatial_merge^2 * width``."""
        return self.spatial_merge**2 * self.width

    @property
    def mlp_width(self) -> int:
        """FFN inner width."""
        return int(self.width * self.mlp_ratio)


class QuickGELU(nn.Module):
    """``x * sigmoid(1.702 x)`` (OpenAI CLIP)."""

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.sigmoid(1.702 * x)


class LayerScale(nn.Module):
    """``x * gamma`` (open_clip ``LayerScale``)."""

    def __init__(self, dim: int, init_value: float) -> None:
        super().__init__()
        self.gamma = nn.Parameter(init_value * torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gamma


def _rename_keys(state: dict[str, Any], prefix: str, pairs: tuple[tuple[str, str], ...]) -> None:
    for old, new in pairs:
        if prefix + old in state:
            state[prefix + new] = state.pop(prefix + old)


_FUSED_NAMES = (("in_proj.weight", "in_proj_weight"), ("in_proj.bias", "in_proj_bias"))
_FUSED_NDIM = {"in_proj_weight": 2, "in_proj_bias": 1}
"""open_clip's rank of each fused tensor; ours carries one more leading dim (q, k, v)."""


def open_clip_shape(key: str, value: Tensor) -> Tensor:
    """``value`` in open_clip's shape: ``[3, D, D] -> [3 D, D]`` and ``[3, D] -> [3 D]`` for the
    fused ``attn.in_proj_*`` keys (a view, same values); any other tensor unchanged."""
    name = key.rsplit(".", 1)[-1]
    if name in _FUSED_NDIM and key.endswith(f"attn.{name}") and value.ndim == _FUSED_NDIM[name] + 1:
        return value.flatten(0, 1)
    return value


class FusedQKV(nn.Module):
    """open_clip's fused q/k/v projection, ``[q, k, v] = x W_in^T + b_in``, ``W_in = [W_q; W_k;
    W_v]``, held as ``weight [3, D_out, D_in]`` and ``bias [3, D_out]``.

    Returns ``(q, k, v)``, each ``x W_c^T + b_c``. Sharding ``D_out`` (dim 1) by whole heads keeps
    the global value canonical; ``forward`` only indexes dim 0, so it runs on the full parameter
    or on a shard.
    """

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(3, out_features, in_features))
        self.bias = nn.Parameter(torch.empty(3, out_features))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear(D_in, 3 D_out)``'s initialisation of the fused ``[3 D_out, D_in]``."""
        bound = self.weight.shape[-1] ** -0.5
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.weight.view(-1, self.weight.shape[-1]), a=math.sqrt(5))
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = (F.linear(x, self.weight[c], self.bias[c]) for c in range(3))
        return q, k, v


class VisionAttention(nn.Module):
    """Multi-head self-attention with open_clip's fused projection.

    ``[q, k, v] = x W_in^T + b_in`` with ``W_in = [W_q; W_k; W_v]`` (:class:`FusedQKV`), heads of
    ``d = D / H``; ``y = softmax(q k^T / sqrt(d)) v W_o^T + b_o``. State-dict keys are open_clip's
    (``in_proj_weight`` ``[3, D, D]``, ``in_proj_bias`` ``[3, D]``, ``out_proj.*``); open_clip's
    ``[3 D, D]`` / ``[3 D]`` load too.
    """

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.in_proj = FusedQKV(width, width)
        self.out_proj = nn.Linear(width, width)
        self._register_state_dict_hook(_save_fused)
        self._register_load_state_dict_pre_hook(_load_fused)

    @property
    def in_proj_weight(self) -> Tensor:
        """``in_proj.weight`` under its state-dict name (``torch.distributed.checkpoint``
        resolves state-dict keys as attributes)."""
        return self.in_proj.weight

    @property
    def in_proj_bias(self) -> Tensor:
        """``in_proj.bias`` under its state-dict name."""
        return self.in_proj.bias

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for t in self.in_proj(x))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).flatten(2))


def _save_fused(module: nn.Module, state: dict[str, Any], prefix: str, _meta: Any) -> None:
    _rename_keys(state, prefix, _FUSED_NAMES)


def _load_fused(state: dict[str, Any], prefix: str, *_args: Any) -> None:
    for name, ndim in _FUSED_NDIM.items():
        value = state.get(prefix + name)
        if isinstance(value, Tensor) and value.ndim == ndim:  # open_clip's [3 D, D] / [3 D]
            state[prefix + name] = value.unflatten(0, (3, -1))
    _rename_keys(state, prefix, tuple((new, old) for old, new in _FUSED_NAMES))


class VisionBlock(nn.Module):
    """Pre-norm residual block: ``x + ls_1(attn(ln_1 x))``, then ``x + ls_2(mlp(ln_2 x))``."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        width, ls = config.width, config.ls_init_value
        self.ln_1 = nn.LayerNorm(width)
        self.attn = VisionAttention(width, config.heads)
        self.ls_1: nn.Module = LayerScale(width, ls) if ls is not None else nn.Identity()
        self.ln_2 = nn.LayerNorm(width)
        act: nn.Module = nn.GELU() if config.act == "gelu" else QuickGELU()
        self.mlp = nn.Sequential(
            OrderedDict(
                [
                    ("c_fc", nn.Linear(width, config.mlp_width)),
                    ("gelu", act),
                    ("c_proj", nn.Linear(config.mlp_width, width)),
                ]
            )
        )
        self.ls_2: nn.Module = LayerScale(width, ls) if ls is not None else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.ls_1(self.attn(self.ln_1(x)))
        return x + self.ls_2(self.mlp(self.ln_2(x)))


class _Blocks(nn.Module):
    """Holds ``resblocks`` so keys read ``transformer.resblocks.N.*`` as in open_clip."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.resblocks = nn.ModuleList(VisionBlock(config) for _ in range(config.layers))


class VisionTower(nn.Module):
    """open_clip-compatible ViT returning ``(pooled @ proj, patch tokens)``.

    ``x = ln_pre([cls; conv1(img)] + pos)``; blocks; ``ln_post``; pooled = class token (or mean of
    patch tokens), tokens = patch tokens ``[B, grid**2, width]``.
    """

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        w, p = config.width, config.patch_size
        scale = w**-0.5
        self.conv1 = nn.Conv2d(3, w, kernel_size=p, stride=p, bias=False)
        self.class_embedding = nn.Parameter(scale * torch.randn(w))
        self.positional_embedding = nn.Parameter(scale * torch.randn(config.grid**2 + 1, w))
        self.ln_pre: nn.Module = nn.Identity() if config.no_ln_pre else nn.LayerNorm(w)
        self.transformer = _Blocks(config)
        self.ln_post = nn.LayerNorm(w)
        self.proj = nn.Parameter(scale * torch.randn(w, config.output_dim))

    def embed(self, images: Tensor) -> Tensor:
        """Patch + class + positional embedding, ``ln_pre``: ``[B, 1 + grid**2, width]``."""
        return embed_patches(
            images, self.conv1, self.class_embedding, self.positional_embedding, self.ln_pre
        )

    def pool(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``ln_post``, pooling and ``proj``: returns ``(pooled [B, output_dim], tokens)``."""
        return pool_tokens(x, self.ln_post, self.proj, self.config)

    def forward(self, images: Tensor) -> tuple[Tensor, Tensor]:
        x = self.embed(images)
        for block in self.transformer.resblocks:
            x = block(x)
        return self.pool(x)


def embed_patches(
    images: Tensor, conv1: nn.Module, cls: Tensor, pos: Tensor, ln_pre: nn.Module
) -> Tensor:
    """``ln_pre([cls; conv1(images) flattened] + pos)``: ``[B, 1 + grid**2, width]``."""
    x = conv1(images).flatten(2).transpose(1, 2)
    cls_tok = cls.view(1, 1, -1).expand(x.shape[0], -1, -1).to(x.dtype)
    x = torch.cat([cls_tok, x], dim=1) + pos.to(x.dtype)
    return ln_pre(x)


def pool_tokens(
    x: Tensor, ln_post: nn.Module, proj: Tensor, config: VisionConfig
) -> tuple[Tensor, Tensor]:
    """open_clip ``_pool``: ``(ln_post(pooled) @ proj, tokens)``, pooled = class token or mean.

    Tokens are ``ln_post``-normalised unless ``final_ln_after_pool``; the patch tokens, or with
    ``keep_class_token`` the class token and the patch tokens; merged by
    :func:`merge_tokens` under ``spatial_merge``.
    """
    first = 0 if config.keep_class_token else 1
    if config.final_ln_after_pool:
        pooled = x[:, 1:].mean(1) if config.pool_type == "avg" else x[:, 0]
        return ln_post(pooled) @ proj, merge_tokens(x[:, first:], config.spatial_merge)
    x = ln_post(x)
    pooled = x[:, 1:].mean(1) if config.pool_type == "avg" else x[:, 0]
    return pooled @ proj, merge_tokens(x[:, first:], config.spatial_merge)


def merge_tokens(tokens: Tensor, merge: int) -> Tensor:
    """``[B, g^2, W]`` row-major patch tokens -> ``[B, (g / m)^2, m^2 W]``: each ``m x m``
    neighbourhood concatenated (row-major inside it), as Qwen2-VL's ``PatchMerger`` reads the
    patches its processor orders by ``m x m`` unit; ``merge == 1``: unchanged."""
    if merge == 1:
        return tokens
    b, n, w = tokens.shape
    g = math.isqrt(n)
    x = tokens.reshape(b, g // merge, merge, g // merge, merge, w).transpose(2, 3)
    return x.reshape(b, (g // merge) ** 2, merge * merge * w)
