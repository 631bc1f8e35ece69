"""GradientDriftMonitor / FP8FallbackCallback on one device: estimator math, faults, recovery."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

from lightning_mmpar.callbacks import (
    DriftConfig,
    FallbackConfig,
    FP8FallbackCallback,
    FP8FallbackError,
    GradientDriftMonitor,
    Snapshot,
)
from lightning_mmpar.callbacks.grad_stats import noise_scale_terms
from lightning_mmpar.callbacks.replicas import find_drift
from lightning_mmpar.testing import quiet_trainer
from tests.distributed.callbacks.stability_matrix import matrix_case
from tests.distributed.callbacks.stability_worker import TinyNet, fit, loader, read_jsonl, run_case


def test_noise_scale_estimator_recovers_known_gradient_statistics() -> None:
    """Per-sample grads g_i = G + sigma * eps_i: tr(S) = d sigma^2, |G|^2 known."""
    torch.manual_seed(0)
    d, sigma, b, n, trials = 50, 2.0, 4, 8, 4000
    G = torch.randn(d, dtype=torch.float64) * 0.5
    samples = G + sigma * torch.randn(trials, n, b, d, dtype=torch.float64)
    small = samples.mean(2).square().sum(-1).mean().item()  # each rank's micro-batch
    big = samples.mean((1, 2)).square().sum(-1).mean().item()  # the all-reduced gradient
    g2, trace = noise_scale_terms(small, big, b, b * n)
    assert g2 == pytest.approx(G.square().sum().item(), rel=0.1)
    assert trace == pytest.approx(d * sigma**2, rel=0.05)
    with pytest.raises(ValueError, match="b_big"):
        noise_scale_terms(1.0, 1.0, 8, 8)


def test_find_drift_majority_and_ties() -> None:
    table = torch.tensor([[[1.0, 1.0]], [[1.0, 1.0]], [[1.5, 1.5]]], dtype=torch.float64)
    drifting, ref = find_drift(table, rtol=1e-6, atol=0.0)
    assert drifting[:, 0].tolist() == [False, False, True] and int(ref[0]) == 0
    drifting, ref = find_drift(table[[2, 0]], rtol=1e-6, atol=0.0)  # tie: lowest rank wins
    assert drifting[:, 0].tolist() == [False, True] and int(ref[0]) == 0
    drifting, _ = find_drift(table, rtol=1.0, atol=0.0)  # within tolerance
    assert not drifting.any()


def test_monitor_alone_records_nonfinite_gradient(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyNet(fault=("nan_grad", 2, 0))
    mon = GradientDriftMonitor(DriftConfig(log_dir=str(tmp_path / "logs")))
    fit(model, [mon], tmp_path, steps=3)
    recs = read_jsonl(tmp_path / "logs" / "anomalies.jsonl")
    local = [r for r in recs if r["kind"] == "nonfinite_local_grad"]
    assert [(r["step"], r["rank"], r["param"], r["shape"]) for r in local] == [
        (2, 0, "fc1.weight", [32, 16])
    ]
    assert local[0]["action"] == "reported" and local[0]["values"]["local_norm"] == "nan"
    assert any(r["kind"] == "nonfinite_grad" and r["param"] == "fc1.weight" for r in recs)


def test_monitor_flags_exploding_module(tmp_path: Path) -> None:
    torch.manual_seed(0)
    mon = GradientDriftMonitor(max_module_grad_norm=1e-6, log_dir=str(tmp_path))
    fit(TinyNet(), [mon], tmp_path, steps=2)
    kinds = {(r.kind, r.param) for r in mon.anomalies.records}
    assert ("exploding_grad", "fc1") in kinds and ("exploding_grad", "norm") in kinds
    assert mon.last_report is not None and mon.last_report.anomalous


def test_fallback_single_device_nan(tmp_path: Path) -> None:
    res = run_case(str(tmp_path), "nan_grad", steps=6)
    assert res["precision"] == {"fc1": "bf16", "fc2": "fp8"} and res["finite"]
    assert res["counters"]["redone_steps"] == 1 and res["counters"]["fallbacks"] == 1
    fb = [r for r in read_jsonl(tmp_path / "anomalies.jsonl") if r["kind"] == "fp8_fallback"]
    assert len(fb) == 1 and fb[0]["shape"] == [32, 16] and fb[0]["step"] == 3
    assert fb[0]["values"]["grad_norm_after_redo"] > 0
    assert "clean" in fb[0]["action"] and "clipped grad norm to 1.0" in fb[0]["action"]


def test_persistent_fault_raises_after_bounded_retries(tmp_path: Path) -> None:
    with pytest.raises(FP8FallbackError, match="still anomalous after 2 recoveries"):
        run_case(str(tmp_path), "nan_grad", steps=6, persistent=True)
    fb = [r for r in read_jsonl(tmp_path / "anomalies.jsonl") if r["kind"] == "fp8_fallback"]
    assert [r["values"]["attempt"] for r in fb] == [1, 2]
    assert "switched ['fc1']" in fb[0]["action"] and "switched ['fc2']" in fb[1]["action"]


def test_return_to_fp8_after_clean_steps(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyNet(fp8=True, fault=("huge_input", 2, 0))
    fb = FP8FallbackCallback(FallbackConfig(return_to_fp8_after=2))
    fit(model, [GradientDriftMonitor(log_dir=str(tmp_path)), fb], tmp_path, steps=6)
    assert model.fc1.precision == "fp8" and fb.counters["returns_to_fp8"] == 1
    kinds = [r["kind"] for r in read_jsonl(tmp_path / "anomalies.jsonl")]
    assert kinds == ["fp8_fallback", "fp8_return"]


def test_snapshot_restores_weights_and_optimizer_without_aliasing() -> None:
    class T:
        pass

    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    trainer = T()
    trainer.optimizers, trainer.global_step = [opt], 5  # type: ignore[attr-defined]
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    snap = Snapshot()
    snap.take(trainer, model)  # type: ignore[arg-type]
    w0 = model.fc1.weight.detach().clone()
    m0 = opt.state[model.fc1.weight]["exp_avg"].clone()
    for _ in range(2):
        model(torch.randn(4, 16)).sum().backward()
        opt.step()
    assert not torch.equal(model.fc1.weight, w0)
    assert snap.restore(trainer, model) == 5  # type: ignore[arg-type]
    assert torch.equal(model.fc1.weight, w0)
    assert torch.equal(opt.state[model.fc1.weight]["exp_avg"], m0)
    opt.step()  # mutating the restored state must not touch the snapshot
    snap.restore(trainer, model)  # type: ignore[arg-type]
    assert torch.equal(opt.state[model.fc1.weight]["exp_avg"], m0)


@pytest.mark.parametrize(
    ("cls", "kwargs", "msg"),
    [
        (DriftConfig, {"explode_factor": 1.0}, "explode_factor"),
        (DriftConfig, {"on_drift": "fix"}, "on_drift"),
        (DriftConfig, {"check_every_n_steps": 0}, "check_every_n_steps"),
        (FallbackConfig, {"max_retries": 0}, "max_retries"),
        (FallbackConfig, {"clip_grad_norm": -1.0}, "clip_grad_norm"),
        (FallbackConfig, {"fallback_precision": "fp16"}, "fallback_precision"),
    ],
)
def test_config_validation(cls: type, kwargs: dict[str, object], msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        cls(**kwargs)


class _WindowProbe(pl.Callback):
    """After the fallback callback: the batches of each step, the longest window held, and at
    ``step`` the gradient the optimizer gets next to the one of that step's batches alone."""

    def __init__(self, fb: FP8FallbackCallback, step: int) -> None:
        self.fb, self.step = fb, step
        self.batches: dict[int, list[list[torch.Tensor]]] = {}
        self.longest = 0
        self.diff: float | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, i: int) -> None:
        self.batches.setdefault(trainer.global_step, []).append([t.clone() for t in batch])
        self.longest = max(self.longest, len(self.fb._window))

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, opt: Any) -> None:
        if trainer.global_step != self.step:
            return
        ref = TinyNet()  # the restored snapshot = the weights this step started from
        ref.load_state_dict(self.fb.snapshot.tensors)
        for x, y in self.batches[self.step]:
            (F.mse_loss(ref(x), y) / trainer.accumulate_grad_batches).backward()
        got = dict(pl_module.named_parameters())
        self.diff = max(
            float((got[n].grad - p.grad).abs().max() / p.grad.abs().max())
            for n, p in ref.named_parameters()
        )


@pytest.mark.parametrize("accumulate", [1, 2])
def test_redo_recomputes_only_the_current_accumulation_window(
    tmp_path: Path, accumulate: int
) -> None:
    """Issue 15.1: the window held the batches since training started; a redo summed them."""
    torch.manual_seed(0)
    model = TinyNet(fault=("nan_grad", 3, 0))
    mon = GradientDriftMonitor(log_dir=str(tmp_path))
    fb = FP8FallbackCallback(FallbackConfig(clip_grad_norm=None), monitor=mon)
    probe = _WindowProbe(fb, step=3)
    trainer = quiet_trainer(
        max_steps=5,
        accumulate_grad_batches=accumulate,
        callbacks=[mon, fb, probe],
        default_root_dir=str(tmp_path),
    )
    trainer.fit(model, loader())
    assert fb.counters["redone_steps"] == 1
    assert len(probe.batches[3]) == accumulate and probe.longest == accumulate
    assert probe.diff is not None and probe.diff < 1e-5


def test_drift_fingerprints_nan_on_every_rank_is_not_drift() -> None:
    nan = float("nan")
    table = torch.tensor([[[nan, nan]], [[nan, nan]], [[1.0, 1.0]]], dtype=torch.float64)
    drifting, ref = find_drift(table, rtol=1e-6, atol=0.0)
    assert drifting[:, 0].tolist() == [False, False, True] and int(ref[0]) == 0


def test_matrix_single_device(tmp_path: Path) -> None:
    """The trainer matrix on one device: NaN gradient detected and (with the fallback) redone;
    a norm perturbation has no replica to differ from, so nothing is reported for it."""
    for fallback in (False, True):
        r = matrix_case(str(tmp_path / str(fallback)), "single", fallback)
        recs = {(x["kind"], x["step"], x["param"]) for x in r["records"]}
        assert ("nonfinite_local_grad", 4, "fc1.weight") in recs
        assert {s for _, s, _ in recs} == {4} and r["groups"] == {}
        assert all(math.isfinite(v) for v in r["losses"])
        if fallback:
            assert r["counters"]["redone_steps"] == 1 and len(r["losses"]) == 6
            assert all(math.isfinite(float(t.sum())) for t in r["local"].values())
        # every clean step logs its own gradient norm; the NaN step (monitor alone) logs NaN,
        # not the last finite value
        if not fallback:
            assert math.isnan(r["logged"][4]), r["logged"]
        clean = [i for i in range(len(r["logged"])) if i != 4]
        for i in clean:
            assert r["logged"][i] == pytest.approx(r["probe"][i], rel=1e-6)
