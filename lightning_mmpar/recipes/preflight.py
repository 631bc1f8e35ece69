"""Checks of a run's layout against its model and data, before any process is launched.

Lightning launches the other ranks inside ``trainer.fit`` (``validate``, ``test``,
``predict``); errors that need the model or the data (pipeline stages vs blocks, heads vs
tensor parallelism, batch vs micro-batches, image sizes) were raised after
that, 13-20 s in, once per rank. :func:`preflight` runs the same validation functions in the
CLI's main process, from the configuration (the model's blocks counted on the meta device), so a
mistake is one ``ValueError``, printed once, within seconds. Lightning's ``LightningCLI``
``before_<subcommand>`` hooks call it (:class:`lightning_mmpar.recipes.cli.ClipLlamaCLI`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer

from lightning_mmpar.config import ParallelConfig
from lightning_mmpar.models.fusion import FusionModel
from lightning_mmpar.parallel.checkpoint import resolve, validate_checkpoint
from lightning_mmpar.parallel.checkpoint_check import HPARAMS_KEY, inspect_checkpoint
from lightning_mmpar.parallel.pipeline import partition
from lightning_mmpar.plans.fusion import check_moe_layout, validate_tensor_parallel
from lightning_mmpar.plans.fusion_vision import check_vision_batch
from lightning_mmpar.recipes.module import ClipLlamaModule
from lightning_mmpar.recipes.options import check_image_size
from lightning_mmpar.strategy import MultimodalParallelStrategy

__all__ = ["RESUME_MAY_CHANGE", "preflight"]

RESUME_MAY_CHANGE = (
    "loss",
    "plan.activation_checkpointing",
    "plan.sequence_parallel",
    "plan.vision_parallel",
    "plan.vl_combine",
)
"""Hyper-parameters a resumed run may change: loss weights (read from this run's config) and
how the model is laid out over ranks (the deprecated recomputation switch, sequence
parallelism, the vision tower's layout, the vision-language combine); they change no
checkpointed tensor and take effect. Everything else differing refuses the checkpoint before the
processes start: tower sizes, vocabulary (``vocab_multiple``), frozen parts, and ``optim`` (the
optimizer's learning rates and the schedule are restored from the checkpoint, so a new value
would be silently ignored). A checkpoint written before ``model.tensor_parallel`` became
``model.plan`` is compared under its own name (:func:`_as_saved`)."""
_RENAMED = {"plan": "tensor_parallel"}
"""Recipe hyper-parameters by their current name -> the name older checkpoints keep them under."""
_LIGHTNING_CKPT_NAMES = ("last", "best", "hpc", "registry")


def _check_model(model: ClipLlamaModule, tp: int, config: ParallelConfig | None) -> None:
    """Heads and widths vs tp (``validate_tensor_parallel``), MoE layers vs ep and sequence
    parallelism (``check_moe_layout``), pipeline stages vs the model's blocks (``partition``,
    blocks counted on a meta-device model)."""
    fusion = model._resolved_config(tp)
    if tp > 1:
        validate_tensor_parallel(fusion, tp, vision_parallel=model.plan_options.vision_parallel)
    ep = config.expert_parallel if config is not None else 1
    check_moe_layout(fusion, tp, ep, sequence_parallel=model.plan_options.sequence_parallel)
    if config is not None and config.pipeline_parallel > 1:
        with torch.device("meta"):
            blocks = len(FusionModel(fusion).pipeline_blocks())
        try:
            partition(blocks, config.num_stages)
        except ValueError as err:
            pp = config.pipeline_parallel
            raise ValueError(
                f"{err} With pipeline_parallel={pp}: virtual_pipeline <= {blocks // pp}."
            ) from None


def _check_vision_batch(batch_size: int, config: ParallelConfig) -> None:
    """``vision_parallel='dp'``: each micro-batch's images split over the tp ranks."""
    tp, n = config.tensor_parallel, config.num_micro_batches
    if tp == 1:
        return
    if config.pipeline_parallel > 1:
        what = f"each micro-batch (data.batch_size {batch_size} / micro_batches {n})"
        check_vision_batch(batch_size // n, tp, what)
    else:
        check_vision_batch(batch_size, tp, f"each batch (data.batch_size {batch_size})")


def preflight(
    trainer: Trainer,
    model: LightningModule | None,
    datamodule: Any = None,
    *,
    ckpt_path: str | None = None,
) -> None:
    """Check the layout of ``trainer`` against ``model`` and ``datamodule`` before the processes
    are launched (call it in the main process, before ``trainer.fit`` & co.).

    The world size vs the layout is checked when the strategy is built (``ParallelDims``,
    ``ParallelConfig.check_world``). Checks here: every sharded size vs tp
    (:func:`~lightning_mmpar.plans.fusion.validate_tensor_parallel`), pipeline stages vs blocks
    (:func:`~lightning_mmpar.parallel.pipeline.partition`), ``data.batch_size`` vs micro-batches
    (:meth:`ParallelConfig.check_batch_size`; under ``vision_parallel='dp'`` each micro-batch
    vs tp, :func:`~lightning_mmpar.plans.fusion_vision.check_vision_batch`) and
    ``data.image_size`` vs the ViT's
    (:func:`~lightning_mmpar.recipes.options.check_image_size`); under ``mm_parallel`` a
    ``ckpt_path`` is validated (:func:`~lightning_mmpar.parallel.checkpoint.validate_checkpoint`:
    complete, undamaged files, the same hyper-parameters apart from :data:`RESUME_MAY_CHANGE`).
    Other strategies and modules get the checks that apply.

    Raises:
        ValueError: the first failing check, naming field, value and fix.
        FileNotFoundError: ``ckpt_path`` or a file of it is missing.
    """
    strategy = trainer.strategy
    tp, config = 1, None
    if isinstance(strategy, MultimodalParallelStrategy):
        config = strategy.config
        tp = config.tensor_parallel
    if isinstance(model, ClipLlamaModule):
        _check_model(model, tp, config)
        image_size = getattr(datamodule, "image_size", None)
        if isinstance(image_size, int):
            check_image_size(image_size, model.fusion_config.vision.image_size)
    batch_size = getattr(datamodule, "batch_size", None)
    if config is not None and isinstance(batch_size, int):
        config.check_batch_size(batch_size)
        if isinstance(model, ClipLlamaModule) and model.plan_options.vision_parallel == "dp":
            _check_vision_batch(batch_size, config)
    if ckpt_path is not None and config is not None and ckpt_path not in _LIGHTNING_CKPT_NAMES:
        hparams = model.hparams if model is not None else None
        hparams, ignore = _as_saved(ckpt_path, hparams)
        validate_checkpoint(ckpt_path, hparams, ignore=ignore)


def _as_saved(path: str, hparams: Any) -> tuple[Any, tuple[str, ...]]:
    """``hparams`` and :data:`RESUME_MAY_CHANGE` under the names the checkpoint at ``path``
    keeps (:data:`_RENAMED`: a checkpoint from before a rename). Raises what
    :func:`~lightning_mmpar.parallel.checkpoint.validate_checkpoint` raises for a missing or
    unreadable checkpoint."""
    saved = inspect_checkpoint(resolve(Path(path))).meta.get(HPARAMS_KEY)
    if not isinstance(saved, Mapping) or not isinstance(hparams, Mapping):
        return hparams, RESUME_MAY_CHANGE
    old = {new: name for new, name in _RENAMED.items() if name in saved and new not in saved}
    if not old:
        return hparams, RESUME_MAY_CHANGE
    renamed = {old.get(k, k): v for k, v in hparams.items()}
    return renamed, tuple(_old_name(n, old) for n in RESUME_MAY_CHANGE)


def _old_name(name: str, old: Mapping[str, str]) -> str:
    """``name`` with its first part renamed by ``old`` (``plan.x`` -> ``tensor_parallel.x``)."""
    head, dot, rest = name.partition(".")
    return old.get(head, head) + dot + rest
