"""Every private or version-dependent torch / Lightning API the package touches, in one place."""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


_GROUP_TIMEOUT: list[timedelta | None] = [None]
"""Timeout of the groups a ``DeviceMesh`` creates (:func:`set_group_timeout`); None: torch's."""


def set_group_timeout(timeout: timedelta | None) -> None:
    """Give every group the meshes create from now on ``timeout`` (the strategy's
    ``timeout``, which Lightning passes to the world group only).

    torch's ``DeviceMesh`` creates its tensor/pipeline/data-parallel groups with
    ``new_group(timeout=None)``, i.e. torch's default (30 minutes on gloo, 10 on NCCL),
    whatever the world group's timeout: a collective on a sub-group that waits for a dead or
    hung peer would stall that long instead of the configured time.
    """
    _GROUP_TIMEOUT[0] = timeout


def _keep_rank_order(new_group: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Ask ``new_group`` to keep the ranks' order (``sort_ranks=False``, torch >= 2.12). An older
    torch has no such argument and always sorts: sorted rank lists need nothing; a permuted one
    is refused, as its collectives would run in another order than DTensor's coordinates.

    Raises:
        RuntimeError: a permuted rank list on a torch whose ``new_group`` cannot keep its order.
    """
    import torch

    if "sort_ranks" in inspect.signature(new_group).parameters:
        kwargs["sort_ranks"] = False
        return
    ranks = kwargs.get("ranks", args[0] if args else None)
    if ranks is not None and list(ranks) != sorted(ranks):
        raise RuntimeError(
            f"rank placement: a process group over ranks {list(ranks)} (not in ascending order) "
            f"needs torch.distributed.new_group(sort_ranks=False), which torch {torch.__version__} "
            "lacks: upgrade torch, or use a rank placement whose groups are ascending."
        )


def new_group_in_order(ranks: Sequence[int], backend: str) -> Any:
    """``torch.distributed.new_group`` over ``ranks`` in their given order (``sort_ranks=False``
    where torch has it: :func:`_keep_rank_order`) on ``backend``, with the timeout of
    :func:`set_group_timeout`. Collective over the world: every rank calls it with the same
    ``ranks``, member or not. Raises ``RuntimeError`` as :func:`_keep_rank_order`."""
    import torch.distributed as dist

    kwargs: dict[str, Any] = {"ranks": list(ranks), "backend": backend}
    if _GROUP_TIMEOUT[0] is not None:
        kwargs["timeout"] = _GROUP_TIMEOUT[0]
    _keep_rank_order(dist.new_group, (), kwargs)
    return dist.new_group(**kwargs)


@contextmanager
def _ordered_groups(ordered: bool = True) -> Iterator[None]:
    """While set, the groups ``DeviceMesh`` creates keep its rank order (``sort_ranks=False``)
    and get the timeout of :func:`set_group_timeout`.

    torch 2.14's ``DeviceMesh`` creates each group with ``new_group(ranks)``, which sorts the
    ranks, while ``get_coordinate()`` (DTensor's shard offsets) reads the mesh tensor: on a
    permuted mesh a rank's group-local rank (``get_local_rank``, every collective's order) then
    differs from its coordinate (checked on gloo: tp group ``[3, 1]`` gave rank 3 coordinate 0,
    group rank 1). Keeping the order makes both agree (pytorch/pytorch PR 193224 proposes the
    same as a ``preserve_rank_order`` flag). A no-op for sorted rank lists.
    """
    import torch.distributed.device_mesh as device_mesh

    timeout = _GROUP_TIMEOUT[0]
    originals = {n: getattr(device_mesh, n) for n in ("new_group", "split_group")}

    def wrap(name: str) -> Any:
        def create(*args: Any, **kwargs: Any) -> Any:
            if timeout is not None and kwargs.get("timeout") is None:
                kwargs["timeout"] = timeout
            if ordered and name == "new_group":
                _keep_rank_order(originals[name], args, kwargs)
            return originals[name](*args, **kwargs)

        return create

    for name in originals:
        setattr(device_mesh, name, wrap(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(device_mesh, name, original)


def init_mesh(
    device_type: str,
    shape: tuple[int, ...],
    names: tuple[str, ...],
    flattened: dict[str, tuple[str, ...]],
    ranks: Sequence[int] | None = None,
    timeout: timedelta | None = None,
) -> DeviceMesh:
    """Build a named mesh and register flattened dimensions (``DeviceMesh._flatten``).

    ``ranks`` (length ``prod(shape)``, default ``0 .. n - 1``): the global rank of each mesh
    position, row-major; the mesh is ``DeviceMesh(device_type, tensor(ranks).reshape(shape))``
    with order-preserving groups (:func:`_ordered_groups`). A dimension spanning the whole
    world gets a group of its own in that order (torch would reuse the default group, ordered
    by global rank). ``timeout``: of every group the mesh creates (:func:`set_group_timeout`;
    None keeps the current setting).
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if timeout is not None:
        set_group_timeout(timeout)
    if ranks is None or list(ranks) == list(range(len(ranks))):
        with _ordered_groups(ordered=False):
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


def broadcast_coalesced(tensors: list[Any], group: Any, bucket_bytes: int) -> None:
    """Group rank 0's values into ``tensors`` (same device, any dtypes), coalesced into
    buckets of ``bucket_bytes``: torch's private ``_broadcast_coalesced``, what
    ``DistributedDataParallel`` uses to sync module states at construction."""
    import torch.distributed as dist

    dist._broadcast_coalesced(group, tensors, bucket_bytes, 0)


def replicate(module: Any, ignored_modules: Sequence[Any], **ddp_kwargs: Any) -> Any:
    """torch's composable ``replicate`` (``torch.distributed._composable.replicate``, private;
    torchtitan's ``apply_ddp``) with ``ddp_kwargs`` for its ``DistributedDataParallel``, plus
    no buffer broadcast in forward: ``forward_sync_buffers=False`` where torch has it (2.14),
    else ``broadcast_buffers=False`` (deprecated there)."""
    import inspect

    from torch.distributed._composable.replicate import replicate as torch_replicate
    from torch.nn.parallel import DistributedDataParallel

    params = inspect.signature(DistributedDataParallel.__init__).parameters
    key = "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"
    return torch_replicate(module, ignored_modules=ignored_modules, **{key: False}, **ddp_kwargs)
