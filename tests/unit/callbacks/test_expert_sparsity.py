"""ExpertSparsitySchedule: cosine ramp values, mask choice from loads, top_k floor, masks stop
routing, state round trip, and one 4-step in-process fit checked against recorded stats."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mmpar.callbacks import ExpertSparsitySchedule
from lightning_mmpar.callbacks.expert_sparsity import (
    active_expert_count,
    cosine_sparsity,
    pruning_mask,
)
from lightning_mmpar.models.moe import MoEFeedForward
from lightning_mmpar.models.moe_routing import MoEConfig

E, D, S, STEPS = 8, 8, 6, 4


def test_cosine_sparsity_at_chosen_steps() -> None:
    assert cosine_sparsity(0, 10) == pytest.approx(0.1, rel=1e-12)
    assert cosine_sparsity(5, 10) == pytest.approx(0.4, rel=1e-12)  # midpoint of 0.1 and 0.7
    assert cosine_sparsity(10, 10) == pytest.approx(0.7, rel=1e-12)
    assert cosine_sparsity(25, 10) == pytest.approx(0.7, rel=1e-12)  # clamped to T
    assert cosine_sparsity(-3, 10) == pytest.approx(0.1, rel=1e-12)
    want = 0.1 + 0.6 * (1 - math.cos(math.pi * 0.3)) / 2
    assert cosine_sparsity(3, 10) == pytest.approx(want, rel=1e-12)
    assert cosine_sparsity(2, 4, 0.5, 0.0) == pytest.approx(0.25, rel=1e-12)  # decreasing ramp
    for bad in ({"total": 0}, {"total": 2.5}, {"s0": -0.1}, {"s1": 1.5}, {"s1": True}):
        kwargs: dict[str, Any] = {"step": 1, "total": 10, **bad}
        with pytest.raises(ValueError, match=next(iter(bad))):
            cosine_sparsity(**kwargs)


def test_active_count_and_mask_choice() -> None:
    assert active_expert_count(0.7, 10, 2) == 3  # (1 - 0.7) * 10 = 3.0000000000000004
    assert active_expert_count(0.1, 8, 2) == 8  # ceil(7.2)
    assert active_expert_count(0.7, 8, 2) == 3  # ceil(2.4)
    assert active_expert_count(0.7, 8, 4) == 4  # never below top_k
    assert active_expert_count(1.0, 8, 1) == 1  # never all masked
    load = torch.tensor([5.0, 1.0, 3.0, 1.0, 0.0, 3.0])
    assert pruning_mask(load, 3).tolist() == [True, False, True, False, False, True]
    # ties keep the lower id: experts 1 and 3 tie at load 1
    assert pruning_mask(load, 5).tolist() == [True, True, True, True, False, True]
    assert pruning_mask(torch.zeros(4), 2).tolist() == [True, True, False, False]
    with pytest.raises(ValueError, match="keep"):
        pruning_mask(load, 0)
    for bad in ({"s0": 2.0}, {"total_steps": 0}, {"prefix": "/"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ExpertSparsitySchedule(**bad)  # type: ignore[arg-type]


def test_masked_expert_receives_no_token() -> None:
    torch.manual_seed(0)
    layer = MoEFeedForward(
        D,
        MoEConfig(
            num_experts=4, top_k=2, ffn_width=8, router_dim=8, capacity_factor=None, init_std=0.5
        ),
    )
    x = torch.randn(3, 8, D)
    layer(x)
    before = layer.last_stats["text"].kept_per_expert
    busiest = int(before.argmax())
    assert int(before[busiest]) > 0
    layer.expert_mask[busiest] = False
    layer(x)
    stats = layer.last_stats["text"]
    assert int(stats.tokens_per_expert[busiest]) == 0 and int(stats.kept_per_expert[busiest]) == 0
    assert int(stats.kept_per_expert.sum()) == 2 * 3 * 8  # every token still gets top_k


class TinyMoE(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.moe = MoEFeedForward(
            D,
            MoEConfig(
                num_experts=E,
                top_k=2,
                ffn_width=8,
                router_dim=8,
                capacity_factor=None,
                init_std=0.5,
            ),
        )
        self.head = nn.Linear(D, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.head(x + self.moe(x)).pow(2).mean() + self.moe.aux_loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Recorder(pl.Callback):
    """Runs before the schedule: each batch's kept routes and the mask it was routed with."""

    def __init__(self) -> None:
        self.kept: list[torch.Tensor] = []
        self.masks: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        self.kept.append(pl_module.moe.last_stats["text"].kept_per_expert.clone())
        self.masks.append(pl_module.moe.expert_mask.clone())


@pytest.fixture(scope="module")
def fitted() -> dict[str, Any]:
    torch.manual_seed(0)
    model, rec = TinyMoE(), Recorder()
    sched = ExpertSparsitySchedule(total_steps=STEPS)
    data = DataLoader(TensorDataset(torch.randn(2 * STEPS, S, D)), batch_size=2)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        log_every_n_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[rec, sched],
    )
    trainer.fit(model, data)
    return {"model": model, "rec": rec, "sched": sched, "trainer": trainer}


def test_fit_masks_follow_loads_and_ramp(fitted: dict[str, Any]) -> None:
    rec, sched, model = fitted["rec"], fitted["sched"], fitted["model"]
    assert rec.masks[0].all(), "the mask is unchanged before the first optimizer step"
    loads = torch.zeros(E, dtype=torch.float64)
    for step in range(1, STEPS + 1):
        loads += rec.kept[step - 1].double()
        keep = active_expert_count(cosine_sparsity(step, STEPS), E, 2)
        want = pruning_mask(loads, keep)
        got = rec.masks[step] if step < STEPS else model.moe.expert_mask
        assert got.tolist() == want.tolist(), f"mask after step {step}"
        if step < STEPS:  # the next batch routes nothing to a pruned expert
            assert int(rec.kept[step][~want].sum()) == 0
    assert int(model.moe.expert_mask.sum()) == math.ceil(0.3 * E) == sched.active["moe"]
    assert torch.equal(sched.loads["moe"], loads)
    metrics = fitted["trainer"].logged_metrics
    assert float(metrics["moe/sparsity"]) == pytest.approx(0.7, rel=1e-6)
    assert float(metrics["moe/moe/active_experts"]) == 3.0


def test_state_dict_round_trip(fitted: dict[str, Any]) -> None:
    sched, model, trainer = fitted["sched"], fitted["model"], fitted["trainer"]
    state = sched.state_dict()
    assert state["step"] == STEPS and state["sparsity"] == pytest.approx(0.7)
    fresh = ExpertSparsitySchedule(total_steps=STEPS)
    fresh.load_state_dict(state)
    fresh.on_fit_start(trainer, model)
    assert torch.equal(fresh.loads["moe"], sched.loads["moe"])
    assert fresh.state_dict() == state
    other = TinyMoE()  # the mask travels with the model's state dict (persistent buffer)
    other.load_state_dict(model.state_dict())
    assert torch.equal(other.moe.expert_mask, model.moe.expert_mask)
    assert "moe.expert_mask" in model.state_dict()
