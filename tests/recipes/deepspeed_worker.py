"""Train a tiny module with DeepSpeed ZeRO-1/2 on CPU processes (run as a script by the tests).

``python tests/recipes/deepspeed_worker.py STAGE OUT_JSON``: 2 CPU processes (gloo), DeepSpeed's
engine through :class:`CPUCapableDeepSpeedStrategy`; rank 0 writes the first and last loss.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_mmpar.recipes.deepspeed_cli import strategy_from_deepspeed


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


def main(stage: int, out: str) -> None:
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
    if trainer.is_global_zero:
        engine = type(trainer.strategy.model).__name__
        Path = __import__("pathlib").Path
        Path(out).write_text(
            json.dumps(
                {
                    "first": model.losses[0],
                    "last": model.losses[-1],
                    "engine": engine,
                    "steps": trainer.global_step,
                }
            )
        )


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
