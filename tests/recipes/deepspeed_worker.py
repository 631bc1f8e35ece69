"""DeepSpeed on CPU processes, in one spawned world (gloo): the recipe's ``--deepspeed`` runs
and a tiny module on DeepSpeed's ZeRO-1/2 engine.

:func:`world` runs the recipe CLI commands it is given (:mod:`cli_worker`), then trains
:class:`Tiny` once per ZeRO stage through :class:`CPUCapableDeepSpeedStrategy`
(:func:`train_engine`). ``DS_ACCELERATOR=cpu`` must be in the environment of the caller of
:func:`lightning_mmpar.testing.spawn`.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_mmpar.recipes.deepspeed_cli import strategy_from_deepspeed
from tests.recipes import cli_worker


class Tiny(LightningModule):
    """Linear regression ``y = x W``: the loss must fall under any ZeRO stage."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )
        # 0-dim, like CLIP's logit scale: DeepSpeed's broadcast must cope with it
        self.scale = torch.nn.Parameter(torch.tensor(1.0))
        self.losses: list[float] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x) * self.scale, y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def train_engine(stage: int) -> dict[str, Any]:
    """40 steps of :class:`Tiny` under ZeRO ``stage`` on this world's 2 ranks; this rank's
    first and last loss, the engine's class name and the steps taken."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g)
    config = {"train_micro_batch_size_per_gpu": 16, "zero_optimization": {"stage": stage}}
    model = Tiny()
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy_from_deepspeed(config),
        max_steps=40,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=16))
    return {
        "first": model.losses[0],
        "last": model.losses[-1],
        "engine": type(trainer.strategy.model).__name__,
        "steps": trainer.global_step,
    }


def world(
    rank: int, world_size: int, commands: dict[str, list[str]], stages: list[int]
) -> dict[str, Any]:
    """The recipe ``commands`` (:func:`cli_worker.world`), then :func:`train_engine` for each
    of ``stages``: ``{command name: ..., "engine": {stage: ...}}``."""
    out = cli_worker.world(rank, world_size, commands)
    out["engine"] = {stage: train_engine(stage) for stage in stages}
    return out
