"""Where a pipeline step's time goes: compute, send/recv wait, loss and host work, per rank.

    python benchmarks/profile_pipeline.py    # pp2: 1f1b, interleaved_1f1b, zbv, dualpipev
    python benchmarks/profile_pipeline.py --schedules 1f1b --steps 8 --repeats 3
    python benchmarks/profile_pipeline.py --partition fixed --unpacked   # packed vs unpacked
    python benchmarks/profile_pipeline.py --model equal   # bench_pipeline's EqualBlocks
    python benchmarks/profile_pipeline.py --split-backward   # B + W against one fused backward
    python benchmarks/profile_pipeline.py --model equal --schedules interleaved_1f1b --torch-loop
    python benchmarks/profile_pipeline.py --schedules interleaved_1f1b,dualpipev --lean-ab 100

The model and data of ``benchmarks/bench_pipeline.py`` (``recipes/clip_llama_cpu.yaml``, batch
72, 4 micro-batches, ``partition="measured"`` unless ``--partition`` says otherwise; ``fixed``:
:data:`FIXED`), one spawned 2-process gloo world per schedule and repeat (``--unpacked``: also
each schedule with ``PipelineEngine.pack_boundaries = False``, round-robin; ``--torch-loop``:
also each with ``PipelineEngine.lean_runtime = False``, torch's own action loop), one thread per
process (``--model equal``: :class:`bench_pipeline.EqualBlocks`, 8 equal blocks, ``partition
"equal"``, stages of equal work). On every step after the first two, each rank splits the span
of the training schedule (first action start to last action end over both ranks, clocks
aligned by a barrier at the batch start: what
:class:`~lightning_mmpar.callbacks.PipelineTimeline` measures) into:

* ``compute``: the stage actions (forward, backward, input / weight backward);
* ``wait``: torch's point-to-point waits (the engine's ``wait_observers``): the peer's lateness
  plus the gloo transfer;
* ``post``: posting the sends and receives (torch's ``_batch_p2p``);
* ``loss``: the loss on the last stage (torch's ``_maybe_compute_loss``, the engine's
  ``_loss_fn``);
* ``outside``: the span before the rank's first action, loss or wait and after its last (fill
  and drain spent outside torch's waits: the last stage's rank, done first, waits in the
  step's loss broadcast);
* ``host``: the rest (the schedule's bookkeeping between actions).

Python's garbage collections inside the span are counted too (``collections``, ``gc_ms``,
``gc_in_actions_ms``: a collection pauses the thread wherever an allocation triggers it).

The bubble is ``wait + post + host + outside`` (what
:class:`~lightning_mmpar.callbacks.PipelineTimeline` reports as its ``wait``, ``post``,
``host`` and ``outside``): the loss and the tail of the gradient cache's forward-only pass
(``earlier_pass``) are the ranks' work.

Each as a share of the span (wall clock) and as CPU milliseconds of the process
(``time.thread_time``): on a shared machine a descheduled process stretches every wall figure,
the CPU figures are what the work costs. ``cpu/wall`` of the actions says how much of a core the
process got. Prints the medians over all measured steps of all repeats, next to the formula.

The same steps are also recorded by :class:`~lightning_mmpar.callbacks.PipelineTimeline`; its
per-rank split (``compute``, ``wait``, ``post``, ``host``, ``outside``) is printed next to
the profile's (``compute + earlier_pass + loss``, ``wait``, ``post``, ``host``, ``outside``) with
the largest difference over the steps and ranks (``timeline vs profile``): both time the same
intervals, so they agree to the timers' own overhead, which includes this profile's CPU clock
reads (``--wall-only`` leaves them out, see :data:`CPU_CLOCK`).

``--split-backward`` times, on one process and one thread, one stage's fused backward (torch's
``stage_backward``) against its zero-bubble split (``stage_backward_input`` then
``stage_backward_weight``, what ZBV / DualPipeV run) for the stages of ``--model`` (alternated,
CPU time, medians): where ``I + W`` costs more than the fused ``B``, the split schedules pay it
on every micro-batch whatever the engine does.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml
from lightning.pytorch import Callback, seed_everything
from torch import Tensor

sys.path.insert(0, str(Path(__file__).parent))
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
        gc.callbacks.append(self._gc)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        gc.callbacks.remove(self._gc)

    def _gc(self, phase: str, info: dict[str, Any]) -> None:
        """Python's garbage collections: ``gc<generation>`` events (they pause the thread
        wherever an allocation triggers them, inside an action or between actions)."""
        now, cpu = time.perf_counter(), _cpu()
        if phase == "start":
            self._gc_start = (now, cpu)
        elif self.current is not None:
            self.add(f"gc{info['generation']}", self._gc_start[0], now, self._gc_start[1], cpu)

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step >= self.warmup:
            torch.distributed.barrier()  # a common origin on both ranks
            now, cpu = time.perf_counter(), _cpu()
            self.current = [("batch_start", now, now, cpu, cpu)]

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if self.current is not None:
            now, cpu = time.perf_counter(), _cpu()
            self.current.append(("batch_end", now, now, cpu, cpu))
            self.steps.append(self.current)
            self.current = None


CPU_CLOCK = [True]
"""Read the thread's CPU clock around every timed region (``--wall-only``: no). Each read is
a system call on this machine, and under load the process can be descheduled in it: the
nested :class:`PipelineTimeline` wrapper then counts milliseconds the profile's does not."""


def _cpu() -> float:
    return time.thread_time() if CPU_CLOCK[0] else 1.0  # 1.0: "timed", no CPU time


def _timed(fn: Callable[..., Any], kind: str | None, rec: Recorder) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start, cpu = time.perf_counter(), _cpu()
        try:
            return fn(*args, **kwargs)
        finally:
            name = kind or f"compute:{fn.__name__}:{args[0].stage_index}:{args[1]}"
            rec.add(name, start, time.perf_counter(), cpu, _cpu())

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


def _module(model: str, steps: int) -> tuple[Any, dict[str, Any]]:
    """The LightningModule of ``--model`` and the ``fit`` keyword arguments of its data."""
    if model == "equal":
        from bench_pipeline import EqualBlocks, equal_blocks_data

        return EqualBlocks(), {"train_dataloaders": equal_blocks_data(steps)}
    from lightning_mmpar.recipes.partition import build_module

    module, data = build_module(yaml.safe_load(YAML.read_text()), meta=False)
    return module, {"datamodule": data}


def run(
    rank: int,
    size: int,
    schedule: str,
    steps: int,
    partition: str,
    packed: bool = True,
    model: str = "recipe",
    cpu_clock: bool = True,
    lean: bool = True,
) -> dict[str, Any]:
    """One profiled run: ``events`` (the profile's, per measured step) and ``timeline`` (the
    :class:`PipelineTimeline` split of the same steps)."""
    from lightning_mmpar import MultimodalParallelStrategy
    from lightning_mmpar.callbacks import PipelineTimeline
    from lightning_mmpar.parallel.pipeline import PipelineEngine
    from lightning_mmpar.testing import quiet_trainer

    torch.set_num_threads(1)
    CPU_CLOCK[0] = cpu_clock
    PipelineEngine.pack_boundaries = packed
    PipelineEngine.lean_runtime = lean
    cut: str | list[int] = FIXED[SCHEDULES[schedule]] if partition == "fixed" else partition
    seed_everything(0, verbose=False)
    module, fit = _module(model, steps)
    strategy = MultimodalParallelStrategy(
        pipeline_parallel=2,
        virtual_pipeline=SCHEDULES[schedule],
        schedule=schedule,
        partition=cut,
        micro_batches=4,
    )
    rec = Recorder(warmup=2)
    _patch(rec)
    with tempfile.TemporaryDirectory() as root:
        timeline = PipelineTimeline(steps=list(range(2, steps)), path=Path(root) / "t.png")
        trainer = quiet_trainer(
            devices=size,
            strategy=strategy,
            max_steps=steps,
            limit_val_batches=0,
            callbacks=[rec, timeline],
        )
        trainer.fit(module, **fit)
    return {
        "events": rec.steps,
        "timeline": [r["split"]["ranks"] for r in timeline.results],
        "intervals": [r["intervals"] for r in timeline.results],
    }


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


def _inside_actions(events: list[Event], lo: float, hi: float) -> float:
    """Seconds of the garbage collections in ``[lo, hi]`` that ran inside a stage action."""
    acts = [(e[1], e[2]) for e in events if e[0].startswith("compute:")]
    return sum(
        max(0.0, min(e[2], hi) - max(e[1], lo))
        for e in events
        if e[0].startswith("gc") and any(a <= e[1] and e[2] <= b for a, b in acts)
    )


def _bounds(events: list[Event], lo: float, hi: float) -> tuple[float, float]:
    """This rank's first action, loss or wait start and its last one's end inside ``[lo, hi]``
    (``(hi, hi)`` without any); outside them is the rank's ``outside``, as
    :func:`~lightning_mmpar.callbacks.pipeline_timeline.bubble_split`'s (a post there too)."""
    kept = ("wait", "loss")
    spans = [(max(e[1], lo), min(e[2], hi)) for e in events if e[0] in kept or ":" in e[0]]
    spans = [(a, b) for a, b in spans if b > a]
    if not spans:
        return hi, hi
    return min(a for a, _ in spans), max(b for _, b in spans)


def decompose(per_rank: list[list[Event]], origins: list[float] | None = None) -> dict[str, Any]:
    """One step: per rank, wall shares of the training schedule's span and CPU ms in it.
    ``origins``: each rank's clock origin (default its post-barrier batch start)."""
    passes = [_actions(ev) for ev in per_rank]
    t0 = origins or [next(e[1] for e in ev if e[0] == "batch_start") for ev in per_rank]
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

        def clipped(e: Event, lo: float = lo, hi: float = hi) -> float:
            return max(0.0, min(e[2], hi) - max(e[1], lo))

        def wall(kind: str, ev: list[Event] = ev) -> float:  # clipped to the span, as the
            return sum(clipped(e) for e in ev if e[0] == kind)  # timeline's

        def cpu(kind: str, inside: list[Event] = inside) -> float:
            return sum(e[4] - e[3] for e in inside if e[0] == kind)

        busy = _union([(i[3], i[4]) for i in p])
        first, last = _bounds(ev, lo, hi)
        a_cpu = sum(e[4] - e[3] for e in acts)
        timed = [e for e in inside if e[4] > 0]
        c_all = max(e[4] for e in timed) - min(e[3] for e in timed)
        row = {
            "compute": busy / span,
            "earlier_pass": sum(
                clipped(e) for e in ev if e[0].startswith("compute:") and (e[1], e[2]) not in mine
            )
            / span,
            "wait": wall("wait") / span,
            "post": sum(clipped(e, first, last) for e in ev if e[0] == "post") / span,
            "loss": wall("loss") / span,
            "outside": (first - lo + hi - last) / span,
        }
        row["host"] = 1 - sum(row.values())
        row.update(
            compute_cpu_ms=1e3 * a_cpu,
            fwd_cpu_ms=1e3 * sum(e[4] - e[3] for e in acts if "forward" in e[0]),
            wait_cpu_ms=1e3 * cpu("wait"),
            post_cpu_ms=1e3 * cpu("post"),
            loss_cpu_ms=1e3 * cpu("loss"),
            host_cpu_ms=1e3 * (c_all - a_cpu - cpu("wait") - cpu("post") - cpu("loss")),
            gc_ms=1e3 * sum(clipped(e) for e in ev if e[0].startswith("gc")),
            gc_in_actions_ms=1e3 * _inside_actions(ev, lo, hi),
            collections=sum(1 for e in ev if e[0].startswith("gc") and clipped(e) > 0),
            core_share=a_cpu / max(sum(e[2] - e[1] for e in acts), 1e-9),
            earlier_actions=len(earlier),
            actions=len(acts),
        )
        rows.append(row)
    work = ("compute", "earlier_pass", "loss")  # as PipelineTimeline: the loss is work
    bubble = sum(1 - sum(r[k] for k in work) for r in rows) / len(rows)
    return {"bubble": bubble, "span_ms": 1e3 * span, "ranks": rows}


def timeline_origins(per_rank: list[list[Event]], intervals: list[list[Any]]) -> list[float]:
    """Each rank's clock origin as :class:`PipelineTimeline` had it in one step (its own barrier
    at the batch start, after the profile's): the profile's first action start minus the
    timeline's (the same action, timed by two wrappers a few microseconds apart). Two barriers
    release the ranks apart by different amounts (on a loaded machine by milliseconds), so the
    split is compared on one clock alignment."""
    origins = []
    for ev, rank in zip(per_rank, intervals, strict=True):
        first = min(e[1] for e in ev if e[0].startswith("compute:"))
        origins.append(first - min(i[3] for i in rank))
    return origins


def timeline_agreement(profile: dict[str, Any], timeline: list[dict[str, float]]) -> float:
    """Largest ``|timeline - profile|`` of one step over the ranks and the three parts:
    ``compute`` against the profile's ``compute + earlier_pass + loss``, ``wait``, ``post``,
    ``host`` and ``outside`` against the same parts (fractions of the span)."""
    worst = 0.0
    for mine, theirs in zip(profile["ranks"], timeline, strict=True):
        parts = {
            "compute": mine["compute"] + mine["earlier_pass"] + mine["loss"],
            "wait": mine["wait"],
            "post": mine["post"],
            "host": mine["host"],
            "outside": mine["outside"],
        }
        worst = max(worst, *(abs(parts[k] - theirs[k]) for k in parts))
    return worst


def _split_times(chunk: Any, x: tuple[Tensor, ...], reps: int) -> dict[str, float]:
    """Median CPU ms of one forward, fused backward, input backward and weight backward of
    ``chunk`` on ``x`` (inputs that carry gradients), alternated."""
    from torch.distributed.pipelining._backward import (
        stage_backward,
        stage_backward_input,
        stage_backward_weight,
    )

    times: dict[str, list[float]] = {"F": [], "B": [], "I": [], "W": []}
    for i in range(reps + 2):
        for split in (i % 2 == 0, i % 2 == 1):
            inputs = [t.detach().requires_grad_(t.is_floating_point()) for t in x]
            c0 = time.thread_time()
            out = chunk(*inputs)
            # a copy, as the engine's packed boundary: torch's input backward detaches the
            # outputs in place, and an output may be a tensor the stage passes through
            outs = [o.clone() for o in (out if isinstance(out, tuple) else (out,))]
            c1 = time.thread_time()
            grads = [torch.ones_like(o) if o.requires_grad else None for o in outs]
            keep = [(o, g) for o, g in zip(outs, grads, strict=True) if g is not None]
            o_list, g_list = [o for o, _ in keep], [g for _, g in keep]
            if split:
                _, groups = stage_backward_input(o_list, g_list, inputs, chunk.parameters())
                c2 = time.thread_time()
                stage_backward_weight(chunk.parameters(), groups)
                c3 = time.thread_time()
                spans = {"I": c2 - c1, "W": c3 - c2}
            else:
                stage_backward(o_list, g_list, inputs)
                spans = {"B": time.thread_time() - c1}
            chunk.zero_grad(set_to_none=True)
            if i >= 2:
                times["F"].append(c1 - c0)
                for k, v in spans.items():
                    times[k].append(v)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def split_backward(model: str, reps: int = 30) -> dict[str, dict[str, float]]:
    """:func:`_split_times` of every non-first stage at pp 2 x v 2 (``--model equal``: its 4
    equal stages of 2 blocks; ``recipe``: the cut ``[2, 6, 7]``) on one micro-batch, one thread.
    Returns per stage F, B, I, W (CPU ms) and ``(I + W) / B``."""
    from lightning_mmpar.parallel.pipeline import PipelineChunk
    from lightning_mmpar.parallel.pipeline.schedules import unsplit_parameters

    torch.set_num_threads(1)
    seed_everything(0, verbose=False)
    module, fit = _module(model, 1)
    if model == "equal":
        x, _ = next(iter(fit["train_dataloaders"]))
        mb: tuple[Tensor, ...] = (x[: x.shape[0] // 4],)
        cuts = [0, 2, 4, 6, 8]
    else:
        from lightning_mmpar.testing import quiet_trainer

        module._trainer = quiet_trainer(devices=1)  # configure_model reads its (1-rank) layout
        module.configure_model()
        data = fit["datamodule"]
        data.setup("fit")
        inputs, _ = module.pipeline_inputs(next(iter(data.train_dataloader())))
        mb = tuple(t.tensor_split(4)[0] for t in inputs)
        cuts = [0, *FIXED[2], len(module.pipeline_blocks())]
    blocks = list(module.pipeline_blocks())
    out: dict[str, dict[str, float]] = {}
    with torch.no_grad():
        y = mb
        stage_inputs = []
        for a, b in itertools.pairwise(cuts):
            stage_inputs.append(y)
            r = PipelineChunk(blocks[a:b])(*y)
            y = r if isinstance(r, tuple) else (r,)
    for s, (a, b) in enumerate(itertools.pairwise(cuts)):
        if s == 0 or s == len(cuts) - 2:  # stage 0: no input gradient; last: the loss's stage
            continue
        chunk = PipelineChunk(blocks[a:b])
        x = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in stage_inputs[s])
        y = chunk(*x)
        if unsplit_parameters(x, y if isinstance(y, tuple) else (y,)):
            out[f"stage {s} (blocks {a}-{b - 1})"] = {"unsplit (the engine runs B)": 1.0}
            continue
        t = _split_times(chunk, stage_inputs[s], reps)
        t["(I+W)/B"] = (t["I"] + t["W"]) / t["B"]
        out[f"stage {s} (blocks {a}-{b - 1})"] = t
    return out


def lean_ab(rank: int, size: int, schedule: str, steps: int) -> dict[str, list[float]]:
    """``--lean-ab``: one world of :class:`bench_pipeline.EqualBlocks` at pp 2 (v 2 for the
    multi-stage schedules, m 4) training ``steps`` steps after 3 warm-up ones, alternating
    ``PipelineEngine.lean_runtime`` between steps; CPU ms of each step (``time.thread_time``
    around ``train_step``) under each: the host work the lean runtime removes, A/B in one
    world (the same stages, buffers and connections)."""
    from bench_pipeline import EqualBlocks, equal_blocks_data

    from lightning_mmpar import ParallelConfig
    from lightning_mmpar.parallel.pipeline import PipelineEngine

    torch.manual_seed(0)
    module = EqualBlocks()
    v = SCHEDULES.get(schedule, 2)
    config = ParallelConfig(pipeline_parallel=2, virtual_pipeline=v, schedule=schedule)
    config = dataclasses.replace(config, micro_batches=4)
    engine = PipelineEngine(module, config, torch.distributed.group.WORLD, torch.device("cpu"))
    cpu: dict[str, list[float]] = {"lean": [], "torch loop": []}
    for i, batch in enumerate(equal_blocks_data(steps + 3)):
        engine.lean_runtime = i % 2 == 0
        module.zero_grad(set_to_none=True)
        start = time.thread_time()
        engine.train_step(batch)
        if i >= 3:
            cpu["lean" if engine.lean_runtime else "torch loop"].append(
                1e3 * (time.thread_time() - start)
            )
    return cpu


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
    p.add_argument(
        "--torch-loop",
        action="store_true",
        help="also run each schedule with PipelineEngine.lean_runtime = False (torch's own "
        "action loop for the multi-stage schedules), round-robin",
    )
    p.add_argument(
        "--lean-ab",
        type=int,
        default=0,
        metavar="STEPS",
        help="CPU ms per step with and without the lean runtime, alternating steps in one "
        "world per schedule (EqualBlocks)",
    )
    p.add_argument("--model", choices=("recipe", "equal"), default="recipe")
    p.add_argument("--split-backward", action="store_true", help="B against I + W per stage")
    p.add_argument(
        "--wall-only",
        action="store_true",
        help="no CPU clock reads (CPU columns 0): the timeline comparison without their cost",
    )
    args = p.parse_args(argv)
    if args.lean_ab:
        return _lean_ab_report(args.schedules.split(","), args.lean_ab)
    if args.split_backward:
        split = split_backward(args.model)
        for stage, t in split.items():
            print(f"{stage}: " + " ".join(f"{k} {v:.3f}" for k, v in t.items()))
        return split
    partition = "equal" if args.model == "equal" and args.partition == "measured" else None
    partition = partition or args.partition
    names = args.schedules.split(",")
    if args.unpacked:
        names = [f"{n}{tail}" for n in names for tail in ("", " unpacked")]
    if args.torch_loop:
        names = [f"{n}{tail}" for n in names for tail in ("", " torch-loop")]
    steps: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for _ in range(args.repeats):
        for name in names:
            schedule, packed = name.split(" ")[0], " unpacked" not in name
            lean = " torch-loop" not in name
            clock = not args.wall_only
            out = spawn(
                run,
                2,
                schedule,
                args.steps,
                partition,
                packed,
                args.model,
                clock,
                lean,
                timeout=900,
            )
            for i in range(len(out[0]["events"])):
                events = [out[0]["events"][i], out[1]["events"][i]]
                row = decompose(events)
                aligned = decompose(events, timeline_origins(events, out[0]["intervals"][i]))
                row["timeline_vs_profile"] = timeline_agreement(aligned, out[0]["timeline"][i])
                row["barrier_skew"] = timeline_agreement(row, out[0]["timeline"][i])
                steps[name].append(row)
    return _report(names, steps, formula_bubble)


def _lean_ab_report(schedules: list[str], steps: int) -> dict[str, Any]:
    from lightning_mmpar.testing import spawn

    report: dict[str, Any] = {}
    for schedule in schedules:
        ranks = spawn(lean_ab, 2, schedule, steps, timeout=900)
        report[schedule] = [
            {k: (statistics.median(v), min(v), len(v)) for k, v in r.items()} for r in ranks
        ]
        for r, row in enumerate(report[schedule]):
            cells = ", ".join(f"{k} {m:.2f} (min {lo:.2f}, n {n})" for k, (m, lo, n) in row.items())
            print(f"== {schedule} rank {r}: CPU ms per step, median: {cells}", flush=True)
    return report


def _report(names: list[str], steps: dict[str, list[dict[str, Any]]], formula_of: Any) -> Any:
    report: dict[str, Any] = {}
    for name in names:
        rows = steps[name]
        schedule = name.split(" ")[0]
        formula = formula_of(schedule, 2, 4, SCHEDULES[schedule])
        med = {
            "bubble": statistics.median(s["bubble"] for s in rows),
            "span_ms": statistics.median(s["span_ms"] for s in rows),
            "ranks": [
                {k: statistics.median(s["ranks"][r][k] for s in rows) for k in rows[0]["ranks"][r]}
                for r in range(2)
            ],
        }
        agree = max(s["timeline_vs_profile"] for s in rows)
        skew = max(s["barrier_skew"] for s in rows)
        report[name] = {"formula": formula, "steps": len(rows), "timeline_vs_profile": agree}
        report[name]["barrier_skew"] = skew
        report[name].update(med)
        print(
            f"== {name}: bubble {med['bubble']:.3f} (formula {formula:.3f}), span "
            f"{med['span_ms']:.1f} ms, {len(rows)} steps, timeline vs profile: largest "
            f"difference {agree:.4f} of the span ({skew:.3f} on each one's own barrier)"
        )
        for r, row in enumerate(med["ranks"]):
            print(f"  rank {r}: " + " ".join(f"{k} {v:.3f}" for k, v in row.items()))
        sys.stdout.flush()
    return report


if __name__ == "__main__":
    main()
