"""Peak memory of every rank, logged: pipeline stages and tensor shards differ, so one rank's
figure says little about the others.

Every ``log_every_n_steps``-th optimizer step each rank reads its peak: on CUDA the caching
allocator's ``torch.cuda.max_memory_allocated`` (tensors; the reserved pool is larger), on a CPU
the peak resident set size of the process (``getrusage(RUSAGE_SELF).ru_maxrss``: everything the
process holds, Python and libraries included). One all-gather of a ``[1]`` float64 tensor over
the default group (:func:`lightning_mmpar.parallel.comm.all_gather`); rank 0 logs
``memory/peak_gib_rank<r>`` for every rank and ``memory/peak_gib_max`` to the Trainer's loggers,
in GiB (2**30 bytes).
"""

from __future__ import annotations

import resource
import sys
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_mmpar.callbacks.cadence import OptimizerStepCadence
from lightning_mmpar.parallel import comm

__all__ = ["PeakMemory", "peak_bytes"]

GIB = float(2**30)


def peak_bytes(device: torch.device) -> float:
    """This process's peak memory in bytes on ``device`` (module docstring)."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(rss if sys.platform == "darwin" else rss * 1024)  # Linux: KiB


class PeakMemory(Callback):
    """Logs every rank's peak memory (module docstring) at the Trainer's logging cadence."""

    def __init__(self) -> None:
        self.last: list[float] = []
        """The last gathered peaks, GiB, by global rank."""
        self._cadence = OptimizerStepCadence()

    def gather(self, trainer: pl.Trainer) -> list[float]:
        """Every rank's peak in GiB, by global rank (a collective when a group exists)."""
        device = trainer.strategy.root_device
        mine = torch.tensor([peak_bytes(device) / GIB], dtype=torch.float64)
        return [float(t.item()) for t in comm.all_gather(mine)]

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        step = trainer.global_step
        if not self._cadence.due(step, getattr(trainer, "log_every_n_steps", 50)):
            return  # once per logging step, right after the optimizer step
        self.last = self.gather(trainer)
        if trainer.is_global_zero and trainer.loggers:
            metrics = {f"memory/peak_gib_rank{r}": v for r, v in enumerate(self.last)}
            metrics["memory/peak_gib_max"] = max(self.last)
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)
