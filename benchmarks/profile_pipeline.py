"""Where a pipeline step's time goes: compute, send/recv wait, loss and host work, per rank.

    python benchmarks/profile_pipeline.py               # pp2: 1f1b, interleaved_1f1b, zbv, dualpipev
    python benchmarks/profile_pipeline.py --schedules 1f1b --steps 6

The model and data of ``benchmarks/bench_pipeline.py`` (``recipes/clip_llama_cpu.yaml``, batch
72, 4 micro-batches, ``partition="balanced"``), one spawned 2-process gloo world, one thread
per process. On every step after the first two, each rank splits the span of the training
schedule (first action start to last action end over both ranks, as
:class:`~lightning_mmpar.callbacks.PipelineTimeline` measures it) into:

* ``compute``: the stage actions (forward, backward, input / weight backward);
* ``wait``: torch's point-to-point waits (``_wait_batch_p2p``), i.e. the peer's lateness plus
  the gloo transfer;
* ``loss``: the loss on the last stage (torch's ``_maybe_compute_loss``: the engine's
  ``_loss_fn``);
* ``host``: the rest (the schedule's own bookkeeping between actions).

Prints medians over the measured steps of ``(idle share, wait, loss, host)`` as fractions of
the span, next to the PipelineTimeline bubble and the formula; ``--profile`` also writes the
torch profiler's table of the last step (self CPU time per op) to stdout.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml
from lightning.pytorch import Callback, seed_everything

ROOT = Path(__file__).resolve().parents[1]
YAML = ROOT / "recipes" / "clip_llama_cpu.yaml"
SCHEDULES = {"1f1b": 1, "interleaved_1f1b": 2, "zbv_zero_bubble": 2, "dualpipev": 2}


class Recorder(Callback):
    """Per step: (kind, start, end) of every timed region on this rank (perf_counter)."""

    def __init__(self, warmup: int, profile: bool) -> None:
        self.warmup, self.profile = warmup, profile
        self.steps: list[list[tuple[str, float, float]]] = []
        self.current: list[tuple[str, float, float]] | None = None
        self.table = ""
        self._prof: Any = None

    def add(self, kind: str, start: float, end: float) -> None:
        if self.current is not None:
            self.current.append((kind, start, end))

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step >= self.warmup:
            self.current = []
            last = trainer.global_step == trainer.max_steps - 1
            if self.profile and last:
                self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                self._prof.__enter__()
            torch.distributed.barrier()  # a common origin on both ranks
            self.current.append(("batch_start", time.perf_counter(), time.perf_counter()))

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if self.current is not None:
            self.current.append(("batch_end", time.perf_counter(), time.perf_counter()))
            self.steps.append(self.current)
            self.current = None
            if self._prof is not None:
                self._prof.__exit__(None, None, None)
                self.table = self._prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
                self._prof = None


def _timed(fn: Callable[..., Any], kind: str, rec: Recorder) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            rec.add(kind, start, time.perf_counter())

    return wrapper


def _patch(rec: Recorder) -> None:
    from torch.distributed.pipelining import schedules as ts

    ts._wait_batch_p2p = _timed(ts._wait_batch_p2p, "wait", rec)
    ts._PipelineSchedule._maybe_compute_loss = _timed(
        ts._PipelineSchedule._maybe_compute_loss, "loss", rec
    )
    ts._batch_p2p = _timed(ts._batch_p2p, "post", rec)
    from torch.distributed.pipelining.stage import _PipelineStageBase as base

    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        setattr(base, name, _cpu_timed(getattr(base, name), rec))


def _cpu_timed(fn: Callable[..., Any], rec: Recorder) -> Callable[..., Any]:
    """Record the action's CPU time (this thread) as ``cpu:<ms>`` over its wall interval."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            rec.add(f"cpu:{time.thread_time() - cpu}", start, time.perf_counter())

    return wrapper


def run(rank: int, size: int, schedule: str, steps: int, profile: bool) -> list[Any]:
    from lightning_mmpar import MultimodalParallelStrategy
    from lightning_mmpar.recipes.partition import build_module
    from lightning_mmpar.testing import quiet_trainer

    torch.set_num_threads(1)
    config = yaml.safe_load(YAML.read_text())
    seed_everything(0, verbose=False)
    module, data = build_module(config, meta=False)
    v = SCHEDULES[schedule]
    strategy = MultimodalParallelStrategy(
        pipeline_parallel=2,
        virtual_pipeline=v,
        schedule=schedule,
        partition="balanced",
        micro_batches=4,
    )
    rec = Recorder(warmup=2, profile=profile and rank == 0)
    _patch(rec)

    class Observe(Callback):
        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            trainer.strategy.pipeline.observers.append(
                lambda s, a, mb, t0, t1: rec.add(f"compute:{a}:{s}:{mb}", t0, t1)
            )

    trainer = quiet_trainer(
        devices=size, strategy=strategy, max_steps=steps, limit_val_batches=0,
        callbacks=[rec, Observe()],
    )
    trainer.fit(module, datamodule=data)
    return [rec.steps, rec.table]


from lightning_mmpar.callbacks.pipeline_timeline import last_pass  # noqa: E402


def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def decompose(per_rank: list[list[tuple[str, float, float]]]) -> dict[str, Any]:
    """One step: per rank, shares of the schedule span (clocks aligned at the batch start)."""
    aligned = []
    for events in per_rank:
        t0 = next(e[1] for e in events if e[0] == "batch_start")
        aligned.append([(k, a - t0, b - t0) for k, a, b in events])
    passes = [
        last_pass([(int(k.split(":")[2]), k.split(":")[1], int(k.split(":")[3]), a, b)
                   for k, a, b in ev if k.startswith("compute")])
        for ev in aligned
    ]
    comp = [[(i[3], i[4]) for i in p] for p in passes]
    start = min(a for c in comp for a, _ in c)
    end = max(b for c in comp for _, b in c)
    span = end - start
    rows = []
    for ev, c, p in zip(aligned, comp, passes, strict=True):
        busy = _union(c)
        inside = [(k, max(a, start), min(b, end)) for k, a, b in ev]
        wait = sum(b - a for k, a, b in inside if k == "wait" and b > a)
        cpu = sum(float(k[4:]) for k, a, b in ev if k.startswith("cpu:") and a >= start - 1e-6)
        post = sum(b - a for k, a, b in inside if k == "post" and b > a)
        loss = sum(b - a for k, a, b in inside if k == "loss" and b > a)
        idle = span - busy
        step = next(b for k, a, b in ev if k == "batch_end")
        rows.append({
            "idle": idle / span, "wait": wait / span, "post": post / span, "loss": loss / span,
            "host": (idle - wait - loss - post) / span, "busy": busy / span, "cpu": cpu / span,
            "fwd": sum(i[4] - i[3] for i in p if i[1] == "forward") / span,
            "bwd": sum(i[4] - i[3] for i in p if i[1] != "forward") / span,
            "n_actions": len(c), "span_ms": span * 1e3, "step_ms": step * 1e3,
            "before_ms": start * 1e3, "after_ms": (step - end) * 1e3,
        })
    return {"bubble": sum(r["idle"] for r in rows) / len(rows), "ranks": rows, "span": span}


def main(argv: list[str] | None = None) -> None:
    from lightning_mmpar.callbacks.pipeline_timeline import formula_bubble
    from lightning_mmpar.testing import spawn

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schedules", default=",".join(SCHEDULES))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args(argv)
    for schedule in args.schedules.split(","):
        out = spawn(run, 2, schedule, args.steps, args.profile, timeout=900)
        steps = [decompose([out[r][0][i] for r in range(2)]) for i in range(len(out[0][0]))]
        med = lambda f: statistics.median(f(s) for s in steps)  # noqa: E731
        formula = formula_bubble(schedule, 2, 4, SCHEDULES[schedule])
        print(f"== {schedule}: bubble {med(lambda s: s['bubble']):.3f} (formula {formula:.3f}),"
              f" {len(steps)} steps")
        for r in range(2):
            keys = ("idle", "wait", "post", "loss", "host", "busy", "cpu", "fwd", "bwd", "span_ms", "step_ms", "before_ms", "after_ms", "n_actions")
            print(f"  rank {r}: " + " ".join(f"{k} {med(lambda s: s['ranks'][r][k]):.3f}" for k in keys))
        if args.profile:
            print(out[0][1])
        sys.stdout.flush()


if __name__ == "__main__":
    main()


def dump(schedule: str = "1f1b", steps: int = 4) -> None:
    from lightning_mmpar.testing import spawn

    out = spawn(run, 2, schedule, steps, False, timeout=900)
    for r in range(2):
        ev = out[r][0][-1]
        t0 = next(e[1] for e in ev if e[0] == "batch_start")
        print(f"rank {r}")
        for k, a, b in sorted(ev, key=lambda e: e[1]):
            print(f"   {k:28} {1e3 * (a - t0):8.2f} {1e3 * (b - t0):8.2f} {1e3 * (b - a):7.2f}")
