"""Rank placement (issue 12): ``ParallelDims(placement=...)`` and the strategy's
``placement`` option, without a process group.

A placement maps each mesh position (the Megatron rank) to the global rank that runs it, so
every coordinate and group of a placed layout must equal the identity layout's, mapped through
the permutation. The real meshes and numerics are checked in
``tests/distributed/test_topology_megatron.py`` and the parity matrix.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from jsonargparse import ArgumentParser
from lightning.pytorch import Trainer

from lightning_mmpar import MultimodalParallelStrategy, ParallelConfig, ParallelDims
from lightning_mmpar.topology import MESH_DIMS, check_placement

NAMES = (*MESH_DIMS, "dp")
LAYOUTS = [(8, 2, 2, 2), (8, 1, 4, 1), (8, 4, 1, 2), (8, 1, 1, 8), (4, 2, 2, 1), (6, 3, 1, 1)]
"""(world, tp, pp, ep)."""


def _permutations(world: int, count: int = 4) -> list[tuple[int, ...]]:
    rng = random.Random(world)
    out = [tuple(reversed(range(world)))]
    for _ in range(count - 1):
        perm = list(range(world))
        rng.shuffle(perm)
        out.append(tuple(perm))
    return out


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda t: "w{}-tp{}-pp{}-ep{}".format(*t))
def test_coordinates_and_groups_follow_the_permutation(layout: tuple[int, int, int, int]) -> None:
    world, tp, pp, ep = layout
    identity = ParallelDims(world_size=world, tp=tp, pp=pp, ep=ep)
    assert identity.placement == tuple(range(world)) and identity.is_identity
    for perm in _permutations(world):
        placed = ParallelDims(world_size=world, tp=tp, pp=pp, ep=ep, placement=perm)
        assert placed.placement == perm and not placed.is_identity
        for position, rank in enumerate(perm):
            assert placed.position(rank) == position
            assert placed.rank_coords(rank) == identity.rank_coords(position)
        for name in NAMES:
            mapped = sorted([perm[p] for p in group] for group in identity.groups(name))
            assert placed.groups(name) == mapped, (name, perm)
            for group in placed.groups(name):  # group-local rank = the coordinate
                for index, rank in enumerate(group):
                    assert placed.rank_coords(rank)[name] == index


def test_tp_peers_and_stages_move_with_the_placement() -> None:
    """The parity layout: tp pairs {3, 1} and {0, 2}, stage 0 on ranks 3 and 1."""
    dims = ParallelDims(world_size=4, tp=2, pp=2, placement=[3, 1, 0, 2])
    assert dims.groups("tp") == [[0, 2], [3, 1]]
    assert dims.groups("pp") == [[1, 2], [3, 0]]
    assert dims.rank_coords(3) == {"tp": 0, "ep": 0, "edp": 0, "pp": 0, "dp": 0}
    assert dims.rank_coords(0) == {"tp": 0, "ep": 0, "edp": 0, "pp": 1, "dp": 0}
    assert dims.placement == (3, 1, 0, 2)  # a list is stored as a tuple


@pytest.mark.parametrize(
    "bad",
    [[0, 1, 2], [0, 1, 2, 2], [1, 2, 3, 4], [0, 1, 2, True], "0123", 3, [0.0, 1, 2, 3]],
    ids=["short", "repeated", "out-of-range", "bool", "string", "int", "float"],
)
def test_invalid_placement_names_field_value_and_fix(bad: object) -> None:
    with pytest.raises(ValueError, match=r"^placement \(.*\) must list every global rank 0 \.\. 3"):
        ParallelDims(world_size=4, tp=2, placement=bad)  # type: ignore[arg-type]
    assert check_placement(None, 3) == (0, 1, 2)


def test_position_of_an_unknown_rank() -> None:
    with pytest.raises(ValueError, match=r"^rank \(4\) must be a global rank in \[0, 4\)"):
        ParallelDims(world_size=4).position(4)


@pytest.mark.parametrize(
    "bad",
    [[1, 2], [0, 0], [0, False], "no/such/topology.txt", 7, {"0": 1}],
    ids=["not-from-0", "repeated", "bool", "missing-file", "int", "dict"],
)
def test_config_refuses_a_bad_placement_at_construction(bad: object) -> None:
    with pytest.raises(ValueError, match=r"^placement \("):
        ParallelConfig(placement=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^placement \("):
        MultimodalParallelStrategy(placement=bad)  # type: ignore[arg-type]


def test_config_resolves_names_lists_and_lengths() -> None:
    assert ParallelConfig().resolve_placement(4) == (None, "megatron")  # CPU: Megatron's order
    assert ParallelConfig(placement="auto").resolve_placement(4) == (None, "megatron")
    assert ParallelConfig(placement="megatron").resolve_placement(4) == (None, "megatron")
    given = ParallelConfig(tensor_parallel=2, placement=[1, 0, 3, 2])
    assert given.resolve_placement(4) == ((1, 0, 3, 2), "given")
    with pytest.raises(ValueError, match=r"lists 4 ranks but the run has 8 processes"):
        given.resolve_placement(8)


def test_topology_file_is_placed(tmp_path: Path) -> None:
    pytest.importorskip("lightning_mmpar.layout.placement")
    from lightning_mmpar.layout.devices import DeviceGraph
    from lightning_mmpar.layout.placement import place

    fixture = Path(__file__).resolve().parents[1] / "fixtures/topology/nvlink_pairs_8gpu.txt"
    config = ParallelConfig(tensor_parallel=2, pipeline_parallel=2, placement=str(fixture))
    placement, source = config.resolve_placement(8)
    graph = DeviceGraph.from_nvidia_smi(fixture.read_text())
    assert placement == tuple(place(graph, pp=2, dp=2, ep=1, tp=2).devices)
    assert source == f"topology {fixture}"
    ParallelDims(world_size=8, tp=2, pp=2, placement=placement)  # a permutation
    with pytest.raises(ValueError, match=r"describes 8 devices but the run has 4 processes"):
        config.resolve_placement(4)


def test_strategy_applies_and_checks_the_placement() -> None:
    strategy = MultimodalParallelStrategy(tensor_parallel=2, placement=[1, 0])
    Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)
    assert strategy.parallel_dims.placement == (1, 0)
    assert strategy.parallel_dims.rank_coords(1)["tp"] == 0
    assert strategy._rank_layout()["rank"] == strategy.parallel_dims.position(0) == 1
    wrong = MultimodalParallelStrategy(placement=[2, 1, 0])
    with pytest.raises(ValueError, match=r"lists 3 ranks but the run has 2 processes"):
        Trainer(strategy=wrong, accelerator="cpu", devices=2, logger=False)


def test_placement_round_trips_through_the_cli_parser() -> None:
    parser = ArgumentParser()
    parser.add_class_arguments(MultimodalParallelStrategy, "strategy")
    for given, expected in (("[3, 1, 0, 2]", [3, 1, 0, 2]), ("megatron", "megatron")):
        cfg = parser.parse_args(["--strategy.placement", given])
        assert cfg.strategy.placement == expected
        again = parser.parse_string(parser.dump(cfg))
        strategy = parser.instantiate(again).strategy
        assert strategy.config.placement == expected


def test_sub_meshes_and_their_groups_are_sliced_once(tmp_path: Path) -> None:
    """``get_mesh`` / ``get_group`` slice the root mesh once per name: the strategy asks for
    the ``dp`` group several times per training step, and slicing costs ~0.2 ms of Python."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        dims = ParallelDims(world_size=1)
        dims.build_mesh("cpu")
        sliced: list[object] = []
        original = DeviceMesh.__getitem__

        def counted(self: DeviceMesh, name: object) -> DeviceMesh:
            sliced.append(name)
            return original(self, name)  # type: ignore[arg-type]

        DeviceMesh.__getitem__ = counted  # type: ignore[assignment, method-assign]
        try:
            first = dims.get_mesh("dp")
            groups = [dims.get_group("dp") for _ in range(3)]
            assert dims.get_mesh("dp") is first
            assert all(g is first.get_group() for g in groups)
            assert dims.get_mesh("data_parallel").size() == 1  # an alias: its own entry
        finally:
            DeviceMesh.__getitem__ = original  # type: ignore[method-assign]
        assert sliced == ["dp", "data_parallel"]
    finally:
        dist.destroy_process_group()
