"""Losses and metrics in real gloo worlds, against single-process oracles (open_clip ClipLoss).

Gradient convention: every dp rank computes the *global* loss L, and the gather's backward sums
over the group, so a rank's local feature gradient is ``dp * dL/dx_local``; dp gradient averaging
(DDP/FSDP) divides by dp again. The logit-scale gradient is ``dL/ds`` on every rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from open_clip.loss import ClipLoss
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module

from lightning_mmpar.losses.caption import caption_loss, plain_caption_loss
from lightning_mmpar.losses.contrastive import ContrastiveLoss
from lightning_mmpar.losses.mml import MMLConfig, MMLLoss
from lightning_mmpar.recipes.metrics import RetrievalRecall, ZeroShotAccuracy
from lightning_mmpar.testing import spawn

pytestmark = pytest.mark.distributed


def _batch(sizes: list[int], d: int = 6, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    return F.normalize(torch.randn(n, d, generator=g), dim=-1), F.normalize(
        torch.randn(n, d, generator=g), dim=-1
    )


def _reference(
    image: torch.Tensor, text: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """open_clip's ClipLoss in one process: loss and grads on features and log-scale."""
    image, text = image.clone().requires_grad_(), text.clone().requires_grad_()
    log_scale = torch.tensor(scale).log().requires_grad_()
    loss = ClipLoss()(image, text, log_scale.exp())
    gi, gt, gs = torch.autograd.grad(loss, [image, text, log_scale])
    return loss.detach(), gi, gt, gs


def _distributed(
    loss_fn: nn.Module, image: torch.Tensor, text: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    image, text = image.clone().requires_grad_(), text.clone().requires_grad_()
    log_scale = torch.tensor(scale).log().requires_grad_()
    loss = loss_fn(image, text, log_scale.exp())
    gi, gt, gs = torch.autograd.grad(loss, [image, text, log_scale])
    return loss.detach(), gi, gt, gs


def _check_contrastive(
    rank_in_dp: int, dp: int, sizes: list[int], group: dist.ProcessGroup | None, local: bool
) -> None:
    image, text = _batch(sizes)
    ref_loss, ref_gi, ref_gt, ref_gs = _reference(image, text, 7.0)
    start = sum(sizes[:rank_in_dp])
    rows = slice(start, start + sizes[rank_in_dp])
    loss_fn = ContrastiveLoss(group=group, local_loss=local)
    loss, gi, gt, gs = _distributed(loss_fn, image[rows], text[rows], 7.0)
    if local:  # each rank holds the mean over its rows; their dp mean is the global loss
        dist.all_reduce(loss, group=group)
        dist.all_reduce(gs, group=group)
        loss, gs = loss / dp, gs / dp
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gi, dp * ref_gi[rows], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gt, dp * ref_gt[rows], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gs, ref_gs, rtol=1e-5, atol=1e-7)


def _check_mml(rank: int) -> None:
    image, text = _batch([3, 3], seed=1)
    m_image, m_text = _batch([3, 3], seed=2)
    rows = slice(3 * rank, 3 * rank + 3)
    full = MMLLoss(config=MMLConfig(weight=0.7))(image, text, m_image, m_text, 5.0)
    mine = image[rows].clone().requires_grad_()
    loss = MMLLoss(config=MMLConfig(weight=0.7), group=dist.group.WORLD)(
        mine, text[rows], m_image[rows], m_text[rows], 5.0
    )
    assert isinstance(loss, torch.Tensor) and isinstance(full, torch.Tensor)
    torch.testing.assert_close(loss, full)
    (grad,) = torch.autograd.grad(loss, mine)
    ref_image = image.clone().requires_grad_()
    ref = MMLLoss(config=MMLConfig(weight=0.7))(ref_image, text, m_image, m_text, 5.0)
    assert isinstance(ref, torch.Tensor)
    (ref_grad,) = torch.autograd.grad(ref, ref_image)
    torch.testing.assert_close(grad, 2 * ref_grad[rows])


def _check_caption_dtensor() -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    hidden, targets = torch.randn(3, 6, 8), torch.randint(0, 10, (3, 6))
    targets[1, 3:] = -100
    head = nn.Linear(8, 10)
    ref = plain_caption_loss(head(hidden), targets)
    ref_grads = torch.autograd.grad(ref, list(head.parameters()))
    for scoped in (False, True):
        tp_head = parallelize_module(
            nn.Linear(8, 10), mesh, ColwiseParallel(use_local_output=False)
        )
        with torch.no_grad():
            for p, q in zip(tp_head.parameters(), head.parameters(), strict=True):
                assert isinstance(p, DTensor)
                p.copy_(distribute_tensor(q.detach(), mesh, p.placements))
        logits = tp_head(hidden)
        assert isinstance(logits, DTensor) and logits.placements == (Shard(2),)
        # needs no context, and works inside torch's own loss_parallel() too
        with loss_parallel() if scoped else torch.enable_grad():
            loss = caption_loss(logits, targets, loss_parallel=True)
            loss.backward()
        assert not isinstance(loss, DTensor)  # a plain tensor, equal on every tp rank
        torch.testing.assert_close(loss, ref)
        for p, g in zip(tp_head.parameters(), ref_grads, strict=True):
            assert isinstance(p.grad, DTensor)
            torch.testing.assert_close(p.grad.full_tensor(), g, rtol=1e-5, atol=1e-7)


def _check_metrics(rank: int, world: int, group: dist.ProcessGroup | None) -> None:
    """Each dp rank updates its shard; compute() must equal one process seeing everything."""
    image, text = _batch([5] * world, seed=3)
    noisy = F.normalize(text + 0.8 * _batch([5] * world, seed=4)[0], dim=-1)
    labels = torch.arange(5 * world) % 3
    classes = _batch([3], seed=5)[0]
    rows = slice(5 * rank, 5 * rank + 5)
    kw: dict[str, Any] = {"process_group": group} if group is not None else {}
    # The single-process references must not sync: they already saw every sample.
    recall = RetrievalRecall(ks=(1, 2), **kw)
    full_recall = RetrievalRecall(ks=(1, 2), sync_on_compute=False)
    acc, full_acc = ZeroShotAccuracy(**kw), ZeroShotAccuracy(sync_on_compute=False)
    recall.update(image[rows], noisy[rows])
    acc.update(image[rows], classes, labels[rows])
    full_recall.update(image, noisy)
    full_acc.update(image, classes, labels)
    got, expected = recall.compute(), full_recall.compute()
    assert got.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key])
    assert 0 < expected["i2t_recall@1"] < 1
    torch.testing.assert_close(acc.compute(), full_acc.compute())


def two_rank_checks(rank: int, world: int) -> list[str]:
    """Every 2-rank check, in one world (process start-up is the slow part)."""
    done = []
    for sizes, local in (([4, 4], False), ([4, 4], True), ([3, 5], False)):
        _check_contrastive(rank, world, sizes, dist.group.WORLD, local)
        done.append(f"contrastive sizes={sizes} local={local}")
    _check_mml(rank)
    done.append("mml")
    _check_caption_dtensor()
    done.append("caption dtensor")
    _check_metrics(rank, world, None)
    done.append("metrics")
    return done


def dp2_tp2_checks(rank: int, world: int) -> dict[str, float]:
    """dp=2 x tp=2: dp groups [[0, 2], [1, 3]]; tp peers (0, 1) and (2, 3) share samples."""
    dp_group, _ = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
    assert isinstance(dp_group, dist.ProcessGroup)
    dp_rank = dist.get_rank(dp_group)
    assert dp_rank == rank // 2
    _check_contrastive(dp_rank, 2, [4, 4], dp_group, local=False)
    _check_metrics(dp_rank, 2, dp_group)
    image, text = _batch([4, 4])
    rows = slice(4 * dp_rank, 4 * dp_rank + 4)
    ref = ClipLoss()(image, text, 7.0)
    over_world = ContrastiveLoss(group=dist.group.WORLD)(image[rows], text[rows], 7.0)
    assert isinstance(over_world, torch.Tensor)
    # WORLD sees every sample twice (once per tp peer): [s0, s0, s1, s1] ...
    dup = torch.cat([image[:4], image[:4], image[4:], image[4:]])
    dup_text = torch.cat([text[:4], text[:4], text[4:], text[4:]])
    torch.testing.assert_close(over_world, ClipLoss()(dup, dup_text, 7.0))
    return {"reference": ref.item(), "world": over_world.item()}


def test_two_rank_losses_and_metrics() -> None:
    results = spawn(two_rank_checks, 2)
    assert results[0] == results[1]
    assert len(results[0]) == 6


def test_dp_group_not_world_under_tensor_parallel() -> None:
    results = spawn(dp2_tp2_checks, 4)
    for r in results:
        # ... which makes each sample's copy a false negative: a visibly different loss.
        assert abs(r["world"] - r["reference"]) > 0.1
