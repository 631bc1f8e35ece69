"""Every private or version-dependent torch / Lightning API the package touches, in one place."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def init_mesh(
    device_type: str,
    shape: tuple[int, ...],
    names: tuple[str, ...],
    flattened: dict[str, tuple[str, ...]],
) -> DeviceMesh:
    """Build a named mesh and register flattened dimensions (``DeviceMesh._flatten``)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    for flat_name, dims in flattened.items():
        mesh[dims]._flatten(flat_name)
    return mesh


def new_subgroups(groups: list[list[int]]) -> dist.ProcessGroup:
    """Create one process group per list of ranks; return the one holding this rank.

    Collective: every rank creates every group, in the same order.
    """
    group, _ = dist.new_subgroups_by_enumeration(groups)
    assert isinstance(group, dist.ProcessGroup)
    return group
