"""The numerics core on one process: the global norm and clip against torch's own."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mmpar.parallel.numerics import (
    clip_grad_norm_,
    global_grad_norm,
    grad_norm_weights,
    scale_grads_,
    vocab_parallel_cross_entropy,
)

# float64 accumulation of the per-parameter norms vs torch's float32 one: they agree to the
# last float32 bit or so, not always bitwise.
TIGHT = {"rtol": 1e-6, "atol": 0.0}


def _net_with_grads(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(13, 29), nn.LayerNorm(29), nn.Linear(29, 5, bias=False))
    net(torch.randn(7, 13) * (1 + seed)).square().sum().backward()
    return net


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_single_process_equals_torch_clip_grad_norm(max_norm: float) -> None:
    for seed in range(4):
        ours, theirs = _net_with_grads(seed), _net_with_grads(seed)
        frozen = nn.Parameter(torch.ones(3))  # no gradient: skipped by both
        norm = clip_grad_norm_([*ours.parameters(), frozen], max_norm)
        ref = torch.nn.utils.clip_grad_norm_([*theirs.parameters(), frozen], max_norm)
        assert norm.dtype == torch.float64 and norm.ndim == 0
        torch.testing.assert_close(norm, ref.double(), **TIGHT)
        for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None
            torch.testing.assert_close(p.grad, q.grad, **TIGHT)
        if max_norm > norm:  # no clipping: gradients untouched, bit for bit
            fresh = _net_with_grads(seed)
            for p, q in zip(ours.parameters(), fresh.parameters(), strict=True):
                assert torch.equal(p.grad, q.grad)  # type: ignore[arg-type]


def test_weights_override_and_validation() -> None:
    net = _net_with_grads(0)
    params = list(net.parameters())
    assert grad_norm_weights(params) == [1.0] * len(params)
    dense = torch.sqrt(sum(p.grad.double().square().sum() for p in params))  # type: ignore[union-attr]
    torch.testing.assert_close(global_grad_norm(params), dense, **TIGHT)
    doubled = global_grad_norm(params, weights=[4.0] * len(params))
    torch.testing.assert_close(doubled, 2 * dense, **TIGHT)
    with pytest.raises(ValueError, match="weights has 1 entries for 5 parameters"):
        global_grad_norm(params, weights=[1.0])
    with pytest.raises(ValueError, match="max_norm"):
        clip_grad_norm_(params, -1.0)


def test_nan_norm_leaves_gradients_alone() -> None:
    net = _net_with_grads(1)
    before = [p.grad.clone() for p in net.parameters()]  # type: ignore[union-attr]
    coef = scale_grads_(net.parameters(), 1.0, float("nan"))
    assert float(coef) == 1.0
    for p, g in zip(net.parameters(), before, strict=True):
        assert torch.equal(p.grad, g)  # type: ignore[arg-type]
    assert float(scale_grads_(net.parameters(), 1.0, 3.0)) == pytest.approx(1 / (3 + 1e-6))


def test_plain_logits_cross_entropy() -> None:
    torch.manual_seed(0)
    logits, target = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    target[0, 3:] = -100
    ref = F.cross_entropy(logits.reshape(-1, 11), target.reshape(-1))
    torch.testing.assert_close(vocab_parallel_cross_entropy(logits, target), ref)
