"""Enumerate the layouts of ``N`` devices, predict each (:func:`lightning_mmpar.layout.cost.
predict`) and rank them by predicted step time (pure Python). Every candidate is checked by
:func:`lightning_mmpar.layout.value.validate`, with what the model tells as ``facts`` (see
``python -m lightning_mmpar.recipes.planner``), the check the strategy runs.

Peers: Megatron-LM and torchtitan take a hand-written layout; DeepSpeed's autotuner and
Alpa/Galvatron search by trials or by a cost model of their own. This one is a cost model
checked against the package's own measurements (tests/unit/layout/test_cost_model.py,
benchmarks/bench_planner.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeAlias

from lightning_mmpar.layout.cost import DeviceSpec, Prediction, predict
from lightning_mmpar.layout.value import LayoutFacts, ParallelLayout, validate

__all__ = [
    "Rejected",
    "candidate_layouts",
    "describe",
    "divisors",
    "plan",
    "ranking_key",
    "refusal",
]

Facts: TypeAlias = LayoutFacts | Callable[[Any], LayoutFacts] | None
"""What the model tells about a layout: one :class:`LayoutFacts`, or a function of the layout
(a model's padded vocabulary depends on tp), or nothing known."""


def ranking_key(prediction: Prediction) -> tuple[float, int]:
    """The planner's order: the faster step first, then the smaller memory per rank."""
    return prediction.step_seconds, prediction.memory.total


@dataclass(frozen=True)
class Rejected:
    """A layout the planner will not run, and why (invalid, or over the memory limit)."""

    layout: Any
    reason: str
    prediction: Prediction | None = None
    """Set for layouts that are valid but do not fit."""


def divisors(n: int) -> list[int]:
    """The divisors of ``n >= 1`` in increasing order.

    Raises:
        ValueError: ``n`` not an int >= 1.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n ({n!r}) must be an int >= 1 to have divisors.")
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(
    world: int,
    num_blocks: int,
    *,
    global_batch: int,
    max_tp: int = 8,
    experts: int = 0,
    virtual: Sequence[int] = (1, 2, 4, 8),
    micro_batch_counts: Callable[[int, int], Iterable[int]] | None = None,
    sequence_parallel: Sequence[bool] = (False, True),
    data_parallel: Sequence[str] = ("fsdp", "ddp"),
    checkpointing: Sequence[bool] = (False, True),
    base: Any = None,
    vision_ranks: Sequence[int] = (0,),
    noncolocated_accumulate: Sequence[int] = (1, 2, 4, 8),
    vision_data_parallel: Sequence[str] = ("ddp",),
) -> list[Any]:
    """Every ``ParallelLayout`` of ``world`` devices at a fixed ``global_batch`` (samples per
    optimizer step): ``tp`` a divisor of ``world`` up to ``max_tp`` (a node's NVLink island),
    ``pp`` a divisor of the rest with ``pp * v <= num_blocks``, ``dp = world / (tp pp)`` dividing
    ``global_batch``, ``ep`` a divisor of ``dp`` and of ``experts`` (MoE models only), ``v``
    from ``virtual`` (``> 1``: ``interleaved_1f1b``), micro-batches per step from
    ``micro_batch_counts(pp, per_dp_batch)`` (default: ``pp``, ``2 pp``, ``4 pp`` and the whole
    per-rank batch, those dividing it; 1 without a pipeline), sequence parallelism only with
    ``tp > 1``, ``ddp`` only with ``dp > 1``. ``base``: a ``ParallelLayout`` whose other fields
    (precision, vision mode, partition) every candidate keeps. ``vision_ranks``: per ``V > 0``
    the same on ``world - V`` language ranks, the vision tower on ``V`` ranks of its own
    (non-colocated; no sequence or expert parallelism: unsupported there); ``0``: colocated.
    ``noncolocated_accumulate``: the batches per optimizer step (``accumulate``, Lightning's
    ``accumulate_grad_batches``) of the non-colocated ones, each ``A`` dividing
    ``global_batch`` enumerated at ``global_batch / A`` samples per batch (the engine's vision
    rank encodes one batch ahead inside each window of ``A`` batches:
    :func:`~lightning_mmpar.layout.towers_cost.run_ahead_seconds`); colocated layouts
    accumulate 1 (there accumulation only adds per-batch overhead).
    ``vision_data_parallel``: the vision ranks' engines tried (``"fsdp"`` only for ``V >= 2``:
    FSDP2 over one rank shards nothing).

    Raises:
        ValueError: ``world``, ``num_blocks``, ``global_batch``, ``max_tp`` or a
            ``noncolocated_accumulate`` value < 1.
    """
    if tuple(vision_ranks) != (0,):
        accumulate = tuple(noncolocated_accumulate)
        args = {k: a for k, a in locals().items() if k not in _NOT_ENUMERATED}
        _check_counts(**{f"noncolocated_accumulate[{i}]": a for i, a in enumerate(accumulate)})
        engines = args.pop("vision_data_parallel")
        return _with_vision_ranks(world, vision_ranks, args, accumulate, engines)
    _check_counts(world=world, num_blocks=num_blocks, global_batch=global_batch, max_tp=max_tp)
    base = base if base is not None else ParallelLayout()
    counts = micro_batch_counts or _micro_batch_counts
    out = []
    for tp in (d for d in divisors(world) if d <= max_tp):
        for pp in (d for d in divisors(world // tp) if d <= num_blocks):
            dp = world // (tp * pp)
            if global_batch % dp:
                continue
            per_dp = global_batch // dp
            eps = [e for e in divisors(dp) if experts % e == 0] if experts else [1]
            vs = [v for v in virtual if pp > 1 and pp * v <= num_blocks] if pp > 1 else [1]
            for ep, v, m in ((e, v, m) for e in eps for v in vs for m in counts(pp, per_dp)):
                if per_dp % m:
                    continue
                schedule = "1f1b" if v == 1 else "interleaved_1f1b"
                for sp in sequence_parallel if tp > 1 else (False,):
                    for mode in data_parallel if dp > 1 else ("fsdp",):
                        for ckpt in checkpointing:
                            out.append(
                                replace(
                                    base,
                                    tp=tp,
                                    pp=pp,
                                    dp=dp,
                                    ep=ep,
                                    virtual=v,
                                    micro_batches=m,
                                    micro_batch_size=per_dp // m,
                                    accumulate=1,
                                    schedule=schedule,
                                    sequence_parallel=sp,
                                    data_parallel=mode,
                                    activation_checkpointing=ckpt,
                                )
                            )
    return out


_NOT_ENUMERATED = ("world", "vision_ranks", "noncolocated_accumulate", "accumulate")
""":func:`candidate_layouts`' locals that :func:`_with_vision_ranks` does not pass on."""


def _with_vision_ranks(
    world: int,
    counts: Sequence[int],
    args: dict[str, Any],
    accumulate: Sequence[int],
    engines: Sequence[str] = ("ddp",),
) -> list[Any]:
    """:func:`candidate_layouts` (``args``) on ``world - V`` ranks for each ``V`` in
    ``counts``, with ``vision_ranks=V`` and each of ``engines`` as ``vision_data_parallel``
    (``"fsdp"`` only for ``V >= 2``); non-colocated ones without sequence or expert
    parallelism, once per ``A`` in ``accumulate`` dividing the global batch (enumerated at
    ``global_batch / A``, ``accumulate=A``)."""
    out = []
    for v in (v for v in counts if 0 <= v < world):
        for a in accumulate if v else (1,):
            batch = args["global_batch"]
            if batch % a:
                continue
            found = candidate_layouts(world - v, **{**args, "global_batch": batch // a})
            out += [
                replace(x, vision_ranks=v, accumulate=a, vision_data_parallel=e)
                for x in found
                if not v or not (x.sequence_parallel or x.ep > 1)
                for e in (engines if v >= 2 else ("ddp",))
            ]
    return out


def _check_counts(**values: int) -> None:
    """``ValueError`` naming the first value that is not an int >= 1."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} ({value!r}) must be an int >= 1.")


def _micro_batch_counts(pp: int, per_dp: int) -> list[int]:
    if pp == 1:
        return [1]
    return sorted({m for m in (pp, 2 * pp, 4 * pp, per_dp) if m <= per_dp and per_dp % m == 0})


def refusal(layout: Any, facts: Facts = None, world: int | None = None) -> str | None:
    """Why ``layout`` cannot run (:func:`~lightning_mmpar.layout.value.validate`'s message), or
    ``None``: the planner's filter. ``facts`` as :func:`plan` takes them; ``world``: the world
    size (replaces the facts')."""
    known = facts(layout) if callable(facts) else facts if facts is not None else LayoutFacts()
    if world is not None:
        known = replace(known, world_size=world)
    try:
        validate(layout, known)
    except ValueError as err:
        return str(err)
    return None


def plan(
    model: Any,
    world: int,
    device: DeviceSpec,
    graph: Any = None,
    memory_gib: float | None = None,
    *,
    candidates: Sequence[Any] | None = None,
    facts: Facts = None,
    accept: Callable[[Any], str | None] | None = None,
    placement: Callable[[Any], Any] | None = None,
    tower_overlap: bool = False,
    **enumerate_args: Any,
) -> tuple[list[Prediction], list[Rejected]]:
    """Predict every candidate and rank them: ``(ranked, rejected)``.

    ``model``: a ``ModelSpec``, or a function ``layout -> ModelSpec`` when the spec depends on
    the layout (a fusion model's vocabulary padding and collectives do; cache it).
    ``ranked``: predictions that fit in ``memory_gib`` (default the device's), fastest
    predicted step first (ties: less memory). ``rejected``: layouts :func:`refusal` refuses
    with ``facts`` on ``world`` ranks (its message is the reason; a candidate whose ``dp`` is
    ``None`` gets ``world / (tp * pp)``), that ``accept`` refuses (a further filter: its string
    is the reason, None accepts), whose prediction raises ``ValueError`` (its message), or that
    do not fit (``"needs 93.1 GiB (pipeline rank 0: parameters 41.2 + gradients ... +
    activations 21.0) > 80 GiB"``: :meth:`RankMemory.describe`), in candidate order.
    ``candidates`` default to :func:`candidate_layouts` (``world``, the model's block count and
    ``enumerate_args``); ``placement(layout)`` gives each layout's ``Placement`` (None:
    Megatron's order); ``tower_overlap``: non-colocated layouts priced at their pipelined
    bound (each side's work hidden behind the other's, the transfer exposed, no fill or
    drain: :func:`~lightning_mmpar.layout.cost.predict`), not as run.

    Raises:
        ValueError: bad enumeration arguments (see :func:`candidate_layouts`).
    """
    spec_of = model if callable(model) else (lambda _: model)
    if candidates is None:
        base = enumerate_args.get("base")
        blocks = len(spec_of(base if base is not None else ParallelLayout()).blocks)
        candidates = candidate_layouts(world, blocks, **enumerate_args)
    ranked: list[Prediction] = []
    rejected: list[Rejected] = []
    for layout in candidates:
        reason = refusal(layout, facts, world) or (accept(layout) if accept is not None else None)
        if reason:
            rejected.append(Rejected(layout, reason))
            continue
        if layout.dp is None:
            layout = replace(layout, dp=world // (layout.tp * layout.pp))
        try:
            pred = _predict(
                spec_of(layout), layout, device, graph, memory_gib, placement, tower_overlap
            )
        except ValueError as err:
            rejected.append(Rejected(layout, str(err)))
            continue
        if pred.fits:
            ranked.append(pred)
        else:
            rejected.append(Rejected(layout, pred.reason, pred))
    ranked.sort(key=ranking_key)
    return ranked, rejected


def _predict(
    spec: Any,
    layout: Any,
    device: DeviceSpec,
    graph: Any,
    memory_gib: float | None,
    placement: Callable[[Any], Any] | None,
    overlap: bool = False,
) -> Prediction:
    """Megatron's order, or the placed one when ``placement`` is given and it is faster."""
    pred = predict(spec, layout, device, graph, None, memory_gib=memory_gib, tower_overlap=overlap)
    if placement is None:
        return pred
    where = placement(layout)
    placed = predict(
        spec, layout, device, graph, where, memory_gib=memory_gib, tower_overlap=overlap
    )
    return placed if placed.step_seconds <= pred.step_seconds else pred


def describe(layout: Any) -> str:
    """``tp 4 pp 2 v 2 dp 2 ep 1 mb 8x4 sp fsdp ckpt`` for tables and logs (``acc A``: ``A``
    batches per optimizer step, shown when above 1; ``+ V vision``: a non-colocated layout's
    vision ranks; ``+ V vision fsdp``: sharded over them)."""
    flags = " ".join(
        f
        for f, on in (("sp", layout.sequence_parallel), ("ckpt", layout.activation_checkpointing))
        if on
    )
    return (
        f"tp {layout.tp} pp {layout.pp} v {layout.virtual} dp {layout.dp} ep {layout.ep} "
        f"mb {layout.num_micro_batches}x{layout.micro_batch_size}"
        + (f" acc {layout.accumulate}" if layout.accumulate > 1 else "")
        + f" {layout.data_parallel}"
        + (f" {flags}" if flags else "")
        + (f" + {layout.vision_ranks} vision" if layout.vision_ranks else "")
        + (" fsdp" if layout.vision_ranks and layout.vision_data_parallel == "fsdp" else "")
    )
