"""Rank placement (lightning_mmpar.layout.placement): mesh groups equal the strategy's, TP on the
fastest islands, DP across nodes, never worse than Megatron's order, the search against brute
force over every rank permutation, and the machine's placement from nvidia-smi output."""

from __future__ import annotations

import itertools
import subprocess
from pathlib import Path

import pytest

from lightning_mmpar.layout.devices import DeviceGraph, load_topology
from lightning_mmpar.layout.placement import (
    MESH_AXES,
    Placement,
    _Cost,
    group_positions,
    machine_placement,
    megatron_placement,
    place,
    placement_seconds,
)
from lightning_mmpar.topology import MESH_DIMS, ParallelDims

TOPO = Path(__file__).resolve().parents[2] / "fixtures" / "topology"
PCIE = load_topology(TOPO / "pcie_4gpu_2numa.txt")
PAIRS = load_topology(TOPO / "nvlink_pairs_8gpu.txt")
TWO = load_topology(TOPO / "two_nodes_h100.yaml")


def layouts(world: int) -> list[dict[str, int]]:
    """Every (pp, dp, ep, tp) of ``world`` ranks."""
    out = []
    for tp, pp in itertools.product(range(1, world + 1), repeat=2):
        if world % (tp * pp) == 0:
            dp = world // (tp * pp)
            out += [dict(pp=pp, dp=dp, ep=ep, tp=tp) for ep in range(1, dp + 1) if dp % ep == 0]
    return out


def total(graph: DeviceGraph, placement: Placement, **layout: int) -> float:
    return sum(placement_seconds(graph, placement, **layout).values())


def groups_of(graph: DeviceGraph, placement: Placement, dim: str, **layout: int) -> list[set]:
    shape = dict(pp=layout["pp"], dp=layout["dp"], ep=layout["ep"], tp=layout["tp"])
    return [{placement.devices[p] for p in g} for g in group_positions(shape, dim)]


def nodes_spanned(graph: DeviceGraph, placement: Placement, dim: str, **layout: int) -> set[int]:
    """How many nodes each group of ``dim`` spans (as a set over the groups)."""
    groups = groups_of(graph, placement, dim, **layout)
    return {len({graph.node_of[d] for d in g}) for g in groups}


@pytest.mark.parametrize(
    ("world", "tp", "pp", "ep"),
    [(8, 2, 2, 1), (8, 1, 2, 2), (16, 2, 2, 2), (12, 3, 2, 1), (8, 2, 1, 4), (1, 1, 1, 1)],
)
def test_group_positions_equal_parallel_dims(world: int, tp: int, pp: int, ep: int) -> None:
    assert MESH_AXES == MESH_DIMS
    dims = ParallelDims(world_size=world, tp=tp, pp=pp, ep=ep)
    as_dict = {"pp": pp, "dp": dims.dp, "ep": ep, "tp": tp}
    for dim in ("pp", "edp", "ep", "tp", "dp"):
        assert group_positions(as_dict, dim) == dims.groups(dim), dim
        assert group_positions(dims.shape, dim) == dims.groups(dim), dim
    assert group_positions(dims.shape, "vl") == dims.groups("tp")
    with pytest.raises(ValueError, match="dim \\('cp'\\)"):
        group_positions(dims.shape, "cp")
    with pytest.raises(ValueError, match="shape \\(2, 2\\) must give the sizes"):
        group_positions((2, 2), "tp")


def test_tp_on_nvlink_pairs() -> None:
    for layout in (
        dict(pp=1, dp=4, ep=1, tp=2),
        dict(pp=2, dp=2, ep=1, tp=2),
        dict(pp=2, dp=2, ep=2, tp=2),
        dict(pp=4, dp=1, ep=1, tp=2),
    ):
        chosen = place(PAIRS, **layout)
        assert all(
            g in ({0, 1}, {2, 3}, {4, 5}, {6, 7}) for g in groups_of(PAIRS, chosen, "tp", **layout)
        ), (layout, chosen)
    # pairs numbered apart (0-4, 1-5, ...): Megatron's order puts TP on PCIe, place does not
    apart = PAIRS.select([0, 2, 4, 6, 1, 3, 5, 7])
    layout = dict(pp=2, dp=2, ep=1, tp=2)
    chosen = place(apart, **layout)
    assert sorted(map(sorted, groups_of(apart, chosen, "tp", **layout))) == [
        [0, 4],
        [1, 5],
        [2, 6],
        [3, 7],
    ]
    # the pipeline boundary stays inside a socket (PXB), data parallelism crosses (SYS)
    for dim, link in (("pp", "PXB"), ("dp", "SYS")):
        for a, b in map(sorted, groups_of(apart, chosen, dim, **layout)):
            assert apart.links[a][b] == link, (dim, chosen)
    megatron = megatron_placement(8)
    assert groups_of(apart, megatron, "tp", **layout)[0] == {0, 1}  # PXB, not NVLink
    fast, slow = total(apart, chosen, **layout), total(apart, megatron, **layout)
    assert fast < 0.2 * slow


def test_tp_within_a_numa_node() -> None:
    layout = dict(pp=1, dp=2, ep=1, tp=2)
    for graph in (PCIE, PCIE.select([0, 2, 1, 3]), PCIE.select([3, 0, 2, 1])):
        chosen = place(graph, **layout)
        for g in groups_of(graph, chosen, "tp", **layout):
            a, b = sorted(g)
            assert graph.links[a][b] in ("PIX", "PHB"), (graph.links, chosen)


def test_two_nodes() -> None:
    layout = dict(pp=2, dp=1, ep=1, tp=8)
    chosen = place(TWO, **layout)
    assert nodes_spanned(TWO, chosen, "tp", **layout) == {1}
    # nodes interleaved (rank r on node r % 2): Megatron's TP groups would cross the network
    mixed = TWO.select([k // 2 + 8 * (k % 2) for k in range(16)])
    for layout in (
        dict(pp=2, dp=1, ep=1, tp=8),
        dict(pp=1, dp=8, ep=4, tp=2),
        dict(pp=2, dp=2, ep=1, tp=4),
    ):
        chosen = place(mixed, **layout)
        for dim in ("tp", "ep"):
            assert nodes_spanned(mixed, chosen, dim, **layout) == {1}, (dim, layout)
        assert total(mixed, chosen, **layout) < total(mixed, megatron_placement(16), **layout)
    # tp 4 pp 2 dp 2: Megatron sends PP over the network; place keeps PP in a node, DP across
    layout = dict(pp=2, dp=2, ep=1, tp=4)
    chosen = place(TWO, **layout)
    assert nodes_spanned(TWO, chosen, "pp", **layout) == {1}
    assert nodes_spanned(TWO, chosen, "dp", **layout) == {2}
    assert nodes_spanned(TWO, megatron_placement(16), "pp", **layout) == {2}
    by_dim = placement_seconds(TWO, chosen, **layout)
    megatron = placement_seconds(TWO, megatron_placement(16), **layout)
    assert by_dim["pp"] < megatron["pp"] and by_dim["dp"] > megatron["dp"]
    assert sum(by_dim.values()) < sum(megatron.values())


def test_never_worse_than_megatron() -> None:
    for name in (
        "dgx_h100.txt",
        "pcie_4gpu_2numa.txt",
        "nvlink_pairs_8gpu.txt",
        "two_nodes_h100.yaml",
        "two_nodes_pcie_matrix.yaml",
    ):
        graph = load_topology(TOPO / name)
        for layout in layouts(graph.num_devices)[:: 1 if graph.num_devices <= 8 else 3]:
            chosen = place(graph, **layout)
            ours = total(graph, chosen, **layout)
            assert ours <= total(graph, megatron_placement(graph.num_devices), **layout) * (
                1 + 1e-12
            ), (name, layout)


def brute_force(graph: DeviceGraph, layout: dict[str, int], first: int | None = None) -> float:
    """The least total over every rank permutation (``first``: device 0 fixed at position 0,
    exact on a vertex-transitive graph: relabelling by an automorphism keeps every cost)."""
    shape = {
        "pp": layout["pp"],
        "edp": layout["dp"] // layout["ep"],
        "ep": layout["ep"],
        "tp": layout["tp"],
    }
    cost = _Cost(graph, shape, {"tp": 8e9, "ep": 1e9, "pp": 1.25e8, "dp": 1.5e7})
    n = graph.num_devices
    rest = itertools.permutations(range(1, n)) if first == 0 else None
    perms = ((0, *p) for p in rest) if rest else itertools.permutations(range(n))
    return min(sum(cost.seconds(p)[0].values()) for p in perms)


def test_search_matches_brute_force() -> None:
    for layout in layouts(4):
        for graph in (PCIE, PCIE.select([0, 2, 1, 3])):
            best = brute_force(graph, layout)
            assert total(graph, place(graph, **layout), **layout) == pytest.approx(best, rel=1e-12)
    for layout in (dict(pp=2, dp=2, ep=1, tp=2), dict(pp=2, dp=4, ep=4, tp=1)):
        best = brute_force(PAIRS, layout, first=0)
        assert total(PAIRS, place(PAIRS, **layout), **layout) == pytest.approx(best, rel=1e-12)


def test_traffic_keys_and_errors() -> None:
    layout = dict(pp=2, dp=2, ep=1, tp=2)
    ident = megatron_placement(8)
    plain = placement_seconds(PAIRS, ident, **layout, traffic={"tp": 1e8, "pp": 1e6})
    keys = {"tp.all_reduce": 1e8, "pp.send": 1e6, "pp.recv": 1e6}  # recv: the same messages
    split = placement_seconds(PAIRS, ident, **layout, traffic=keys)
    assert plain == split and set(plain) == {"tp", "pp"}
    fsdp = {"dp.all_gather": 1e8, "dp.reduce_scatter": 1e8}  # = one all-reduce of 1e8 bytes
    gather = placement_seconds(PAIRS, ident, **layout, traffic=fsdp)["dp"]
    reduce = placement_seconds(PAIRS, ident, **layout, traffic={"dp.all_reduce": 1e8})["dp"]
    assert gather == pytest.approx(reduce, rel=1e-12)
    with pytest.raises(ValueError, match="traffic key 'cp'"):
        placement_seconds(PAIRS, ident, **layout, traffic={"cp": 1.0})
    extra = {"pp.broadcast": 1e6, "dp.barrier": 0, "tp.recv": 1e6}  # comm_bytes' other kinds
    assert placement_seconds(PAIRS, ident, **layout, traffic=extra) == placement_seconds(
        PAIRS, ident, **layout, traffic={"pp.all_gather": 1e6}
    )
    with pytest.raises(ValueError, match=r"traffic key 'tp\.gather'"):
        place(PAIRS, **layout, traffic={"tp.gather": 1.0})
    with pytest.raises(ValueError, match="graph has 8 devices but the layout needs"):
        place(PAIRS, pp=1, dp=2, ep=1, tp=2)
    with pytest.raises(ValueError, match="ep \\(3\\) must divide dp \\(4\\)"):
        place(PAIRS, pp=1, dp=4, ep=3, tp=2)
    with pytest.raises(ValueError, match="tp \\(0\\) must be a positive integer"):
        place(PAIRS, pp=1, dp=8, ep=1, tp=0)
    with pytest.raises(ValueError, match=r"permutation of 0 \.\. 2"):
        Placement((0, 0, 2))
    assert Placement([1, 0]).devices == (1, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="placement has 4 ranks"):
        placement_seconds(PAIRS, megatron_placement(4), pp=1, dp=4, ep=1, tp=2)
    for world in (0, -2, 2.0):
        with pytest.raises(ValueError, match=r"world \(.*\) must be an int >= 1"):
            megatron_placement(world)  # type: ignore[arg-type]
    routed = {"ep.all_to_all_v": 1e8, "tp": 1e8}  # MoE dispatch: an all-to-all of its bytes
    assert placement_seconds(PAIRS, ident, pp=2, dp=2, ep=2, tp=2, traffic=routed) == (
        placement_seconds(
            PAIRS, ident, pp=2, dp=2, ep=2, tp=2, traffic={"ep.all_to_all": 1e8, "tp": 1e8}
        )
    )


def test_machine_placement(monkeypatch: pytest.MonkeyPatch) -> None:
    text = (TOPO / "nvlink_pairs_8gpu.txt").read_text()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(
        subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 0, stdout=text)
    )
    layout = dict(pp=2, dp=2, ep=1, tp=2)
    assert machine_placement(**layout, world=8) == place(PAIRS, **layout).devices
    two = machine_placement(pp=2, dp=4, ep=1, tp=2, world=16)  # two such nodes
    assert two == place(PAIRS.replicate(2), pp=2, dp=4, ep=1, tp=2).devices
    assert machine_placement(pp=1, dp=6, ep=1, tp=2, world=12) is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,2,4,6,1,3,5,7")
    apart = machine_placement(**layout, world=8)
    assert apart is not None and apart != tuple(range(8))
    assert total(PAIRS.select([0, 2, 4, 6, 1, 3, 5, 7]), Placement(apart), **layout) == (
        pytest.approx(total(PAIRS, place(PAIRS, **layout), **layout))
    )

    def missing(cmd: list[str], **kwargs: object) -> None:
        raise FileNotFoundError(cmd[0])

    monkeypatch.setattr(subprocess, "run", missing)
    assert machine_placement(**layout, world=8) is None
