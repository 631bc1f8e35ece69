"""The pipeline stage plan of a :class:`~lightning_mmpar.parallel.pipeline.PipelineModule`.

Joins a module's blocks to :mod:`lightning_mmpar.layout.partition`: the module's own block
costs when it has them (``pipeline_block_specs()``, e.g. the recipe's ``ClipLlamaModule``), else
one unit of cost per block with the block's ``kind`` (enough for ``equal``, ``ratio`` and
explicit boundaries; ``balanced`` and ``memory`` need real costs and are refused).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from lightning.pytorch.utilities import rank_zero_warn

from lightning_mmpar.config import ParallelConfig
from lightning_mmpar.layout import (
    BlockSpec,
    Partition,
    StagePlan,
    in_flight,
    parameter_bytes,
    parse_partition,
    plan_stages,
    stage_ranks,
)

__all__ = ["module_stage_plan", "stage_plan_for"]


def _unit_specs(blocks: Sequence[Any]) -> list[BlockSpec]:
    specs = []
    for i, block in enumerate(blocks):
        total, trainable = parameter_bytes(block)
        kind = str(getattr(block, "kind", "") or type(block).__name__)
        specs.append(BlockSpec(f"block{i}", kind, 1.0, 0.0, float(total), float(trainable)))
    return specs


def _block_specs(module: Any, part: Partition) -> list[BlockSpec]:
    """One :class:`BlockSpec` per pipeline block: the module's own (``pipeline_block_specs()``)
    or :func:`_unit_specs`; the costed modes (``balanced``, ``memory``) need the module's
    (``measured`` works with either: it times the blocks)."""
    blocks = list(module.pipeline_blocks())
    specs_of = getattr(module, "pipeline_block_specs", None)
    costed = part.mode in ("balanced", "memory")
    specs: list[BlockSpec] | None = None
    if specs_of is not None:
        try:
            specs = list(specs_of())
        except ValueError:  # costs unknown here (no caption length, say): needed only to balance
            if costed:
                raise
    if specs is None and costed:
        raise ValueError(
            f"partition ({part}) balances block costs, and {type(module).__name__} has no "
            "pipeline_block_specs(); implement it (one lightning_mmpar.layout.BlockSpec per "
            "pipeline block, see ClipLlamaModule.pipeline_block_specs) or use partition='equal', "
            "'ratio:V:A:D' or explicit boundaries."
        )
    if specs is None:
        specs = _unit_specs(blocks)
    if len(specs) != len(blocks):
        raise ValueError(
            f"{type(module).__name__}.pipeline_block_specs() gave {len(specs)} specs for "
            f"{len(blocks)} pipeline blocks; return one per block, in order."
        )
    return specs


def module_stage_plan(
    module: Any,
    pipeline_parallel: int,
    virtual_pipeline: int,
    partition: str | Sequence[int],
    *,
    micro_batch_size: int = 1,
    schedule: str = "1f1b",
    micro_batches: int | None = None,
    block_seconds: Sequence[float] | None = None,
) -> StagePlan:
    """Cut ``module.pipeline_blocks()`` into ``pipeline_parallel * virtual_pipeline`` stages by
    ``partition`` (``equal``, ``balanced``, ``measured``, ``memory``, ``ratio:V:A:D`` or
    boundaries). ``block_seconds``: each block's measured forward + backward seconds
    (:func:`~lightning_mmpar.parallel.pipeline.block_timing.time_blocks`; what ``measured``
    balances, shown by the plan of any mode).

    Call before the pipeline drops other stages' parameters (the specs count them all).

    Raises:
        ValueError: ``balanced`` / ``memory`` for a module without ``pipeline_block_specs()``,
            ``measured`` without ``block_seconds``, specs or times not one per block, or any
            error of :func:`~lightning_mmpar.layout.plan_stages`.
    """
    part = parse_partition(partition, pipeline_parallel * virtual_pipeline)
    specs = _block_specs(module, part)
    if block_seconds is not None:
        if len(block_seconds) != len(specs):
            raise ValueError(
                f"block_seconds has {len(block_seconds)} times for {len(specs)} pipeline "
                "blocks; give one per block, in order (time_blocks does)."
            )
        specs = [
            dataclasses.replace(b, seconds=float(t))
            for b, t in zip(specs, block_seconds, strict=True)
        ]
    m = micro_batches or pipeline_parallel
    return plan_stages(
        specs,
        pipeline_parallel,
        virtual_pipeline,
        part,
        micro_batch_size=micro_batch_size,
        stage_ranks=stage_ranks(schedule, pipeline_parallel, virtual_pipeline),
        in_flight=in_flight(schedule, pipeline_parallel, virtual_pipeline, m),
    )


def _measured_seconds(module: Any, config: ParallelConfig) -> list[float] | None:
    """Each block's measured seconds for ``partition="measured"`` (:mod:`.block_timing`: one
    micro-batch of the first training batch, collective over every rank); ``None`` on the meta
    device (a dry run: nothing to time, ``balanced``'s FLOPs instead, with a warning)."""
    if str(config.partition) != "measured":
        return None
    if any(p.is_meta for p in module.parameters()):
        rank_zero_warn(
            "partition='measured': the parameters are on the meta device (a dry run), nothing "
            "can be timed; the plan balances FLOPs ('balanced') instead."
        )
        return None
    from lightning_mmpar.parallel.pipeline import block_timing

    inputs, target = block_timing.first_batch(module, config.num_micro_batches)
    blocks = list(module.pipeline_blocks())
    return block_timing.time_blocks(blocks, inputs, target, module.pipeline_loss)


def stage_plan_for(module: Any, config: ParallelConfig) -> StagePlan:
    """:func:`module_stage_plan` of a LightningModule for ``config`` (its ``partition``);
    activation memory at its data module's ``batch_size / micro_batches`` when it has one.
    ``partition="measured"`` times the blocks first (:func:`_measured_seconds`: collective
    over every rank)."""
    data = getattr(getattr(module, "_trainer", None), "datamodule", None)
    batch = getattr(data, "batch_size", None)
    mbs = max(1, batch // config.num_micro_batches) if isinstance(batch, int) else 1
    seconds = _measured_seconds(module, config)
    return module_stage_plan(
        module,
        config.pipeline_parallel,
        config.virtual_pipeline,
        config.partition,
        micro_batch_size=mbs,
        schedule=config.schedule,
        micro_batches=config.num_micro_batches,
        block_seconds=seconds,
    )
