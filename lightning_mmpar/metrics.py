"""Deprecated alias of :mod:`lightning_mmpar.recipes.metrics` (the recipe is its only user);
removed in the next release."""

import warnings

from lightning_mmpar.recipes.metrics import RetrievalRecall, ZeroShotAccuracy, recall_at_k

__all__ = ["RetrievalRecall", "ZeroShotAccuracy", "recall_at_k"]

warnings.warn(
    "lightning_mmpar.metrics moved to lightning_mmpar.recipes.metrics; import from there "
    "(this alias goes in the next release).",
    DeprecationWarning,
    stacklevel=2,
)
