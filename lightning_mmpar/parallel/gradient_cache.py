"""Gradient cache: a loss that couples micro-batches, trained exactly under pipeline parallelism.

A contrastive loss takes its negatives from the whole batch, so it is not a sum of per-micro-batch
terms and a pipeline schedule (which back-propagates each micro-batch on its own) cannot train it
directly. The gradient-cache technique (Gao et al. 2021, "Scaling Deep Contrastive Learning
Batch Size under Memory Limited Setup", arXiv:2101.06983) splits the step into

1. a forward-only pass that collects every micro-batch's features ``f_m`` on the last stage;
2. the coupled loss ``L(f_1, ..., f_M)`` on the whole batch, with the features as leaves, and
   its gradients ``g_m = dL/df_m``;
3. the training pass, whose loss for micro-batch ``m`` is ``l_m + M * <f_m, g_m>`` (value:
   ``l_m``, plus ``L`` once per micro-batch so the mean is ``mean(l_m) + L``); the schedule's
   ``1 / M`` averaging leaves ``sum_m g_m df_m/dtheta = dL/dtheta`` exactly.

The training pass must recompute the same features, so both passes must see the same random
numbers: :class:`RNGReplay` records the RNG states (the default CPU / accelerator generators and
the model-parallel tracker's regions, :mod:`lightning_mmpar.parallel.random`) at the entry of
every (stage, micro-batch) forward in pass 1 and restores them at the same forward in pass 2,
whatever order the schedule runs them in (interleaved schedules included).

The module implements :class:`BatchLossModule`; the engine
(:class:`~lightning_mmpar.parallel.pipeline.PipelineEngine`) drives the passes. Nothing here
knows a model or a recipe.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from lightning_mmpar.parallel.random import get_rng_tracker

__all__ = ["BatchLossModule", "RNGReplay", "batch_gradients", "cat_features", "surrogate"]

Features = tuple[Tensor, ...]
"""One micro-batch's features: batch-first tensors ``[b, ...]`` (integer ones carry no
gradient)."""


@runtime_checkable
class BatchLossModule(Protocol):
    """What a :class:`~lightning_mmpar.parallel.pipeline.PipelineModule` adds when part of its
    loss couples the samples of a batch (contrastive negatives).

    The module's own ``pipeline_loss(output, target)`` must equal
    ``pipeline_micro_loss(output, target) + pipeline_batch_loss(pipeline_features(output,
    target))`` on one (micro-)batch; the engine calls the three parts instead when
    :meth:`pipeline_batch_coupled` is true.
    """

    def pipeline_batch_coupled(self) -> bool:
        """Whether this step's coupled term takes the whole batch (gradient cache under pp > 1);
        False runs ``pipeline_loss`` per micro-batch. Must be equal on every pipeline rank."""
        ...

    def pipeline_features(self, output: Any, target: Any) -> Features:
        """The features of one micro-batch that the coupled term needs (batch-first)."""
        ...

    def pipeline_micro_loss(self, output: Any, target: Any) -> Tensor:
        """The separable part of one micro-batch's loss (0-dim)."""
        ...

    def pipeline_batch_loss(self, features: Features) -> Tensor:
        """The coupled term (0-dim) of the features of the whole batch (micro-batches
        concatenated on dim 0, in order)."""
        ...


def cat_features(per_micro_batch: Sequence[Features]) -> Features:
    """Concatenate every feature over the micro-batches (dim 0). Raises ``ValueError`` when the
    micro-batches return different numbers of features."""
    counts = {len(f) for f in per_micro_batch}
    if len(counts) != 1:
        raise ValueError(
            f"pipeline_features returned {sorted(counts)} tensors on different micro-batches; "
            "return the same tensors for every micro-batch."
        )
    return tuple(torch.cat(parts) for parts in zip(*per_micro_batch, strict=True))


def batch_gradients(
    module: BatchLossModule, per_micro_batch: Sequence[Features]
) -> tuple[Tensor, list[tuple[Tensor | None, ...]]]:
    """The coupled loss of the whole batch and its gradient on each micro-batch's features.

    Returns ``(L, grads)``: ``L`` the detached 0-dim loss, ``grads[m][i]`` the gradient of ``L``
    with respect to feature ``i`` of micro-batch ``m`` (same shape), None where no gradient
    flows (integer features, features the loss treats as constants).
    """
    # rows per feature and micro-batch: features may differ in rows (a ragged batch's
    # image-caption pairs beside the batch-shaped logit scale)
    sizes = [[f[i].shape[0] for f in per_micro_batch] for i in range(len(per_micro_batch[0]))]
    leaves = tuple(
        t.detach().requires_grad_(t.is_floating_point()) for t in cat_features(per_micro_batch)
    )
    with torch.enable_grad():
        loss = module.pipeline_batch_loss(leaves)
        wanted = [t for t in leaves if t.requires_grad]
        found: Sequence[Tensor | None] = [None] * len(wanted)
        if loss.requires_grad and wanted:
            found = torch.autograd.grad(loss, wanted, allow_unused=True)
    by_leaf = dict(zip(map(id, wanted), found, strict=True))
    split = [
        g.split(n) if (g := by_leaf.get(id(t))) is not None else None
        for t, n in zip(leaves, sizes, strict=True)
    ]
    grads = [
        tuple(s[m] if s is not None else None for s in split) for m in range(len(per_micro_batch))
    ]
    return loss.detach(), grads


def surrogate(features: Features, grads: tuple[Tensor | None, ...], scale: float) -> Tensor:
    """``scale * sum_i <f_i - sg(f_i), g_i>``: value 0, gradient ``scale * g_i df_i/dtheta``
    (``sg``: stop-gradient). Float32 products."""
    total: Tensor | None = None
    for f, g in zip(features, grads, strict=True):
        if g is None or not f.requires_grad:
            continue
        term = ((f.float() - f.detach().float()) * g.float()).sum()
        total = term if total is None else total + term
    if total is None:
        return torch.zeros((), device=features[0].device)
    return total * scale


class RNGReplay:
    """Replays the random numbers of forward-only pass 1 in training pass 2, per forward.

    A forward pre-hook on every chunk: while :meth:`record` is active, the ``k``-th forward of
    chunk ``c`` (micro-batch ``k``: a stage runs its micro-batches in order in every schedule)
    saves the RNG states (CPU, ``device``'s accelerator, the model-parallel tracker); while
    :meth:`replay` is active it restores them before the same forward. Dropout masks of the two
    passes are thus identical.
    """

    def __init__(self, chunks: Sequence[nn.Module], device: torch.device) -> None:
        self.device = device
        self._mode: str | None = None
        self._states: dict[int, list[tuple[Tensor, Tensor | None, dict[str, Any]]]] = {}
        self._calls: dict[int, int] = {}
        for index, chunk in enumerate(chunks):
            chunk.register_forward_pre_hook(self._hook(index))

    def _accelerator(self) -> Any:
        if self.device.type == "cpu":
            return None
        module = torch.get_device_module(self.device.type)
        return module if hasattr(module, "get_rng_state") else None

    def _hook(self, index: int) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            if self._mode is None:
                return
            k = self._calls.get(index, 0)
            self._calls[index] = k + 1
            acc = self._accelerator()
            tracker = get_rng_tracker()
            if self._mode == "record":
                state = acc.get_rng_state(self.device) if acc is not None else None
                saved = (torch.get_rng_state(), state, tracker.state_dict())
                self._states.setdefault(index, []).append(saved)
                return
            cpu, state, regions = self._states[index][k]
            torch.set_rng_state(cpu)
            if acc is not None and state is not None:
                acc.set_rng_state(state, self.device)
            tracker.load_state_dict(regions)

        return hook

    def record(self) -> None:
        """Start pass 1: forget earlier states, save one per forward."""
        self._mode, self._states, self._calls = "record", {}, {}

    def replay(self) -> None:
        """Start pass 2: restore the saved state before each forward."""
        self._mode, self._calls = "replay", {}

    def stop(self) -> None:
        """Neither record nor replay (evaluation, shape probing)."""
        self._mode, self._states, self._calls = None, {}, {}
