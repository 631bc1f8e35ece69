"""The Qwen3-VL-MoE parallel plan (:class:`~lightning_mmpar.models.hf.qwen3_vl_moe.
Qwen3MoeVLModel`): one plan per tower, expert parallelism for the MoE decoder.

* **vision** (``model.vision``), per ``vision_parallel``: ``tp`` shards every ViT block by heads
  (q/k/v column, ``proj`` row parallel) and its MLP (``fc1`` column, ``fc2`` row parallel), the
  merger and every DeepStack merger (``mlp.0`` column, ``mlp.2`` row parallel: the merged
  tokens leave replicated); the patch / position embedding and norms stay replicated.
  ``replicate`` keeps a full ViT on every tp rank.
* **language** (``model.language``): the fusion model's language plan
  (:func:`~lightning_mmpar.plans.fusion.language_plan`: vocab-parallel embedding and LM head,
  GQA q/k/v column and ``o_proj`` row parallel; dense layers' SwiGLU column / row parallel;
  MoE FFNs whole on every tp rank). The per-head ``q_norm`` / ``k_norm`` weights stay whole
  and run on the local heads: each tp rank's gradient is its heads' share, so they are marked
  :data:`~lightning_mmpar.parallel.data.PARTIAL_OVER_TP` (the strategy sums them over tp).
* **experts**: every MoE FFN (``model.moe_layers()``) sharded over the ``ep`` mesh with
  all-to-all token dispatch (:func:`~lightning_mmpar.parallel.experts.apply_expert_parallel`),
  ``ep`` carved out of the data-parallel ranks (Megatron-core's expert-data-parallel group).

Sequence parallelism is refused (the bridge splices image tokens into the full sequence).
Layers (activation-checkpoint units): every ViT block and decoder layer. Sources: Megatron's
column / row patterns (Shoeybi et al. 2019), torchtitan's Qwen3 MoE ``parallelize``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Literal

from torch import nn

from lightning_mmpar.models.hf.qwen3_vl_moe import Qwen3MoeVLModel
from lightning_mmpar.parallel.data import PARTIAL_OVER_TP
from lightning_mmpar.parallel.parallelize import ParallelPlan
from lightning_mmpar.plans.qwen_vl import tower_plan
from lightning_mmpar.topology import ParallelDims

__all__ = ["check_qwen3_moe_vl_layout", "qwen3_moe_vl_plan"]

Qwen3VisionParallel = Literal["tp", "replicate"]


def check_qwen3_moe_vl_layout(
    model: Qwen3MoeVLModel, dims: ParallelDims, *, vision_parallel: str, sequence_parallel: bool
) -> None:
    """``ValueError`` naming the field, value and fix: an unknown ``vision_parallel``, sequence
    parallelism, a size tensor parallelism must split that ``tp`` does not divide, or an expert
    count ``ep`` does not divide."""
    if vision_parallel not in ("tp", "replicate"):
        raise ValueError(
            f"vision_parallel ({vision_parallel!r}) must be 'tp' or 'replicate' for Qwen3-VL-MoE."
        )
    tp = dims.tp
    if sequence_parallel and tp > 1:
        raise ValueError(
            "sequence_parallel=True is not supported for Qwen3-VL-MoE: the bridge splices image "
            "tokens into the full sequence; set sequence_parallel=False."
        )
    lang, vision, moe = model.config.language, model.config.vision, model.config.language.moe
    assert moe is not None
    sizes = [
        ("LanguageConfig.num_attention_heads", lang.num_attention_heads, tp, ""),
        ("LanguageConfig.num_key_value_heads", lang.num_key_value_heads, tp, ""),
        ("LanguageConfig.intermediate_size", lang.intermediate_size, tp, ""),
        ("LanguageConfig.vocab_size", lang.vocab_size, tp, ""),
        ("MoEConfig.num_experts", moe.num_experts, dims.ep, " (expert_parallel)"),
    ]
    if vision_parallel == "tp":
        other = " or vision_parallel='replicate'"
        sizes += [
            ("Qwen3VisionConfig.heads", vision.heads, tp, other),
            ("Qwen3VisionConfig.mlp_width", vision.mlp_width, tp, other),
            (
                "width * spatial_merge_size^2",
                vision.width * vision.spatial_merge_size**2,
                tp,
                other,
            ),
        ]
    for name, size, degree, fix in sizes:
        if size % degree:
            raise ValueError(
                f"{name} ({size}) must be divisible by {degree}; choose a parallel degree that "
                f"divides it{fix}."
            )


def qwen3_moe_vl_plan(
    model: Qwen3MoeVLModel,
    *,
    vision_parallel: Qwen3VisionParallel = "tp",
    sequence_parallel: bool = False,
    dims: ParallelDims | None = None,
    pipeline_blocks: Callable[[], Sequence[nn.Module]] | None = None,
) -> ParallelPlan:
    """The plan as data (paths from ``model``); ``pipeline_blocks``: the blocks the
    LightningModule registered (default ``model.pipeline_blocks``). With ``dims``: checked
    first (:func:`check_qwen3_moe_vl_layout`), raising its ``ValueError``."""
    if dims is not None:
        check_qwen3_moe_vl_layout(
            model, dims, vision_parallel=vision_parallel, sequence_parallel=sequence_parallel
        )
    return tower_plan(
        model,
        vision_parallel,
        after=partial(_head_norms_partial, model),
        pipeline_blocks=pipeline_blocks,
        expert_parallel=model.moe_layers(),
    )


def _head_norms_partial(model: Qwen3MoeVLModel, dims: ParallelDims) -> None:
    """Under tp, mark every decoder layer's ``q_norm`` / ``k_norm`` weight
    :data:`PARTIAL_OVER_TP`: each rank's gradient covers its own heads only."""
    if dims.tp == 1:
        return
    for layer in model.language.layers:
        for norm in ("q_norm", "k_norm"):
            setattr(getattr(layer.self_attn, norm).weight, PARTIAL_OVER_TP, True)
