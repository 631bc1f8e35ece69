"""In-memory snapshot of weights, buffers and optimizer state (the "last stable" state)."""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_mmpar.parallel.comm import to_local


def clone_tree(obj: Any, device: torch.device | None = None) -> Any:
    """Deep copy of nested dicts/lists/tuples whose tensors are cloned (optionally moved)."""
    if isinstance(obj, Tensor):
        t = obj.detach().clone()
        return t.to(device) if device is not None else t
    if isinstance(obj, dict):
        return {k: clone_tree(v, device) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(clone_tree(v, device) for v in obj)
    return obj


class Snapshot:
    """Copies of every parameter (local shard), buffer and optimizer state dict.

    Memory: one extra copy of the model and optimizer state, on the same device or on CPU.
    """

    def __init__(self, device: Literal["same", "cpu"] = "same") -> None:
        self.device = torch.device("cpu") if device == "cpu" else None
        self.step = -1
        self.tensors: dict[str, Tensor] = {}
        self.optim: list[dict[str, Any]] = []

    def take(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Copy the current state; remember ``trainer.global_step``."""
        named = [*pl_module.named_parameters(), *pl_module.named_buffers()]
        self.tensors = {n: clone_tree(to_local(t), self.device) for n, t in named}
        self.optim = [clone_tree(opt.state_dict(), self.device) for opt in trainer.optimizers]
        self.step = trainer.global_step

    def restore(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> int:
        """Copy the snapshot back in place; return the step it was taken at."""
        if self.step < 0:
            raise RuntimeError("Snapshot.restore() before take(); call take() in on_fit_start.")
        with torch.no_grad():
            for n, t in [*pl_module.named_parameters(), *pl_module.named_buffers()]:
                if n in self.tensors:
                    to_local(t).copy_(self.tensors[n])
        for opt, state in zip(trainer.optimizers, self.optim, strict=True):
            opt.load_state_dict(clone_tree(state))  # clone: the optimizer mutates in place
        return self.step
