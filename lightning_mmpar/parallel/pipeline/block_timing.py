"""Measured block costs for ``partition="measured"``: each pipeline block's forward + backward
of one micro-batch, timed once at set-up.

A FLOPs count prices a block by its matrix products; where per-operator overhead sets the time
(small blocks, CPUs, many element-wise operators around each product), it mis-prices stages: on
the CPU recipe the FLOPs-balanced pp 2 cut is 1.10 apart by FLOPs and about 1.3 apart in time.
:func:`time_blocks` runs the module's blocks in order on one micro-batch of a real batch (the
first rows of it, as the engine splits a batch), times each block's forward and backward (the
last block's with the module's ``pipeline_loss``), keeps the fastest of a few repeats (a loaded
machine only ever slows a run down), and averages the times over every rank, so every rank
cuts the same plan. Profile-guided partitioning as PipeDream's planner does it from a profile of
each layer's compute time (Narayanan et al. 2019).

The measurement leaves the module as it found it: every random generator (``fork_rng`` and the
model-parallel tracker), the parameters' gradients and the buffers are put back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_mmpar.parallel import comm
from lightning_mmpar.parallel.pipeline.engine import _rng_untouched
from lightning_mmpar.parallel.token_loss import TokenMean, as_token_mean

__all__ = ["first_batch", "time_blocks"]

Loss = Callable[[Any, Any], Any]
"""``loss(last_block_output, target)``: the module's ``pipeline_loss``."""


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _as_tuple(out: Any) -> tuple[Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


def _scalar(loss: Any) -> Tensor:
    loss = as_token_mean(loss)
    return loss.token_sum if isinstance(loss, TokenMean) else loss


def _once(
    blocks: Sequence[nn.Module], x: tuple[Tensor, ...], target: Any, loss_fn: Loss, device: Any
) -> list[float]:
    """Forward + backward seconds of each block on ``x`` (one pass)."""
    times = []
    for i, block in enumerate(blocks):
        inputs = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in x)
        _sync(device)
        start = time.perf_counter()
        out = _as_tuple(block(*inputs))
        if i == len(blocks) - 1:
            roots = [_scalar(loss_fn(out[0] if len(out) == 1 else out, target))]
            grads = None
        else:
            roots = [t for t in out if t.requires_grad]
            grads = [torch.ones_like(t) for t in roots]
        if roots and roots[0].requires_grad:
            torch.autograd.backward(roots, grads)
        _sync(device)
        times.append(time.perf_counter() - start)
        x = tuple(t.detach() for t in out)
    return times


@contextmanager
def _module_untouched(blocks: Sequence[nn.Module], device: torch.device) -> Iterator[None]:
    """Random generators, parameter gradients and buffers as they were, after the block."""
    params = {id(p): p for b in blocks for p in b.parameters()}
    grads = {k: p.grad for k, p in params.items()}
    buffers = [(b, b.detach().clone()) for blk in blocks for b in blk.buffers()]
    try:
        with _rng_untouched(device):
            yield
    finally:
        for k, p in params.items():
            p.grad = grads[k]
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)


def time_blocks(
    blocks: Sequence[nn.Module],
    inputs: tuple[Tensor, ...],
    target: Any,
    loss_fn: Loss,
    *,
    repeats: int = 3,
    group: dist.ProcessGroup | None = None,
) -> list[float]:
    """Seconds of each block's forward + backward of ``inputs`` (one micro-batch; the last
    block's with ``loss_fn(output, target)`` and its backward): the fastest of ``repeats`` runs
    after one warm-up, averaged over the ranks of ``group`` (the default group when initialised;
    every rank must call it: collective).

    Raises:
        ValueError: ``repeats`` below 1 or no block.
    """
    if repeats < 1 or not blocks:
        raise ValueError(
            f"time_blocks needs repeats >= 1 ({repeats!r}) and at least one block "
            f"({len(blocks)}); pass repeats=3 and the module's pipeline_blocks()."
        )
    device = inputs[0].device if inputs else torch.device("cpu")
    with _module_untouched(blocks, device):
        runs = [_once(blocks, inputs, target, loss_fn, device) for _ in range(repeats + 1)]
    best = [min(r[i] for r in runs[1:]) for i in range(len(blocks))]
    if comm.is_distributed():
        mean = comm.all_reduce(torch.tensor(best, dtype=torch.float64, device=device), "avg", group)
        best = mean.tolist()
    return best


def first_batch(module: Any, micro_batches: int) -> tuple[tuple[Tensor, ...], Any]:
    """One micro-batch ``(inputs, target)`` of the first training batch of the module's data
    module (``trainer.datamodule.train_dataloader()``, drawn with every generator put back):
    the first ``batch // micro_batches`` rows, as the engine splits a batch; tensors on the
    module's device.

    Raises:
        ValueError: the module's trainer has no data module with a ``train_dataloader``.
    """
    data = getattr(getattr(module, "_trainer", None), "datamodule", None)
    loader = getattr(data, "train_dataloader", None)
    if loader is None:
        raise ValueError(
            "partition='measured' times the pipeline blocks on the first training batch of the "
            "data module, and this Trainer has none; pass datamodule= to fit, or use "
            "partition='balanced' (FLOPs) or explicit boundaries."
        )
    device = next(iter(module.parameters())).device
    with _rng_untouched(device):
        batch = next(iter(loader()))
    batch = _to(batch, device)
    inputs, target = module.pipeline_inputs(batch)
    first = tuple(t.tensor_split(micro_batches)[0] for t in inputs)
    if isinstance(target, Tensor):
        target = target.tensor_split(micro_batches)[0]
    return first, target


def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(_to(v, device) for v in batch)
    return batch
