"""The schedule facts of :mod:`lightning_mmpar.layout.schedules` against what torch runs.

For every schedule and a grid of ``(pp, virtual, micro_batches)`` that ``ParallelConfig``
accepts, the schedule object is built the engine's way (``parallel.pipeline.schedules.
build_schedule`` over stand-in stages: torch computes every rank's action order at
construction, no process group needed) and its action order is simulated with the facts' time
model (``UNIT_TIMES``; free communication, each action as soon as its inputs exist). The
simulated stage -> rank map, the in-flight micro-batches of each stage at its rank's peak, the
step length and the bubble must equal the formulas. The planner and the timeline callback must
use the same functions.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from torch import nn

from lightning_mmpar.callbacks import pipeline_timeline
from lightning_mmpar.config import ParallelConfig
from lightning_mmpar.layout import cost, schedules
from lightning_mmpar.layout.schedules import (
    SCHEDULES,
    UNIT_TIMES,
    bubble_fraction,
    in_flight,
    rank_in_flight,
    stage_ranks,
    step_units,
)
from lightning_mmpar.parallel.pipeline import schedules as ps

Action = tuple[str, int, int]
"""``(kind, stage, micro_batch)``: ``kind`` one of ``F``, ``I``, ``W``, ``B``."""


def layouts() -> Iterator[tuple[str, int, int, int]]:
    """``(schedule, pp, virtual, micro_batches)`` of every layout ``ParallelConfig`` accepts on
    the grid: pp 2-5, virtual 1 (single-stage), 2 (V) or 2-3 (loop), 1 to 2 pp + 3 micro-batches."""
    for schedule in SCHEDULES:
        vs = (2, 3) if schedules.stage_layout(schedule) == "loop" else (2,)
        for pp in (2, 3, 4, 5):
            for v in vs if schedule in schedules.MULTI_STAGE_SCHEDULES else (1,):
                for m in range(1, 2 * pp + 4):
                    try:
                        ParallelConfig(
                            pipeline_parallel=pp,
                            virtual_pipeline=v,
                            schedule=schedule,  # type: ignore[arg-type]
                            micro_batches=m,
                        )
                    except ValueError:
                        continue
                    yield schedule, pp, v, m


def build(schedule: str, pp: int, virtual: int, m: int) -> Any:
    """Rank 0's schedule object, built as the engine builds it (``build_schedule``)."""
    ranks = stage_ranks(schedule, pp, virtual)
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
    return ps.build_schedule(schedule, stages, m, lambda out, target: out)


def single_stage_order(schedule: str, pp: int, m: int) -> dict[int, list[Action]]:
    """Per rank, the actions of torch's single-stage loops (``ScheduleGPipe`` /
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


def torch_order(schedule: Any) -> dict[int, list[Action]]:
    """Per rank, the compute actions of a multi-stage schedule's ``pipeline_order`` (idle
    slots dropped; an overlapped forward-backward is its two actions, run in turn)."""

    def flat(items: Any) -> Iterator[Action]:
        for a in items:
            if a is None:
                continue
            if a.sub_actions is not None:
                yield from flat(a.sub_actions)
            elif a.computation_type.value in UNIT_TIMES:
                yield a.computation_type.value, a.stage_index, a.microbatch_index

    return {r: list(flat(actions)) for r, actions in schedule.pipeline_order.items()}


def _inputs(kind: str, stage: int, mb: int, last: int) -> list[Action]:
    """Actions whose end ``(kind, stage, mb)`` waits for; ``G`` is a stage's input gradient."""
    if kind == "F":
        return [("F", stage - 1, mb)] if stage > 0 else []
    if kind == "W":
        return [("I", stage, mb)]
    return [("F", stage, mb)] + ([("G", stage + 1, mb)] if stage < last else [])


def simulate(order: dict[int, list[Action]], num_stages: int) -> dict[int, list[Any]]:
    """Start and end of every action: each rank runs its list in order, an action starting when
    the rank is free and its inputs are done. Returns per rank ``(kind, stage, mb, start, end)``."""
    done: dict[Action, int] = {}
    free, pos = dict.fromkeys(order, 0), dict.fromkeys(order, 0)
    timeline: dict[int, list[Any]] = {r: [] for r in order}
    moved = True
    while moved:
        moved = False
        for r, actions in order.items():
            while pos[r] < len(actions):
                kind, stage, mb = actions[pos[r]]
                needs = _inputs(kind, stage, mb, num_stages - 1)
                if any(n not in done for n in needs):
                    break
                start = max([free[r]] + [done[n] for n in needs])
                end = free[r] = done[(kind, stage, mb)] = start + UNIT_TIMES[kind]
                if kind in ("I", "B"):
                    done[("G", stage, mb)] = end
                timeline[r].append((kind, stage, mb, start, end))
                pos[r] += 1
                moved = True
    stuck = {r: order[r][pos[r]] for r in order if pos[r] < len(order[r])}
    assert not stuck, f"the schedule deadlocks at {stuck}"
    return timeline


def peak_in_flight(timeline: list[Any]) -> dict[int, int]:
    """Per stage, the micro-batches held (forward started, ``I`` / ``B`` not ended) at the
    first moment the rank holds the most."""
    held: dict[int, int] = {}
    best, at = 0, {}
    for kind, stage, _, _, _ in timeline:  # a rank's actions run one after another
        if kind in ("F", "I", "B"):
            held[stage] = held.get(stage, 0) + (1 if kind == "F" else -1)
            if sum(held.values()) > best:
                best, at = sum(held.values()), dict(held)
    return {s: at.get(s, 0) for s in held}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_facts_equal_the_simulated_torch_schedule(schedule: str) -> None:
    cases = [c for c in layouts() if c[0] == schedule]
    assert len(cases) >= 12, cases
    for _, pp, v, m in cases:
        built = build(schedule, pp, v, m)
        assert type(built).__name__ == ps.SCHEDULE_CLASSES[schedule]
        ranks = stage_ranks(schedule, pp, v)
        if schedule in schedules.MULTI_STAGE_SCHEDULES:
            assert built.stage_index_to_group_rank == dict(enumerate(ranks)), (pp, v, m)
            order = torch_order(built)
        else:
            order = single_stage_order(schedule, pp, m)
        timeline = simulate(order, len(ranks))
        span = max(end for actions in timeline.values() for *_, end in actions)
        work = sum(end - start for actions in timeline.values() for *_, start, end in actions)
        where = (schedule, pp, v, m)
        assert span == step_units(schedule, pp, v, m), where
        assert 1 - work / (pp * span) == pytest.approx(bubble_fraction(schedule, pp, v, m)), where
        peaks = {s: k for r in timeline for s, k in peak_in_flight(timeline[r]).items()}
        assert [peaks[s] for s in range(len(ranks))] == in_flight(schedule, pp, v, m), where
        per_rank = [sum(peaks[s] for s, o in enumerate(ranks) if o == r) for r in range(pp)]
        assert per_rank == rank_in_flight(schedule, pp, v, m), where


def test_the_disagreement_of_issue_27_is_settled() -> None:
    """pp 4, v 2, 8 micro-batches: rank 0 holds 11 stage-micro-batches under interleaved 1F1B
    (7 of stage 0, 4 of stage 4; the two old formulas said 4 and 6 per stage); the V schedules
    keep a bubble of (p - 1) / (6 m + p - 1)."""
    assert in_flight("interleaved_1f1b", 4, 2, 8) == [7, 5, 4, 4, 4, 4, 3, 1]
    assert rank_in_flight("interleaved_1f1b", 4, 2, 8) == [11, 9, 7, 5]
    for schedule in ("zbv_zero_bubble", "dualpipev"):
        assert bubble_fraction(schedule, 4, 2, 8) == pytest.approx(3 / 51)
    assert in_flight("zbv_zero_bubble", 2, 2, 4) == [3, 2, 2, 1]


def test_planner_and_timeline_use_the_facts() -> None:
    """One function each: the cost model's bubble and in-flight counts, the timeline's formula."""
    assert cost.bubble_fraction is bubble_fraction and cost.in_flight is in_flight
    assert pipeline_timeline.FORMULA_SOURCES is schedules.SCHEDULE_SOURCES
    assert set(schedules.SCHEDULE_SOURCES) == set(SCHEDULES)
    for schedule, pp, v, m in layouts():
        formula = pipeline_timeline.formula_bubble(schedule, pp, m, v)
        assert formula == bubble_fraction(schedule, pp, v, m), (schedule, pp, v, m)


def test_no_pipeline_no_bubble_and_bad_input_refused() -> None:
    for schedule in SCHEDULES:
        v = 2 if schedule in schedules.MULTI_STAGE_SCHEDULES else 1
        assert bubble_fraction(schedule, 1, v, 4) == 0.0, schedule
    with pytest.raises(ValueError, match=r"^schedule \('zb'\) is unknown; use one of gpipe, 1f1b"):
        bubble_fraction("zb", 2, 1, 2)
    with pytest.raises(ValueError, match=r"^micro_batches \(0\) must be a positive integer"):
        in_flight("1f1b", 2, 1, 0)
    with pytest.raises(ValueError, match=r"needs 2 stages per pipeline rank \(got virtual=3\)"):
        stage_ranks("zbv_zero_bubble", 2, 3)
    with pytest.raises(ValueError, match=r"runs one stage per pipeline rank \(got virtual=2\)"):
        in_flight("1f1b", 2, 2, 4)
    assert stage_ranks("1f1b", 1, 2) == [0, 0]  # the engine on a one-rank group holds both
