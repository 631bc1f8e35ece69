"""``--deepspeed ds_config.json``: the strategy a DeepSpeed JSON maps to, for the recipe's CLI.

The mapping itself (:func:`lightning_mmpar.parallel.deepspeed.map_deepspeed_config`) is a pure
function in ``parallel/``; building a strategy from it needs the strategy class, which only the
recipe layer may import.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities import rank_zero_info

from lightning_mmpar.parallel.deepspeed import (
    MM_PARALLEL_KEYS,
    CPUCapableDeepSpeedStrategy,
    map_deepspeed_config,
)
from lightning_mmpar.strategy import MultimodalParallelStrategy

__all__ = ["strategy_from_deepspeed"]


def strategy_from_deepspeed(config: dict[str, Any], *, base: Any = None) -> Strategy:
    """Build the strategy a DeepSpeed JSON maps to; ``base`` is the recipe's current strategy
    (an ``mm_parallel`` instance, whose layout is kept, or anything else).

    ZeRO-1/2 give :class:`CPUCapableDeepSpeedStrategy` (``DS_ACCELERATOR=cpu`` set without a
    GPU, before DeepSpeed is first imported); stages 0 and 3 give ``MultimodalParallelStrategy``.

    Raises:
        ValueError: what :func:`map_deepspeed_config` refuses (unknown stage, ZeRO-3 offload,
            ZeRO-1/2 with model parallelism, a contradicting ``tp_size``).
    """
    layout: dict[str, Any] = {}
    if isinstance(base, MultimodalParallelStrategy):
        c = base.config
        layout = {k: getattr(c, k) for k in MM_PARALLEL_KEYS}
    plan = map_deepspeed_config(config, layout=layout)
    if plan.note:
        rank_zero_info(f"[lightning_mmpar] {plan.note}")
    if plan.engine == "deepspeed":
        if not torch.cuda.is_available():  # DeepSpeed reads it when first imported
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        return CPUCapableDeepSpeedStrategy(**plan.strategy_kwargs)
    return MultimodalParallelStrategy(**plan.strategy_kwargs)
