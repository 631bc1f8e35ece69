"""Our rank layout vs megatron-core's ``parallel_state``, in one real 8-rank gloo world.

For every layout in :data:`LAYOUTS` each rank runs megatron-core's unpatched
``initialize_model_parallel(tp, pp, ep)`` on gloo and reads its groups; the test then asserts that
``ParallelDims(world_size=8, tp, pp, ep).groups(name)`` is exactly the set of megatron's groups
(same ranks, same order, so group-local rank = our coordinate) and that ``rank_coords`` equals
megatron's per-group ranks:

==========  ============================================================================
ours        megatron-core
==========  ============================================================================
``tp``      ``get_tensor_model_parallel_group`` and ``get_expert_tensor_parallel_group``
``pp``      ``get_pipeline_model_parallel_group``
``dp``      ``get_data_parallel_group`` (dense parameters, context parallel = 1)
``ep``      ``get_expert_model_parallel_group``
``edp``     ``get_expert_data_parallel_group``
==========  ============================================================================

Megatron convention matched: the default ``order="tp-cp-ep-dp-pp"`` with context parallel 1 and
``expert_tensor_parallel_size=None``, which megatron-core 0.16 resolves to
``expert_tensor_parallel_size = tensor_model_parallel_size`` (ETP = TP; the expert rank
generator is then ``tp, ep, edp = world / (tp * ep * pp), pp``). Megatron with
``expert_tensor_parallel_size=1`` and ``tp > 1`` lays experts out differently and is not what
``ParallelDims`` models.

The same world then builds our real mesh for a few layouts and checks that every ``get_mesh(name)``
holds this rank's ``groups(name)`` row and that ``vl_group`` has the tp ranks on its own
communicator. It also builds meshes under rank placements (:data:`PLACED`: tp peers apart,
stage 0 off rank 0, a world-spanning dp / tp axis reordered) and checks the same, plus that
each group-local rank and ``DeviceMesh.get_coordinate()`` equal ``rank_coords`` (torch 2.14's
``new_group`` sorts ranks: without ``compat``'s order-preserving groups they differ) and that a
``DTensor`` sharded on the placed tp mesh holds the coordinate's chunk and gathers back whole.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_mmpar.testing import spawn
from lightning_mmpar.topology import MESH_DIMS, ParallelDims

WORLD = 8
LAYOUTS: list[tuple[int, int, int]] = [
    (1, 1, 1),
    (2, 1, 1),
    (4, 1, 1),
    (8, 1, 1),
    (1, 2, 1),
    (1, 4, 1),
    (1, 8, 1),
    (2, 2, 1),
    (2, 4, 1),
    (4, 2, 1),
    (2, 1, 2),
    (1, 1, 2),
    (1, 1, 4),
    (1, 1, 8),
    (2, 2, 2),
    (1, 2, 2),
    (1, 2, 4),
    (4, 1, 2),
    (2, 1, 4),
]
"""(tp, pp, ep) layouts proven against megatron-core."""
MESH_LAYOUTS: list[tuple[int, int, int]] = [(2, 2, 2), (1, 2, 4), (4, 1, 2)]
"""(tp, pp, ep) layouts whose real ``DeviceMesh`` is built."""
PLACED: list[tuple[tuple[int, int, int], tuple[int, ...]]] = [
    ((2, 2, 2), (5, 2, 7, 0, 3, 6, 1, 4)),
    ((1, 1, 1), (7, 6, 5, 4, 3, 2, 1, 0)),
    ((8, 1, 1), (3, 0, 6, 1, 7, 4, 2, 5)),
]
"""((tp, pp, ep), placement) whose permuted ``DeviceMesh`` is built."""
NAMES: tuple[str, ...] = ("tp", "pp", "dp", "ep", "edp")
TIMEOUT_S = 123.0


def _megatron_groups() -> dict[str, tuple[list[int], int]]:
    """This rank's megatron groups: name -> (ranks, group-local rank)."""
    from megatron.core import parallel_state as ps

    getters = {
        "tp": ps.get_tensor_model_parallel_group,
        "pp": ps.get_pipeline_model_parallel_group,
        "dp": ps.get_data_parallel_group,
        "ep": ps.get_expert_model_parallel_group,
        "edp": ps.get_expert_data_parallel_group,
        "etp": ps.get_expert_tensor_parallel_group,
    }
    out = {}
    for name, get in getters.items():
        group = get()
        out[name] = (dist.get_process_group_ranks(group), dist.get_rank(group))
    return out


def _destroy_megatron_groups() -> None:
    """Destroy the groups megatron-core created, not only forget them as
    ``destroy_model_parallel`` does: with every layout's gloo groups alive, creating the next
    group slowed from 0.5 s to over 30 s per layout on 2 cores and the world timed out."""
    from megatron.core import parallel_state as ps

    for group in ps._global_process_group_list or []:
        if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(group)
    ps.destroy_model_parallel()


def _mesh_checks(
    rank: int, tp: int, pp: int, ep: int, placement: tuple[int, ...] | None = None
) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    dims = ParallelDims(world_size=WORLD, tp=tp, pp=pp, ep=ep, placement=placement)
    dims.build_mesh("cpu")
    meshes = {name: dist.get_process_group_ranks(dims.get_mesh(name).get_group()) for name in NAMES}
    vl = dims.vl_group
    whole = torch.arange(4.0 * tp)
    shard = distribute_tensor(whole, dims.get_mesh("tp"), [Shard(0)])
    return {
        "mesh": meshes,
        "local": {name: dims.get_mesh(name).get_local_rank() for name in NAMES},
        "coordinate": dict(zip(MESH_DIMS, dims.mesh.get_coordinate() or (), strict=True)),
        "vl": dist.get_process_group_ranks(vl),
        "vl_local": dims.vl_mesh.get_local_rank(),
        "vl_is_tp": vl is dims.get_mesh("tp").get_group(),
        "shard": shard.to_local().tolist(),
        "gathered": torch.equal(shard.full_tensor(), whole),
    }


def _worker(rank: int, world: int) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
        from megatron.core import parallel_state as ps

    megatron = {}
    for tp, pp, ep in LAYOUTS:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
            create_gloo_process_groups=False,  # the default group is gloo already
        )
        megatron[(tp, pp, ep)] = _megatron_groups()
        _destroy_megatron_groups()
    meshes = {layout: _mesh_checks(rank, *layout) for layout in MESH_LAYOUTS}
    placed = {perm: _mesh_checks(rank, *layout, perm) for layout, perm in PLACED}
    return {"megatron": megatron, "meshes": meshes, "placed": placed, "timeouts": _timeouts()}


def _timeouts() -> dict[str, dict[str, float]]:
    """Seconds of every mesh group's timeout when the mesh is built with one (the strategy
    passes its ``timeout``; torch alone would give the sub-groups its 30-minute default)."""
    from datetime import timedelta

    from lightning_mmpar import compat

    out = {}
    for key, placement in (("identity", None), ("placed", PLACED[0][1])):
        tp, pp, ep = PLACED[0][0]
        dims = ParallelDims(world_size=WORLD, tp=tp, pp=pp, ep=ep, placement=placement)
        dims.build_mesh("cpu", timeout=timedelta(seconds=TIMEOUT_S))
        groups = {name: dims.get_mesh(name).get_group() for name in NAMES} | {"vl": dims.vl_group}
        out[key] = {
            name: g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
            for name, g in groups.items()
            if g is not dist.group.WORLD
        }
    compat.set_group_timeout(None)
    return out


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return spawn(_worker, WORLD)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda t: "tp{}-pp{}-ep{}".format(*t))
def test_groups_match_megatron(world: list[dict[str, Any]], layout: tuple[int, int, int]) -> None:
    tp, pp, ep = layout
    dims = ParallelDims(world_size=WORLD, tp=tp, pp=pp, ep=ep)
    for name in (*NAMES, "etp"):
        ours = dims.groups("tp" if name == "etp" else name)
        theirs = {tuple(r["megatron"][layout][name][0]) for r in world}
        assert {tuple(g) for g in ours} == theirs, f"{name} groups of {layout}"
        for rank, result in enumerate(world):
            ranks, local = result["megatron"][layout][name]
            assert ranks in ours, f"rank {rank}: megatron {name} group {ranks} of {layout}"
            coord = dims.rank_coords(rank)["tp" if name == "etp" else name]
            assert local == coord, f"rank {rank}: {name} rank {local} != ours {coord} ({layout})"


@pytest.mark.distributed
@pytest.mark.parametrize("layout", MESH_LAYOUTS, ids=lambda t: "tp{}-pp{}-ep{}".format(*t))
def test_mesh_matches_groups(world: list[dict[str, Any]], layout: tuple[int, int, int]) -> None:
    dims = ParallelDims(world_size=WORLD, tp=layout[0], pp=layout[1], ep=layout[2])
    for rank, result in enumerate(world):
        checks = result["meshes"][layout]
        coords = dims.rank_coords(rank)
        for name in NAMES:
            mine = next(g for g in dims.groups(name) if rank in g)
            assert checks["mesh"][name] == mine, f"rank {rank}: mesh {name!r} of {layout}"
            assert checks["local"][name] == coords[name], f"rank {rank}: {name} local rank"
        assert checks["vl"] == checks["mesh"]["tp"], f"rank {rank}: vl_group ranks"
        assert not checks["vl_is_tp"], f"rank {rank}: vl_group must be its own communicator"


@pytest.mark.distributed
@pytest.mark.parametrize("case", PLACED, ids=lambda c: "tp{}-pp{}-ep{}-placed".format(*c[0]))
def test_placed_mesh_matches_groups(
    world: list[dict[str, Any]], case: tuple[tuple[int, int, int], tuple[int, ...]]
) -> None:
    (tp, pp, ep), perm = case
    dims = ParallelDims(world_size=WORLD, tp=tp, pp=pp, ep=ep, placement=perm)
    for rank, result in enumerate(world):
        checks, coords = result["placed"][perm], dims.rank_coords(rank)
        for name in NAMES:
            mine = next(g for g in dims.groups(name) if rank in g)
            assert checks["mesh"][name] == mine, f"rank {rank}: placed mesh {name!r}"
            assert checks["local"][name] == coords[name], f"rank {rank}: {name} group rank"
        assert checks["coordinate"] == {d: coords[d] for d in ("pp", "edp", "ep", "tp")}
        assert checks["vl"] == checks["mesh"]["tp"] and checks["vl_local"] == coords["tp"]
        assert not checks["vl_is_tp"], f"rank {rank}: vl_group must be its own communicator"
        chunk = list(range(4 * coords["tp"], 4 * coords["tp"] + 4))
        assert checks["shard"] == chunk and checks["gathered"], f"rank {rank}: tp DTensor"


@pytest.mark.distributed
def test_mesh_groups_take_the_strategy_timeout(world: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(world):
        for key, timeouts in result["timeouts"].items():
            assert len(timeouts) >= 4, (rank, key, timeouts)  # sub-groups, not the world group
            assert set(timeouts.values()) == {TIMEOUT_S}, (rank, key, timeouts)
