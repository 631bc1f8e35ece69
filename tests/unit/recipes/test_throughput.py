"""MFU and throughput through Lightning's ThroughputMonitor (``RecipeThroughput``), peak memory
per rank (``PeakMemory``), and Lightning's default logger being TensorBoard without warnings."""

from __future__ import annotations

import resource
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import TQDMProgressBar, throughput_monitor
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import Logger, TensorBoardLogger
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import RunningStage
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_mmpar.callbacks.peak_memory import PeakMemory
from lightning_mmpar.data.conversations import RowsCollator
from lightning_mmpar.recipes import throughput
from lightning_mmpar.recipes.throughput import RecipeThroughput, ThroughputProgressBar, batch_counts
from lightning_mmpar.topology import ParallelDims

B, T, FLOPS = 4, 5, (100.0, 20.0)  # batch, text tokens, per-sample block FLOPs
PEAK = 1000.0


class _Batches(Dataset[dict[str, Tensor]]):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"images": torch.randn(32), "attention_mask": torch.ones(T, dtype=torch.long)}


class _Model(BoringModel):
    """BoringModel on dict batches, with block costs like ClipLlamaModule's."""

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Any:
        return super().training_step(batch["images"], batch_idx)

    def pipeline_block_specs(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(flops=f) for f in FLOPS]

    def train_dataloader(self) -> DataLoader[dict[str, Tensor]]:
        return DataLoader(_Batches(), batch_size=B)


class _Memory(Logger):
    name, version = "memory", 0  # type: ignore[assignment]

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, float]] = []

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append(dict(metrics))

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass


class _Clock:
    """``time.perf_counter`` that advances one second per call."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1.0
        return self.now


def test_mfu_tokens_and_peak_memory_logged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(throughput_monitor, "time", _Clock())
    logger = _Memory()
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=6,
        logger=logger,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[RecipeThroughput(peak_flops_per_device=PEAK, window_size=2), PeakMemory()],
    )
    model = _Model()
    trainer.fit(model)
    assert model.flops_per_batch == sum(FLOPS) * B
    rows = [r for r in logger.rows if "train/device/mfu" in r]
    assert rows, logger.rows[:3]
    last = rows[-1]  # one batch per second
    assert last["train/device/flops_per_sec"] == pytest.approx(sum(FLOPS) * B)
    assert last["train/device/mfu"] == pytest.approx(sum(FLOPS) * B / PEAK)
    assert last["train/device/samples_per_sec"] == pytest.approx(B)
    assert last["train/device/items_per_sec"] == pytest.approx(B * T)  # text tokens
    memory = [r for r in logger.rows if "memory/peak_gib_rank0" in r]
    assert len(memory) == 6
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30
    got = memory[-1]["memory/peak_gib_rank0"]
    assert 0.05 < got <= rss and got == memory[-1]["memory/peak_gib_max"]


def test_a_replica_is_one_device_for_throughput_and_mfu() -> None:
    """tp 2 x pp 2 x dp 2: the world of Lightning's Throughput is the 2 replicas, a replica's peak
    is 4 devices', and a step's FLOPs are both replicas' batches."""
    strategy = SimpleNamespace(
        parallel_dims=ParallelDims(world_size=8, tp=2, pp=2), root_device=torch.device("cpu")
    )
    trainer: Any = SimpleNamespace(
        strategy=strategy,
        world_size=8,
        precision_plugin=Precision(),
        enable_validation=False,
        state=SimpleNamespace(stage=RunningStage.TRAINING),
    )
    monitor, model = RecipeThroughput(peak_flops_per_device=PEAK), _Model()
    monitor.setup(trainer, model, "fit")
    assert monitor.available_flops == 4 * PEAK
    assert monitor._throughputs[RunningStage.TRAINING].world_size == 2
    batch = next(iter(model.train_dataloader()))
    monitor.on_train_batch_start(trainer, model, batch, 0)
    assert model.flops_per_batch == sum(FLOPS) * B * 2
    assert monitor.batch_size_fn(batch) == 2 * B
    assert monitor.length_fn is not None and monitor.length_fn(batch) == 2 * B * T
    ragged = RowsCollator(max_tokens=8, image_token_id=9)([_ragged("a", [1, 9, 5, 2], 1)] * 3)
    monitor.on_train_batch_start(trainer, model, ragged, 1)  # 3 samples packed in 2 rows
    assert model.flops_per_batch == sum(FLOPS) * 2 * 2  # a row is what the block costs price
    assert monitor.batch_size_fn(ragged) == 2 * 3


def test_refuses_a_non_positive_peak() -> None:
    with pytest.raises(ValueError, match=r"peak_flops_per_device=0.*> 0"):
        RecipeThroughput(peak_flops_per_device=0)


def test_default_logger_is_tensorboard_without_warnings(tmp_path: Any) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = Trainer(accelerator="cpu", devices=1, max_steps=1, default_root_dir=tmp_path)
    assert isinstance(trainer.logger, TensorBoardLogger)
    assert not [str(w.message) for w in caught if "logger" in str(w.message).lower()]


def _ragged(sid: str, text: list[int], images: int) -> dict[str, Any]:
    ids = torch.tensor(text)
    return {
        "id": sid,
        "input_ids": ids,
        "labels": ids.clone(),
        "pixel_values": torch.zeros(images, 3, 4, 4),
    }


def test_ragged_batches_count_packed_samples_and_their_tokens() -> None:
    """Issue 28: a ragged batch has no ``images`` key; its samples are the packed samples of
    every row (empty rows none) and its tokens the non-pad positions plus each image's tokens
    (cross-attention), the image positions already in the rows when spliced."""
    img = 9
    samples = [
        _ragged("a", [1, img, 5, 2], 1),
        _ragged("b", [1, 6, 6, 6, 6, 2], 0),
        _ragged("c", [1, img, img, img, 2], 3),
        _ragged("d", [1, 7, 2], 0),
    ]
    collate = RowsCollator(max_tokens=8, image_token_id=img, rows_multiple=4)
    batch = collate(samples)  # rows: a + d, b, c, and one empty row
    assert batch["sample_ids"].shape[0] == 4
    assert batch_counts(batch, 5) == (4, 18 + 4 * 5)  # 18 text positions, 4 images
    assert batch_counts(batch, 5, spliced=True) == (4, 18)
    spliced = RowsCollator(max_tokens=16, image_token_id=img, image_seq_length=3)(samples)
    assert batch_counts(spliced, 5, spliced=True) == (4, 18 + 4 * (3 - 1))
    one_image = {"images": torch.zeros(2, 3), "attention_mask": torch.ones(2, 5)}
    assert batch_counts(one_image, 5) == (2, 10 + 2 * 5)


def test_progress_bar_shows_samples_per_second_on_ragged_batches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bar = ThroughputProgressBar(window=2)
    monkeypatch.setattr(throughput, "time", _Clock())
    batch = RowsCollator(max_tokens=8, image_token_id=9)([_ragged("a", [1, 9, 5, 2], 1)] * 3)
    trainer: Any = SimpleNamespace(
        strategy=SimpleNamespace(parallel_dims=ParallelDims(world_size=2))
    )
    module: Any = SimpleNamespace(fusion_config=None)
    monkeypatch.setattr(TQDMProgressBar, "on_train_batch_end", lambda *a: None)
    for i in range(3):
        bar.on_train_batch_end(trainer, module, None, batch, i)
    assert bar.samples_per_sec == pytest.approx(2 * 3)  # dp 2 x 3 samples, one step a second
    assert bar.tokens_per_sec == pytest.approx(2 * 12)
