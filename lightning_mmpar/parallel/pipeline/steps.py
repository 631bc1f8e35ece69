"""A pipeline stage's blocks as one module (:class:`PipelineChunk`) and Lightning steps for a
pipeline module under any strategy (:class:`PipelineSteps`: the blocks chained in order on the
whole batch). Both are re-exported by :mod:`lightning_mmpar.parallel.pipeline`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

from lightning_mmpar.parallel.token_loss import as_token_mean

__all__ = ["PipelineChunk", "PipelineSteps"]


class PipelineChunk(nn.Module):
    """Consecutive blocks run as one stage: ``y = b_k(...b_1(*x))``, tuples unpacked.

    Outputs are made contiguous: they are a stage's send buffers and the templates of the next
    stage's receive buffers, and point-to-point ops refuse non-contiguous tensors (a block may
    return a view, e.g. rows broadcast with ``expand``). Views are copied: torch's zero-bubble
    input backward detaches the stage outputs in place, which views refuse.
    """

    def __init__(self, blocks: Sequence[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, *args: Tensor) -> Tensor | tuple[Tensor, ...]:
        for block in self.blocks:
            out = block(*args)
            args = out if isinstance(out, tuple) else (out,)
        args = tuple(t.clone() if t._is_view() else t.contiguous() for t in args)
        return args[0] if len(args) == 1 else args


class PipelineSteps:
    """Lightning steps for a :class:`PipelineModule`, so it trains under any strategy.

    Mix in before ``LightningModule``. Each step runs the blocks in order on the whole batch and
    logs ``train_loss`` / ``val_loss`` / ``test_loss``; under ``mm_parallel`` the strategy runs
    the same computation through its pipeline schedule instead and logs the same names. A
    ``(sum, token count)`` from ``pipeline_loss`` becomes this batch's token mean here (a
    :class:`~lightning_mmpar.parallel.token_loss.TokenMean`); only ``mm_parallel`` normalises it
    over the whole step's tokens (under other strategies each batch and rank weighs the same).
    """

    def _pipeline_step(self, name: str, batch: Any) -> Tensor:
        inputs, target = self.pipeline_inputs(batch)  # type: ignore[attr-defined]
        chunk = PipelineChunk(self.pipeline_blocks())  # type: ignore[attr-defined]
        loss = as_token_mean(self.pipeline_loss(chunk(*inputs), target))  # type: ignore[attr-defined]
        self.log(f"{name}_loss", loss, prog_bar=True, sync_dist=True)  # type: ignore[attr-defined]
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self._pipeline_step("train", batch)

    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self._pipeline_step("val", batch)

    def test_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self._pipeline_step("test", batch)
