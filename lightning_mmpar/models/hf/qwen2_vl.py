"""Qwen2-VL / Qwen2.5-VL as this package's pipeline blocks: ViT -> merger -> spliced into the
Qwen2 language model with M-RoPE.

Data flow (every tensor batch-first, so micro-batching splits them by row)::

    inputs   (pixel_values [B, P, C T p p], image_grid_thw [B, I, 3], ids [B, T],
              position_ids [B, 3, T], sample_ids [B, T])
    stem     x = patch_embed(pixel_values); the patch layout (rotary positions, frame and
             window segments [B, P]) from image_grid_thw                 QwenVisionStem
    vision   x <- block(x)  (segment-masked attention, 2-D RoPE)        QwenVisionLayer
    merger   tok [B, P / 4, D] = merger(x); valid [B, P / 4]           QwenMergerBlock
    bridge   h = embed(ids) with the image tokens' embeddings replaced,
             in order, by the valid merged tokens (masked_scatter)     QwenBridge
    language h <- layer(h)  (block-causal over packed samples, M-RoPE)  QwenDecoderLayer
    head     logits [B, T, V] = lm_head(norm(h))                        QwenHead

:meth:`QwenVLModel.forward` runs exactly :meth:`QwenVLModel.pipeline_blocks` in order. The
language modules are :class:`~lightning_mmpar.models.language.LanguageModel`'s (same names), so
its tensor-parallel plan applies unchanged; the ViT's q/k/v, ``proj``, MLP and merger layers
are plain ``nn.Linear`` s (column / row parallel). Sources: transformers'
``Qwen2VLForConditionalGeneration`` / ``Qwen2_5_VLForConditionalGeneration`` (the logits this
model matches) and torchtitan's VLM blocks. A block's ``cost(image_tokens, text_length)``
reads ``image_tokens`` as the merged (language) tokens per sample; the ViT runs
``merge^2`` patches per merged token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from torch import Tensor, nn

from lightning_mmpar.models.block_cost import CostTally
from lightning_mmpar.models.blocks import FusionBlock, owned
from lightning_mmpar.models.hf.mrope import MRopeAttention
from lightning_mmpar.models.hf.qwen_vision import (
    QwenPatchMerger,
    QwenVisionBlock,
    QwenVisionConfig,
    QwenVisionTower,
    segment_mask,
    vision_cos_sin,
)
from lightning_mmpar.models.language import LanguageConfig, LanguageModel, LlamaDecoderLayer
from lightning_mmpar.models.moe import MoEFeedForward
from lightning_mmpar.models.ragged import block_causal_mask

__all__ = [
    "QWEN_VL_KEYS",
    "QwenVLConfig",
    "QwenVLModel",
]

QWEN_VL_KEYS: tuple[str, ...] = (
    "pixel_values",
    "image_grid_thw",
    "input_ids",
    "position_ids",
    "sample_ids",
)
"""The batch keys block 0 takes, in order (:class:`lightning_mmpar.data.QwenVLCollator`)."""


@dataclass(kw_only=True)
class QwenVLConfig:
    """The two towers and the splice."""

    vision: QwenVisionConfig = field(default_factory=QwenVisionConfig)
    """The ViT and merger."""
    language: LanguageConfig = field(default_factory=LanguageConfig)
    """The Qwen2 decoder (``attention_bias=True``: q/k/v biases; ``o_proj`` has none)."""
    mrope_section: tuple[int, int, int] = (16, 24, 24)
    """Frequency chunks rotated by the t / h / w positions (sum = head_dim / 2)."""
    image_token_id: int = 151655
    """The image-token id whose embeddings the merged image tokens replace."""

    def __post_init__(self) -> None:
        half = self.language.dim_per_head // 2
        if len(self.mrope_section) != 3 or sum(self.mrope_section) != half:
            raise ValueError(
                f"rope_parameters.mrope_section {list(self.mrope_section)} must be three "
                f"numbers summing to head_dim / 2 = {half}."
            )
        check_widths(self.vision, self.language)


def check_widths(vision: QwenVisionConfig, language: LanguageConfig) -> None:
    """Raise ``ValueError`` unless the ViT's output width is the decoder's ``hidden_size``."""
    if vision.out_width != language.hidden_size:
        raise ValueError(
            f"vision out_hidden_size ({vision.out_width}) must equal the language "
            f"hidden_size ({language.hidden_size})."
        )


class QwenLanguageModel(LanguageModel):
    """:class:`LanguageModel` with :class:`~lightning_mmpar.models.hf.mrope.MRopeAttention`
    in every layer (Qwen2: q/k/v biases, M-RoPE)."""

    def __init__(self, config: LanguageConfig, mrope_section: Sequence[int]) -> None:
        super().__init__(config)
        for layer in self.layers:
            assert isinstance(layer, LlamaDecoderLayer)
            layer.self_attn = MRopeAttention(config, mrope_section)


class QwenVisionStem(FusionBlock):
    """Patch embedding and the patch layout of the batch's image grids."""

    kind = "vision"

    def __init__(self, vision: QwenVisionTower) -> None:
        super().__init__()
        self.patch_embed = vision.patch_embed

    def forward(self, pixel_values: Tensor, grid_thw: Tensor, *rest: Tensor) -> tuple[Tensor, ...]:
        return (*self.patch_embed(pixel_values, grid_thw), *rest)

    def _tally(self, tally: CostTally, n: int, t: int) -> None:
        tally.linear(self.patch_embed.config.spatial_merge_size**2 * n, self.patch_embed.proj)


class QwenVisionLayer(FusionBlock):
    """One ViT block: frame- or window-masked attention (``windowed``)."""

    kind = "vision"

    def __init__(self, block: QwenVisionBlock, config: QwenVisionConfig, windowed: bool) -> None:
        super().__init__()
        self.block, self.windowed = block, windowed
        self.head_dim, self.theta = config.width // config.heads, config.rope_theta
        self.unit = config.spatial_merge_size**2

    def forward(
        self, x: Tensor, position: Tensor, frame: Tensor, window: Tensor, *rest: Tensor
    ) -> tuple[Tensor, ...]:
        x = self._attend(x, position, window if self.windowed else frame)
        return (x, position, frame, window, *rest)

    def _attend(self, x: Tensor, position: Tensor, segments: Tensor) -> Tensor:
        """The block over ``x [B, P, D_v]``, attention masked to equal ``segments [B, P]``."""
        cos, sin = vision_cos_sin(position, self.head_dim, self.theta)
        return self.block(x, cos, sin, segment_mask(segments))

    def _tally(self, tally: CostTally, n: int, t: int) -> None:
        b, v = self.block, self.unit * n
        for proj in (b.attn.q_proj, b.attn.k_proj, b.attn.v_proj, b.attn.proj):
            tally.linear(v, proj)
        tally.attention(v, v, b.attn.q_proj.weight.shape[0])
        for name in ("fc1", "fc2", "gate_proj", "up_proj", "down_proj"):
            if hasattr(b.mlp, name):
                tally.linear(v, getattr(b.mlp, name))
        tally.keep(2 * v * b.attn.proj.weight.shape[0])


class QwenMergerBlock(FusionBlock):
    """The patch merger: ``[B, P, D_v] -> [B, P / merge^2, D]`` and which merged tokens are
    images (not padding). The tensor after ``frame`` (the window segments) is dropped, or
    passed on after them when ``keeps_slot`` (Qwen3-VL's DeepStack tokens)."""

    kind = "vision"
    keeps_slot = False

    def __init__(self, merger: QwenPatchMerger) -> None:
        super().__init__()
        self.merger = merger

    def forward(
        self, x: Tensor, position: Tensor, frame: Tensor, slot: Tensor, *rest: Tensor
    ) -> tuple[Tensor, ...]:
        kept = (slot,) if self.keeps_slot else ()
        return (*(owned(t) for t in self.merger(x, frame)), *kept, *rest)

    def _tally(self, tally: CostTally, n: int, t: int) -> None:
        tally.linear(n, self.merger.mlp[0])
        tally.linear(n, self.merger.mlp[2])


class QwenBridge(FusionBlock):
    """``h = embed(ids)``; the image tokens' embeddings replaced in order by the valid merged
    tokens (transformers' ``masked_scatter``).

    Raises:
        ValueError: the number of image tokens differs from the merged image tokens.
    """

    kind = "aligner"

    def __init__(self, embed_tokens: nn.Embedding, image_token_id: int) -> None:
        super().__init__()
        self.embed_tokens, self.image_token_id = embed_tokens, image_token_id

    family = "Qwen-VL"

    def forward(
        self, tokens: Tensor, valid: Tensor, ids: Tensor, position_ids: Tensor, sample_ids: Tensor
    ) -> tuple[Tensor, ...]:
        return (self._splice(tokens, valid, ids)[0], position_ids, sample_ids)

    def _splice(self, tokens: Tensor, valid: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
        """``h [B, T, D]`` and the image positions ``where [B, T, 1]``."""
        h = self.embed_tokens(ids)
        where = (ids == self.image_token_id)[..., None]
        images = tokens[valid]
        if int(where.sum()) != images.shape[0]:
            raise ValueError(
                f"{self.family} splice: {int(where.sum())} image tokens (id "
                f"{self.image_token_id}) in input_ids but the image grids give "
                f"{images.shape[0]} merged tokens; expand each image marker to t*h*w/merge^2 "
                "tokens (QwenVLCollator does)."
            )
        return h.masked_scatter(where, images.to(h.dtype)) + 0.0 * tokens.sum(), where

    def _tally(self, tally: CostTally, n: int, t: int) -> None:
        return None


class QwenDecoderLayer(FusionBlock):
    """One Qwen2 decoder layer: block-causal attention over packed samples, M-RoPE (its cost
    also counts an MoE FFN: Qwen3-VL-MoE's layers)."""

    kind = "language"

    def __init__(self, layer: LlamaDecoderLayer) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, h: Tensor, position_ids: Tensor, sample_ids: Tensor) -> tuple[Tensor, ...]:
        mask = block_causal_mask(sample_ids)
        out = self.layer(h, None, None, attn_mask=mask, position_ids=position_ids)
        return (out, position_ids, sample_ids)

    def _tally(self, tally: CostTally, n: int, t: int) -> None:
        attn, mlp = self.layer.self_attn, self.layer.mlp
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
            tally.linear(t, proj)
        tally.attention(t, t, attn.q_proj.weight.shape[0])
        if isinstance(mlp, MoEFeedForward):
            tally.moe(t, attn.o_proj.weight.shape[0], mlp.config, train=True)
        else:
            for name in ("gate_proj", "up_proj", "down_proj"):
                tally.linear(t, getattr(mlp, name))
        tally.keep(2 * t * attn.o_proj.weight.shape[0])


class QwenHead(FusionBlock):
    """``logits [B, T, V] = lm_head(norm(h))`` (a one-tensor tuple)."""

    kind = "head"

    def __init__(self, language: LanguageModel) -> None:
        super().__init__()
        self.norm, self.lm_head = language.norm, language.lm_head

    def forward(self, h: Tensor, position_ids: Tensor, sample_ids: Tensor) -> tuple[Tensor, ...]:
        return (self.lm_head(self.norm(h)),)

    def _tally(self, tally: CostTally, n: int, t: int) -> None:
        tally.linear(t, self.lm_head)


class QwenVLModel(nn.Module):
    """Qwen2-VL / Qwen2.5-VL: :class:`~lightning_mmpar.models.hf.qwen_vision.QwenVisionTower`
    (``vision``) and the Qwen2 decoder (``language``, :class:`LanguageModel` module names).

    Args:
        config: the towers, M-RoPE sections and image-token id
            (:func:`~lightning_mmpar.models.hf.qwen_convert.qwen_vl_config` reads a transformers
            config).
    """

    def __init__(self, config: QwenVLConfig) -> None:
        super().__init__()
        self.config = config
        self.vision = QwenVisionTower(config.vision)
        self.language = QwenLanguageModel(config.language, config.mrope_section)

    @staticmethod
    def pipeline_inputs(batch: Mapping[str, Tensor]) -> tuple[Tensor, ...]:
        """The tuple block 0 takes: the batch's :data:`QWEN_VL_KEYS` in order.

        Raises:
            ValueError: a key missing or ``position_ids`` not ``[B, 3, T]``.
        """
        missing = [k for k in QWEN_VL_KEYS if k not in batch]
        if missing or batch["position_ids"].ndim != 3:
            raise ValueError(
                f"a Qwen-VL batch needs {list(QWEN_VL_KEYS)} with position_ids [B, 3, T]; "
                f"missing {missing} (use lightning_mmpar.data.QwenVLCollator)."
            )
        return tuple(batch[k] for k in QWEN_VL_KEYS)

    def pipeline_blocks(self) -> list[FusionBlock]:
        """Ordered blocks (stem, ViT blocks, merger, bridge, decoder layers, head); new wrappers
        over the model's own modules on every call, in the model's train/eval mode."""
        vision, cfg = self.vision, self.config.vision
        blocks: list[FusionBlock] = [QwenVisionStem(vision)]
        blocks += [
            QwenVisionLayer(b, cfg, cfg.windowed(i))  # type: ignore[arg-type]
            for i, b in enumerate(vision.blocks)
        ]
        blocks += [QwenMergerBlock(vision.merger)]
        blocks += [QwenBridge(self.language.embed_tokens, self.config.image_token_id)]
        blocks += [QwenDecoderLayer(d) for d in self.language.layers]  # type: ignore[arg-type]
        blocks.append(QwenHead(self.language))
        for block in blocks:
            block.training = self.training
        return blocks

    def forward(self, batch: Mapping[str, Tensor]) -> Tensor:
        """``logits [B, T, V]`` of a collated batch (:meth:`pipeline_inputs`)."""
        state = self.pipeline_inputs(batch)
        for block in self.pipeline_blocks():
            state = block(*state)
        return state[0]


def image_token_count(grid_thw: Tensor, merge: int) -> Tensor:
    """Language tokens per image: ``t h w / merge^2`` of ``grid_thw [..., 3]``."""
    return grid_thw.prod(-1) // merge**2
