"""A user's own LightningModule that skips its vision tower on a batch with no image (issue 28
item 3), on 2 data-parallel ranks: rank 0's batches have images, rank 1's none.

* FSDP2, tower skipped: every rank raises the strategy's one ``RuntimeError`` naming each rank's
  next unit (without the guard: gloo aborts the process on a size mismatch, the peer hangs);
* DDP, tower skipped: trains (rank 1 reduces the tower's gradients as zeros) and equals one
  process;
* FSDP2, the documented fix (the tower on a zero dummy image, output times 0): trains and
  equals one process; also with ``check_unit_order=False`` (no guard, no hook);
* the gloo group the guard uses over an NCCL dp group (``cpu_group``, the backend read as
  NCCL): a new gloo group over the same ranks whose all-gather works.
"""

from __future__ import annotations

import time
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_mmpar import MultimodalParallelStrategy
from lightning_mmpar.parallel import unit_order
from lightning_mmpar.testing import quiet_trainer

LR, STEPS = 0.1, 2


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Linear(48, 32)
        self.blocks = nn.ModuleList([nn.Linear(32, 32) for _ in range(2)])

    def forward(self, x: Tensor) -> Tensor:
        h = self.patch(x)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return h


class OwnVLM(LightningModule):
    """A vision tower, an embedding, two layers and a head; ``dummy``: the tower runs on one
    zero image when the batch has none (the fix), else it is skipped (the natural code)."""

    def __init__(self, dummy: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dummy = dummy
        self.vision = Tower()
        self.embed = nn.Embedding(64, 32)
        self.layers = nn.ModuleList([nn.Linear(32, 32) for _ in range(2)])
        self.head = nn.Linear(32, 64)

    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        h = self.embed(batch["input_ids"])
        images = batch["images"]
        if images.shape[0] > 0:
            h = h + self.vision(images).mean(0)
        elif self.dummy:
            h = h + 0.0 * self.vision(images.new_zeros(1, images.shape[1])).mean(0)
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return F.cross_entropy(self.head(h).flatten(0, 1), batch["input_ids"].flatten())

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self.loss(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def batches(rank: int) -> list[dict[str, Tensor]]:
    """Rank 0: 2 images per batch; rank 1: none."""
    g = torch.Generator().manual_seed(rank)
    n = 2 if rank == 0 else 0
    return [
        {"input_ids": torch.randint(0, 64, (2, 8), generator=g), "images": torch.randn(n, 48)}
        for _ in range(STEPS)
    ]


def reference() -> dict[str, Tensor]:
    """One process: each step the mean of the two ranks' losses, SGD; the final weights."""
    module = OwnVLM()
    opt = module.configure_optimizers()
    data = [batches(0), batches(1)]
    for step in range(STEPS):
        opt.zero_grad()
        loss = (module.loss(data[0][step]) + module.loss(data[1][step])) / 2
        loss.backward()
        opt.step()
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _fit(rank: int, data_parallel: str, dummy: bool, check: bool = True) -> dict[str, Any]:
    start = time.perf_counter()
    module = OwnVLM(dummy)
    strategy = MultimodalParallelStrategy(data_parallel=data_parallel, check_unit_order=check)
    trainer = quiet_trainer(
        strategy=strategy,
        devices=2,
        max_epochs=1,
        use_distributed_sampler=False,
        limit_val_batches=0,
    )
    try:
        trainer.fit(module, DataLoader(batches(rank), batch_size=None))  # type: ignore[arg-type]
    except RuntimeError as err:
        return {"error": str(err), "seconds": time.perf_counter() - start}
    weights = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in module.named_parameters()
    }
    guarded = strategy._unit_order is not None
    hooks = sum(len(m._forward_pre_hooks) for m in module.modules())  # FSDP2's and the guard's
    units = sum(isinstance(m, FSDPModule) for m in module.modules())
    out = {"weights": weights, "seconds": time.perf_counter() - start}
    return {**out, "guarded": guarded, "hooks": hooks, "units": units}


def nccl_group(rank: int) -> dict[str, Any]:
    """``cpu_group`` of the world group read as NCCL: a new gloo group, same ranks; the
    ranks' all-gather over it."""
    world = dist.group.WORLD
    with mock.patch.object(unit_order, "_backend", return_value="nccl"):
        group = unit_order.cpu_group(world)
    parts = [torch.zeros(1, dtype=torch.int64) for _ in range(2)]
    dist.all_gather(parts, torch.tensor([10 + rank]), group=group)
    return {
        "new": group is not world,
        "backend": str(dist.get_backend(group)),
        "ranks": dist.get_process_group_ranks(group),
        "gathered": [int(p) for p in parts],
    }


def world(rank: int) -> dict[str, Any]:
    """The runs on this rank, by name."""
    return {  # the run that raises last
        "nccl group": nccl_group(rank),
        "ddp skipped": _fit(rank, "ddp", dummy=False),
        "fsdp dummy": _fit(rank, "fsdp", dummy=True),
        "fsdp dummy, unchecked": _fit(rank, "fsdp", dummy=True, check=False),
        "fsdp skipped": _fit(rank, "fsdp", dummy=False),
    }
