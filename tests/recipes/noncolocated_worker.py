"""Non-colocated towers (issue 30): the vision tower on its own ranks against one process, on
the ragged batches of :mod:`ragged_parity_worker` (text-only, one- and three-image samples),
one spawned world per size."""

from __future__ import annotations

import time
from typing import Any

from lightning.pytorch import Trainer

from lightning_mmpar import MultimodalParallelStrategy
from tests.recipes import parity_matrix_worker as pm
from tests.recipes import ragged_parity_worker as rp
from tests.recipes import recipe_faults_worker as rw


class Recorder(rw.Recorder):
    """Losses where a rank logs them (the language ranks), gradients everywhere."""

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, *args: Any) -> None:
        if "train_loss" in trainer.callback_metrics:
            self.losses.append(float(trainer.callback_metrics["train_loss"]))


LAYOUTS: tuple[tuple[str, int, dict[str, Any]], ...] = (
    ("1 vision + tp2", 3, {"vision_ranks": 1, "tensor_parallel": 2}),
    ("2 vision (dp) + pp2", 4, {"vision_ranks": 2, **pm._pp("1f1b", 2, 2, 1)}),
    ("1 vision + tp2 x pp2", 5, {"vision_ranks": 1, **pm._pp("1f1b", 2, 2, 1, tensor_parallel=2)}),
)


def run(name: str, world: int, strategy: dict[str, Any], rank: int) -> dict[str, Any]:
    start = time.perf_counter()
    module = pm.build(rp.VOCAB, None)
    module.text_length = rp.TOKENS
    recorder = Recorder()
    trainer = rw.quiet_trainer(
        strategy=MultimodalParallelStrategy(**strategy),
        devices=world,
        max_epochs=1,
        use_distributed_sampler=False,
        limit_val_batches=0,
        callbacks=[recorder],
    )
    from torch.utils.data import DataLoader

    trainer.fit(module, DataLoader(rp.batches(), batch_size=None))
    return {
        "losses": recorder.losses,
        "grads": recorder.grads,
        "seconds": time.perf_counter() - start,
    }


def world(rank: int, world_size: int) -> dict[str, Any]:
    return {
        name: pm.named(name, rank, run, name, size, strategy, rank)
        for name, size, strategy in LAYOUTS
        if size == world_size
    }
