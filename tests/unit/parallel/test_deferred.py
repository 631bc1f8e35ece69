"""``parallel/deferred.py``: the strategy's contract with modules that fill meta parameters
after sharding (the 4-process FSDP path is in tests/recipes/test_pretrained.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_mmpar.parallel import deferred


class Filling(nn.Module):
    """A meta ``lin.weight`` shared with ``alias``; the hook fills it (or not: ``fill=False``)."""

    def __init__(self, fill: bool = True) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        with torch.device("meta"):
            self.lin.weight = nn.Parameter(torch.empty(2, 3))
        self.alias = nn.Module()
        self.alias.w = self.lin.weight
        self.fill, self.devices = fill, []

    def load_sharded_parameters(self, device: torch.device) -> None:
        self.devices.append(device)
        if self.fill:
            new = nn.Parameter(torch.ones(2, 3, device=device))
            deferred.assign([(self.lin, "weight"), (self.alias, "w")], new)


def test_move_leaves_meta_tensors_and_the_hook_fills_every_registration() -> None:
    module = Filling()
    assert deferred.defers(module) and not deferred.defers(nn.Linear(1, 1))
    bias = module.lin.bias
    deferred.move(module, torch.device("cpu"))  # .to() would raise on the meta weight
    assert module.lin.weight.is_meta and module.lin.bias is bias
    deferred.load_deferred(module, torch.device("cpu"))
    assert module.devices == [torch.device("cpu")]
    assert module.alias.w is module.lin.weight and torch.equal(module.lin.weight, torch.ones(2, 3))
    assert len(list(module.parameters())) == 2  # shared: one parameter, not two


def test_meta_tensors_left_by_the_hook_raise() -> None:
    with pytest.raises(RuntimeError, match=r"left tensors on the meta device: \['lin.weight'\]"):
        deferred.load_deferred(Filling(fill=False), torch.device("cpu"))
    deferred.load_deferred(nn.Linear(1, 1), torch.device("cpu"))  # no hook: nothing to do
