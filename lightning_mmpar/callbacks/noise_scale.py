"""The gradient noise scale from the local/global gradient-norm ratio: part (b) of
:class:`~lightning_mmpar.callbacks.GradientDriftMonitor`.

With per-rank micro-batch size ``b`` and global batch ``B = b * accumulate * dp``,
``E|g_b|^2 = |G|^2 + tr(S)/b``, so the two measured squared norms give unbiased estimates
(McCandlish et al. 2018, "An Empirical Model of Large-Batch Training", App. A.1)::

    |G|^2 = (B |g_B|^2 - b |g_b|^2) / (B - b),   tr(S) = (|g_b|^2 - |g_B|^2) / (1/b - 1/B)

(:func:`~lightning_mmpar.callbacks.grad_stats.noise_scale_terms`) and the *simple noise scale*
``B_simple = EMA(tr S) / EMA(|G|^2)`` is reported. Under a pipeline schedule (pp > 1) the
local gradient is a micro-batch's, so the small batch is ``b / micro_batches`` (and the noise
scale is available even at dp = 1).
"""

from __future__ import annotations

import math
from typing import Any

from lightning_mmpar.callbacks.grad_stats import (
    LocalGradCapture,
    noise_scale_terms,
    norm_weights,
    pipeline_micro_batches,
)
from lightning_mmpar.topology import ParallelDims


def small_batch_sq(
    trainer: Any, capture: LocalGradCapture | None, local_sq: list[float], count: int
) -> tuple[float, bool]:
    """``(|g_b|^2, unavailable)``: this rank's mean weighted squared local gradient norm over
    the ``count`` backwards since the last step, from the capture's per-parameter squares
    ``local_sq``; ``unavailable`` without a capture (FSDP), a backward or a finite value."""
    small = 0.0
    if capture is not None:
        weights = norm_weights(trainer, capture.params)
        # under a pipeline the hook sees unscaled micro-batch gradients, else loss/accumulate
        acc = 1 if pipeline_micro_batches(trainer) > 1 else trainer.accumulate_grad_batches
        small = sum(w * v for w, v in zip(weights, local_sq, strict=True)) * acc**2
        small /= max(count, 1)
    has = capture is not None and bool(capture.names)
    return small, not has or count == 0 or not math.isfinite(small)


class NoiseScale:
    """EMAs (coefficient ``beta``) of ``|G|^2`` and ``tr(S)``, and the noise scale they give."""

    def __init__(self, beta: float) -> None:
        self.beta = beta
        self.ema_g2: float | None = None
        self.ema_trace: float | None = None

    def update(
        self, small: float, big: float, trainer: Any, batch: int | None
    ) -> tuple[float | None, float | None]:
        """``(local/global norm ratio, noise scale)`` from ``small = mean_dp |g_b|^2`` and
        ``big = |g_B|^2`` for per-rank batch ``batch``; each ``None`` when not available (no
        synchronised gradient, an unknown batch size, ``B <= b``, EMAs not yet positive)."""
        ratio = math.sqrt(small / big) if big > 0 else None
        dp, b = ParallelDims.of(trainer).dp, batch
        if b is None:
            return ratio, None
        b_small = b / pipeline_micro_batches(trainer)
        b_big = b * trainer.accumulate_grad_batches * dp
        if b_big <= b_small:
            return ratio, None
        g2, trace = noise_scale_terms(small, big, b_small, b_big)
        beta = self.beta
        self.ema_g2 = g2 if self.ema_g2 is None else beta * self.ema_g2 + (1 - beta) * g2
        self.ema_trace = (
            trace if self.ema_trace is None else beta * self.ema_trace + (1 - beta) * trace
        )
        if self.ema_g2 > 0 and self.ema_trace > 0:
            return ratio, self.ema_trace / self.ema_g2
        return ratio, None
