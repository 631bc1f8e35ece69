"""Deprecated: :class:`ShardedCheckpointHooks` moved to
:mod:`lightning_mmpar.strategy.checkpoint_hooks` (a mixin of the strategy, not a mechanism).

The alias resolves on first use, by module name, so that ``parallel/`` does not import the
strategy (the layering contracts in pyproject.toml); it goes in the next release.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any


def __getattr__(name: str) -> Any:
    if name != "ShardedCheckpointHooks":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        "lightning_mmpar.parallel.checkpoint_hooks.ShardedCheckpointHooks moved to "
        "lightning_mmpar.strategy.ShardedCheckpointHooks; import it from there.",
        DeprecationWarning,
        stacklevel=2,
    )
    return importlib.import_module("lightning_mmpar.strategy.checkpoint_hooks").__dict__[name]
