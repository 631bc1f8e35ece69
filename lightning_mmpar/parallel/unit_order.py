"""Modules run on some data-parallel ranks only: one clear error instead of a hang.

A module of the user's own that skips a part of itself for some batches (the natural code of a
vision-language model: ``if images: h = h + self.vision(images)``) breaks data parallelism when
one rank skips and a peer does not:

* FSDP2 all-gathers a unit's parameters in the unit's forward pre-hook; the rank that skips the
  vision tower issues the next unit's all-gather instead, so the two ranks' collectives pair up
  wrongly (gloo aborts the process, "Received data size doesn't match expected size"; NCCL hangs
  or reads the wrong bytes). Nothing after the fact can repair it: the all-gathers happened. Torch
  has no switch for it (``set_reduce_scatter_unused_params`` covers unused parameters of a unit
  that ran; DeepSpeed ZeRO-3 hangs the same way, and the peers' answer is to run the tower on a
  dummy input, as :class:`~lightning_mmpar.models.FusionModel` does).
* An all-reduce of the gradients after backward coalesces the gradients each rank has: the
  skipping rank's buffer is shorter.

:class:`UnitOrderGuard` checks, in a forward pre-hook that runs before FSDP2's own, that every
data-parallel rank enters the same unit next (one all-gather of one integer per unit and
forward, plus one at the end of forward: a rank that skipped the last unit), and raises the same
``RuntimeError`` on every rank, naming each rank's unit and the fix, before any mismatched
all-gather. :func:`~lightning_mmpar.parallel.data.sync_gradients` with ``fill_missing`` makes the
gradient all-reduce impossible to mismatch instead: a gradient missing on a rank but present on a
peer is reduced as zeros, a gradient missing everywhere stays ``None`` (torch DDP's
``find_unused_parameters``, which all-reduces a used-parameter map for the same reason).

The integers travel on the CPU: over the data-parallel group itself when its backend has gloo,
else over a gloo group of the same ranks created once (:func:`cpu_group`), so no exchange waits
for the GPU's queue (an NCCL collective read back on the host would stall the CPU's run-ahead of
kernel launches once per unit). The strategy's ``check_unit_order=False`` leaves the guard out
for a module that never skips a unit.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.hooks import RemovableHandle

from lightning_mmpar.compat import new_group_in_order
from lightning_mmpar.parallel import comm

__all__ = ["UnitOrderGuard", "cpu_group"]

FIX = (
    "run the module on every rank, e.g. on a zero dummy input whose output is multiplied by 0 "
    "(as FusionModel runs its vision tower on a batch with no image: docs/ragged.md), or use "
    "data_parallel='ddp', whose gradient all-reduce reduces a skipped module's gradients as zeros"
)


def _is_unit(module: nn.Module) -> bool:
    return isinstance(module, FSDPModule)


def _backend(group: dist.ProcessGroup | None) -> str:
    return str(dist.get_backend(group))


def cpu_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """A group over ``group``'s ranks (same order) whose collectives take CPU tensors through
    gloo: ``group`` itself when its backend has gloo (``gloo``, ``cpu:gloo,cuda:nccl``), else a
    new gloo group. Collective over the world when it creates one (``new_group`` is): every rank
    calls it with its own group, the groups of all ranks being disjoint (a mesh dimension's)."""
    if "gloo" in _backend(group):
        return group
    ranks = range(dist.get_world_size()) if group is None else dist.get_process_group_ranks(group)
    mine = tuple(ranks)
    every = sorted({tuple(r) for r in comm.all_gather_objects(mine)})
    made = {ranks: new_group_in_order(ranks, "gloo") for ranks in every}  # the same order
    return made[mine]


class UnitOrderGuard:
    """Before each FSDP2 unit's forward (and at the end of forward, :meth:`end_of_forward`),
    every rank of ``group`` says which unit it enters; all must agree.

    ``units``: ``(qualified name, FSDP2 module)`` pairs, the same list in the same order on every
    rank; ``group``: a group whose collectives take CPU tensors (:func:`cpu_group`). Costs one
    CPU all-gather of one integer per unit and forward over ``group`` (no GPU sync): the
    strategy installs it only for modules whose parts it cannot tell always run (no
    ``pipeline_blocks``), unless ``check_unit_order=False``.
    """

    def __init__(
        self, units: Iterable[tuple[str, nn.Module]], group: dist.ProcessGroup | None
    ) -> None:
        pairs = list(units)
        self.names = [name for name, _ in pairs]
        self.group = group
        self.handles: list[RemovableHandle] = [
            module.register_forward_pre_hook(self._hook(i), prepend=True)
            for i, (_, module) in enumerate(pairs)
        ]

    @classmethod
    def of(cls, module: nn.Module, group: dist.ProcessGroup | None) -> UnitOrderGuard | None:
        """The guard over every FSDP2 unit of ``module`` (``None`` without one, or on a
        one-rank ``group``), exchanging over :func:`cpu_group` of ``group`` (collective over
        the world when that creates a group)."""
        units = [(n or "<root>", m) for n, m in module.named_modules() if _is_unit(m)]
        if not units or comm.group_size(group) == 1:
            return None
        return cls(units, cpu_group(group))

    def _hook(self, index: int) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            self.check(index)

        return hook

    def _name(self, index: int) -> str:
        if index == len(self.names):
            return "the end of forward (no further unit)"
        return repr(self.names[index])

    def check(self, index: int) -> None:
        """This rank is about to enter unit ``index`` (``len(names)``: the end of forward).
        Collective over ``group``.

        Raises:
            RuntimeError: on every rank, when the ranks are about to enter different units;
                names each rank's unit and the fix.
        """
        mine = torch.tensor([index], dtype=torch.int64)  # on the CPU: gloo, no GPU sync
        got = [int(t) for t in comm.all_gather_cpu(mine, self.group)]
        if len(set(got)) == 1:
            return
        where = "; ".join(f"rank {r}: {self._name(i)}" for r, i in enumerate(got))
        raise RuntimeError(
            "data-parallel ranks ran different modules in one forward (a module skipped on some "
            f"ranks, say a vision tower for a batch with no image), next unit per dp rank: "
            f"{where}. FSDP2's all-gathers would pair up wrongly (a hang, or a collective size "
            f"mismatch). Fix: {FIX}."
        )

    def end_of_forward(self) -> None:
        """Every rank finished its forward (no rank is still about to enter a unit).
        Collective over ``group``; raises as :meth:`check`."""
        self.check(len(self.names))

    def remove(self) -> None:
        """Take the hooks off."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
