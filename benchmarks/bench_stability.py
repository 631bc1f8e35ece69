"""Overhead of the stability callbacks and speed of FP8 emulation on CPU (ratios, one run).

    python benchmarks/bench_stability.py            # writes docs/results/stability.json
    python benchmarks/bench_stability.py --smoke --out-dir /tmp/r   # a few steps of each

1. Step time of a Lightning run with no callback, with GradientDriftMonitor, and with
   GradientDriftMonitor + FP8FallbackCallback (snapshot every step), interleaved in one process
   so machine load affects all three alike; medians of per-step wall times.
2. The same on the fusion model (the recipe's ``ClipLlamaModule`` at the recipe tests' tiny
   sizes, ``tests/recipes/recipe_faults_worker.tiny_module``) under Lightning ``ddp`` with 2
   gloo processes: the three variants interleaved A B C A B C, per-step times of both ranks
   (a step waits for the slower rank); the median overhead in ms and as a ratio, and the
   spread of the per-repeat medians.
3. Forward+backward time of a stack of Linear layers in fp32, bf16 and FP8 emulation on CPU.
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

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from report import write_result
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mmpar.callbacks import FP8FallbackCallback, GradientDriftMonitor
from lightning_mmpar.precision import FP8Policy, convert_to_fp8, set_precision
from lightning_mmpar.testing import quiet_trainer, spawn

VARIANTS = ("off", "monitor", "monitor+fallback")


class MLP(pl.LightningModule):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()]
        self.net = nn.Sequential(*layers, nn.Linear(width, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class StepTimer(pl.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self._t = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        self._t = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._t)


def run(variant: str, width: int, depth: int, steps: int, root: str) -> list[float]:
    torch.manual_seed(0)
    x, y = torch.randn(steps * 32, width), torch.randn(steps * 32, 1)
    timer = StepTimer()
    cbs: list[pl.Callback] = [timer, *_variant_callbacks(variant, root)]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        callbacks=cbs,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    trainer.fit(MLP(width, depth), DataLoader(TensorDataset(x, y), batch_size=32))
    return timer.times[3:]  # drop warm-up steps


def callback_overhead(repeats: int, width: int, depth: int, steps: int) -> dict[str, Any]:
    times: dict[str, list[float]] = {"off": [], "monitor": [], "monitor+fallback": []}
    with tempfile.TemporaryDirectory() as root:
        for _ in range(repeats):
            for variant in times:
                times[variant] += run(variant, width, depth, steps, root)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "model": f"{depth} x (Linear {width}x{width} + LayerNorm + GELU), batch 32, Adam",
        "median_step_s": med,
        "ratio_monitor_vs_off": med["monitor"] / med["off"],
        "ratio_monitor_fallback_vs_off": med["monitor+fallback"] / med["off"],
        "steps_per_variant": len(times["off"]),
    }


def _variant_callbacks(variant: str, root: str) -> list[pl.Callback]:
    cbs: list[pl.Callback] = []
    if variant != "off":
        cbs.append(GradientDriftMonitor(log_dir=root))
    if variant == "monitor+fallback":
        cbs.append(FP8FallbackCallback())
    return cbs


def _fusion_rank(rank: int, world: int, repeats: int, steps: int, root: str) -> Any:
    """One rank of the fusion-model ddp benchmark: per variant, per repeat, step times."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's tests/
    from tests.recipes.recipe_faults_worker import batches, digits, tiny_module

    torch.set_num_threads(1)
    data = digits()
    loader = batches(data, steps)
    out: dict[str, list[list[float]]] = {v: [] for v in VARIANTS}
    for _ in range(repeats):
        for variant in VARIANTS:
            timer = StepTimer()
            trainer = quiet_trainer(
                strategy="ddp",
                devices=world,
                max_steps=steps,
                use_distributed_sampler=False,
                limit_val_batches=0,
                callbacks=[timer, *_variant_callbacks(variant, root)],
                default_root_dir=root,
            )
            trainer.fit(tiny_module(data.vocab_size), DataLoader(loader, batch_size=None))  # type: ignore[arg-type]
            out[variant].append(timer.times[3:])  # drop warm-up steps
    return out


def fusion_ddp_overhead(repeats: int, steps: int) -> dict[str, Any]:
    """Section 2 of the module docstring (2 gloo processes on CPU)."""
    with tempfile.TemporaryDirectory() as root:
        ranks = spawn(_fusion_rank, 2, repeats, steps, root, timeout=1800)
    # a ddp step is as slow as its slower rank
    per_step = {
        v: [[max(ts) for ts in zip(*(r[v][i] for r in ranks), strict=True)] for i in range(repeats)]
        for v in VARIANTS
    }
    med = {v: statistics.median([t for rep in per_step[v] for t in rep]) for v in VARIANTS}
    rep_med = {v: [statistics.median(rep) for rep in per_step[v]] for v in VARIANTS}
    res: dict[str, Any] = {
        "model": "recipe ClipLlamaModule, tiny sizes (recipe_faults_worker.tiny_module), batch 8,"
        " Lightning ddp, 2 gloo processes x 1 thread",
        "median_step_s": med,
        "per_repeat_median_step_s": rep_med,
        "steps_per_variant": sum(len(rep) for rep in per_step["off"]),
    }
    for v in VARIANTS[1:]:
        ratios = [a / b for a, b in zip(rep_med[v], rep_med["off"], strict=True)]
        res[f"overhead_ms_{v}"] = 1e3 * (med[v] - med["off"])
        res[f"ratio_{v}_vs_off"] = med[v] / med["off"]
        res[f"ratio_{v}_vs_off_spread"] = [min(ratios), max(ratios)]
    return res


def _fwd_bwd_time(model: nn.Module, x: torch.Tensor, iters: int) -> float:
    out: list[float] = []
    for _ in range(iters):
        t = time.perf_counter()
        model(x).square().mean().backward()
        out.append(time.perf_counter() - t)
    return statistics.median(out[2:])


def precision_speed(width: int, depth: int, tokens: int, iters: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
    convert_to_fp8(model, FP8Policy(backend="emulate"))
    x = torch.randn(tokens, width)
    res = {}
    for prec in ("fp32", "bf16", "fp8"):
        set_precision(model, prec)  # type: ignore[arg-type]
        res[prec] = _fwd_bwd_time(model, x, iters)
    return {
        "model": f"{depth} x Linear {width}x{width}, {tokens} tokens, forward+backward",
        "median_s": res,
        "ratio_bf16_vs_fp32": res["bf16"] / res["fp32"],
        "ratio_fp8_emulation_vs_fp32": res["fp8"] / res["fp32"],
        "ratio_fp8_emulation_vs_bf16": res["fp8"] / res["bf16"],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out-dir", type=Path, default=None, help="default docs/results")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fusion-steps", type=int, default=23)
    parser.add_argument("--smoke", action="store_true", help="one repeat of a few steps each")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    steps = (6, 6, 6, 6) if args.smoke else (23, 13, args.fusion_steps, 12)
    repeats = 1 if args.smoke else args.repeats
    result = {
        "callback_overhead_small": callback_overhead(repeats, width=256, depth=4, steps=steps[0]),
        "callback_overhead_large": callback_overhead(repeats, width=1024, depth=4, steps=steps[1]),
        "fusion_ddp_overhead": fusion_ddp_overhead(repeats, steps=steps[2]),
        "precision_cpu": precision_speed(width=512, depth=4, tokens=256, iters=steps[3]),
    }
    write_result("stability", result, args.out_dir)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
