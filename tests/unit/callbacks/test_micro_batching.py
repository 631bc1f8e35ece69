"""DynamicMicroBatching (issue 11): the policy's values, rounding to valid
sizes, hysteresis, latency hooks with a fake clock, and decisions of the callback on a fake engine
with a fake memory source. The real pipelined run (size changed mid-run, losses equal to the
static run's) is in tests/recipes/pipeline_callbacks_worker.py (the 2-rank parity-matrix world)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from lightning_mmpar.callbacks import DynamicMicroBatching, brief_policy
from lightning_mmpar.callbacks.micro_batching import (
    DeviceMemory,
    Hysteresis,
    LatencyMeter,
    nearest_valid,
    watched_modules,
)

pytestmark = pytest.mark.filterwarnings("ignore:DynamicMicroBatching. no module to time")


@pytest.mark.parametrize(
    ("memory", "latency", "size"),
    [
        (0.0, 0.0, 8),  # 8 * 1 * 1
        (0.2, 20.0, 4),  # 8 * 0.8 * 0.75 = 4.8
        (0.25, 10.0, 5),  # 8 * 0.75 * 0.875 = 5.25
        (0.0, 100.0, 3),  # latency capped at 80 ms, factor floor 0.4: 3.2
        (0.9, 0.0, 2),  # memory factor floor 0.3: 2.4
        (0.5, 40.0, 2),  # 8 * 0.5 * 0.5 = 2
        (1.0, 80.0, 2),  # 8 * 0.3 * 0.4 = 0.96, floored at 2
    ],
)
def test_brief_policy(memory: float, latency: float, size: int) -> None:
    assert brief_policy(memory, latency) == size


def test_nearest_valid_size() -> None:
    at_least_two = lambda n: n >= 2  # noqa: E731 - the 1F1B minimum at pp 2
    assert nearest_valid(7, 8, at_least_two) == 4  # 8 would be one micro-batch
    assert nearest_valid(3, 8, at_least_two) == 2  # tie 2 / 4: the smaller size
    assert nearest_valid(5, 8, lambda n: True) == 4
    assert nearest_valid(5, 12, lambda n: True) == 4  # 4 and 6 tie: 4
    assert nearest_valid(2, 8, lambda n: False) is None
    assert nearest_valid(3, 72, lambda n: True) == 3
    assert nearest_valid(3, 72, lambda n: True, multiple=2) == 2  # vision dp at tp 2: even sizes
    assert nearest_valid(9, 72, lambda n: True, multiple=2) == 8


def test_hysteresis_needs_a_streak_and_never_oscillates() -> None:
    h = Hysteresis(patience=2)
    assert [h.propose(v, 4) for v in [2, 8, 2, 8, 2, 8]] == [None] * 6  # alternating inputs
    assert [h.propose(v, 4) for v in [2, 2]] == [None, 2]
    assert [h.propose(v, 4) for v in [2, 4, 2]] == [None, None, None]  # back to current resets
    assert Hysteresis(patience=1).propose(8, 4) == 8


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SlowAdapter(nn.Module):
    """Takes 10 ms of the fake clock; holds a nested adapter (timed once, with its parent)."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self.clock = clock
        self.inner = InnerAdapterMLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.now += 0.010
        return self.inner(x)


class InnerAdapterMLP(nn.Linear):
    def __init__(self) -> None:
        super().__init__(2, 2)


def test_latency_meter_times_the_outermost_adapters() -> None:
    clock = FakeClock()
    model = nn.Sequential(SlowAdapter(clock), nn.Linear(2, 2), SlowAdapter(clock))
    found = watched_modules(model, None)
    assert sorted(found) == ["0", "2"]
    assert sorted(watched_modules(model, ["*.inner"])) == ["0.inner", "2.inner"]
    meter = LatencyMeter(list(found.values()), clock)
    model(torch.zeros(1, 2))
    assert meter.take() is None  # inactive
    meter.active = True
    model(torch.zeros(1, 2))
    model(torch.zeros(1, 2))
    assert meter.take() == pytest.approx(10.0)
    meter.remove()
    model(torch.zeros(1, 2))
    assert meter.take() is None


def test_device_memory_on_cpu() -> None:
    used, limit = DeviceMemory(torch.device("cpu"), limit=10**12)()
    assert 10**6 < used < limit == 10**12


class FakeEngine:
    """``set_micro_batches`` with the 1F1B minimum at pp 2."""

    def __init__(self, n: int) -> None:
        self.num_micro_batches, self.calls = n, []

    def set_micro_batches(self, n: int) -> None:
        self.calls.append(n)
        if n < 2:
            raise ValueError(f"micro_batches ({n}) must be >= pipeline_parallel (2)")
        self.num_micro_batches = n


class Pipelined(nn.Module):
    def pipeline_inputs(self, batch: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        return (batch,), None

    def log(self, name: str, value: float, **kwargs: Any) -> None:
        self.logged = {**getattr(self, "logged", {}), name: value}


def run(
    cb: DynamicMicroBatching,
    engine: FakeEngine,
    steps: int,
    accumulate: int = 1,
    trainer: Any = None,
) -> list[int]:
    """Drive the callback ``steps`` batches of 8 rows (``accumulate`` batches per optimizer
    step); the micro-batch size of every batch. With ``trainer`` given the fit does not end."""
    module = Pipelined()
    ends = trainer is None
    trainer = trainer or SimpleNamespace(
        strategy=SimpleNamespace(pipeline=engine, root_device=torch.device("cpu")), global_step=0
    )
    cb.on_fit_start(trainer, module)  # type: ignore[arg-type]
    sizes = []
    for step in range(steps):
        trainer.global_step = step // accumulate
        cb.on_train_batch_start(trainer, module, torch.zeros(8, 2), step)  # type: ignore[arg-type]
        sizes.append(8 // engine.num_micro_batches)
        trainer.global_step = (step + 1) // accumulate
        cb.on_train_batch_end(trainer, module, None, None, step)  # type: ignore[arg-type]
        assert module.logged == {"micro_batch_size": sizes[-1], "num_micro_batches": 8 / sizes[-1]}
    if ends:
        cb.on_fit_end(trainer, module)  # type: ignore[arg-type]
    return sizes


def test_evaluation_and_the_end_of_training_use_the_configured_count() -> None:
    """Validation (whose last batch may be smaller) and what runs after training (greedy
    decoding in on_fit_end) use the count the run started with; training resumes with the
    chosen one."""
    cb = DynamicMicroBatching(every_n_steps=1, memory_source=lambda: (0.9, 1.0), latency_modules=[])
    engine = FakeEngine(n=2)
    trainer = SimpleNamespace(
        strategy=SimpleNamespace(pipeline=engine, root_device=torch.device("cpu")), global_step=0
    )
    assert run(cb, engine, 4, trainer=trainer)[-1] == 2  # size 2: 4 micro-batches
    module: Any = Pipelined()
    cb.on_validation_start(trainer, module)  # type: ignore[arg-type]
    assert engine.num_micro_batches == 2
    cb.on_validation_end(trainer, module)  # type: ignore[arg-type]
    assert engine.num_micro_batches == 4
    cb.on_train_end(trainer, module)  # type: ignore[arg-type]
    assert engine.num_micro_batches == 2


def test_callback_changes_size_after_patience_every_n_steps() -> None:
    fractions = iter([0.0, 0.0, 0.0, 0.9, 0.9, 0.9])  # policy 8 -> valid 4; 2.4 -> 2
    cb = DynamicMicroBatching(
        every_n_steps=2, memory_source=lambda: (next(fractions), 1.0), latency_modules=[]
    )
    engine = FakeEngine(n=2)  # size 4
    sizes = run(cb, engine, 12)
    # decisions after steps 2, 4, 6, 8, 10, 12: size 4 kept (8 is invalid: 1 micro-batch), then
    # 2 chosen at 8 and 10, applied from the step after decision 10
    assert [d["chosen_size"] for d in cb.decisions] == [4, 4, 4, 2, 2, 2]
    assert [d["applied"] for d in cb.decisions] == [None, None, None, None, 2, None]
    assert sizes == [4] * 10 + [2] * 2
    assert cb.decisions[0]["policy_size"] == 8 and engine.num_micro_batches == 4


def test_callback_does_not_oscillate_on_alternating_memory() -> None:
    fractions = iter([0.9, 0.2] * 5)  # sizes 2 and 6 -> 4 (current), alternately
    cb = DynamicMicroBatching(
        every_n_steps=1, memory_source=lambda: (next(fractions), 1.0), latency_modules=[]
    )
    fractions2 = iter([0.9, 0.5] * 5)  # 2 and 4 alternately: the streak never reaches 2
    cb2 = DynamicMicroBatching(
        every_n_steps=1, memory_source=lambda: (next(fractions2), 1.0), latency_modules=[]
    )
    assert run(cb, FakeEngine(n=2), 10) == [4] * 10
    assert run(cb2, FakeEngine(n=2), 10) == [4] * 10
    assert [d["chosen_size"] for d in cb2.decisions] == [2, 4] * 5


def test_invalid_arguments_and_policy() -> None:
    with pytest.raises(ValueError, match=r"every_n_steps \(0\) must be an integer >= 1"):
        DynamicMicroBatching(every_n_steps=0)
    with pytest.raises(ValueError, match=r"patience \(0\) must be an integer >= 1; use 1"):
        DynamicMicroBatching(patience=0)
    with pytest.raises(ValueError, match=r"latency_modules \('adapter'\) must be a sequence"):
        DynamicMicroBatching(latency_modules="adapter")
    cb = DynamicMicroBatching(
        every_n_steps=1,
        policy=lambda f, lat: 0.5,
        memory_source=lambda: (0.0, 1.0),  # type: ignore[arg-type, return-value]
    )
    with pytest.raises(ValueError, match=r"policy returned 0.5 .* must return a positive int"):
        run(cb, FakeEngine(n=2), 1)


def test_callback_under_accumulation_decides_once_per_due_step() -> None:
    cb = DynamicMicroBatching(every_n_steps=1, memory_source=lambda: (0.9, 1.0), latency_modules=[])
    sizes = run(cb, FakeEngine(n=2), 8, accumulate=2)  # optimizer steps end after odd batches
    assert [d["step"] for d in cb.decisions] == [1, 2, 3, 4]  # none at step 0
    assert sizes == [4] * 4 + [2] * 4
