"""What the set-up broadcast covers and where torch's DDP applies (:mod:`~lightning_mmpar.
parallel.replication`), without processes; the collectives are
``tests/distributed/parallel/test_replication.py``."""

from __future__ import annotations

import torch
from torch import nn

from lightning_mmpar.config import ParallelConfig
from lightning_mmpar.parallel.replication import ddp_fallback, module_state
from lightning_mmpar.topology import ParallelDims


def test_module_state_is_every_parameter_and_persistent_buffer_once() -> None:
    lin = nn.Linear(2, 3)
    frozen = nn.Linear(3, 3).requires_grad_(False)
    model = nn.Sequential(lin, frozen, lin)  # lin shared: listed once
    model.register_buffer("kept", torch.zeros(2))
    model.register_buffer("derived", torch.zeros(2), persistent=False)
    model.register_buffer("ones", torch.ones(1).expand(3))  # one element, seen 3 times
    with torch.device("meta"):
        model.add_module("deferred", nn.Linear(2, 2))
    dense, experts = module_state(model)
    expected = [lin.weight, lin.bias, frozen.weight, frozen.bias, model.kept]
    assert [t.data_ptr() for t in dense] == [t.data_ptr() for t in expected]
    assert experts == []


def test_torch_ddp_applies_at_tp_and_pp_one_only() -> None:
    ddp = ParallelConfig(data_parallel="ddp")
    assert ddp_fallback(ParallelDims(world_size=2), ddp) is None
    assert ddp_fallback(ParallelDims(world_size=4, ep=2), ddp) is None  # experts: edp path
    reason = ddp_fallback(ParallelDims(world_size=4, tp=2), ddp)
    assert reason is not None and reason.startswith("tensor_parallel > 1")
    reason = ddp_fallback(ParallelDims(world_size=4, pp=2), ddp)
    assert reason is not None and reason.startswith("pipeline_parallel > 1")
    assert ddp_fallback(ParallelDims(world_size=1), ddp) is not None  # nothing to reduce
    assert ddp_fallback(ParallelDims(world_size=2), ParallelConfig()) is not None  # fsdp
