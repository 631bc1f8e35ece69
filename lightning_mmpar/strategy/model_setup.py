"""The strategy's model set-up after the plan is applied: pipeline split, then data parallelism.

:func:`parallelize_module` runs these steps in torchtitan's order (``parallelize_*``: tensor
parallel in ``configure_model``, then activation checkpointing / compile, then the pipeline
split, then FSDP2 applied to each stage's chunk); each step is a function of a module, the
layout (:class:`~lightning_mmpar.topology.ParallelDims`) and the strategy's options:

1. :func:`check_pipeline_module`: ``pipeline_parallel > 1`` needs a
   :class:`~lightning_mmpar.parallel.pipeline.PipelineModule`;
2. activation checkpointing and ``torch.compile`` per block
   (:meth:`~lightning_mmpar.parallel.fsdp_options.MemoryOptions.apply_to_blocks`), and the
   expert weights' gradient scale
   (:func:`~lightning_mmpar.parallel.expert_data.prepare_expert_gradients`);
3. :func:`data_parallel_step`: the FSDP2 function applied to each piece below (``None``: no
   FSDP; the gradients are all-reduced instead,
   :class:`~lightning_mmpar.parallel.data.GradientSync`);
4. :func:`split_pipeline`: this rank's stages (a
   :class:`~lightning_mmpar.parallel.pipeline.PipelineEngine` at ``pp > 1``, one
   :class:`~lightning_mmpar.parallel.pipeline.PipelineChunk` of every block at ``pp == 1``, the
   module itself otherwise), each sharded by step 3.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from lightning_mmpar.config import ParallelConfig
from lightning_mmpar.layout import StagePlan
from lightning_mmpar.parallel import data as dpar
from lightning_mmpar.parallel.expert_data import prepare_expert_gradients
from lightning_mmpar.parallel.fsdp_options import MemoryOptions
from lightning_mmpar.parallel.pipeline import PipelineChunk, PipelineEngine, PipelineModule
from lightning_mmpar.parallel.pipeline.stages import stage_plan_for
from lightning_mmpar.topology import ParallelDims

__all__ = [
    "PipelineSplit",
    "ShardFn",
    "check_pipeline_module",
    "data_parallel_step",
    "parallelize_module",
    "split_pipeline",
]

ShardFn = Callable[..., nn.Module]
"""``shard(piece, blocks=None) -> piece``: FSDP2 over one piece of the model
(:func:`lightning_mmpar.parallel.data.shard_data_parallel` with the layout and options bound)."""


@dataclass
class PipelineSplit:
    """What :func:`split_pipeline` made of the module (at most one of the first two is set)."""

    engine: PipelineEngine | None = None
    """This rank's stages and schedule (``pipeline_parallel > 1``)."""
    chunk: PipelineChunk | None = None
    """Every block as one stage (a ``PipelineModule`` at ``pipeline_parallel == 1``)."""
    stage_plan: StagePlan | None = None
    """The partition in use (``pipeline_parallel > 1``), logged on rank 0."""


def check_pipeline_module(module: Any, config: ParallelConfig) -> None:
    """Raise ``TypeError`` when ``config.pipeline_parallel > 1`` and ``module`` does not
    implement :class:`~lightning_mmpar.parallel.pipeline.PipelineModule`."""
    if config.pipeline_parallel > 1 and not isinstance(module, PipelineModule):
        raise TypeError(
            f"pipeline_parallel={config.pipeline_parallel} needs {type(module).__name__} to "
            "implement pipeline_blocks(), pipeline_inputs() and pipeline_loss() "
            "(lightning_mmpar.parallel.pipeline.PipelineModule); or set pipeline_parallel=1."
        )


def data_parallel_step(
    module: nn.Module,
    dims: ParallelDims,
    config: ParallelConfig,
    memory: MemoryOptions,
    device: torch.device,
) -> ShardFn | None:
    """FSDP2 for each piece of ``module``, or ``None`` when nothing is sharded: another
    ``data_parallel`` than ``"fsdp"``, one data-parallel rank with no memory option that needs
    FSDP2 (``memory.needs_fsdp``), or a module that sharded itself in ``configure_model``."""
    wanted = config.data_parallel == "fsdp" and (dims.dp > 1 or memory.needs_fsdp)
    if not wanted or dpar.has_fsdp(module):
        return None
    fsdp_kwargs = memory.fsdp_kwargs(device)

    def shard(piece: nn.Module, blocks: Sequence[nn.Module] | None = None) -> nn.Module:
        return dpar.shard_data_parallel(piece, dims, blocks, **fsdp_kwargs)

    return shard


def split_pipeline(
    module: Any,
    config: ParallelConfig,
    dims: ParallelDims,
    device: torch.device,
    shard: ShardFn | None,
) -> PipelineSplit:
    """Cut ``module`` into this rank's pipeline pieces and apply ``shard`` to each (FSDP2 one
    unit per block); a module that is no ``PipelineModule`` is one piece, sharded as a tree.

    ``pipeline_parallel > 1``: the stage plan of ``config.partition``
    (:func:`~lightning_mmpar.parallel.pipeline.stages.stage_plan_for`, logged on rank 0) and a
    :class:`~lightning_mmpar.parallel.pipeline.PipelineEngine` on the ``pp`` group that shards
    its chunks before it builds the stages. Collective over ``pp`` and ``dp``."""
    if config.pipeline_parallel > 1:
        plan = stage_plan_for(module, config)
        rank_zero_info(plan.table())
        wrap = None if shard is None else lambda chunk: shard(chunk, chunk.blocks)
        pp_group = dims.get_mesh("pp").get_group()
        engine = PipelineEngine(module, config, pp_group, device, wrap, stage_ranges=plan.ranges)
        return PipelineSplit(engine=engine, stage_plan=plan)
    if isinstance(module, PipelineModule):
        chunk = PipelineChunk(list(module.pipeline_blocks()))
        if shard is not None:
            shard(chunk, chunk.blocks)
        return PipelineSplit(chunk=chunk)
    if shard is not None:
        shard(module)
    return PipelineSplit()


def parallelize_module(
    module: Any,
    dims: ParallelDims,
    config: ParallelConfig,
    memory: MemoryOptions,
    device: torch.device,
) -> PipelineSplit:
    """Steps 1-4 of the module docstring on ``module`` (its plan applied in
    ``configure_model``). Raises ``TypeError`` (step 1) or ``ValueError`` (``expert_parallel``
    without expert-parallel layers). Collective over ``pp``, ``dp`` and ``edp``."""
    check_pipeline_module(module, config)
    memory.apply_to_blocks(module)  # activation checkpointing, compile: before any sharding
    prepare_expert_gradients(module, dims.ep)
    shard = data_parallel_step(module, dims, config, memory, device)
    return split_pipeline(module, config, dims, device, shard)
