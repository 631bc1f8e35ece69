"""Deprecated: :class:`GradientStash` moved to :mod:`lightning_mmpar.strategy.gradient_stash`
(the strategy's own step mechanics).

The alias resolves on first use, by module name, so that ``parallel/`` does not import the
strategy (the layering contracts in pyproject.toml); it goes in the next release.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any


def __getattr__(name: str) -> Any:
    if name != "GradientStash":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        "lightning_mmpar.parallel.stash.GradientStash moved to "
        "lightning_mmpar.strategy.gradient_stash.GradientStash; import it from there.",
        DeprecationWarning,
        stacklevel=2,
    )
    return importlib.import_module("lightning_mmpar.strategy.gradient_stash").__dict__[name]
