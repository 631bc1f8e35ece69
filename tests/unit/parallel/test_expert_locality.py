"""Expert placement and locality (parallel/experts.py), one process.

:func:`permute_experts` must leave the layer's function unchanged: outputs, aux loss, stats and
gradients of the permuted layer equal the original's (reindexed), rel 1e-6. A negative control
permutes the expert weights alone (router untouched) and must change the output. The ep = 2
behaviour (custom placement vs ep 1, group-limited routing, the byte counters) is checked in
tests/distributed/parallel/test_expert_parallel.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_mmpar.models import MoEConfig, MoEFeedForward
from lightning_mmpar.parallel.experts import (
    AllToAllDispatcher,
    expert_placement,
    locality_group_ranks,
    permute_experts,
    placement_order,
)

ORDER = [2, 0, 3, 1]  # new expert p = old expert ORDER[p]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def layer(**config: Any) -> MoEFeedForward:
    torch.manual_seed(0)
    cfg = MoEConfig(**{**dict(num_experts=4, ffn_width=16, router_dim=8), **config})
    moe = MoEFeedForward(8, cfg)
    moe.expert_bias.copy_(torch.randn(2, 4) * 1e-2)  # non-trivial aux-free selection bias
    return moe


def run(moe: MoEFeedForward) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 8, 8, generator=g, requires_grad=True)
    modality = torch.randint(0, 2, (3, 8), generator=g)
    mask = torch.zeros(3, 8, dtype=torch.bool)
    mask[-1, -3:] = True
    y = moe(x, modality, mask)
    ((y * torch.randn(y.shape, generator=g)).sum() + moe.aux_loss).backward()
    grads = {n: p.grad.clone() for n, p in moe.named_parameters() if p.grad is not None}
    kept = {m: s.kept_per_expert for m, s in moe.last_stats.items()}
    return dict(y=y.detach(), aux=moe.aux_loss.detach(), x=x.grad, grads=grads, kept=kept)


@pytest.mark.parametrize(
    "config",
    [
        dict(top_k=2, capacity_factor=1.0),  # dropping: capacity priority must not move
        dict(top_k=1, capacity_factor=None, load_balancing="aux_free", num_shared_experts=1),
    ],
)
def test_permute_experts_keeps_the_function(config: dict[str, Any]) -> None:
    ref_layer = layer(**config)
    ref_layer.expert_mask[1] = False  # pruned expert: its mask entry moves with it
    ref = run(ref_layer)
    moved = layer(**config)
    moved.expert_mask[1] = False
    assert permute_experts(moved, ORDER) is moved
    got = run(moved)
    assert rel(got["y"], ref["y"]) <= 1e-6 and rel(got["aux"], ref["aux"]) <= 1e-6
    assert rel(got["x"], ref["x"]) <= 1e-6
    index = torch.tensor(ORDER)
    for name, grad in ref["grads"].items():
        if name == "router_gate":  # [M, E, R]
            expect = grad[:, index]
        else:  # stacked experts [E, ...] are reordered, dense weights are not
            expect = grad[index] if name.startswith("experts.") else grad
        assert rel(got["grads"][name], expect) <= 1e-6, name
    for m, kept in ref["kept"].items():
        assert torch.equal(got["kept"][m], kept[index]), m
    assert torch.equal(moved.expert_mask, torch.tensor([True, True, True, False]))
    assert torch.equal(moved.expert_bias, ref_layer.expert_bias[:, index])


def test_permuting_experts_without_the_router_changes_the_output() -> None:
    """Negative control: the equality above is not vacuous."""
    ref = run(layer())
    moved = layer()
    permute_experts(moved.experts, ORDER)  # weights only: the router still points at old ids
    assert rel(run(moved)["y"], ref["y"]) > 1e-2


def test_permute_experts_round_trip_and_errors() -> None:
    moe, ref = layer(), layer()
    permute_experts(moe, ORDER)
    permute_experts(moe, [1, 3, 0, 2])  # the inverse of ORDER
    assert all(
        torch.equal(a, b)
        for a, b in zip(moe.state_dict().values(), ref.state_dict().values(), strict=True)
    )
    with pytest.raises(ValueError, match=r"order \(\[0, 0, 1, 2\]\).*range\(4\)"):
        permute_experts(moe, [0, 0, 1, 2])
    with pytest.raises(ValueError, match=r"'w_missing'.*before apply_expert_parallel"):
        permute_experts(moe, ORDER, weights=("w_missing",))


def test_placement_helpers() -> None:
    assert expert_placement(8, 4) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert placement_order(expert_placement(8, 4), 4) == list(range(8))
    assert placement_order([1, 0, 1, 0], 2) == [1, 3, 0, 2]
    for bad in ([1, 1, 1, 0], [0, 2, 1, 0], []):
        with pytest.raises(ValueError, match=r"placement .*exactly num_experts / ep"):
            placement_order(bad, 2)
    assert locality_group_ranks(8, 5, 2) == range(4, 8)
    assert locality_group_ranks(8, 5, 8) == range(5, 6)
    assert locality_group_ranks(8, 5, None) == range(5, 6)
    for groups in (3, 0, True):
        with pytest.raises(ValueError, match=r"locality_groups .* divisor of the ep size \(8\)"):
            locality_group_ranks(8, 0, groups)  # type: ignore[arg-type]


def test_dispatcher_records_placement_and_counts_nothing_at_ep1() -> None:
    dispatcher = AllToAllDispatcher(4, None, placement=[0, 0, 0, 0], locality_groups=1)
    assert dispatcher.placement == [0, 0, 0, 0] and dispatcher.logical_ids == [0, 1, 2, 3]
    out = dispatcher(torch.randn(5, 3), torch.tensor([2, 0, 3, 0]), lambda t, c: t)
    assert out.shape == (5, 3) and dispatcher.bytes_sent == dispatcher.bytes_across_groups == 0
    logical = AllToAllDispatcher(4, None)
    logical.logical_ids = [2, 0, 3, 1]
    assert logical.to_logical(torch.tensor([[20, 0, 30, 10]])).tolist() == [[0, 10, 20, 30]]
