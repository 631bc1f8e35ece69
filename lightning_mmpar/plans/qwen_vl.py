"""The Qwen2-VL / Qwen2.5-VL parallel plan (:class:`~lightning_mmpar.models.hf.qwen2_vl.
QwenVLModel`): one plan per tower.

* **vision** (``model.vision``), per ``vision_parallel``: ``tp`` shards every ViT block by
  heads (q/k/v column parallel, ``proj`` row parallel) and its MLP (``fc1`` / ``gate_proj`` /
  ``up_proj`` column, ``fc2`` / ``down_proj`` row parallel), and the merger (``mlp.0`` column,
  ``mlp.2`` row parallel: the merged tokens leave replicated); the patch embedding and norms
  stay replicated. ``replicate`` keeps a full ViT on every tp rank. (``dp`` is the fusion ViT's
  option only: refused here.)
* **language** (``model.language``): the fusion model's language plan unchanged
  (:func:`~lightning_mmpar.plans.fusion.language_plan`: vocab-parallel embedding and LM head,
  GQA q/k/v column and ``o_proj`` row parallel, SwiGLU); the logits are a vocab-sharded
  DTensor for :func:`lightning_mmpar.losses.caption_loss` with ``loss_parallel=True``.
  Sequence parallelism is refused: the bridge splices image tokens into the full sequence.

Layers (activation-checkpoint units): every ViT block and decoder layer. Pipeline blocks and
FSDP units: ``model.pipeline_blocks()``. Megatron's column / row patterns (Shoeybi et al.
2019); per-tower plans as torchtitan's VLM ``parallelize``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from lightning_mmpar.models.hf.qwen2_vl import QwenVLModel
from lightning_mmpar.parallel.parallelize import ParallelPlan
from lightning_mmpar.parallel.tensor import StyleGroup
from lightning_mmpar.plans.fusion import language_plan
from lightning_mmpar.topology import ParallelDims

__all__ = ["check_qwen_vl_layout", "qwen_vision_plan", "qwen_vl_plan"]

QwenVisionParallel = Literal["tp", "replicate"]


def qwen_vision_plan(model: QwenVLModel) -> dict[str, ParallelStyle]:
    """Column / row parallel styles of the ViT blocks and the merger (module docstring)."""
    plan: dict[str, ParallelStyle] = {}
    swiglu = model.config.vision.mlp == "swiglu"
    for i in range(len(model.vision.blocks)):
        p = f"blocks.{i}"
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"{p}.attn.{name}"] = ColwiseParallel()
        plan[f"{p}.attn.proj"] = RowwiseParallel()
        columns, row = (("gate_proj", "up_proj"), "down_proj") if swiglu else (("fc1",), "fc2")
        for name in columns:
            plan[f"{p}.mlp.{name}"] = ColwiseParallel()
        plan[f"{p}.mlp.{row}"] = RowwiseParallel()
    plan["merger.mlp.0"] = ColwiseParallel()
    plan["merger.mlp.2"] = RowwiseParallel()
    return plan


def check_qwen_vl_layout(
    model: QwenVLModel, tp: int, *, vision_parallel: str, sequence_parallel: bool
) -> None:
    """``ValueError`` naming the field, value and fix: an unknown ``vision_parallel``, sequence
    parallelism, or a size tensor parallelism must split that ``tp`` does not divide."""
    if vision_parallel not in ("tp", "replicate"):
        raise ValueError(
            f"vision_parallel ({vision_parallel!r}) must be 'tp' or 'replicate' for Qwen-VL."
        )
    if sequence_parallel and tp > 1:
        raise ValueError(
            "sequence_parallel=True is not supported for Qwen-VL: the bridge splices image "
            "tokens into the full sequence; set sequence_parallel=False."
        )
    lang, vision = model.config.language, model.config.vision
    sizes = [
        ("LanguageConfig.num_attention_heads", lang.num_attention_heads, ""),
        ("LanguageConfig.num_key_value_heads", lang.num_key_value_heads, ""),
        ("LanguageConfig.intermediate_size", lang.intermediate_size, ""),
        ("LanguageConfig.vocab_size", lang.vocab_size, ""),
    ]
    if vision_parallel == "tp":
        wide = vision.width * vision.spatial_merge_size**2
        other = " or vision_parallel='replicate'"
        sizes += [
            ("QwenVisionConfig.heads", vision.heads, other),
            ("QwenVisionConfig.mlp_width", vision.mlp_width, other),
            ("QwenVisionConfig.width * spatial_merge_size^2", wide, other),
        ]
    for name, size, fix in sizes:
        if size % tp:
            raise ValueError(
                f"{name} ({size}) must be divisible by tensor_parallel ({tp}); choose a "
                f"tensor_parallel that divides it{fix}."
            )


def qwen_vl_plan(
    model: QwenVLModel,
    *,
    vision_parallel: QwenVisionParallel = "tp",
    sequence_parallel: bool = False,
    dims: ParallelDims | None = None,
    pipeline_blocks: Callable[[], Sequence[nn.Module]] | None = None,
) -> ParallelPlan:
    """The plan as data (paths from ``model``); ``pipeline_blocks``: the blocks the
    LightningModule registered (default ``model.pipeline_blocks``). With ``dims``: checked
    first (:func:`check_qwen_vl_layout`), raising its ``ValueError``."""
    if dims is not None:
        check_qwen_vl_layout(
            model, dims.tp, vision_parallel=vision_parallel, sequence_parallel=sequence_parallel
        )
    groups: list[StyleGroup] = []
    if vision_parallel == "tp":
        groups.append(StyleGroup("vision", "tp", qwen_vision_plan(model)))
    groups.append(
        StyleGroup("language", "tp", language_plan(model.language, sequence_parallel=False))
    )
    vision = [f"vision.blocks.{i}" for i in range(len(model.vision.blocks))]
    layers = [f"language.layers.{i}" for i in range(len(model.language.layers))]
    return ParallelPlan(
        tensor_parallel=tuple(groups),
        layers=(*vision, *layers),
        pipeline_blocks=pipeline_blocks or model.pipeline_blocks,
        root=model,
    )
