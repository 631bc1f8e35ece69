"""A lean executor of torch's multi-stage schedules: the same action list, less host work.

torch's multi-stage schedules (``ScheduleInterleaved1F1B``, ``ScheduleLoopedBFS``,
``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``) lower their
compute order into a per-rank action list with the sends and receives in it
(``pipeline_order_with_comms``) and run it in ``_PipelineScheduleRuntime._step_microbatches``,
which for every action (46 per step and rank at pp 2, v 2, 4 micro-batches) enters a profiler
``record_function`` (two dispatcher calls, a profiler event when no profiler records), formats
a debug log call, and re-derives what the action needs (its stage, whether the neighbouring
stages share the rank, whether the stage is FSDP-sharded). :class:`LeanRuntime` compiles the
rank's action list once per schedule into steps that hold those answers and runs them in the
same order, with the same stage calls (``forward_one_chunk``, ``backward_one_chunk``,
``backward_weight_one_chunk``, ``perform_reduce_grad``, the stage's own send / receive ops
posted and waited through torch's ``_batch_p2p`` / ``_wait_batch_p2p``) and the same loss
bookkeeping: numerics and communication are torch's, only the per-action host work goes.

It steps aside (torch's own loop runs) while a torch profiler records (its ``PP:<action>``
ranges then appear in the trace as usual), for a stage whose module is FSDP-sharded (the
runtime's unshard / reshard actions), when custom action functions are registered, on a torch
without one of the internals it calls (:func:`torch_supported`), or while ``enabled()`` is
false (the A/B switch: ``PipelineEngine.lean_runtime``).

Peers: Megatron-LM's interleaved schedule (``forward_backward_pipelining_with_interleaving``)
and DeepSpeed's ``PipeEngine`` (an instruction list interpreted per step) run their schedules
in one loop of their own in the same way.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import schedules as ts

__all__ = ["LeanRuntime", "install", "torch_supported"]

Step = Callable[["_StepState"], None]

_TORCH_NAMES = (
    "_batch_p2p",
    "_wait_batch_p2p",
    "FORWARD",
    "FULL_BACKWARD",
    "BACKWARD_INPUT",
    "BACKWARD_WEIGHT",
    "SEND_F",
    "SEND_B",
    "RECV_F",
    "RECV_B",
    "UNSHARD",
    "RESHARD",
    "REDUCE_GRAD",
    "OVERLAP_F_B",
)
"""The private names of ``torch.distributed.pipelining.schedules`` the executor uses."""
_SCHEDULE_NAMES = (
    "pipeline_order_with_comms",
    "_comp_type_to_function_map",
    "_check_inputs",
    "_initialize_stages",
    "_maybe_compute_loss",
    "_maybe_get_loss",
    "_update_losses",
)
"""The private members of a runtime schedule it uses: a torch without one of them (these are
torch 2.14's internals; the package supports torch >= 2.6) runs torch's own loop instead."""


def torch_supported(schedule: Any) -> bool:
    """Whether this torch has every internal :class:`LeanRuntime` calls, on ``schedule``."""
    return all(hasattr(ts, n) for n in _TORCH_NAMES) and all(
        hasattr(schedule, n) for n in _SCHEDULE_NAMES
    )


class _StepState:
    """One step's moving parts: the micro-batches, the posted receives and sends."""

    __slots__ = (
        "args",
        "bwd_recv",
        "counts",
        "fwd_recv",
        "kwargs",
        "loss_kwargs",
        "outputs",
        "sends",
        "targets",
    )

    def __init__(
        self, args: Any, kwargs: Any, targets: Any, outputs: bool, loss_kwargs: Any
    ) -> None:
        self.args, self.kwargs, self.targets = args, kwargs, targets
        self.outputs, self.loss_kwargs = outputs, loss_kwargs
        self.sends: list[Any] = []
        self.fwd_recv: dict[tuple[int, int], Any] = {}
        self.bwd_recv: dict[tuple[int, int], Any] = {}
        self.counts: dict[int, int] = {}


class LeanRuntime:
    """Runs ``schedule``'s own action list for its rank (``pipeline_order_with_comms``) as
    precompiled steps (see the module docstring); :func:`install` puts it in place of the
    schedule's ``_step_microbatches``. ``enabled()`` is read at every step.

    Raises:
        TypeError: ``schedule`` is not a torch runtime schedule (``_PipelineScheduleRuntime``).
    """

    def __init__(self, schedule: Any, enabled: Callable[[], bool] = lambda: True) -> None:
        if not isinstance(schedule, ts._PipelineScheduleRuntime):
            raise TypeError(
                f"LeanRuntime runs torch's multi-stage runtime schedules; got "
                f"{type(schedule).__name__}. Use it for the schedules of "
                "lightning_mmpar.layout.schedules.MULTI_STAGE_SCHEDULES."
            )
        self.schedule = schedule
        self.enabled = enabled
        self.torch_step = schedule._step_microbatches
        """torch's own ``_step_microbatches`` (bound), run whenever this executor steps aside."""
        self.steps_run = 0
        """Steps this executor ran (not torch's loop): what tests and benchmarks check."""
        self._program: list[tuple[Any, Step]] | None = None
        self._supported = torch_supported(schedule)

    def applies(self) -> bool:
        """Whether the next step runs here (else torch's loop): see the module docstring."""
        sch = self.schedule
        return (
            self._supported
            and self.enabled()
            and not torch.autograd._profiler_enabled()
            and not sch._comp_type_to_function_map
            and not any(isinstance(s.submod, FSDPModule) for s in sch._stages)
        )

    def step_microbatches(
        self,
        arg_mbs: Any = None,
        kwarg_mbs: Any = None,
        target_mbs: Any = None,
        losses: Any = None,
        return_outputs: bool = True,
        loss_kwargs: Any = None,
    ) -> None:
        """``_step_microbatches`` of the schedule (same arguments): torch's checks and stage
        set-up, then the compiled action list, then the pending sends and the losses."""
        if not self.applies():
            return self.torch_step(
                arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs
            )
        sch = self.schedule
        arg_mbs, kwarg_mbs = sch._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        first_target = target_mbs[0] if target_mbs is not None else None
        sch._initialize_stages(arg_mbs[0], kwarg_mbs[0], first_target, loss_kwargs)
        if self._program is None:
            self._program = self._compile()
        state = _StepState(arg_mbs, kwarg_mbs, target_mbs, return_outputs, loss_kwargs)
        for action, step in self._program:
            try:
                step(state)
            except Exception as err:
                err.add_note(f"pipeline action {action} (lightning_mmpar LeanRuntime)")
                raise
        while state.sends:  # mostly done long ago: waited for before the step returns
            ts._wait_batch_p2p(state.sends.pop())
        self.steps_run += 1
        sch._update_losses(sch._stages, losses)
        return None

    def _compile(self) -> list[tuple[Any, Step]]:
        """The rank's action list as ``(action, step)`` pairs."""
        sch = self.schedule
        program: list[tuple[Any, Step]] = []
        for action in sch.pipeline_order_with_comms[sch.rank]:
            subs = action.sub_actions if action.computation_type == ts.OVERLAP_F_B else None
            steps = [self._compile_one(a) for a in (subs or (action,))]
            if len(steps) == 1:
                program.append((action, steps[0]))
            else:
                program.append((action, _sequence(steps)))
        return program

    def _compile_one(self, action: Any) -> Step:
        """One action as a step (torch's ``_perform_action`` with its lookups done once)."""
        sch = self.schedule
        by_index = {s.stage_index: s for s in sch._stages}
        kind, index, mb = action.computation_type, action.stage_index, action.microbatch_index
        if mb is None and kind not in (ts.UNSHARD, ts.RESHARD, ts.REDUCE_GRAD):
            raise AssertionError(f"{action=} missing mb_index")
        stage = by_index[index]
        if kind in (ts.UNSHARD, ts.RESHARD):  # no FSDP here (applies()): nothing to do
            return _nothing
        if kind in (ts.SEND_F, ts.SEND_B, ts.RECV_F, ts.RECV_B):
            return self._compile_comm(kind, stage, mb)
        if kind == ts.FORWARD:
            return self._compile_forward(stage, mb, by_index)
        if kind in (ts.FULL_BACKWARD, ts.BACKWARD_INPUT, ts.BACKWARD_WEIGHT):
            return self._compile_backward(kind, stage, mb, by_index)
        if kind == ts.REDUCE_GRAD:
            return lambda state: stage.perform_reduce_grad(
                sch._n_microbatches if sch.scale_grads else 1
            )
        raise ValueError(f"{action=} is unknown or unsupported")

    def _compile_comm(self, kind: Any, stage: Any, mb: int) -> Step:
        key = (stage.stage_index, mb)
        if kind == ts.SEND_F:
            return lambda state: state.sends.append(ts._batch_p2p(stage.get_fwd_send_ops(mb)))
        if kind == ts.SEND_B:
            return lambda state: state.sends.append(ts._batch_p2p(stage.get_bwd_send_ops(mb)))
        forward = kind == ts.RECV_F

        def recv(state: _StepState) -> None:
            posted = state.fwd_recv if forward else state.bwd_recv
            if key in posted:
                raise AssertionError(f"Recv twice for {key} without executing its compute")
            ops = stage.get_fwd_recv_ops(mb) if forward else stage.get_bwd_recv_ops(mb)
            posted[key] = ts._batch_p2p(ops)

        return recv

    def _compile_forward(self, stage: Any, mb: int, by_index: dict[int, Any]) -> Step:
        sch, key = self.schedule, (stage.stage_index, mb)
        nxt = by_index.get(stage.stage_index + 1)  # the V layout's turn: handed over in memory
        receives = not stage.is_first and stage.stage_index - 1 not in by_index

        def forward(state: _StepState) -> None:
            if receives:
                if key not in state.fwd_recv:
                    raise AssertionError(f"Computing forward {key} before receiving input")
                ts._wait_batch_p2p(state.fwd_recv.pop(key))
            output = stage.forward_one_chunk(
                mb, state.args[mb], state.kwargs[mb], save_forward_output=state.outputs
            )
            sch._maybe_compute_loss(stage, output, state.targets, mb, state.loss_kwargs)
            if nxt is not None:
                nxt.set_local_fwd_input(output, mb)

        return forward

    def _compile_backward(self, kind: Any, stage: Any, mb: int, by_index: dict[int, Any]) -> Step:
        sch, key, index = self.schedule, (stage.stage_index, mb), stage.stage_index
        prev = by_index.get(index - 1)
        receives = not stage.is_last and index + 1 not in by_index
        n = sch._n_microbatches

        def count(state: _StepState) -> bool:
            state.counts[index] = state.counts.get(index, 0) + 1
            return state.counts[index] == n

        if kind == ts.BACKWARD_WEIGHT:
            return lambda state: stage.backward_weight_one_chunk(mb, last_backward=count(state))
        full = kind == ts.FULL_BACKWARD

        def backward(state: _StepState) -> None:
            if receives:
                if key not in state.bwd_recv:
                    raise AssertionError(f"Computing backward {key} before receiving input")
                ts._wait_batch_p2p(state.bwd_recv.pop(key))
            loss = sch._maybe_get_loss(stage, mb)
            last = count(state) if full else False
            stage.backward_one_chunk(mb, loss=loss, full_backward=full, last_backward=last)
            if prev is not None:
                prev.set_local_bwd_input(stage.get_local_bwd_output(mb), mb)

        return backward


def _nothing(state: _StepState) -> None:
    return None


def _sequence(steps: list[Step]) -> Step:
    def run(state: _StepState) -> None:
        for step in steps:
            step(state)

    return run


def install(schedule: Any, enabled: Callable[[], bool] = lambda: True) -> LeanRuntime | None:
    """Put a :class:`LeanRuntime` in place of ``schedule``'s ``_step_microbatches`` (an
    instance attribute: ``schedule.step`` and ``schedule.eval`` then run it) and return it;
    ``None`` (nothing changed) for a schedule that is not a torch runtime schedule (the
    single-stage ones run their own hand-written loops)."""
    if not isinstance(schedule, ts._PipelineScheduleRuntime):
        return None
    runtime = LeanRuntime(schedule, enabled)
    target: Any = schedule  # an instance attribute in place of the class's method
    target._step_microbatches = types.MethodType(
        lambda self, *args, **kwargs: runtime.step_microbatches(*args, **kwargs), schedule
    )
    target.lean_runtime = runtime
    return runtime
