"""WebDataset shards under ``mm_parallel``: the split follows the dp rank, and a Lightning
checkpoint taken mid-epoch resumes with exactly the samples an uninterrupted run reads next.

One 2-rank gloo world runs the rank checks: at tp 2 (one dp replica) both ranks train on the same
samples; at dp 2 they train on disjoint halves that together hold every sample once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor

from lightning_mmpar import MultimodalParallelStrategy
from lightning_mmpar.data.webdataset import WebDatasetCaptions
from lightning_mmpar.testing import quiet_trainer, spawn
from tests.builders import column_parallel_plan
from tests.unit.data.test_webdataset import write_shards

pytestmark = pytest.mark.distributed


class Recorder(LightningModule):
    """Records the captions (token ids) of the batches it trains on; ``proj`` is split
    column-wise at tensor_parallel > 1 (a module leaving tp idle is refused)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.proj = torch.nn.Linear(1, 2)
        self.seen: list[Tensor] = []

    def parallel_plan(self, dims: Any) -> Any:
        return column_parallel_plan("proj")

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        self.seen.append(batch["input_ids"].detach().clone())
        loss = self.w.sum() * batch["images"].mean()
        return loss + self.proj(batch["images"].mean().view(1, 1)).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _sample_ids(data: WebDatasetCaptions, seen: list[Tensor]) -> list[int]:
    rows = torch.cat(seen).tolist() if seen else []
    return [int(data.tokenizer.decode(r).split()[1]) for r in rows]


def _fit(pattern: str, strategy: Any, world: int, **trainer: Any) -> tuple[list[int], Any]:
    data = WebDatasetCaptions(train_shards=pattern, image_size=8, max_length=6, batch_size=2)
    module = Recorder()
    quiet_trainer(strategy=strategy, devices=world, **trainer).fit(module, datamodule=data)
    return _sample_ids(data, module.seen), data


def checks(rank: int, world: int, pattern: str) -> dict[str, Any]:
    tp2 = MultimodalParallelStrategy(tensor_parallel=2, data_parallel="ddp")
    dp2 = MultimodalParallelStrategy(data_parallel="ddp")
    return {
        "tp2": _fit(pattern, tp2, world, max_epochs=1)[0],
        "dp2": _fit(pattern, dp2, world, max_epochs=1)[0],
    }


def test_split_follows_the_dp_rank(tmp_path: Path) -> None:
    pattern = write_shards(tmp_path, shards=4, per_shard=3)
    results = spawn(checks, 2, pattern, timeout=600)
    assert results[0]["tp2"] == results[1]["tp2"]  # tensor-parallel peers: the same samples
    assert sorted(results[0]["tp2"]) == list(range(12))
    dp = [r["dp2"] for r in results]
    assert len(dp[0]) == len(dp[1]) == 6 and sorted(dp[0] + dp[1]) == list(range(12))


def test_lightning_checkpoint_resumes_mid_epoch_exactly(tmp_path: Path) -> None:
    pattern = write_shards(tmp_path / "shards", shards=3, per_shard=4)
    strategy = MultimodalParallelStrategy  # one process: dp 1
    full, _ = _fit(pattern, strategy(), 1, max_epochs=2)
    assert len(full) == 24 and full[:12] != full[12:]  # epoch 2 reads the shards reordered
    save = ModelCheckpoint(dirpath=tmp_path, filename="mid", every_n_train_steps=9)
    data = WebDatasetCaptions(train_shards=pattern, image_size=8, max_length=6, batch_size=2)
    first = Recorder()
    trainer = quiet_trainer(
        strategy=strategy(),
        devices=1,
        max_epochs=2,
        max_steps=10,
        callbacks=[save],
        enable_checkpointing=True,
    )
    trainer.fit(first, datamodule=data)  # saved after 6 batches of epoch 1 and 3 of epoch 2
    head = _sample_ids(data, first.seen)[:18]
    data2 = WebDatasetCaptions(train_shards=pattern, image_size=8, max_length=6, batch_size=2)
    second = Recorder()
    quiet_trainer(strategy=strategy(), devices=1, max_epochs=2).fit(
        second, datamodule=data2, ckpt_path=tmp_path / "mid.ckpt"
    )
    assert head + _sample_ids(data2, second.seen) == full
