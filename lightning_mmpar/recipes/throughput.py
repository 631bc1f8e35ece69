"""Throughput of the recipe: Lightning's ``ThroughputMonitor`` with MFU, and a progress bar.

:class:`RecipeThroughput` is Lightning's
:class:`~lightning.pytorch.callbacks.ThroughputMonitor` (logged to the Trainer's loggers as
``train/...``) counting one model replica (``tp * pp`` ranks) as one "device" and the dp
replicas as the world: ``train/samples_per_sec`` and ``train/items_per_sec`` (tokens) are the
whole run's, ``train/device/mfu`` is the model FLOPs utilisation (PaLM, Chowdhery et al. 2022,
App. B): model FLOPs of the training steps (forward + backward, counted from the block shapes by
:meth:`~lightning_mmpar.recipes.module.ClipLlamaModule.pipeline_block_specs`, the pipeline
planner's cost model, one sample of ``data.max_length`` tokens: a ragged batch is priced per
row, its row budget; recomputation not counted) / elapsed time / (``tp * pp`` x the peak FLOP/s
of one device). The peak is ``peak_flops_per_device`` when given, else Lightning's table for the
GPU and dtype in use (``get_available_flops``); a CPU has no table entry: there MFU is logged
only with a configured peak, and it is then relative to that stated figure.

Samples and tokens are counted over the whole data-parallel world (each dp rank sees its own
batch; tp/pp peers share one): ``samples/s = dp * B / step time``; tokens are the text tokens
(attention mask) plus the image tokens (patches + class token) of every sample. A ragged batch
(:class:`~lightning_mmpar.data.MultimodalCollator`: ``sample_ids``, ``image_mask``) counts its
samples, packed ones included (``max(sample_ids) + 1`` per row; empty rows none), and its tokens
as the rows' non-pad positions plus, under cross-attention fusion, each image's patches + class
token (under spliced fusion an image's tokens are the row positions it occupies, already
counted). Recipe-only: it reads the recipe's batch keys and the module's ``fusion_config``.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch
from lightning.fabric.utilities.throughput import Throughput, get_available_flops
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ThroughputMonitor, TQDMProgressBar
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_mmpar.topology import ParallelDims

__all__ = ["RecipeThroughput", "ThroughputProgressBar", "batch_counts", "flops_per_sample"]


def batch_counts(batch: Any, image_tokens: int, *, spliced: bool = False) -> tuple[int, int]:
    """``(samples, tokens)`` of one rank's batch: a one-image batch (``images``,
    ``attention_mask``) or a ragged one (``sample_ids [B, T]``, ``image_mask [B, I]``; module
    docstring). ``image_tokens``: tokens per image beside the text (ViT patches + class token);
    ``spliced``: images are spliced into the rows (their tokens are row positions). ``(0, 0)``
    for any other batch."""
    if not isinstance(batch, dict):
        return 0, 0
    if "sample_ids" in batch:
        return _ragged_counts(batch, image_tokens, spliced)
    if "images" not in batch:
        return 0, 0
    samples = int(batch["images"].shape[0])
    text = int(batch["attention_mask"].sum()) if "attention_mask" in batch else 0
    return samples, text + samples * image_tokens


def _ragged_counts(batch: dict[str, Any], image_tokens: int, spliced: bool) -> tuple[int, int]:
    """Samples (``max(sample_ids) + 1`` per row: packed samples are numbered from 0 in their
    row, pad is -1) and tokens (non-pad positions, plus ``image_tokens`` per image unless
    spliced) of a ragged batch."""
    ids = batch["sample_ids"]
    if ids.numel() == 0:
        return 0, 0
    samples = int((ids.max(dim=1).values + 1).clamp(min=0).sum())
    images = int(batch["image_mask"].sum()) if "image_mask" in batch else 0
    return samples, int((ids >= 0).sum()) + (0 if spliced else images * image_tokens)


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

    @staticmethod
    def _spliced(module: LightningModule) -> bool:
        """The module splices images into its rows (``FusionConfig.fusion == "spliced"``)."""
        return getattr(getattr(module, "fusion_config", None), "fusion", None) == "spliced"

    @override
    def on_train_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        spliced = self._spliced(pl_module)
        samples, tokens = batch_counts(batch, self._image_tokens(pl_module), spliced=spliced)
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


def flops_per_sample(trainer: Trainer, module: LightningModule) -> float | None:
    """Training FLOPs (forward + backward) of one sample through the whole model: the blocks'
    costs of the strategy's stage plan (pp > 1, measured before stages drop parameters), else
    ``module.pipeline_block_specs()``; ``None`` for a module without block costs."""
    plan = getattr(trainer.strategy, "stage_plan", None)
    if plan is not None:
        return float(sum(b.flops for b in plan.blocks))
    specs = getattr(module, "pipeline_block_specs", None)
    return float(sum(b.flops for b in specs())) if callable(specs) else None


def _priced_units(batch: Any) -> int:
    """What :func:`flops_per_sample` prices one of: a sample of a one-image batch; a row of a
    ragged batch (the block costs price ``data.max_length`` tokens, a ragged module's row budget,
    however many samples are packed in it)."""
    if isinstance(batch, dict) and "sample_ids" in batch:
        return int(batch["sample_ids"].shape[0])
    return batch_counts(batch, 0)[0]


def _compute_dtype(precision: str) -> torch.dtype:
    """The matmul dtype of a Trainer ``precision`` flag (``bf16-mixed``, ``16-true``, ..)."""
    if "bf16" in precision:
        return torch.bfloat16
    return torch.float16 if "16" in precision else torch.float32


class RecipeThroughput(ThroughputMonitor):
    """Lightning's ``ThroughputMonitor`` over model replicas, with MFU (module docstring).

    Args:
        peak_flops_per_device: peak FLOP/s of one device at the training dtype (e.g. ``989e12``
            for an H100 SXM at BF16 dense); ``None``: Lightning's table (GPUs only). On a CPU
            give the figure you measured or were told; MFU is relative to it.
        window_size: steps in the moving average (Lightning's ``Throughput``).

    Raises:
        ValueError: ``peak_flops_per_device`` is not positive.
    """

    def __init__(self, peak_flops_per_device: float | None = None, window_size: int = 20) -> None:
        if peak_flops_per_device is not None and not peak_flops_per_device > 0:
            raise ValueError(
                f"RecipeThroughput(peak_flops_per_device={peak_flops_per_device!r}) must be > 0 "
                "FLOP/s (or None for Lightning's GPU table)."
            )
        super().__init__(self._count_samples, self._count_tokens, window_size=window_size)
        self.peak_flops_per_device = peak_flops_per_device
        self._image_tokens = 0
        self._spliced = False
        self._flops_per_sample: float | None = None
        self._dp = 1

    def _count_samples(self, batch: Any) -> int:
        return batch_counts(batch, self._image_tokens, spliced=self._spliced)[0] * self._dp

    def _count_tokens(self, batch: Any) -> int:
        return batch_counts(batch, self._image_tokens, spliced=self._spliced)[1] * self._dp

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        dims = ParallelDims.of(trainer)
        self._dp, replica = dims.dp, dims.world_size // dims.dp
        peak = self.peak_flops_per_device or get_available_flops(
            trainer.strategy.root_device, _compute_dtype(str(trainer.precision))
        )
        self.available_flops = int(peak * replica) if peak else None
        if peak is None:
            rank_zero_info(
                "RecipeThroughput: no peak FLOP/s known for this device; MFU is not logged. Set "
                "peak_flops_per_device (on a CPU: a figure you state)."
            )
        stages = [trainer.state.stage]
        if stage == TrainerFn.FITTING and trainer.enable_validation:
            stages.append(RunningStage.VALIDATING)
        for running in stages:
            assert running is not None
            self._throughputs[running] = Throughput(
                available_flops=self.available_flops, world_size=self._dp, **self.kwargs
            )
        self._image_tokens = ThroughputProgressBar._image_tokens(pl_module)
        self._spliced = ThroughputProgressBar._spliced(pl_module)
        if stage != TrainerFn.FITTING:  # training FLOPs only: no MFU (nor warning) elsewhere
            setattr(pl_module, "flops_per_batch", None)  # noqa: B010

    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._flops_per_sample is None:
            self._flops_per_sample = flops_per_sample(trainer, pl_module) or 0.0
        if self._flops_per_sample:  # Lightning's monitor reads this attribute every batch
            flops = self._flops_per_sample * _priced_units(batch) * self._dp
            setattr(pl_module, "flops_per_batch", flops)  # noqa: B010 (a float, not a Module)
