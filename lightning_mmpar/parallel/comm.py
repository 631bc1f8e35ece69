"""Device-aware collectives: the one place the package calls ``torch.distributed`` collectives.

Every function puts its tensors on the device the group's backend accepts (CUDA for NCCL, CPU
for gloo), runs the collective there and hands the result back on the caller's device, so no
code path sends a CPU tensor through an NCCL group (or a CUDA tensor through gloo). A ``group``
of ``None`` means the default (world) group; every function is the identity when no process
group exists or the group has size 1, so single-process runs need no special case.

Ranks passed as ``src`` / ``dst`` are *group* ranks (``group_src`` in torch's terms).
A test (``tests/unit/test_architecture.py``) fails if a collective is called anywhere else in
the package.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "ReduceOp",
    "all_gather",
    "all_gather_cpu",
    "all_gather_objects",
    "all_gather_stacked",
    "all_reduce",
    "all_to_all_counts",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "group_device",
    "group_rank",
    "group_size",
    "is_distributed",
    "isend_tensor",
    "recv_object",
    "recv_tensor",
    "recv_tensors",
    "send_object",
    "send_tensor",
    "send_tensors",
    "to_local",
    "to_locals",
]

ReduceOp = Literal["sum", "max", "min", "avg"]
_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN", "avg": "SUM"}


def is_distributed() -> bool:
    """Whether a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def group_size(group: dist.ProcessGroup | None = None) -> int:
    """Ranks in ``group`` (1 without a process group)."""
    return dist.get_world_size(group) if is_distributed() else 1


def group_rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank inside ``group`` (0 without a process group)."""
    return dist.get_rank(group) if is_distributed() else 0


def group_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device ``group``'s collectives accept: the current CUDA device for NCCL, else CPU."""
    if is_distributed() and "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def to_local(t: Tensor) -> Tensor:
    """This rank's local tensor of a DTensor (its shard, no communication), else ``t``."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def to_locals(tensors: list[Tensor]) -> list[Tensor]:
    """:func:`to_local` of each tensor; ``tensors`` itself (no per-tensor Python call) when
    none is a DTensor, the case of every step's gradients outside tensor parallelism."""
    from torch.distributed.tensor import DTensor

    if not any(isinstance(t, DTensor) for t in tensors):
        return tensors
    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


def _on_group(t: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    device = group_device(group)
    return t if t.device == device and t.is_contiguous() else t.contiguous().to(device)


def _back(result: Tensor, original: Tensor) -> Tensor:
    """Write ``result`` into ``original`` unless it is ``original`` itself; return ``original``."""
    if result is not original:
        original.copy_(result)
    return original


def all_reduce(t: Tensor, op: ReduceOp = "sum", group: dist.ProcessGroup | None = None) -> Tensor:
    """Reduce ``t`` over ``group`` in place (``avg``: sum divided by the group size); returns
    ``t``. Not differentiable (use it on detached values or inside autograd functions)."""
    size = group_size(group)
    if size == 1:
        return t
    work = _on_group(t, group)
    dist.all_reduce(work, op=getattr(dist.ReduceOp, _OPS[op]), group=group)
    if op == "avg":
        work.div_(size)
    return _back(work, t)


def broadcast(t: Tensor, src: int = 0, group: dist.ProcessGroup | None = None) -> Tensor:
    """Copy group rank ``src``'s ``t`` into every rank's ``t`` (in place); returns ``t``."""
    if group_size(group) == 1:
        return t
    work = _on_group(t, group)
    dist.broadcast(work, group_src=src, group=group)
    return _back(work, t)


def all_gather(t: Tensor, group: dist.ProcessGroup | None = None) -> list[Tensor]:
    """Every rank's ``t`` (equal shapes), in group-rank order, on ``t``'s device."""
    size = group_size(group)
    if size == 1:
        return [t]
    work = _on_group(t, group)
    parts = [torch.empty_like(work) for _ in range(size)]
    dist.all_gather(parts, work, group=group)
    return [p.to(t.device) for p in parts]


def all_gather_stacked(t: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """``[size, *t.shape]``: every rank's ``t`` (equal shapes) stacked in group-rank order, on
    ``t``'s device; one ``all_gather_single`` (``all_gather_into_tensor`` before torch 2.14)
    into one buffer, cheaper on the host than :func:`all_gather`'s list of tensors."""
    size = group_size(group)
    if size == 1:
        return t.unsqueeze(0)
    work = _on_group(t, group).reshape(-1)
    out = work.new_empty(size * work.numel())  # the concatenated form: every backend takes it
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, work, group=group)
    return out.view(size, *t.shape).to(t.device)


def all_gather_cpu(t: Tensor, group: dist.ProcessGroup | None = None) -> list[Tensor]:
    """Every rank's CPU tensor ``t`` (equal shapes), in group-rank order, exchanged as it is:
    for a group whose backend takes CPU tensors (gloo, or ``cpu:gloo,cuda:nccl``), so the
    exchange never waits on a GPU stream. ``[t]`` on one rank."""
    size = group_size(group)
    if size == 1:
        return [t]
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t, group=group)
    return parts


def all_gather_objects(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's picklable ``obj`` over ``group`` (``[obj]`` without a process group)."""
    size = group_size(group)
    if size == 1:
        return [obj]
    out: list[Any] = [None] * size
    dist.all_gather_object(out, obj, group=group)
    return out


def send_object(obj: Any, dst: int, group: dist.ProcessGroup | None = None) -> None:
    """Send a picklable ``obj`` to group rank ``dst`` (tensors travel on the group's device)."""
    dist.send_object_list([obj], group=group, group_dst=dst, device=group_device(group))


def recv_object(src: int, group: dist.ProcessGroup | None = None) -> Any:
    """Receive the object group rank ``src`` sent with :func:`send_object`."""
    box: list[Any] = [None]
    dist.recv_object_list(box, group=group, group_src=src, device=group_device(group))
    return box[0]


def _plain(t: Tensor) -> Tensor:
    """``t`` as a plain, finished, detached CPU tensor for pickling: an in-flight functional
    collective's result (``AsyncCollectiveTensor``, e.g. a vocab-parallel embedding's pending
    all-reduce) is waited for, a DTensor is gathered to its full value (collective over its
    mesh; its pickled mesh would name the sender's ranks)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    if isinstance(t, AsyncCollectiveTensor):
        t = t.wait()
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().cpu()


def send_tensors(tensors: tuple[Tensor, ...], dst: int, group: dist.ProcessGroup | None) -> None:
    """Send a tuple of tensors of any shapes to group rank ``dst`` (pickled, see
    :func:`send_object`). Each is first made a plain finished CPU tensor: a pending
    ``AsyncCollectiveTensor`` is waited for (pickling it would copy its buffer before the
    collective wrote it: uninitialised or partial values on the receiver) and a DTensor is
    gathered with ``full_tensor()`` (a collective over its mesh, whose ranks all send)."""
    send_object(tuple(_plain(t) for t in tensors), dst, group)


def recv_tensors(
    src: int, group: dist.ProcessGroup | None, device: torch.device
) -> tuple[Tensor, ...]:
    """Receive the tuple :func:`send_tensors` sent from group rank ``src``, on ``device``."""
    return tuple(t.to(device) for t in recv_object(src, group))


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.bool)
_HEADER = 10  # dtype code, ndim, then up to 8 sizes


def send_tensor(t: Tensor, dst: int, group: dist.ProcessGroup | None = None) -> None:
    """Send one tensor of any shape (up to 8 dims, zero-size included) to group rank ``dst``:
    an int64 header ``[dtype code, ndim, *shape, 0...]`` of 10 values, then the data (nothing
    when empty), on the group's device; blocking. The receiver needs no shape
    (:func:`recv_tensor`): ragged counts travel in the header. Raises ``ValueError`` for more
    than 8 dims or a dtype outside float32/bfloat16/float16/float64/int64/bool."""
    for message in _messages(t, group):
        dist.send(message, group=group, group_dst=dst)


def isend_tensor(t: Tensor, dst: int, group: dist.ProcessGroup | None = None) -> list[Any]:
    """:func:`send_tensor` without waiting: returns the sends' ``Work`` handles (each keeps
    its buffer alive; ``wait()`` them before the process group goes). The receiver runs
    :func:`recv_tensor`. Messages to one rank arrive in the order they were posted (gloo and
    NCCL match point-to-point operations between two ranks in order). Raises as there."""
    return [dist.isend(m, group=group, group_dst=dst) for m in _messages(t, group)]


def _messages(t: Tensor, group: dist.ProcessGroup | None) -> list[Tensor]:
    """The header and (when not empty) the data :func:`send_tensor` sends."""
    if t.ndim > _HEADER - 2 or t.dtype not in _DTYPES:
        raise ValueError(
            f"send_tensor: a {t.ndim}-dim {t.dtype} tensor; at most {_HEADER - 2} dims of "
            f"{', '.join(map(str, _DTYPES))} travel."
        )
    device = group_device(group)
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0], header[1] = _DTYPES.index(t.dtype), t.ndim
    header[2 : 2 + t.ndim] = torch.tensor(t.shape, dtype=torch.int64)
    messages = [header.to(device)]
    if t.numel():
        messages.append(t.detach().to(device).contiguous())
    return messages


def recv_tensor(src: int, device: torch.device, group: dist.ProcessGroup | None = None) -> Tensor:
    """Receive the tensor group rank ``src`` sent with :func:`send_tensor` (dtype and shape
    from its header), on ``device``."""
    header = torch.empty(_HEADER, dtype=torch.int64, device=group_device(group))
    dist.recv(header, group=group, group_src=src)
    values = header.tolist()
    shape = tuple(values[2 : 2 + values[1]])
    out = torch.empty(shape, dtype=_DTYPES[values[0]], device=group_device(group))
    if out.numel():
        dist.recv(out, group=group, group_src=src)
    return out.to(device)


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Wait for every rank of ``group`` (no-op without a process group)."""
    if group_size(group) > 1:
        dist.barrier(group=group)


def all_to_all_counts(t: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """Equal-split all-to-all of ``t [P * n, ...]`` over a group of ``P`` ranks: block ``j``
    (rows ``j n .. (j+1) n - 1``) goes to group rank ``j``, and the result's block ``i`` comes
    from group rank ``i``. Not differentiable (for counts and other metadata); returns a new
    tensor on ``t``'s device; ``t`` itself without a process group or with ``P == 1``.

    Raises ``ValueError`` when ``t``'s first dimension is not a multiple of ``P``.
    """
    size = group_size(group)
    if size == 1:
        return t
    if t.shape[0] % size:
        raise ValueError(
            f"all_to_all_counts: t.shape[0] ({t.shape[0]}) must be a multiple of the group size "
            f"({size}); pass one equal block per rank."
        )
    work = _on_group(t, group)
    out = torch.empty_like(work)
    dist.all_to_all_single(out, work, group=group)
    return out.to(t.device)


def _check_splits(name: str, splits: list[int], rows: int, size: int) -> None:
    if len(splits) != size or min(splits, default=0) < 0 or sum(splits) != rows:
        raise ValueError(
            f"all_to_all_single: {name} ({splits}) must hold {size} non-negative sizes (one per "
            f"rank) summing to the tensor's rows ({rows}); pass the per-rank row counts."
        )


class _AllToAllSingle(torch.autograd.Function):
    """All-to-all with uneven splits; backward is the reverse all-to-all (splits swapped)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, t: Tensor, out_splits: list[int], in_splits: list[int], group: Any
    ) -> Tensor:
        ctx.splits, ctx.group = (in_splits, out_splits), group
        work = _on_group(t, group)
        out = work.new_empty((sum(out_splits), *work.shape[1:]))
        dist.all_to_all_single(out, work, out_splits, in_splits, group=group)
        return out.to(t.device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None, None]:  # type: ignore[override]
        back_out, back_in = ctx.splits
        return _AllToAllSingle.apply(grad, back_out, back_in, ctx.group), None, None, None


def all_to_all_single(
    t: Tensor,
    output_split_sizes: list[int],
    input_split_sizes: list[int],
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """Differentiable all-to-all of ``t [N, ...]`` with uneven splits over ``P`` ranks.

    Rows ``sum(input_split_sizes[:j]) ..`` (``input_split_sizes[j]`` of them) go to group rank
    ``j``; the result ``[sum(output_split_sizes), ...]`` holds ``output_split_sizes[i]`` rows
    from group rank ``i``, in rank order, on ``t``'s device. The backward pass is the reverse
    all-to-all of the gradient (torch's ``torch.distributed.nn.functional.all_to_all_single``,
    Megatron-core's ``all_to_all`` autograd function). ``t`` itself without a process group or
    with ``P == 1``.

    Raises ``ValueError`` when a split list does not hold ``P`` non-negative sizes summing to
    the rows it describes.
    """
    size = group_size(group)
    _check_splits("input_split_sizes", list(input_split_sizes), t.shape[0], size)
    if size == 1:
        return t
    out_splits = [int(n) for n in output_split_sizes]
    _check_splits("output_split_sizes", out_splits, sum(out_splits), size)
    result: Tensor = _AllToAllSingle.apply(
        t, out_splits, [int(n) for n in input_split_sizes], group
    )
    return result
