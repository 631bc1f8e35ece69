"""ExpertLoadMonitor: logged values equal hand-computed stats; heatmap; forced load; arguments.

One in-process 3-step fit on one CPU device with a CSVLogger (``log_every_n_steps=2``, so the
first logged interval spans two batches) and two MoE layers: ``moe_a`` (top-2, capacity 1.0:
drops) and ``moe_b`` (top-1, dropless, aux-free bias forcing every route to expert 0).
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mmpar.callbacks import ExpertLoadMonitor
from lightning_mmpar.callbacks.grad_stats import log_due
from lightning_mmpar.models.moe import MoEFeedForward
from lightning_mmpar.models.moe_routing import MoEConfig

E, D, S = 4, 8, 6


class TinyMoE(pl.LightningModule):
    """``x [B, S, D]`` through two MoE layers; first half of each sequence text, rest vision."""

    def __init__(self) -> None:
        super().__init__()
        self.moe_a = MoEFeedForward(
            D,
            MoEConfig(
                num_experts=E, top_k=2, ffn_width=8, router_dim=8, capacity_factor=1.0, init_std=0.5
            ),
        )
        self.moe_b = MoEFeedForward(
            D,
            MoEConfig(
                num_experts=E,
                top_k=1,
                ffn_width=8,
                router_dim=8,
                capacity_factor=None,
                load_balancing="aux_free",
            ),
        )
        self.moe_b.expert_bias[:, 0] = 100.0  # every route of both modalities to expert 0
        self.head = nn.Linear(D, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (batch,) = batch
        modality = torch.zeros(batch.shape[:2], dtype=torch.long)
        modality[:, S // 2 :] = 1
        padding = torch.zeros(batch.shape[:2], dtype=torch.bool)
        padding[0, -1] = True
        h = batch + self.moe_a(batch, modality, padding)
        h = h + self.moe_b(h, modality, padding)
        return self.head(h).pow(2).mean() + self.moe_a.aux_loss + self.moe_b.aux_loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Recorder(pl.Callback):
    """Runs before the monitor: each batch's ``last_stats`` (as floats) and whether it logs."""

    def __init__(self) -> None:
        self.batches: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        stats = {
            (name, mod): {f: getattr(s, f).double().clone() for f in s.__dataclass_fields__}
            for name in ("moe_a", "moe_b")
            for mod, s in getattr(pl_module, name).last_stats.items()
        }
        self.batches.append({"stats": stats, "due": log_due(trainer)})


def expected(batches: list[dict[str, Any]], key: tuple[str, str]) -> dict[str, float]:
    """The metrics of ``key`` over ``batches``, computed from the recorded ``MoEStats``."""
    rows = [b["stats"][key] for b in batches]
    tokens = sum(float(r["tokens"]) for r in rows)
    demand = sum(r["tokens_per_expert"] for r in rows)
    kept = sum(r["kept_per_expert"] for r in rows)

    def mean(f: str) -> float:
        return sum(float(r["tokens"]) * float(r[f]) for r in rows) / tokens

    return {
        "top1_share": mean("top1_share"),
        "routing_entropy_bits": mean("routing_entropy_bits"),
        "load_balancing_loss": mean("load_balancing_loss"),
        "z_loss": mean("z_loss"),
        "dropped_fraction": 1 - float(kept.sum()) / float(demand.sum()),
        "experts_per_token": float(kept.sum()) / tokens,
        "max_load": float(demand.max()) / float(demand.sum()) * E,
    }


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("expert_load")
    torch.manual_seed(0)
    model, rec, mon = TinyMoE(), Recorder(), ExpertLoadMonitor()
    data = DataLoader(TensorDataset(torch.randn(6, S, D)), batch_size=2)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        log_every_n_steps=2,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[rec, mon],
        logger=CSVLogger(root, name="moe"),
    )
    trainer.fit(model, data)
    with open(Path(trainer.log_dir) / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("moe/moe_a/text/max_load")]
    return {"rec": rec, "mon": mon, "rows": rows, "trainer": trainer}


def test_logged_values_equal_hand_computed_interval_stats(fitted: dict[str, Any]) -> None:
    batches, rows = fitted["rec"].batches, fitted["rows"]
    intervals, start = [], 0
    for i, b in enumerate(batches):
        if b["due"]:
            intervals.append(batches[start : i + 1])
            start = i + 1
    assert [len(iv) for iv in intervals] == [2], "log_every_n_steps=2 over 3 steps: one log"
    assert len(rows) == len(intervals)
    checked = 0
    for row, iv in zip(rows, intervals, strict=True):
        for key in [("moe_a", "text"), ("moe_a", "vision"), ("moe_b", "text"), ("moe_b", "vision")]:
            for metric, want in expected(iv, key).items():
                got = float(row[f"moe/{key[0]}/{key[1]}/{metric}"])
                assert got == pytest.approx(want, rel=1e-5, abs=1e-7), (key, metric)
                checked += 1
    assert checked == 28
    # the interval really spans both batches (a last-batch-only value would differ)
    one = expected(intervals[0][-1:], ("moe_a", "text"))["top1_share"]
    assert float(rows[0]["moe/moe_a/text/top1_share"]) != pytest.approx(one, rel=1e-9)
    assert float(rows[0]["moe/moe_a/text/dropped_fraction"]) > 0  # capacity 1.0 drops


def test_forced_layer_max_load_is_num_experts(fitted: dict[str, Any]) -> None:
    row = fitted["rows"][0]
    for mod in ("text", "vision"):
        assert float(row[f"moe/moe_b/{mod}/max_load"]) == pytest.approx(E)
        assert float(row[f"moe/moe_b/{mod}/experts_per_token"]) == pytest.approx(1.0)
        assert float(row[f"moe/moe_b/{mod}/dropped_fraction"]) == 0.0
    assert 1.0 <= float(row["moe/moe_a/text/max_load"]) < E


def test_heatmap_png_and_totals(fitted: dict[str, Any]) -> None:
    mon, trainer, batches = fitted["mon"], fitted["trainer"], fitted["rec"].batches
    path = mon.heatmap_path
    assert path == Path(trainer.log_dir) / "expert_load.png"
    assert path.stat().st_size > 0 and path.read_bytes()[:4] == b"\x89PNG"
    labels, grid = mon.shares()
    assert labels == ["moe_a/text", "moe_a/vision", "moe_b/text", "moe_b/vision"]
    demand = sum(b["stats"][("moe_a", "vision")]["tokens_per_expert"] for b in batches)
    torch.testing.assert_close(grid[1], demand / demand.sum(), rtol=1e-12, atol=0)
    assert grid[2].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert all(math.isclose(float(r.sum()), 1.0) for r in grid)


def test_modality_summary_is_token_weighted_over_layers(fitted: dict[str, Any]) -> None:
    """The run summary's per-modality figures: every layer's values since fit start, weighted
    by tokens (both layers see the same tokens here, so the plain mean of the two layers)."""
    batches, summary = fitted["rec"].batches, fitted["mon"].modality_summary()
    assert sorted(summary) == ["text", "vision"]
    for mod in ("text", "vision"):
        per_layer = [expected(batches, (name, mod)) for name in ("moe_a", "moe_b")]
        assert summary[mod].pop("layers") == 2.0
        for metric, got in summary[mod].items():
            want = (per_layer[0][metric] + per_layer[1][metric]) / 2
            assert got == pytest.approx(want, rel=1e-6), (mod, metric)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"heatmap_every_n_steps": 0}, "heatmap_every_n_steps (0)"),
        ({"heatmap_every_n_steps": 2.5}, "heatmap_every_n_steps (2.5)"),
        ({"heatmap_every_n_steps": True}, "heatmap_every_n_steps (True)"),
        ({"prefix": "/"}, "prefix ('/')"),
        ({"log_dir": 3}, "log_dir (3)"),
    ],
)
def test_argument_errors(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=r"must be") as err:
        ExpertLoadMonitor(**kwargs)
    assert field in str(err.value) and "use" in str(err.value)


def test_missing_matplotlib_is_a_note(
    monkeypatch: pytest.MonkeyPatch, fitted: dict[str, Any]
) -> None:
    import builtins

    real = builtins.__import__

    def no_mpl(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    mon = ExpertLoadMonitor()
    mon._slots, mon.totals = fitted["mon"]._slots, fitted["mon"].totals
    monkeypatch.setattr(builtins, "__import__", no_mpl)
    with pytest.warns(UserWarning, match="matplotlib is not installed"):
        assert mon.draw_heatmap(fitted["trainer"]) is None
    assert mon.heatmap_path is None
