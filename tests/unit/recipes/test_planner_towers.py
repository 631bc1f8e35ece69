"""The planner CLI's non-colocated candidates (``--vision-ranks``, ``--no-noncolocated``)."""

from __future__ import annotations

import pytest

from lightning_mmpar.recipes.planner import vision_counts


def test_vision_counts_of_the_cli() -> None:
    assert vision_counts(16) == list(range(9)) and vision_counts(2) == [0, 1]
    assert vision_counts(16, colocated=True) == [0] and vision_counts(1) == [0]
    assert vision_counts(16, forced=2) == [2]
    with pytest.raises(ValueError, match=r"--vision-ranks \(16\)"):
        vision_counts(16, forced=16)
