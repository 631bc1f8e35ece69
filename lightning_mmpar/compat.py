"""Every private or version-dependent torch / Lightning API the package touches, in one place."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@contextmanager
def _ordered_groups() -> Iterator[None]:
    """While set, the groups ``DeviceMesh`` creates keep its rank order (``sort_ranks=False``).

    torch 2.14's ``DeviceMesh`` creates each group with ``new_group(ranks)``, which sorts the
    ranks, while ``get_coordinate()`` (DTensor's shard offsets) reads the mesh tensor: on a
    permuted mesh a rank's group-local rank (``get_local_rank``, every collective's order) then
    differs from its coordinate (checked on gloo: tp group ``[3, 1]`` gave rank 3 coordinate 0,
    group rank 1). Keeping the order makes both agree (pytorch/pytorch PR 193224 proposes the
    same as a ``preserve_rank_order`` flag). A no-op for sorted rank lists.
    """
    from functools import partial

    import torch.distributed.device_mesh as device_mesh

    original = device_mesh.new_group  # type: ignore[attr-defined]
    device_mesh.new_group = partial(original, sort_ranks=False)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        device_mesh.new_group = original  # type: ignore[attr-defined]


def init_mesh(
    device_type: str,
    shape: tuple[int, ...],
    names: tuple[str, ...],
    flattened: dict[str, tuple[str, ...]],
    ranks: Sequence[int] | None = None,
) -> DeviceMesh:
    """Build a named mesh and register flattened dimensions (``DeviceMesh._flatten``).

    ``ranks`` (length ``prod(shape)``, default ``0 .. n - 1``): the global rank of each mesh
    position, row-major; the mesh is ``DeviceMesh(device_type, tensor(ranks).reshape(shape))``
    with order-preserving groups (:func:`_ordered_groups`). A dimension spanning the whole
    world gets a group of its own in that order (torch would reuse the default group, ordered
    by global rank).
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if ranks is None or list(ranks) == list(range(len(ranks))):
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        for flat_name, dims in flattened.items():
            mesh[dims]._flatten(flat_name)
        return mesh
    world, backend = math.prod(shape), dist.get_backend()
    override = tuple((backend, None) if size == world else (None, None) for size in shape)
    with _ordered_groups():
        mesh = DeviceMesh(
            device_type,
            torch.tensor(list(ranks), dtype=torch.int).reshape(shape),
            mesh_dim_names=names,
            backend_override=override,  # type: ignore[arg-type]
        )
        for flat_name, dims in flattened.items():
            size = math.prod(shape[names.index(d)] for d in dims)
            mesh[dims]._flatten(flat_name, backend if size == world else None)
    return mesh


def own_communicator(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """A 1-D mesh over the same ranks as ``mesh``, in its order, with its own communicator,
    derived from the same root mesh (``DeviceMesh._unflatten``), so FSDP2 can combine it with
    the dp mesh."""
    import torch.distributed as dist

    ranks = mesh.mesh.flatten().tolist()
    whole = len(ranks) == dist.get_world_size() and ranks != sorted(ranks)
    override = {name: dist.get_backend()} if whole else None  # see init_mesh
    with _ordered_groups():
        return mesh._unflatten(0, (mesh.size(),), (name,), override)  # type: ignore[arg-type]


def checkpoint_module(module: Any, context_fn: Any = None) -> None:
    """Activation checkpointing of one module in place (torch's private composable
    ``checkpoint``: forward hooks, so the module tree and parameter names stay as they are).
    ``context_fn`` (torch's checkpoint argument) returns the forward's and the recomputation's
    context managers: e.g. the RNG tracker's replay, so dropout masks match."""
    from torch.distributed._composable import checkpoint

    if context_fn is None:
        checkpoint(module)
    else:
        checkpoint(module, context_fn=context_fn)


def deepspeed_broadcast_zero_dim() -> None:
    """Let DeepSpeed's engine broadcast 0-dim parameters (CLIP's logit scale, say).

    DeepSpeed (0.19) broadcasts every parameter as ``p.data.view(torch.uint8)``, which raises
    for 0-dim tensors. While ``_broadcast_model`` runs, such parameters hold a 1-element view of
    their own storage; the broadcast values land in that storage, then the 0-dim tensor is put
    back. Idempotent.
    """
    from deepspeed.runtime.engine import DeepSpeedEngine

    original = DeepSpeedEngine._broadcast_model
    if getattr(original, "_zero_dim_safe", False):
        return

    def _broadcast_model(self: DeepSpeedEngine) -> None:
        zero_dim = [p for p in self.module.parameters() if p.dim() == 0]
        kept = [p.data for p in zero_dim]
        for p in zero_dim:
            p.data = p.data.reshape(1)
        try:
            original(self)
        finally:
            for p, data in zip(zero_dim, kept, strict=True):
                p.data = data

    _broadcast_model._zero_dim_safe = True  # type: ignore[attr-defined]
    DeepSpeedEngine._broadcast_model = _broadcast_model  # type: ignore[method-assign]
