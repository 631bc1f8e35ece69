"""Deprecated module alias of :mod:`lightning_mmpar.recipes.options` (the recipe's options; the
name clashed with ``lightning_mmpar.config`` and ``lightning_mmpar.callbacks.config``)."""

import warnings

from lightning_mmpar.recipes.options import (
    FinetuneConfig,
    FusionPlanOptions,
    LossConfig,
    OptimConfig,
    PretrainedConfig,
    TensorParallelOptions,
    check_image_size,
)

__all__ = [
    "FinetuneConfig",
    "FusionPlanOptions",
    "LossConfig",
    "OptimConfig",
    "PretrainedConfig",
    "TensorParallelOptions",
    "check_image_size",
]

warnings.warn(
    "lightning_mmpar.recipes.config is deprecated: import from lightning_mmpar.recipes.options.",
    DeprecationWarning,
    stacklevel=2,
)
