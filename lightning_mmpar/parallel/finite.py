"""Non-finite guard: a non-finite loss or gradient never reaches the weights or a checkpoint.

The peer is Megatron-LM's ``--check-for-nan-in-loss-and-grad`` (the loss and the gradient norm
are checked before the optimizer step, and the run stops naming the rank). Here:

* :class:`NonFiniteGuard` records, per batch of the current optimizer step (the accumulation
  window), whether the batch's floating tensors are finite (the *inputs*) and whether the loss
  this rank computed is finite; these are device flags, no host sync. Before the optimizer step
  :meth:`NonFiniteGuard.check` adds whether this rank's local gradient pieces are finite and
  exchanges one ``[3]`` vector per rank (one ``all_gather``, one host sync). The gradient
  check takes the 2-norm of each tensor that holds gradients, once: a gradient viewing a
  larger buffer of its dtype is read through that buffer (under torch's DDP, which the
  package runs with ``gradient_as_bucket_view``, the gradients are views of a few flat
  buckets: a few norms instead of one per gradient, as Megatron-LM's ``check_grads`` takes
  the norm of each bucket). A NaN or inf entry makes its buffer's norm non-finite. The check
  errs only towards failing: a buffer's norm bounds each of its views' (up to rounding), and
  a buffer may hold entries outside this step's gradients. Only when it fails on some rank
  does that rank take one norm per gradient (one fused ``torch._foreach_norm``), which names
  the parameters (up to 3 per rank) or clears the false alarm; a gradient whose norm is
  beyond the float32 range counts as non-finite, as in Megatron (float16 is widened first).
  Every rank then takes the same decision: go ahead, raise
  ``RuntimeError`` naming the global step, the batch indices and the ranks with non-finite
  inputs, loss or gradients (and up to 3 parameter names per rank), or skip the step by setting
  every gradient to ``None`` (torch optimizers then leave weights and state untouched, as
  Lightning does when ``training_step`` returns ``None``). The exchange runs after every
  change to the gradients (hooks, clipping): under torch's DDP the reduced gradients are the same
  on every rank only until a rank-local hook or fault changes them, and ranks that decided
  differently would wait on each other forever.
* :func:`nonfinite_weights`: the parameters holding a NaN or inf, over every rank (one
  all-reduce; the names travel only when there are some), for a checkpoint guard.

A re-run of a batch of the window (``FP8FallbackCallback``'s redo calls the strategy's
``training_step`` / ``backward`` again with the same batch index) replaces its flags.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_mmpar.parallel import comm

__all__ = [
    "NonFiniteGuard",
    "NonFiniteMode",
    "NonFiniteReport",
    "check_mode",
    "nonfinite_weights",
]

NonFiniteMode = Literal["raise", "skip", "off"]


def check_mode(value: Any, field_name: str = "on_nonfinite") -> NonFiniteMode:
    """``value`` if it is one of ``"raise"``, ``"skip"``, ``"off"``; else ``ValueError``."""
    if value not in get_args(NonFiniteMode):
        raise ValueError(
            f"{field_name}={value!r} is not a valid choice: pass 'raise' (stop the run naming "
            "the batch and ranks), 'skip' (skip the optimizer step) or 'off' (no check)."
        )
    return value  # type: ignore[no-any-return]


def _widened(local: list[Tensor]) -> list[Tensor]:
    """``local`` with each float16 tensor widened to float32 (its norm cannot overflow)."""
    if any(t.dtype == torch.float16 for t in local):
        return [t.float() if t.dtype == torch.float16 else t for t in local]
    return local


def _norms(local: list[Tensor]) -> Tensor:
    """``[N]``: the 2-norm of each tensor (one fused ``torch._foreach_norm``), on the first
    tensor's device."""
    norms = list(torch._foreach_norm(_widened(local)))
    device = local[0].device
    if any(n.device != device for n in norms):
        norms = [n.to(device) for n in norms]
    return torch.stack(norms)


@torch.no_grad()
def _nonfinite_flags(tensors: Sequence[Tensor]) -> Tensor:
    """``[N]`` bool: the tensor holds a NaN or inf (one fused ``torch._foreach_norm`` over the
    local shards; float16 widened first so that its norm cannot overflow; a norm beyond the
    range of the dtype counts too, as in Megatron's check of the norm). No per-tensor Python
    work unless some tensor is a DTensor or float16, or they lie on several devices."""
    return ~_norms(comm.to_locals(list(tensors))).isfinite()


def _norms_finite(local: list[Tensor]) -> Tensor:
    """0-dim bool: the 2-norm of every tensor of ``local`` (at least one) is finite, float16
    widened first; one tensor (a batch's images, a DDP bucket) without the stack."""
    if len(local) == 1:
        return torch.linalg.vector_norm(_widened(local)[0]).isfinite()
    return _norms(local).isfinite().all()


@torch.no_grad()
def _finite_flag(tensors: Sequence[Tensor]) -> Tensor | None:
    """0-dim bool: every :func:`_nonfinite_flags` flag clear (``None`` for no tensors)."""
    return None if not tensors else _norms_finite(comm.to_locals(list(tensors)))


def _holders(tensors: Sequence[Tensor]) -> list[Tensor]:
    """Tensors that hold every entry of ``tensors`` (local shards of DTensors), each once: a
    view of a larger tensor of its dtype (``_base``: torch DDP's gradient bucket under
    ``gradient_as_bucket_view``, FSDP2's reduce-scatter output) stands for all its views, the
    others for themselves. One Python pass over ``tensors``."""
    bases: dict[int, Tensor] = {}
    holders: list[Tensor] = []
    for t in tensors:
        if type(t) is not Tensor:  # a DTensor (or another subclass): its local shard
            t = comm.to_local(t)
        base = t._base
        if base is None or base.dtype != t.dtype:
            holders.append(t)
        else:
            bases[id(base)] = base
    return holders + list(bases.values())


@torch.no_grad()
def _grads_finite(grads: Sequence[Tensor]) -> Tensor:
    """0-dim bool, a fast bound on :func:`_nonfinite_flags`: ``True`` only if no flag is set.

    One norm per holding tensor (:func:`_holders`; under torch's DDP the few flat buckets
    instead of one per gradient, as Megatron-LM's ``check_grads`` takes the norm of each
    bucket's ``grad_data``): a NaN or inf entry makes its holder's norm non-finite, and a
    holder's norm is at least each of its views' (up to rounding). ``False`` can be a false
    alarm (an entry of a bucket outside these gradients, norms that overflow only together):
    :func:`_nonfinite_flags` then says which, if any, gradients are non-finite."""
    return _norms_finite(_holders(grads))


def _floating(batch: Any) -> list[Tensor]:
    if isinstance(batch, Tensor):
        return [batch] if batch.is_floating_point() and batch.numel() else []
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        return [t for item in batch for t in _floating(item)]
    return []


@dataclass
class NonFiniteReport:
    """Who saw what at one optimizer step: rank -> first batch index (inputs, loss), ranks with
    non-finite gradients and rank -> up to 3 parameter names; ``window``: the step's batches."""

    step: int
    window: list[int] = field(default_factory=list)
    inputs: dict[int, int] = field(default_factory=dict)
    losses: dict[int, int] = field(default_factory=dict)
    grads: dict[int, list[str]] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        """A non-finite loss or gradient on any rank (inputs alone are reported, not acted on:
        a non-finite field that no layer uses does no harm)."""
        return bool(self.losses or self.grads)

    @property
    def batches(self) -> list[int]:
        return sorted({*self.inputs.values(), *self.losses.values()}) or self.window

    def describe(self) -> str:
        def where(by_rank: dict[int, int]) -> str:
            return ", ".join(f"rank {r} (batch {b})" for r, b in sorted(by_rank.items()))

        parts = []
        if self.losses:
            parts.append(f"non-finite loss on {where(self.losses)}")
        if self.grads:
            names = "; ".join(f"rank {r}: {', '.join(n)}" for r, n in sorted(self.grads.items()))
            parts.append(f"non-finite gradients on ranks {sorted(self.grads)} ({names})")
        if self.inputs:
            parts.append(f"non-finite inputs on {where(self.inputs)}")
        batches = f"batch {self.batches}" if self.batches else "a batch of this step"
        return f"global step {self.step}, {batches}: " + "; ".join(parts)


class NonFiniteGuard:
    """Detect a non-finite loss or gradient before the optimizer step (module docstring).

    ``mode``: ``"raise"`` or ``"skip"`` (``"off"`` is the caller's business: do not call).
    ``group``: the group spanning every rank (``None``: the default world group).
    ``skipped`` counts the skipped steps; ``last_skipped_step`` is the ``global_step`` at which
    the last one was skipped (``-1``: none), for hooks that follow optimizer steps up (an EMA
    update must not follow a skipped step).
    """

    def __init__(self, mode: NonFiniteMode, group: dist.ProcessGroup | None = None) -> None:
        self.mode = check_mode(mode)
        self.group = group
        self.skipped = 0
        self.last_skipped_step = -1
        self._window: dict[int, list[Tensor | None]] = {}
        self._batch = 0
        self._consts: dict[torch.device, tuple[Tensor, Tensor]] = {}

    def observe_batch(self, batch: Any, batch_idx: int) -> None:
        """Record whether ``batch``'s floating tensors are finite (a device flag)."""
        self._batch = int(batch_idx)
        self._window[self._batch] = [_finite_flag(_floating(batch)), None]

    def observe_loss(self, loss: Tensor) -> None:
        """Record whether the loss of the current batch (this rank's own) is finite."""
        flags = self._window.setdefault(self._batch, [None, None])
        ok = loss.detach().isfinite()
        flags[1] = ok if ok.dim() == 0 else ok.all()

    def _constants(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """``(True, inf)``: 0-dim bool and float64 on ``device``, made once per device."""
        if device not in self._consts:
            true = torch.ones((), dtype=torch.bool, device=device)
            self._consts[device] = (
                true,
                torch.full((), math.inf, dtype=torch.float64, device=device),
            )
        return self._consts[device]

    def _local(self, grads: Sequence[Tensor], device: torch.device) -> Tensor:
        """``[3]`` float64: the first batch of the window with non-finite inputs, with a
        non-finite loss, and with :func:`_grads_finite` false (its index for every batch; no
        batch: 0), ``inf`` for none. A few small operations, no host sync."""
        true, inf = self._constants(device)
        ok_grads = _grads_finite(grads).to(device) if grads else true
        first: Tensor | None = None
        for idx, (inputs, loss) in (self._window or {0: [None, None]}).items():
            ok = torch.stack(
                [
                    true if inputs is None else inputs.to(device),
                    true if loss is None else loss.to(device),
                    ok_grads,
                ]
            )
            bad = torch.where(ok, inf, float(idx))
            first = bad if first is None else torch.minimum(first, bad)
        assert first is not None
        return first

    @staticmethod
    def _bad_names(params: list[Tensor], names: Callable[[], dict[int, str]]) -> list[str]:
        """Up to 3 names of ``params`` whose gradients :func:`_nonfinite_flags` flags (the
        slow path, after :func:`_grads_finite` failed on some rank; empty: a false alarm)."""
        pairs = [(p, g) for p in params if (g := p.grad) is not None]
        flags = _nonfinite_flags([g for _, g in pairs]).tolist() if pairs else []
        bad = [p for (p, _), b in zip(pairs, flags, strict=True) if b][:3]
        by_id = names() if bad else {}
        return [by_id.get(id(p), "?") for p in bad]

    def check(
        self,
        params: Iterable[Tensor],
        names: Callable[[], dict[int, str]],
        step: int,
        check_grads: bool = True,
    ) -> NonFiniteReport | None:
        """Collective over ``group``: decide on the step whose gradients ``params`` hold.

        ``names``: ``id(parameter) -> name`` (called only on failure). ``check_grads=False``
        leaves the gradients to a ``GradScaler``, which skips overflowing steps itself.
        Returns ``None`` (go ahead) or the report of a skipped step (gradients set to ``None``).
        Raises ``RuntimeError`` in mode ``"raise"``.
        """
        params = list(params)
        grads = [g for p in params if (g := p.grad) is not None] if check_grads else []
        device = grads[0].device if grads else comm.group_device(self.group)
        local = self._local(grads, device)
        report = NonFiniteReport(step=step, window=sorted(self._window))
        self._window = {}
        rows = comm.all_gather_stacked(local, self.group).tolist()
        for rank, (inp, loss, _) in enumerate(rows):
            if inp != math.inf:
                report.inputs[rank] = int(inp)
            if loss != math.inf:
                report.losses[rank] = int(loss)
        if any(row[2] != math.inf for row in rows):
            mine = (
                self._bad_names(params, names)
                if rows[comm.group_rank(self.group)][2] != math.inf
                else []
            )
            for rank, got in enumerate(comm.all_gather_objects(mine, self.group)):
                if got:
                    report.grads[rank] = got
        if not report.failed:
            return None
        if self.mode == "raise":
            raise RuntimeError(
                f"Non-finite training step at {report.describe()}. The optimizer step did not "
                "run: weights and optimizer state are those of the previous step. Check that "
                "batch's data (or lower the learning rate), or pass "
                "MultimodalParallelStrategy(on_nonfinite='skip') to skip such steps."
            )
        for p in params:
            p.grad = None
        self.skipped += 1
        self.last_skipped_step = step
        if comm.group_rank(self.group) == 0:
            warnings.warn(
                f"Skipped the optimizer step at {report.describe()} (on_nonfinite='skip'; "
                f"{self.skipped} skipped so far).",
                stacklevel=2,
            )
        return report


def nonfinite_weights(
    module: nn.Module, group: dist.ProcessGroup | None = None
) -> dict[int, list[str]]:
    """Rank -> names of its parameters holding a NaN or inf (local shards; empty: all finite).

    Collective over ``group``: one all-reduce of a count; the names are gathered only when the
    count is not 0. One fused ``torch._foreach_norm`` over this rank's parameters.
    """
    named = [(n, p) for n, p in module.named_parameters() if p.is_floating_point() and p.numel()]
    bad: list[str] = []
    if named:
        flags = _nonfinite_flags([p for _, p in named]).tolist()
        bad = [n for (n, _), b in zip(named, flags, strict=True) if b]
    count = torch.tensor(float(len(bad)), device=comm.group_device(group))
    if comm.all_reduce(count, "sum", group).item() == 0:
        return {}
    return {r: names for r, names in enumerate(comm.all_gather_objects(bad, group)) if names}
