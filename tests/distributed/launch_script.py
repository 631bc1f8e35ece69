"""Train the toy LM for 3 steps under mm_parallel; rank 0 prints its cluster environment and
losses. Run by tests/distributed/test_launchers.py with Lightning's own launcher, torchrun, and
a SLURM-like environment."""

from __future__ import annotations

import json
import sys

import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader

from lightning_mmpar import MultimodalParallelStrategy
from tests.distributed.parallel import parity_worker as pw

LAYOUTS = {"tp2": {"tensor_parallel": 2}, "pp2": {"pipeline_parallel": 2}}


def main() -> None:
    cfg = pw.ToyConfig()
    torch.manual_seed(0)
    model = pw.ToyTransformer(cfg)
    rec = pw.Recorder()
    trainer = Trainer(
        strategy=MultimodalParallelStrategy(**LAYOUTS[sys.argv[1]]),
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        limit_train_batches=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[rec],
    )
    trainer.fit(model, DataLoader(pw.dataset(cfg), batch_size=pw.GLOBAL_BATCH))
    if trainer.global_rank == 0:
        env = type(trainer.strategy.cluster_environment).__name__
        print("RESULT " + json.dumps({"env": env, "losses": rec.losses}), flush=True)


if __name__ == "__main__":
    main()
