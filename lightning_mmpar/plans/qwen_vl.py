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
from functools import partial
from typing import Any, Literal

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from lightning_mmpar.layout import check_vision_batch
from lightning_mmpar.models.hf.qwen2_vl import QwenVLModel
from lightning_mmpar.models.hf.qwen3_vl_moe import Qwen3MoeVLModel
from lightning_mmpar.models.hf.qwen_vision import QwenVisionTower
from lightning_mmpar.parallel import comm
from lightning_mmpar.parallel.data import PARTIAL_OVER_TP
from lightning_mmpar.parallel.parallelize import ParallelPlan
from lightning_mmpar.parallel.tensor import StyleGroup, gather_rows, local_rows
from lightning_mmpar.plans.fusion import language_plan
from lightning_mmpar.topology import ParallelDims

__all__ = [
    "apply_qwen_vision_data_parallel",
    "check_qwen_vl_layout",
    "qwen_vision_plan",
    "qwen_vl_plan",
]

QwenVisionParallel = Literal["tp", "replicate", "dp"]


def qwen_vision_plan(model: QwenVLModel | Qwen3MoeVLModel) -> dict[str, ParallelStyle]:
    """Column / row parallel styles of the ViT blocks, the merger and (Qwen3-VL) every DeepStack
    merger (module docstring)."""
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
    levels = len(getattr(model.vision, "deepstack_merger_list", ()))
    for m in ["merger"] + [f"deepstack_merger_list.{j}" for j in range(levels)]:
        plan[f"{m}.mlp.0"] = ColwiseParallel()
        plan[f"{m}.mlp.2"] = RowwiseParallel()
    return plan


def check_qwen_vl_layout(
    model: QwenVLModel, tp: int, *, vision_parallel: str, sequence_parallel: bool
) -> None:
    """``ValueError`` naming the field, value and fix: an unknown ``vision_parallel``, sequence
    parallelism, or a size tensor parallelism must split that ``tp`` does not divide."""
    if vision_parallel not in ("tp", "replicate", "dp"):
        raise ValueError(
            f"vision_parallel ({vision_parallel!r}) must be 'tp', 'replicate' or 'dp'."
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
    return tower_plan(
        model,
        vision_parallel,
        after=partial(_vision_hooks, model, vision_parallel),
        pipeline_blocks=pipeline_blocks,
    )


def tower_plan(
    model: QwenVLModel | Qwen3MoeVLModel,
    vision_parallel: str,
    *,
    after: Callable[[ParallelDims], None],
    pipeline_blocks: Callable[[], Sequence[nn.Module]] | None,
    expert_parallel: tuple[str, ...] = (),
) -> ParallelPlan:
    """A Qwen-VL family's plan: the ViT's styles (:func:`qwen_vision_plan`, under
    ``vision_parallel == "tp"``) then the language plan, ``after`` run after them, every ViT
    block and decoder layer an activation-checkpointing unit."""
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
        expert_parallel=expert_parallel,
        after_model_parallel=(after,),
        layers=(*vision, *layers),
        pipeline_blocks=pipeline_blocks or model.pipeline_blocks,
        root=model,
    )


def apply_qwen_vision_data_parallel(
    vision: QwenVisionTower, group: dist.ProcessGroup | None
) -> None:
    """Run ``vision`` data-parallel over ``group`` (the tp group; module docstring): slice the
    rows at the patch embedding, gather the merger's output, mark every ViT parameter
    :data:`~lightning_mmpar.parallel.data.PARTIAL_OVER_TP`. Nothing when the group has one
    rank. Raises ``ValueError`` at forward time for rows not divisible by the group size."""
    tp = comm.group_size(group)
    if tp == 1:
        return

    def split(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        pixel_values, grid = args[0], args[1]
        check_vision_batch(pixel_values.shape[0], tp)
        return (local_rows(pixel_values, group), local_rows(grid, group), *args[2:])

    def gather(_module: nn.Module, _args: tuple[Any, ...], out: tuple[Tensor, Tensor]) -> Any:
        tokens, valid = out
        return gather_rows(tokens, group), gather_rows(valid.long(), group).bool()

    vision.patch_embed.register_forward_pre_hook(split)
    vision.merger.register_forward_hook(gather)
    for p in vision.parameters():
        setattr(p, PARTIAL_OVER_TP, True)


def _vision_hooks(model: QwenVLModel, vision_parallel: str, dims: ParallelDims) -> None:
    if vision_parallel != "dp" or dims.tp == 1:
        return
    if not dims.is_built:
        raise ValueError(
            "vision_parallel='dp' needs the mm_parallel strategy (MultimodalParallelStrategy), "
            "which sums the ViT's gradients over the tensor-parallel group; use "
            "vision_parallel='replicate' or 'tp' here."
        )
    apply_qwen_vision_data_parallel(model.vision, dims.get_group("tp"))
