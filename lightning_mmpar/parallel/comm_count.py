"""Count the bytes every collective moves, by mesh dimension and kind (issue 12's measurement).

:class:`CommCounter` is a ``TorchDispatchMode`` (torch's ``torch.utils._python_dispatch``): it
sees every collective the process issues on its thread, whoever issues it - ``torch.distributed``
calls (``c10d.allreduce_``: ``dist.all_reduce`` and DDP's reducer buckets; ``c10d.
_allgather_base_`` / ``_reduce_scatter_base_``: FSDP2; ``c10d.send`` / ``recv_``: pipelining;
``alltoall_base_``; ``broadcast_``) and functional collectives (``_c10d_functional.all_reduce``
/ ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` / ``all_to_all_single``: DTensor
redistributions and tensor-parallel styles). ``_c10d_functional.wait_tensor`` and
``_wrap_tensor_autograd`` move nothing and are ignored.

Bytes follow nccl-tests' ``size`` convention (the same as :func:`lightning_mmpar.layout.comm.
comm_bytes`): all-reduce and broadcast the buffer, all-gather the OUTPUT, reduce-scatter the
INPUT, all-to-all the input, send / recv one message. Keys are ``"<dim>.<kind>"``: ``dim`` is
the layout dimension owning the op's process group (by rank set: ``tp`` - the ``vl`` communicator
counts as ``tp`` - ``pp``, ``dp``, ``edp``, ``ep``, the first of these when several have the
same ranks (the default group counts as the dimension spanning every rank, ``world`` when none
does); ``self`` for a one-rank group (moves nothing); ``other`` for any other group; an
all-to-all over the ep ranks is ``ep``); ``kind`` is ``all_reduce``, ``all_gather``,
``reduce_scatter``, ``all_to_all`` (equal splits), ``all_to_all_v`` (variable splits, MPI's
``Alltoallv``: the MoE token dispatch, whose bytes depend on the routing), ``send``, ``recv``,
``broadcast`` or ``barrier`` (0 bytes).
:attr:`CommCounter.calls` counts the ops by the same keys.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch._C._distributed_c10d import ProcessGroup
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lightning_mmpar.topology import ParallelDims

__all__ = ["CommCounter", "state_bytes_of"]

_C10D = {  # c10d op name -> (kind, index of the positional argument whose tensors count)
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "_allgather_base_": ("all_gather", 0),
    "allgather_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "alltoall_base_": ("all_to_all", 1),
    "alltoall_": ("all_to_all", 1),
    "send": ("send", 0),
    "recv_": ("recv", 0),
    "broadcast_": ("broadcast", 0),
    "barrier": ("barrier", None),
}
_FUNCTIONAL = {
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
}
_IGNORED = {"wait_tensor", "_wrap_tensor_autograd"}
_PRIORITY = ("tp", "pp", "dp", "edp", "ep")
"""Dimensions with equal rank sets are named by the first of these (``self``: one rank)."""


def _is_group(value: Any) -> bool:
    if isinstance(value, ProcessGroup):
        return True
    if isinstance(value, torch.ScriptObject):
        return "ProcessGroup" in str(value._type())  # type: ignore[attr-defined]
    return False


def _tensor_bytes(value: Any) -> int:
    leaves, _ = tree_flatten(value)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


class CommCounter(TorchDispatchMode):
    """Bytes per ``"<dim>.<kind>"`` moved by this rank's collectives while active.

    ``with CommCounter(dims) as counter: ...`` then ``counter.bytes`` (``dict[str, int]``) and
    ``counter.calls``. ``dims``: the run's :class:`~lightning_mmpar.topology.ParallelDims`
    (its groups name the dimensions; built lazily on first use, so construct the counter after
    the strategy set its mesh up). ``enabled`` may be toggled to pause counting.

    Raises:
        RuntimeError: a collective op the counter does not know (so nothing moves uncounted).
    """

    def __init__(self, dims: ParallelDims, *, record: bool = False) -> None:
        super().__init__()
        self.dims = dims
        self.bytes: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self.enabled = True
        self._names: dict[tuple[int, ...], str] | None = None
        self.events: list[tuple[str, int, str]] | None = [] if record else None
        """``record=True``: every counted op as ``(key, bytes, op name)``, in order."""
        self.unknown: set[str] = set()
        """Rank sets of the process groups counted as ``other``."""

    def group_names(self) -> dict[tuple[int, ...], str]:
        """This rank's groups by rank set -> dimension: the first of ``tp, pp, dp, edp, ep``
        whose group has that rank set (so the default group, or any group over the same ranks,
        counts as the dimension spanning the world; ``world`` when none does)."""
        if self._names is None:
            import torch.distributed as dist

            names: dict[tuple[int, ...], str] = {}
            for dim in _PRIORITY:
                group = self.dims.get_group(dim)
                if group is not None:
                    names.setdefault(tuple(dist.get_process_group_ranks(group)), dim)
            if dist.is_initialized():
                names.setdefault(tuple(range(dist.get_world_size())), "world")
            self._names = names
        return self._names

    def _dim(self, group: Any, kind: str) -> str:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _resolve_process_group

        if isinstance(group, torch.ScriptObject):
            group = ProcessGroup.unbox(group)
        if isinstance(group, str):
            group = _resolve_process_group(group)  # type: ignore[arg-type]
        ranks = tuple(dist.get_process_group_ranks(group))
        if len(ranks) == 1:
            return "self"
        if kind.startswith("all_to_all") and ranks == self._ep_ranks():  # token dispatch: ep, even
            return "ep"  # when the ep ranks equal the dp ranks
        dim = self.group_names().get(ranks)
        if dim is None:
            self.unknown.add(str(ranks))
            return "other"
        return dim

    def _ep_ranks(self) -> tuple[int, ...]:
        import torch.distributed as dist

        group = self.dims.get_group("ep")
        return tuple(dist.get_process_group_ranks(group)) if group is not None else ()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if self.enabled:
            self._count(func, args, kwargs)
        return func(*args, **kwargs)

    def _count(self, func: Any, args: tuple, kwargs: dict) -> None:
        namespace = func.namespace
        op = func._schema.name.split("::")[-1]
        if namespace == "c10d":
            if op not in _C10D:
                if op in ("monitored_barrier_",):
                    return
                raise RuntimeError(f"CommCounter: unknown c10d op {op!r}; add it to _C10D.")
            kind, index = _C10D[op]
            if op == "alltoall_base_" and (args[3] or args[4]):
                kind = "all_to_all_v"  # variable splits (MPI_Alltoallv): token dispatch
            group = next((a for a in args if _is_group(a)), None)
            size = 0 if index is None else _tensor_bytes(args[index])
            self._add(f"{self._dim(group, kind)}.{kind}", size, op)
        elif namespace == "_c10d_functional":
            if op in _IGNORED:
                return
            if op not in _FUNCTIONAL:
                raise RuntimeError(f"CommCounter: unknown functional collective {op!r}.")
            kind = _FUNCTIONAL[op]
            if op == "all_to_all_single" and (args[1] or args[2]):
                kind = "all_to_all_v"
            group = kwargs.get("group_name", args[-1])
            size = _tensor_bytes(args[0])
            if kind == "all_gather":  # output bytes: input * group size
                size *= int(args[1])
            self._add(f"{self._dim(group, kind)}.{kind}", size, op)

    def _add(self, key: str, size: int, op: str) -> None:
        if self.events is not None:
            self.events.append((key, size, op))
        self.bytes[key] += size
        self.calls[key] += 1


def state_bytes_of(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, ...]:
    """``(parameters, gradients, optimizer state)`` bytes this rank holds: local shards
    (``DTensor.to_local()``) of ``module``'s parameters and their ``.grad``, and every tensor of
    ``optimizer.state`` (AdamW's moments and its ``step`` scalars) - what
    :func:`lightning_mmpar.layout.memory.state_bytes` predicts."""
    from torch.distributed.tensor import DTensor

    def size(t: torch.Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    params = list(module.parameters())
    state = [v for s in optimizer.state.values() for v in s.values()]
    return (
        sum(size(p) for p in params),
        sum(size(p.grad) for p in params if p.grad is not None),
        sum(size(v) for v in state if isinstance(v, torch.Tensor)),
    )
