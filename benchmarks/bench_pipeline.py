"""Pipeline planning on the CPU recipe: partition modes, schedules and vision layouts (one run).

    python benchmarks/bench_pipeline.py        # writes docs/results/pipeline.json + .png
    python benchmarks/bench_pipeline.py --smoke --out-dir /tmp/r   # one short run, pp2 only

The product's own model and data: ``recipes/clip_llama_cpu.yaml``'s ``model:`` / ``data:``
sections (CLIP-ViT + adapter + LLaMA on the offline digits, batch 72), trained by
``Trainer(strategy=MultimodalParallelStrategy(...))`` for a few steps per configuration. Its 9
pipeline blocks differ in cost (stem, two ViT layers, pooling, adapter, two decoder layers,
head), so no cut of them gives equal stages: at pp 2 x v 2 every cut is at least 1.28 apart in
FLOPs, and the rows' "at the stage costs" bubble is above the formula by what the unequal
stages leave. The schedules are therefore also measured on a model whose stages can be equal
(``pp2eq``). Four spawned gloo worlds:

* ``pp2eq`` (2 processes): :class:`EqualBlocks`, 8 identical transformer blocks (the toy LM's
  ``Block``, width 64, 32 tokens, on random features with a mean-squared loss, batch 72),
  ``partition="equal"``: 4 blocks per stage at v 1, 2 at v 2, every stage the same work under
  every schedule (GPipe, 1F1B and each multi-stage schedule at v 2). Its "at the stage costs"
  column is then the formula up to timing noise (for the zero-bubble schedules, the formula at
  this CPU's input / weight backward costs, which are not half the fused backward each:
  ``profile_pipeline.py --split-backward``), and ``measured - stage_cost`` is what the engine,
  torch's schedule and the transport add;
* ``pp2`` (2 processes, the recipe model): ``partition`` equal vs balanced under 1F1B, then
  every schedule at pp 2 (the multi-stage ones with 2 stages per rank) with
  ``partition="balanced"``;
* ``pp4`` (4 processes): equal / ratio / balanced under 1F1B, and the interleaved, ZBV and
  DualPipeV schedules at pp 4 x v 2;
* ``tp2`` (2 processes): ``vision_parallel`` tp / replicate / dp at tensor parallel 2.

Within a world the configurations run round-robin (A B C A B C ...), so machine load hits them
alike. A step's time is the slowest rank's (``on_train_batch_start`` to ``_end``), medians over
the measured steps of all rounds (the first steps build schedules and are skipped); the spread is
the range of the per-round medians. The measured bubble comes from
:class:`~lightning_mmpar.callbacks.PipelineTimeline` on every step after the first two of each
run (medians over all of them; split into send/recv waits, host work between actions and
the fill / drain outside each rank's schedule, ``outside``), next
to the schedule's formula and the bubble at the measured stage costs (``stage_cost``: torch's
action order simulated with each stage's median action times, the loss in the last stage's
forward, free communication: what unequal stages alone leave). ``imbalance`` is max / mean
stage FLOPs; ``measured_imbalance`` max / mean of the times ``partition="measured"`` took at
set-up. ``--worlds pp2`` re-measures one world and keeps the others' rows from the existing
JSON (``kept`` names their run). The pp2 world also compares packed and unpacked stage
boundaries (``... unpacked``: ``PipelineEngine.pack_boundaries = False``) on the same fixed cuts;
``--configs "name;name"`` runs only the named configurations.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from lightning.pytorch import Callback, LightningModule, seed_everything
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mmpar.layout.schedules import MULTI_STAGE_SCHEDULES, SCHEDULES
from lightning_mmpar.parallel.pipeline import PipelineSteps

sys.path.insert(0, str(Path(__file__).parent))
from bench_stability import StepTimer  # the same per-batch wall-time callback
from report import save_figure, write_result

ROOT = Path(__file__).resolve().parents[1]
YAML = ROOT / "recipes" / "clip_llama_cpu.yaml"

Spec = tuple[str, dict[str, Any], str]
"""(name, strategy arguments, vision_parallel)."""

UNPACKED = "unpacked"
"""A spec key (not a strategy argument): run with ``PipelineEngine.pack_boundaries = False``,
every boundary tensor on its own (the engine before boundary packing), in the same run."""


def _pp(
    pp: int, schedule: str, partition: str | list[int], v: int = 1, packed: bool = True
) -> Spec:
    name = f"{schedule}{' v2' if v > 1 else ''} {partition}{'' if packed else ' unpacked'}"
    args = {"pipeline_parallel": pp, "virtual_pipeline": v, "schedule": schedule}
    return name, {**args, "partition": partition, **({} if packed else {UNPACKED: True})}, "tp"


MULTI = tuple(s for s in SCHEDULES if s in MULTI_STAGE_SCHEDULES)
"""Every multi-stage schedule, in the facts' order (lightning_mmpar.layout.schedules)."""
EQUAL_WORLDS = ("pp2eq",)
"""Worlds that train :class:`EqualBlocks` instead of the recipe model."""
WORLDS: dict[str, tuple[int, list[Spec]]] = {
    "pp2eq": (
        2,
        [
            _pp(2, "1f1b", "equal"),
            _pp(2, "gpipe", "equal"),
            *(_pp(2, s, "equal", 2) for s in MULTI),
        ],
    ),
    "pp2": (
        2,
        [
            _pp(2, "1f1b", "equal"),
            _pp(2, "1f1b", "balanced"),
            _pp(2, "1f1b", "measured"),
            _pp(2, "gpipe", "balanced"),
            *(_pp(2, s, "balanced", 2) for s in MULTI),
            _pp(2, "interleaved_1f1b", "ratio:2:1:1", 2),
            *(
                _pp(2, s, "measured", 2)
                for s in ("interleaved_1f1b", "zbv_zero_bubble", "dualpipev")
            ),
            *(_pp(2, "1f1b", [6], packed=p) for p in (True, False)),
            *(
                _pp(2, s, [2, 6, 7], 2, packed=p)
                for s in ("interleaved_1f1b", "zbv_zero_bubble", "dualpipev")
                for p in (True, False)
            ),
        ],
    ),
    "pp4": (
        4,
        [
            _pp(4, "1f1b", "equal"),
            _pp(4, "1f1b", "ratio:2:1:1"),
            _pp(4, "1f1b", "balanced"),
            *(
                _pp(4, s, "balanced", 2)
                for s in ("interleaved_1f1b", "zbv_zero_bubble", "dualpipev")
            ),
        ],
    ),
    "tp2": (2, [(f"vision {v}", {"tensor_parallel": 2}, v) for v in ("tp", "replicate", "dp")]),
}
MICRO_BATCHES = {"pp2eq": 4, "pp2": 4, "pp4": 8, "tp2": None}


class EqualBlocks(PipelineSteps, LightningModule):
    """``blocks`` identical pre-norm transformer blocks
    (:class:`lightning_mmpar.examples.toy_transformer.Block`: attention and a 4x MLP, ``dim``
    wide) on random ``[batch, seq, dim]`` features with a mean-squared loss against random
    targets: a :class:`~lightning_mmpar.parallel.pipeline.PipelineModule` whose cut into equal
    block counts gives stages of equal work (the loss, one ``mse_loss``, is the only extra on
    the last stage). One float boundary tensor of ``micro-batch x seq x dim`` float32."""

    def __init__(self, blocks: int = 8, dim: int = 64, seq: int = 32, heads: int = 4) -> None:
        super().__init__()
        from lightning_mmpar.examples.toy_transformer import Block, ToyConfig

        cfg = ToyConfig(dim=dim, heads=heads, layers=blocks, seq=seq)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(blocks))

    def pipeline_blocks(self) -> list[nn.Module]:
        return list(self.layers)

    def pipeline_inputs(self, batch: Any) -> tuple[tuple[Tensor, ...], Tensor]:
        return (batch[0],), batch[1]

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return nn.functional.mse_loss(output, target)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


EQUAL_BATCH = 72
"""Batch of the ``pp2eq`` world: the recipe's, 18 rows per micro-batch at 4 micro-batches."""


def equal_blocks_data(steps: int, seq: int = 32, dim: int = 64) -> Any:
    """``steps`` batches of :data:`EQUAL_BATCH` random features and targets (seeded)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(steps * EQUAL_BATCH, seq, dim, generator=g)
    y = torch.randn(steps * EQUAL_BATCH, seq, dim, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=EQUAL_BATCH)


def run_one(
    rank: int,
    size: int,
    world: str,
    spec: tuple[str, dict[str, Any], str],
    steps: int,
    measure_steps: list[int],
    root: str,
) -> dict[str, Any]:
    from lightning_mmpar import MultimodalParallelStrategy
    from lightning_mmpar.callbacks import PipelineTimeline
    from lightning_mmpar.parallel.pipeline import PipelineEngine
    from lightning_mmpar.recipes.partition import build_module
    from lightning_mmpar.testing import quiet_trainer

    name, strategy, vision = spec
    strategy = dict(strategy)
    PipelineEngine.pack_boundaries = not strategy.pop(UNPACKED, False)
    seed_everything(0, verbose=False)
    if world in EQUAL_WORLDS:
        module, data = EqualBlocks(), None
        loader = equal_blocks_data(steps)
    else:
        config = yaml.safe_load(YAML.read_text())
        config["model"]["plan"]["vision_parallel"] = vision
        module, data = build_module(config, meta=False)
    n = MICRO_BATCHES[world]
    args = {**strategy, **({"micro_batches": n} if n else {})}
    timer = StepTimer()
    callbacks: list[Callback] = [timer]
    timeline = None
    if args.get("pipeline_parallel", 1) > 1:
        path = Path(root) / f"{world}-{name.replace(' ', '_').replace(':', '-')}.png"
        timeline = PipelineTimeline(steps=measure_steps, path=path)
        callbacks.append(timeline)
    strategy_obj = MultimodalParallelStrategy(**args)
    trainer = quiet_trainer(
        devices=size,
        strategy=strategy_obj,
        max_steps=steps,
        limit_val_batches=0,
        callbacks=callbacks,
    )
    if data is None:
        trainer.fit(module, train_dataloaders=loader)
    else:
        trainer.fit(module, datamodule=data)
    out: dict[str, Any] = {"times": timer.times}
    plan = getattr(strategy_obj, "stage_plan", None)
    if plan is not None:
        out["imbalance"] = _flops_imbalance(plan)
        out["boundaries"] = list(plan.boundaries)
        if plan.measured_imbalance is not None:
            out["measured_imbalance"] = plan.measured_imbalance
    if timeline is not None and timeline.results:
        out["bubbles"] = [
            {
                "measured": r["measured"],
                "formula": r["formula"],
                "stage_cost": r["stage_cost"],
                "wait": r["split"]["wait"],
                "post": r["split"]["post"],
                "host": r["split"]["host"],
                "outside": r["split"]["outside"],
            }
            for r in timeline.results
        ]
    return out


def _flops_imbalance(plan: Any) -> float:
    """max / mean stage FLOPs, whatever the plan balanced."""
    flops = plan.stage_flops
    return max(flops) / (sum(flops) / len(flops))


def worker(
    rank: int,
    world_size: int,
    world: str,
    rounds: int,
    steps: int,
    limit: int | None = None,
    only: tuple[str, ...] = (),
) -> dict[str, Any]:
    torch.set_num_threads(1)
    specs = [s for s in WORLDS[world][1][:limit] if not only or s[0] in only]
    results: dict[str, list[dict[str, Any]]] = {s[0]: [] for s in specs}
    with tempfile.TemporaryDirectory() as root:
        for _ in range(rounds):
            for spec in specs:
                measured = list(range(2, steps))  # steps 0 and 1 build the schedules
                results[spec[0]].append(
                    run_one(rank, world_size, world, spec, steps, measured, root)
                )
    return results


def summarise(per_rank: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in per_rank[0]:
        rounds = len(per_rank[0][name])
        medians, all_steps = [], []
        for i in range(rounds):
            runs = [r[name][i] for r in per_rank]
            steps = [max(ts) for ts in zip(*(run["times"] for run in runs), strict=True)][warmup:]
            medians.append(statistics.median(steps))
            all_steps += steps
        row: dict[str, Any] = {
            "step_s": statistics.median(all_steps),
            "spread_s": [min(medians), max(medians)],
        }
        runs0 = per_rank[0][name]  # the timeline's results are the same on every rank
        for key in ("imbalance", "boundaries", "measured_imbalance"):
            if key in runs0[0]:
                row[key] = runs0[0][key]
        bubbles = [b for run in runs0 for b in run.get("bubbles", [])]
        if bubbles:
            for key in ("measured", "formula", "stage_cost", "wait", "post", "host", "outside"):
                row[f"bubble_{key}"] = statistics.median(b[key] for b in bubbles)
            row["bubble_steps"] = len(bubbles)
            per_round = [statistics.median(b["measured"] for b in run["bubbles"]) for run in runs0]
            row["bubble_spread"] = [min(per_round), max(per_round)]
        out[name] = row
    return out


def plot(results: dict[str, dict[str, Any]], out_dir: Path | None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4.2), squeeze=False)
    for ax, (world, rows) in zip(axes[0], results.items(), strict=True):
        names = list(rows)
        y = range(len(names))
        ax.barh(y, [rows[n]["step_s"] * 1000 for n in names], color="#4c72b0", label="step ms")
        ax.set_yticks(list(y), names, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("median step (ms)")
        ax.set_title(world)
        for i, n in enumerate(names):
            if "bubble_measured" in rows[n]:
                row = rows[n]
                txt = f"bubble {row['bubble_measured']:.2f} (formula {row['bubble_formula']:.2f})"
                ax.text(rows[n]["step_s"] * 1000, i, " " + txt, va="center", fontsize=6)
    path = save_figure(fig, "pipeline", out_dir)
    plt.close(fig)
    return path


def _kept(results: dict[str, Any], out_dir: Path | None) -> dict[str, Any]:
    """The worlds this run skipped (``--worlds``), from the existing JSON (under ``kept``: the
    command and date of their run), so that one world can be re-measured alone."""
    path = (out_dir or ROOT / "docs" / "results") / "pipeline.json"
    if not path.exists():
        return {}
    old = json.loads(path.read_text())
    kept = {w: rows for w, rows in old.get("results", {}).items() if w not in results}
    if not kept:
        return {}
    results.update(kept)
    when = old.get("date", "an earlier run")
    earlier = old.get("kept", {})  # a world the old run had kept itself: its own run
    run = f"{old.get('command', '')}, {when}"
    return {"kept": {w: earlier.get(w, run) for w in kept}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from lightning_mmpar.testing import spawn

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=5, help="steps per run (2 warm-up)")
    p.add_argument("--worlds", default=",".join(WORLDS))
    p.add_argument("--smoke", action="store_true", help="pp2, two configurations, 3 steps")
    p.add_argument("--out-dir", type=Path, default=None, help="default docs/results")
    p.add_argument("--configs", default="", help="configuration names only, separated by ;")
    args = p.parse_args(argv)
    only = tuple(c.strip() for c in args.configs.split(";") if c.strip())
    limit = None
    if args.smoke:
        args.rounds, args.steps, args.worlds, limit = 1, 3, "pp2", 2
    results: dict[str, Any] = {}
    started = time.perf_counter()
    for world in args.worlds.split(","):
        size = WORLDS[world][0]
        per_rank = spawn(worker, size, world, args.rounds, args.steps, limit, only, timeout=1800)
        results[world] = summarise(per_rank, warmup=2)
        for name, row in results[world].items():
            extra = "".join(
                f"  {k.removeprefix('bubble_')} {row[k]:.3f}"
                for k in (
                    "imbalance",
                    "measured_imbalance",
                    "bubble_measured",
                    "bubble_stage_cost",
                    "bubble_formula",
                    "bubble_wait",
                    "bubble_post",
                    "bubble_host",
                    "bubble_outside",
                )
                if k in row
            )
            print(f"{world:4} {name:38} {row['step_s'] * 1000:8.1f} ms{extra}", flush=True)
    report = {
        "config": {
            "yaml": str(YAML.relative_to(ROOT)),
            "rounds": args.rounds,
            "steps": args.steps,
            "micro_batches": MICRO_BATCHES,
            **({"configs": list(only)} if only else {}),
        },
        "wall_s": round(time.perf_counter() - started, 1),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "results": results,
    }
    report.update(_kept(results, args.out_dir))
    write_result("pipeline", report, args.out_dir)
    plot(results, args.out_dir)
    return report


if __name__ == "__main__":
    main()
