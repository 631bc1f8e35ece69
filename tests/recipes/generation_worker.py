"""Rank body of the generation / evaluation checks: one 2-process world, two layouts.

Every run uses the untrained tiny recipe module (:func:`recipe_faults_worker.tiny_module`:
CLIP-ViT + adapter + joint-attention LLaMA, seeded, dropout 0) and :class:`ShortDigits`: the
first :data:`SAMPLES` held-out digits in batches of :data:`BATCH` (8 then 5: the last batch is
smaller than, and not divisible by, the 2 micro-batches).

* ``pp2`` (pipeline 2, 1F1B, 2 micro-batches): ``predict`` with :class:`CaptionWriter` (KV-cached
  decoding through the stages), ``validate`` (the short batch runs its stages in order), and the
  cached and uncached (forward-only schedule per token) captions of the first full batch;
* ``tp2`` (tensor 2): ``predict`` with :class:`CaptionWriter` and the cached captions;
* ``tp2_pp2`` (4 ranks, :func:`world_tp2_pp2`): as ``pp2``;
* ``fsdp2`` (data parallel 2, FSDP2): cached and uncached captions of each rank's own 4 images
  (the cached decode gathers each block's shards around its calls).

The test compares each with one process (same module, same data).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Subset

from lightning_mmpar import MultimodalParallelStrategy
from lightning_mmpar.parallel import data as dpar
from lightning_mmpar.recipes.caption_writer import CaptionWriter
from lightning_mmpar.recipes.cli import RecipeDigitsCaptions
from lightning_mmpar.testing import quiet_trainer
from tests.recipes import recipe_faults_worker as rw

SAMPLES = 13
BATCH = 8


class ShortDigits(RecipeDigitsCaptions):
    """The first :data:`SAMPLES` held-out digits, batches of :data:`BATCH` (a short last one),
    for validation and prediction."""

    def val_dataloader(self) -> DataLoader[dict[str, torch.Tensor]]:
        assert self.val is not None, "call setup() first"
        return DataLoader(Subset(self.val, range(SAMPLES)), batch_size=BATCH)


def data() -> ShortDigits:
    return ShortDigits(image_size=16, batch_size=BATCH, max_length=rw.TEXT_LENGTH)


def run(
    strategy: Any, devices: int, out: Path, *, validate: bool, uncached: bool = True
) -> dict[str, Any]:
    """``predict`` (and ``validate``) of a fresh module on :func:`data`; captions written under
    ``out``; cached and uncached captions of the first batch."""
    digits = data()
    module = rw.tiny_module(digits.vocab_size)
    writer = CaptionWriter(str(out))
    trainer = quiet_trainer(
        strategy=strategy, devices=devices, callbacks=[writer], use_distributed_sampler=False
    )
    trainer.predict(module, datamodule=digits, return_predictions=False)
    result: dict[str, Any] = {"rows": writer.rows, "accuracy": writer.accuracy}
    images = next(iter(digits.val_dataloader()))["images"]
    ids = torch.zeros(images.shape[0], rw.TEXT_LENGTH, dtype=torch.long)
    module.eval()
    with torch.no_grad():
        result["cached"] = module._greedy({"images": images, "input_ids": ids})
        if uncached:
            result["uncached"] = module._greedy({"images": images, "input_ids": ids}, False)
    if validate:  # same trainer: the strategy keeps its pipeline
        trainer.validate(module, datamodule=digits, verbose=False)
        result["metrics"] = {k: float(v) for k, v in trainer.callback_metrics.items()}
    return result


def world(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """The ``pp2`` and ``tp2`` runs on this rank."""
    pp2 = MultimodalParallelStrategy(pipeline_parallel=2, micro_batches=2, schedule="1f1b")
    out = {"pp2": run(pp2, world_size, Path(root) / "pp2", validate=True)}
    tp2 = MultimodalParallelStrategy(tensor_parallel=2)
    out["tp2"] = run(tp2, world_size, Path(root) / "tp2", validate=False, uncached=False)
    out["fsdp2"] = fsdp(rank, world_size)
    return out


def world_tp2_pp2(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """``tp2_pp2`` (4 ranks: tensor 2 x pipeline 2, 1F1B, 2 micro-batches): ``predict`` with
    :class:`CaptionWriter`, ``validate`` (short last batch in stage order) and the cached and
    uncached captions. Its stage boundary carries the vocab-parallel embedding's output, a
    pending all-reduce (``comm.send_tensors`` must wait for it)."""
    strategy = MultimodalParallelStrategy(
        tensor_parallel=2, pipeline_parallel=2, micro_batches=2, schedule="1f1b"
    )
    return run(strategy, world_size, Path(root) / "tp2_pp2", validate=True)


def fsdp(rank: int, world_size: int) -> dict[str, Any]:
    """Cached and uncached captions of images ``4 rank .. 4 rank + 3`` under FSDP2 at dp 2."""
    digits = data()
    module = rw.tiny_module(digits.vocab_size)
    strategy = MultimodalParallelStrategy(data_parallel="fsdp")
    trainer = quiet_trainer(
        strategy=strategy,
        devices=world_size,
        limit_predict_batches=1,
        use_distributed_sampler=False,
    )
    trainer.predict(module, datamodule=digits, return_predictions=False)  # sets up FSDP2
    images = next(iter(digits.val_dataloader()))["images"][4 * rank : 4 * rank + 4]
    module.eval()
    return {
        "sharded": dpar.has_fsdp(module),
        "cached": module.generate(images, rw.TEXT_LENGTH),
        "uncached": module.generate(images, rw.TEXT_LENGTH, use_cache=False),
    }
