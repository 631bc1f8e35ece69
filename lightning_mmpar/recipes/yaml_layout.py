"""The recipe YAML's own layout in the planner's ranking: where it ranks and why.

A planner that only prints its best layouts leaves a user asking where the layout they launch
stands. :func:`yaml_layout` reads that layout from the YAML (``trainer.strategy``,
``trainer.accumulate_grad_batches``, ``model.plan``, ``data.batch_size``, the precision) and
:func:`report` prices it like every candidate and explains its place: the terms of the
predicted step (compute, pipeline bubble, communication per mesh dimension) and the memory per
rank, next to the best layout's, the largest gap named first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from lightning_mmpar.layout import ParallelLayout
from lightning_mmpar.layout.cost import GIB, Prediction
from lightning_mmpar.layout.planner import describe, refusal
from lightning_mmpar.recipes.partition import _strategy_args, data_args

__all__ = ["report", "yaml_layout"]

_FIELDS = {
    "tensor_parallel": "tp",
    "pipeline_parallel": "pp",
    "virtual_pipeline": "virtual",
    "expert_parallel": "ep",
    "micro_batches": "micro_batches",
    "schedule": "schedule",
    "data_parallel": "data_parallel",
    "vision_ranks": "vision_ranks",
    "vision_data_parallel": "vision_data_parallel",
}


def yaml_layout(config: dict[str, Any], base: ParallelLayout, gpus: int) -> ParallelLayout | str:
    """The layout the YAML launches on ``gpus`` devices (``base``: the planner's defaults:
    precision, partition, vision mode), or why it has none there (a string: the YAML's degrees
    do not divide ``gpus``). With ``vision_ranks: V`` the layout's tp x pp x dp spans the
    ``gpus - V`` language ranks."""
    args = _strategy_args(config)
    values = {
        ours: args[theirs] for theirs, ours in _FIELDS.items() if args.get(theirs) is not None
    }
    plan = (config.get("model") or {}).get("plan") or {}
    trainer = config.get("trainer") or {}
    tp, pp = int(values.get("tp", 1)), int(values.get("pp", 1))
    vision = int(values.get("vision_ranks", 0))
    if vision:  # non-colocated towers: the language ranks are the others
        if not 0 < vision < gpus or (gpus - vision) % (tp * pp):
            return f"its vision_ranks {vision} + tp {tp} x pp {pp} x dp do not make --gpus {gpus}"
    elif gpus % (tp * pp):
        return f"its tp {tp} x pp {pp} does not divide --gpus {gpus}"
    dp = (gpus - vision) // (tp * pp)
    batch = int(data_args(config).get("batch_size", 1) or 1)
    layout = replace(
        base,
        **values,
        dp=dp,
        accumulate=int(trainer.get("accumulate_grad_batches", 1) or 1),
        sequence_parallel=bool(plan.get("sequence_parallel", base.sequence_parallel)),
        vision_parallel=str(plan.get("vision_parallel", base.vision_parallel)),
        activation_checkpointing=bool(args.get("activation_checkpointing")),
    )
    # the strategy splits each dp rank's batch into the schedule's micro-batches (by default
    # pipeline_parallel of them, ParallelLayout.num_micro_batches)
    return replace(layout, micro_batch_size=max(1, batch // layout.num_micro_batches))


def report(
    own: ParallelLayout | str,
    ranked: Sequence[Prediction],
    price: Callable[[ParallelLayout], Prediction],
    facts: Any,
    gpus: int,
) -> list[str]:
    """Lines saying where ``own`` ranks among ``ranked`` (fastest first) and why: refused (the
    strategy's message), not fitting (the memory), or its rank with the step's terms next to
    the best's. ``price(layout)`` predicts one layout as the planner does."""
    if isinstance(own, str):
        return [f"the YAML's layout: not on {gpus} devices ({own})"]
    name = describe(own)
    head = f"the YAML's layout: {name}"
    reason = refusal(own, facts, gpus)
    if reason:
        return [f"{head}: refused: {reason}"]
    try:
        mine = price(own)
    except ValueError as err:
        return [f"{head}: refused: {err}"]
    if not mine.fits:
        return [f"{head}: does not fit: {mine.reason}"]
    place = 1 + sum(p.step_seconds < mine.step_seconds for p in ranked)
    total = len(ranked) + (0 if any(describe(p.layout) == name for p in ranked) else 1)
    if not ranked:
        return [f"{head}: rank 1 of 1"]
    best = ranked[0]
    ratio = mine.step_seconds / best.step_seconds if best.step_seconds else 1.0
    lines = [
        f"{head}: rank {place} of {total}, step {mine.step_seconds:.4g} s vs the best's "
        f"{best.step_seconds:.4g} s (x{ratio:.2f})"
    ]
    return lines + _gaps(mine, best)


def _gaps(mine: Prediction, best: Prediction) -> list[str]:
    """``why:`` lines: each part of the step (:attr:`Prediction.breakdown`) where ``mine``
    differs from ``best``, the largest gap first, and the memory per rank."""
    own, top = mine.breakdown, best.breakdown
    keys = sorted(set(own) | set(top), key=lambda k: -abs(own.get(k, 0.0) - top.get(k, 0.0)))
    lines = []
    for key in keys:
        a, b = own.get(key, 0.0), top.get(key, 0.0)
        if abs(a - b) > 1e-3 * max(mine.step_seconds, 1e-12):
            lines.append(f"  {key}: {a:.4g} s vs {b:.4g} s ({a - b:+.4g} s)")
    gib = (mine.memory.total / GIB, best.memory.total / GIB)
    lines.append(f"  memory per rank: {gib[0]:.2f} GiB vs {gib[1]:.2f} GiB")
    return ["  why (this layout vs the best, largest gap first):", *lines]
