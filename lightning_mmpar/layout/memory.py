"""Exact per-rank parameter, gradient and optimizer-state bytes of a layout (pure Python).

For one rank (its ``pp``, ``tp``, ``dp`` / ``edp`` / ``ep`` coordinates) the parameters it
holds are those of its pipeline stages (:func:`stage_blocks`), each reduced to the local shard
the strategy leaves on that rank:

1. tensor parallelism splits ``ParamSpec.tp_dim`` by ``tp`` (Megatron's column / row / vocab
   shards); expert weights are split on dim 0 by ``ep`` (experts per rank) instead;
2. FSDP2 (``data_parallel="fsdp"``, ``dp > 1``) shards every non-scalar dense parameter over
   ``dp`` on the dim ``lightning_mmpar.parallel.data.shard_placement`` picks (dim 0 when it
   divides, else the largest dim that does, else dim 0 padded), and expert weights over ``edp``
   on dim 0 when ``edp > 1``; a rank holds ``torch.chunk``'s piece (chunks of
   ``ceil(n / dp)`` rows, the last ranks' shorter or empty);
3. 0-dim parameters and everything under ``ddp`` stay whole.

Gradients: the trainable local shards (same bytes), except ``ParamSpec.full_grad`` ones, whose
gradient is the whole tensor-parallel tensor (``tp`` times the shard) when FSDP does not shard
them. Optimizer: AdamW's ``exp_avg`` and
``exp_avg_sq`` (two more copies of each trainable shard) and its ``step``, a 4-byte float32
scalar tensor per trainable parameter (torch's ``_get_scalar_dtype()``).
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_mmpar.layout.model import ModelSpec, ParamSpec
from lightning_mmpar.layout.partition import plan_stages
from lightning_mmpar.layout.schedules import in_flight, stage_ranks
from lightning_mmpar.layout.stages import StagePlan
from lightning_mmpar.layout.value import ParallelLayout

__all__ = [
    "StateBytes",
    "layout_stage_plan",
    "local_shape",
    "shard_dim",
    "stage_blocks",
    "state_bytes",
]

STEP_BYTES = 4
"""AdamW's ``step`` state: a float32 0-dim tensor per parameter."""


@dataclass(frozen=True)
class StateBytes:
    """Bytes one rank holds for training state."""

    parameters: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer


def layout_stage_plan(model: ModelSpec, layout: ParallelLayout) -> StagePlan:
    """The stage cut the strategy makes for ``layout``
    (``lightning_mmpar.parallel.pipeline.stages.module_stage_plan``): ``layout.partition`` at
    its micro-batch size, stages on the schedule's ranks with its in-flight micro-batches
    (they weigh activations in ``memory`` mode; the other modes ignore them).

    Raises:
        ValueError: a partition the model cannot take (:func:`~lightning_mmpar.layout.
            partition.plan_stages`).
    """
    pp, v = layout.pp, layout.virtual
    return plan_stages(
        model.blocks,
        pp,
        v,
        layout.partition,
        micro_batch_size=layout.micro_batch_size,
        stage_ranks=stage_ranks(layout.schedule, pp, v),
        in_flight=in_flight(layout.schedule, pp, v, layout.num_micro_batches),
    )


def stage_blocks(model: ModelSpec, layout: ParallelLayout, pp_rank: int) -> list[int]:
    """Block indices held by pipeline rank ``pp_rank``: stage ``s`` runs on ``s % pp`` (loop)
    or, on the V schedules, rank ``r`` holds stages ``r`` and ``2 * pp - 1 - r``.

    Raises:
        ValueError: ``pp_rank`` outside ``0 .. pp - 1`` or a partition the model cannot take.
    """
    if not 0 <= pp_rank < layout.pp:
        raise ValueError(f"pp_rank ({pp_rank}) must be in 0..{layout.pp - 1} (pipeline_parallel).")
    if layout.pp == 1:
        return list(range(len(model.blocks)))
    plan = layout_stage_plan(model, layout)
    ranks = stage_ranks(layout.schedule, layout.pp, layout.virtual)
    return [i for r, blocks in zip(ranks, plan.ranges, strict=True) if r == pp_rank for i in blocks]


def shard_dim(shape: tuple[int, ...], n: int) -> int:
    """FSDP2's shard dim of a local ``shape`` over ``n`` ranks
    (``lightning_mmpar.parallel.data.shard_placement``)."""
    if shape[0] % n == 0:
        return 0
    even = [d for d, size in enumerate(shape) if size % n == 0]
    return max(even, key=lambda d: (shape[d], -d)) if even else 0


def _chunk(size: int, n: int, index: int) -> int:
    step = -(-size // n)
    return max(0, min(step, size - index * step))


def tp_local_shape(param: ParamSpec, layout: ParallelLayout) -> tuple[int, ...]:
    """The shape after tensor (or expert) parallelism, before FSDP."""
    shape = list(param.shape)
    if param.expert and shape:
        shape[0] //= layout.ep
    elif param.tp_dim is not None and layout.tp > 1:
        shape[param.tp_dim] //= layout.tp
    return tuple(shape)


def fsdp_group(param: ParamSpec, layout: ParallelLayout) -> int:
    """Ranks FSDP2 shards ``param`` over (1: not sharded)."""
    if layout.data_parallel != "fsdp" or layout.dp_size == 1 or not param.shape:
        return 1
    if param.expert:
        return layout.edp
    return layout.dp_size


def local_shape(
    param: ParamSpec, layout: ParallelLayout, coords: dict[str, int]
) -> tuple[int, ...]:
    """``param``'s local shard on the rank at ``coords`` (``dp``, ``edp`` keys used)."""
    shape = list(tp_local_shape(param, layout))
    n = fsdp_group(param, layout)
    if n > 1:
        index = coords.get("edp", 0) if param.expert else coords.get("dp", 0)
        d = 0 if param.expert else shard_dim(tuple(shape), n)
        shape[d] = _chunk(shape[d], n, index)
    return tuple(shape)


def state_bytes(model: ModelSpec, layout: ParallelLayout, coords: dict[str, int]) -> StateBytes:
    """Parameter, gradient and AdamW state bytes of the rank at ``coords`` (keys ``pp``,
    ``dp``, ``edp``; missing ones are 0), exactly as the strategy leaves them (module docstring).

    Raises:
        ValueError: ``coords["pp"]`` outside the pipeline (see :func:`stage_blocks`).
    """
    blocks = set(stage_blocks(model, layout, coords.get("pp", 0)))
    params = grads = moments = steps = 0
    for p in model.params:
        if p.block not in blocks:
            continue
        n = 1
        for d in local_shape(p, layout, coords):
            n *= d
        size = n * p.element_size
        params += size
        if p.trainable:
            grads += size
            moments += 2 * size
            if p.full_grad and layout.tp > 1 and fsdp_group(p, layout) == 1:
                grads += size * (layout.tp - 1)
            steps += 1
    return StateBytes(params, grads, moments + STEP_BYTES * steps)
