"""Deprecated: :class:`GradientStash` moved to :mod:`lightning_mmpar.strategy.gradient_stash`
(the strategy's own step mechanics).

The alias reads :data:`lightning_mmpar.parallel.MOVED_TO_STRATEGY` (filled by the package's
``__init__``), so ``parallel/`` does not import the strategy; it goes in the next release.
"""

from __future__ import annotations

from typing import Any

from lightning_mmpar.parallel import moved_to_strategy


def __getattr__(name: str) -> Any:
    if name != "GradientStash":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return moved_to_strategy(__name__, name)
