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
