"""The planner CLI's non-colocated candidates (``--vision-ranks``, ``--no-noncolocated``,
``--vision-fsdp``) and the YAML fragment of a chosen layout."""

from __future__ import annotations

import pytest

from lightning_mmpar.layout import ParallelLayout
from lightning_mmpar.layout.planner import candidate_layouts, refusal
from lightning_mmpar.recipes.planner import fragment, vision_counts


def test_vision_counts_of_the_cli() -> None:
    assert vision_counts(16) == list(range(9)) and vision_counts(2) == [0, 1]
    assert vision_counts(16, colocated=True) == [0] and vision_counts(1) == [0]
    assert vision_counts(16, forced=2) == [2]
    with pytest.raises(ValueError, match=r"--vision-ranks \(16\)"):
        vision_counts(16, forced=16)


def test_vision_fsdp_enumerates_two_vision_ranks_on_three_devices() -> None:
    """``--vision-fsdp`` on 3 devices: 1 language + 2 FSDP vision ranks is a valid layout,
    beyond ``gpus / 2`` (it was reachable with ``--vision-ranks 2`` only, so the flag added
    nothing); elsewhere the counts are those without the flag."""
    assert vision_counts(3) == [0, 1] and vision_counts(3, fsdp=True) == [0, 1, 2]
    assert vision_counts(2, fsdp=True) == [0, 1] and vision_counts(1, fsdp=True) == [0]
    assert vision_counts(16, fsdp=True) == list(range(9))
    found = candidate_layouts(
        3,
        8,
        global_batch=8,
        vision_ranks=vision_counts(3, fsdp=True),
        vision_data_parallel=("ddp", "fsdp"),
    )
    valid = [x for x in found if refusal(x, world=3) is None]
    assert any(x.vision_ranks == 2 and x.vision_data_parallel == "fsdp" for x in valid)


@pytest.mark.parametrize(
    ("layout", "nodes", "devices"),
    [
        (ParallelLayout(tp=2, pp=2, dp=1), 1, 4),
        (ParallelLayout(dp=1, vision_ranks=2, vision_data_parallel="fsdp"), 1, 3),
        (ParallelLayout(tp=2, dp=4, vision_ranks=8), 2, 8),
    ],
)
def test_fragment_sets_the_process_count(layout: ParallelLayout, nodes: int, devices: int) -> None:
    """The fragment of a chosen layout sets ``trainer.devices`` (vision ranks included) and
    ``trainer.num_nodes``: pasted over a recipe, the recipe's own count launched another
    world."""
    trainer = fragment(layout, None, nodes)["trainer"]
    assert (trainer["devices"], trainer["num_nodes"]) == (devices, nodes)
    with pytest.raises(ValueError, match=r"nodes \(5\) must divide"):
        fragment(layout, None, 5)
