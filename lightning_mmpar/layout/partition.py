"""Cut an ordered list of costed blocks into pipeline stages: equal, ratio, balanced, measured,
memory, explicit boundaries; ``pp * v`` stages (virtual / interleaved stages in every mode).

Pure Python, model-agnostic: a :class:`BlockSpec` is a name, a kind and four numbers per block
(a fusion model's come from ``FusionBlock.cost``, see ``ClipLlamaModule.pipeline_block_specs``).
Stage ``s`` runs on pipeline rank ``s % pp`` (Megatron's loop layout of virtual stages); a stage
may hold blocks of different towers (the boundary carries text hidden states and image tokens).

Modes (``partition=``):

* ``equal``: ``n // S`` blocks per stage, earlier stages take the remainder (what
  ``lightning_mmpar.parallel.pipeline.partition`` does; identical ranges).
* ``ratio:a:b:c``: ``a`` stages for the vision tower, ``b`` for the aligner (bridge, adapters),
  ``c`` for the decoder (language layers and the head); ``a + b + c = pp * v``; each tower's
  blocks split as ``equal`` over its stages (Megatron-LM's encoder/decoder stage split).
* ``balanced``: minimise the largest stage FLOPs, exactly (dynamic programming over contiguous
  splits, the linear-partition problem; DeepSpeed's ``partition_method="parameters"`` balances a
  proxy instead). Among optimal plans the one with the least sum of squared stage costs wins,
  then the earliest cuts: deterministic.
* ``measured``: the same minimisation on measured seconds (:attr:`BlockSpec.seconds`: each
  block's forward + backward of one micro-batch, timed by the strategy at set-up); where
  per-operator overhead, not FLOPs, sets a block's time (small blocks, CPUs), FLOPs mis-price
  the stages. Blocks without times (the planner, a dry run, a preview: nothing was timed) are
  cut as ``balanced``.
* ``memory``: the same minimisation on stage bytes (below), optionally under a limit.
* explicit boundaries ``[b1, ..., b_{S-1}]``: the first block of stages ``1 .. S-1``.

Stage bytes: see :mod:`lightning_mmpar.layout.stages`.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from lightning_mmpar.layout.stages import BlockSpec, StagePlan, gib

__all__ = [
    "Partition",
    "compare_modes",
    "default_ratio",
    "equal_ranges",
    "parse_partition",
    "plan_stages",
    "tower_of",
]

TOWERS = ("vision", "aligner", "decoder")
"""The towers of ``ratio``; a block's tower comes from its kind (:func:`tower_of`)."""
_TOWER_OF_KIND = {
    "vision": "vision",
    "aligner": "aligner",
    "language": "decoder",
    "head": "decoder",
}
_FIX = (
    "use 'equal', 'balanced', 'measured', 'memory', 'ratio:V:A:D' (vision:aligner:decoder "
    "stage counts) or a list of stage boundaries such as [4, 9, 14]"
)


@dataclass(frozen=True)
class Partition:
    """A parsed ``partition=`` value (:func:`parse_partition`)."""

    mode: str
    """One of ``equal``, ``ratio``, ``balanced``, ``measured``, ``memory``, ``explicit``."""
    ratio: tuple[int, ...] = ()
    """``ratio``: stage counts of vision, aligner, decoder."""
    boundaries: tuple[int, ...] = ()
    """``explicit``: first block index of stages ``1 .. S-1``."""

    def __str__(self) -> str:
        if self.mode == "ratio":
            return "ratio:" + ":".join(map(str, self.ratio))
        if self.mode == "explicit":
            return "[" + ", ".join(map(str, self.boundaries)) + "]"
        return self.mode


def parse_partition(
    value: str | Sequence[int] | Partition, num_stages: int | None = None
) -> Partition:
    """Validate a ``partition=`` value without a model (config time).

    Accepts ``"equal"``, ``"balanced"``, ``"measured"``, ``"memory"``, ``"ratio:2:3:3"``,
    boundaries as a list of ints or a string ``"4,9,14"``. ``num_stages`` (``pp * v``), when
    known, also checks the ratio's sum and the number of boundaries.

    Raises:
        ValueError: unknown mode, malformed ratio (three non-negative ints, not all zero),
            boundaries not strictly increasing from 1, or not matching ``num_stages``.
    """
    if isinstance(value, Partition):
        part = value
    elif isinstance(value, str):
        part = _parse_text(value.strip())
    else:
        part = _explicit(value, repr(value))
    if num_stages is not None:
        if part.mode == "ratio" and sum(part.ratio) != num_stages:
            raise ValueError(
                f"partition {str(part)!r}: the ratio sums to {sum(part.ratio)} stages, the "
                f"pipeline has {num_stages} (pipeline_parallel * virtual_pipeline); make the "
                f"vision:aligner:decoder counts sum to {num_stages}."
            )
        if part.mode == "explicit" and len(part.boundaries) != num_stages - 1:
            raise ValueError(
                f"partition {part}: {len(part.boundaries)} boundaries for {num_stages} stages; "
                f"give {num_stages - 1} (the first block index of stages 1..{num_stages - 1})."
            )
    return part


def _parse_text(text: str) -> Partition:
    if text in ("equal", "balanced", "measured", "memory"):
        return Partition(text)
    if text.startswith("ratio:"):
        fields = text.split(":")[1:]
        if len(fields) != 3 or not all(f.strip().isdigit() for f in fields):
            raise ValueError(
                f"partition {text!r}: a ratio is three non-negative stage counts "
                "'ratio:V:A:D' (vision:aligner:decoder), e.g. 'ratio:2:3:3'."
            )
        ratio = tuple(int(f) for f in fields)
        if sum(ratio) == 0:
            raise ValueError(f"partition {text!r}: the ratio has no stages; {_FIX}.")
        return Partition("ratio", ratio=ratio)
    pieces = [p.strip() for p in text.strip("[]").split(",")]
    if text and all(p.lstrip("-").isdigit() for p in pieces):
        return _explicit([int(p) for p in pieces], repr(text))
    raise ValueError(f"partition {text!r} is not a known mode; {_FIX}.")


def _explicit(value: Sequence[int], shown: str) -> Partition:
    items = list(value)
    if not items or not all(isinstance(b, int) and not isinstance(b, bool) for b in items):
        raise ValueError(f"partition {shown}: boundaries must be a non-empty list of ints; {_FIX}.")
    if items[0] < 1 or any(b >= c for b, c in itertools.pairwise(items)):
        raise ValueError(
            f"partition {shown}: boundaries must be strictly increasing block indices >= 1 "
            "(the first block of stages 1..S-1); sort them and drop repeats."
        )
    return Partition("explicit", boundaries=tuple(items))


def tower_of(kind: str) -> str:
    """``vision`` -> vision, ``aligner`` -> aligner, ``language`` / ``head`` -> decoder.

    Raises:
        ValueError: any other kind (``ratio`` cannot place it).
    """
    if kind not in _TOWER_OF_KIND:
        raise ValueError(
            f"block kind {kind!r} belongs to no tower of a ratio partition (kinds: "
            f"{sorted(_TOWER_OF_KIND)}); use 'balanced', 'memory' or explicit boundaries."
        )
    return _TOWER_OF_KIND[kind]


def plan_stages(
    blocks: Sequence[BlockSpec],
    pipeline_parallel: int,
    virtual_pipeline: int = 1,
    partition: str | Sequence[int] | Partition = "equal",
    *,
    micro_batch_size: int = 1,
    memory_limit_bytes: float | None = None,
    stage_ranks: Sequence[int] | None = None,
    in_flight: Sequence[int] | None = None,
) -> StagePlan:
    """Cut ``blocks`` into ``pipeline_parallel * virtual_pipeline`` contiguous stages.

    ``memory_limit_bytes`` (any mode): the plan's largest :attr:`StagePlan.stage_bytes` must fit.
    ``stage_ranks`` / ``in_flight``: each stage's pipeline rank and in-flight micro-batches under
    the schedule (default: loop layout, 1F1B's ``pp - rank``); they weigh activations in
    ``memory`` mode and label the table.

    Raises:
        ValueError: bad sizes, fewer blocks than stages, an invalid partition (see
            :func:`parse_partition`), a ratio tower with fewer blocks than its stages or with
            blocks but no stage, boundaries out of range, or a memory limit no plan of this mode
            satisfies (naming the limit, the best achievable bytes and the fix).
    """
    sizes = {"pipeline_parallel": pipeline_parallel, "virtual_pipeline": virtual_pipeline}
    for name, v in {**sizes, "micro_batch_size": micro_batch_size}.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} ({v!r}) must be an int >= 1.")
    stages = pipeline_parallel * virtual_pipeline
    part = parse_partition(partition, stages)
    blocks = tuple(blocks)
    if len(blocks) < stages:
        raise ValueError(
            f"pipeline stages ({stages} = pipeline_parallel * virtual_pipeline) exceed the "
            f"model's pipeline blocks ({len(blocks)}); use at most {len(blocks)} stages or a "
            "deeper model."
        )
    ranks, flight = tuple(stage_ranks or ()), tuple(in_flight or ())
    shape = StagePlan(
        str(part), pipeline_parallel, virtual_pipeline, [], blocks, micro_batch_size, ranks, flight
    )
    for name, given in (("stage_ranks", stage_ranks), ("in_flight", in_flight)):
        if given is not None and len(given) != stages:
            raise ValueError(f"{name} has {len(given)} entries for {stages} stages; give one each.")
    weights = tuple(_in_flight(shape, stages))
    ranges = _cached_ranges(part, blocks, stages, pipeline_parallel, micro_batch_size, weights)
    plan = replace(shape, ranges=list(ranges))
    if memory_limit_bytes is not None and max(plan.stage_bytes) > memory_limit_bytes * (1 + 1e-9):
        raise _over_limit(plan, part, memory_limit_bytes)
    return plan


def _over_limit(plan: StagePlan, part: Partition, limit: float) -> ValueError:
    """The error of a plan whose largest stage exceeds ``limit`` bytes, naming the best
    ``memory`` plan of the same pipeline."""
    best = plan
    if part.mode != "memory":
        best = plan_stages(
            plan.blocks,
            plan.pipeline_parallel,
            plan.virtual_pipeline,
            "memory",
            micro_batch_size=plan.micro_batch_size,
            stage_ranks=plan.stage_ranks or None,
            in_flight=plan.in_flight or None,
        )
    return ValueError(
        f"memory_limit ({gib(limit)} per stage) is exceeded by partition "
        f"{part} ({gib(max(plan.stage_bytes))}); the best achievable at pp "
        f"{plan.pipeline_parallel} x v {plan.virtual_pipeline}, micro-batch "
        f"{plan.micro_batch_size} is {gib(max(best.stage_bytes))} (partition 'memory'). Raise "
        "the limit, use partition='memory', more pipeline stages, a smaller micro-batch, or "
        "freeze more."
    )


def _in_flight(shape: StagePlan, stages: int) -> list[int]:
    """Per-stage in-flight micro-batches of a plan's schedule (its ranges not needed)."""
    pp = shape.pipeline_parallel
    ranks = list(shape.stage_ranks) or [s % pp for s in range(stages)]
    return list(shape.in_flight) or [pp - r for r in ranks]


@functools.lru_cache(maxsize=4096)
def _cached_ranges(
    part: Partition,
    blocks: tuple[BlockSpec, ...],
    stages: int,
    pp: int,
    mbs: int,
    flight: tuple[int, ...],
) -> tuple[range, ...]:
    """:func:`_ranges`, memoised: the planner asks for the same cut thousands of times."""
    return tuple(_ranges(part, blocks, stages, pp, mbs, flight))


def _ranges(
    part: Partition,
    blocks: tuple[BlockSpec, ...],
    stages: int,
    pp: int,
    mbs: int,
    flight: Sequence[int],
) -> list[range]:
    n = len(blocks)
    if part.mode == "equal":
        return equal_ranges(0, n, stages)
    if part.mode == "explicit":
        if part.boundaries[-1] >= n:
            raise ValueError(
                f"partition {part}: boundary {part.boundaries[-1]} is out of range for {n} "
                f"blocks; every boundary must be in 1..{n - 1}."
            )
        bounds = [0, *part.boundaries, n]
        return [range(bounds[s], bounds[s + 1]) for s in range(stages)]
    if part.mode == "ratio":
        return _ratio_ranges(part, blocks)
    if part.mode in ("balanced", "measured"):
        timed = part.mode == "measured" and all(b.seconds is not None for b in blocks)
        cost = _prefix([float(b.seconds or 0.0) if timed else b.flops for b in blocks])
        return _minimax(n, stages, lambda s, i, j: cost[j] - cost[i])
    # memory
    fixed = _prefix([b.parameter_bytes + 3 * b.trainable_bytes for b in blocks])
    act = _prefix([b.activation_bytes * mbs for b in blocks])
    return _minimax(n, stages, lambda s, i, j: fixed[j] - fixed[i] + (act[j] - act[i]) * flight[s])


def equal_ranges(start: int, stop: int, stages: int) -> list[range]:
    """Blocks ``start .. stop - 1`` in ``stages`` contiguous ranges of equal size, the earlier
    stages taking the remainder (Megatron's and torch's even split)."""
    base, extra = divmod(stop - start, stages)
    bounds = [start]
    for s in range(stages):
        bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    return [range(bounds[s], bounds[s + 1]) for s in range(stages)]


def _ratio_ranges(part: Partition, blocks: tuple[BlockSpec, ...]) -> list[range]:
    towers = [tower_of(b.kind) for b in blocks]
    order = [TOWERS.index(t) for t in towers]
    if order != sorted(order):
        raise ValueError(
            f"partition {part}: the blocks are not ordered vision, aligner, decoder "
            f"(kinds {[b.kind for b in blocks]}); use 'balanced' or explicit boundaries."
        )
    ranges: list[range] = []
    start = 0
    for tower, count in zip(TOWERS, part.ratio, strict=True):
        size = towers.count(tower)
        if size < count or (size and not count):
            raise ValueError(
                f"partition {part}: the {tower} tower has {size} blocks and {count} stages; "
                f"give it between 1 and {size} stages (0 only for a tower with no blocks)."
                if size
                else f"partition {part}: the {tower} tower has no blocks; give it 0 stages."
            )
        if count:
            ranges += equal_ranges(start, start + size, count)
        start += size
    return ranges


def _prefix(values: Sequence[float]) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + float(v))
    return out


def _minimax(n: int, stages: int, cost: Callable[[int, int, int], float]) -> list[range]:
    """Contiguous split of ``n`` blocks into ``stages`` non-empty stages minimising the largest
    ``cost(stage, first, stop)``; among those, the least sum of squared costs, then the
    earliest cuts. Exact dynamic programming, ``O(stages * n^2)``."""
    inf = math.inf
    # best[s][j]: smallest max cost of blocks [0, j) in s stages
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for j in range(s, n - (stages - s) + 1):
            best[s][j] = min(max(best[s - 1][i], cost(s - 1, i, j)) for i in range(s - 1, j))
    limit = best[stages][n] * (1 + 1e-9) + 1e-12
    # second pass: least sum of squares with every stage <= the optimum
    sq = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    sq[0][0] = 0.0
    for s in range(1, stages + 1):
        for j in range(s, n - (stages - s) + 1):
            for i in range(s - 1, j):
                c = cost(s - 1, i, j)
                if c <= limit and sq[s - 1][i] + c * c < sq[s][j]:
                    sq[s][j], cut[s][j] = sq[s - 1][i] + c * c, i
    bounds = [n]
    for s in range(stages, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    bounds.reverse()
    return [range(bounds[s], bounds[s + 1]) for s in range(stages)]


def default_ratio(blocks: Sequence[BlockSpec], stages: int) -> Partition | None:
    """Stage counts per tower proportional to its FLOPs (largest remainder, at least one stage
    for a tower with blocks, at most its block count); None when ``stages`` cannot give every
    tower with blocks a stage or the kinds do not map to towers."""
    try:
        towers = [tower_of(b.kind) for b in blocks]
    except ValueError:
        return None
    sizes = [towers.count(t) for t in TOWERS]
    work = [sum(b.flops for b, t in zip(blocks, towers, strict=True) if t == w) for w in TOWERS]
    present = [k for k in range(3) if sizes[k]]
    if stages < len(present) or stages > len(blocks):
        return None
    counts = [1 if sizes[k] else 0 for k in range(3)]
    total = sum(work) or 1.0
    while sum(counts) < stages:  # give the next stage to the tower with the most work per stage
        open_ = [k for k in present if counts[k] < sizes[k]]
        k = max(open_, key=lambda k: (work[k] / total) / counts[k])
        counts[k] += 1
    return Partition("ratio", ratio=tuple(counts))


def compare_modes(
    blocks: Sequence[BlockSpec],
    pipeline_parallel: int,
    virtual_pipeline: int = 1,
    partition: str | Sequence[int] | Partition | None = None,
    *,
    micro_batch_size: int = 1,
    stage_ranks: Sequence[int] | None = None,
    in_flight: Sequence[int] | None = None,
) -> list[StagePlan]:
    """Plans of every mode side by side: ``equal``, a FLOPs-proportional ``ratio`` (when every
    tower can have a stage), ``balanced``, ``memory``, and ``partition`` if it is another one.

    Raises:
        ValueError: as :func:`plan_stages` (sizes, too few blocks, an invalid ``partition``).
    """
    stages = pipeline_parallel * virtual_pipeline
    parts: list[Partition] = [Partition("equal")]
    ratio = default_ratio(blocks, stages)
    parts += [ratio] if ratio is not None else []
    parts += [Partition("balanced"), Partition("memory")]
    if partition is not None and (chosen := parse_partition(partition, stages)) not in parts:
        parts.append(chosen)
    return [
        plan_stages(
            blocks,
            pipeline_parallel,
            virtual_pipeline,
            p,
            micro_batch_size=micro_batch_size,
            stage_ranks=stage_ranks,
            in_flight=in_flight,
        )
        for p in parts
    ]
