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

from lightning_mmpar.callbacks import FP8FallbackCallback, GradientDriftMonitor
from lightning_mmpar.examples.toy_transformer import ToyConfig, ToyTransformer, make_tokens
from lightning_mmpar.parallel.comm import to_local
from lightning_mmpar.precision import FP8Policy, convert_to_fp8, fp8_modules


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class TinyNet(pl.LightningModule):
    """Stock LightningModule: Linear -> LayerNorm -> GELU -> Linear regression.

    ``fault`` = ``(kind, step, rank)`` injects one fault: ``nan_grad`` (NaN into ``fc1.weight``'s
    gradient), ``perturb_norm`` (add 1e-2 to ``norm.weight`` before the step), ``huge_input``
    (multiply the batch by 1e4, in place). ``persistent=True`` re-injects on every attempt.
    """

    def __init__(
        self,
        fp8: bool = False,
        fault: tuple[str, int, int] | None = None,
        persistent: bool = False,
        lr: float = 0.05,
    ) -> None:
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
    model: pl.LightningModule,
    callbacks: list[pl.Callback],
    root: Path,
    steps: int,
    strategy: Any = "auto",
    devices: int = 1,
) -> pl.Trainer:
    """A small CPU Trainer run."""
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        callbacks=callbacks,
    )
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
        strategy="ddp" if dist.is_initialized() else "auto",
        accelerator="cpu",
        devices=2 if dist.is_initialized() else 1,
        max_steps=10,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[mon, fb],
        logger=CSVLogger(root, name="stock"),
        log_every_n_steps=1,
    )
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

    from lightning_mmpar.precision import Float8Linear

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
    from tests.distributed.callbacks.stability_matrix import matrix_world

    out: dict[str, Any] = {}
    for kind in (None, "nan_grad", "huge_input", "perturb_norm"):
        out[str(kind)] = run_case(f"{root}/{kind}", kind, steps=12)
    out["stock"] = stock_case(f"{root}/stock")
    out["tp"] = tp_fp8_check(rank, world)
    out.update(matrix_world(rank, world, f"{root}/matrix"))  # ddp, ModelParallel + fully_shard
    return out


# ---------------------------------------------------------------------------- mm_parallel
class FaultyToy(ToyTransformer):
    """The example toy LM with optional FP8 layers and one injected fault.

    ``fault`` = ``(kind, step, rank, param)``: ``nan_grad`` puts a NaN into that parameter's
    local gradient (a hook registered after the TP plan, so on the DTensor parameter; under a
    pipeline it fires in the first micro-batch); ``perturb`` adds 1e-2 to element 3 of that
    parameter's local tensor before the step.
    """

    def __init__(self, fp8: bool = False, fault: tuple[str, int, int, str] | None = None) -> None:
        super().__init__(ToyConfig())
        self.fault = fault
        self.fired = 0
        self.losses: list[float] = []
        if fp8:  # before configure_model: the TP plan then shards the Float8Linear weights
            convert_to_fp8(self, FP8Policy(backend="emulate", history_len=4))

    def _armed(self, kind: str) -> bool:
        if self.fault is None or self.fault[0] != kind or self.fired:
            return False
        return self.trainer.global_step == self.fault[1] and _rank() == self.fault[2]

    def arm(self) -> None:
        """Register the NaN hook; called by :class:`Arm` once the strategy has set up the model
        (moving DTensor parameters to the device swaps them, losing earlier hooks)."""
        if self.fault is not None and self.fault[0] == "nan_grad" and _rank() == self.fault[2]:
            dict(self.named_parameters())[self.fault[3]].register_hook(self._nan_hook)

    def _nan_hook(self, grad: Tensor) -> Tensor:
        if not self._armed("nan_grad"):
            return grad
        from torch.distributed.tensor import DTensor

        self.fired += 1
        local = to_local(grad).clone()
        local.view(-1)[0] = float("nan")
        if isinstance(grad, DTensor):
            return DTensor.from_local(local, grad.device_mesh, grad.placements, run_check=False)
        return local

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.fault is not None and self._armed("perturb"):
            self.fired += 1
            with torch.no_grad():
                to_local(dict(self.named_parameters())[self.fault[3]]).view(-1)[3] += 1e-2

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(self.trainer.callback_metrics["train_loss"]))


class Arm(pl.Callback):
    """First in ``callbacks``: arms the fault hooks before the monitor registers its own."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        pl_module.arm()


class NormProbe(pl.Callback):
    """At step 0 (after the monitor): the monitor's global norm, and the norm recomputed from
    the full gradients (``full_tensor()`` per parameter, stages summed over the pp group)."""

    def __init__(self, mon: GradientDriftMonitor) -> None:
        self.mon = mon
        self.out: dict[str, float] = {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        if trainer.global_step != 0 or self.out:
            return
        from torch.distributed.tensor import DTensor

        sq = torch.zeros((), dtype=torch.float64)
        for _, p in pl_module.named_parameters():
            if p.grad is not None:
                g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                sq += g.double().square().sum()
        strategy: Any = trainer.strategy
        pp = strategy.parallel_dims.get_mesh("pp")
        if pp.size() > 1:
            dist.all_reduce(sq, group=pp.get_group())
        assert self.mon.last_report is not None
        self.out = {"monitor": self.mon.last_report.grad_norm, "full": float(sq.sqrt())}


def mm_fit(
    root: str,
    world: int,
    tp: int,
    pp: int,
    data_parallel: str,
    steps: int,
    fp8: bool = False,
    fault: tuple[str, int, int, str] | None = None,
    fallback: bool = True,
) -> dict[str, Any]:
    """One mm_parallel Trainer run of :class:`FaultyToy` with the stability callbacks."""
    from lightning_mmpar import MultimodalParallelStrategy

    torch.manual_seed(0)
    model = FaultyToy(fp8=fp8, fault=fault)
    mon = GradientDriftMonitor(warmup_steps=2, log_dir=root)
    probe = NormProbe(mon)
    fb = FP8FallbackCallback(monitor=mon) if fallback else None
    strategy = MultimodalParallelStrategy(
        tensor_parallel=tp,
        pipeline_parallel=pp,
        data_parallel=data_parallel,  # type: ignore[arg-type]
        micro_batches=2 * pp if pp > 1 else None,
    )
    dp = world // (tp * pp)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=world,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=[Arm(), mon, probe, *([fb] if fb else [])],
        num_sanity_val_steps=0,
    )
    cfg = model.cfg
    data = make_tokens(5 * 8, cfg)
    trainer.fit(model, DataLoader(data, batch_size=8 // dp))  # type: ignore[arg-type]
    named = dict(model.named_parameters())
    prints = {n: [float(to_local(p).detach().double().sum())] for n, p in named.items()}
    rep = mon.last_report
    return {
        "rank": _rank(),
        "losses": model.losses,
        "records": [r.kind for r in mon.anomalies.records],
        "groups": {g.name: (len(g.params), g.skipped) for g in mon.groups},
        "probe": probe.out,
        "noise_scale": rep.noise_scale if rep else None,
        "ratio": rep.local_global_ratio if rep else None,
        "grad_norm": rep.grad_norm if rep else None,
        "counters": dict(fb.counters) if fb else {},
        "precision": {n: m.precision for n, m in fp8_modules(model).items()},
        "fingerprints": prints,
        "pipeline_grads_left": getattr(trainer.strategy, "_pipeline_grads", None) is not None,
    }


def mm_world(rank: int, world: int, root: str) -> dict[str, Any]:
    """All mm_parallel stability runs in one 4-rank world (ranks: tp fastest, then dp, pp)."""
    from tests.distributed.callbacks.stability_matrix import matrix_world

    out: dict[str, Any] = {}
    # tp2 x dp2, DDP all-reduce: clean; then a TP/DP-replicated norm weight perturbed on rank 3
    out["clean_tp2dp2"] = mm_fit(f"{root}/clean_tp2dp2", world, 2, 1, "ddp", steps=6)
    fault = ("perturb", 3, 3, "layers.0.norm1.weight")
    out["drift_tp2dp2"] = mm_fit(f"{root}/drift_tp2dp2", world, 2, 1, "ddp", 6, fault=fault)
    # tp2 x pp2 (1F1B, 4 micro-batches): clean; then FP8 with a NaN in rank 3's shard
    out["clean_tp2pp2"] = mm_fit(f"{root}/clean_tp2pp2", world, 2, 2, "ddp", steps=6)
    fault = ("nan_grad", 2, 3, "layers.3.up.weight")
    out["nan_tp2pp2"] = mm_fit(f"{root}/nan_tp2pp2", world, 2, 2, "ddp", 6, fp8=True, fault=fault)
    out.update(matrix_world(rank, world, f"{root}/matrix"))  # ModelParallel tp2 x dp2, mm_parallel
    return out
