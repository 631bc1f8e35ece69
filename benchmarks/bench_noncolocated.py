"""The vision tower on its own rank against the colocated layouts of the same 2 processes (one run).

    python benchmarks/bench_noncolocated.py            # docs/results/noncolocated.json
    python benchmarks/bench_noncolocated.py --smoke --out-dir /tmp/r   # 1 round, 3 steps
    python benchmarks/bench_noncolocated.py --accumulate 1   # one batch per step: serial

**Work.** ``recipes/digits_vqa_cpu.yaml``'s ragged question-answering batches (0 to
``MAX_IMAGES`` digit images per sample, one sample per row padded to ``MAX_TOKENS``: the
planner's per-sample model applies as is) with a vision tower that does real work
(:data:`MODEL`: 32 px images in 4 px patches, 64 tokens each, 2 ViT layers of width 96, 2.5
images per sample on average: about 60% of the step's FLOPs) beside the recipe's 2-layer
decoder; ``--global-batch`` samples per optimizer step on every layout, in ``--accumulate``
batches (``accumulate_grad_batches``; ``data.batch_size = global / dp / accumulate``).

**Layouts** (:data:`LAYOUTS`), all on the same 2 gloo processes, each with one core of a 2-core
machine (``torch.set_num_threads(1)``): the colocated ``dp2`` (DDP and FSDP2), ``tp2`` and
``pp2`` (1F1B, 2 micro-batches) against ``vision 1 + language 1`` (``vision_ranks=1``: the tower
alone on rank 1, the language model on rank 0). One spawned world runs every layout in turn,
``--rounds`` times, the order reversed every other round (A B C, C B A: machine load hits them
alike). A step's time is the slowest rank's (from its window's first ``on_train_batch_start``
to its last ``on_train_batch_end``: the optimizer step included), the median over the steps
after the first ``--warmup`` of each run.

**Reported.** Per layout: median step seconds, target tokens/s per process, CPU seconds per
step (``time.process_time`` of each rank: summed over the ranks, and on the *critical path*:
the busiest rank's for a colocated layout, whose ranks compute at once, and for the
non-colocated one when it accumulates (its vision rank runs one batch ahead); the sum for it
with one batch per step, whose exchange runs one side at a time). ``ratio``: non-colocated
over the best colocated layout's step time (below 1: faster), the median of the per-round
ratios, with their spread (max - min); the same against every colocated layout. Both sides use
the same 2 processes, so tokens/s per process is the inverse ratio. ``cpu_critical_ratio``: the
same on the critical path's CPU seconds, against the colocated layout lowest there: what the
step ratio is on two cores of its own when the machine is shared (a loaded machine gives the
job's processes less than a core each, which stretches layouts whose ranks compute at once
and not a serial one: the wall-clock ratio then favours the non-colocated layout).

Inside an accumulation window the vision rank encodes batch ``k + 1`` while the language rank
runs batch ``k`` (``lightning_mmpar.parallel.towers``); with one batch per step the exchange is
serial (the language rank waits for the embeddings, the vision rank for their gradients).
docs/noncolocated.md discusses the figures.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from lightning.pytorch import Callback
from report import write_result

ROOT = Path(__file__).resolve().parents[1]
YAML = ROOT / "recipes" / "digits_vqa_cpu.yaml"
WORLD = 2
MAX_IMAGES = 5
MAX_TOKENS = 32
MODEL: dict[str, Any] = {
    "vision": {
        "image_size": 32,
        "patch_size": 4,
        "width": 96,
        "layers": 2,
        "heads": 4,
        "mlp_ratio": 2.0,
        "output_dim": 64,
        "pool_type": "tok",
    },
}
"""What changes in the YAML's ``model.fusion`` (the language side stays the recipe's)."""

NONCOLOCATED = "vision 1 + language 1"
LAYOUTS: dict[str, dict[str, Any]] = {
    "dp2 ddp": {"data_parallel": "ddp"},
    "dp2 fsdp": {"data_parallel": "fsdp"},
    "tp2": {"tensor_parallel": 2},
    "pp2": {"pipeline_parallel": 2, "micro_batches": 2},
    NONCOLOCATED: {"vision_ranks": 1},
}
"""Strategy arguments per layout on :data:`WORLD` processes."""


def dp_of(args: dict[str, Any]) -> int:
    """The language data-parallel degree of a layout on :data:`WORLD` processes."""
    model = args.get("tensor_parallel", 1) * args.get("pipeline_parallel", 1)
    return (WORLD - args.get("vision_ranks", 0)) // model


def config(global_batch: int, args: dict[str, Any], accumulate: int = 1) -> dict[str, Any]:
    """The YAML with :data:`MODEL`'s tower, unpacked rows and ``global_batch / dp /
    accumulate`` samples per batch and rank."""
    cfg = copy.deepcopy(yaml.safe_load(YAML.read_text()))
    cfg["model"]["fusion"].update(copy.deepcopy(MODEL))
    init = cfg["data"]["init_args"]
    init.update(
        image_size=MODEL["vision"]["image_size"],
        max_images=MAX_IMAGES,
        max_images_per_row=MAX_IMAGES,
        max_tokens=MAX_TOKENS,
        pack=False,
        pad_to_max_tokens=True,
        batch_size=global_batch // dp_of(args) // accumulate,
        train_samples=2000,
    )
    return cfg


class Tokens(Callback):
    """Target tokens (labels not ignored), rows and images of each training batch on this
    rank, its start and end (``time.perf_counter``), and the process's CPU seconds of each
    batch (``time.process_time``: what the rank computed, whatever else the machine runs; a
    rank blocked in a receive adds little)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.rows: list[int] = []
        self.images: list[int] = []
        self.cpu: list[float] = []
        self.starts: list[float] = []
        self.ends: list[float] = []
        self._cpu = 0.0

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, *args: Any) -> None:
        self.tokens.append(int((batch["labels"][:, 1:] != -100).sum()))
        self.rows.append(int(batch["labels"].shape[0]))
        self.images.append(int(batch["image_mask"].sum()))
        self._cpu = time.process_time()
        self.starts.append(time.perf_counter())

    def on_train_batch_end(self, *args: Any) -> None:
        self.ends.append(time.perf_counter())
        self.cpu.append(time.process_time() - self._cpu)


def windows(values: list[float], accumulate: int) -> list[float]:
    """Per-batch ``values`` summed over each optimizer step's ``accumulate`` batches."""
    return [sum(values[i : i + accumulate]) for i in range(0, len(values), accumulate)]


def run_one(
    args: dict[str, Any], global_batch: int, steps: int, accumulate: int = 1
) -> dict[str, list[Any]]:
    """One ``Trainer.fit`` of ``steps`` optimizer steps of ``accumulate`` batches under
    ``args`` on this rank: per step its seconds (first batch's start to last batch's end), CPU
    seconds and target tokens (a vision rank's batches are not its own: 0)."""
    from lightning.pytorch import seed_everything

    from lightning_mmpar import MultimodalParallelStrategy
    from lightning_mmpar.recipes.partition import build_module
    from lightning_mmpar.testing import quiet_trainer

    seed_everything(0, verbose=False)
    module, data = build_module(config(global_batch, args, accumulate), meta=False)
    tokens = Tokens()
    strategy = MultimodalParallelStrategy(**args)
    trainer = quiet_trainer(
        devices=WORLD,
        strategy=strategy,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        limit_val_batches=0,
        callbacks=[tokens],
    )
    trainer.fit(module, datamodule=data)
    a = accumulate
    times = [e - s for s, e in zip(tokens.starts[::a], tokens.ends[a - 1 :: a], strict=True)]
    out = {"times": times, "cpu": windows(tokens.cpu, a), "tokens": windows(tokens.tokens, a)}
    if strategy._exchange is not None and strategy._exchange.is_vision:  # not its batches
        return out | {"tokens": [0] * steps, "rows": [0] * steps, "images": []}
    return out | {"rows": windows(tokens.rows, a), "images": tokens.images}


def worker(
    rank: int,
    size: int,
    names: list[str],
    global_batch: int,
    steps: int,
    rounds: int,
    accumulate: int = 1,
) -> dict[str, list[dict[str, list[Any]]]]:
    """Every layout of ``names`` in turn, ``rounds`` times (reversed every other round)."""
    torch.set_num_threads(1)
    out: dict[str, list[dict[str, list[Any]]]] = {n: [] for n in names}
    for i in range(rounds):
        for name in names if i % 2 == 0 else names[::-1]:
            out[name].append(run_one(LAYOUTS[name], global_batch, steps, accumulate))
    return out


def measure(
    names: list[str], global_batch: int, steps: int, rounds: int, accumulate: int = 1
) -> dict[str, Any]:
    """Spawn the world, run :func:`worker` and :func:`collect` its results."""
    from lightning_mmpar.testing import spawn

    per_rank = spawn(worker, WORLD, names, global_batch, steps, rounds, accumulate, timeout=3600)
    return collect(per_rank, names, rounds, accumulate)


def collect(
    per_rank: list[Any], names: list[str], rounds: int, accumulate: int = 1
) -> dict[str, Any]:
    """Per layout and round (``per_rank``: :func:`worker`'s results): the steps' slowest-rank
    seconds and global target tokens (the ranks of one tp x pp group counted once), and the
    images per sample the language ranks saw."""
    out: dict[str, Any] = {}
    for name in names:
        share = WORLD // dp_of(LAYOUTS[name]) - LAYOUTS[name].get("vision_ranks", 0)
        # one batch per step: the exchange is serial, one side computes at a time
        serial = LAYOUTS[name].get("vision_ranks", 0) > 0 and accumulate == 1
        times, tokens, cpu, critical = [], [], [], []
        for r in range(rounds):
            runs = [rank[name][r] for rank in per_rank]
            times.append([max(s) for s in zip(*(x["times"] for x in runs), strict=True)])
            per_step = list(zip(*(x["cpu"] for x in runs), strict=True))
            cpu.append([sum(s) for s in per_step])
            critical.append([sum(s) if serial else max(s) for s in per_step])
            per_step = zip(*(x["tokens"] for x in runs), strict=True)
            tokens.append([sum(t) / share for t in per_step])
        rows = sum(sum(x["rows"]) for rank in per_rank for x in rank[name])
        images = sum(sum(x["images"]) for rank in per_rank for x in rank[name])
        out[name] = {
            "step_seconds": times,
            "cpu_seconds": cpu,
            "cpu_critical_seconds": critical,
            "tokens": tokens,
            "images_per_sample": images / rows,
        }
    return out


def summarise(measured: dict[str, Any], warmup: int) -> dict[str, Any]:
    """Median step seconds and tokens/s per process of each layout; the non-colocated
    layout's ratio against the best colocated one and against each (median of the per-round
    ratios, spread max - min)."""

    def med(rounds: list[list[float]]) -> list[float]:
        return [statistics.median(r[warmup:]) for r in rounds]

    per_round = {n: med(m["step_seconds"]) for n, m in measured.items()}
    layouts = {}
    for name, m in measured.items():
        step = statistics.median(t for r in m["step_seconds"] for t in r[warmup:])
        tokens = statistics.median(t for r in m["tokens"] for t in r[warmup:])
        cpu = statistics.median(t for r in m["cpu_seconds"] for t in r[warmup:])
        critical = statistics.median(t for r in m["cpu_critical_seconds"] for t in r[warmup:])
        layouts[name] = {
            "step_s": step,
            "cpu_s_all_ranks": cpu,
            "cpu_critical_s": critical,
            "tokens_per_step": tokens,
            "tokens_per_s_per_process": tokens / step / WORLD,
        }
    out: dict[str, Any] = {"layouts": layouts}
    colocated = [n for n in measured if n != NONCOLOCATED]
    if NONCOLOCATED not in measured or not colocated:
        return out
    best = min(colocated, key=lambda n: layouts[n]["step_s"])
    ours = per_round[NONCOLOCATED]
    against = {}
    for name in colocated:
        ratios = [a / b for a, b in zip(ours, per_round[name], strict=True)]
        against[name] = {
            "ratio": statistics.median(ratios),
            "spread": max(ratios) - min(ratios),
            "ratios": ratios,
        }
    by_cpu = min(colocated, key=lambda n: layouts[n]["cpu_critical_s"])
    cpu_ratio = layouts[NONCOLOCATED]["cpu_critical_s"] / layouts[by_cpu]["cpu_critical_s"]
    return out | {
        "best_colocated": best,
        **against[best],
        "against": against,
        "cpu_critical_ratio": {"against": by_cpu, "ratio": cpu_ratio},
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--global-batch", type=int, default=32, help="samples per optimizer step")
    p.add_argument("--accumulate", type=int, default=4, help="batches per optimizer step")
    p.add_argument("--steps", type=int, default=10, help="steps per run")
    p.add_argument("--warmup", type=int, default=3, help="first steps of a run not timed")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--smoke", action="store_true", help="dp2 ddp + non-colocated, 1 round, 3 steps of 2"
    )
    p.add_argument("--out-dir", type=Path, default=None, help="default docs/results")
    args = p.parse_args(argv)
    if args.smoke:
        args.layouts, args.steps, args.rounds = f"dp2 ddp,{NONCOLOCATED}", 3, 1
        args.accumulate = min(args.accumulate, 2)
    args.warmup = min(args.warmup, args.steps - 1)
    names = [n.strip() for n in args.layouts.split(",")]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        raise SystemExit(f"unknown layouts {unknown}; choose from {list(LAYOUTS)}")
    measured = measure(names, args.global_batch, args.steps, args.rounds, args.accumulate)
    payload = result(measured, args)
    path = write_result("noncolocated", payload, args.out_dir)
    print(f"wrote {path}")
    return payload


def result(measured: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The JSON payload of a measurement (``args``: ``global_batch``, ``steps``, ``warmup``,
    ``rounds``), its table printed."""
    summary = summarise(measured, args.warmup)
    payload = {
        "config": {
            "yaml": str(YAML.relative_to(ROOT)),
            "model": MODEL,
            "max_images": MAX_IMAGES,
            "max_tokens": MAX_TOKENS,
            "processes": WORLD,
            "global_batch": args.global_batch,
            "accumulate": getattr(args, "accumulate", 1),
            "steps": args.steps,
            "warmup": args.warmup,
            "rounds": args.rounds,
        },
        "load_average": list(os.getloadavg()),
        **summary,
        "measured": measured,
    }
    for name, s in summary["layouts"].items():
        print(
            f"{name:22} {s['step_s'] * 1e3:8.1f} ms/step  "
            f"{s['tokens_per_s_per_process']:8.1f} tokens/s per process  "
            f"{s['cpu_s_all_ranks'] * 1e3:8.1f} CPU ms/step (all ranks), "
            f"{s['cpu_critical_s'] * 1e3:8.1f} on the critical path"
        )
    if "ratio" in summary:
        print(
            f"non-colocated / best colocated ({summary['best_colocated']}) step time: "
            f"{summary['ratio']:.2f} (spread {summary['spread']:.2f})"
        )
        cpu = summary["cpu_critical_ratio"]
        print(f"on the CPU critical path, against {cpu['against']}: {cpu['ratio']:.2f}")
    return payload


if __name__ == "__main__":
    main()
