"""LeanRuntime: torch's multi-stage action lists run in the same order, with the same stage
calls, as torch's own loop (recording stand-in stages, one process, no process group)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_mmpar.layout.schedules import MULTI_STAGE_SCHEDULES, min_micro_batches, stage_ranks
from lightning_mmpar.parallel.pipeline import executor
from lightning_mmpar.parallel.pipeline.schedules import build_schedule


class RecordingStage:
    """A stage that records every call a schedule's loop makes on it (into a shared log);
    sends and receives are empty op lists (nothing travels)."""

    def __init__(self, index: int, num_stages: int, pp: int, rank: int, log: list[Any]) -> None:
        self.stage_index, self.num_stages, self.group_size, self.group_rank = (
            index,
            num_stages,
            pp,
            rank,
        )
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.submod = nn.Identity()
        self.stage_index_to_group_rank: Any = None
        self.has_backward = True
        self.log = log

    def _record(self, *call: Any) -> None:
        self.log.append((self.stage_index, *call))

    def clear_runtime_states(self) -> None:
        self._record("clear")

    def forward_one_chunk(self, mb: int, args: Any, kwargs: Any, save_forward_output: bool) -> Any:
        self._record("F", mb, args, save_forward_output)
        return torch.tensor(float(10 * self.stage_index + mb))

    def backward_one_chunk(
        self, mb: int, loss: Any = None, full_backward: bool = True, last_backward: bool = False
    ) -> None:
        loss_value = None if loss is None else float(loss)
        self._record("B" if full_backward else "I", mb, loss_value, last_backward)

    def backward_weight_one_chunk(self, mb: int, last_backward: bool = False) -> None:
        self._record("W", mb, last_backward)

    def perform_reduce_grad(self, factor: int) -> None:
        self._record("reduce", factor)

    def set_local_fwd_input(self, output: Any, mb: int) -> None:
        self._record("local_fwd", mb, float(output))

    def get_local_bwd_output(self, mb: int) -> Any:
        self._record("get_local_bwd", mb)
        return ()

    def set_local_bwd_input(self, grads: Any, mb: int) -> None:
        self._record("local_bwd", mb)

    def get_fwd_send_ops(self, mb: int) -> list[Any]:
        self._record("send_f", mb)
        return []

    def get_bwd_send_ops(self, mb: int) -> list[Any]:
        self._record("send_b", mb)
        return []

    def get_fwd_recv_ops(self, mb: int) -> list[Any]:
        self._record("recv_f", mb)
        return []

    def get_bwd_recv_ops(self, mb: int) -> list[Any]:
        self._record("recv_b", mb)
        return []


def _schedule(name: str, rank: int, m: int, log: list[Any]) -> Any:
    pp, v = 2, 2
    ranks = stage_ranks(name, pp, v)
    stages = [
        RecordingStage(s, len(ranks), pp, rank, log) for s, r in enumerate(ranks) if r == rank
    ]
    schedule = build_schedule(name, stages, m, lambda out, target: out * 0 + target)
    schedule._stages_forward_initialized = schedule._stages_backward_initialized = True
    return schedule


def _step(schedule: Any, m: int) -> list[Any]:
    losses: list[Any] = []
    args = [(torch.tensor(float(i)),) for i in range(m)]
    targets = [torch.tensor(100.0 + i) for i in range(m)]
    schedule.step(arg_mbs=args, target_mbs=targets, losses=losses, return_outputs=False)
    return [float(x) for x in losses]


@pytest.mark.parametrize("name", sorted(MULTI_STAGE_SCHEDULES))
@pytest.mark.parametrize("rank", [0, 1])
def test_lean_runtime_makes_torchs_calls_in_torchs_order(name: str, rank: int) -> None:
    m = max(4, min_micro_batches(name, 2, 2))
    theirs: list[Any] = []
    torch_schedule = _schedule(name, rank, m, theirs)
    want_losses = _step(torch_schedule, m)
    ours: list[Any] = []
    lean_schedule = _schedule(name, rank, m, ours)
    runtime = executor.install(lean_schedule)
    assert runtime is not None and lean_schedule.lean_runtime is runtime
    assert _step(lean_schedule, m) == want_losses
    assert runtime.steps_run == 1
    assert ours == theirs  # every stage call, its micro-batch, loss and last-backward flag
    assert any(call[1] in ("B", "I") for call in ours)  # a training step ran
    ours.clear()
    assert _step(lean_schedule, m) == want_losses and ours == theirs  # compiled once, reused


def test_lean_runtime_steps_aside_when_disabled_or_profiled() -> None:
    log: list[Any] = []
    schedule = _schedule("interleaved_1f1b", 0, 4, log)
    enabled = [False]
    runtime = executor.install(schedule, lambda: enabled[0])
    assert runtime is not None
    _step(schedule, 4)
    assert runtime.steps_run == 0  # torch's loop ran
    enabled[0] = True
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _step(schedule, 4)
    assert runtime.steps_run == 0  # a profiler records: torch's loop and its PP: ranges
    assert any(e.name.startswith("PP:") for e in prof.events())
    _step(schedule, 4)
    assert runtime.steps_run == 1


def test_install_leaves_single_stage_schedules_and_refuses_others() -> None:
    stage = RecordingStage(0, 2, 2, 0, [])
    schedule = build_schedule("1f1b", [stage], 2, lambda out, target: out)
    assert executor.install(schedule) is None
    with pytest.raises(TypeError, match="runtime schedules"):
        executor.LeanRuntime(schedule)


def test_lean_runtime_names_the_failing_action() -> None:
    schedule = _schedule("interleaved_1f1b", 0, 4, [])
    executor.install(schedule)
    stage = schedule._stages[0]

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("boom")

    stage.forward_one_chunk = broken
    with pytest.raises(RuntimeError, match="boom") as info:
        _step(schedule, 4)
    assert any("0F0" in note for note in getattr(info.value, "__notes__", []))


def test_a_torch_without_its_internals_runs_torchs_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a torch that lacks one of the private names the executor calls (the package supports
    torch >= 2.6; they are torch 2.14's), it steps aside instead of failing mid-step."""
    from torch.distributed.pipelining import schedules as ts

    from lightning_mmpar.parallel.pipeline import executor

    class Runtime(ts._PipelineScheduleRuntime):
        def __init__(self) -> None:  # no stages: only the support check runs
            pass

    assert executor.torch_supported(Runtime()) == all(
        hasattr(Runtime, n) for n in executor._SCHEDULE_NAMES
    )
    monkeypatch.delattr(ts, "REDUCE_GRAD")
    runtime = executor.LeanRuntime(Runtime())
    assert not runtime._supported and not runtime.applies()
