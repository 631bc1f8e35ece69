"""The strategy's numerics hooks: global-norm clipping and the non-finite check.

:class:`NumericsHooks` is a mixin of
:class:`~lightning_mmpar.strategy.MultimodalParallelStrategy`; the strategy's precision plugin
(:class:`~lightning_mmpar.precision.plugins.GlobalNormClipping`) calls
:meth:`NumericsHooks._clip_grad_by_norm` for ``Trainer(gradient_clip_val=...)`` and
:meth:`NumericsHooks._check_finite` before each optimizer step. Duck-typed: the host provides
``parallel_dims`` (``.pp``), ``_identical_grads()``, ``nonfinite`` (a
:class:`~lightning_mmpar.parallel.finite.NonFiniteGuard` or ``None``), ``precision_plugin`` and
``lightning_module``.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities import rank_zero_warn
from torch.optim import Optimizer

from lightning_mmpar.config import ParallelConfig
from lightning_mmpar.parallel.numerics import clip_grad_norm_


def _params(optimizer: Optimizer) -> list[Any]:
    return [p for group in optimizer.param_groups for p in group["params"]]


class NumericsHooks:
    """Global-norm clipping and the non-finite check of a model-parallel strategy."""

    parallel_dims: Any
    nonfinite: Any
    precision_plugin: Any
    lightning_module: Any

    def _identical_grads(self) -> bool:
        """Whether every rank holds the same gradients after backward (the host's answer)."""
        return False

    def _check_clipping(self, trainer: Any) -> None:
        """Warn (or raise ``ValueError``, :meth:`ParallelConfig.check_clipping`) when the
        precision plugin does not clip by the global norm."""
        plugin = self.precision_plugin
        mode = None if self.nonfinite is None else self.nonfinite.mode
        glob = hasattr(plugin, "clip_fn") and hasattr(plugin, "check_fn")
        name = type(plugin).__name__
        if note := ParallelConfig.check_clipping(name, glob, trainer.gradient_clip_val, mode):
            rank_zero_warn(note)

    def _clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        """Clip by the norm over every tp/dp shard and pp stage (one all-reduce); under
        non-colocated towers over both sides (``_tower_clip``); where every rank holds the same
        gradients (torch's DDP over the world) by the local norm, with no collective."""
        tower_clip = getattr(self, "_tower_clip", None)
        if tower_clip is not None and tower_clip(optimizer, clip_val):
            return
        if self._identical_grads():
            clip_grad_norm_(_params(optimizer), clip_val, local=True)
            return
        clip_grad_norm_(_params(optimizer), clip_val, pp=self.parallel_dims.pp)

    def _check_finite(self, optimizer: Optimizer, check_grads: bool) -> None:
        """Before the optimizer step, after the hooks and clipping: raise or skip on a
        non-finite loss or gradient (:class:`~lightning_mmpar.parallel.finite.NonFiniteGuard`)."""
        if (guard := self.nonfinite) is None:
            return
        module = self.lightning_module
        names = lambda: {id(p): n for n, p in module.named_parameters()}  # noqa: E731
        guard.check(_params(optimizer), names, module.trainer.global_step, check_grads)
        if guard.mode == "skip":
            module.log("nonfinite_skipped_steps", float(guard.skipped), on_step=True)
