"""The recipe's learning-rate schedule survives a resume on a pipeline stage with other groups.

Lightning saves rank 0's scheduler state; under pipeline parallelism stage 1 holds fewer
parameter groups (no vision tower), and torch's ``LambdaLR.load_state_dict`` then failed with a
``zip()`` length mismatch. :class:`~lightning_mmpar.recipes.optim.StepLambdaLR` saves the step
only: loaded into an optimizer with any groups, every rate equals an uninterrupted run's.
"""

from __future__ import annotations

import torch

from lightning_mmpar.recipes import parallel_env as penv
from lightning_mmpar.recipes.optim import StepLambdaLR
from lightning_mmpar.recipes.options import OptimConfig


def _optimizer(rates: list[float]) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.ones(2))], "lr": lr} for lr in rates]
    return torch.optim.AdamW(groups, lr=1.0)


def test_state_of_six_groups_loads_into_two_and_matches_an_uninterrupted_run() -> None:
    optim = OptimConfig(lr=1e-3, warmup_steps=3)
    factor = penv.warmup_cosine(optim, 20)
    stage0 = StepLambdaLR(_optimizer([1e-3, 1e-3, 2e-4, 2e-4, 5e-3, 5e-3]), factor)
    stage1_reference = StepLambdaLR(_optimizer([2e-4, 5e-3]), factor)
    for _ in range(7):
        stage0.optimizer.step()
        stage0.step()
        stage1_reference.optimizer.step()
        stage1_reference.step()
    state = stage0.state_dict()
    assert state == {"last_epoch": 7, "_step_count": 8}

    resumed = StepLambdaLR(_optimizer([2e-4, 5e-3]), factor)
    resumed.load_state_dict(state)
    want = [g["lr"] for g in stage1_reference.optimizer.param_groups]
    assert [g["lr"] for g in resumed.optimizer.param_groups] == want
    assert resumed.get_last_lr() == want == [2e-4 * factor(7), 5e-3 * factor(7)]
    resumed.optimizer.step()
    resumed.step()
    stage1_reference.optimizer.step()
    stage1_reference.step()
    assert resumed.get_last_lr() == stage1_reference.get_last_lr()


def test_torch_state_with_per_group_keys_loads_too() -> None:
    factor = penv.warmup_cosine(OptimConfig(lr=1.0, warmup_steps=2), 10)
    torch_sched = torch.optim.lr_scheduler.LambdaLR(_optimizer([1.0, 1.0, 1.0]), factor)
    for _ in range(4):
        torch_sched.optimizer.step()
        torch_sched.step()
    resumed = StepLambdaLR(_optimizer([0.5]), factor)
    resumed.load_state_dict(torch_sched.state_dict())  # base_lrs of 3 groups: ignored
    assert resumed.last_epoch == 4 and resumed.get_last_lr() == [0.5 * factor(4)]
