"""Inputs that used to be accepted silently: an empty training set is refused, layout options
that cannot act are refused at construction (issue 31 item 8; warned about before, issue 15
item 9) and a partition without a pipeline is warned about (issue 15, items 6, 9).

The fits run in this process on one CPU device (a gloo world of 1, destroyed afterwards).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mmpar import MultimodalParallelStrategy, ParallelConfig
from lightning_mmpar.config import check_train_batches
from lightning_mmpar.testing import quiet_trainer


class Linear(LightningModule):
    """One linear layer on ``(B, 4)`` inputs, ``(B,)`` targets, fed by ``drop_last`` batches."""

    def __init__(self, samples: int, batch_size: int) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.samples, self.batch_size, self.steps = samples, batch_size, 0

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        self.steps += 1
        x, y = batch
        return nn.functional.mse_loss(self.layer(x).squeeze(-1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        data = TensorDataset(torch.randn(self.samples, 4), torch.randn(self.samples))
        return DataLoader(data, batch_size=self.batch_size, drop_last=True)


@pytest.fixture
def one_process_world() -> Iterator[None]:
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _fit(module: Linear, root: Path, **kwargs: Any) -> Trainer:
    trainer = quiet_trainer(
        strategy=MultimodalParallelStrategy(),
        devices=1,
        max_steps=2,
        default_root_dir=root,
        **kwargs,
    )
    trainer.fit(module)
    return trainer


# ---------------------------------------------------------------- item 6: empty training set
def test_empty_train_set_is_refused(tmp_path: Path, one_process_world: None) -> None:
    module = Linear(samples=3, batch_size=4)  # drop_last: 0 batches
    msg = (
        "the train dataloader (DataLoader over TensorDataset of 3 samples, batch_size 4, "
        "drop_last True) has 0 batches on every rank, so fit would run 0 steps. Check the "
        "datamodule's data path and train split, use a batch_size no larger than the samples "
        "per data-parallel rank, or set drop_last=False."
    )
    with pytest.raises(ValueError, match="^" + re.escape(msg) + "$"):
        _fit(module, tmp_path)
    assert module.steps == 0


def test_non_empty_train_set_trains(tmp_path: Path, one_process_world: None) -> None:
    module = Linear(samples=8, batch_size=4)  # 2 batches
    trainer = _fit(module, tmp_path)
    assert (module.steps, trainer.global_step) == (2, 2)


def test_zero_train_batch_limit_still_skips_training(
    tmp_path: Path, one_process_world: None
) -> None:
    """``limit_train_batches=0`` asks for no training: Lightning never builds the loader."""
    module = Linear(samples=3, batch_size=4)
    trainer = _fit(module, tmp_path, limit_train_batches=0)
    assert (module.steps, trainer.global_step) == (0, 0)


def test_check_train_batches_passes_unsized_and_non_empty_loaders() -> None:
    loader = DataLoader(TensorDataset(torch.zeros(2, 1)), batch_size=1)
    check_train_batches(None, loader)
    check_train_batches(2, loader)
    with pytest.raises(ValueError, match=r"over TensorDataset of 2 samples, batch_size 1, "):
        check_train_batches(0, loader)


def test_empty_loader_message_reports_the_batching_it_really_uses() -> None:
    """Lightning re-creates a torchdata ``StatefulDataLoader`` around a ``DistributedSampler``
    (dp > 1) with ``batch_sampler=``: the loader's own ``batch_size`` / ``drop_last`` then read
    ``None`` / ``False``; the message names its batch sampler's 72 and ``True``."""
    from lightning.fabric.utilities.data import _update_dataloader
    from torch.utils.data import DistributedSampler
    from torchdata.stateful_dataloader import StatefulDataLoader

    from lightning_mmpar.data.sampler import ResumableRandomSampler

    data = TensorDataset(torch.zeros(100, 1))
    loader = StatefulDataLoader(
        data, batch_size=72, sampler=ResumableRandomSampler(data, seed=0), drop_last=True
    )
    sampler = DistributedSampler(data, num_replicas=2, rank=0, shuffle=False)
    rebuilt = _update_dataloader(loader, sampler)
    assert (rebuilt.batch_size, rebuilt.drop_last, len(rebuilt)) == (None, False, 0)
    with pytest.raises(ValueError, match=r"of 100 samples, batch_size 72, drop_last True\) has 0"):
        check_train_batches(0, rebuilt)


# ---------------------------------------------------------------- item 9: options with no effect
def _build(strategy: MultimodalParallelStrategy, devices: int) -> list[str]:
    """Build a Trainer (no process starts) and return the warnings it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_trainer(strategy=strategy, devices=devices)
    return [str(w.message) for w in caught if "has no effect" in str(w.message)]


def test_expert_parallel_without_experts_is_refused_at_setup() -> None:
    from torch import nn

    from lightning_mmpar.parallel.expert_data import check_expert_layers

    assert _build(MultimodalParallelStrategy(expert_parallel=2), 4) == []  # no warning: set-up
    with pytest.raises(ValueError, match=r"expert_parallel \(2\) needs a model with expert-par"):
        check_expert_layers(nn.Linear(2, 2), 2)  # the strategy's set-up check (_parallelize)
    check_expert_layers(nn.Linear(2, 2), 1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"micro_batches": 2},
            "micro_batches (2) cannot act with pipeline_parallel=1: each batch runs whole. Set "
            "pipeline_parallel >= 2, or leave micro_batches unset (null); Trainer("
            "accumulate_grad_batches=...) accumulates several batches per step.",
        ),
        (
            {"schedule": "gpipe"},
            "schedule ('gpipe') cannot act with pipeline_parallel=1: there is no pipeline to "
            "schedule. Set pipeline_parallel >= 2, or leave schedule unset (the default '1f1b').",
        ),
        (
            {"schedule": "interleaved_1f1b"},
            "schedule ('interleaved_1f1b') cannot act with pipeline_parallel=1: there is no "
            "pipeline to schedule. Set pipeline_parallel >= 2, or leave schedule unset (the "
            "default '1f1b').",
        ),
    ],
)
def test_pipeline_options_at_pp_1_are_refused_at_construction(
    kwargs: dict[str, Any], message: str
) -> None:
    """Issue 31 item 8: refused when the strategy (and the planner's layout) is built, with the
    fix; formerly a warning when the Trainer was built."""
    from lightning_mmpar.layout import ParallelLayout, validate

    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        MultimodalParallelStrategy(**kwargs)
    layout = {"micro_batches": kwargs.get("micro_batches"), "schedule": kwargs.get("schedule")}
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        validate(ParallelLayout(**{k: v for k, v in layout.items() if v is not None}))


def test_one_micro_batch_at_pp_1_is_what_runs() -> None:
    """``micro_batches=1`` without a pipeline says what happens (the planner's layouts)."""
    assert _build(MultimodalParallelStrategy(micro_batches=1), 1) == []


@pytest.mark.parametrize(
    ("config", "devices"),
    [
        (ParallelConfig(), 1),
        (ParallelConfig(schedule="1f1b"), 1),  # the default, as shipped YAMLs spell it
        (ParallelConfig(pipeline_parallel=2, micro_batches=4, schedule="gpipe"), 2),
        (ParallelConfig(pipeline_parallel=2, virtual_pipeline=2, schedule="interleaved_1f1b"), 2),
    ],
)
def test_effective_options_do_not_warn(config: ParallelConfig, devices: int) -> None:
    assert config.ineffective_options() == []
    assert _build(MultimodalParallelStrategy(config=config), devices) == []
