"""Issue 9, fault 8: a trainable parameter used outside the pipeline blocks is refused.

Under pipeline parallelism such a parameter (a loss scale used in ``pipeline_loss``, say) exists
on every pipeline rank: the last stage sums its gradient over micro-batches, the other ranks
never train it, and the checkpoint stores the first stage's stale copy. ``PipelineEngine``
refuses it at set-up, naming it and the fix. No process group is needed: the check runs before
any communication.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_mmpar.config import ParallelConfig
from lightning_mmpar.parallel.pipeline import PipelineEngine


class Toy(nn.Module):
    """Two linear blocks and a loss scale outside them (trainable unless ``frozen``)."""

    def __init__(self, *, frozen: bool = False, inside: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.loss_scale = nn.Parameter(torch.ones(()), requires_grad=not frozen)
        if inside:  # the fix: the last block owns it
            self.blocks[-1].register_parameter("loss_scale", self.loss_scale)

    def pipeline_blocks(self) -> list[nn.Module]:
        return list(self.blocks)

    def pipeline_inputs(self, batch: Any) -> tuple[tuple[Tensor, ...], Tensor]:
        return (batch[0],), batch[1]

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return ((self.loss_scale * output - target) ** 2).mean()


def engine(module: nn.Module) -> PipelineEngine:
    config = ParallelConfig(pipeline_parallel=2, micro_batches=2)
    return PipelineEngine(module, config, None, torch.device("cpu"))  # type: ignore[arg-type]


def test_trainable_parameter_outside_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="outside pipeline_blocks\\(\\): loss_scale;") as err:
        engine(Toy())
    assert "Move them into a block (the last one" in str(err.value)


def test_parameters_in_blocks_or_frozen_are_accepted() -> None:
    for module in (Toy(frozen=True), Toy(inside=True)):
        built = engine(module)
        assert built.has_first and built.has_last  # one process holds both stages
