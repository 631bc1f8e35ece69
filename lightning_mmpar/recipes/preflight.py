"""Checks of a run's layout against its model and data, before any process is launched.

Lightning launches the other ranks inside ``trainer.fit`` (``validate``, ``test``,
``predict``); errors that need the model or the data (pipeline stages vs blocks, heads vs
tensor parallelism, batch vs micro-batches, image sizes) were raised after
that, 13-20 s in, once per rank. :func:`preflight` runs the same validation
(:func:`lightning_mmpar.layout.validate`, the strategy's and the planner's check) in the CLI's
main process, from the configuration (the model's blocks counted on the meta device), so a
mistake is one ``ValueError``, printed once, within seconds. Lightning's ``LightningCLI``
``before_<subcommand>`` hooks call it (:class:`lightning_mmpar.recipes.cli.ClipLlamaCLI`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningModule, Trainer

from lightning_mmpar.data.digits import (
    CLASS_NAMES,
    DIGITS_SAMPLES,
    DigitsCaptions,
    split_sizes,
)
from lightning_mmpar.layout import LayoutFacts, ParallelLayout, validate
from lightning_mmpar.parallel.checkpoint import (
    HPARAMS_KEY,
    inspect_checkpoint,
    resolve,
    validate_checkpoint,
)
from lightning_mmpar.plans.fusion import fusion_facts
from lightning_mmpar.recipes.module import ClipLlamaModule
from lightning_mmpar.recipes.options import check_image_size
from lightning_mmpar.strategy import MultimodalParallelStrategy

__all__ = [
    "RESUME_MAY_CHANGE",
    "check_training_batches",
    "layout_and_facts",
    "packs",
    "preflight",
    "vision_ranks_refusal",
]

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


def layout_and_facts(
    trainer: Trainer, model: LightningModule | None, datamodule: Any = None
) -> tuple[ParallelLayout, LayoutFacts]:
    """The run's layout (the ``mm_parallel`` strategy's, with the recipe model's
    ``plan`` options; one rank of everything under another strategy) and what it is
    checked against: the world size, ``data.batch_size`` (for data that packs several samples
    per row, ``data.rows_multiple``: a batch's row count varies, every one a multiple of it),
    ``data.max_length`` and the recipe model's facts
    (:func:`~lightning_mmpar.plans.fusion.fusion_facts` of its configuration at this tp,
    pipeline blocks counted on the meta device)."""
    strategy = trainer.strategy
    layout = ParallelLayout(dp=None)
    if isinstance(strategy, MultimodalParallelStrategy):
        layout = strategy.config.layout
    batch, length = (getattr(datamodule, k, None) for k in ("batch_size", "max_length"))
    run: dict[str, Any] = {
        "world_size": getattr(trainer, "world_size", None),
        "batch_size": batch if isinstance(batch, int) else None,
        "sequence_length": length if isinstance(length, int) else None,
    }
    rows = _packed_rows_multiple(datamodule)
    if rows is not None:  # a packed batch's rows vary: only their multiple is known
        run |= {"batch_size": rows, "batch_name": PACKED_ROWS}
    if not isinstance(model, ClipLlamaModule):
        return layout, LayoutFacts(**run)
    options = model.plan_options
    layout = replace(
        layout, vision_parallel=options.vision_parallel, sequence_parallel=options.sequence_parallel
    )
    fusion = model._resolved_config(layout.tp)
    return layout, replace(fusion_facts(fusion, count_blocks=layout.pp > 1), **run)


PACKED_ROWS = "data.rows_multiple"
"""What a packed batch's rows are checked with (:func:`layout_and_facts`)."""
_PACKED_NOTE = (
    " data.pack: true puts the data.batch_size samples in a varying number of rows, padded to "
    "a multiple of data.rows_multiple; the rows are what the pipeline splits."
)


def packs(datamodule: Any) -> bool:
    """Whether ``datamodule`` packs several samples per row (its ``collate_args``' ``pack``):
    a batch's row count then varies (the planner's ``--samples-per-row``, the check of
    ``data.rows_multiple``)."""
    collate = getattr(datamodule, "collate_args", None)
    return isinstance(collate, dict) and bool(collate.get("pack"))


def _packed_rows_multiple(datamodule: Any) -> int | None:
    """``data.rows_multiple`` of a data module that packs samples into rows, else ``None``."""
    if not packs(datamodule):
        return None
    rows = datamodule.collate_args.get("rows_multiple", 1)
    return rows if isinstance(rows, int) else None


def preflight(
    trainer: Trainer,
    model: LightningModule | None,
    datamodule: Any = None,
    *,
    ckpt_path: str | None = None,
    fit: bool = False,
) -> None:
    """Check the layout of ``trainer`` against ``model`` and ``datamodule`` before the processes
    are launched (call it in the main process, before ``trainer.fit`` & co.).

    One :func:`lightning_mmpar.layout.validate` of the layout (:func:`layout_and_facts`): the
    strategy's own rules (run again with the world size), every sharded size vs tp, MoE layers
    vs ep and sequence parallelism, the text length vs sequence parallelism, pipeline stages vs
    blocks, ``data.batch_size`` (packed data: ``data.rows_multiple``) vs micro-batches and,
    under ``vision_parallel='dp'``, each micro-batch vs tp; then ``data.image_size`` vs the ViT's
    (:func:`~lightning_mmpar.recipes.options.check_image_size`); under ``mm_parallel`` a
    ``ckpt_path`` is validated (:func:`~lightning_mmpar.parallel.checkpoint.validate_checkpoint`:
    complete, undamaged files, the same hyper-parameters apart from :data:`RESUME_MAY_CHANGE`).
    Other strategies and modules get the checks that apply. ``vision_ranks`` with the digits
    caption data (one image per sample, not ragged) or with pretrained towers is refused
    (:func:`vision_ranks_refusal`). With ``fit`` (the CLI's ``fit``),
    the digits data must leave every data-parallel rank a training batch
    (:func:`check_training_batches`).

    Raises:
        ValueError: the first failing check, naming field, value and fix.
        FileNotFoundError: ``ckpt_path`` or a file of it is missing.
    """
    layout, facts = layout_and_facts(trainer, model, datamodule)
    try:
        validate(layout, facts)
    except ValueError as err:
        if facts.batch_name == PACKED_ROWS and str(err).startswith(PACKED_ROWS):
            raise ValueError(f"{err}{_PACKED_NOTE}") from None
        raise
    used = isinstance(model, ClipLlamaModule) and model.pretrained.used
    refused = vision_ranks_refusal(datamodule, layout.vision_ranks, pretrained=used)
    if layout.vision_ranks and refused is not None:
        raise ValueError(refused)
    if fit and isinstance(datamodule, DigitsCaptions):
        check_training_batches(datamodule, _dp_size(layout, facts.world_size))
    if isinstance(model, ClipLlamaModule) and model.fixed_image_size:
        image_size = getattr(datamodule, "image_size", None)
        if isinstance(image_size, int):
            check_image_size(image_size, model.fusion_config.vision.image_size)
    mm_parallel = isinstance(trainer.strategy, MultimodalParallelStrategy)
    if ckpt_path is not None and mm_parallel and ckpt_path not in _LIGHTNING_CKPT_NAMES:
        hparams = model.hparams if model is not None else None
        hparams, ignore = _as_saved(ckpt_path, hparams)
        validate_checkpoint(ckpt_path, hparams, ignore=ignore)


def vision_ranks_refusal(
    datamodule: Any, vision_ranks: int | None = None, *, pretrained: bool = False
) -> str | None:
    """Why the run cannot put the vision tower on ranks of its own (non-colocated towers,
    ``vision_ranks`` > 0), or ``None`` when it can: with ``pretrained`` (the model reads
    pretrained towers, ``model.pretrained``), which the vision ranks do not read yet
    (:meth:`~lightning_mmpar.recipes.module.ClipLlamaModule.use_tower_role` refuses them), or
    with a ``datamodule`` that cannot feed them: they take ragged batches (``pixel_values``,
    ``image_mask``), which the digits caption data (one image per sample) does not give.
    :func:`preflight` raises it as a ``ValueError``; the layout planner
    (:mod:`lightning_mmpar.recipes.planner`) offers no non-colocated layout then and refuses
    ``--vision-ranks N`` with it. ``vision_ranks`` (the count refused) goes in the text when
    given."""
    count = "" if vision_ranks is None else f"{vision_ranks}: "
    if pretrained:
        return (
            f"vision_ranks ({count}the vision tower on ranks of its own, non-colocated towers) "
            "does not read pretrained towers yet (model.pretrained); train from scratch or set "
            "vision_ranks=0."
        )
    if not isinstance(datamodule, DigitsCaptions):
        return None
    return (
        f"vision_ranks ({count}the vision tower on ranks of its own) takes ragged batches "
        f"(pixel_values, image_mask); data {type(datamodule).__name__} gives one image per "
        "sample. Use a ragged data module (e.g. lightning_mmpar.data.DigitsVQA, "
        "recipes/digits_vqa_cpu.yaml, or a ConversationDataModule) or vision_ranks=0."
    )


def check_training_batches(data: DigitsCaptions, dp: int) -> None:
    """Refuse a digits split that leaves a data-parallel rank no training batch.

    The training loader drops its last partial batch and Lightning's ``DistributedSampler``
    gives each of the ``dp`` ranks ``ceil(train / dp)`` of the training digits
    (:func:`~lightning_mmpar.data.digits.split_sizes` of ``data.val_fraction``); fewer than
    ``data.batch_size`` is no step at all. Raises ``ValueError`` naming ``data.val_fraction``
    and ``data.batch_size``, the samples missing and the largest ``val_fraction`` (and
    ``batch_size``) that train.
    """
    train, _ = split_sizes(data.val_fraction)
    per_rank, batch = -(-train // dp), data.batch_size
    if per_rank >= batch:
        return
    need = (batch - 1) * dp + 1  # the fewest training digits with ceil(train / dp) >= batch
    most = math.floor((DIGITS_SAMPLES - need) / DIGITS_SAMPLES * 1e4) / 1e4
    fix = f"Use data.val_fraction <= {most} (>= {batch} digits per rank) or"
    if DIGITS_SAMPLES - need < len(CLASS_NAMES):  # no split leaves that many: a smaller batch
        fix = f"No val_fraction leaves {batch} digits per rank: use"
    raise ValueError(
        f"data.val_fraction ({data.val_fraction}) leaves {train} of the {DIGITS_SAMPLES} digits "
        f"for training: {per_rank} per data-parallel rank (dp {dp}), {batch - per_rank} short "
        f"of one batch of data.batch_size ({batch}; the last partial batch is dropped), so "
        f"fit would run no step. {fix} data.batch_size <= {per_rank}."
    )


def _dp_size(layout: ParallelLayout, world_size: int | None) -> int:
    """Data-parallel ranks: the layout's ``dp``, else ``world / (tp * pp)``."""
    if layout.dp is not None:
        return layout.dp
    return max(1, ((world_size or 1) - layout.vision_ranks) // (layout.tp * layout.pp))


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
