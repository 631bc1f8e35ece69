"""Overhead of the stability callbacks and speed of FP8 emulation on CPU (ratios, one run).

    python benchmarks/bench_stability.py            # writes benchmarks/results/stability.json

1. Step time of a Lightning run with no callback, with GradientDriftMonitor, and with
   GradientDriftMonitor + FP8FallbackCallback (snapshot every step), interleaved in one process
   so machine load affects all three alike; medians of per-step wall times.
2. Forward+backward time of a stack of Linear layers in fp32, bf16 and FP8 emulation on CPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mmpar.callbacks import FP8FallbackCallback, GradientDriftMonitor
from lightning_mmpar.precision import FP8Policy, convert_to_fp8, set_precision


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
    cbs: list[pl.Callback] = [timer]
    if variant != "off":
        cbs.append(GradientDriftMonitor(log_dir=root))
    if variant == "monitor+fallback":
        cbs.append(FP8FallbackCallback())
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=False, callbacks=cbs,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=root,
    )  # fmt: skip
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "stability.json"))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = {
        "host": {"machine": platform.machine(), "torch": torch.__version__, "threads": 1},
        "callback_overhead_small": callback_overhead(args.repeats, width=256, depth=4, steps=23),
        "callback_overhead_large": callback_overhead(args.repeats, width=1024, depth=4, steps=13),
        "precision_cpu": precision_speed(width=512, depth=4, tokens=256, iters=12),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
