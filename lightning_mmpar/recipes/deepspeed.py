"""Deprecated alias of :mod:`lightning_mmpar.recipes.deepspeed_cli`; removed in the next
release."""

import warnings

from lightning_mmpar.recipes.deepspeed_cli import (
    apply_deepspeed_json,
    optim_from_deepspeed,
    strategy_from_deepspeed,
)

__all__ = ["apply_deepspeed_json", "optim_from_deepspeed", "strategy_from_deepspeed"]

warnings.warn(
    "lightning_mmpar.recipes.deepspeed moved to lightning_mmpar.recipes.deepspeed_cli; import "
    "from there or from lightning_mmpar.recipes (this alias goes in the next release).",
    DeprecationWarning,
    stacklevel=2,
)
