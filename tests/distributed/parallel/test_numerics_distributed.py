"""The numerics core in a 4-rank gloo world: DTensor tp shards, replicas, a pp split, dp/FSDP
shards, a vocab-sharded cross-entropy and a pipeline boundary send under tp x pp, each against
one dense single-process computation."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
)

from lightning_mmpar.parallel.numerics import (
    clip_grad_norm_,
    global_grad_norm,
    vocab_parallel_cross_entropy,
)
from lightning_mmpar.testing import spawn

pytestmark = pytest.mark.distributed

SHAPES = [(8, 6), (8,), (8,), (6, 8), (6,), (6, 6)]
"""Dense parameters: stage 0 holds 0-2, stage 1 holds 3-5 (under pp = 2)."""


def dense_grads(scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g, dtype=torch.float64).float() * scale for s in SHAPES]


def torch_clip(grads: list[torch.Tensor], max_norm: float) -> tuple[float, list[torch.Tensor]]:
    params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return float(norm), [p.grad for p in params]  # type: ignore[misc]


def _param(
    mesh: Any, full: torch.Tensor, placements: list[Any], grad: torch.Tensor
) -> nn.Parameter:
    p = nn.Parameter(distribute_tensor(torch.zeros_like(full), mesh, placements))
    p.grad = distribute_tensor(grad.clone(), mesh, placements)  # clipping works in place
    return p


def pp_tp_params(mesh: Any, grads: list[torch.Tensor]) -> tuple[list[nn.Parameter], list[int]]:
    """pp2 x tp2: colwise / plain replicated / bias on stage 0; rowwise / replicated DTensor /
    a Partial gradient on stage 1. Returns this rank's parameters and their dense indices."""
    tp, stage = mesh["tp"], mesh.get_local_rank("pp")
    if stage == 0:
        plain = nn.Parameter(torch.zeros(SHAPES[1]))
        plain.grad = grads[1].clone()
        return [
            _param(tp, grads[0], [Shard(0)], grads[0]),
            plain,
            _param(tp, grads[2], [Shard(0)], grads[2]),
        ], [0, 1, 2]
    partial = nn.Parameter(distribute_tensor(torch.zeros(SHAPES[5]), tp, [Replicate()]))
    share = (tp.get_local_rank() + 1) / 3  # the tp pieces sum to the gradient: 1/3 + 2/3
    partial.grad = DTensor.from_local(grads[5] * share, tp, [Partial()], run_check=False)
    return [
        _param(tp, grads[3], [Shard(1)], grads[3]),
        _param(tp, grads[4], [Replicate()], grads[4]),
        partial,
    ], [3, 4, 5]


def dp_tp_params(mesh: Any, grads: list[torch.Tensor]) -> list[nn.Parameter]:
    """dp2 x tp2 (FSDP2 on dp composed with TP): every kind of 2-D placement, and a plain
    tensor replicated on all four ranks."""
    plain = nn.Parameter(torch.zeros(SHAPES[2]))
    plain.grad = grads[2].clone()
    return [
        _param(mesh, grads[0], [Shard(0), Shard(1)], grads[0]),
        _param(mesh, grads[1], [Replicate(), Shard(0)], grads[1]),
        plain,
        _param(mesh, grads[3], [Shard(0), Replicate()], grads[3]),
        _param(mesh, grads[4], [Replicate(), Replicate()], grads[4]),
        _param(mesh, grads[5], [Shard(1), Shard(0)], grads[5]),
    ]


def _full(p: nn.Parameter) -> torch.Tensor:
    g = p.grad
    assert g is not None
    return g.full_tensor() if isinstance(g, DTensor) else g


def _count_all_reduces(fn: Any) -> tuple[Any, int]:
    calls = []
    original = dist.all_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("group"))
        return original(*args, **kwargs)

    dist.all_reduce = counting  # type: ignore[assignment]
    try:
        return fn(), len(calls)
    finally:
        dist.all_reduce = original


def grad_norm_checks(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    grads = dense_grads(scale=3.0)
    ref_norm, ref_clipped = torch_clip(grads, 1.0)
    # pp2 x tp2: stages add up, tp replicas count once, the Partial gradient is reduced first
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    params, idx = pp_tp_params(mesh, grads)
    out["pp_tp_norm"] = float(global_grad_norm(params, pp=2))
    out["pp_tp_clip"] = float(clip_grad_norm_(params, 1.0, pp=2))
    out["pp_tp_diff"] = max(
        float((_full(p) - ref_clipped[i]).abs().max()) for p, i in zip(params, idx, strict=True)
    )
    # dp2 x tp2, no pipeline: one all-reduce over the world group, none per parameter
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    params = dp_tp_params(mesh, grads)
    norm, out["dp_tp_all_reduces"] = _count_all_reduces(lambda: global_grad_norm(params))
    out["dp_tp_norm"] = float(norm)
    clip_grad_norm_(params, 1.0)
    out["dp_tp_diff"] = max(
        float((_full(p) - r).abs().max()) for p, r in zip(params, ref_clipped, strict=True)
    )
    # FSDP1-like flat shards that partition the parameters: weights of 1
    flat = torch.cat([g.reshape(-1) for g in grads]).chunk(world)[rank]
    piece = nn.Parameter(torch.zeros_like(flat))
    piece.grad = flat.clone()
    out["flat_norm"] = float(global_grad_norm([piece], weights=[1.0]))
    out["ref_norm"] = ref_norm
    return out


def vocab_checks(rank: int, world: int) -> float:
    """Uneven vocab shards (11 over 2 ranks of a 2 x 2 mesh, replicated on the other dim)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    logits, target = torch.randn(3, 4, 11), torch.randint(0, 11, (3, 4))
    target[1, 2:] = -100
    ref_in = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_in.reshape(-1, 11), target.reshape(-1))
    ref.backward()
    sharded = distribute_tensor(logits, mesh, [Replicate(), Shard(2)]).requires_grad_()
    loss = vocab_parallel_cross_entropy(sharded, target)
    assert not isinstance(loss, DTensor)
    torch.testing.assert_close(loss, ref)
    loss.backward()
    assert isinstance(sharded.grad, DTensor) and ref_in.grad is not None
    torch.testing.assert_close(sharded.grad.full_tensor(), ref_in.grad)
    with pytest.raises(ValueError, match="sharded on the vocab dim"):
        vocab_parallel_cross_entropy(distribute_tensor(logits, mesh, [Shard(0), Shard(2)]), target)
    return float(loss.detach())


def boundary_send_checks(rank: int, world: int) -> dict[str, Any]:
    """A pipeline boundary under tp2 x pp2 (``comm.send_tensors``, as ``run_in_order`` sends a
    stage's outputs), two decode-like steps: stage 0 sends (a) the output of a vocab-parallel
    embedding (the fusion plan's ``embed_tokens``), an ``AsyncCollectiveTensor`` whose
    all-reduce is in flight (sent as is, the second step's values were wrong: wrong greedy
    captions at tp2 x pp2), and (b) a DTensor sharded over stage 0's tp ranks (its pickled
    mesh names ranks the receiver is not in). Stage 1 must get plain tensors with their full
    values; returns the largest error per kind (0 on stage 0)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    from lightning_mmpar.parallel import comm

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    torch.manual_seed(0)
    dense = nn.Embedding(40, 32)
    steps = [torch.full((8, 1), 1), torch.tensor([[25]] * 7 + [[14]])]  # shard 0, then both
    sharded = torch.randn(8, 6)
    stage, pp = mesh.get_local_rank("pp"), mesh["pp"].get_group()
    out: dict[str, Any] = {"embedding": 0.0, "dtensor": 0.0, "plain": True}
    plan = RowwiseParallel(input_layouts=Replicate())  # the fusion plan's embed_tokens
    embed = parallelize_module(nn.Embedding(40, 32), mesh["tp"], plan)
    embed.weight.data.copy_(distribute_tensor(dense.weight.data, mesh["tp"], [Shard(0)]))
    for ids in steps:
        if stage == 1:
            got = comm.recv_tensors(0, pp, torch.device("cpu"))
            out["embedding"] = max(out["embedding"], float((got[0] - dense(ids)).abs().max()))
            out["dtensor"] = max(out["dtensor"], float((got[1] - sharded).abs().max()))
            out["plain"] &= all(type(t) is torch.Tensor for t in got)
            continue
        with torch.no_grad():
            h = embed(ids)
        assert isinstance(h, AsyncCollectiveTensor)  # the case under test
        comm.send_tensors((h, distribute_tensor(sharded, mesh["tp"], [Shard(1)])), 1, pp)
    return out


def all_checks(rank: int, world: int) -> dict[str, Any]:
    out = grad_norm_checks(rank, world)
    out["vocab_loss"] = vocab_checks(rank, world)
    out["boundary"] = boundary_send_checks(rank, world)
    return out


def test_global_norm_and_clip_match_the_dense_model() -> None:
    results = spawn(all_checks, 4)
    ref = results[0]["ref_norm"]
    for r in results:
        for key in ("pp_tp_norm", "pp_tp_clip", "dp_tp_norm", "flat_norm"):
            assert r[key] == pytest.approx(ref, rel=1e-6), key
        assert r["pp_tp_diff"] < 1e-6 and r["dp_tp_diff"] < 1e-6
        assert r["dp_tp_all_reduces"] == 1
        assert r["vocab_loss"] == results[0]["vocab_loss"]
        assert r["boundary"] == {"embedding": 0.0, "dtensor": 0.0, "plain": True}, r["boundary"]
