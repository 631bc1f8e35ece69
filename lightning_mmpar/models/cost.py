"""Deprecated alias of :mod:`lightning_mmpar.models.block_cost`; removed in the next release."""

import warnings

from lightning_mmpar.models.block_cost import BlockCost, CostTally, linear_weight

__all__ = ["BlockCost", "CostTally", "linear_weight"]

warnings.warn(
    "lightning_mmpar.models.cost moved to lightning_mmpar.models.block_cost; import from there "
    "or from lightning_mmpar.models (this alias goes in the next release).",
    DeprecationWarning,
    stacklevel=2,
)
