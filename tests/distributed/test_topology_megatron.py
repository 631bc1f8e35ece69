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
communicator.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch.distributed as dist

from lightning_mmpar.testing import spawn
from lightning_mmpar.topology import ParallelDims

WORLD = 8
LAYOUTS: list[tuple[int, int, int]] = [
    (1, 1, 1), (2, 1, 1), (4, 1, 1), (8, 1, 1), (1, 2, 1), (1, 4, 1), (1, 8, 1), (2, 2, 1),
    (2, 4, 1), (4, 2, 1), (2, 1, 2), (1, 1, 2), (1, 1, 4), (1, 1, 8), (2, 2, 2), (1, 2, 2),
    (1, 2, 4), (4, 1, 2), (2, 1, 4),
]  # fmt: skip
"""(tp, pp, ep) layouts proven against megatron-core."""
MESH_LAYOUTS: list[tuple[int, int, int]] = [(2, 2, 2), (1, 2, 4), (4, 1, 2)]
"""(tp, pp, ep) layouts whose real ``DeviceMesh`` is built."""
NAMES: tuple[str, ...] = ("tp", "pp", "dp", "ep", "edp")


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


def _mesh_checks(rank: int, tp: int, pp: int, ep: int) -> dict[str, Any]:
    dims = ParallelDims(world_size=WORLD, tp=tp, pp=pp, ep=ep)
    dims.build_mesh("cpu")
    meshes = {name: dist.get_process_group_ranks(dims.get_mesh(name).get_group()) for name in NAMES}
    vl = dims.vl_group
    return {
        "mesh": meshes,
        "local": {name: dims.get_mesh(name).get_local_rank() for name in NAMES},
        "vl": dist.get_process_group_ranks(vl),
        "vl_is_tp": vl is dims.get_mesh("tp").get_group(),
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
        ps.destroy_model_parallel()
    meshes = {layout: _mesh_checks(rank, *layout) for layout in MESH_LAYOUTS}
    return {"megatron": megatron, "meshes": meshes}


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
