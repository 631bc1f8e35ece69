"""Non-colocated towers (issue 30) without processes: the layout option's validation, the
rank layout (which vision rank serves which replica), the slot index and the inlet."""

from __future__ import annotations

import pytest
import torch

from lightning_mmpar import MultimodalParallelStrategy
from lightning_mmpar.config import ParallelConfig
from lightning_mmpar.layout import LayoutFacts, ParallelLayout, validate
from lightning_mmpar.models.ragged import scatter_slots
from lightning_mmpar.parallel.towers import (
    TowerInlet,
    image_index,
    tower_block_count,
    zero_on_graph,
)
from lightning_mmpar.topology import ParallelDims, TowerRanks, chunk_sizes


@pytest.mark.parametrize(
    ("layout", "world", "words"),
    [
        (ParallelLayout(dp=None, vision_ranks=-1), None, ["vision_ranks (-1)", "0"]),
        (ParallelLayout(dp=None, ep=2, vision_ranks=1), None, ["expert_parallel (2)"]),
        (
            ParallelLayout(dp=None, pp=2, virtual=2, schedule="zbv_zero_bubble", vision_ranks=1),
            None,
            ["'zbv_zero_bubble'", "1f1b"],
        ),
        (
            ParallelLayout(dp=None, tp=2, sequence_parallel=True, vision_ranks=1),
            None,
            ["sequence_parallel"],
        ),
        (ParallelLayout(dp=None, tp=2, vision_ranks=1), 2, ["world_size (2)", "run on 3"]),
        (  # the fixes hold the process count or the vision ranks (not the replicas)
            ParallelLayout(dp=None, vision_ranks=2),
            5,
            ["vision_ranks (2)", "replicas (3", "at 5 processes use vision_ranks in [1, 4]"],
        ),
        (
            ParallelLayout(dp=None, vision_ranks=3),
            5,
            ["vision_ranks (3)", "vision_ranks in [1, 4]", "keep vision_ranks=3 on 4 / 6 / 9"],
        ),
        (
            ParallelLayout(dp=None, vision_ranks=2, vision_data_parallel="zero3"),
            None,
            ["vision_data_parallel ('zero3')", "'ddp', 'fsdp'"],
        ),
        (
            ParallelLayout(dp=None, vision_data_parallel="fsdp"),
            None,
            ["vision_data_parallel ('fsdp')", "vision_ranks >= 2 (got 0)", "set vision_ranks=2"],
        ),
        (
            ParallelLayout(dp=None, tp=2, vision_ranks=1, vision_data_parallel="fsdp"),
            None,
            ["vision_data_parallel ('fsdp')", "vision_ranks (1)", "shards nothing", "'ddp'"],
        ),
    ],
)
def test_vision_ranks_refusals_name_field_value_and_fix(
    layout: ParallelLayout, world: int | None, words: list[str]
) -> None:
    with pytest.raises(ValueError) as err:
        validate(layout, LayoutFacts(world_size=world))
    assert all(w in str(err.value) for w in words), str(err.value)


def test_vision_ranks_accepted_layouts_and_strategy_option() -> None:
    for world, layout in (
        (3, ParallelLayout(dp=None, tp=2, vision_ranks=1)),
        (4, ParallelLayout(dp=None, pp=2, vision_ranks=2)),
        (5, ParallelLayout(dp=None, tp=2, pp=2, vision_ranks=1)),
        (6, ParallelLayout(dp=None, vision_ranks=2)),  # 4 replicas, 2 per vision rank
    ):
        validate(layout, LayoutFacts(world_size=world))
    assert ParallelConfig(vision_ranks=2).layout.strategy_args() == {"vision_ranks": 2}
    strategy = MultimodalParallelStrategy(tensor_parallel=2, vision_ranks=1)
    assert strategy.config.vision_ranks == 1
    with pytest.raises(ValueError, match="expert_parallel"):
        MultimodalParallelStrategy(expert_parallel=2, vision_ranks=1)
    validate(
        ParallelLayout(dp=None, pp=2, vision_ranks=2, vision_data_parallel="fsdp"),
        LayoutFacts(world_size=4),
    )
    sharded = MultimodalParallelStrategy(vision_ranks=2, vision_data_parallel="fsdp")
    assert sharded.config.layout.strategy_args() == {
        "vision_ranks": 2,
        "vision_data_parallel": "fsdp",
    }
    assert MultimodalParallelStrategy(vision_ranks=2).config.vision_data_parallel == "ddp"
    with pytest.raises(ValueError, match="vision_data_parallel"):  # at construction
        MultimodalParallelStrategy(vision_data_parallel="fsdp")


def test_links_fan_out_and_fan_in() -> None:
    out = TowerRanks(dims=ParallelDims(world_size=2, pp=2), vision_ranks=2)
    assert [(x.replica, x.vision, x.chunk, x.chunks, x.stage0) for x in out.links()] == [
        (0, 2, 0, 2, (0,)),
        (0, 3, 1, 2, (0,)),
    ]
    assert out.is_vision(3) and not out.is_vision(1) and out.links_of(1) == []
    fan_in = TowerRanks(dims=ParallelDims(world_size=8, tp=2), vision_ranks=2)
    assert [(x.replica, x.vision, x.stage0) for x in fan_in.links()] == [
        (0, 8, (0, 1)),
        (1, 8, (2, 3)),
        (2, 9, (4, 5)),
        (3, 9, (6, 7)),
    ]
    assert [x.replica for x in fan_in.links_of(9)] == [2, 3]
    with pytest.raises(ValueError, match="vision_ranks"):
        TowerRanks(dims=ParallelDims(world_size=3), vision_ranks=2)
    assert chunk_sizes(5, 2) == [3, 2] and chunk_sizes(0, 3) == [0, 0, 0]


def test_inlet_fills_slots_as_the_colocated_tower_scatters() -> None:
    mask = torch.tensor([[True, True, False], [False, False, False], [True, False, False]])
    index = image_index(mask)
    assert index.tolist() == [[0, 1, -1], [-1, -1, -1], [2, -1, -1]]
    tokens = torch.randn(3, 4, 5, requires_grad=True)
    pooled = torch.randn(3, 6)
    inlet = TowerInlet()
    inlet.parts = (tokens, pooled)
    got_tokens, got_pooled, rest = inlet(index, torch.ones(1))
    assert torch.equal(got_tokens, scatter_slots(tokens, mask, False))
    assert torch.equal(got_pooled, scatter_slots(pooled, mask, False))
    assert torch.equal(rest, torch.ones(1))
    got_tokens.sum().backward()
    assert torch.equal(tokens.grad, torch.ones(3, 4, 5))  # each image used once
    inlet.parts = (torch.zeros(0, 4, 5, requires_grad=True),)
    (empty,) = inlet(image_index(torch.zeros(2, 1, dtype=torch.bool)))
    assert empty.shape == (2, 1, 4, 5) and not empty.any()


def test_zero_on_graph_reaches_every_tensor_with_zero_gradients() -> None:
    """The one "zero on the graph" (the vision step's loss, the exchange's backward without
    images, the inlet's empty part): zeros of ``zero``'s shape and dtype whose backward gives
    each tensor a zero gradient; no tensor, ``zero`` itself."""
    a, b = torch.randn(3, 2, requires_grad=True), torch.randn(0, 4, requires_grad=True)
    out = zero_on_graph([a, b], a.new_zeros(2, 5))
    assert out.shape == (2, 5) and not out.any() and out.requires_grad
    out.sum().backward()
    assert torch.equal(a.grad, torch.zeros(3, 2)) and b.grad is not None and b.grad.shape == (0, 4)
    zero = torch.zeros((), dtype=torch.float64)
    assert zero_on_graph([], zero) is zero


def test_tower_block_count_needs_leading_vision_blocks() -> None:
    class Block(torch.nn.Module):
        def __init__(self, kind: str) -> None:
            super().__init__()
            self.kind = kind

    assert tower_block_count([Block("vision"), Block("vision"), Block("language")]) == 2
    with pytest.raises(ValueError, match="vision_ranks"):
        tower_block_count([Block("language"), Block("vision")])


def test_yaml_strategy_section_takes_vision_ranks() -> None:
    """The recipe YAML's strategy section (what LightningCLI instantiates)."""
    import yaml
    from lightning.pytorch.cli import instantiate_class

    section = yaml.safe_load(
        """
        class_path: lightning_mmpar.strategy.MultimodalParallelStrategy
        init_args: {tensor_parallel: 2, pipeline_parallel: 2, vision_ranks: 1}
        """
    )
    strategy = instantiate_class((), section)
    assert strategy.config.vision_ranks == 1
    assert strategy.config.layout.strategy_args()["vision_ranks"] == 1
    section["init_args"] = {"pipeline_parallel": 2, "vision_ranks": 2}
    section["init_args"]["vision_data_parallel"] = "fsdp"
    assert instantiate_class((), section).config.layout.vision_data_parallel == "fsdp"


def test_vision_ranks_skip_the_colocated_tower_rules() -> None:
    """The tower is whole on its own ranks: its sizes are not checked against tp."""
    heads = (("vision", "VisionConfig.heads", 3),)
    with pytest.raises(ValueError, match=r"VisionConfig\.heads"):
        validate(ParallelLayout(dp=None, tp=2), LayoutFacts(world_size=2, vision_tp_sizes=heads))
    validate(
        ParallelLayout(dp=None, tp=2, vision_ranks=1),
        LayoutFacts(world_size=3, vision_tp_sizes=heads),
    )
