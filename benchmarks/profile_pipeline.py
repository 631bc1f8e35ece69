"""Where a pipeline step's time goes: compute, send/recv wait, loss and host work, per rank.

    python benchmarks/profile_pipeline.py    # pp2: 1f1b, interleaved_1f1b, zbv, dualpipev
    python benchmarks/profile_pipeline.py --schedules 1f1b --steps 8 --repeats 3
    python benchmarks/profile_pipeline.py --partition fixed --unpacked   # packed vs unpacked

The model and data of ``benchmarks/bench_pipeline.py`` (``recipes/clip_llama_cpu.yaml``, batch
72, 4 micro-batches, ``partition="measured"`` unless ``--partition`` says otherwise; ``fixed``:
:data:`FIXED`), one spawned 2-process gloo world per schedule and repeat (``--unpacked``: also
each schedule with ``PipelineEngine.pack_boundaries = False``, round-robin), one thread per
process. On every step after the first two, each rank splits the span of the training
schedule (first action start to last action end over both ranks, clocks aligned by a barrier
at the batch start: what :class:`~lightning_mmpar.callbacks.PipelineTimeline` measures) into:

* ``compute``: the stage actions (forward, backward, input / weight backward);
* ``wait``: torch's point-to-point waits (the engine's ``wait_observers``): the peer's lateness
  plus the gloo transfer;
* ``post``: posting the sends and receives (torch's ``_batch_p2p``);
* ``loss``: the loss on the last stage (torch's ``_maybe_compute_loss``, the engine's
  ``_loss_fn``);
* ``host``: the rest (the schedule's bookkeeping between actions).

The bubble is ``wait + post + host`` (what :class:`~lightning_mmpar.callbacks.PipelineTimeline`
reports as its ``wait`` and ``host``): the loss and the tail of the gradient cache's
forward-only pass (``earlier_pass``) are the ranks' work.

Each as a share of the span (wall clock) and as CPU milliseconds of the process
(``time.thread_time``): on a shared machine a descheduled process stretches every wall figure,
the CPU figures are what the work costs. ``cpu/wall`` of the actions says how much of a core the
process got. Prints the medians over all measured steps of all repeats, next to the formula.
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
Event = tuple[str, float, float, float, float]
"""(kind, wall start, wall end, cpu start, cpu end), seconds."""


class Recorder(Callback):
    """Every timed region of the measured steps on this rank, and the engine's observers."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.steps: list[list[Event]] = []
        self.current: list[Event] | None = None

    def add(self, kind: str, start: float, end: float, c0: float = 0.0, c1: float = 0.0) -> None:
        if self.current is not None:
            self.current.append((kind, start, end, c0, c1))

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        engine = trainer.strategy.pipeline
        engine.wait_observers.append(lambda a, b: self.add("wait", a, b))

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step >= self.warmup:
            torch.distributed.barrier()  # a common origin on both ranks
            now, cpu = time.perf_counter(), time.thread_time()
            self.current = [("batch_start", now, now, cpu, cpu)]

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if self.current is not None:
            now, cpu = time.perf_counter(), time.thread_time()
            self.current.append(("batch_end", now, now, cpu, cpu))
            self.steps.append(self.current)
            self.current = None


def _timed(fn: Callable[..., Any], kind: str | None, rec: Recorder) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            name = kind or f"compute:{fn.__name__}:{args[0].stage_index}:{args[1]}"
            rec.add(name, start, time.perf_counter(), cpu, time.thread_time())

    return wrapper


def _patch(rec: Recorder) -> None:
    from torch.distributed.pipelining import schedules as ts
    from torch.distributed.pipelining.stage import _PipelineStageBase as base

    ts._PipelineSchedule._maybe_compute_loss = _timed(
        ts._PipelineSchedule._maybe_compute_loss, "loss", rec
    )
    ts._batch_p2p = _timed(ts._batch_p2p, "post", rec)
    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        setattr(base, name, _timed(getattr(base, name), None, rec))


FIXED = {1: [6], 2: [2, 6, 7]}
"""``--partition fixed``: the cuts ``measured`` takes on a quiet core (pp 2, by stages per
rank), so that configurations compared in one run have the same stages."""


def run(
    rank: int, size: int, schedule: str, steps: int, partition: str, packed: bool = True
) -> list[list[Event]]:
    from lightning_mmpar import MultimodalParallelStrategy
    from lightning_mmpar.parallel.pipeline import PipelineEngine
    from lightning_mmpar.recipes.partition import build_module
    from lightning_mmpar.testing import quiet_trainer

    torch.set_num_threads(1)
    PipelineEngine.pack_boundaries = packed
    cut: str | list[int] = FIXED[SCHEDULES[schedule]] if partition == "fixed" else partition
    config = yaml.safe_load(YAML.read_text())
    seed_everything(0, verbose=False)
    module, data = build_module(config, meta=False)
    strategy = MultimodalParallelStrategy(
        pipeline_parallel=2,
        virtual_pipeline=SCHEDULES[schedule],
        schedule=schedule,
        partition=cut,
        micro_batches=4,
    )
    rec = Recorder(warmup=2)
    _patch(rec)
    trainer = quiet_trainer(
        devices=size, strategy=strategy, max_steps=steps, limit_val_batches=0, callbacks=[rec]
    )
    trainer.fit(module, datamodule=data)
    return rec.steps


def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _actions(events: list[Event]) -> list[tuple[int, str, int, float, float]]:
    from lightning_mmpar.callbacks.pipeline_timeline import last_pass

    out = []
    for kind, a, b, _, _ in events:
        if kind.startswith("compute:"):
            _, action, stage, mb = kind.split(":")
            out.append((int(stage), action, int(mb), a, b))
    return last_pass(out)


def decompose(per_rank: list[list[Event]]) -> dict[str, Any]:
    """One step: per rank, wall shares of the training schedule's span and CPU ms in it."""
    passes = [_actions(ev) for ev in per_rank]
    t0 = [next(e[1] for e in ev if e[0] == "batch_start") for ev in per_rank]
    start = min(i[3] - t for p, t in zip(passes, t0, strict=True) for i in p)
    end = max(i[4] - t for p, t in zip(passes, t0, strict=True) for i in p)
    span = end - start
    rows = []
    for ev, p, t in zip(per_rank, passes, t0, strict=True):
        lo, hi = start + t, end + t
        inside = [e for e in ev if e[1] >= lo - 1e-9 and e[2] <= hi + 1e-9]
        acts = [e for e in inside if e[0].startswith("compute:")]
        mine = {(i[3], i[4]) for i in p}
        earlier = [e for e in acts if (e[1], e[2]) not in mine]  # the cache pass's tail

        def wall(kind: str, inside: list[Event] = inside) -> float:
            return sum(e[2] - e[1] for e in inside if e[0] == kind)

        def cpu(kind: str, inside: list[Event] = inside) -> float:
            return sum(e[4] - e[3] for e in inside if e[0] == kind)

        busy = _union([(i[3], i[4]) for i in p])
        a_cpu = sum(e[4] - e[3] for e in acts)
        timed = [e for e in inside if e[4] > 0]
        c_all = max(e[4] for e in timed) - min(e[3] for e in timed)
        row = {
            "compute": busy / span,
            "earlier_pass": sum(e[2] - e[1] for e in earlier) / span,
            "wait": wall("wait") / span,
            "post": wall("post") / span,
            "loss": wall("loss") / span,
        }
        row["host"] = 1 - sum(row.values())
        row.update(
            compute_cpu_ms=1e3 * a_cpu,
            fwd_cpu_ms=1e3 * sum(e[4] - e[3] for e in acts if "forward" in e[0]),
            wait_cpu_ms=1e3 * cpu("wait"),
            post_cpu_ms=1e3 * cpu("post"),
            loss_cpu_ms=1e3 * cpu("loss"),
            host_cpu_ms=1e3 * (c_all - a_cpu - cpu("wait") - cpu("post") - cpu("loss")),
            core_share=a_cpu / max(sum(e[2] - e[1] for e in acts), 1e-9),
            earlier_actions=len(earlier),
            actions=len(acts),
        )
        rows.append(row)
    work = ("compute", "earlier_pass", "loss")  # as PipelineTimeline: the loss is work
    bubble = sum(1 - sum(r[k] for k in work) for r in rows) / len(rows)
    return {"bubble": bubble, "span_ms": 1e3 * span, "ranks": rows}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from lightning_mmpar.callbacks.pipeline_timeline import formula_bubble
    from lightning_mmpar.testing import spawn

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schedules", default=",".join(SCHEDULES))
    p.add_argument("--steps", type=int, default=8, help="steps per run (2 warm-up)")
    p.add_argument("--repeats", type=int, default=1, help="runs per schedule (round-robin)")
    p.add_argument(
        "--partition", default="measured", help="the strategy's partition=, or 'fixed' (FIXED)"
    )
    p.add_argument(
        "--unpacked",
        action="store_true",
        help="also run each schedule with PipelineEngine.pack_boundaries = False (round-robin)",
    )
    args = p.parse_args(argv)
    names = args.schedules.split(",")
    if args.unpacked:
        names = [f"{n}{tail}" for n in names for tail in ("", " unpacked")]
    steps: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for _ in range(args.repeats):
        for name in names:
            schedule, packed = name.split(" ")[0], not name.endswith(" unpacked")
            out = spawn(run, 2, schedule, args.steps, args.partition, packed, timeout=900)
            steps[name] += [decompose([out[0][i], out[1][i]]) for i in range(len(out[0]))]
    report: dict[str, Any] = {}
    for name in names:
        rows = steps[name]
        schedule = name.split(" ")[0]
        formula = formula_bubble(schedule, 2, 4, SCHEDULES[schedule])
        med = {
            "bubble": statistics.median(s["bubble"] for s in rows),
            "span_ms": statistics.median(s["span_ms"] for s in rows),
            "ranks": [
                {k: statistics.median(s["ranks"][r][k] for s in rows) for k in rows[0]["ranks"][r]}
                for r in range(2)
            ],
        }
        report[name] = {"formula": formula, "steps": len(rows), **med}
        print(
            f"== {name}: bubble {med['bubble']:.3f} (formula {formula:.3f}), span "
            f"{med['span_ms']:.1f} ms, {len(rows)} steps"
        )
        for r, row in enumerate(med["ranks"]):
            print(f"  rank {r}: " + " ".join(f"{k} {v:.3f}" for k, v in row.items()))
        sys.stdout.flush()
    return report


if __name__ == "__main__":
    main()
