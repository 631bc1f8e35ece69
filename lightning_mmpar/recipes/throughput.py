"""A progress bar that shows throughput (samples/s, tokens/s) next to the loss terms.

Samples and tokens are counted over the whole data-parallel world (each dp rank sees its own
batch; tp/pp peers share one): ``samples/s = dp * B / step time``; tokens are the text tokens
(attention mask) plus the image tokens (patches + class token) of every sample. Recipe-only: it
reads the recipe's batch keys (``images``, ``attention_mask``) and the module's ``fusion_config``.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import TQDMProgressBar
from typing_extensions import override

from lightning_mmpar.topology import ParallelDims

__all__ = ["ThroughputProgressBar", "batch_counts"]


def batch_counts(batch: Any, image_tokens: int) -> tuple[int, int]:
    """``(samples, tokens)`` of one rank's batch (dicts with ``images``/``attention_mask``)."""
    if not isinstance(batch, dict) or "images" not in batch:
        return 0, 0
    samples = int(batch["images"].shape[0])
    text = int(batch["attention_mask"].sum()) if "attention_mask" in batch else 0
    return samples, text + samples * image_tokens


class ThroughputProgressBar(TQDMProgressBar):
    """TQDM bar with ``samples/s`` and ``tokens/s`` averaged over the last ``window`` steps.

    Args:
        window: steps in the moving average.
        refresh_rate: TQDM refresh rate (batches).
    """

    def __init__(self, window: int = 20, refresh_rate: int = 1) -> None:
        super().__init__(refresh_rate=refresh_rate)
        self._times: deque[tuple[float, int, int]] = deque(maxlen=window + 1)
        self.samples_per_sec = 0.0
        self.tokens_per_sec = 0.0

    @staticmethod
    def _image_tokens(module: LightningModule) -> int:
        vision = getattr(getattr(module, "fusion_config", None), "vision", None)
        return int(vision.grid**2 + 1) if vision is not None else 0

    @override
    def on_train_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        samples, tokens = batch_counts(batch, self._image_tokens(pl_module))
        dp = ParallelDims.of(trainer).dp
        total_s, total_t = (self._times[-1][1], self._times[-1][2]) if self._times else (0, 0)
        self._times.append((time.perf_counter(), total_s + samples * dp, total_t + tokens * dp))
        if len(self._times) > 1:
            (t0, s0, k0), (t1, s1, k1) = self._times[0], self._times[-1]
            self.samples_per_sec = (s1 - s0) / max(t1 - t0, 1e-9)
            self.tokens_per_sec = (k1 - k0) / max(t1 - t0, 1e-9)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    @override
    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        metrics["samples/s"] = f"{self.samples_per_sec:.0f}"
        metrics["tokens/s"] = f"{self.tokens_per_sec:.0f}"
        return metrics
