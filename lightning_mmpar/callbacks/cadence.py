"""When a callback's per-step work is due: once, right after every N-th optimizer step."""

from __future__ import annotations

__all__ = ["OptimizerStepCadence"]


class OptimizerStepCadence:
    """Says, at ``on_train_batch_end``, whether an every-``N``-optimizer-steps action is due.

    ``trainer.global_step`` counts optimizer steps; under gradient accumulation several batches
    end with the same value. :meth:`due` is true for the first batch end after the step count
    reached a multiple of ``every`` (never mid-accumulation, never twice for one step) - the
    same rule on every rank, so a collective behind it is entered by all of them.
    """

    def __init__(self) -> None:
        self.last_step = -1
        """The optimizer step at which :meth:`due` last returned True (``-1``: never)."""

    def due(self, step: int, every: int) -> bool:
        """True once per ``step`` (``trainer.global_step``) that is a multiple of ``every``
        (``every < 1`` counts as 1)."""
        if step == self.last_step or step % max(int(every), 1):
            return False
        self.last_step = step
        return True
