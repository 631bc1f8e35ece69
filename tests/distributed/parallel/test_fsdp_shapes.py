"""FSDP2 with every awkward parameter shape, dp 2 against one process (issue 9, fault 1).

``fully_shard`` refuses 0-dim parameters (the fusion model's tanh gates and logit scale), so the
recipe crashed at dp > 1 with ``data_parallel="fsdp"``. One 2-rank gloo world checks, for both
ways the strategy shards (``shard_blocks``: one unit per pipeline block plus the root;
``apply_fsdp``: the layers of each ``ModuleList`` plus the root's children), a module holding a
0-dim gate (in a block and on the root), a one-element ``[1]``, ``[1, D]`` and ``[1, 3]`` (first
dim smaller than dp), an odd ``[5]``, a fused q/k/v ``[3, D, D]`` and its ``[3, D]`` bias:

* the loss (dp mean of the local half-batch losses) and every parameter's gradient equal one
  process on the whole batch, then 3 AdamW steps of loss and the final weights (rel <= 1e-5);
* the fused ``[3, D, D]`` is sharded evenly: each rank holds exactly 1/dp of its elements.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from lightning_mmpar.parallel import comm
from lightning_mmpar.parallel import data as dpar
from lightning_mmpar.testing import spawn

pytestmark = pytest.mark.distributed

D, BATCH, STEPS, TOL = 4, 8, 3, 1e-5


class Block(nn.Module):
    """Every shape FSDP2 finds awkward, all used by the forward ``[B, D] -> [B, D]``."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv_weight = nn.Parameter(torch.randn(3, D, D) / D**0.5)  # fused q/k/v
        self.qkv_bias = nn.Parameter(0.1 * torch.randn(3, D))
        self.gate = nn.Parameter(torch.tensor(0.3))  # 0-dim (an adapter's tanh gate)
        self.one = nn.Parameter(torch.tensor([0.7]))  # one element
        self.row = nn.Parameter(0.1 * torch.randn(1, D))  # dim 0 < dp, dim 1 even
        self.odd = nn.Parameter(0.1 * torch.randn(1, 3))  # no dim divides by dp
        self.vec = nn.Parameter(0.1 * torch.randn(5))  # odd length
        self.lin = nn.Linear(D, D)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = torch.einsum("bi,coi->cbo", x, self.qkv_weight) + self.qkv_bias[:, None]
        h = q * torch.sigmoid(k) + v + self.row * self.one
        h = h + torch.tanh(self.gate) * self.lin(h)
        return h * (1 + self.odd.sum() * self.vec.mean())


class Awkward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.logit_scale = nn.Parameter(torch.tensor(0.5))  # 0-dim on the root (CLIP's)
        self.head = nn.Parameter(torch.randn(D, 2) / D**0.5)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return ((self.logit_scale.exp() * x @ self.head - y) ** 2).mean()


def _full(t: Tensor) -> Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _rel(a: Tensor, b: Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _train(model: nn.Module, x: Tensor, y: Tensor, replicated: list[nn.Parameter], group: Any):
    """Loss of the first step, first-step gradients, losses of STEPS AdamW steps."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses, grads = [], {}
    for step in range(STEPS):
        loss = model(x, y)
        loss.backward()
        dpar.sync_gradients(replicated, group)
        losses.append(float(comm.all_reduce(loss.detach().clone(), "avg", group)))
        if step == 0:
            grads = {
                n: _full(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None
            }
        opt.step()
        opt.zero_grad()
    return losses, grads


def fsdp_world(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    group = mesh.get_group()
    torch.manual_seed(0)
    reference = Awkward()
    x, y = torch.randn(BATCH, D), torch.randn(BATCH, 2)
    ref_model = copy.deepcopy(reference)
    ref_losses, ref_grads = _train(ref_model, x, y, [], None)
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    out: dict[str, Any] = {}
    for how in ("shard_blocks", "apply_fsdp"):
        model = copy.deepcopy(reference)
        for p in model.parameters():  # scalars start apart: broadcast_parameters must fix it
            if p.ndim == 0:
                p.data.add_(0.01 * rank)
        if how == "shard_blocks":
            dpar.shard_blocks(model.blocks, model, mesh)
        else:
            dpar.apply_fsdp(model, mesh)
        replicated = dpar.replicated_parameters(model)
        dpar.broadcast_parameters(replicated, group)
        qkv: Tensor = model.blocks[0].qkv_weight  # type: ignore[union-attr, assignment]
        losses, grads = _train(model, x[rows], y[rows], replicated, group)
        out[how] = {
            "losses": [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True)],
            "grads": {n: _rel(grads[n], ref_grads[n]) for n in ref_grads},
            "missing": sorted(set(ref_grads) - set(grads)),
            "weights": {
                n: _rel(_full(p.detach()), dict(ref_model.named_parameters())[n].detach())
                for n, p in model.named_parameters()
            },
            "qkv_local": comm.to_local(qkv).numel(),
            "qkv_placement": str(qkv.placements) if isinstance(qkv, DTensor) else "plain",
            "replicated": sorted(
                n for n, p in model.named_parameters() if any(p is q for q in replicated)
            ),
        }
    return out


def test_every_parameter_shape_under_fsdp2_matches_one_process() -> None:
    results = spawn(fsdp_world, 2, timeout=300)
    scalars = ["blocks.0.gate", "blocks.1.gate", "logit_scale"]
    for rank, out in enumerate(results):
        for how, r in out.items():
            where = f"rank {rank} {how}"
            assert not r["missing"], (where, r["missing"])
            assert max(r["losses"]) <= TOL, (where, r["losses"])
            bad = {n: v for n, v in r["grads"].items() if v > TOL}
            assert not bad, (where, "first-step gradients", bad)
            bad = {n: v for n, v in r["weights"].items() if v > TOL}
            assert not bad, (where, f"weights after {STEPS} AdamW steps", bad)
            assert r["qkv_local"] == 3 * D * D // 2, (where, r["qkv_local"])
            assert r["qkv_placement"] == "(Shard(dim=1),)", (where, r["qkv_placement"])
            assert set(scalars) <= set(r["replicated"]), (where, r["replicated"])
    # the root's head is an FSDP unit of its own under shard_blocks, replicated under apply_fsdp
    assert "head" not in results[0]["shard_blocks"]["replicated"]
    assert "head" in results[0]["apply_fsdp"]["replicated"]
