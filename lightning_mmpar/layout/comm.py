"""Communication bytes per optimizer step of one rank, by mesh dimension and kind (pure Python).

:func:`comm_bytes` returns ``{"<dim>.<kind>": bytes}`` for one rank of pipeline rank
``pp_rank``, in nccl-tests' ``size`` convention (all-reduce / broadcast: the buffer; all-gather:
the OUTPUT; reduce-scatter: the INPUT; all-to-all: the input; send / recv: one message), the
same keys :class:`lightning_mmpar.parallel.comm_count.CommCounter` counts. ``dim``: ``tp``,
``pp``, ``dp``, ``edp``, ``ep``; a collective over every rank (the default group) takes the
first of ``tp, pp, dp, edp, ep`` that spans the world, else ``world``.

What runs, per batch (``accumulate`` batches per optimizer step; a dp rank's batch is
``b = micro_batches * micro_batch_size`` samples):

* **data parallelism** (``dp > 1``): ``ddp``: one all-reduce of every trainable dense gradient
  held (``lightning_mmpar.parallel.data.sync_gradients``), once per optimizer step at
  ``tp == pp == 1`` (torch's DDP, ``no_sync`` while accumulating:
  ``lightning_mmpar.parallel.replication``); ``fsdp``: per FSDP unit (pipeline
  block) an all-gather of its non-scalar parameters (each padded on its shard dim to a multiple
  of ``dp``: FSDP2's padding) in every forward and again in backward, a reduce-scatter of the
  trainable ones' gradients, and one all-reduce of the 0-dim parameters' gradients;
* **expert weights** (``edp = dp / ep > 1``): ``fsdp``: each MoE layer's experts are an FSDP2
  unit over ``edp`` (``lightning_mmpar.parallel.expert_data.shard_experts``: all-gathers and a
  reduce-scatter of the ``ep``-local weights, as a dense unit); ``ddp``: one ``edp`` all-reduce
  of their gradients per batch;
* **partial gradients over tp**: parameters of a tower run data-parallel inside tp
  (``ParamSpec.sum_over_tp``: ``vision_parallel="dp"``) are all-reduced (summed) over tp after
  every backward, their local (FSDP) shard; ``Partial`` gradients (``ParamSpec.partial_grad``:
  a head-sharded temperature, a sequence-parallel norm or gate) of parameters FSDP2 shards are
  made ``Replicate`` over tp in backward (FSDP's reduce-scatter needs them so), once per batch;
* **expert parallelism** (MoE layers, ``ep > 1``): per layer call the per-expert token counts
  (``ep.all_to_all``, exact: ``8 E`` bytes) and the token dispatch and return, forward and
  backward (``ep.all_to_all_v``): routing- and padding-dependent, so predicted as its
  uniform-routing expectation within ``[0, high]`` (:func:`comm_bounds`);
* **tensor parallelism**: the model's per-block :class:`~lightning_mmpar.layout.model.Collective`
  list times the samples (``forward`` ones once per forward pass, ``loss`` and ``backward`` ones
  once);
* **pipeline**: at each stage boundary the sender sends every tensor of the boundary per forward
  pass (two per micro-batch: the gradient cache's forward-only pass and the schedule's) and
  receives the gradient of every floating-point one once (calls: one buffer per dtype each
  way, floats and integers, and one gradient buffer: ``PipelineEngine.pack_boundaries``); the
  loss (24 bytes) and the logged terms (48 bytes) are broadcast from the last stage;
* **loss** (``dp > 1``, on the last stage): the caption token count (8-byte all-reduce; under
  accumulation instead one per optimizer step on every rank: the window's count,
  ``lightning_mmpar.parallel.token_windows``), three
  dp gathers of the image / text features (row counts: ``8 dp`` bytes; each tensor ``b dp``
  rows) whose two differentiable ones all-reduce their gradient in backward; every rank
  all-reduces the logged loss pair (8 bytes) and the term sums (48 bytes);
* over the world: Lightning's SIGTERM flag (an int64 broadcast before every batch); per
  optimizer step the non-finite guard's all-gather of 3 float64 per rank, and with clipping
  (but under DDP over the whole world, which clips by
  the local norm, :func:`ddp_covers_world`) one
  float64 all-reduce of the squared norm (after the ``Partial`` gradients of tp-replicated
  parameters, ``ParamSpec.partial_grad``, are all-reduced over tp).

:func:`comm_parts` splits each key by purpose (``fsdp``, ``ddp``, ``replicated``, ``experts``,
``tp grads``, ``activations``, ``boundary``, ``loss``, ``logging``, ``shape check``,
``sigterm``, ``guard``, ``clip``); the dry run (``lightning_mmpar.recipes.dryrun``) measures
the :data:`SET_UP_PURPOSES` ones from the built model at real scale.
Exactness is checked against :class:`~lightning_mmpar.parallel.comm_count.CommCounter` on the
CPU parity layouts (tests/recipes/test_parity_matrix.py: dp, tp, sequence parallel, the three
vision modes, pp with gpipe / 1f1b / interleaved / ZBV / DualPipeV schedules, partitions and
accumulation, pp x dp under DDP, ep with edp 1 and 2 under FSDP and DDP and with pp, clipping,
a permuted placement, tp x pp x dp; fp32). Not
measured, derived: bf16 / fp8 activation collectives (2 bytes per element; pipeline boundaries
keep the fp32 residual stream under ``bf16-mixed``), ``bf16-true`` (2-byte parameters and
activations), uneven FSDP shards of ``sum_over_tp`` parameters (dp rank 0's, the largest, is
counted). Not modelled: activation checkpointing's recomputation (it re-runs forward
collectives of the recomputed blocks in backward; :func:`comm_bytes` counts none of them).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from lightning_mmpar.layout.memory import (
    fsdp_group,
    layout_stage_plan,
    local_shape,
    shard_dim,
    stage_blocks,
    tp_local_shape,
)
from lightning_mmpar.layout.model import ModelSpec, ParamSpec
from lightning_mmpar.layout.schedules import stage_ranks
from lightning_mmpar.layout.value import LayoutFacts, ParallelLayout, validate

__all__ = [
    "SET_UP_PURPOSES",
    "comm_bounds",
    "comm_bytes",
    "comm_calls",
    "comm_parts",
    "comm_profile",
    "ddp_covers_world",
    "dispatched_calls",
    "fsdp_gathers",
    "gradient_syncs",
    "world_dim",
]

SET_UP_PURPOSES = ("fsdp", "ddp", "replicated", "experts")
"""The :func:`comm_parts` purposes whose bytes the set-up alone fixes (the parameter groups,
their sizes and dtypes; no activation): FSDP2's unit all-gathers and reduce-scatters
(``fsdp``; ``experts``: the expert units over ``edp``, or their all-reduce under DDP), the
gradient all-reduce of data parallelism (``ddp``) and of the parameters FSDP does not manage
(``replicated``: 0-dim parameters). The others (``activations``: tp / ep collectives of the
blocks, ``boundary``: pipeline send / recv, ``loss``, ``logging``, ``tp grads``, ``guard``,
``clip``, ``sigterm``, ``shape check``) depend on the batch or on the step's values."""

GUARD_BYTES = 24
"""The non-finite guard's ``[3]`` float64 row per rank."""
LOG_PAIR_BYTES = 8
"""The strategy's logged ``(loss * rows, rows)`` float32 pair."""
TERM_BYTES = 48
"""The recipe's ``[2, 3]`` float64 term sums."""
TOKEN_BYTES = 8
"""The caption's token count (int64 per batch; float64 per accumulation window)."""
LOSS_BYTES = 24
"""The pipeline's loss broadcast from the last stage: 3 float64 (the mean loss, a token loss's
sum and its token count; ``PipelineEngine._broadcast_loss``)."""
SHAPE_CHECK_BYTES = 16
"""The pipeline's per-batch check that every pipeline rank got the same batch shapes: a
2-element int64 all-reduce over ``pp`` (``PipelineEngine._check_shapes_agree``)."""
SIGTERM_BYTES = 8
"""Lightning's int64 SIGTERM flag, broadcast from rank 0 before every training batch
(``_TrainingEpochLoop._broadcast_sigterm_tensor``)."""


def world_dim(layout: ParallelLayout) -> str:
    """The key of a collective over every rank: the first of ``tp, pp, dp, edp, ep`` whose
    size is the world, else ``world``."""
    sizes = {
        "tp": layout.tp,
        "pp": layout.pp,
        "dp": layout.dp_size,
        "edp": layout.edp,
        "ep": layout.ep,
    }
    return next((d for d, n in sizes.items() if n == layout.world), "world")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _padded_bytes(p: ParamSpec, layout: ParallelLayout) -> int:
    shape = list(tp_local_shape(p, layout))
    n = fsdp_group(p, layout)
    d = 0 if p.expert else shard_dim(tuple(shape), n)
    shape[d] = -(-shape[d] // n) * n
    return _numel(tuple(shape)) * p.element_size


def _grad_bytes(p: ParamSpec, layout: ParallelLayout) -> int:
    size = _numel(tp_local_shape(p, layout)) * p.element_size
    return size * layout.tp if p.full_grad and layout.tp > 1 else size


def fsdp_gathers(layout: ParallelLayout) -> int:
    """All-gathers of one FSDP2 unit per optimizer step: forward and backward's re-gather
    (``reshard_after_forward``) per batch, without a pipeline; under pp, one per forward pass
    of each micro-batch (the gradient cache's forward-only pass and the schedule's) and one
    for the backward of the last, times ``accumulate``."""
    if layout.pp > 1:
        return layout.accumulate * (2 * layout.num_micro_batches + 1)
    return layout.accumulate * 2


def gradient_syncs(layout: ParallelLayout) -> int:
    """Gradient all-reduces per optimizer step under ``data_parallel="ddp"``: one at
    ``tp == pp == 1`` (torch's DDP, ``no_sync`` while accumulating), else one per batch."""
    return 1 if layout.tp == 1 and layout.pp == 1 else layout.accumulate


def ddp_covers_world(layout: ParallelLayout) -> bool:
    """Whether torch's DDP reduces every gradient over every rank (``data_parallel="ddp"``,
    ``tp == pp == ep == 1``, no vision ranks, ``dp > 1``): every rank then holds the same
    gradients, so clipping takes the local norm (no collective)."""
    if layout.data_parallel != "ddp" or layout.tp * layout.pp * layout.ep != 1:
        return False
    return not layout.vision_ranks and layout.dp_size > 1


def _stage_of_block(model: ModelSpec, layout: ParallelLayout) -> tuple[list[int], list[int]]:
    """Per block: its stage and that stage's pipeline rank."""
    n = len(model.blocks)
    if layout.pp == 1:
        return [0] * n, [0] * n
    plan = layout_stage_plan(model, layout)
    stage, rank = [0] * n, [0] * n
    owners = stage_ranks(layout.schedule, layout.pp, layout.virtual)
    for s, (r, owner) in enumerate(zip(plan.ranges, owners, strict=True)):
        for i in r:
            stage[i], rank[i] = s, owner
    return stage, rank


def comm_bytes(model: ModelSpec, layout: ParallelLayout, pp_rank: int = 0) -> dict[str, int]:
    """Bytes per optimizer step of one rank on pipeline rank ``pp_rank`` (module docstring),
    keys ``"<dim>.<kind>"`` with non-zero bytes; data-dependent keys (``ep.all_to_all_v``: the
    MoE token dispatch) at their expected value (:func:`comm_bounds` gives their range).

    Raises:
        ValueError: ``pp_rank`` outside the pipeline, a partition the model cannot take, or a
            layout :func:`~lightning_mmpar.layout.value.validate` refuses (with the layout's
            batch and ``ModelSpec.extra["text_length"]``: ``vision_parallel="dp"`` with a
            micro-batch not divisible by ``tp``, sequence parallelism with a text ``tp`` does
            not divide).
    """
    return _comm(model, layout, pp_rank, "expected")


def comm_bounds(
    model: ModelSpec, layout: ParallelLayout, pp_rank: int = 0
) -> dict[str, tuple[int, int]]:
    """``(low, high)`` bytes per key of :func:`comm_bytes`; equal for every exact key.

    Raises:
        ValueError: as :func:`comm_bytes`.
    """
    low, high = _comm(model, layout, pp_rank, "low"), _comm(model, layout, pp_rank, "high")
    return {k: (low.get(k, 0), high[k]) for k in high}


def _check(model: ModelSpec, layout: ParallelLayout) -> None:
    """Layouts the strategy refuses have no byte count: :func:`~lightning_mmpar.layout.value.
    validate` with the layout's own batch and the model's text length; ``dp`` must be known."""
    text = model.extra.get("text_length")
    length = text if isinstance(text, int) else None
    validate(layout, LayoutFacts(batch_size=layout.local_batch, sequence_length=length))
    layout.world  # noqa: B018 - raises while dp is unknown


def _comm(model: ModelSpec, layout: ParallelLayout, pp_rank: int, bound: str) -> dict[str, int]:
    return _count(model, layout, pp_rank, bound)[0]


def comm_calls(model: ModelSpec, layout: ParallelLayout, pp_rank: int = 0) -> dict[str, int]:
    """Collective calls per optimizer step of one rank on pipeline rank ``pp_rank``, by the keys
    of :func:`comm_bytes` (each op one call, as :attr:`~lightning_mmpar.parallel.comm_count.
    CommCounter.calls` counts them): what a call's fixed cost (latency, host software)
    multiplies. Raises ``ValueError`` as :func:`comm_bytes`."""
    return comm_profile(model, layout, pp_rank)[1]


def comm_profile(
    model: ModelSpec, layout: ParallelLayout, pp_rank: int = 0
) -> tuple[dict[str, int], dict[str, int], int]:
    """:func:`comm_bytes`, :func:`comm_calls` and :func:`dispatched_calls` of one rank from
    one count (the cost model needs all three per layout). Raises ``ValueError`` as
    :func:`comm_bytes`."""
    nbytes, calls, dispatched, _ = _count(model, layout, pp_rank, "expected")
    return nbytes, {k: calls[k] for k in nbytes if calls[k]}, dispatched


def comm_parts(
    model: ModelSpec, layout: ParallelLayout, pp_rank: int = 0
) -> dict[str, dict[str, int]]:
    """:func:`comm_bytes` split by purpose: ``{key: {purpose: bytes}}``, each key's purposes
    summing to its bytes. Purposes: ``fsdp``, ``ddp``, ``replicated``, ``experts``
    (:data:`SET_UP_PURPOSES`: fixed by the set-up), ``tp grads``, ``activations``,
    ``boundary``, ``loss``, ``logging``, ``shape check``, ``sigterm``, ``guard``, ``clip``.
    Raises ``ValueError`` as :func:`comm_bytes`."""
    parts = _count(model, layout, pp_rank, "expected")[3]
    out: dict[str, dict[str, int]] = {}
    for (key, why), n in sorted(parts.items()):
        if n:
            out.setdefault(key, {})[why] = n
    return out


def dispatched_calls(model: ModelSpec, layout: ParallelLayout, pp_rank: int = 0) -> int:
    """Of :func:`comm_calls`, the calls issued through DTensor or FSDP2 (the tensor-parallel
    activation collectives and ``Partial`` redistributions, FSDP's unit all-gathers and
    reduce-scatters), which carry per-call host work (sharding propagation, copy-in / copy-out,
    hooks) beyond a plain ``torch.distributed`` call's. Raises ``ValueError`` as
    :func:`comm_bytes`."""
    return _count(model, layout, pp_rank, "expected")[2]


def _world_collectives(
    layout: ParallelLayout,
    partial: list[ParamSpec],
    add: Callable[..., None],
) -> None:
    """:func:`_count`'s collectives over every rank: Lightning's SIGTERM flag per batch; the
    non-finite guard and clipping per optimizer step."""
    if layout.world == 1:
        return
    acc = layout.accumulate
    world = world_dim(layout)
    add(f"{world}.broadcast", acc * SIGTERM_BYTES, acc, why="sigterm")
    add(f"{world}.all_gather", GUARD_BYTES * layout.world, 1, why="guard")
    if layout.clip and not ddp_covers_world(layout):  # else the local norm
        add(f"{world}.all_reduce", 8, 1, why="clip")
        if layout.tp > 1:  # Partial gradients (no FSDP) summed over tp before their norm
            whole = [p for p in partial if fsdp_group(p, layout) == 1]
            add(
                "tp.all_reduce",
                sum(_grad_bytes(p, layout) for p in whole),
                len(whole),
                True,
                "clip",
            )


def _count(
    model: ModelSpec, layout: ParallelLayout, pp_rank: int, bound: str
) -> tuple[dict[str, int], Counter[str], int, Counter[tuple[str, str]]]:
    """Bytes (``bound``: ``expected``, ``low`` or ``high``) and calls per key, the calls
    issued through DTensor / FSDP2, and the bytes per ``(key, purpose)`` (:func:`comm_parts`)."""
    _check(model, layout)
    held = set(stage_blocks(model, layout, pp_rank))
    out: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    parts: Counter[tuple[str, str]] = Counter()
    dispatched = 0

    def add(
        key: str, nbytes: int | float, n: int, via_dtensor: bool = False, why: str = ""
    ) -> None:
        nonlocal dispatched
        out[key] += nbytes  # type: ignore[assignment]
        parts[key, why] += nbytes  # type: ignore[assignment]
        if nbytes:
            calls[key] += n
            dispatched += n if via_dtensor else 0

    b, acc = layout.local_batch, layout.accumulate
    passes = 2 if layout.pp > 1 else 1  # the gradient cache's forward-only pass
    gathers = fsdp_gathers(layout) // acc  # per FSDP unit and batch
    params = [p for p in model.params if p.block in held]
    # data parallelism, per batch
    if layout.dp_size > 1 and layout.data_parallel != "none":
        dense = [p for p in params if p.trainable and not p.expert]
        if layout.data_parallel == "ddp":  # per dtype; torch's DDP (tp = pp = 1): no_sync
            syncs = gradient_syncs(layout)
            add(
                "dp.all_reduce",
                syncs * sum(_grad_bytes(p, layout) for p in dense),
                syncs * len({p.element_size for p in dense}),
                why="ddp",
            )
        else:
            units: dict[int, list[ParamSpec]] = {}
            for p in params:
                if p.shape and not p.expert:
                    units.setdefault(p.block, []).append(p)
            for unit in units.values():
                add(
                    "dp.all_gather",
                    acc * gathers * sum(_padded_bytes(p, layout) for p in unit),
                    acc * gathers,
                    True,
                    "fsdp",
                )
                add(
                    "dp.reduce_scatter",
                    acc * sum(_padded_bytes(p, layout) for p in unit if p.trainable),
                    acc,
                    True,
                    "fsdp",
                )
            scalars = [p for p in dense if not p.shape]
            add(
                "dp.all_reduce",
                acc * sum(_grad_bytes(p, layout) for p in scalars),
                acc * len({p.element_size for p in scalars}),
                why="replicated",
            )
    # expert weights over their edp replicas (FSDP2 units of their own, or an all-reduce)
    experts = [p for p in params if p.expert and p.shape]
    if layout.edp > 1 and layout.data_parallel != "none" and experts:
        if layout.data_parallel == "ddp":
            trained = [p for p in experts if p.trainable]
            add(
                "edp.all_reduce",
                acc * sum(_grad_bytes(p, layout) for p in trained),
                acc * len({p.element_size for p in trained}),
                why="experts",
            )
        else:
            layers = len({p.block for p in experts})
            add(
                "edp.all_gather",
                acc * gathers * sum(_padded_bytes(p, layout) for p in experts),
                acc * gathers * layers,
                True,
                "experts",
            )
            add(
                "edp.reduce_scatter",
                acc * sum(_padded_bytes(p, layout) for p in experts if p.trainable),
                acc * layers,
                True,
                "experts",
            )
    # a tower run data-parallel inside tp: its gradients summed over tp after every backward;
    # Partial gradients that FSDP2 reduce-scatters are made Replicate over tp first (backward)
    partial = [p for p in params if p.trainable and p.partial_grad]
    if layout.tp > 1:
        summed = [p for p in params if p.trainable and p.sum_over_tp]
        add(
            "tp.all_reduce",
            acc * sum(_numel(local_shape(p, layout, {})) * p.element_size for p in summed),
            acc * len({p.element_size for p in summed}),
            why="tp grads",
        )
        sharded = [p for p in partial if fsdp_group(p, layout) > 1]
        add(
            "tp.all_reduce",
            acc * sum(_grad_bytes(p, layout) for p in sharded),
            acc * len(sharded),
            True,
            "tp grads",
        )
    # tensor (and expert) parallel activations
    for block in held:
        for c in model.collectives[block] if model.collectives else ():
            times = passes if c.phase == "forward" else 1  # "loss", "backward": once
            per_sample = c.bytes_per_sample
            if c.upper_per_sample is not None and bound != "expected":
                per_sample = c.upper_per_sample if bound == "high" else 0
            m = layout.num_micro_batches
            add(
                f"{c.dim}.{c.kind}",
                acc * times * (b * per_sample + m * c.bytes_per_call),
                acc * times * m,
                c.dim == "tp",
                "activations",
            )
    # pipeline boundaries: one send / recv per dtype buffer (pack_boundaries), micro-batch, pass
    last = len(model.blocks) - 1
    if layout.pp > 1:
        stage, rank = _stage_of_block(model, layout)
        m = layout.num_micro_batches
        for i in range(last):
            if stage[i] == stage[i + 1] or rank[i] == rank[i + 1]:
                continue
            sent = sum(x.bytes_per_sample for x in model.boundaries[i])
            n_sent = len({x.requires_grad for x in model.boundaries[i] if x.bytes_per_sample})
            grads = sum(x.bytes_per_sample for x in model.boundaries[i] if x.requires_grad)
            n_grads = int(any(x.requires_grad and x.bytes_per_sample for x in model.boundaries[i]))
            if rank[i] == pp_rank:
                add("pp.send", acc * passes * b * sent, acc * passes * m * n_sent, why="boundary")
                add("pp.recv", acc * b * grads, acc * m * n_grads, why="boundary")
            if rank[i + 1] == pp_rank:
                add("pp.recv", acc * passes * b * sent, acc * passes * m * n_sent, why="boundary")
                add("pp.send", acc * b * grads, acc * m * n_grads, why="boundary")
        add("pp.broadcast", acc * (LOSS_BYTES + TERM_BYTES), acc * 2, why="loss")
        add("pp.all_reduce", acc * SHAPE_CHECK_BYTES, acc, why="shape check")
    # the loss and its logging
    if layout.dp_size > 1:
        loss = model.loss
        if loss is not None and (acc > 1 or last in held):  # caption tokens: the accumulation
            add(
                "dp.all_reduce", TOKEN_BYTES, 1, why="loss"
            )  # window's on every rank, else the last stage's
        if loss is not None and last in held and loss.gathers:
            rows = b * layout.dp_size * loss.feature_bytes
            # per gather: the row counts, then the image and the text features
            add(
                "dp.all_gather",
                acc * loss.gathers * (8 * layout.dp_size + 2 * rows),
                acc * loss.gathers * 3,
                why="loss",
            )
            add(
                "dp.all_reduce",
                acc * loss.gathers_with_grad * 2 * rows,
                acc * loss.gathers_with_grad * 2,
                why="loss",
            )
        add("dp.all_reduce", acc * (LOG_PAIR_BYTES + TERM_BYTES), acc * 2, why="logging")
    _world_collectives(layout, partial, add)
    return {k: v for k, v in sorted(out.items()) if v}, calls, dispatched, parts
