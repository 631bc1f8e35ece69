"""Density-driven expert activation (models/moe_density.py), one process.

Oracles: ``torch.autograd.grad`` of the layer input computed apart for the captured norms, a
token-by-token float64 reference for the output with per-token ``k``, and plain (not
checkpointed) training for the checkpointed and pipelined orders.
"""

from __future__ import annotations

import copy
import gc
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lightning_mmpar.models import GradientDensity, MoEConfig, MoEFeedForward

TOL = dict(rtol=1e-5, atol=1e-7)


def make_layer(dtype: torch.dtype = torch.float32, **overrides: object) -> MoEFeedForward:
    torch.manual_seed(0)
    fields: dict = dict(num_experts=4, top_k=2, ffn_width=8, router_dim=4, init_std=0.5)
    fields |= dict(capacity_factor=None, density_threshold=0.85) | overrides
    return MoEFeedForward(6, MoEConfig(**fields)).to(dtype)


def inputs(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """``x [3, 6, 6]`` (aligned to 8 inside the layer), two modalities, padding in rows 1-2."""
    x = torch.randn(3, 6, 6, generator=torch.Generator().manual_seed(3), dtype=dtype)
    modality = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0]])
    pad = torch.zeros(3, 6, dtype=torch.bool)
    pad[1, 4:] = True
    pad[2, 5] = True
    return x, modality, pad


def density(layer: MoEFeedForward) -> GradientDensity:
    assert isinstance(layer.density, GradientDensity)
    return layer.density


def train_step(layer: MoEFeedForward, x: torch.Tensor, *args: torch.Tensor) -> None:
    layer(x.clone().requires_grad_(True), *args).square().sum().backward()


def test_hook_captures_per_token_gradient_norms_without_padding() -> None:
    layer, (x, modality, pad) = make_layer().train(), inputs()
    reference = copy.deepcopy(layer)  # no estimate yet: same routing as `layer`
    xr = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(reference(xr, modality, pad).square().sum(), xr)
    train_step(layer, x, modality, pad)
    norms, dens = grad.norm(dim=-1), density(layer)
    for m in range(2):
        for s in range(8):
            rows = [b for b in range(3) if s < 6 and not pad[b, s] and modality[b, s] == m]
            assert bool(dens.seen[m, s]) == bool(rows), (m, s)  # padding never observed
            if rows:
                torch.testing.assert_close(dens.estimate[m, s], norms[rows, s].mean(), **TOL)
    assert not bool(dens.seen[:, 8:].any()) and not bool(dens._pending_count.any())


def test_top_k_follows_the_threshold_on_hand_set_estimates() -> None:
    dens = GradientDensity(2, threshold=0.85, min_top_k=1, max_positions=6)
    assert dens.top_k(0, torch.arange(4), torch.Size([1, 4]), 3) is None  # nothing measured
    dens.estimate[0, :5] = torch.tensor([2.0, 1.7, 1.699, 0.4, 0.0])
    dens.seen[0, :5] = True
    index = torch.tensor([4, 5, 6, 7, 8, 9, 11])  # row 1 of [2, 4]: positions 0-3 and row 2
    k = dens.top_k(0, index, torch.Size([3, 4]), 3)
    assert k is not None and k.dtype == torch.long and k.tolist() == [3, 3, 1, 1, 3, 3, 1]
    long_rows = dens.top_k(0, torch.tensor([4, 5, 9]), torch.Size([1, 10]), 3)
    assert long_rows is not None and long_rows.tolist() == [1, 3, 3]  # 5-8 unseen, 9 -> bucket 5
    dens.min_top_k = 5  # clamped to the layer's top_k
    assert (k := dens.top_k(0, torch.tensor([3]), torch.Size([1, 4]), 2)) is not None
    assert k.tolist() == [2]
    dens.estimate[1, :2], dens.seen[1, :2] = 0.0, True  # all zero: no information, full k
    assert (k := dens.top_k(1, torch.tensor([0, 1]), torch.Size([1, 2]), 2)) is not None
    assert k.tolist() == [2, 2]


def reference_output(layer: MoEFeedForward, x, modality, pad, ks: dict) -> torch.Tensor:
    """Token by token, dropless: router ``m``, the token's first ``k_t`` experts, gates
    renormalised over those ``k_t``, SwiGLU experts summed."""
    y, w = torch.zeros_like(x), layer.experts
    for m in range(2):
        order = iter(ks[m].tolist())
        for b in range(x.shape[0]):
            for s in range(x.shape[1]):
                if pad[b, s] or modality[b, s] != m:
                    continue
                probs = (layer.router_proj(x[b, s]) @ layer.router_gate[m].t()).softmax(-1)
                top = torch.topk(probs, next(order)).indices
                for e in top.tolist():
                    h = F.silu(x[b, s] @ w.w_gate[e]) * (x[b, s] @ w.w_up[e])
                    y[b, s] += probs[e] / probs[top].sum() * (h @ w.w_down[e])
    return y


def test_output_and_experts_per_token_with_density_match_a_manual_route() -> None:
    layer, (x, modality, pad) = make_layer(torch.float64).train(), inputs(torch.float64)
    dens = density(layer)
    y0 = layer(x, modality, pad)  # first step: no backward seen yet, every token uses top_k
    for name in ("text", "vision"):
        assert float(layer.last_stats[name].experts_per_token) == 2
    y0.sum().backward()
    with torch.no_grad():
        dens.estimate[0, :8] = torch.tensor([4.0, 4.0, 4.0, 3.5, 1.0, 3.3, 0, 0])  # dense text
        dens.estimate[1, :8] = torch.tensor([4.0, 0.5, 3.0, 3.9, 0, 0, 0, 0])  # sparse vision
        dens.seen[:, :6] = True
    flat_mod, flat_ok = modality.reshape(-1), ~pad.reshape(-1)
    ks = {}
    for m in range(2):  # k from the threshold rule written out here (S = 6 < aligned 8)
        pos = torch.nonzero(flat_ok & (flat_mod == m)).squeeze(1) % 6
        ratio = dens.estimate[m, pos] / dens.estimate[m, :6].max()
        ks[m] = torch.where(ratio >= 0.85, 2, 1)
    y = layer(x, modality, pad)
    torch.testing.assert_close(y, reference_output(layer, x, modality, pad, ks), **TOL)
    text, vision = (layer.last_stats[n].experts_per_token for n in ("text", "vision"))
    assert float(text) == pytest.approx(ks[0].double().mean().item(), rel=1e-6)
    assert float(vision) == pytest.approx(ks[1].double().mean().item(), rel=1e-6)
    assert float(vision) < float(text) < 2  # densities differ: experts per token differ
    assert int(layer.last_stats["text"].tokens) + int(layer.last_stats["vision"].tokens) == 15


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_recompute_counts_each_backward_once(reentrant: bool) -> None:
    x, modality, pad = inputs()
    plain, ckpt = make_layer().train(), make_layer().train()
    for _ in range(2):  # step 2 routes with step 1's estimate (per-token k), then measures
        train_step(plain, x, modality, pad)
        xc = x.clone().requires_grad_(True)
        checkpoint(ckpt, xc, modality, pad, use_reentrant=reentrant).square().sum().backward()
        torch.testing.assert_close(density(ckpt).estimate, density(plain).estimate, **TOL)
    assert float(ckpt.last_stats["vision"].experts_per_token) < 2


def test_pipeline_order_folds_after_the_last_backward_and_recompute_matches() -> None:
    x, modality, pad = (t[:2] for t in inputs())
    layer = make_layer().train()
    train_step(layer, x, modality, pad)
    dens, before = density(layer), density(layer).estimate.clone()
    mb = [(x * s).clone().requires_grad_(True) for s in (1.0, 0.5)]
    ys = [checkpoint(layer, v, modality, pad, use_reentrant=False) for v in mb]
    ys[0].square().sum().backward()  # recompute of micro-batch 0 while micro-batch 1 waits
    assert torch.equal(dens.estimate, before) and bool(dens._pending_count.any())
    layer(x, modality, pad)  # a forward in between (no grad needed) folds nothing either
    assert torch.equal(dens.estimate, before)
    ys[1].square().sum().backward()  # recomputed with its forward's routing, then the fold
    norms = torch.cat([v.grad.norm(dim=-1) for v in mb])  # type: ignore[union-attr]
    mods, pads = modality.repeat(2, 1), pad.repeat(2, 1)
    expected = before.clone()
    for m in range(2):
        for s in range(6):
            rows = (mods[:, s] == m) & ~pads[:, s]
            if bool(rows.any()):
                expected[m, s] = norms[rows, s].mean()
    torch.testing.assert_close(dens.estimate, expected, **TOL)
    assert not bool(dens._pending_count.any()) and not torch.equal(expected, before)


def test_momentum_state_dict_and_a_forward_without_backward() -> None:
    x, modality, pad = inputs()
    layer = make_layer().train()
    layer.density = GradientDensity(2, momentum=0.25, max_positions=4)
    single = make_layer().train()
    single.density = GradientDensity(2, max_positions=4)
    train_step(layer, x, modality, pad)
    train_step(single, x, modality, pad)
    first = density(layer).estimate.clone()
    torch.testing.assert_close(first, density(single).estimate, **TOL)  # positions >= 3 pooled
    layer(x.clone().requires_grad_(True), modality, pad)  # skipped step: no backward
    x2 = x * 2
    train_step(single, x2, modality, pad)  # momentum 0: the last step's value
    train_step(layer, x2, modality, pad)  # the skipped graph (held by aux_loss) is gone now
    gc.collect()
    assert len(density(layer)._outstanding) == 0
    last = density(single).estimate
    torch.testing.assert_close(density(layer).estimate, 0.25 * first + 0.75 * last, **TOL)
    resumed = make_layer()
    resumed.density = GradientDensity(2, momentum=0.25, max_positions=4)
    resumed.load_state_dict(layer.state_dict())  # estimate and seen are persistent
    assert torch.equal(density(resumed).estimate, density(layer).estimate)
    assert isinstance(copy.deepcopy(make_layer()).density, GradientDensity)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (dict(density_threshold=0.0), r"density_threshold \(0.0\) must be in \(0, 1\]; use e.g"),
        (dict(density_threshold=1.5), r"density_threshold \(1.5\) must be in \(0, 1\]"),
        (dict(density_threshold=float("nan")), r"density_threshold \(nan\)"),
        (dict(density_min_top_k=0), r"density_min_top_k \(0\) must be a positive integer"),
        (dict(density_min_top_k=3), r"density_min_top_k \(3\) must be <= top_k \(2\); lower"),
    ],
)
def test_config_errors_name_field_value_and_fix(fields: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MoEConfig(num_experts=4, top_k=2, **fields)


def test_density_errors_and_default_install() -> None:
    for kwargs, match in [
        (dict(threshold=0.0), r"threshold \(0.0\) must be in \(0, 1\]"),
        (dict(momentum=1.0), r"momentum \(1.0\) must be in \[0, 1\); use 0"),
        (dict(max_positions=0), r"max_positions \(0\) must be a positive integer"),
    ]:
        with pytest.raises(ValueError, match=match):
            GradientDensity(2, **kwargs)  # type: ignore[arg-type]
    assert make_layer(density_threshold=None).density is None
    dens, x = GradientDensity(1), torch.randn(1, 2, 3, requires_grad=True)
    y = x * 1
    dens.observe(y, None, None)  # a hook awaits y's backward: weak references do not pickle
    assert len(dens._outstanding) == 1 and len(pickle.loads(pickle.dumps(dens))._outstanding) == 0
    assert "density.estimate" in make_layer().state_dict()
