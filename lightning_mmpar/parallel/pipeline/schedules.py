"""Pipeline plan pieces: blocks -> stages (equal split, explicit ranges, ownership), stages ->
ranks (loop / V layouts), schedules by name, and per-action timing hooks.

Every schedule of ``torch.distributed.pipelining`` (all present in torch 2.14) is selectable by
the name in :data:`lightning_mmpar.layout.schedules.SCHEDULES`, the pure-Python home of the
schedules' facts (stage -> rank maps, in-flight micro-batches, the bubble); this module holds
the torch side:

============================ ================== ======= =======================================
name                         torch class        layout  source
============================ ================== ======= =======================================
``gpipe``                    ScheduleGPipe      loop    GPipe (Huang et al. 2019)
``1f1b``                     Schedule1F1B       loop    PipeDream-Flush (Narayanan et al. 2021)
``interleaved_1f1b``         Interleaved1F1B    loop    Megatron-LM virtual pipeline (2021)
``looped_bfs``               ScheduleLoopedBFS  loop    Breadth-first PP (Lamy-Poirier 2022)
``interleaved_zero_bubble``  InterleavedZB      loop    Zero Bubble PP (Qi et al. 2023)
``zbv_zero_bubble``          ScheduleZBVZeroB.  V       Zero Bubble PP, ZB-V (Qi et al. 2023)
``dualpipev``                ScheduleDualPipeV  V       DeepSeek-V3 DualPipe, V variant (2024)
============================ ================== ======= =======================================

Stage layouts (:func:`lightning_mmpar.layout.schedules.stage_ranks`): ``loop`` puts stage ``s``
on pipeline rank ``s % pp`` (Megatron's virtual pipeline); ``V`` gives rank ``r`` stages ``r``
and ``2 * pp - 1 - r``, so the last stage lives on rank 0 next to the first (torch's
``generate_stage_to_rank_mapping(style="v")``).

Work-arounds for torch 2.14, each measured on gloo: a V-layout forward-only pass asserts at the
V turn (:func:`allow_forward_only_turn`); the zero-bubble split drops the gradient of parameters
that reach a stage output through no gradient-carrying input (:func:`unsplit_parameters`); and
it bypasses FSDP2's reduce-scatter (refused by ``ParallelConfig.check_world``).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import pipelining as tpp

from lightning_mmpar.layout import equal_ranges, schedules
from lightning_mmpar.layout.schedules import (
    MULTI_STAGE_SCHEDULES,
    SCHEDULES,
    SPLIT_BACKWARD_SCHEDULES,
)
from lightning_mmpar.parallel import comm

__all__ = [
    "SCHEDULE_CLASSES",
    "ZERO_BUBBLE",
    "StageObserver",
    "WaitObserver",
    "allow_forward_only_turn",
    "build_schedule",
    "check_ownership",
    "check_stage_ranges",
    "in_flight_micro_batches",
    "instrument_stage",
    "observing_waits",
    "partition",
    "run_in_order",
    "schedule_class",
    "stage_ranks",
    "unsplit_parameters",
]

StageObserver = Callable[[int, str, int, float, float], None]
"""``observer(stage, action, micro_batch, start, end)``: called after each stage action;
``action`` is ``"forward"``, ``"backward"`` (full), ``"backward_input"`` or
``"backward_weight"`` (zero-bubble split); ``start`` / ``end`` from ``time.perf_counter()``."""

WaitObserver = Callable[[float, float], None]
"""``observer(start, end)``: called after each point-to-point wait of torch's schedules
(``time.perf_counter()`` seconds): the peer's lateness plus the transfer; also the type of a
post observer (:func:`observing_waits`), called after each posting of sends / receives."""

SCHEDULE_CLASSES: dict[str, str] = dict(
    zip(
        SCHEDULES,
        (
            "ScheduleGPipe",
            "Schedule1F1B",
            "ScheduleInterleaved1F1B",
            "ScheduleLoopedBFS",
            "ScheduleInterleavedZeroBubble",
            "ScheduleZBVZeroBubble",
            "ScheduleDualPipeV",
        ),
        strict=True,
    )
)
"""Schedule name (:data:`lightning_mmpar.layout.schedules.SCHEDULES`) -> class name in
``torch.distributed.pipelining``."""


def partition(num_blocks: int, num_stages: int) -> list[range]:
    """Equal split of ``num_blocks`` into ``num_stages`` contiguous ranges (earlier stages get
    the remainder)."""
    if num_blocks < num_stages:
        raise ValueError(
            f"pipeline stages ({num_stages} = pipeline_parallel * virtual_pipeline) exceed the "
            f"model's pipeline blocks ({num_blocks}); use at most {num_blocks} stages or a deeper "
            "model."
        )
    return equal_ranges(0, num_blocks, num_stages)


def _drop_parameters(
    root: nn.Module, owned: Sequence[nn.Module], others: Sequence[nn.Module]
) -> int:
    """Unregister, everywhere under ``root``, the parameters and buffers of blocks on other ranks.

    Blocks may be registered submodules or unregistered wrappers around them; either way the
    tensors disappear from ``root``'s state dict and optimizer, and this rank's own tensors
    keep their original names. Returns the number of parameters dropped.
    """
    keep = {id(t) for b in owned for t in (*b.parameters(), *b.buffers())}
    drop = {id(t) for b in others for t in (*b.parameters(), *b.buffers())} - keep
    count = 0
    for module in (*root.modules(), *others):
        for table in (module._parameters, module._buffers):
            for name, t in list(table.items()):
                if t is not None and id(t) in drop:
                    del table[name]
                    count += table is module._parameters
    return count


def check_ownership(module: nn.Module, blocks: Sequence[nn.Module]) -> None:
    """Refuse trainable parameters of ``module`` that are in none of ``blocks``.

    Under pipeline parallelism a parameter used outside the blocks (in ``pipeline_loss``, say)
    exists on every pipeline rank, gets its gradient summed over micro-batches on the last stage
    only and is saved from the first stage. Raises ``ValueError`` naming them.
    """
    inside = {id(p) for b in blocks for p in b.parameters()}
    outside = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in inside]
    if outside:
        raise ValueError(
            f"trainable parameters outside pipeline_blocks(): {', '.join(outside)}; under "
            "pipeline parallelism every trainable parameter must belong to a block. Move them "
            "into a block (the last one if pipeline_loss uses them, and use them in its forward) "
            "or freeze them (requires_grad=False)."
        )


def stage_ranks(schedule: str, num_stages: int, pp: int) -> list[int]:
    """Pipeline rank of every stage: ``[rank(stage 0), ..., rank(stage num_stages - 1)]``, that
    is :func:`lightning_mmpar.layout.schedules.stage_ranks` of ``num_stages // pp`` stages per
    rank (loop layout ``s % pp``; V layout, ``zbv_zero_bubble`` and ``dualpipev``: ``s`` for
    ``s < pp``, else ``2 * pp - 1 - s``).

    Raises:
        ValueError: ``num_stages`` not a multiple of ``pp``, or a V schedule with
            ``num_stages != 2 * pp``.
    """
    if num_stages % pp:
        raise ValueError(
            f"num_stages ({num_stages}) must be a multiple of the pipeline ranks ({pp}): "
            "pipeline_parallel * virtual_pipeline stages."
        )
    return schedules.stage_ranks(schedule, pp, num_stages // pp)


def in_flight_micro_batches(schedule: str, ranks: Sequence[int], pp: int, m: int) -> list[int]:
    """Deprecated: :func:`lightning_mmpar.layout.schedules.in_flight` (``schedule, pp,
    len(ranks) // pp, m``), whose counts equal what torch's schedules hold."""
    warnings.warn(
        "in_flight_micro_batches is deprecated; use "
        "lightning_mmpar.layout.schedules.in_flight(schedule, pp, virtual, micro_batches).",
        DeprecationWarning,
        stacklevel=2,
    )
    return schedules.in_flight(schedule, pp, len(ranks) // pp, m)


def check_stage_ranges(ranges: Sequence[range], num_stages: int, num_blocks: int) -> list[range]:
    """Validate explicit per-stage block ranges: ``num_stages`` of them, non-empty, step 1,
    contiguous and covering ``range(num_blocks)`` in order.

    Raises:
        ValueError: naming the offending stage and range, and the fix.
    """
    ranges = list(ranges)
    fix = (
        f"pass {num_stages} contiguous non-empty ranges covering blocks 0..{num_blocks - 1} "
        "in order, e.g. lightning_mmpar.parallel.pipeline.partition(blocks, stages)."
    )
    if len(ranges) != num_stages:
        raise ValueError(
            f"stage_ranges has {len(ranges)} ranges but the pipeline has {num_stages} stages "
            f"(pipeline_parallel * virtual_pipeline); {fix}"
        )
    start = 0
    for s, r in enumerate(ranges):
        if not isinstance(r, range) or r.step != 1 or len(r) == 0 or r.start != start:
            raise ValueError(
                f"stage_ranges[{s}] ({r!r}) must be a non-empty range(start, stop) starting at "
                f"block {start}; {fix}"
            )
        start = r.stop
    if start != num_blocks:
        raise ValueError(
            f"stage_ranges end at block {start} but the model has {num_blocks} pipeline "
            f"blocks; {fix}"
        )
    return ranges


def schedule_class(schedule: str) -> Any:
    """The ``torch.distributed.pipelining`` class of ``schedule`` (:data:`SCHEDULE_CLASSES`).

    Raises:
        ValueError: the installed torch lacks it (names the version and the fix).
    """
    cls = getattr(tpp, SCHEDULE_CLASSES[schedule], None)
    if cls is None:  # pragma: no cover - torch >= 2.9 has every class
        raise ValueError(
            f"schedule={schedule!r} needs torch.distributed.pipelining."
            f"{SCHEDULE_CLASSES[schedule]}, missing from torch {torch.__version__}; "
            "upgrade torch or choose schedule='1f1b'."
        )
    return cls


def build_schedule(
    schedule: str, stages: list[Any], micro_batches: int, loss_fn: Callable[..., Any]
) -> Any:
    """The torch schedule ``schedule`` over this rank's ``stages`` (one for single-stage
    schedules) with ``micro_batches`` micro-batches; gradients scaled by ``1 / micro_batches``
    (torch's ``scale_grads``).

    Raises:
        ValueError: the installed torch lacks the schedule's class (:func:`schedule_class`).
    """
    cls = schedule_class(schedule)
    if schedule in MULTI_STAGE_SCHEDULES:
        return cls(stages, micro_batches, loss_fn=loss_fn)
    return cls(stages[0], micro_batches, loss_fn=loss_fn)


def instrument_stage(stage: Any, observers: list[StageObserver]) -> None:
    """Time ``stage``'s actions for ``observers`` (read at call time; no timing while empty).

    Wraps ``forward_one_chunk``, ``backward_one_chunk`` (``full_backward=False`` is the
    zero-bubble input-gradient half, ``"backward_input"``, unless the stage runs its whole
    backward there: :func:`unsplit_parameters`) and ``backward_weight_one_chunk`` on the
    instance; each observer gets ``(stage_index, action, micro_batch, start, end)``.
    """
    index = stage.stage_index

    def timed(method: Callable[..., Any], action: str) -> Any:
        def wrapper(chunk: int, *args: Any, **kwargs: Any) -> Any:
            if not observers:
                return method(chunk, *args, **kwargs)
            start = time.perf_counter()
            out = method(chunk, *args, **kwargs)
            end = time.perf_counter()
            name = action
            split = getattr(stage, "dw_builder", None) is None  # else: whole backward (I step)
            if action == "backward" and split and not kwargs.get("full_backward", True):
                name = "backward_input"  # torch's schedules pass full_backward by keyword
            for observer in list(observers):
                observer(index, name, int(chunk), start, end)
            return out

        return wrapper

    stage.forward_one_chunk = timed(stage.forward_one_chunk, "forward")
    stage.backward_one_chunk = timed(stage.backward_one_chunk, "backward")
    stage.backward_weight_one_chunk = timed(stage.backward_weight_one_chunk, "backward_weight")


_WAITING: list[list[WaitObserver]] = []  # the wait observer lists of the schedules now running
_POSTING: list[list[WaitObserver]] = []  # the post observer lists of the schedules now running


def _timed(fn: Callable[..., Any], active: list[list[WaitObserver]]) -> Callable[..., Any]:
    """``fn`` calling every observer of ``active`` with its ``(start, end)`` while any is."""

    def timed(*args: Any, **kwargs: Any) -> Any:
        if not active:
            return fn(*args, **kwargs)
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        end = time.perf_counter()
        for observers in list(active):
            for observer in list(observers):
                observer(start, end)
        return out

    timed.mmpar_timed = True  # type: ignore[attr-defined]
    return timed


def _timed_wait(wait: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return _timed(wait, _WAITING)


@contextlib.contextmanager
def observing_waits(
    observers: list[WaitObserver], posts: list[WaitObserver] | None = None
) -> Iterator[None]:
    """Time the point-to-point waits of torch's schedules for ``observers``, and the posting of
    their sends and receives for ``posts``, while in the block.

    torch waits on each batch of sends / receives in one module function
    (``torch.distributed.pipelining.schedules._wait_batch_p2p``) and posts each batch in another
    (``_batch_p2p``: on gloo it starts the transfer, on NCCL it enqueues it); each is wrapped
    once, on first use, and times nothing outside these blocks. With both lists empty nothing
    is wrapped.
    """
    posts = posts if posts is not None else []
    if not observers and not posts:
        yield
        return
    from torch.distributed.pipelining import schedules as ts

    if not getattr(ts._wait_batch_p2p, "mmpar_timed", False):
        ts._wait_batch_p2p = _timed_wait(ts._wait_batch_p2p)  # type: ignore[assignment]
    if posts and not getattr(ts._batch_p2p, "mmpar_timed", False):
        ts._batch_p2p = _timed(ts._batch_p2p, _POSTING)  # type: ignore[assignment]
    lists = [(active, x) for active, x in ((_WAITING, observers), (_POSTING, posts)) if x]
    for active, x in lists:
        active.append(x)
    try:
        yield
    finally:
        for active, x in lists:
            active.remove(x)


def allow_forward_only_turn(stage: Any) -> None:
    """Let a V-layout stage run a forward-only ``schedule.eval``.

    torch 2.14's runtime schedules keep the backward actions in an eval pass and, at the V turn
    (two consecutive stages on one rank), hand the input gradient over in memory even when
    backward is disabled, which asserts (``can't steal_bwd_input``). With backward disabled
    there is no gradient: the hand-over becomes a no-op. Training is unchanged.
    """
    get_output, set_input = stage.get_local_bwd_output, stage.set_local_bwd_input

    def get_local_bwd_output(mb_index: int) -> Any:
        return get_output(mb_index) if stage.has_backward else ()

    def set_local_bwd_input(grads: Any, mb_index: int) -> None:
        if stage.has_backward:
            set_input(grads, mb_index)

    stage.get_local_bwd_output = get_local_bwd_output
    stage.set_local_bwd_input = set_local_bwd_input


ZERO_BUBBLE: frozenset[str] = SPLIT_BACKWARD_SCHEDULES
"""Schedules that split backward into input (``I``) and weight (``W``) gradients."""


def unsplit_parameters(inputs: Sequence[Any], outputs: Sequence[Any]) -> bool:
    """Whether torch's zero-bubble split misses trainable parameters of a non-first stage.

    ``stage_backward_input`` keeps, for the later ``W`` step, only parameters whose path to the
    stage output meets a gradient-carrying input (torch's ``get_param_groups``); a parameter
    reaching an output that depends on no such input (an embedding of token ids that enter a
    later stage, say) gets no gradient at all on torch 2.14. That happens exactly when some
    gradient-carrying output's autograd graph holds none of the inputs, which this checks
    (also under FSDP2, whose sharded parameters are not graph nodes). ``inputs`` /
    ``outputs``: one forward of the stage with autograd on. Such a stage runs its whole
    backward in the ``I`` step instead (torch's ``dw_builder`` path).
    """
    from torch.distributed.pipelining import _backward as tb

    starts = {
        tb._get_grad_fn_or_grad_acc(t)
        for t in inputs
        if isinstance(t, torch.Tensor) and t.requires_grad
    }
    for out in outputs:
        if not isinstance(out, torch.Tensor) or out.grad_fn is None:
            continue
        seen, stack, found = set(), [out.grad_fn], False
        while stack and not found:
            node = stack.pop()
            found = node in starts
            for nxt, _ in node.next_functions:
                if nxt is not None and nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        if not found:
            return True
    return False


StageRun = Callable[[int, tuple[Tensor, ...]], tuple[Tensor, ...]]
"""``run(stage, inputs) -> outputs``: one stage's work in :func:`run_in_order`."""


def run_in_order(
    stage_ids: Sequence[int],
    ranks: Sequence[int],
    group: dist.ProcessGroup | None,
    device: torch.device,
    run: StageRun,
    first: tuple[Tensor, ...],
) -> tuple[Tensor, ...] | None:
    """Run this rank's stages in stage order on one whole batch, without a schedule.

    Stage ``s`` gets ``first`` (``s == 0``), the previous stage's outputs in memory (same rank:
    the V layout's turn) or from its rank by point-to-point (pickled, moved to ``device``);
    its outputs go to the next stage's rank (:func:`comm.send_tensors`: a pending functional
    collective is waited for first, a DTensor sent as its full value). Any batch size and any
    tuple shapes work (no static stage metadata): used for batches the micro-batch count does
    not divide and for incremental decoding, whose states change shape between steps.
    ``ranks[s]`` is stage ``s``'s rank in ``group``. Returns the last stage's outputs on its
    rank, else ``None``. Every rank of ``group`` must call it with the same stage plan
    (collective over ``group``).
    """
    rank = comm.group_rank(group)
    y: tuple[Tensor, ...] = ()
    for s in stage_ids:
        if s == 0:
            x = first
        elif ranks[s - 1] == rank:
            x = y
        else:
            x = comm.recv_tensors(ranks[s - 1], group, device)
        y = run(s, x)
        if s + 1 < len(ranks) and ranks[s + 1] != rank:
            comm.send_tensors(y, ranks[s + 1], group)
    return y if len(ranks) - 1 in stage_ids else None
