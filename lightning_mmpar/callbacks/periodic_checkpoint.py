"""One ``last.ckpt`` on two triggers: every ``n`` training steps and every ``h:m:s`` of training.

Lightning's ``ModelCheckpoint`` takes one of ``every_n_train_steps``, ``train_time_interval`` and
``every_n_epochs`` per instance (its ``__init__`` refuses two), so a recipe wanting both used two
instances with ``save_last``; the second one found the first one's ``last.ckpt`` and wrote
``last-v1.ckpt`` (Lightning's version counter), and ``ckpt_path: auto`` then resumed from
whichever was newer. :class:`PeriodicCheckpoint` is one ``ModelCheckpoint`` with both triggers:
Lightning's ``on_train_batch_end`` already saves when either is due (the time decision broadcast
from rank 0), so only the check in ``__init__`` is relaxed.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint

__all__ = ["PeriodicCheckpoint"]


class PeriodicCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` that saves every ``every_n_train_steps`` optimizer steps **and**
    every ``train_time_interval`` of training, whichever comes first, into one ``last.ckpt``.

    Args:
        every_n_train_steps: steps between saves (``None`` or 0: no step trigger).
        train_time_interval: wall time between saves (``None``: no time trigger); in a YAML,
            ``"h:m:s"``.
        **kwargs: ``ModelCheckpoint``'s other arguments (``save_last``, ``save_top_k``,
            ``dirpath``, ...); ``every_n_epochs`` is not taken (``None`` only).

    Raises:
        ValueError: ``every_n_train_steps < 0``, or ``every_n_epochs`` given.
    """

    def __init__(
        self,
        every_n_train_steps: int | None = None,
        train_time_interval: timedelta | None = None,
        **kwargs: Any,
    ) -> None:
        if every_n_train_steps is not None and every_n_train_steps < 0:
            raise ValueError(
                f"PeriodicCheckpoint(every_n_train_steps={every_n_train_steps}) must be >= 0 "
                "(0 or None: no step trigger)."
            )
        if kwargs.pop("every_n_epochs", None) is not None:
            raise ValueError(
                "PeriodicCheckpoint(every_n_epochs=...): not taken; use "
                "Lightning's ModelCheckpoint(every_n_epochs=...) for epoch-end saves."
            )
        steps = every_n_train_steps if train_time_interval is None else None
        super().__init__(
            every_n_train_steps=steps, train_time_interval=train_time_interval, **kwargs
        )
        self._every_n_train_steps = every_n_train_steps or 0
