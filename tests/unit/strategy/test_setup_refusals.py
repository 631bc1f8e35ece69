"""Options that cannot act on the module are refused before any process starts, once (issue 31
item 2): the module's class is checked when Lightning launches, and under torchrun / SLURM
(processes started outside) only rank 0 raises; the other ranks stop quietly.

No process starts here: every case is refused in this process before Lightning's launcher
would spawn one (or, with a torchrun environment, before the process group exists).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_only
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mmpar import MultimodalParallelStrategy
from lightning_mmpar.parallel.parallelize import UnappliedDegreeError, check_degrees_applied
from lightning_mmpar.testing import quiet_trainer
from lightning_mmpar.topology import ParallelDims

PLAN_FIX = (
    "Give it a plan: a parallel_plan(dims) method returning a ParallelPlan with tensor_parallel "
    "styles, or parallelize_module(..., self.device_mesh['tp'], ...) in configure_model() "
    "(docs/strategy.md#one-parallelize-path-parallel_plandims-and-parallelize); or set "
    "tensor_parallel=1."
)


class Plain(LightningModule):
    """A user's module: layers built in ``__init__``, no plan, no ``configure_model``."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.steps = 0

    def training_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> Tensor:
        self.steps += 1
        return self.layer(batch[0]).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2)


def _fit(module: LightningModule, devices: int = 2, **strategy: Any) -> None:
    trainer = quiet_trainer(strategy=MultimodalParallelStrategy(**strategy), devices=devices)
    trainer.fit(module, _loader())


@pytest.mark.parametrize(
    ("strategy", "error", "message"),
    [
        (
            {"tensor_parallel": 2},
            UnappliedDegreeError,
            "tensor_parallel=2 has no effect on Plain: it has no parallel_plan(dims) method and "
            "no configure_model() of its own, so its 2 tensor-parallel ranks would train "
            f"identical full copies doing the same work. {PLAN_FIX}",
        ),
        (
            {"expert_parallel": 2},
            UnappliedDegreeError,
            "expert_parallel (2) needs a model with expert-parallel MoE layers, but Plain has no "
            "parallel_plan(dims) method (whose plan names its MoE layers) and no "
            "configure_model() of its own; add MoE layers and a plan (docs/experts.md) or set "
            "expert_parallel=1.",
        ),
        (
            {"pipeline_parallel": 2},
            TypeError,
            "pipeline_parallel=2 needs Plain to implement pipeline_blocks(), pipeline_inputs() "
            "and pipeline_loss() (lightning_mmpar.parallel.pipeline.PipelineModule); or set "
            "pipeline_parallel=1.",
        ),
    ],
)
def test_refused_before_lightning_launches(
    strategy: dict[str, Any], error: type[Exception], message: str
) -> None:
    """Formerly: tp 2 and ep 2 trained two identical copies silently; pp 2 failed after the
    processes started, once per rank. Now refused here, before the second process exists."""
    module = Plain()
    with pytest.raises(error, match="^" + re.escape(message) + "$"):
        _fit(module, **strategy)
    assert module.steps == 0


@pytest.fixture
def torchrun_rank_1(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process as rank 1 of 2 started by torchrun (no process group yet)."""
    env = {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "GROUP_RANK": "0",
        "LOCAL_WORLD_SIZE": "2",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29511",
        "TORCHELASTIC_RUN_ID": "refusals",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(rank_zero_only, "rank", 1)


def test_other_ranks_stop_quietly_under_torchrun(torchrun_rank_1: None) -> None:
    """Rank 1 of a torchrun job exits with status 0 and no traceback (rank 0 says why) for a
    module-, world- or option-level refusal."""
    module = Plain()
    with pytest.raises(SystemExit) as stop:
        _fit(module, tensor_parallel=2)  # the module: checked before the process group
    assert stop.value.code == 0 and module.steps == 0
    with pytest.raises(SystemExit) as stop:
        quiet_trainer(strategy=MultimodalParallelStrategy(tensor_parallel=4), devices=2)
    assert stop.value.code == 0  # the world: 2 processes for tp 4
    with pytest.raises(SystemExit) as stop:
        MultimodalParallelStrategy(micro_batches=2)  # the options themselves
    assert stop.value.code == 0


def test_degrees_left_unapplied_by_a_plan_are_named() -> None:
    """The check after the plan ran (every rank alike): no parameter sharded over ``tp``."""
    dims = ParallelDims(world_size=2, tp=2)
    with pytest.raises(UnappliedDegreeError, match=r"^tensor_parallel=2 has no effect on Linear"):
        check_degrees_applied(nn.Linear(2, 2), dims)
    check_degrees_applied(nn.Linear(2, 2), ParallelDims(world_size=2))  # dp 2: nothing to do
    with pytest.raises(UnappliedDegreeError, match=r"^expert_parallel \(2\) needs a model"):
        check_degrees_applied(nn.Linear(2, 2), ParallelDims(world_size=2, ep=2))
