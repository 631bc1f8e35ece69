"""BranchGradientClipping: vision global-norm clip, text AGC against a hand computation, branch
resolution (recipe-style ``fusion_model`` names), DTensor layouts on an in-process 1-rank gloo
mesh, and one 2-step fit that logs the metrics."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mmpar.callbacks import BranchGradientClipping
from lightning_mmpar.callbacks.branch_clipping import agc_coefficients, branch_parameters


class Branches(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.vision = nn.Linear(4, 3)
        self.language = nn.Linear(4, 5)
        self.other = nn.Linear(4, 2)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return 100 * (self.vision(x).sum() + self.language(x).pow(2).sum() + self.other(x).sum())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


TRAINER = SimpleNamespace(strategy=None, world_size=1)  # one process, no strategy


def agc_by_hand(w: torch.Tensor, g: torch.Tensor, lam: float, eps: float) -> torch.Tensor:
    """NFNets AGC unit by unit (rows of a matrix, the whole of a vector), in float64."""
    w, g = w.double(), g.double()
    units = [(w, g)] if w.ndim < 2 else list(zip(w, g, strict=True))
    out = []
    for wi, gi in units:
        bound = lam * max(math.sqrt(float((wi * wi).sum())), eps)
        norm = math.sqrt(float((gi * gi).sum()))
        out.append(gi * (bound / max(norm, 1e-6)) if norm > bound else gi)
    return out[0] if w.ndim < 2 else torch.stack(out)


def set_grads(module: Branches, vision_norm: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    for p in module.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    vis = [module.vision.weight.grad, module.vision.bias.grad]
    total = math.sqrt(sum(float(v.square().sum()) for v in vis))
    for v in vis:
        v.mul_(vision_norm / total)
    with torch.no_grad():
        module.language.weight[1].mul_(1e-5)  # a tiny row: its bound is lam * eps
        w, g = module.language.weight, module.language.weight.grad
        g[0] *= 1e-4  # a row far below its bound
        for row, ratio in ((2, 1.5), (3, 0.9)):  # just above / just below lam |W_i| (lam 0.05)
            g[row] *= ratio * 0.05 * float(w[row].norm()) / float(g[row].norm())
    return {n: p.grad.clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("vision_norm", [5.0, 0.5])
def test_vision_clip_and_text_agc(vision_norm: float) -> None:
    module, cb = Branches(), BranchGradientClipping(clipping=0.05)
    cb.on_fit_start(TRAINER, module)  # type: ignore[arg-type]
    assert list(cb.vision) == ["vision.weight", "vision.bias"]
    assert list(cb.text) == ["language.weight", "language.bias"]
    before = set_grads(module, vision_norm)
    cb.on_before_optimizer_step(TRAINER, module, None)  # type: ignore[arg-type]
    assert float(cb.last_vision_norm) == pytest.approx(vision_norm, rel=1e-6)
    vis = torch.cat([module.vision.weight.grad.flatten(), module.vision.bias.grad])
    if vision_norm > 1:
        assert float(vis.norm()) == pytest.approx(1.0, rel=1e-5)
    else:  # below the bound: untouched, bit for bit
        assert torch.equal(module.vision.weight.grad, before["vision.weight"])
    for name in ("weight", "bias"):
        w = getattr(module.language, name)
        want = agc_by_hand(w.detach(), before[f"language.{name}"], 0.05, 1e-3)
        torch.testing.assert_close(w.grad.double(), want, rtol=1e-6, atol=0)
    assert torch.equal(module.other.weight.grad, before["other.weight"])  # no branch
    g, want = module.language.weight.grad, before["language.weight"]
    assert torch.equal(g[0], want[0]) and torch.equal(g[3], want[3]), "rows under the bound"
    bound = 0.05 * float(module.language.weight[2].detach().norm())
    assert float(g[2].norm()) == pytest.approx(bound, rel=1e-5), "clipped to lam |W_i|"
    assert float(g[1].norm()) == pytest.approx(0.05 * 1e-3, rel=1e-5), "floored by eps"
    coef, shards = agc_coefficients(module.language.weight, want, clipping=0.05)
    assert coef.shape == (5,) and shards == 1 and float(coef[0]) == 1.0
    assert cb._counts is not None
    assert cb._counts.tolist() == [float((coef < 1).sum()) + 1.0, 6.0]  # + the clipped bias


class Wrapped(pl.LightningModule):
    """Recipe-style: registered ``blocks.N`` names, the model itself unregistered."""

    def __init__(self) -> None:
        super().__init__()
        inner = nn.Module()
        inner.vision, inner.language = nn.Linear(2, 2), nn.Linear(2, 2)
        self._inner = (inner,)
        self.blocks = nn.ModuleList([inner.vision, inner.language])

    @property
    def fusion_model(self) -> nn.Module:
        return self._inner[0]


def test_branch_names_and_arguments() -> None:
    vision, text = branch_parameters(Wrapped(), ("vision.",), ("language.",))
    assert [n for n, _ in vision] == ["blocks.0.weight", "blocks.0.bias"]
    assert [n for n, _ in text] == ["blocks.1.weight", "blocks.1.bias"]
    with pytest.raises(ValueError, match="both"):
        branch_parameters(Branches(), ("vision.",), ("vision.w",))
    bad_args: list[dict[str, Any]] = [
        {"max_norm": 0.0},
        {"clipping": -1},
        {"eps": True},
        {"vision_prefixes": "vision."},
        {"text_prefixes": ("",)},
        {"prefix": ""},
    ]
    for bad in bad_args:
        with pytest.raises(ValueError, match=next(iter(bad))):
            BranchGradientClipping(**bad)  # type: ignore[arg-type]


def test_dtensor_layouts_on_one_rank_mesh() -> None:
    """Shard(0) (local rows), Shard(1) and a sharded bias (DTensor sums), Replicate: the same
    factors as plain tensors. One rank: checks the code paths, not a cross-rank sum."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        w, g = torch.randn(6, 4), torch.randn(6, 4) * 0.05
        b, gb = torch.randn(6), torch.randn(6)
        want, _ = agc_coefficients(w, g, clipping=0.05)
        want_b, _ = agc_coefficients(b, gb, clipping=0.05)
        assert 0 < int((want < 1).sum()) < 6, "some rows clipped, some not"
        for placement in (Shard(0), Shard(1), Replicate()):
            dw, dg = (distribute_tensor(t, mesh, [placement]) for t in (w, g))
            got, shards = agc_coefficients(dw, dg, clipping=0.05, name="w")
            assert shards == 1
            torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        db, dgb = (distribute_tensor(t, mesh, [Shard(0)]) for t in (b, gb))
        got_b, _ = agc_coefficients(db, dgb, clipping=0.05, name="b")
        torch.testing.assert_close(got_b, want_b, rtol=1e-6, atol=0)
    finally:
        dist.destroy_process_group()


def test_fit_logs_metrics() -> None:
    module, cb = Branches(), BranchGradientClipping()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        log_every_n_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[cb],
    )
    trainer.fit(module, DataLoader(TensorDataset(torch.randn(4, 4)), batch_size=2))
    metrics: dict[str, Any] = trainer.logged_metrics
    assert float(metrics["clip/vision_grad_norm"]) > 1.0  # the loss is scaled by 100
    assert float(metrics["clip/vision_grad_norm"]) == pytest.approx(float(cb.last_vision_norm))
    assert 0.0 < float(metrics["clip/text_clipped_fraction"]) <= 1.0
