"""Tiny models, fault injectors and Trainer runs for the stability tests.

Importable by spawned processes (``lightning_mmpar.testing.spawn``) and by the unit tests.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mmpar.callbacks.fp8_fallback import FP8FallbackCallback
from lightning_mmpar.callbacks.grad_drift import GradientDriftMonitor
from lightning_mmpar.precision.fp8 import FP8Policy, convert_to_fp8, fp8_modules


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class TinyNet(pl.LightningModule):
    """Stock LightningModule: Linear -> LayerNorm -> GELU -> Linear regression.

    ``fault`` = ``(kind, step, rank)`` injects one fault: ``nan_grad`` (NaN into ``fc1.weight``'s
    gradient), ``perturb_norm`` (add 1e-2 to ``norm.weight`` before the step), ``huge_input``
    (multiply the batch by 1e4, in place). ``persistent=True`` re-injects on every attempt.
    """

    def __init__(
        self, fp8: bool = False, fault: tuple[str, int, int] | None = None,
        persistent: bool = False, lr: float = 0.05,
    ) -> None:  # fmt: skip
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.fc2 = nn.Linear(32, 1)
        self.fault, self.persistent, self.lr = fault, persistent, lr
        self.fired = 0
        self.losses: list[float] = []
        if fp8:
            convert_to_fp8(self, FP8Policy(backend="emulate", history_len=4))
        # registered before the monitor's capture hook, so it runs first
        self.fc1.weight.register_hook(self._nan_hook)

    def _armed(self, kind: str) -> bool:
        if self.fault is None or self.fault[0] != kind:
            return False
        _, step, rank = self.fault
        hit = self.trainer.global_step == step and _rank() == rank
        return hit and (self.persistent or self.fired == 0)

    def _nan_hook(self, grad: Tensor) -> Tensor:
        if self._armed("nan_grad"):
            self.fired += 1
            grad = grad.clone()
            grad[0, 0] = float("nan")
        return grad

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.norm(self.fc1(x))))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._armed("huge_input"):  # in the batch itself, so a redo sees it too
            self.fired += 1
            batch[0].mul_(1e4)
        if self._armed("perturb_norm"):
            self.fired += 1
            with torch.no_grad():
                self.norm.weight[3] += 1e-2

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def loader(n: int = 64, batch: int = 8, seed: int = 0) -> DataLoader:
    """Deterministic regression data: y = sin(x @ w)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    y = torch.sin(x @ torch.randn(16, 1, generator=g))
    return DataLoader(TensorDataset(x, y), batch_size=batch)


def fit(
    model: pl.LightningModule, callbacks: list[pl.Callback], root: Path, steps: int,
    strategy: Any = "auto", devices: int = 1,
) -> pl.Trainer:  # fmt: skip
    """A small CPU Trainer run."""
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(root), callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(model, loader())
    return trainer


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """All records of an anomalies.jsonl file ([] if missing)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_case(root: str, kind: str | None, steps: int = 8, **net: Any) -> dict[str, Any]:
    """One Trainer run with both callbacks; returns what the assertions need."""
    torch.manual_seed(0)
    fault = None if kind is None else (kind, 3, 1 if dist.is_initialized() else 0)
    model = TinyNet(fp8=net.pop("fp8", True), fault=fault, **net)
    mon = GradientDriftMonitor(warmup_steps=2)
    fb = FP8FallbackCallback()
    devices = 2 if dist.is_initialized() else 1
    strategy = "ddp" if devices > 1 else "auto"
    fit(model, [mon, fb], Path(root), steps, strategy=strategy, devices=devices)
    return {
        "rank": _rank(),
        "losses": model.losses,
        "final_loss": model.losses[-1],
        "precision": {n: m.precision for n, m in fp8_modules(model).items()},
        "counters": dict(fb.counters),
        "records": [r.kind for r in mon.anomalies.records],
        "noise_scale": mon.last_report.noise_scale if mon.last_report else None,
        "ratio": mon.last_report.local_global_ratio if mon.last_report else None,
        "finite": all(math.isfinite(v) for v in model.losses),
        "weight_sum": float(model.fc1.weight.detach().double().sum()),
        "norm_sum": float(model.norm.weight.detach().double().sum()),
    }


def stock_case(root: str) -> dict[str, Any]:
    """Stock module (no FP8), both callbacks, CSVLogger: metrics must reach the logger."""
    from lightning.pytorch.loggers import CSVLogger

    torch.manual_seed(0)
    model = TinyNet(fp8=False)
    mon, fb = GradientDriftMonitor(), FP8FallbackCallback()
    trainer = pl.Trainer(
        strategy="ddp" if dist.is_initialized() else "auto", accelerator="cpu",
        devices=2 if dist.is_initialized() else 1, max_steps=10, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[mon, fb],
        logger=CSVLogger(root, name="stock"), log_every_n_steps=1,
    )  # fmt: skip
    trainer.fit(model, loader())
    return {
        "metrics": sorted(trainer.logged_metrics),
        "noise_scale": mon.last_report.noise_scale if mon.last_report else None,
        "ratio": mon.last_report.local_global_ratio if mon.last_report else None,
        "records": len(mon.anomalies.records),
        "counters": dict(fb.counters),
        "log_dir": trainer.log_dir,
    }


def tp_fp8_check(rank: int, world: int) -> dict[str, float]:
    """Float8Linear under DTensor TP (colwise -> rowwise) vs per-shard local FP8 layers."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from lightning_mmpar.precision.fp8 import Float8Linear

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    ref = copy.deepcopy(mlp)
    x = torch.randn(4, 16)
    policy = FP8Policy(backend="emulate")
    convert_to_fp8(mlp, policy)
    parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    out = mlp(x)
    out.sum().backward()
    # reference: the same FP8 casts on this rank's shards, by hand
    l0 = nn.Linear(16, 32 // world)
    l2 = nn.Linear(32 // world, 8, bias=False)
    with torch.no_grad():
        l0.weight.copy_(ref[0].weight.chunk(world, 0)[rank])
        l0.bias.copy_(ref[0].bias.chunk(world, 0)[rank])
        l2.weight.copy_(ref[2].weight.chunk(world, 1)[rank])
    f0 = Float8Linear.from_linear(l0, policy, "emulate")
    f2 = Float8Linear.from_linear(l2, policy, "emulate")
    partial = f2(F.gelu(f0(x)))
    full = partial.detach().clone()
    dist.all_reduce(full)
    full += ref[2].bias.detach()
    partial.backward(torch.ones_like(partial))
    w0: Any = mlp[0].weight
    w2: Any = mlp[2].weight
    return {
        "out_diff": float((out - full).abs().max()),
        "w0_grad_diff": float((w0.grad.to_local() - f0.weight.grad).abs().max()),
        "w2_grad_diff": float((w2.grad.to_local() - f2.weight.grad).abs().max()),
        "fp32_rel_err": float((out - ref(x)).norm() / ref(x).norm()),
    }


def ddp_world(rank: int, world: int, root: str) -> dict[str, Any]:
    """Every multi-process stability check, in one world (process start-up is costly)."""
    out: dict[str, Any] = {}
    for kind in (None, "nan_grad", "huge_input", "perturb_norm"):
        out[str(kind)] = run_case(f"{root}/{kind}", kind, steps=12)
    out["stock"] = stock_case(f"{root}/stock")
    out["tp"] = tp_fp8_check(rank, world)
    return out
