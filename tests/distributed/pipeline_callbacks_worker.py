"""Rank body of the pipeline-callback checks (issue 11): one 2-process world, two pp 2 runs.

Both runs train the recipe module (:func:`recipe_faults_worker.tiny_module`: CLIP-ViT + adapter
+ LLaMA fusion, contrastive + caption + MML losses, dropout 0) for :data:`STEPS` AdamW steps at
pipeline parallel 2 with the 1F1B schedule, on the same global batches:

* ``static``: 2 micro-batches (size 4) throughout; :class:`PipelineTimeline` records steps
  1 to 3;
* ``dynamic``: starts at 2 micro-batches; :class:`DynamicMicroBatching` decides after every step
  (``every_n_steps=1``, ``patience=2``) from a fake memory source reporting 95% of the limit
  (policy: ``int(8 * 0.3 * ~0.99) = 2``), so size 2 (4 micro-batches) is chosen after steps 1
  and 2 and applied from step 2 on; :class:`PipelineTimeline` records steps 2 and 3 (m = 4).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, Trainer

sys.path.insert(0, str(Path(__file__).parents[1] / "recipes"))
import recipe_faults_worker as rw

from lightning_mmpar import MultimodalParallelStrategy
from lightning_mmpar.callbacks import DynamicMicroBatching, PipelineTimeline

STEPS = 4
MEMORY_FRACTION = 0.95


class Sizes(Callback):
    """The logged ``micro_batch_size`` and ``num_micro_batches`` of every step."""

    def __init__(self) -> None:
        self.logged: list[tuple[float, float]] = []

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, *args: Any) -> None:
        m = trainer.callback_metrics
        self.logged.append((float(m["micro_batch_size"]), float(m["num_micro_batches"])))


def _strategy() -> MultimodalParallelStrategy:
    return MultimodalParallelStrategy(pipeline_parallel=2, micro_batches=2, schedule="1f1b")


def world(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """The static and the dynamic run on this rank (PNGs and JSON under ``root``)."""
    digits = rw.digits()
    data = rw.batches(digits, STEPS)
    out: dict[str, Any] = {}
    start = time.perf_counter()
    timeline = PipelineTimeline(steps=[1, 2, 3], path=Path(root) / "static.png")
    rec = rw.fit(
        rw.tiny_module(digits.vocab_size), data, strategy=_strategy(), devices=world_size,
        callbacks=[timeline],
    )  # fmt: skip
    out["static"] = {"losses": rec.losses, "timeline": timeline.results}
    out["static_s"] = time.perf_counter() - start
    start = time.perf_counter()
    micro = DynamicMicroBatching(
        every_n_steps=1, patience=2, memory_source=lambda: (MEMORY_FRACTION, 1.0)
    )
    timeline = PipelineTimeline(steps=[2, 3], path=Path(root) / "dynamic.png")
    sizes = Sizes()
    rec = rw.fit(
        rw.tiny_module(digits.vocab_size), data, strategy=_strategy(), devices=world_size,
        callbacks=[micro, timeline, sizes],
    )  # fmt: skip
    out["dynamic"] = {
        "losses": rec.losses,
        "timeline": timeline.results,
        "decisions": micro.decisions,
        "watched": sorted(micro.modules),
        "logged": sizes.logged,
    }
    out["dynamic_s"] = time.perf_counter() - start
    return out
