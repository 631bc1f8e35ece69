"""The FSDP2 unit-order guard's opt-out (``check_unit_order``) and its CPU group.

The guard itself (one error naming each rank's next unit) and the gloo group it builds beside
an NCCL dp group run in the 2-process ragged world (tests/recipes/skipped_tower_worker.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_mmpar import MultimodalParallelStrategy
from lightning_mmpar.config import ParallelConfig
from lightning_mmpar.parallel import comm, unit_order
from lightning_mmpar.parallel.parallelize import ParallelizeOptions, split_pipeline


def test_check_unit_order_false_installs_no_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    """A module with its own steps and 2 units on 2 dp ranks (faked): guarded by default, one
    pre-hook per unit; with ``check_unit_order=False`` no guard and no hook."""
    monkeypatch.setattr(unit_order, "_is_unit", lambda m: isinstance(m, nn.Linear))
    monkeypatch.setattr(comm, "group_size", lambda group=None: 2)
    monkeypatch.setattr(unit_order, "cpu_group", lambda group: group)
    dims = SimpleNamespace(get_group=lambda name: None)
    for check in (True, False):
        model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
        options = ParallelizeOptions(ParallelConfig(), check_unit_order=check)
        done = split_pipeline(model, dims, options, lambda m, *blocks: None)  # type: ignore[arg-type]
        hooks = sum(len(m._forward_pre_hooks) for m in model.modules())
        assert (done.unit_order is not None, hooks) == ((True, 2) if check else (False, 0))


def test_check_unit_order_is_a_validated_strategy_argument() -> None:
    assert MultimodalParallelStrategy().check_unit_order is True
    assert MultimodalParallelStrategy(check_unit_order=False).check_unit_order is False
    with pytest.raises(ValueError, match=r"check_unit_order='no': give True .* or False"):
        MultimodalParallelStrategy(check_unit_order="no")  # type: ignore[arg-type]


def test_the_guard_exchanges_on_the_cpu_without_a_gpu_sync(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two ranks (faked): the integer goes through the group as a CPU tensor, whatever the
    device of the group's collectives (``comm.group_device`` would pick CUDA for NCCL)."""
    guard = unit_order.UnitOrderGuard([("a", nn.Linear(1, 1))], None)
    sent: list[torch.Tensor] = []

    def gather(parts: list[torch.Tensor], mine: torch.Tensor, group: object = None) -> None:
        sent.append(mine)
        for p in parts:
            p.copy_(mine)

    monkeypatch.setattr(comm, "group_size", lambda group=None: 2)
    monkeypatch.setattr(comm, "group_device", lambda group=None: torch.device("cuda", 0))
    monkeypatch.setattr(comm.dist, "all_gather", gather)
    guard.check(0)
    assert len(sent) == 1 and sent[0].device.type == "cpu"
