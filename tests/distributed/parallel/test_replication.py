"""Replicas after set-up and torch's DDP under ``data_parallel="ddp"`` (issues 31 6(a), 32 1).

One 2-rank gloo world. Each rank builds the module with its OWN values (a model whose weights
were loaded on rank 0 only): a trainable and a frozen linear, a persistent and a non-persistent
buffer, a 0-dim gate. After :func:`~lightning_mmpar.parallel.parallelize.parallelize`:

* ``ddp`` and ``fsdp``: every parameter (frozen included, FSDP2's full tensors) and every
  persistent buffer equal rank 0's values on both ranks; the non-persistent buffer (derived,
  rank-owned state such as the MoE locality mask) keeps each rank's own;
* ``ddp``: the chunk is replicated by torch's DDP (``replicate``) and the package's own
  all-reduce holds no parameter; one backward on each rank's half-batch gives every rank the
  dp mean of the gradients; under the strategy's ``block_backward_sync`` (Lightning's gradient
  accumulation) a backward keeps each rank's own gradient, and the synced backward after it
  averages the sum (accumulation equals one batch of both halves).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_mmpar.config import ParallelConfig
from lightning_mmpar.parallel import comm
from lightning_mmpar.parallel.parallelize import ParallelizeOptions, parallelize
from lightning_mmpar.testing import spawn
from lightning_mmpar.topology import ParallelDims

pytestmark = pytest.mark.distributed

D = 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.train_lin = nn.Linear(D, D)
        self.frozen = nn.Linear(D, D)
        self.frozen.requires_grad_(False)
        self.gate = nn.Parameter(torch.randn(()))
        self.register_buffer("stat", torch.randn(D))
        self.register_buffer("derived", torch.randn(D), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.gate) * self.train_lin(self.frozen(x) + self.stat)


class Toy(nn.Module):
    """A :class:`~lightning_mmpar.parallel.pipeline.PipelineModule` of two blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def pipeline_blocks(self) -> list[nn.Module]:
        return list(self.blocks)

    def pipeline_inputs(self, batch: Any) -> tuple[tuple[Tensor, ...], Any]:
        return (batch[0],), batch[1]

    def pipeline_loss(self, output: Any, target: Any) -> Tensor:
        return ((output - target) ** 2).mean()


def _state(model: nn.Module) -> dict[str, Tensor]:
    items = [*model.named_parameters(), *model.named_buffers()]
    return {
        n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone() for n, t in items
    }


def _gather(t: Tensor) -> list[Tensor]:
    return comm.all_gather(t.contiguous())


def _grads(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _ddp_checks(rank: int, done: Any, model: Toy, x: Tensor, y: Tensor) -> dict[str, Any]:
    from lightning_mmpar.strategy import MultimodalParallelStrategy

    chunk = done.chunk
    out: dict[str, Any] = {
        "replicated": done.replicated is chunk,
        "own_all_reduce": len(done.grad_sync.replicated),
    }
    half = slice(rank * 4, rank * 4 + 4)
    model.pipeline_loss(chunk(x[half]), y[half]).backward()
    synced = _grads(model)
    out["synced"] = {n: [g.clone() for g in _gather(t)] for n, t in synced.items()}
    for p in model.parameters():  # each rank's own gradient, unsynced
        p.grad = None
    strategy = MultimodalParallelStrategy(data_parallel="ddp")
    strategy._replicated = chunk
    with strategy.block_backward_sync():
        model.pipeline_loss(chunk(x[half]), y[half]).backward()
    local = _grads(model)
    out["local"] = {n: _gather(t) for n, t in local.items()}
    model.pipeline_loss(chunk(x[half]), y[half]).backward()  # synced: the mean of the sums
    out["accumulated"] = {n: _gather(t) for n, t in _grads(model).items()}
    return out


def world(rank: int, size: int) -> dict[str, Any]:
    dims = ParallelDims(world_size=size)
    dims.build_mesh("cpu")
    torch.manual_seed(0)
    x, y = torch.randn(8, D), torch.randn(8, D)
    results: dict[str, Any] = {}
    for mode in ("ddp", "fsdp"):
        torch.manual_seed(100 + rank)  # each rank its own weights and buffers
        model = Toy()
        own = _state(model)
        config = ParallelConfig(data_parallel=mode)
        done = parallelize(model, dims, None, ParallelizeOptions(config))
        after = _state(model)
        results[mode] = {
            "own": own,
            "gathered": {n: _gather(t) for n, t in after.items()},
        }
        if mode == "ddp":
            results[mode].update(_ddp_checks(rank, done, model, x, y))
    return results


def test_replicas_after_setup_and_ddp() -> None:
    ranks = spawn(world, 2, timeout=120)
    for mode in ("ddp", "fsdp"):
        gathered = ranks[0][mode]["gathered"]
        own = [r[mode]["own"] for r in ranks]
        assert gathered.keys() == own[0].keys()
        for name, (a, b) in gathered.items():
            if name.endswith("derived"):  # non-persistent: each rank keeps its own
                assert torch.equal(a, own[0][name]) and torch.equal(b, own[1][name]), name
                assert not torch.equal(a, b), name
                continue
            assert torch.equal(a, own[0][name]), (mode, name)  # rank 0's values ...
            assert torch.equal(b, own[0][name]), (mode, name)  # ... on both ranks
            assert not torch.equal(own[0][name], own[1][name]), name  # they started apart
    ddp = ranks[0]["ddp"]
    assert ddp["replicated"] and ddp["own_all_reduce"] == 0, ddp
    assert ddp["synced"].keys() == {
        f"blocks.{i}.{n}" for i in (0, 1) for n in ("train_lin.weight", "train_lin.bias", "gate")
    }
    for name, (a, b) in ddp["synced"].items():
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)  # the dp mean on both
        local = ddp["local"][name]
        assert not torch.equal(local[0], local[1]), name  # no_sync: each rank's own
        mean = (local[0] + local[1]) / 2
        torch.testing.assert_close(a, mean, rtol=1e-6, atol=1e-7, msg=name)
        acc = ddp["accumulated"][name]  # both ranks: the mean of (own + own) = 2 * mean
        torch.testing.assert_close(acc[0], acc[1], rtol=0, atol=0, msg=name)
        torch.testing.assert_close(acc[0], 2 * mean, rtol=1e-6, atol=1e-7, msg=name)
