"""Overhead of ``mm_parallel`` against Lightning's own strategies on the fusion model (issue #14,
items 1 and 2), 2 and 4 gloo processes on CPU.

    python benchmarks/bench_overhead.py            # docs/results/overhead.json + overhead.png
    python benchmarks/bench_overhead.py --smoke    # 2 processes, 2 steps, one repeat

The model and data: ``recipes/clip_llama_cpu.yaml``'s ``model:`` / ``data:`` sections (CLIP-ViT +
adapter + LLaMA on the offline digits; :func:`lightning_mmpar.recipes.partition.build_module`) at
``--global-batch`` samples per step (``data.batch_size = global / dp``). Pairs, ours vs theirs:

* ``ddp``: ``MultimodalParallelStrategy(data_parallel="ddp")`` vs Lightning ``"ddp"``
  (``DDPStrategy``), the recipe's ``ClipLlamaModule`` unchanged on both sides (target <= 1.03);
* ``fsdp``: ``MultimodalParallelStrategy()`` (FSDP2 per pipeline block + root) vs Lightning
  ``ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)`` with
  :class:`LightningUserModule`: ``fully_shard`` per block, then the root, in ``configure_model``
  (Lightning's FSDP2 docs; target <= 1.03);
* ``tp2`` (2 processes) and ``tp2 dp2`` (4 processes): ``mm_parallel(tensor_parallel=2)`` vs
  ``ModelParallelStrategy(tensor_parallel_size=2, data_parallel_size=world / 2)`` where
  :class:`LightningUserModule` applies the package's own plan
  (:func:`lightning_mmpar.plans.apply_tensor_parallel`, the recipe's options) on
  ``self.device_mesh["tensor_parallel"]`` and ``fully_shard`` over ``["data_parallel"]``
  (target <= 1.00).

One spawned world per world size runs every side, interleaved A B, B A (``report.interleaved``);
a side is one ``Trainer.fit`` of ``--steps`` steps, re-seeded (``seed_everything(0)``) before the
model is built, so both sides start from the same weights and batches. A step's time is the
slowest rank's (``StepTimer``: ``on_train_batch_start`` to ``_end``), the first ``--warmup``
steps dropped; the ratio is ours / theirs, the median of the per-repeat ratios with their spread
(``report.ratio_stats``). The same work is checked, not assumed: every rank's loss of the first
step (same weights, same batch) and of the last step (gradient averaging and AdamW alike) are
compared between the sides and stored; a mismatch is reported as ``same_work: false`` and the
script exits non-zero after writing the JSON (the comparison is void).

Both sides run with their defaults: ours checks for non-finite loss / gradients each step
(``on_nonfinite="raise"``: one all-gather of 3 numbers per rank and a host sync), runs
cross-attention on its own ``vl`` communicator, and under ``data_parallel="ddp"`` reduces
gradients through torch's DDP (composable ``replicate``: bucketed all-reduces overlapping
backward) without Lightning's per-forward buffer broadcast; those costs are part of the
measured ratio. ``--pairs ddp`` runs one pair alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import yaml
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).parent))
from bench_stability import StepTimer  # the same per-batch wall-time callback
from report import CPU_YAML, interleaved, ratio_stats, save_figure, write_result

from lightning_mmpar.models.fusion import FusionModel, FusionOutput
from lightning_mmpar.recipes.module import ClipLlamaModule

PAIRS: dict[int, tuple[tuple[str, dict[str, Any], str, float], ...]] = {
    2: (
        ("ddp", {"data_parallel": "ddp"}, "ddp", 1.03),
        ("ddp guard off", {"data_parallel": "ddp", "on_nonfinite": "off"}, "ddp", 1.03),
        ("fsdp", {}, "model_parallel", 1.03),
        ("tp2", {"tensor_parallel": 2}, "model_parallel", 1.00),
    ),
    4: (
        ("ddp", {"data_parallel": "ddp"}, "ddp", 1.03),
        ("ddp guard off", {"data_parallel": "ddp", "on_nonfinite": "off"}, "ddp", 1.03),
        ("fsdp", {}, "model_parallel", 1.03),
        ("tp2 dp2", {"tensor_parallel": 2}, "model_parallel", 1.00),
    ),
}
"""Per world size: (name, ``MultimodalParallelStrategy`` arguments, Lightning side, target).
``ddp guard off``: ours without the non-finite guard (``on_nonfinite="off"``; Lightning has no
such check), to show what the guard's default costs."""
LOSS_RTOL = 1e-6
"""Relative tolerance of the loss agreement, first and last step (measured: bit-equal at 2
processes; leaving the 0-dim parameters' gradients unaveraged on the Lightning side moves the
fsdp pair's 5th-step loss by 4e-5 at 14.4, which this catches)."""


class Blocks(nn.ModuleList):
    """The blocks run in order (``y = b_k(...b_1(*x))``): a root module with a ``forward`` for
    FSDP2's root hooks, as ``self.model`` is in Lightning's docs."""

    def forward(self, *state: Tensor) -> tuple[Tensor, ...]:
        for block in self:
            state = block(*state)
        return state


class LightningUserModule(ClipLlamaModule):
    """The recipe's module as a user of Lightning's ``ModelParallelStrategy`` writes it: the
    parallelism applied by hand in ``configure_model`` (Lightning's TP and FSDP2 docs).

    The model is the recipe's (same config, padded vocabulary, freezing, blocks). With
    ``device_mesh["tensor_parallel"]`` of size > 1 the package's fusion plan
    (:func:`lightning_mmpar.plans.apply_tensor_parallel`, the recipe's ``tensor_parallel``
    options) shards it on that mesh; with ``device_mesh["data_parallel"]`` of size > 1 each block
    gets ``fully_shard`` and then the root (:class:`Blocks`). ``fully_shard`` refuses 0-dim
    parameters (the tanh gates, the logit scale), so they are ``ignored_params`` and their
    gradients averaged over the data-parallel group after backward, as such a user must.
    """

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        from lightning_mmpar.plans import apply_tensor_parallel

        if self.blocks is not None:
            return
        mesh = self.device_mesh
        assert mesh is not None, "ModelParallelStrategy sets the mesh before configure_model"
        tp_mesh, dp_mesh = mesh["tensor_parallel"], mesh["data_parallel"]
        model = FusionModel(
            self._resolved_config(tp_mesh.size()), momentum=self.loss_config.mml.momentum
        )
        o = self.plan_options
        if tp_mesh.size() > 1:
            apply_tensor_parallel(
                model,
                tp_mesh,
                vision_parallel=o.vision_parallel,
                sequence_parallel=o.sequence_parallel,
                vl_combine=o.vl_combine,
            )
        self._freeze(model)
        self._fusion = (model,)
        self.blocks = Blocks(model.pipeline_blocks())
        self._scalars = [p for p in self.blocks.parameters() if p.ndim == 0]
        if dp_mesh.size() > 1:
            scalars = set(self._scalars)
            for block in self.blocks:
                ignored = scalars & set(block.parameters())
                if len(ignored) < len(list(block.parameters())):
                    fully_shard(block, mesh=dp_mesh, ignored_params=ignored or None)
            fully_shard(self.blocks, mesh=dp_mesh, ignored_params=scalars or None)

    def _run(self, state: tuple[Tensor, ...]) -> FusionOutput:
        assert self.blocks is not None
        return FusionOutput(*self.blocks(*state))

    def on_after_backward(self) -> None:
        assert self.device_mesh is not None
        dp_mesh = self.device_mesh["data_parallel"]
        grads = [p.grad for p in self._scalars if p.requires_grad and p.grad is not None]
        if dp_mesh.size() > 1 and grads:
            flat = torch.stack([g.detach().reshape(()) for g in grads])
            dist.all_reduce(flat, group=dp_mesh.get_group())
            for g, v in zip(grads, flat / dp_mesh.size(), strict=True):
                g.copy_(v)
        super().on_after_backward()


class StepEnds(pl.Callback):
    """``perf_counter`` at the end of every training batch: the loop's seconds per step between
    two ends include what runs between ``on_train_batch_end`` and the next
    ``on_train_batch_start`` (data, Lightning's per-batch SIGTERM broadcast, logging), which
    ``StepTimer`` leaves out."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.ends.append(time.perf_counter())


class Probe(pl.Callback):
    """Re-seeds before ``configure_model`` builds the model (same weights on both sides) and
    records each step's loss on this rank."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        pl.seed_everything(0, verbose=False)

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, *args: Any) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss.detach().float()))


def fit_side(
    side: str,
    world: int,
    ours: dict[str, Any],
    theirs: str,
    global_batch: int,
    steps: int,
    losses: list[list[float]],
    stamps: list[list[float]],
) -> list[float]:
    """One ``Trainer.fit`` of ``steps`` steps; returns this rank's per-step seconds and appends
    its per-step losses to ``losses`` and its steps' end times to ``stamps``."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_mmpar import MultimodalParallelStrategy
    from lightning_mmpar.recipes.partition import build_module
    from lightning_mmpar.testing import quiet_trainer

    tp = ours.get("tensor_parallel", 1)
    config = yaml.safe_load(CPU_YAML.read_text())
    config["data"]["batch_size"] = global_batch // (world // tp)
    pl.seed_everything(0, verbose=False)
    module, data = build_module(config, meta=False)
    strategy: Any
    if side == "ours":
        strategy = MultimodalParallelStrategy(**ours)
    elif theirs == "ddp":
        strategy = "ddp"
    else:
        strategy = ModelParallelStrategy(data_parallel_size=world // tp, tensor_parallel_size=tp)
        module = LightningUserModule(**dict(module.hparams))
    timer, probe, ends = StepTimer(), Probe(), StepEnds()
    trainer = quiet_trainer(
        devices=world,
        strategy=strategy,
        max_steps=steps,
        limit_val_batches=0,
        callbacks=[timer, probe, ends],
    )
    trainer.fit(module, datamodule=data)
    losses.append(probe.losses)
    stamps.append(ends.ends)
    return timer.times


def _pairs(
    world: int, names: Sequence[str] | None
) -> tuple[tuple[str, dict[str, Any], str, float], ...]:
    """The pairs of ``world`` processes, those named in ``names`` only (``None``: all)."""
    return tuple(p for p in PAIRS[world] if names is None or p[0] in names)


def worker(
    rank: int,
    world: int,
    repeats: int,
    steps: int,
    global_batch: int,
    names: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Every pair of this world size (those in ``names``), interleaved; per side, per repeat:
    times and losses."""
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    losses: dict[str, list[list[float]]] = {}
    stamps: dict[str, list[list[float]]] = {}
    sides: dict[str, Callable[[], Sequence[float]]] = {}
    for name, ours, theirs, _ in _pairs(world, names):
        for side in ("ours", "theirs"):
            key = f"{name}/{side}"
            losses[key], stamps[key] = [], []
            sides[key] = partial(
                fit_side, side, world, ours, theirs, global_batch, steps, losses[key], stamps[key]
            )
    return {"times": interleaved(sides, repeats), "losses": losses, "ends": stamps}


def loop_seconds(per_rank: list[dict[str, Any]], key: str, warmup: int) -> list[float]:
    """Per repeat: seconds per step of the training loop after ``warmup`` steps (from the end
    of step ``warmup`` to the end of the last, divided by the steps between), the slowest
    rank's: everything a step costs, in the step's hooks or between them."""
    w = max(1, warmup)  # the first step's end starts the span
    out = []
    for ends in zip(*(r["ends"][key] for r in per_rank), strict=True):  # repeat -> ranks
        out.append(max((e[-1] - e[w - 1]) / (len(e) - w) for e in ends))
    return out


def _agree(a: float, b: float, tol: float) -> bool:
    return abs(a - b) <= tol * max(1.0, abs(a), abs(b))


def summarise(
    per_rank: list[dict[str, Any]], world: int, warmup: int, names: Sequence[str] | None = None
) -> dict[str, Any]:
    """Per pair: ``ratio_stats`` of the slowest-rank step times and the loss checks."""
    out: dict[str, Any] = {}
    for name, ours, theirs, target in _pairs(world, names):
        steps: dict[str, list[list[float]]] = {}
        for side in ("ours", "theirs"):
            runs = [r["times"][f"{name}/{side}"] for r in per_rank]  # rank -> repeat -> step
            steps[side] = [
                [max(ts) for ts in zip(*reps, strict=True)][warmup:]
                for reps in zip(*runs, strict=True)
            ]
        stats = ratio_stats(steps["ours"], steps["theirs"])
        loop = {side: loop_seconds(per_rank, f"{name}/{side}", warmup) for side in steps}
        loop_ratios = [a / b for a, b in zip(loop["ours"], loop["theirs"], strict=True)]
        stats["loop_ratio"] = statistics.median(loop_ratios)
        stats["loop_spread"] = max(loop_ratios) - min(loop_ratios)
        # every rank's losses of the first repeat (later repeats redo the same steps)
        first = {s: [r["losses"][f"{name}/{s}"][0] for r in per_rank] for s in ("ours", "theirs")}
        pairs = list(zip(first["ours"], first["theirs"], strict=True))
        first_ok = all(_agree(a[0], b[0], LOSS_RTOL) for a, b in pairs)
        last_ok = all(_agree(a[-1], b[-1], LOSS_RTOL) for a, b in pairs)
        out[name] = {
            **stats,
            "theirs": "DDPStrategy" if theirs == "ddp" else "ModelParallelStrategy",
            "ours_args": ours,
            "target": target,
            "met": stats["ratio"] <= target,
            "first_loss": {s: [v[0] for v in first[s]] for s in first},
            "last_loss": {s: [v[-1] for v in first[s]] for s in first},
            "first_loss_max_abs_diff": max(abs(a[0] - b[0]) for a, b in pairs),
            "last_loss_max_abs_diff": max(abs(a[-1] - b[-1]) for a, b in pairs),
            "same_work": first_ok and last_ok,
        }
    return out


def plot(results: dict[str, dict[str, Any]], out_dir: Path | None) -> Path:
    """Bar chart: each pair's median ratio, the per-repeat range as error bars, its target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, rows = [], []
    for world, pairs in results.items():
        for name, row in pairs.items():
            peer = "DDP" if row["theirs"] == "DDPStrategy" else "ModelParallel"
            labels.append(f"{name} vs {peer}\n{world} proc")
            rows.append(row)
    x = range(len(rows))
    ratio = [r["ratio"] for r in rows]
    err = [
        [r["ratio"] - min(r["ratios"]) for r in rows],
        [max(r["ratios"]) - r["ratio"] for r in rows],
    ]
    fig, ax = plt.subplots(figsize=(1.3 * len(rows) + 2, 3.6))
    colors = ["tab:green" if r["met"] else "tab:red" for r in rows]
    ax.bar(x, ratio, yerr=err, capsize=4, color=colors, alpha=0.8)
    for i, r in enumerate(rows):
        ax.hlines(
            r["target"],
            i - 0.45,
            i + 0.45,
            colors="k",
            linestyles="--",
            label="target" if i == 0 else "_nolegend_",
        )
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("step time, mm_parallel / Lightning")
    ax.set_title("Overhead on the fusion model (median ratio, range over repeats)")
    ax.legend(loc="upper right", fontsize=8)
    return save_figure(fig, "overhead", out_dir)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from lightning_mmpar.testing import spawn

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="2,4", help="process counts, comma-separated (2, 4)")
    p.add_argument("--repeats", type=int, default=4, help="A B rounds per pair")
    p.add_argument("--steps", type=int, default=12, help="steps per fit")
    p.add_argument("--warmup", type=int, default=2, help="first steps of a fit not timed")
    p.add_argument("--global-batch", type=int, default=16, help="samples per optimizer step")
    p.add_argument("--pairs", default=None, help="pair names, comma-separated (default: all)")
    p.add_argument("--smoke", action="store_true", help="2 processes, 2 steps, one repeat")
    p.add_argument("--out-dir", type=Path, default=None, help="default docs/results")
    args = p.parse_args(argv)
    if args.smoke:
        args.worlds, args.repeats, args.steps, args.warmup = "2", 1, 2, 1
    args.warmup = min(args.warmup, args.steps - 1)
    started = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    for size in (int(w) for w in args.worlds.split(",")):
        if size not in PAIRS:
            raise SystemExit(f"--worlds: {size} processes; choose from {sorted(PAIRS)}")
        names = None if args.pairs is None else args.pairs.split(",")
        per_rank = spawn(
            worker, size, args.repeats, args.steps, args.global_batch, names, timeout=900
        )
        results[str(size)] = summarise(per_rank, size, args.warmup, names)
    print(
        f"{'procs':>5} {'pair':8} {'ours ms':>8} {'theirs ms':>9} {'ratio':>6} {'spread':>6} "
        f"{'loop':>6} {'spread':>6} {'target':>6} {'met':>4} {'loss0 ours':>11} "
        f"{'loss0 theirs':>12} same"
    )
    for world, pairs in results.items():
        for name, r in pairs.items():
            print(
                f"{world:>5} {name:8} {r['ours_s'] * 1e3:8.1f} {r['theirs_s'] * 1e3:9.1f} "
                f"{r['ratio']:6.3f} {r['spread']:6.3f} {r['loop_ratio']:6.3f} "
                f"{r['loop_spread']:6.3f} {r['target']:6.2f} {r['met']!s:>4} "
                f"{r['first_loss']['ours'][0]:11.6f} {r['first_loss']['theirs'][0]:12.6f} "
                f"{r['same_work']}"
            )
    payload = {
        "config": {
            "yaml": str(CPU_YAML.name),
            "global_batch": args.global_batch,
            "steps": args.steps,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "threads_per_process": 1,
            "backend": "gloo",
        },
        "wall_s": round(time.perf_counter() - started, 1),
        "results": results,
    }
    write_result("overhead", payload, args.out_dir)
    if not args.smoke:
        plot(results, args.out_dir)
    differ = [
        f"{w} proc {n}"
        for w, pairs in results.items()
        for n, r in pairs.items()
        if not r["same_work"]
    ]
    if differ:
        raise SystemExit(
            f"the sides computed different losses ({', '.join(differ)}): the "
            "comparison is void; see first_loss / last_loss in the JSON"
        )
    return payload


if __name__ == "__main__":
    main()
