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

import json
import time
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, Trainer

from lightning_mmpar import MultimodalParallelStrategy
from lightning_mmpar.callbacks import DynamicMicroBatching, PipelineTimeline
from lightning_mmpar.callbacks.pipeline_timeline import last_pass
from tests.recipes import recipe_faults_worker as rw

STEPS = 4
RTOL = 1e-5
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
        rw.tiny_module(digits.vocab_size),
        data,
        strategy=_strategy(),
        devices=world_size,
        callbacks=[timeline],
    )
    out["static"] = {"losses": rec.losses, "timeline": timeline.results}
    out["static_s"] = time.perf_counter() - start
    start = time.perf_counter()
    micro = DynamicMicroBatching(
        every_n_steps=1, patience=2, memory_source=lambda: (MEMORY_FRACTION, 1.0)
    )
    timeline = PipelineTimeline(steps=[2, 3], path=Path(root) / "dynamic.png")
    sizes = Sizes()
    rec = rw.fit(
        rw.tiny_module(digits.vocab_size),
        data,
        strategy=_strategy(),
        devices=world_size,
        callbacks=[micro, timeline, sizes],
    )
    out["dynamic"] = {
        "losses": rec.losses,
        "timeline": timeline.results,
        "decisions": micro.decisions,
        "watched": sorted(micro.modules),
        "logged": sizes.logged,
    }
    out["dynamic_s"] = time.perf_counter() - start
    return out


def _close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and all(
        abs(a - b) <= RTOL * abs(b) for a, b in zip(got, want, strict=True)
    )


def check_dynamic(results: list[dict[str, Any]]) -> None:
    """The dynamic run's losses equal the static run's and one process's; sizes as decided."""
    digits = rw.digits()
    one = rw.fit(rw.tiny_module(digits.vocab_size), rw.batches(digits, STEPS)).losses
    for rank, result in enumerate(results):
        static, dynamic = result["static"]["losses"], result["dynamic"]["losses"]
        assert _close(dynamic, static), (rank, dynamic, static)
        assert _close(dynamic, one), (rank, dynamic, one)
        assert [d["applied"] for d in result["dynamic"]["decisions"]] == [None, 2, None, None]
        assert [d["policy_size"] for d in result["dynamic"]["decisions"]] == [2] * STEPS
        assert result["dynamic"]["logged"] == [(4.0, 2.0), (4.0, 2.0), (2.0, 4.0), (2.0, 4.0)]
    # the adapter lives on one stage: only its rank measures a latency; both decide alike
    watched = [r["dynamic"]["watched"] for r in results]
    assert watched[0] == watched[1] and watched[0], watched
    lat = [[d["latency_ms"] for d in r["dynamic"]["decisions"]] for r in results]
    assert lat[0] == lat[1] and all(x > 0 for x in lat[0]), lat
    print(f"\nlosses one process {one}\nstatic {static}\ndynamic {dynamic}\nlatency ms {lat[0]}")


def check_timeline(results: list[dict[str, Any]], root: Path) -> None:
    """An F and a B interval per (stage, micro-batch) per recorded step; bubble in (0, 1)."""
    for name, steps, m in (("static", [1, 2, 3], 2), ("dynamic", [2, 3], 4)):
        timelines = [r[name]["timeline"] for r in results]
        assert timelines[0] == timelines[1]  # gathered over the pipeline group
        assert [t["step"] for t in timelines[0]] == steps
        for t in timelines[0]:
            assert (t["schedule"], t["pp"], t["micro_batches"]) == ("1f1b", 2, m)
            assert abs(t["formula"] - 1 / (m + 1)) < 1e-12
            assert 0.0 < t["measured"] < 1.0 and 0.0 < t["measured_step"] < 1.0, t
            split = t["split"]  # the bubble: waits, posting, host work, fill / drain
            assert split["wait"] > 0.0 and split["host"] >= 0.0, split
            assert split["post"] > 0.0, split  # sends / receives posted (post observers)
            assert split["outside"] > 0.0, split  # the last stage's rank drains first (1F1B)
            bubble = split["wait"] + split["post"] + split["host"] + split["outside"]
            assert abs(bubble - t["measured"]) < 1e-9, (split, t)
            for stage, rank in enumerate(t["intervals"]):
                seen = {(i[0], i[1], i[2]) for i in last_pass([tuple(i) for i in rank])}
                acts = ("forward", "backward", "loss") if stage == 1 else ("forward", "backward")
                want = {(stage, a, mb) for a in acts for mb in range(m)}  # the loss: stage 1's
                assert seen == want, (name, t["step"], stage, seen)
            assert 0.0 <= t["stage_cost"] < 1.0, t  # the bubble at these stage costs
            print(
                f"{name} step {t['step']} m={m}: bubble measured {t['measured']:.3f} (whole "
                f"step {t['measured_step']:.3f}; wait {split['wait']:.3f}, post "
                f"{split['post']:.3f}, host "
                f"{split['host']:.3f}, outside {split['outside']:.3f}), formula "
                f"{t['formula']:.3f}, at the stage costs "
                f"{t['stage_cost']:.3f}, span {1e3 * t['span_s']:.1f} ms"
            )
        png = root / f"{name}.png"
        assert png.stat().st_size > 1000
        assert json.loads(png.with_suffix(".json").read_text())[-1]["step"] == steps[-1]
    print(f"world: static {results[0]['static_s']:.1f} s, dynamic {results[0]['dynamic_s']:.1f} s")
