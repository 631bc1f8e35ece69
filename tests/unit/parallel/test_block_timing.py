"""``partition="measured"``: each block's forward + backward timed on one micro-batch of the
first training batch (``parallel.pipeline.block_timing``), the module left as it was, and the
strategy's plan cut by those times (one process; pp 2 runs in benchmarks/bench_pipeline.py)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_mmpar.config import ParallelConfig
from lightning_mmpar.parallel.pipeline.block_timing import first_batch, time_blocks
from lightning_mmpar.parallel.pipeline.stages import module_stage_plan, stage_plan_for


class Slow(nn.Module):
    """A linear layer with dropout whose forward also sleeps ``delay`` seconds."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.linear, self.delay = nn.Linear(4, 4), delay
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: Tensor) -> Tensor:
        time.sleep(self.delay)
        self.calls += 1
        return nn.functional.dropout(self.linear(x), 0.5, training=True)


class Module(nn.Module):
    def __init__(self, delays: tuple[float, ...]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Slow(d) for d in delays)
        self.loss_calls = 0
        batches = [{"x": torch.randn(8, 4), "y": torch.randn(8, 4)}]
        data = SimpleNamespace(train_dataloader=lambda: iter(batches), batch_size=8)
        self._trainer = SimpleNamespace(datamodule=data)

    def pipeline_blocks(self) -> list[nn.Module]:
        return list(self.blocks)

    def pipeline_inputs(self, batch: dict[str, Tensor]) -> tuple[tuple[Tensor, ...], Tensor]:
        return (batch["x"],), batch["y"]

    def pipeline_loss(self, out: Tensor, target: Tensor) -> Tensor:
        self.loss_calls += 1
        return (out - target).pow(2).mean()


def test_time_blocks_ranks_blocks_and_leaves_the_module_alone() -> None:
    module = Module((0.0, 0.03, 0.0))
    before = {k: v.clone() for k, v in module.state_dict().items()}
    state = torch.get_rng_state()
    inputs, target = first_batch(module, micro_batches=4)
    assert inputs[0].shape == (2, 4) and target.shape == (2, 4)  # 8 rows / 4 micro-batches
    seconds = time_blocks(module.pipeline_blocks(), inputs, target, module.pipeline_loss)
    assert len(seconds) == 3 and seconds[1] >= 0.03 > max(seconds[0], seconds[2]) > 0
    assert module.loss_calls == 4  # one warm-up + 3 repeats, on the last block
    assert torch.equal(torch.get_rng_state(), state)  # dropout and the loader drew nothing
    assert all(p.grad is None for p in module.parameters())
    after = module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the buffer counted 12 calls
    with pytest.raises(ValueError, match="repeats >= 1"):
        time_blocks(module.pipeline_blocks(), inputs, target, module.pipeline_loss, repeats=0)


def test_the_strategy_plan_cuts_by_measured_time() -> None:
    """FLOPs (one unit per block) cut [2]; the times put the slow last block alone."""
    module = Module((0.0, 0.0, 0.0, 0.03))
    config = ParallelConfig(pipeline_parallel=2, micro_batches=2, partition="measured")
    plan = stage_plan_for(module, config)
    assert plan.boundaries == [3] and plan.stage_seconds is not None
    assert plan.imbalance == pytest.approx(plan.measured_imbalance)
    assert module_stage_plan(module, 2, 1, "equal").boundaries == [2]
    with pytest.raises(ValueError, match="block_seconds has 1 times for 4"):
        module_stage_plan(module, 2, 1, "measured", block_seconds=[1.0])
    module._trainer = SimpleNamespace(datamodule=None)
    with pytest.raises(ValueError, match="first training batch of the data module"):
        stage_plan_for(module, config)


def test_meta_parameters_fall_back_to_flops(recwarn: Any) -> None:
    with torch.device("meta"):
        module = Module((0.0, 0.0))
    config = ParallelConfig(pipeline_parallel=2, micro_batches=2, partition="measured")
    plan = stage_plan_for(module, config)
    assert plan.boundaries == [1] and plan.stage_seconds is None
    assert any("meta device" in str(w.message) for w in recwarn.list)
