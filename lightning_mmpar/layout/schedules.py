"""Pipeline schedules as facts (pure Python): names, stage -> rank maps, in-flight micro-batches
and the bubble, as functions of ``(schedule, pp, virtual, micro_batches)``.

The one home of these facts: the engine (``lightning_mmpar.parallel.pipeline``, which builds
torch's schedule objects by these names), ``ParallelConfig``, the stage partitioner, the cost
model and planner, the ``PipelineTimeline`` callback and the benchmarks import them from here.
Every formula equals what torch 2.14's schedule runs: ``tests/unit/test_schedule_facts.py``
builds each schedule through the engine's ``build_schedule`` and simulates its per-rank action
order (``pipeline_order``; GPipe's and 1F1B's loops for the single-stage ones) over a grid of
``(pp, virtual, micro_batches)``.

The time model (:data:`UNIT_TIMES`): every stage's forward ``F``, input-gradient backward ``I``
and weight-gradient backward ``W`` of one micro-batch take one unit, a full backward ``B = I + W``
two; communication is free and each rank runs its actions in the schedule's order as soon as
their inputs exist. Under that model, with ``p = pp``, ``v = virtual``, ``m = micro_batches``,
each rank works ``3 v m`` units of a step lasting :func:`step_units`, and
:func:`bubble_fraction` ``= 1 - 3 v m / step_units`` is the idle share of the step, the
quantity ``PipelineTimeline`` measures (``sum_r (span - busy_r) / (span p)``).

Activation memory (:func:`in_flight`): the micro-batches whose forward has run on a stage and
whose backward (``I`` or ``B``) has not finished, at the moment its rank holds the most of them
(the inputs ``W`` keeps after ``I`` are not counted).
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = [
    "MULTI_STAGE_SCHEDULES",
    "ROUND_SCHEDULES",
    "SCHEDULES",
    "SCHEDULE_SOURCES",
    "SPLIT_BACKWARD_SCHEDULES",
    "UNIT_TIMES",
    "V_SCHEDULES",
    "Schedule",
    "bubble_fraction",
    "in_flight",
    "micro_batches_per_round",
    "min_micro_batches",
    "rank_in_flight",
    "stage_layout",
    "stage_ranks",
    "step_units",
]

Schedule = Literal[
    "gpipe",
    "1f1b",
    "interleaved_1f1b",
    "looped_bfs",
    "interleaved_zero_bubble",
    "zbv_zero_bubble",
    "dualpipev",
]
"""A pipeline schedule by name (``ParallelConfig.schedule``)."""

SCHEDULES: tuple[str, ...] = get_args(Schedule)
"""Every schedule of ``torch.distributed.pipelining`` by name, in this order: ScheduleGPipe,
Schedule1F1B, ScheduleInterleaved1F1B, ScheduleLoopedBFS, ScheduleInterleavedZeroBubble,
ScheduleZBVZeroBubble, ScheduleDualPipeV (``parallel.pipeline.schedules.SCHEDULE_CLASSES``)."""
MULTI_STAGE_SCHEDULES: frozenset[str] = frozenset(SCHEDULES[2:])
"""Schedules that run ``virtual_pipeline >= 2`` stages per pipeline rank."""
V_SCHEDULES: frozenset[str] = frozenset(("zbv_zero_bubble", "dualpipev"))
"""Schedules on the "V" stage layout: exactly two stages per rank, rank ``r`` holding stages
``r`` and ``2 * pp - 1 - r`` (the last stage on pipeline rank 0)."""
SPLIT_BACKWARD_SCHEDULES: frozenset[str] = frozenset(
    ("interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev")
)
"""Zero-bubble schedules: backward split into input-gradient and weight-gradient actions."""
ROUND_SCHEDULES: frozenset[str] = frozenset(("interleaved_1f1b", "interleaved_zero_bubble"))
"""Schedules that run micro-batches in rounds of :func:`micro_batches_per_round`: the
micro-batch count must be a multiple of the rounds, ``micro_batches // pp`` (torch's check)."""

UNIT_TIMES: dict[str, int] = {"F": 1, "I": 1, "W": 1, "B": 2}
"""Duration of a stage's forward (``F``), input-gradient (``I``), weight-gradient (``W``) and
full (``B = I + W``) backward of one micro-batch in the formulas' time model."""

SCHEDULE_SOURCES: dict[str, str] = {
    "gpipe": "(p-1)/(m+p-1): GPipe, Huang et al. 2019",
    "1f1b": "(p-1)/(m+p-1): PipeDream-Flush 1F1B, Narayanan et al. 2021 (Megatron-LM)",
    "interleaved_1f1b": "(p-1)/(v m+p-1) for m >= p: interleaved 1F1B, Narayanan et al. 2021 "
    "(Megatron-LM)",
    "looped_bfs": "(p-1)/(v m+p-1) for m >= p: Breadth-First Pipeline Parallelism, "
    "Lamy-Poirier 2023",
    "interleaved_zero_bubble": "(p-1)/(3 v m+p-1) for m >= p: ZB-H1 (torch's ZB1P), Qi et al. "
    "2024, Zero Bubble Pipeline Parallelism",
    "zbv_zero_bubble": "(p-1)/(6 m+p-1) for m >= 1.5 p - 0.5: ZB-V, Qi et al. 2024 section 6",
    "dualpipev": "(p-1)/(6 m+p-1): DualPipe (V variant), DeepSeek-V3 report 2024",
}
"""Schedule name -> its bubble under :data:`UNIT_TIMES` in the usual regime and its source
(:func:`step_units` gives every regime)."""


def _check(schedule: str, pp: int, virtual: int, micro_batches: int = 1) -> None:
    """Raise ``ValueError`` for an unknown schedule, sizes that are not positive ints, or a V
    schedule without exactly 2 stages per rank."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule ({schedule!r}) is unknown; use one of {', '.join(SCHEDULES)}.")
    for name, value in (("pp", pp), ("virtual", virtual), ("micro_batches", micro_batches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} ({value!r}) must be a positive integer.")
    if schedule in V_SCHEDULES and virtual != 2:
        raise ValueError(
            f"schedule={schedule!r} needs 2 stages per pipeline rank (got virtual={virtual}); "
            "set virtual_pipeline=2."
        )


def _check_run(schedule: str, pp: int, virtual: int, micro_batches: int) -> None:
    """:func:`_check`, and a single-stage schedule refuses several stages per rank."""
    _check(schedule, pp, virtual, micro_batches)
    if schedule not in MULTI_STAGE_SCHEDULES and virtual != 1:
        raise ValueError(
            f"schedule={schedule!r} runs one stage per pipeline rank (got virtual={virtual}); "
            "set virtual_pipeline=1 or choose a multi-stage schedule such as "
            "'interleaved_1f1b'."
        )


def stage_layout(schedule: str) -> Literal["loop", "v"]:
    """``"v"`` for :data:`V_SCHEDULES` (rank ``r`` holds stages ``r`` and ``2 * pp - 1 - r``),
    ``"loop"`` otherwise (stage ``s`` on rank ``s % pp``, Megatron's virtual pipeline)."""
    return "v" if schedule in V_SCHEDULES else "loop"


def min_micro_batches(schedule: str, pp: int, virtual: int = 1) -> int:
    """The fewest micro-batches ``schedule`` runs with at ``pp`` pipeline ranks and ``virtual``
    stages per rank: ``pp`` for 1F1B and ``pp * virtual`` (the stage count) for DualPipeV
    (torch's checks); 1 otherwise (tried on gloo with torch 2.14: the interleaved, looped-BFS
    and zero-bubble schedules give exact gradients with fewer micro-batches than ranks; the
    interleaved ones then need ``micro_batches`` a multiple of ``micro_batches // pp``)."""
    if pp == 1:
        return 1
    if schedule == "1f1b":
        return pp
    if schedule == "dualpipev":
        return pp * virtual
    return 1


def micro_batches_per_round(pp: int, micro_batches: int) -> int:
    """Micro-batches per round of the interleaved schedules (:data:`ROUND_SCHEDULES`):
    ``m // max(1, m // pp)`` (torch's ``microbatches_per_round``; ``m // pp`` rounds)."""
    return micro_batches // max(1, micro_batches // pp)


def stage_ranks(schedule: str, pp: int, virtual: int) -> list[int]:
    """Pipeline rank of each of the ``pp * virtual`` stages: the loop layout ``s % pp``, or the
    V layout (:data:`V_SCHEDULES`) ``s`` for ``s < pp`` then ``2 pp - 1 - s`` (torch's
    ``generate_stage_to_rank_mapping(style="v")``).

    Raises:
        ValueError: an unknown schedule, sizes not positive ints, or a V schedule with
            ``virtual != 2``.
    """
    _check(schedule, pp, virtual)
    if stage_layout(schedule) == "v":
        return [s if s < pp else 2 * pp - 1 - s for s in range(2 * pp)]
    return [s % pp for s in range(pp * virtual)]


def _interleaved_in_flight(
    factor: int, pp: int, virtual: int, m: int, rank: int
) -> tuple[int, ...]:
    """Per local stage of ``rank``: the interleaved schedules run ``w = (v - 1) k +
    factor (p - 1 - r)`` warm-up forwards (``k`` :func:`micro_batches_per_round`; ``factor`` 2
    for 1F1B, Megatron-LM's ``get_num_warmup_microbatches``, 1 for zero bubble), at most
    ``v m``, in blocks of ``k`` per local stage, then one more forward before the first
    backward: the rank's peak is those ``w + 1`` forwards."""
    k = micro_batches_per_round(pp, m)
    warmup = min((virtual - 1) * k + factor * (pp - 1 - rank), virtual * m)
    held = min(virtual * m, warmup + 1)
    cycles, rest = divmod(held, k * virtual)
    return tuple(cycles * k + min(k, max(0, rest - j * k)) for j in range(virtual))


def _rank_stage_in_flight(schedule: str, pp: int, virtual: int, m: int, r: int) -> tuple[int, ...]:
    """In-flight micro-batches of rank ``r``'s stages (ascending stage index) at its peak."""
    if schedule in ("gpipe", "looped_bfs"):  # every forward before any backward, per stage
        return (m,) * virtual
    if schedule == "1f1b":  # warm-up of min(m, p - r) forwards (torch's Schedule1F1B)
        return (min(m, pp - r),)
    if schedule == "interleaved_1f1b":
        return _interleaved_in_flight(2, pp, virtual, m, r)
    if schedule == "interleaved_zero_bubble":
        return _interleaved_in_flight(1, pp, virtual, m, r)
    if schedule == "zbv_zero_bubble":  # stage r: 2 (p - r) - 1 + r warm-up forwards
        return (min(m, 2 * pp - 1 - r), min(m, r + 1))
    return (min(m, 2 * pp - r), min(m, r + 1))  # dualpipev: one more on the first chunk


def in_flight(schedule: str, pp: int, virtual: int, micro_batches: int) -> list[int]:
    """Micro-batches whose activations each of the ``pp * virtual`` stages holds when its rank
    holds the most (the module's definition); summed over a rank's stages: :func:`rank_in_flight`.

    With ``p`` ranks, ``m`` micro-batches, rank ``r``:

    * ``gpipe``, ``looped_bfs``: ``m`` on every stage (all forwards before any backward;
      GPipe, Huang et al. 2019; breadth-first, Lamy-Poirier 2023).
    * ``1f1b``: ``min(m, p - r)`` (PipeDream-Flush, Narayanan et al. 2021).
    * ``interleaved_1f1b``: ``min(v m, (v - 1) k + 2 (p - 1 - r) + 1)`` stage-micro-batches on
      the rank, ``k`` micro-batches per round, filled in blocks of ``k`` from its first stage
      (Megatron-LM's warm-up, Narayanan et al. 2021); ``interleaved_zero_bubble`` the same with
      ``(p - 1 - r)`` (Qi et al. 2024's ZB-H1 warm-up).
    * ``zbv_zero_bubble``: ``min(m, 2 p - 1 - r)`` on stage ``r``, ``min(m, r + 1)`` on stage
      ``2 p - 1 - r`` (ZB-V, Qi et al. 2024 section 6); ``dualpipev``: ``min(m, 2 p - r)`` and
      ``min(m, r + 1)`` (DeepSeek-V3's DualPipe, V variant).

    Raises:
        ValueError: as :func:`stage_ranks`, ``micro_batches`` not a positive int, or a
            single-stage schedule with ``virtual != 1``.
    """
    _check_run(schedule, pp, virtual, micro_batches)
    ranks = stage_ranks(schedule, pp, virtual)
    out = [0] * len(ranks)
    for r in range(pp):
        mine = [s for s, owner in enumerate(ranks) if owner == r]
        per = _rank_stage_in_flight(schedule, pp, virtual, micro_batches, r)
        for s, k in zip(mine, per, strict=True):
            out[s] = k
    return out


def rank_in_flight(schedule: str, pp: int, virtual: int, micro_batches: int) -> list[int]:
    """Per pipeline rank: the most stage-micro-batches (``(stage, micro-batch)`` pairs) whose
    activations it holds at once (:func:`in_flight` summed over its stages).

    Raises:
        ValueError: as :func:`in_flight`.
    """
    ranks, flight = (
        stage_ranks(schedule, pp, virtual),
        in_flight(schedule, pp, virtual, micro_batches),
    )
    return [sum(k for owner, k in zip(ranks, flight, strict=True) if owner == r) for r in range(pp)]


def step_units(schedule: str, pp: int, virtual: int, micro_batches: int) -> int:
    """Length of one step in :data:`UNIT_TIMES` units (first action's start to the last one's
    end over all ranks), each rank working ``3 v m`` of it. With ``p`` ranks, ``m``
    micro-batches:

    * ``gpipe``, ``1f1b``: ``3 (m + p - 1)`` (GPipe, Huang et al. 2019; Narayanan et al. 2021).
    * ``interleaved_1f1b``, ``looped_bfs``: ``3 max(v m + p - 1, m + v p - 1)``: Megatron-LM's
      interleaved bubble ``(p - 1) / (v m)`` of the work (Narayanan et al. 2021) for ``m >= p``,
      below that the first micro-batch's path through all ``v p`` stages.
    * ``interleaved_zero_bubble``: ``3 v m + p - 1`` for ``m >= p`` (ZB-H1: the 1F1B bubble
      ``3 (p - 1)`` shrunk to ``(p - 1)(F + B - W) = p - 1`` by weight-gradient work, Qi et al.
      2024); below, ``2 v p + 1 + v max(0, 2 m - p) + min(p - 2, 2 m - 2)`` (torch's ZB1P
      order, equal at ``m = p``).
    * ``zbv_zero_bubble``: ``max(6 m + p - 1, 4 m + 4 p - 2)`` (torch's ZB-V order; Qi et al.
      2024 section 6 count no bubble for equal ``F``, ``I``, ``W`` once the pipeline is full,
      the ``p - 1`` left is its fill and drain).
    * ``dualpipev``: ``6 m + p - 1`` (``m >= 2 p``; DeepSeek-V3's DualPipe, V variant, whose
      overlapped forward-backward chunks torch runs one after the other).

    Raises:
        ValueError: as :func:`in_flight`.
    """
    _check_run(schedule, pp, virtual, micro_batches)
    p, v, m = pp, virtual, micro_batches
    if schedule in ("gpipe", "1f1b"):
        return 3 * (m + p - 1)
    if schedule in ("interleaved_1f1b", "looped_bfs"):
        return 3 * max(v * m + p - 1, m + v * p - 1)
    if schedule == "interleaved_zero_bubble":
        if m >= p:
            return 3 * v * m + p - 1
        return 2 * v * p + 1 + v * max(0, 2 * m - p) + min(p - 2, 2 * m - 2)
    if schedule == "zbv_zero_bubble":
        return max(6 * m + p - 1, 4 * m + 4 * p - 2)
    return 6 * m + p - 1


def bubble_fraction(schedule: str, pp: int, virtual: int, micro_batches: int) -> float:
    """Idle share of a pipeline step: ``1 - 3 v m / step_units(...)`` (:func:`step_units`;
    0 without pipelining). The planner's bubble (``layout.cost.predict``) and the formula
    ``PipelineTimeline`` logs next to the measured bubble are this function.

    Raises:
        ValueError: as :func:`in_flight`.
    """
    step = step_units(schedule, pp, virtual, micro_batches)
    return (step - 3 * virtual * micro_batches) / step  # exact for whole units: no 1 - x
