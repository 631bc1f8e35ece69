"""Pipeline parallelism over an ordered list of blocks, on ``torch.distributed.pipelining``.

A LightningModule opts in by implementing :class:`PipelineModule`: it hands the strategy an
ordered list of blocks, says how a batch becomes (inputs, target), and computes the loss on the
last block's output. The strategy cuts the list into ``pp * v`` stages (equal split or explicit
``stage_ranges``), keeps this rank's stages (loop layout: stage ``s`` on pipeline rank ``s % pp``,
Megatron's virtual pipeline; V layout for ZBV / DualPipeV: rank ``r`` holds stages ``r`` and
``2 * pp - 1 - r``), unregisters the parameters of every other block (so state dicts and
optimizers hold only owned parameters, under their original names), and drives one of torch's
schedules by name (:mod:`~lightning_mmpar.parallel.pipeline.schedules`).

Block contract: ``block(*tensors) -> Tensor | tuple[Tensor, ...]``; a tuple is unpacked into the
next block's arguments, so a stage boundary may carry several tensors (text hidden states and
image tokens, say). Every trainable parameter must live in a block (the engine refuses others).

A module whose loss couples micro-batches (contrastive negatives over the whole batch) also
implements :class:`~lightning_mmpar.parallel.gradient_cache.BatchLossModule`: training then runs
a forward-only pass first and back-propagates a gradient-cache surrogate (one extra forward per
step), evaluation collects the micro-batches' features and computes the coupled term once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_mmpar.config import ParallelConfig
from lightning_mmpar.parallel import comm
from lightning_mmpar.parallel import gradient_cache as gc
from lightning_mmpar.parallel.pipeline import executor
from lightning_mmpar.parallel.pipeline import schedules as ps
from lightning_mmpar.parallel.pipeline.boundary import BoundaryLayout, PackedStage
from lightning_mmpar.parallel.pipeline.schedules import (
    _drop_parameters,
    check_ownership,
    partition,
)
from lightning_mmpar.parallel.pipeline.steps import PipelineChunk, PipelineSteps
from lightning_mmpar.parallel.random import get_rng_tracker
from lightning_mmpar.parallel.token_loss import TokenMean, as_token_mean, token_mean

__all__ = [
    "PipelineChunk",
    "PipelineEngine",
    "PipelineModule",
    "PipelineSteps",
    "check_ownership",
    "partition",
]


@runtime_checkable
class PipelineModule(Protocol):
    """What a LightningModule implements to be pipelined by ``mm_parallel``."""

    def pipeline_blocks(self) -> Sequence[nn.Module]:
        """Ordered blocks; each is a submodule of the LightningModule."""
        ...

    def pipeline_inputs(self, batch: Any) -> tuple[tuple[Tensor, ...], Any]:
        """Split a batch into the first block's positional inputs and the loss target."""
        ...

    def pipeline_loss(self, output: Any, target: Any) -> Tensor | tuple[Tensor, Tensor]:
        """Loss of one (micro-)batch from the last block's output: its mean (a 0-dim tensor),
        or its summed token loss and count of target tokens, as a ``(sum, count)`` pair or a
        :class:`~lightning_mmpar.parallel.token_loss.TokenMean` (what
        :func:`lightning_mmpar.losses.caption_loss` returns). ``mm_parallel`` averages means
        over micro-batches, and divides sums by the target tokens of the whole step."""
        ...


def _grad_flags(tensors: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    return tuple(t.detach().requires_grad_(t.is_floating_point()) for t in tensors)


class _StageIO(NamedTuple):
    """One stage's example tensors as they travel (its static metadata) and the layouts of its
    boundaries with other ranks (``None``: unpacked)."""

    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    unpack: BoundaryLayout | None
    pack: BoundaryLayout | None


class PipelineEngine:
    """This rank's stages and schedule for one :class:`PipelineModule`.

    Gradients are scaled by ``1 / micro_batches`` (``scale_grads``), so with a ``pipeline_loss``
    that averages over its micro-batch the gradients equal the mean of micro-batch means; one
    that returns ``(sum, count)`` (or a :class:`~lightning_mmpar.parallel.token_loss.TokenMean`)
    back-propagates the sums, and the step returns the batch's token mean as a ``TokenMean``
    (the strategy then divides the gradients by the step's target tokens). A
    :class:`~lightning_mmpar.parallel.gradient_cache.BatchLossModule` whose
    ``pipeline_batch_coupled()`` is true trains by the gradient cache (a forward-only pass, the
    coupled term on the whole batch, then the schedule with surrogate losses); its evaluation
    adds the coupled term of the collected features to the mean micro-batch loss.

    ``stage_ranges`` gives each stage's blocks (``pp * v`` contiguous non-empty ranges covering
    every block); ``None`` is :func:`partition`'s equal split. ``observers`` receive the timing
    of every stage action (:data:`~lightning_mmpar.parallel.pipeline.schedules.StageObserver`)
    and of each loss on the last stage (action ``"loss"``, micro-batch ``-1`` for a
    gradient-cache module's coupled loss of the whole batch: the loss is that stage's work),
    ``wait_observers`` of every point-to-point wait (:data:`~.schedules.WaitObserver`),
    ``post_observers`` of every posting of sends and receives (same signature);
    :meth:`set_micro_batches` changes the micro-batch count between steps.

    Raises:
        TypeError: ``module`` is not a :class:`PipelineModule`.
        ValueError: a trainable parameter of ``module`` is in no block (:func:`check_ownership`),
            or bad ``stage_ranges`` (:func:`~.schedules.check_stage_ranges`).
    """

    _losses_run = 0
    """Loss calls in the running schedule pass: the next loss's micro-batch index."""

    pack_boundaries = True
    """Send each stage boundary with another rank as one buffer per dtype
    (:class:`~lightning_mmpar.parallel.pipeline.boundary.BoundaryLayout`: 2 + 1 point-to-point
    transfers per micro-batch for the fusion model's 7-tensor boundary instead of 7 + 5).
    ``False`` sends every tensor on its own (torch's default: no copy into a buffer). Read when
    a schedule is built: set it alike on every pipeline rank; changing it between steps builds
    new schedules."""

    lean_runtime = True
    """Run torch's multi-stage schedules' action lists with
    :class:`~lightning_mmpar.parallel.pipeline.executor.LeanRuntime` (the same actions in the
    same order, without torch's per-action profiler ranges, logging and lookups); ``False``
    runs torch's own loop. Read at every step (an A/B switch); the single-stage schedules
    (``gpipe``, ``1f1b``) run torch's hand-written loops either way."""

    def __init__(
        self,
        module: nn.Module,
        config: ParallelConfig,
        pp_group: dist.ProcessGroup,
        device: torch.device,
        wrap_chunk: Any = None,
        stage_ranges: Sequence[range] | None = None,
    ) -> None:
        if not isinstance(module, PipelineModule):
            raise TypeError(
                f"pipeline_parallel={config.pipeline_parallel} needs the LightningModule "
                f"({type(module).__name__}) to implement pipeline_blocks(), pipeline_inputs() "
                "and pipeline_loss(); see lightning_mmpar.parallel.pipeline.PipelineModule."
            )
        self.module = module
        self.config = config
        self.group = pp_group
        self.pp = pp = comm.group_size(pp_group)
        self.pp_rank = comm.group_rank(pp_group)
        blocks = list(module.pipeline_blocks())
        check_ownership(module, blocks)
        n_stages = config.num_stages
        if stage_ranges is None:
            ranges = partition(len(blocks), n_stages)
        else:
            ranges = ps.check_stage_ranges(stage_ranges, n_stages, len(blocks))
        self.stage_ranges = ranges
        self.schedule_name: str = config.schedule
        ps.schedule_class(config.schedule)  # refuse a schedule this torch lacks, now
        self._stage_ranks = ps.stage_ranks(config.schedule, n_stages, pp)
        self.stage_ids = [s for s, r in enumerate(self._stage_ranks) if r == self.pp_rank]
        """This rank's stage indices, ascending."""
        self._unsplit: set[int] = set()  # stages whose zero-bubble split misses parameters
        self.observers: list[ps.StageObserver] = []
        """Called after each stage action and loss (see the class docstring)."""
        self.wait_observers: list[ps.WaitObserver] = []
        """Called after each point-to-point wait of the schedule with ``(start, end)``."""
        self.post_observers: list[ps.WaitObserver] = []  # posting sends / receives: the same
        stage_of = [s for s, r in enumerate(ranges) for _ in r]
        owned = set(self.stage_ids)
        self.chunks = [PipelineChunk([blocks[i] for i in ranges[s]]) for s in self.stage_ids]
        _drop_parameters(
            module,
            [b for b, s in zip(blocks, stage_of, strict=True) if s in owned],
            [b for b, s in zip(blocks, stage_of, strict=True) if s not in owned],
        )
        if wrap_chunk is not None:
            self.chunks = [wrap_chunk(c) for c in self.chunks]
        self.device = device
        self._schedules: dict[tuple[Any, ...], Any] = {}
        self.rng = gc.RNGReplay(self.chunks, device)
        self._clear_pass()
        self._tokens: list[Tensor] = []  # target tokens of each token-sum micro-batch loss
        self.cache_drift = torch.zeros(())
        """Largest ``|f_pass2 - f_pass1|`` of the last gradient-cache step (0: same features), a
        0-dim tensor on the engine's device (kept there: reading it is the only host sync)."""

    def _clear_pass(self) -> None:
        """No gradient-cache pass state: plain losses, nothing collected or cached."""
        self._mode = "plain"  # how _loss_fn treats each micro-batch's output (see _run)
        self._features: list[gc.Features] = []
        self._grads: list[tuple[Tensor | None, ...]] = []
        self._cached: list[gc.Features] = []
        self._batch_loss: Tensor | None = None

    def _check_shapes_agree(self, inputs: tuple[Tensor, ...]) -> None:
        """Every pipeline rank must split a batch of the same shapes (its stages exchange
        micro-batches of those shapes; a ragged batch's length and image slots vary by step).
        One 2-element all-reduce per step compares a signature of the shapes; on a mismatch
        every rank raises the same ``ValueError`` with every rank's shapes (never a hang or a
        silent reshape)."""
        shapes = tuple(tuple(t.shape) for t in inputs)
        sig = hash(shapes) % (1 << 61)
        both = torch.tensor([sig, -sig], dtype=torch.int64, device=self.device)
        comm.all_reduce(both, "max", self.group)
        if int(both[0]) == sig and int(both[1]) == -sig:
            return
        every = comm.all_gather_objects(shapes, self.group)
        raise ValueError(
            f"pipeline ranks got batches of different shapes ({every}, by pipeline rank); every "
            "pipeline rank must get the same batch: pad ragged batches to the same shapes on "
            "every rank (MultimodalCollator(pad_to_max_tokens=True, max_images_per_row=...))."
        )

    def _schedule_for(self, inputs: tuple[Tensor, ...], train: bool) -> Any:
        """The training or forward-only schedule for this input signature, built on first use.

        Stages get real example tensors (micro-batch 0 run through every stage once) instead of
        torch's shape inference, which runs stages on uninitialised tensors: integer inputs
        (token ids, indices) would be garbage there. One schedule per input shape, so evaluation
        batches of another size work too; forward-only passes get their own schedule, so
        switching between them and training does not re-initialise stages; and one per autocast
        state (``bf16-mixed`` steps run in the precision plugin's autocast, a greedy decode after
        ``fit`` may not: the stages' output dtypes, so their send and receive buffers, differ).
        The example run
        leaves every generator (default ones, the model-parallel tracker) where it was: its
        dropout draws would otherwise shift the masks of whichever step builds the schedule
        (the first one, or the first after a resume).
        """
        n = self.config.num_micro_batches
        for t in inputs:
            self.config.check_batch_size(int(t.shape[0]), name="batch size")
        kind = self.device.type
        autocast = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
        shapes = tuple((tuple(t.shape), t.dtype) for t in inputs)
        key = (train, n, autocast, self.pack_boundaries, *shapes)
        if key not in self._schedules:
            with _rng_untouched(self.device):  # built lazily: a resumed run builds it later
                io = self._example_io(tuple(t.tensor_split(n)[0] for t in inputs))
            stages = [
                self._stage(c, s, io[s]) for c, s in zip(self.chunks, self.stage_ids, strict=True)
            ]
            self._schedules[key] = self._build_schedule(stages)
        return self._schedules[key]

    def _stage(self, chunk: nn.Module, index: int, io: _StageIO) -> Any:
        """A stage with static metadata. Gradients are declared like the tensors they flow
        into (same shapes, DTensor placements), so torch does not fall back to inferring
        metadata by running the stage on placeholders (it does so for DTensors otherwise).
        Boundaries with other ranks travel packed (:class:`~.boundary.PackedStage`)."""

        def grads(ts: tuple[Tensor, ...]) -> tuple[Tensor | None, ...]:
            return tuple(t if t.requires_grad else None for t in ts)

        full = index in self._unsplit  # zero-bubble: whole backward in the I step
        stage = PackedStage(
            chunk,
            index,
            self.config.num_stages,
            self.device,
            group=self.group,
            input_args=io.inputs,
            output_args=io.outputs,
            input_grads=grads(io.inputs),
            output_grads=grads(io.outputs),
            dw_builder=(lambda: lambda: None) if full else None,
            inputs=io.unpack,
            outputs=io.pack,
        )
        stage.stage_index_to_group_rank = dict(enumerate(self._stage_ranks))
        ps.instrument_stage(stage, self.observers)
        ps.allow_forward_only_turn(stage)
        return stage

    @torch.no_grad()
    def _example_io(self, mb: tuple[Tensor, ...]) -> dict[int, _StageIO]:
        """Run one micro-batch through the stages in order (point-to-point between owners,
        in memory between two consecutive stages of this rank: the V layout's turn); each
        stage's metadata is what travels: the packed buffers across ranks."""
        chunks = dict(zip(self.stage_ids, self.chunks, strict=True))
        io: dict[int, _StageIO] = {}
        y: tuple[Tensor, ...] = ()
        for s in self.stage_ids:
            x, unpack = self._example_inputs(s, mb, y)
            split = s > 0 and self.schedule_name in ps.ZERO_BUBBLE  # see unsplit_parameters
            with torch.enable_grad() if split else contextlib.nullcontext():
                x = _grad_flags(x) if split else x
                out = chunks[s](*x)
                y = out if isinstance(out, tuple) else (out,)
                if split and ps.unsplit_parameters(x, y):
                    self._unsplit.add(s)
            pack = self._send_example(s, y)
            wire_x = unpack.pack(x) if unpack is not None else x
            wire_y = pack.pack(y) if pack is not None else y
            # the flags tell the stages which boundary tensors carry gradients
            io[s] = _StageIO(_grad_flags(wire_x) if s > 0 else x, _grad_flags(wire_y), unpack, pack)
        return io

    def _example_inputs(
        self, s: int, mb: tuple[Tensor, ...], previous: tuple[Tensor, ...]
    ) -> tuple[tuple[Tensor, ...], BoundaryLayout | None]:
        """Stage ``s``'s example inputs and the layout they travel in (the sender's, received
        with them; ``None``: unpacked)."""
        if s == 0:
            return mb, None
        src = self.stage_rank(s - 1)
        if src == self.pp_rank:
            return tuple(t.detach() for t in previous), None
        x = comm.recv_tensors(src, self.group, self.device)
        return x, comm.recv_object(src, self.group)

    def _send_example(self, s: int, y: tuple[Tensor, ...]) -> BoundaryLayout | None:
        """Send stage ``s``'s example outputs to the next stage's rank, with the layout they
        will travel in (:attr:`pack_boundaries`); nothing for the last stage or the same rank."""
        nxt = s + 1
        if nxt >= self.config.num_stages or self.stage_rank(nxt) == self.pp_rank:
            return None
        layout = BoundaryLayout.of(y) if self.pack_boundaries else None
        comm.send_tensors(y, self.stage_rank(nxt), self.group)
        comm.send_object(layout, self.stage_rank(nxt), self.group)
        return layout

    def _build_schedule(self, stages: list[Any]) -> Any:
        n = self.config.num_micro_batches
        schedule = ps.build_schedule(self.config.schedule, stages, n, self._timed_loss)
        executor.install(schedule, lambda: self.lean_runtime)
        return schedule

    def stage_rank(self, stage: int) -> int:
        """Pipeline rank (in the pp group) that runs ``stage`` (loop or V layout)."""
        return self._stage_ranks[stage]

    @property
    def num_stages(self) -> int:
        """All pipeline stages: ``pp * virtual_pipeline``."""
        return self.config.num_stages

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per step (changed by :meth:`set_micro_batches`)."""
        return self.config.num_micro_batches

    @property
    def last_rank(self) -> int:
        """Pipeline rank of the last stage (``pp - 1`` in the loop layout, 0 in the V one)."""
        return self._stage_ranks[-1]

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.config.num_stages - 1 in self.stage_ids

    def set_micro_batches(self, n: int) -> None:
        """Run ``n`` micro-batches per step from the next step on (every rank must call it
        alike). Gradients stay the full batch's mean (scaled by ``1 / n``); each batch must
        divide by ``n``. Schedules are built once per (``n``, input shapes).

        Raises:
            ValueError: ``n`` not a positive integer or below the schedule's minimum
                (:func:`~lightning_mmpar.layout.schedules.min_micro_batches`), naming the fix.
        """
        self.config = dataclasses.replace(self.config, micro_batches=n)

    def _coupled(self) -> bool:
        module = self.module
        return isinstance(module, gc.BatchLossModule) and module.pipeline_batch_coupled()

    def _observe(self, action: str, mb: int, start: float) -> None:
        end = time.perf_counter()
        for observer in list(self.observers):
            observer(self.num_stages - 1, action, mb, start, end)

    def _timed_loss(self, output: Any, target: Any) -> Tensor:
        """:meth:`_loss_fn`, timed for the observers as the last stage's ``"loss"`` action (the
        loss is that stage's work: torch's schedules run it between its actions)."""
        if not self.observers:
            return self._loss_fn(output, target)
        start, mb = time.perf_counter(), self._losses_run
        self._losses_run += 1
        loss = self._loss_fn(output, target)
        self._observe("loss", mb, start)
        return loss

    def _loss_fn(self, output: Any, target: Any) -> Tensor:
        """The schedules' loss of one micro-batch on the last stage, by pass (``self._mode``):
        ``plain`` the module's ``pipeline_loss``; ``collect`` features only (cache pass);
        ``eval`` micro loss and features; ``cached`` micro loss + gradient-cache surrogate."""
        module: Any = self.module
        if self._mode == "plain":
            return self._micro_loss(module.pipeline_loss(output, target))
        features = module.pipeline_features(output, target)
        if self._mode == "collect":
            self._features.append(tuple(f.detach() for f in features))
            return torch.zeros((), device=self.device)
        loss = module.pipeline_micro_loss(output, target)
        if self._mode == "eval":
            self._features.append(tuple(f.detach() for f in features))
            return loss
        grads = self._grads.pop(0)
        for f, c in zip(features, self._cached.pop(0), strict=True):
            if f.is_floating_point() and f.numel():  # on the device: no host sync per action
                drift = (f.detach() - c).abs().max().float()
                self.cache_drift = torch.maximum(self.cache_drift.to(drift.device), drift)
        assert self._batch_loss is not None
        scale = float(self.config.num_micro_batches)  # cancels the schedule's 1 / M
        return loss + gc.surrogate(features, grads, scale) + self._batch_loss

    def _micro_loss(self, loss: Any) -> Tensor:
        """What the schedule back-propagates for one ``pipeline_loss`` result: a mean as it is,
        a token loss's sum (its count kept for :meth:`_broadcast_loss`)."""
        loss = as_token_mean(loss)
        if not isinstance(loss, TokenMean):
            return loss
        self._tokens.append(loss.tokens.detach())
        return loss.token_sum

    def run_in_order(
        self, first: tuple[Tensor, ...], run: ps.StageRun | None = None
    ) -> tuple[Tensor, ...] | None:
        """This rank's stages in order on one whole batch (:func:`~.schedules.run_in_order`);
        ``run(stage, inputs)`` defaults to the stage's chunk. Returns the last stage's outputs
        (a tuple) on its rank, else ``None``. Collective over the pp group."""
        chunks = dict(zip(self.stage_ids, self.chunks, strict=True))

        def forward(s: int, x: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
            out = chunks[s](*x)
            return out if isinstance(out, tuple) else (out,)

        return ps.run_in_order(
            self.stage_ids, self._stage_ranks, self.group, self.device, run or forward, first
        )

    def _eval_in_order(self, inputs: tuple[Tensor, ...], target: Any) -> Tensor:
        """A forward-only batch the micro-batches do not divide (a short last eval batch):
        every stage in order on the whole batch, ``pipeline_loss`` once on the last stage."""
        out = self.run_in_order(inputs if self.has_first else ())
        losses = []
        if out is not None:
            module: Any = self.module
            loss = module.pipeline_loss(out[0] if len(out) == 1 else out, target)
            losses.append(self._micro_loss(loss))
        try:
            return self._broadcast_loss(losses)
        finally:
            self._tokens = []

    def _run(self, batch: Any, train: bool) -> Tensor:
        inputs, target = self.module.pipeline_inputs(batch)  # type: ignore[attr-defined]
        n = self.config.num_micro_batches
        self._tokens = []  # nothing left from a step that raised
        if not train and any(int(t.shape[0]) % n for t in inputs):
            return self._eval_in_order(tuple(inputs), target)
        self._check_shapes_agree(tuple(inputs))
        args = inputs if self.has_first else ()
        tgt = target if self.has_last else None
        losses: list[Tensor] = []
        coupled = self._coupled()
        extra: Tensor | None = None
        schedule = self._schedule_for(tuple(inputs), train)  # built before any RNG recording
        try:
            if train and coupled:
                self._cache_pass(self._schedule_for(tuple(inputs), False), args, tgt)
                self._mode = "cached"
                self.rng.replay()
            else:
                self._mode = "eval" if coupled else "plain"
            self._losses_run = 0
            with ps.observing_waits(self.wait_observers, self.post_observers):
                if train:
                    schedule.step(*args, target=tgt, losses=losses, return_outputs=False)
                else:
                    schedule.eval(*args, target=tgt, losses=losses, return_outputs=False)
            if not train and coupled and self.has_last:
                module: Any = self.module
                extra = module.pipeline_batch_loss(gc.cat_features(self._features))
        finally:
            self.rng.stop()
            self._clear_pass()
        try:
            return self._broadcast_loss(losses, extra)
        finally:
            self._tokens = []

    def _cache_pass(self, schedule: Any, args: Any, target: Any) -> None:
        """Gradient cache, steps 1 and 2: a forward-only pass recording the RNG state of every
        forward and collecting the features on the last stage; there, the coupled loss of the
        whole batch and its gradient on each micro-batch's features."""
        self._mode, self._features, self._losses_run = "collect", [], 0
        self.rng.record()
        with torch.no_grad(), ps.observing_waits(self.wait_observers, self.post_observers):
            schedule.eval(*args, target=target, losses=[], return_outputs=False)
        if self.has_last:
            start = time.perf_counter()
            loss, self._grads = gc.batch_gradients(self.module, self._features)  # type: ignore[arg-type]
            if self.observers:
                self._observe("loss", -1, start)
            self._batch_loss = loss
            self._cached = self._features
        self._features = []
        self.cache_drift = torch.zeros((), device=self.device)

    def train_step(self, batch: Any) -> Tensor:
        """Forward and backward of one batch; returns the mean loss (detached, on every rank)."""
        return self._run(batch, train=True)

    @torch.no_grad()
    def eval_step(self, batch: Any) -> Tensor:
        """Forward-only pass of one batch; returns the mean loss on every rank. A batch that
        the micro-batches do not divide runs its stages in order, unscheduled."""
        return self._run(batch, train=False)

    def _broadcast_loss(self, losses: list[Tensor], extra: Tensor | None = None) -> Tensor:
        """The last stage's loss of the batch on every pp rank: the mean of micro-batch means,
        or, for token losses, a :class:`TokenMean` (summed loss over target tokens)."""
        device = self.device
        packed = torch.zeros(3, dtype=torch.float64, device=device)  # loss, token sum, tokens
        packed[2] = -1.0  # plain means
        if self.has_last:
            stacked = torch.stack([x.detach().float() for x in losses]).to(device)
            if self._tokens:
                if len(self._tokens) != len(losses):
                    raise ValueError(
                        "pipeline_loss returned a plain mean for some micro-batches and a "
                        "(sum, token count) for others; return the same kind for every one."
                    )
                packed[1] = stacked.sum()
                packed[2] = torch.stack(self._tokens).sum().to(device)
            else:
                loss = stacked.mean()
                if extra is not None:
                    loss = loss + extra.detach().float().to(device)
                packed[0] = loss
        packed = comm.broadcast(packed, src=self.last_rank, group=self.group)
        if packed[2] < 0:
            return packed[0].float()
        mean = (packed[1] / packed[2].clamp(min=1)).float()
        return token_mean(packed[1].float(), packed[2].long(), mean=mean)


@contextlib.contextmanager
def _rng_untouched(device: torch.device) -> Any:
    """Run the block with the default generators (CPU and ``device``'s) and the model-parallel
    tracker's regions put back afterwards (``torch.random.fork_rng`` plus the tracker)."""
    tracker = get_rng_tracker()
    saved = tracker.state_dict()
    accelerator = device.type != "cpu"
    devices = [device.index or 0] if accelerator else []
    device_type = device.type if accelerator else "cuda"
    try:
        with torch.random.fork_rng(devices=devices, device_type=device_type):
            yield
    finally:
        tracker.load_state_dict(saved)
