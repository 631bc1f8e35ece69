"""The bubble a schedule has at given stage costs: torch's action order, simulated.

:func:`lightning_mmpar.layout.schedules.bubble_fraction` (the formula) assumes equal stages: a
stage's forward, input-gradient and weight-gradient backward one unit each. A real partition has
unequal stages (blocks are indivisible, the loss sits on the last stage), and the bubble grows by
the wait for the slowest one. :func:`stage_cost_bubble` is the idle share of a step when each
stage's actions take their own durations, communication is free and every rank runs its
actions in the schedule's order as soon as their inputs exist: the bubble a perfect engine would
measure on these stages. ``measured - stage_cost_bubble`` is what communication and host work
between actions add; ``stage_cost_bubble - formula`` is what the unequal stages add.

The action order is torch's own: the ``pipeline_order`` a multi-stage schedule computes at
construction (built over stand-in stages, no process group), and the loops of ``ScheduleGPipe``
and ``Schedule1F1B`` for the single-stage ones. With unit costs the simulation equals the
formula for every schedule (tests/unit/layout/test_schedule_facts.py,
tests/unit/parallel/test_pipeline_simulation.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from types import SimpleNamespace
from typing import Any

from torch import nn

from lightning_mmpar.layout.schedules import MULTI_STAGE_SCHEDULES, UNIT_TIMES, stage_ranks
from lightning_mmpar.parallel.pipeline.schedules import build_schedule

__all__ = ["Action", "action_order", "simulate", "stage_cost_bubble"]

Action = tuple[str, int, int]
"""``(kind, stage, micro_batch)``: ``kind`` one of ``F``, ``I``, ``W``, ``B`` (``B = I + W``)."""

Duration = Callable[[str, int], float]
"""``duration(kind, stage)``: seconds (or units) of one action of that kind on that stage."""


def _single_stage_order(schedule: str, pp: int, m: int) -> dict[int, list[Action]]:
    """Per rank, the actions of torch's single-stage loops (``ScheduleGPipe`` and
    ``Schedule1F1B._step_microbatches``; their ``pipeline_order`` is a drawing only)."""
    order: dict[int, list[Action]] = {}
    for r in range(pp):
        if schedule == "gpipe":
            order[r] = [("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)]
            continue
        warmup = min(m, pp - r)  # then one backward, one forward, ...; then the backwards
        actions = [("F", r, i) for i in range(warmup)]
        for i in range(m):
            actions.append(("B", r, i))
            if warmup + i < m:
                actions.append(("F", r, warmup + i))
        order[r] = actions
    return order


def _flat(items: Any) -> Iterator[Action]:
    for a in items:
        if a is None:
            continue
        if a.sub_actions is not None:
            yield from _flat(a.sub_actions)
        elif a.computation_type.value in UNIT_TIMES:
            yield a.computation_type.value, a.stage_index, a.microbatch_index


def action_order(schedule: str, pp: int, virtual: int, m: int) -> dict[int, list[Action]]:
    """Per pipeline rank, the compute actions torch's ``schedule`` runs in one step, in order
    (idle slots dropped; an overlapped forward-backward is its two actions, run in turn).

    Raises:
        ValueError: an unknown schedule or a layout it cannot run
            (:func:`~lightning_mmpar.layout.schedules.stage_ranks`, torch's own checks).
    """
    ranks = stage_ranks(schedule, pp, virtual)
    if schedule not in MULTI_STAGE_SCHEDULES:
        return _single_stage_order(schedule, pp, m)
    stages = [
        SimpleNamespace(
            num_stages=len(ranks),
            group_size=pp,
            group_rank=0,
            stage_index=s,
            submod=nn.Identity(),
            is_first=s == 0,
            is_last=s == len(ranks) - 1,
            stage_index_to_group_rank=None,
        )
        for s, r in enumerate(ranks)
        if r == 0
    ]
    built = build_schedule(schedule, stages, m, lambda out, target: out)
    return {r: list(_flat(actions)) for r, actions in built.pipeline_order.items()}


def _inputs(kind: str, stage: int, mb: int, last: int) -> list[Action]:
    """Actions whose end ``(kind, stage, mb)`` waits for; ``G`` is a stage's input gradient."""
    if kind == "F":
        return [("F", stage - 1, mb)] if stage > 0 else []
    if kind == "W":
        return [("I", stage, mb)]
    return [("F", stage, mb)] + ([("G", stage + 1, mb)] if stage < last else [])


def simulate(
    order: Mapping[int, list[Action]],
    num_stages: int,
    duration: Duration | None = None,
    latency: float = 0.0,
) -> dict[int, list[tuple[str, int, int, float, float]]]:
    """Start and end of every action: each rank runs its list in order, an action starting when
    the rank is free and its inputs are done, ``latency`` after that for an input made on
    another rank (one point-to-point hop: posting, transfer, waking the receiver; 0: free
    communication). ``duration`` defaults to
    :data:`~lightning_mmpar.layout.schedules.UNIT_TIMES`. Returns per rank
    ``(kind, stage, micro_batch, start, end)``.

    Raises:
        ValueError: the order deadlocks (an action waits for one that never runs).
    """
    cost = duration or (lambda kind, stage: float(UNIT_TIMES[kind]))
    rank_of = {stage: r for r, actions in order.items() for _, stage, _ in actions}
    done: dict[Action, float] = {}
    free, pos = dict.fromkeys(order, 0.0), dict.fromkeys(order, 0)
    timeline: dict[int, list[tuple[str, int, int, float, float]]] = {r: [] for r in order}
    moved = True
    while moved:
        moved = False
        for r, actions in order.items():
            while pos[r] < len(actions):
                kind, stage, mb = actions[pos[r]]
                needs = _inputs(kind, stage, mb, num_stages - 1)
                if any(n not in done for n in needs):
                    break
                hops = [latency if rank_of[n[1]] != r else 0.0 for n in needs]
                start = max([free[r]] + [done[n] + h for n, h in zip(needs, hops, strict=True)])
                end = free[r] = done[(kind, stage, mb)] = start + cost(kind, stage)
                if kind in ("I", "B"):
                    done[("G", stage, mb)] = end
                timeline[r].append((kind, stage, mb, start, end))
                pos[r] += 1
                moved = True
    stuck = {r: order[r][pos[r]] for r in order if pos[r] < len(order[r])}
    if stuck:
        raise ValueError(f"the action order deadlocks at {stuck} (rank: next action).")
    return timeline


def stage_cost_bubble(
    schedule: str,
    pp: int,
    virtual: int,
    m: int,
    costs: Mapping[int, Mapping[str, float]],
    latency: float = 0.0,
) -> float:
    """Idle share of one step of ``schedule`` (``sum_r (span - busy_r) / (span pp)``, as
    ``PipelineTimeline`` measures it) when stage ``s``'s actions take ``costs[s][kind]`` seconds
    (``kind``: ``F``, ``B``, and for the zero-bubble schedules ``I`` and ``W``; a missing ``B``
    is ``I + W``, a missing ``I`` / ``W`` half of ``B``), each hop between ranks takes
    ``latency`` seconds (default 0: free communication, :func:`simulate`) and no host work
    runs between actions. Equal costs and no latency give the formula
    (:func:`~lightning_mmpar.layout.schedules.bubble_fraction`). A schedule that crosses ranks
    more often pays the latency more often on its critical path: at pp 2, m 4 and the same
    model work, interleaved 1F1B (v 2: three boundaries between ranks) gains about twice what
    1F1B (one boundary) gains per millisecond of latency.

    Raises:
        ValueError: a stage without costs, a negative cost, or a layout the schedule cannot run.
    """
    stages = pp * virtual
    missing = [s for s in range(stages) if s not in costs or "F" not in costs[s]]
    if missing:
        raise ValueError(
            f"costs has no forward ('F') time for stages {missing}; give every one of the "
            f"{stages} stages its F and B (or I and W) seconds."
        )
    table = {s: _complete(dict(costs[s]), s) for s in range(stages)}
    order = action_order(schedule, pp, virtual, m)
    timeline = simulate(order, stages, lambda k, s: table[s][k], latency)
    span = max(end for actions in timeline.values() for *_, end in actions)
    if span <= 0:
        return 0.0
    work = sum(end - start for actions in timeline.values() for *_, start, end in actions)
    return (pp * span - work) / (pp * span)


def _complete(cost: dict[str, float], stage: int) -> dict[str, float]:
    if "B" not in cost:
        cost["B"] = cost.get("I", 0.0) + cost.get("W", 0.0)
    cost.setdefault("I", cost["B"] / 2)
    cost.setdefault("W", cost["B"] - cost["I"])
    bad = {k: v for k, v in cost.items() if v < 0}
    if bad:
        raise ValueError(f"costs of stage {stage} are negative ({bad}); durations are >= 0.")
    return cost
