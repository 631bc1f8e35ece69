"""Qwen3-VL-MoE (transformers' ``Qwen3VLMoeForConditionalGeneration``) as this package's
pipeline blocks: the Qwen3-VL ViT with DeepStack, spliced into a Qwen3-MoE decoder.

Data flow (every tensor batch-first, so micro-batching splits them by row; ``L`` DeepStack
levels, ``N = P / merge^2`` merged tokens)::

    inputs   (pixel_values [B, P, C T p p], image_grid_thw [B, I, 3], ids [B, T],
              position_ids [B, 3, T], sample_ids [B, T])
    stem     x = proj(patch) + interpolated pos_embed; patch layout; deep [B, N, L, D] = 0
    vision   x <- block(x); after a DeepStack block: deep[:, :, l] = merger_l(x)
    merger   tok [B, N, D] = merger(x); valid [B, N]
    bridge   h = embed(ids), image tokens replaced by the valid merged tokens; ds [B, L, T, D]:
             level l's DeepStack tokens at the image positions, zeros elsewhere
    language h <- layer(h) (+ ds[:, i] after layer i < L): q/k RMSNorm, interleaved M-RoPE,
             block-causal attention over packed samples; FFN: top-k softmax MoE (or SwiGLU)
    head     logits [B, T, V] = lm_head(norm(h))

The MoE FFNs are :class:`~lightning_mmpar.models.moe.MoEFeedForward` (one text router without
projection, dropless, ``top_k`` gates renormalised: Qwen3-MoE's ``norm_topk_prob``), so the
package's expert parallelism (all-to-all over ``ep``) applies unchanged; attention and dense
FFNs keep :class:`~lightning_mmpar.models.language.LanguageModel`'s module names, so its tensor-
parallel plan applies. Sources: transformers' ``modeling_qwen3_vl_moe.py`` (the logits this
model matches), torchtitan's Qwen3 MoE blocks. A block's ``cost(image_tokens, text_length)``
reads ``image_tokens`` as the merged (language) tokens per sample; the ViT runs ``merge^2``
patches per merged token; an MoE layer counts its router and ``top_k`` experts per token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from lightning_mmpar.models.block_cost import CostTally
from lightning_mmpar.models.blocks import FusionBlock
from lightning_mmpar.models.hf.mrope import MRopeAttention
from lightning_mmpar.models.hf.qwen2_vl import (
    QwenBridge,
    QwenDecoderLayer,
    QwenHead,
    QwenMergerBlock,
    QwenVisionLayer,
    QwenVLModel,
    check_widths,
)
from lightning_mmpar.models.hf.qwen3_vision import (
    Qwen3DeepstackMerger,
    Qwen3VisionConfig,
    Qwen3VisionTower,
)
from lightning_mmpar.models.hf.qwen_vision import QwenVisionBlock
from lightning_mmpar.models.language import (
    LanguageConfig,
    LanguageModel,
    LlamaDecoderLayer,
    LlamaMLP,
)
from lightning_mmpar.models.moe import MoEFeedForward
from lightning_mmpar.models.ragged import block_causal_mask

__all__ = [
    "Qwen3MoeAttention",
    "Qwen3MoeVLConfig",
    "Qwen3MoeVLModel",
    "interleaved_mrope_cos_sin",
]


def interleaved_mrope_cos_sin(
    positions: Tensor, dim: int, theta: float, section: Sequence[int], dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """``(cos, sin) [B, T, dim]`` of Qwen3-VL's interleaved M-RoPE for ``positions [B, 3, T]``
    (t, h, w): frequency ``i`` rotates by the h position when ``i % 3 == 1`` and ``i < 3 s_h``,
    by w when ``i % 3 == 2`` and ``i < 3 s_w``, else by t (transformers'
    ``Qwen3VLMoeTextRotaryEmbedding.recomposition_frequencies``).

    Raises:
        ValueError: ``sum(section) != dim / 2``.
    """
    half = dim // 2
    if len(section) != 3 or sum(section) != half:
        raise ValueError(
            f"text_config.rope_parameters.mrope_section {list(section)} must be three numbers "
            f"summing to head_dim / 2 = {half}."
        )
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)  # [B, 3, T, d/2]
    axis = torch.zeros(half, dtype=torch.long)
    axis[1 : 3 * section[1] : 3] = 1
    axis[2 : 3 * section[2] : 3] = 2
    index = axis.to(positions.device).expand(*freqs.shape[:1], 1, freqs.shape[2], half)
    picked = freqs.gather(1, index).squeeze(1)  # [B, T, d/2]
    emb = torch.cat((picked, picked), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class Qwen3MoeAttention(MRopeAttention):
    """Qwen3's self-attention: :class:`MRopeAttention` (GQA, explicit ``head_dim``, same
    projection names; ``o_proj`` biased as ``attention_bias``) with RMSNorm over each head's q
    and k (``q_norm``, ``k_norm``, before the rotation) and interleaved M-RoPE positions
    ``[B, 3, T]``. Packed path only: ``attn_mask [B, 1, T, T]``."""

    def __init__(self, config: LanguageConfig, mrope_section: Sequence[int]) -> None:
        super().__init__(
            config,
            mrope_section,
            cos_sin=interleaved_mrope_cos_sin,
            qk_norm=True,
            o_proj_bias=None,
        )


@dataclass(kw_only=True)
class Qwen3MoeVLConfig:
    """The two towers, the splice and which decoder layers are dense."""

    vision: Qwen3VisionConfig = field(default_factory=Qwen3VisionConfig)
    """The ViT, its merger and DeepStack mergers."""
    language: LanguageConfig = field(default_factory=LanguageConfig)
    """The Qwen3-MoE decoder; ``language.moe`` is the experts' config (every layer not in
    ``dense_layers`` is an MoE layer)."""
    mrope_section: tuple[int, int, int] = (24, 20, 20)
    """Interleaved M-RoPE frequency counts of the t / h / w axes (sum = head_dim / 2)."""
    image_token_id: int = 151655
    """The image-token id whose embeddings the merged image tokens replace."""
    dense_layers: tuple[int, ...] = ()
    """Decoder layers with a SwiGLU FFN of ``intermediate_size`` instead of experts
    (transformers' ``mlp_only_layers`` and ``decoder_sparse_step``)."""

    def __post_init__(self) -> None:
        if self.language.moe is None:
            raise ValueError("Qwen3MoeVLConfig.language.moe must be set (the experts' config).")
        if sum(self.mrope_section) * 2 != self.language.dim_per_head:
            raise ValueError(
                f"text_config.rope_parameters.mrope_section {list(self.mrope_section)} must sum "
                f"to head_dim / 2 = {self.language.dim_per_head // 2}."
            )
        check_widths(self.vision, self.language)
        if len(self.vision.deepstack_indexes) > self.language.num_hidden_layers:
            raise ValueError(
                f"vision_config.deepstack_visual_indexes has {len(self.vision.deepstack_indexes)}"
                f" entries, more than the {self.language.num_hidden_layers} decoder layers."
            )

    @property
    def levels(self) -> int:
        """DeepStack levels ``L``."""
        return len(self.vision.deepstack_indexes)


class Qwen3MoeLanguageModel(LanguageModel):
    """:class:`LanguageModel` with :class:`Qwen3MoeAttention` in every layer and a
    :class:`MoEFeedForward` FFN in every layer but ``dense_layers`` (SwiGLU there)."""

    def __init__(
        self, config: LanguageConfig, mrope_section: Sequence[int], dense_layers: Sequence[int]
    ) -> None:
        super().__init__(config)
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, LlamaDecoderLayer)
            layer.self_attn = Qwen3MoeAttention(config, mrope_section)
            if i in dense_layers:
                layer.mlp = LlamaMLP(config)
            elif not isinstance(layer.mlp, MoEFeedForward):
                assert config.moe is not None
                layer.mlp = MoEFeedForward(config.hidden_size, config.moe, attach_aux_loss=True)


class Qwen3VisionStem(FusionBlock):
    """Patch and position embedding, the patch layout, the empty DeepStack slots."""

    kind = "vision"

    def __init__(self, vision: Qwen3VisionTower) -> None:
        super().__init__()
        self.patch_embed = vision.patch_embed
        cfg = vision.config
        self.unit, self.out = cfg.spatial_merge_size**2, cfg.out_width
        self.levels = len(cfg.deepstack_indexes)

    def forward(self, pixel_values: Tensor, grid_thw: Tensor, *rest: Tensor) -> tuple[Tensor, ...]:
        x, position, frame = self.patch_embed(pixel_values, grid_thw)
        deep = x.new_zeros(x.shape[0], x.shape[1] // self.unit, self.levels, self.out)
        return (x, position, frame, deep, *rest)

    def _tally(self, tally: CostTally, n: int, t: int) -> None:
        tally.linear(self.unit * n, self.patch_embed.proj)


class Qwen3VisionLayer(QwenVisionLayer):
    """One ViT block (frame-masked attention); a DeepStack block also fills its level of
    ``deep`` with its merger's output."""

    def __init__(
        self, block: QwenVisionBlock, config: Qwen3VisionConfig, index: int, tower: Qwen3VisionTower
    ) -> None:
        super().__init__(block, config, windowed=False)
        self.level: int | None = None
        self.deepstack: Qwen3DeepstackMerger | None = None
        if index in config.deepstack_indexes:
            self.level = sorted(config.deepstack_indexes).index(index)
            merger = tower.deepstack_merger_list[config.deepstack_indexes.index(index)]
            self.deepstack = merger  # type: ignore[assignment]

    def forward(
        self, x: Tensor, position: Tensor, frame: Tensor, deep: Tensor, *rest: Tensor
    ) -> tuple[Tensor, ...]:
        x = self._attend(x, position, frame)
        if self.deepstack is not None and self.level is not None:
            level = self.deepstack(x, frame)[0][:, :, None]
            deep = torch.cat([deep[:, :, : self.level], level, deep[:, :, self.level + 1 :]], 2)
        return (x, position, frame, deep, *rest)

    def _tally(self, tally: CostTally, n: int, t: int) -> None:
        super()._tally(tally, n, t)
        if self.deepstack is not None:
            tally.linear(n, self.deepstack.mlp[0])
            tally.linear(n, self.deepstack.mlp[2])


class Qwen3MergerBlock(QwenMergerBlock):
    """The final patch merger: ``(tokens [B, N, D], valid [B, N], deep)``."""

    keeps_slot = True


class Qwen3Bridge(QwenBridge):
    """``h = embed(ids)`` with the image tokens' embeddings replaced in order by the valid
    merged tokens, and the DeepStack tokens scattered to the image positions
    (``ds [B, L, T, D]``, zeros elsewhere; left out when ``L == 0``).

    Raises:
        ValueError: the number of image tokens differs from the merged image tokens.
    """

    family = "Qwen3-VL"

    def __init__(self, embed_tokens: nn.Embedding, image_token_id: int, levels: int) -> None:
        super().__init__(embed_tokens, image_token_id)
        self.levels = levels

    def forward(  # type: ignore[override]  # the state carries deep
        self,
        tokens: Tensor,
        valid: Tensor,
        deep: Tensor,
        ids: Tensor,
        position_ids: Tensor,
        sample_ids: Tensor,
    ) -> tuple[Tensor, ...]:
        h, where = self._splice(tokens, valid, ids)
        if not self.levels:
            return (h, position_ids, sample_ids)
        levels = deep[valid].to(h.dtype)  # [n, L, D]
        ds = torch.stack(
            [torch.zeros_like(h).masked_scatter(where, levels[:, i]) for i in range(self.levels)],
            dim=1,
        )
        return (h, ds + 0.0 * deep.sum(), position_ids, sample_ids)


class Qwen3MoeDecoderLayer(QwenDecoderLayer):
    """Decoder layer ``index``: block-causal attention over packed samples, then the FFN (MoE:
    padding never routed); layer ``i < L`` then adds DeepStack level ``i`` (``ds`` passed on
    until its last level is used)."""

    def __init__(self, layer: LlamaDecoderLayer, index: int, levels: int) -> None:
        super().__init__(layer)
        self.index, self.levels = index, levels

    def forward(self, h: Tensor, *state: Tensor) -> tuple[Tensor, ...]:
        deep = self.index < self.levels
        ds, (position_ids, sample_ids) = (state[0] if deep else None), state[-2:]
        mask = block_causal_mask(sample_ids)
        out = self.layer(h, None, sample_ids < 0, attn_mask=mask, position_ids=position_ids)
        if ds is None:
            return (out, position_ids, sample_ids)
        out = out + ds[:, self.index]
        if self.index < self.levels - 1:
            return (out, ds, position_ids, sample_ids)
        return (out, position_ids, sample_ids)


class Qwen3MoeVLModel(nn.Module):
    """Qwen3-VL-MoE: :class:`~lightning_mmpar.models.hf.qwen3_vision.Qwen3VisionTower`
    (``vision``) and the Qwen3-MoE decoder (``language``, :class:`LanguageModel` module names;
    MoE FFNs at ``language.layers.<i>.mlp``).

    Args:
        config: the towers (:func:`~lightning_mmpar.models.hf.qwen3_convert.qwen3_moe_vl_config`
            reads a transformers ``Qwen3VLMoeConfig``).
    """

    def __init__(self, config: Qwen3MoeVLConfig) -> None:
        super().__init__()
        self.config = config
        self.vision = Qwen3VisionTower(config.vision)
        self.language = Qwen3MoeLanguageModel(
            config.language, config.mrope_section, config.dense_layers
        )

    pipeline_inputs = staticmethod(QwenVLModel.pipeline_inputs)

    def moe_layers(self) -> tuple[str, ...]:
        """Paths of the MoE FFNs (``language.layers.<i>.mlp``): the expert-parallel layers."""
        layers = self.language.layers
        return tuple(f"language.layers.{i}.mlp" for i, x in enumerate(layers) if x.moe)

    def pipeline_blocks(self) -> list[FusionBlock]:
        """Ordered blocks (stem, ViT blocks, merger, bridge, decoder layers, head); new wrappers
        over the model's own modules on every call, in the model's train/eval mode."""
        vision, cfg, levels = self.vision, self.config.vision, self.config.levels
        blocks: list[FusionBlock] = [Qwen3VisionStem(vision)]
        blocks += [
            Qwen3VisionLayer(b, cfg, i, vision)  # type: ignore[arg-type]
            for i, b in enumerate(vision.blocks)
        ]
        blocks += [Qwen3MergerBlock(vision.merger)]
        blocks += [Qwen3Bridge(self.language.embed_tokens, self.config.image_token_id, levels)]
        blocks += [
            Qwen3MoeDecoderLayer(d, i, levels)  # type: ignore[arg-type]
            for i, d in enumerate(self.language.layers)
        ]
        blocks.append(QwenHead(self.language))
        for block in blocks:
            block.training = self.training
        return blocks

    def forward(self, batch: Mapping[str, Tensor]) -> Tensor:
        """``logits [B, T, V]`` of a collated batch (the keys of
        :data:`~lightning_mmpar.models.hf.qwen2_vl.QWEN_VL_KEYS`, :class:`QwenVLCollator`)."""
        state = self.pipeline_inputs(batch)
        for block in self.pipeline_blocks():
            state = block(*state)
        return state[0]
