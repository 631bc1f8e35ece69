"""The stage-cost bubble (``parallel.pipeline.simulation``): torch's action order simulated at
given stage costs equals the formula at equal costs and a hand count at unequal ones."""

from __future__ import annotations

import pytest

from lightning_mmpar.layout.schedules import bubble_fraction
from lightning_mmpar.parallel.pipeline.simulation import (
    action_order,
    simulate,
    stage_cost_bubble,
)

LAYOUTS = [
    ("gpipe", 2, 1, 4),
    ("1f1b", 2, 1, 4),
    ("1f1b", 4, 1, 8),
    ("interleaved_1f1b", 2, 2, 4),
    ("looped_bfs", 2, 2, 4),
    ("interleaved_zero_bubble", 2, 2, 4),
    ("zbv_zero_bubble", 2, 2, 4),
    ("dualpipev", 2, 2, 4),
    ("interleaved_1f1b", 4, 2, 8),
]


@pytest.mark.parametrize(("schedule", "pp", "v", "m"), LAYOUTS)
def test_equal_costs_give_the_formula(schedule: str, pp: int, v: int, m: int) -> None:
    costs = {s: {"F": 0.5, "I": 0.5, "W": 0.5} for s in range(pp * v)}
    assert stage_cost_bubble(schedule, pp, v, m, costs) == pytest.approx(
        bubble_fraction(schedule, pp, v, m)
    )


def test_unequal_stages_1f1b_by_hand() -> None:
    """pp 2, m 4, stage 0 F 1 B 2, stage 1 F 2 B 4 (twice as slow): rank 1 runs its 4 (F, B)
    back to back after stage 0's first F, so span = 1 + 4 * 6 + 2 (stage 0's last B) = 27;
    work 4 * 3 + 4 * 6 = 36; bubble = 1 - 36 / 54 = 1/3 against the formula's 0.2."""
    costs = {0: {"F": 1.0, "B": 2.0}, 1: {"F": 2.0, "B": 4.0}}
    assert stage_cost_bubble("1f1b", 2, 1, 4, costs) == pytest.approx(1 / 3)
    assert bubble_fraction("1f1b", 2, 1, 4) == pytest.approx(0.2)


def test_order_is_torchs_and_bad_costs_are_refused() -> None:
    order = action_order("1f1b", 2, 1, 2)
    assert order[0] == [("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("B", 0, 1)]
    assert order[1] == [("F", 1, 0), ("B", 1, 0), ("F", 1, 1), ("B", 1, 1)]
    with pytest.raises(ValueError, match="deadlocks"):
        simulate({0: [("B", 0, 0)], 1: [("F", 1, 0)]}, 2)
    with pytest.raises(ValueError, match=r"stages \[1\]"):
        stage_cost_bubble("1f1b", 2, 1, 4, {0: {"F": 1.0, "B": 2.0}})
    with pytest.raises(ValueError, match="negative"):
        stage_cost_bubble("1f1b", 2, 1, 4, {0: {"F": 1.0, "B": -2.0}, 1: {"F": 1.0, "B": 2.0}})


def test_latency_per_hop_by_hand_and_interleaved_pays_it_more_often() -> None:
    """GPipe, pp 2, one micro-batch, F 1 and B 2 per stage, 1 per hop between ranks: F0, hop,
    F1, B1, hop, B0: span 8, work 6 of 16: bubble 10 / 16. At the same model work (pp 2, m 4,
    8 blocks of F 1: 1F1B stages of 4 blocks, interleaved v 2 stages of 2) interleaved's three
    boundaries between ranks add about twice 1F1B's one (0 latency: the formulas)."""
    costs = {s: {"F": 1.0, "B": 2.0} for s in range(2)}
    assert stage_cost_bubble("gpipe", 2, 1, 1, costs, latency=1.0) == pytest.approx(10 / 16)
    assert stage_cost_bubble("gpipe", 2, 1, 1, costs) == pytest.approx(0.5)
    ones = {s: {"F": 4.0, "B": 8.0} for s in range(2)}
    halves = {s: {"F": 2.0, "B": 4.0} for s in range(4)}
    for latency in (0.5, 1.0):
        one = stage_cost_bubble("1f1b", 2, 1, 4, ones, latency) - 0.2
        interleaved = stage_cost_bubble("interleaved_1f1b", 2, 2, 4, halves, latency) - 1 / 9
        assert 0.0 < 1.5 * one < interleaved < 2.5 * one, (latency, one, interleaved)
