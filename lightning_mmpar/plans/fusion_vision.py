"""The fusion model's vision tower modes inside a tensor-parallel group (``vision_parallel``).

* ``tp``: the ViT sharded like the LLM (Megatron's column/row patterns): per block the fused
  ``attn.in_proj`` column parallel by whole heads
  (:class:`~lightning_mmpar.parallel.tensor.FusedQKVColwiseParallel`), ``attn.out_proj`` row
  parallel, ``mlp.c_fc`` column and ``mlp.c_proj`` row parallel; embeddings, norms and ``proj``
  replicated. Never sequence-parallel (open_clip's ``grid**2 + 1`` tokens rarely divide by tp).
* ``replicate``: a full ViT on every tp rank, each computing all ``B`` images (same numbers).
* ``dp``: a full ViT on every tp rank, each encoding ``B / tp`` images: tp rank ``t`` takes rows
  ``[t B / tp, (t + 1) B / tp)`` of every (micro-)batch at the ViT's input (a forward pre-hook on
  ``vision.conv1``) and the ViT output leaving the transformer is all-gathered over tp (a forward
  hook on the last ``vision.transformer.resblocks``, :func:`~lightning_mmpar.parallel.tensor.
  gather_rows`), so ``ln_post``, pooling, ``proj`` and everything after see all ``B`` images on
  every rank as under ``replicate``. Vision compute per rank drops by ``tp``; the cost is one
  all-gather of ``[B, grid**2 + 1, width]`` per micro-batch. The layout of SGLang's
  ``--mm-enable-dp-encoder`` and vLLM's ``mm_encoder_tp_mode="data"`` (a ViT data-parallel
  inside the LLM's tp group, its outputs gathered), and of Megatron-LM's colocated multimodal
  training (issue 11); the gather is Megatron's ``gather_from_sequence_parallel_region`` with
  ``tensor_parallel_output_grad=False`` along the batch.

Under ``dp`` the hooks sit on the model's own submodules, so the layout works on the model's
``forward`` and on its pipeline blocks alike, whichever stages hold them (the blocks between the
stem and the last ViT block carry ``B / tp`` rows across stage boundaries), under FSDP2 or DDP.
The gather's backward takes this rank's rows of the (tp-replicated) gradient, so the stem's and
the ViT blocks' parameter gradients are this rank's share: they are marked
:data:`~lightning_mmpar.parallel.data.PARTIAL_OVER_TP` and the strategy sums them over tp after
backward. ``ln_post`` and ``proj`` run on all ``B`` rows and hold full gradients (not marked).
The ViT has no dropout (open_clip's patch dropout is not supported); a ``nn.Dropout`` inside it
gets the ``tensor-parallel`` RNG region under ``dp`` (each rank's rows their own masks, as one
process draws different masks per row) and ``replicated`` otherwise
(:func:`vision_dropout_regions`). Sequence parallelism (text only), MoE layers and activation
checkpointing (recomputation of a ViT block does not re-run the gather: non-reentrant
checkpointing stops once the block's saved tensors are rebuilt) compose with every layout.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from lightning_mmpar.layout import LayoutFacts, ParallelLayout, TpSize, validate
from lightning_mmpar.layout import check_vision_batch as check_vision_batch
from lightning_mmpar.layout.value import VISION_PARALLEL as VISION_PARALLEL
from lightning_mmpar.models.vision import VisionConfig, VisionTower
from lightning_mmpar.parallel import comm
from lightning_mmpar.parallel.data import PARTIAL_OVER_TP
from lightning_mmpar.parallel.random import REPLICATED, TENSOR_PARALLEL
from lightning_mmpar.parallel.tensor import FusedQKVColwiseParallel, gather_rows, local_rows
from lightning_mmpar.topology import ParallelDims

__all__ = [
    "VISION_PARALLEL",
    "VisionParallel",
    "apply_vision_data_parallel",
    "check_vision_batch",
    "check_vision_parallel",
    "parallelize_vision",
    "vision_checks",
    "vision_dropout_regions",
    "vision_plan",
    "vision_tp_sizes",
]

VisionParallel = Literal["tp", "replicate", "dp"]
"""The vision tower's modes (:data:`VISION_PARALLEL`, in documentation order)."""


def check_vision_parallel(value: str) -> None:
    """Raise ``ValueError`` naming ``value`` and the choices unless it is a known mode
    (:func:`lightning_mmpar.layout.validate`'s rule)."""
    validate(ParallelLayout(dp=None, vision_parallel=value))


def vision_tp_sizes(config: VisionConfig) -> tuple[TpSize, ...]:
    """``(module, field, value)`` sizes that must divide by tp under ``vision_parallel='tp'``."""
    return (
        ("vision.transformer.resblocks.*.attn", "VisionConfig.heads", config.heads),
        ("vision.transformer.resblocks.*.mlp", "VisionConfig.mlp_width", config.mlp_width),
    )


def vision_checks(
    config: VisionConfig, vision_parallel: VisionParallel
) -> list[tuple[str, str, int]]:
    """Deprecated (``lightning_mmpar.plans.fusion.fusion_facts`` gives the facts
    :func:`lightning_mmpar.layout.validate` checks): :func:`vision_tp_sizes` under ``tp``, else
    none.

    Raises ``ValueError`` for ``dp`` with a ViT of no blocks (the outputs are gathered after
    the last block).
    """
    warnings.warn(
        "plans.fusion_vision.vision_checks is deprecated: use plans.fusion.fusion_facts and "
        "lightning_mmpar.layout.validate.",
        DeprecationWarning,
        stacklevel=2,
    )
    layout = ParallelLayout(dp=None, vision_parallel=vision_parallel)
    validate(layout, LayoutFacts(vision_layers=config.layers))
    return list(vision_tp_sizes(config)) if vision_parallel == "tp" else []


def vision_plan(vision: VisionTower) -> dict[str, ParallelStyle]:
    """Heads of every ViT block column/row parallel; embeddings, norms and ``proj`` replicated."""
    plan: dict[str, ParallelStyle] = {}
    for i in range(len(vision.transformer.resblocks)):
        p = f"transformer.resblocks.{i}"
        plan[f"{p}.attn.in_proj"] = FusedQKVColwiseParallel()
        plan[f"{p}.attn.out_proj"] = RowwiseParallel()
        plan[f"{p}.mlp.c_fc"] = ColwiseParallel()
        plan[f"{p}.mlp.c_proj"] = RowwiseParallel()
    return plan


def vision_dropout_regions(
    vision: VisionTower, vision_parallel: VisionParallel, prefix: str = "vision"
) -> tuple[tuple[str, str], ...]:
    """``(path, region)`` for every ``nn.Dropout`` in the ViT (none in open_clip's ViT):
    ``tensor-parallel`` under ``dp`` (each tp rank holds other images), else ``replicated``."""
    region = TENSOR_PARALLEL if vision_parallel == "dp" else REPLICATED
    return tuple(
        (f"{prefix}.{name}", region)
        for name, m in vision.named_modules()
        if isinstance(m, nn.Dropout)
    )


def apply_vision_data_parallel(vision: VisionTower, group: dist.ProcessGroup | None) -> None:
    """Run ``vision`` data-parallel over ``group`` (the tp group): slice the images at the
    input of ``conv1``, gather the last block's output ``[B / tp, grid**2 + 1, width] ->
    [B, grid**2 + 1, width]``, and mark the stem's and blocks' parameters
    :data:`~lightning_mmpar.parallel.data.PARTIAL_OVER_TP`. Nothing when the group has one rank.

    Raises ``ValueError`` for a ViT without blocks, and at forward time
    (:func:`check_vision_batch`) for a batch not divisible by the group size.
    """
    tp = comm.group_size(group)
    if tp == 1:
        return
    vision_checks(vision.config, "dp")
    blocks = vision.transformer.resblocks

    def split(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        images: Tensor = args[0]
        check_vision_batch(images.shape[0], tp)
        return (local_rows(images, group), *args[1:])

    def gather(_module: nn.Module, _args: tuple[Any, ...], out: Tensor) -> Tensor:
        return gather_rows(out, group)

    vision.conv1.register_forward_pre_hook(split)
    blocks[len(blocks) - 1].register_forward_hook(gather)
    stem: list[nn.Module] = [vision.conv1, vision.ln_pre, blocks]
    params = [vision.class_embedding, vision.positional_embedding]
    params += [p for m in stem for p in m.parameters()]
    for p in params:
        setattr(p, PARTIAL_OVER_TP, True)


def parallelize_vision(vision: VisionTower, dims: ParallelDims, vision_parallel: str) -> None:
    """The hooks of ``vision_parallel='dp'`` on ``dims``' tp group (nothing for the other
    layouts or ``tp == 1``; ``tp`` styles are the plan's).

    Raises ``ValueError`` under ``dp`` with ``tp > 1`` when ``dims`` describe another strategy's
    layout (Lightning's ``ModelParallelStrategy``): only ``mm_parallel`` sums the ViT's partial
    gradients over tp, so training there would silently use ``1 / tp`` of them.
    """
    if vision_parallel != "dp" or dims.tp == 1:
        return
    if not dims.is_built:
        raise ValueError(
            "vision_parallel='dp' needs the mm_parallel strategy (MultimodalParallelStrategy), "
            "which sums the ViT's gradients over the tensor-parallel group; under this strategy "
            "use vision_parallel='replicate' or 'tp'."
        )
    apply_vision_data_parallel(vision, dims.get_group("tp"))
