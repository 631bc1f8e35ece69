"""Deprecated alias: the DeepSpeed JSON mapping is
:mod:`lightning_mmpar.parallel.deepspeed_mapping`, the CPU-capable DeepSpeed strategy
:mod:`lightning_mmpar.parallel.deepspeed_strategy`; removed in the next release."""

import warnings

from lightning_mmpar.parallel.deepspeed_mapping import (
    BATCH_KEYS,
    LIGHTNING_REFUSES,
    MAPPED_KEYS,
    MM_PARALLEL_KEYS,
    NESTED_MAPPED,
    TOP_LEVEL_KEYS,
    ZERO3_NOTE,
    ZERO_KEYS,
    DeepSpeedPlan,
    Engine,
    closest,
    map_deepspeed_config,
    resolve_batch,
)
from lightning_mmpar.parallel.deepspeed_strategy import CPUCapableDeepSpeedStrategy

__all__ = [
    "BATCH_KEYS",
    "LIGHTNING_REFUSES",
    "MAPPED_KEYS",
    "MM_PARALLEL_KEYS",
    "NESTED_MAPPED",
    "TOP_LEVEL_KEYS",
    "ZERO3_NOTE",
    "ZERO_KEYS",
    "CPUCapableDeepSpeedStrategy",
    "DeepSpeedPlan",
    "Engine",
    "closest",
    "map_deepspeed_config",
    "resolve_batch",
]

warnings.warn(
    "lightning_mmpar.parallel.deepspeed is split into lightning_mmpar.parallel.deepspeed_mapping "
    "(the JSON mapping) and lightning_mmpar.parallel.deepspeed_strategy "
    "(CPUCapableDeepSpeedStrategy); import from those (this alias goes in the next release).",
    DeprecationWarning,
    stacklevel=2,
)
