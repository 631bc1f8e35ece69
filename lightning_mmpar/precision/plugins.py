"""Lightning precision plugins whose gradient clipping uses the global norm.

``Trainer(gradient_clip_val=...)`` reaches ``Precision.clip_grad_by_norm``, which calls
``torch.nn.utils.clip_grad_norm_`` on this rank's parameters: under tensor / pipeline
parallelism that is the norm of local shards of one stage. These subclasses of Lightning's own
plugins call the function the strategy gives them instead
(:func:`lightning_mmpar.parallel.numerics.clip_grad_norm_`, one all-reduce over every shard and
stage). ``MultimodalParallelStrategy`` swaps Lightning's plugin for the matching subclass.

The same plugins run the strategy's non-finite check (``check_fn``) after Lightning's
``_after_closure`` (the closure's backward, the ``on_before_optimizer_step`` hooks, where
``FP8FallbackCallback`` may redo the step, and clipping) and before ``optimizer.step`` updates
the weights.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch.optim import Optimizer

__all__ = [
    "GlobalNormClipping",
    "ParallelHalfPrecision",
    "ParallelMixedPrecision",
    "ParallelPrecision",
    "with_global_clipping",
]


class GlobalNormClipping:
    """Precision-plugin mixin: ``Trainer(gradient_clip_val=...)`` clips by the *global* norm.

    Lightning's plugins call ``torch.nn.utils.clip_grad_norm_`` on this rank's parameters, which
    under tensor/pipeline parallelism sees only local shards and one stage. The strategy gives
    its plugin the function that computes the norm over every tp/dp shard and pp stage
    (:func:`lightning_mmpar.parallel.numerics.clip_grad_norm_`).
    """

    clip_fn: Any = None
    """``(optimizer, max_norm) -> None``, set by :class:`MultimodalParallelStrategy`."""

    check_fn: Any = None
    """``(optimizer, check_grads) -> None``, the strategy's non-finite check (raises, or sets
    the gradients to ``None`` to skip the step); ``check_grads`` is ``False`` under a
    ``GradScaler``, which skips overflowing steps itself."""

    def _after_closure(self, model: pl.LightningModule, optimizer: Any) -> None:
        """Lightning's hooks and clipping, then the non-finite check, before the step."""
        super()._after_closure(model, optimizer)  # type: ignore[misc]
        if self.check_fn is not None:
            self.check_fn(optimizer, getattr(self, "scaler", None) is None)

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        if self.clip_fn is None:
            raise RuntimeError(f"{type(self).__name__} is used outside MultimodalParallelStrategy.")
        self.clip_fn(optimizer, float(clip_val))


class ParallelPrecision(GlobalNormClipping, Precision):
    """``precision="32-true"`` with global-norm clipping."""


class ParallelMixedPrecision(GlobalNormClipping, MixedPrecision):
    """``precision="bf16-mixed"`` / ``"16-mixed"`` with global-norm clipping."""


class ParallelHalfPrecision(GlobalNormClipping, HalfPrecision):
    """``precision="bf16-true"`` / ``"16-true"`` with global-norm clipping."""


def with_global_clipping(plugin: Precision | None) -> Precision:
    """The parallel subclass of Lightning's own plugin (same settings); others unchanged."""
    if plugin is None or type(plugin) is Precision:
        return ParallelPrecision()
    if type(plugin) is MixedPrecision:
        return ParallelMixedPrecision(
            plugin.precision,  # type: ignore[arg-type] # "16-mixed" or "bf16-mixed" by its type
            plugin.device,
            plugin.scaler,
        )
    if type(plugin) is HalfPrecision:
        return ParallelHalfPrecision(plugin.precision)
    return plugin
