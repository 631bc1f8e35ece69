"""How one rank's step time and memory scale with the work: image tokens, text, layers, experts.

    python benchmarks/bench_scaling.py            # docs/results/scaling.{json,png}
    python benchmarks/bench_scaling.py --smoke    # base + one doubling of text length, 2 steps

Issue #14 item 7, on the product's own fusion model in one process (one thread): the recipe
module and data of ``recipes/clip_llama_cpu.yaml`` at its sizes (the base), then one size at a
time scaled by about 2 and 4: **image tokens** (image size 32 -> 48 -> 64 px at patch 8: 16 ->
36 -> 64 tokens; a square grid cannot double exactly), **text length** (the data's ``max_length``
x 2, x 4: captions padded), **layers** (vision and language towers both, 2 -> 4 -> 8, all
trained) and **experts** (``clip_llama_moe_cpu.yaml``'s MoE FFNs, 4 -> 8 -> 16 experts at top-2).

Measured per setting: **step time**, the median per-batch wall time (forward + backward + AdamW
through Lightning's ``Trainer``, :class:`bench_stability.StepTimer`) after ``--warmup`` batches,
and **memory**, the parameter bytes plus the bytes of the tensors autograd saves for backward in
one training step (``torch.autograd.graph.saved_tensors_hooks``; distinct storages, parameters
excluded). Expected: the exponent of the model's own FLOPs (forward + backward per sample,
``ClipLlamaModule.pipeline_block_specs``: ``lightning_mmpar.layout.measure_blocks``) and of its
memory estimate (parameter bytes + ``batch x`` the blocks' activation bytes) against the work.
Work ~ linear in tokens, layers and experts' parameters; attention's score FLOPs are quadratic in
the sequence it spans, so text and image-token doubling expect an exponent between the linear
parts' 1 (diluted by the towers that do not grow) and 2. The fitted exponent is the
least-squares slope of ``log(measured)`` on ``log(work)``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from lightning.pytorch import Callback

sys.path.insert(0, str(Path(__file__).parent))
from bench_stability import StepTimer
from report import CPU_YAML, ROOT, save_figure, write_result

MOE_YAML = ROOT / "recipes" / "clip_llama_moe_cpu.yaml"
FACTORS = {
    "image tokens": (32, 48, 64),
    "text length": (1, 2, 4),
    "layers": (2, 4, 8),
    "experts": (4, 8, 16),
}
"""Per axis, the settings: image size (px), text length multiple, layers per tower, experts."""


def config_of(axis: str, value: int, batch: int) -> dict[str, Any]:
    """The recipe YAML (the MoE one for ``experts``) at batch ``batch``, every decoder layer
    trained, with ``axis`` set to ``value`` (:data:`FACTORS`; each axis' first is the recipe's)."""
    config = yaml.safe_load((MOE_YAML if axis == "experts" else CPU_YAML).read_text())
    fusion, data = config["model"]["fusion"], config["data"]
    data["batch_size"] = batch
    config["model"]["finetune"]["train_decoder_layers"] = -1  # every layer trains
    if axis == "image tokens":
        fusion["vision"]["image_size"] = data["image_size"] = value
    elif axis == "text length":
        data["max_length"] = value * base_text_length()
    elif axis == "layers":
        fusion["vision"]["layers"] = fusion["language"]["num_hidden_layers"] = value
    elif axis == "experts":
        fusion["language"]["moe"]["num_experts"] = value
    return config


def base_text_length() -> int:
    """The CPU recipe data's caption length (its tokenizer's longest caption or prompt)."""
    from lightning_mmpar.recipes.partition import build_module

    _, data = build_module(yaml.safe_load(CPU_YAML.read_text()))
    return int(data.max_length)


def works(module: Any, data: Any) -> dict[str, float]:
    """The work variable of every axis: image tokens, text tokens, layers per tower, experts."""
    config = module.fusion_config
    moe = config.language.moe
    return {
        "image tokens": float((config.vision.image_size // config.vision.patch_size) ** 2),
        "text length": float(data.max_length),
        "layers": float(config.vision.layers),
        "experts": float(moe.num_experts if moe is not None else 0),
    }


class SavedBytes(Callback):
    """Bytes of the distinct storages autograd saves during the first training step's forward
    (``saved_tensors_hooks`` from batch start to ``on_before_backward``), parameters excluded."""

    def __init__(self) -> None:
        self.bytes = 0
        self._hooks: Any = None
        self._seen: dict[int, int] = {}

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
        if idx != 0:
            return
        params = {p.untyped_storage().data_ptr() for p in pl_module.parameters()}

        def pack(t: torch.Tensor) -> torch.Tensor:
            s = t.untyped_storage()
            if s.data_ptr() not in params:
                self._seen[s.data_ptr()] = max(self._seen.get(s.data_ptr(), 0), s.nbytes())
            return t

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._hooks.__enter__()

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks, self.bytes = None, sum(self._seen.values())


def run(axis: str, value: int, batch: int, steps: int, warmup: int) -> dict[str, Any]:
    """Train one setting ``steps`` batches; step time, memory, and the model's FLOPs estimate."""
    from lightning.pytorch import seed_everything

    from lightning_mmpar.recipes.partition import build_module
    from lightning_mmpar.testing import quiet_trainer

    seed_everything(0, verbose=False)
    module, data = build_module(config_of(axis, value, batch), meta=False)
    timer, saved = StepTimer(), SavedBytes()
    trainer = quiet_trainer(
        devices=1, max_steps=steps, limit_val_batches=0, callbacks=[timer, saved]
    )
    trainer.fit(module, datamodule=data)
    specs = module.pipeline_block_specs(int(data.max_length))
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    return {
        "value": value,
        "work": works(module, data)[axis],
        "works": works(module, data),
        "step_s": statistics.median(timer.times[warmup:]),
        "times": timer.times,
        "param_bytes": params,
        "saved_bytes": saved.bytes,
        "memory_bytes": params + saved.bytes,
        "flops_per_sample": sum(s.flops for s in specs),
        "flops_by_block": {s.name: s.flops for s in specs},
        "memory_estimate": params + batch * sum(s.activation_bytes for s in specs),
    }


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ``log y`` on ``log x`` (the fitted exponent)."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    var = sum((a - mx) ** 2 for a in lx)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True)) / var


def summarise(points: list[dict[str, Any]]) -> dict[str, Any]:
    w = [p["work"] for p in points]
    return {
        "points": points,
        "time_exponent": slope(w, [p["step_s"] for p in points]),
        "time_expected": slope(w, [p["flops_per_sample"] for p in points]),
        "memory_exponent": slope(w, [p["memory_bytes"] for p in points]),
        "memory_expected": slope(w, [p["memory_estimate"] for p in points]),
        "param_exponent": slope(w, [p["param_bytes"] for p in points]),
        "flops_exponent_by_block": {  # e.g. a decoder block's: its attention quadratic
            n: slope(w, [p["flops_by_block"][n] for p in points])
            for n in points[0]["flops_by_block"]
            if all(n in p["flops_by_block"] for p in points)
        },
    }


def plot(results: dict[str, Any], out_dir: Path | None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, exp, label in (
        (axes[0], "step_s", "time", "step time"),
        (axes[1], "memory_bytes", "memory", "params + saved"),
    ):
        for i, (axis, r) in enumerate(results.items()):
            pts, color = r["points"], f"C{i}"
            x = [p["work"] / pts[0]["work"] for p in pts]
            y = [p[key] / pts[0][key] for p in pts]
            ax.loglog(
                x,
                y,
                "o-",
                color=color,
                label=f"{axis}: {r[exp + '_exponent']:.2f} (exp. {r[exp + '_expected']:.2f})",
            )
            ax.loglog(x, [v ** r[exp + "_expected"] for v in x], "--", color=color, lw=0.8)
        ax.loglog([1, 4], [1, 4], ":", color="k", lw=0.8, label="linear")
        ax.set_xlabel("work / base")
        ax.set_ylabel(f"{label} / base")
        ax.set_title(label)
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.xaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
        ax.yaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
        ax.legend(fontsize=7)
    fig.suptitle("fitted exponent (expected: FLOPs / memory estimate, dashed; linear dotted)")
    return save_figure(fig, "scaling", out_dir)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="base + text x2, 2 steps")
    p.add_argument("--batch", type=int, default=72, help="samples per step (the recipe's 72)")
    p.add_argument("--steps", type=int, default=10, help="batches per setting")
    p.add_argument("--warmup", type=int, default=3, help="first batches not timed")
    p.add_argument(
        "--axes", default=",".join(FACTORS), help="comma-separated: " + ",".join(FACTORS)
    )
    p.add_argument("--out-dir", type=Path, default=None, help="default docs/results")
    args = p.parse_args(argv)
    axes = [a.strip() for a in args.axes.split(",")]
    if unknown := [a for a in axes if a not in FACTORS]:
        p.error(f"unknown axes {unknown}; choose from {list(FACTORS)}")
    if args.smoke:
        axes, args.steps, args.warmup, args.batch = ["text length"], 2, 1, 8
    args.warmup = min(args.warmup, args.steps - 1)
    torch.set_num_threads(1)
    started = time.perf_counter()
    base: dict[str, Any] | None = None
    results = {}
    for axis in axes:
        values = FACTORS[axis][:2] if args.smoke else FACTORS[axis]
        points = []
        for value in values:
            if axis not in ("experts",) and value == FACTORS[axis][0] and base is not None:
                points.append({**base, "value": value, "work": base["works"][axis]})  # once
                continue
            points.append(run(axis, value, args.batch, args.steps, args.warmup))
            if axis != "experts" and value == FACTORS[axis][0]:
                base = points[-1]
        results[axis] = summarise(points)
    print(f"{'axis':13} {'setting':>7} {'work':>6} {'step ms':>8} {'mem MB':>7} {'GFLOP/s':>8}")
    for axis, r in results.items():
        for pt in r["points"]:
            rate = pt["flops_per_sample"] * args.batch / pt["step_s"] / 1e9
            print(
                f"{axis:13} {pt['value']:7} {pt['work']:6.0f} {pt['step_s'] * 1e3:8.1f} "
                f"{pt['memory_bytes'] / 1e6:7.2f} {rate:8.2f}"
            )
        print(
            f"{axis:13} time exponent {r['time_exponent']:.2f} (FLOPs: {r['time_expected']:.2f})"
            f", memory {r['memory_exponent']:.2f} (estimate: {r['memory_expected']:.2f})"
            f", parameters {r['param_exponent']:.2f}"
        )
    payload = {
        "config": {
            "batch": args.batch,
            "steps": args.steps,
            "warmup": args.warmup,
            "threads": 1,
            "smoke": args.smoke,
            "factors": FACTORS,
        },
        "scaling": results,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    write_result("scaling", payload, args.out_dir)
    if not args.smoke:
        plot(results, args.out_dir)
    return payload


if __name__ == "__main__":
    main()
