"""A degree the module's plan leaves without effect is refused at set-up, once (issue 31 item 2):
rank 0 raises the ``ValueError`` naming the option, the module and the fix; the other rank stops
quietly (``SystemExit(0)``, no traceback). One 2-process gloo world, several modules:

* a ``parallel_plan`` returning a plan without styles, at ``tensor_parallel=2``;
* a ``configure_model`` that builds plain layers (no ``parallelize_module``), at ``tp 2``;
* a plan naming no MoE layer, at ``expert_parallel=2``;
* the same module with a column-parallel plan at ``tp 2`` trains (the control).

Before, the first three trained two identical copies with no warning.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mmpar import MultimodalParallelStrategy
from lightning_mmpar.parallel.parallelize import ParallelPlan
from lightning_mmpar.testing import quiet_trainer, spawn
from tests.builders import column_parallel_plan

pytestmark = pytest.mark.distributed


class Linear(LightningModule):
    """``proj`` (4 -> 2); ``plan``: what ``parallel_plan`` returns (``"none"``: no method's
    effect, ``"colwise"``: ``proj`` split column-wise); ``build``: layers made in
    ``configure_model`` instead of ``__init__``."""

    def __init__(self, plan: str = "none", build: bool = False) -> None:
        super().__init__()
        self.plan, self.build = plan, build
        self.proj = None if build else nn.Linear(4, 2)
        self.steps = 0

    def configure_model(self) -> None:
        if self.proj is None:
            self.proj = nn.Linear(4, 2)

    def parallel_plan(self, dims: Any) -> ParallelPlan | None:
        if self.plan == "colwise":
            return column_parallel_plan("proj")
        return ParallelPlan() if self.plan == "empty" else None

    def training_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> Tensor:
        self.steps += 1
        assert self.proj is not None
        return self.proj(batch[0]).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _outcome(module: Linear, **strategy: Any) -> tuple[str, Any]:
    """``("ok", steps)``, ``("ValueError", message)`` or ``("exit", code)``."""
    trainer = quiet_trainer(
        strategy=MultimodalParallelStrategy(data_parallel="ddp", **strategy),
        devices=2,
        max_steps=2,
    )
    loader = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2)
    try:
        trainer.fit(module, loader)
    except ValueError as err:
        return "ValueError", str(err)
    except SystemExit as stop:
        return "exit", stop.code
    return "ok", module.steps


def world(rank: int, size: int) -> dict[str, tuple[str, Any]]:
    return {
        "empty_plan_tp2": _outcome(Linear(plan="empty"), tensor_parallel=2),
        "configure_model_tp2": _outcome(Linear(build=True), tensor_parallel=2),
        "no_experts_ep2": _outcome(Linear(plan="empty"), expert_parallel=2),
        "colwise_tp2": _outcome(Linear(plan="colwise"), tensor_parallel=2),
    }


def test_unapplied_degrees_are_refused_once() -> None:
    rank0, rank1 = spawn(world, 2, timeout=300)
    why = "no parameter is sharded over the 'tp' mesh after its configure_model() and plan"
    assert rank0["empty_plan_tp2"] == (
        "ValueError",
        f"tensor_parallel=2 has no effect on Linear: {why}, so its 2 tensor-parallel ranks "
        "would train identical full copies doing the same work. Give it a plan: a "
        "parallel_plan(dims) method returning a ParallelPlan with tensor_parallel styles, or "
        "parallelize_module(..., self.device_mesh['tp'], ...) in configure_model() "
        "(docs/strategy.md#one-parallelize-path-parallel_plandims-and-parallelize); or set "
        "tensor_parallel=1.",
    )
    assert rank0["configure_model_tp2"][0] == "ValueError"
    assert rank0["configure_model_tp2"][1].startswith("tensor_parallel=2 has no effect on Linear")
    assert rank0["no_experts_ep2"] == (
        "ValueError",
        "expert_parallel (2) needs a model with expert-parallel MoE layers, but Linear has none "
        "after configure_model(); configure MoE layers (e.g. model.fusion.language.moe) or set "
        "expert_parallel=1.",
    )
    refused = ("empty_plan_tp2", "configure_model_tp2", "no_experts_ep2")
    assert [rank1[k] for k in refused] == [("exit", 0)] * 3  # quiet: rank 0 says it
    assert rank0["colwise_tp2"] == rank1["colwise_tp2"] == ("ok", 2)
