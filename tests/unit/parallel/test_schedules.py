"""Issue 11: every torch pipeline schedule by name, its constraints, stage layouts and ranges.

No process group: the layout arithmetic, the constraint errors of every schedule (raised at
``ParallelConfig`` construction), explicit ``stage_ranges`` validation, the engine's stage ->
rank mapping on a one-rank group, ``set_micro_batches`` validation and the stage-action
observers on a stand-in stage. The schedules' gradients are checked on real gloo worlds by
``tests/recipes`` (engine checks in the recipe-fault world, the fusion model's parity matrix).
"""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_mmpar import config
from lightning_mmpar.config import ParallelConfig
from lightning_mmpar.layout import schedules as facts
from lightning_mmpar.layout.schedules import (
    MULTI_STAGE_SCHEDULES,
    SCHEDULES,
    V_SCHEDULES,
    min_micro_batches,
)
from lightning_mmpar.parallel.pipeline import PipelineEngine
from lightning_mmpar.parallel.pipeline.schedules import (
    SCHEDULE_CLASSES,
    check_stage_ranges,
    instrument_stage,
    observing_waits,
    stage_ranks,
)


def _exact(message: str) -> str:
    return "^" + re.escape(message) + "$"


def _config(schedule: str, pp: int = 2, **kwargs: Any) -> ParallelConfig:
    v = 2 if schedule in MULTI_STAGE_SCHEDULES else 1
    return ParallelConfig(
        pipeline_parallel=pp,
        virtual_pipeline=kwargs.pop("virtual_pipeline", v),
        schedule=schedule,
        **kwargs,  # type: ignore[arg-type]
    )


def test_config_keeps_the_schedule_names_of_the_facts_module() -> None:
    """``lightning_mmpar.config`` re-exports the facts' names (one home: layout/schedules.py)."""
    for name in (
        "SCHEDULES",
        "MULTI_STAGE_SCHEDULES",
        "V_SCHEDULES",
        "SPLIT_BACKWARD_SCHEDULES",
        "ROUND_SCHEDULES",
        "Schedule",
        "min_micro_batches",
        "stage_layout",
    ):
        assert getattr(config, name) is getattr(facts, name), name
    assert list(SCHEDULE_CLASSES) == list(SCHEDULES)


def test_every_schedule_is_a_torch_class() -> None:
    from torch.distributed import pipelining

    assert set(SCHEDULE_CLASSES) == set(SCHEDULES)
    assert all(hasattr(pipelining, cls) for cls in SCHEDULE_CLASSES.values())


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_default_micro_batches_meet_the_minimum(schedule: str) -> None:
    for pp in (2, 4):
        config = _config(schedule, pp)
        low = min_micro_batches(schedule, pp, config.virtual_pipeline)
        assert config.num_micro_batches == max(pp, low)
        assert config.num_stages == pp * config.virtual_pipeline


@pytest.mark.parametrize("schedule", sorted(MULTI_STAGE_SCHEDULES))
def test_multi_stage_schedule_needs_virtual_pipeline(schedule: str) -> None:
    msg = (
        f"schedule={schedule!r} needs virtual_pipeline >= 2 (got 1); "
        "set virtual_pipeline=2 or use schedule='1f1b'."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        _config(schedule, virtual_pipeline=1)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_single_stage_schedule_refuses_virtual_pipeline(schedule: str) -> None:
    msg = (
        f"virtual_pipeline (2) needs a multi-stage schedule (got {schedule!r}); set schedule to "
        f"one of {', '.join(sorted(MULTI_STAGE_SCHEDULES))} or virtual_pipeline=1."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        _config(schedule, virtual_pipeline=2)


@pytest.mark.parametrize("schedule", sorted(V_SCHEDULES))
def test_v_schedule_needs_exactly_two_stages_per_rank(schedule: str) -> None:
    msg = (
        f"schedule={schedule!r} needs virtual_pipeline=2 (got 3): its V stage order holds exactly "
        "two stages per pipeline rank; set virtual_pipeline=2."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        _config(schedule, virtual_pipeline=3, micro_batches=8)
    assert _config(schedule).virtual_pipeline == 2


@pytest.mark.parametrize(
    "schedule, pp, n, what",
    [
        ("1f1b", 4, 3, "pipeline_parallel (4)"),
        ("dualpipev", 2, 3, "the pipeline stages (4 = pipeline_parallel * virtual_pipeline)"),
        ("dualpipev", 4, 7, "the pipeline stages (8 = pipeline_parallel * virtual_pipeline)"),
    ],
)
def test_micro_batch_minimum(schedule: str, pp: int, n: int, what: str) -> None:
    low = min_micro_batches(schedule, pp, 2)
    msg = (
        f"micro_batches ({n}) must be >= {what} for the {schedule} schedule; "
        f"set micro_batches to at least {low}."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        _config(schedule, pp, micro_batches=n)
    assert _config(schedule, pp, micro_batches=low).num_micro_batches == low


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "interleaved_zero_bubble"])
def test_rounds_schedules_need_a_multiple_of_rounds(schedule: str) -> None:
    msg = (
        "micro_batches (5) must be a multiple of its rounds (2 = micro_batches // "
        f"pipeline_parallel) for {schedule}; use 4."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        _config(schedule, micro_batches=5)


@pytest.mark.parametrize(
    "schedule",
    ["gpipe", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble"],
)
def test_schedules_without_a_minimum_take_one_micro_batch(schedule: str) -> None:
    assert _config(schedule, 4, micro_batches=1).num_micro_batches == 1


@pytest.mark.parametrize("schedule", ["interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev"])
def test_zero_bubble_refuses_fsdp_replicas(schedule: str) -> None:
    msg = (
        f"schedule={schedule!r} cannot run with data_parallel='fsdp' over 2 data-parallel "
        "replicas on this torch: its split weight-gradient backward bypasses FSDP2's per-block "
        "gradient reduce-scatter (measured: wrong gradients at dp 2 x pp 2). Set "
        "data_parallel='ddp', or choose schedule='interleaved_1f1b' or 'looped_bfs'."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        _config(schedule).check_world(4)
    _config(schedule).check_world(2)  # one replica: nothing to reduce
    _config(schedule, data_parallel="ddp").check_world(4)
    _config("looped_bfs").check_world(4)


def test_stage_layouts() -> None:
    assert stage_ranks("interleaved_1f1b", 8, 4) == [0, 1, 2, 3, 0, 1, 2, 3]
    assert stage_ranks("1f1b", 2, 2) == [0, 1]
    for schedule in sorted(V_SCHEDULES):  # rank r: stages r and 2pp - 1 - r; last on rank 0
        assert stage_ranks(schedule, 4, 2) == [0, 1, 1, 0]
        assert stage_ranks(schedule, 8, 4) == [0, 1, 2, 3, 3, 2, 1, 0]
    with pytest.raises(ValueError, match=r"^schedule='dualpipev' needs 2 stages per pipeline"):
        stage_ranks("dualpipev", 6, 2)


@pytest.mark.parametrize(
    "ranges, msg",
    [
        ([range(0, 2)], "stage_ranges has 1 ranges but the pipeline has 2 stages"),
        ([range(0, 2), range(3, 5)], "stage_ranges[1] (range(3, 5)) must be a non-empty"),
        ([range(0, 0), range(0, 5)], "stage_ranges[0] (range(0, 0)) must be a non-empty"),
        ([range(1, 2), range(2, 5)], "stage_ranges[0] (range(1, 2)) must be a non-empty"),
        ([range(0, 2), range(2, 5, 2)], "stage_ranges[1] (range(2, 5, 2)) must be a non-empty"),
        ([range(0, 2), range(2, 4)], "stage_ranges end at block 4 but the model has 5 pipeline"),
        ([[0, 1], range(2, 5)], "stage_ranges[0] ([0, 1]) must be a non-empty"),
    ],
)
def test_stage_ranges_are_validated(ranges: list[Any], msg: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(msg)) as err:
        check_stage_ranges(ranges, 2, 5)
    assert "pass 2 contiguous non-empty ranges covering blocks 0..4 in order" in str(err.value)
    assert check_stage_ranges([range(0, 1), range(1, 5)], 2, 5) == [range(0, 1), range(1, 5)]


class Toy(nn.Module):
    """Five linear blocks (a :class:`PipelineModule`)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(5)])

    def pipeline_blocks(self) -> list[nn.Module]:
        return list(self.blocks)

    def pipeline_inputs(self, batch: Any) -> tuple[tuple[Tensor, ...], Tensor]:
        return (batch[0],), batch[1]

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return ((output - target) ** 2).mean()


def _engine(schedule: str = "1f1b", **kwargs: Any) -> PipelineEngine:
    """An engine on a one-rank group (``pp_group=None``: it holds every stage)."""
    config = ParallelConfig(pipeline_parallel=2, schedule=schedule, micro_batches=2)  # type: ignore[arg-type]
    return PipelineEngine(Toy(), config, None, torch.device("cpu"), **kwargs)  # type: ignore[arg-type]


def test_engine_stage_ranges_and_mapping() -> None:
    engine = _engine(stage_ranges=[range(0, 4), range(4, 5)])
    assert [len(c.blocks) for c in engine.chunks] == [4, 1]
    assert engine.stage_ids == [0, 1] and engine.stage_rank(1) == 0 and engine.last_rank == 0
    assert (engine.pp, engine.num_stages, engine.schedule_name) == (1, 2, "1f1b")
    assert [len(c.blocks) for c in _engine().chunks] == [3, 2]  # None: the equal split
    with pytest.raises(ValueError, match=r"^stage_ranges\[1\] \(range\(3, 5\)\)"):
        _engine(stage_ranges=[range(0, 2), range(3, 5)])


def test_set_micro_batches_validates() -> None:
    engine = _engine()
    engine.set_micro_batches(4)
    assert engine.num_micro_batches == 4 and engine.config.micro_batches == 4
    with pytest.raises(ValueError, match=r"^micro_batches \(0\) must be a positive integer"):
        engine.set_micro_batches(0)
    with pytest.raises(ValueError, match=r"^micro_batches \(1\) must be >= pipeline_parallel"):
        engine.set_micro_batches(1)
    assert engine.num_micro_batches == 4  # a refused value changes nothing
    with pytest.raises(ValueError, match=r"^batch size \(6\) must be divisible by micro_batches"):
        engine.config.check_batch_size(6, name="batch size")


def test_observers_time_every_action_only_when_present() -> None:
    calls: list[tuple[str, Any]] = []
    stage = SimpleNamespace(
        stage_index=3,
        forward_one_chunk=lambda i, args, kwargs=None, save_forward_output=True: calls.append(
            ("f", i)
        ),
        backward_one_chunk=lambda i, loss=None, full_backward=True, last_backward=False: (
            calls.append(("b", full_backward))
        ),
        backward_weight_one_chunk=lambda i, last_backward=False: calls.append(("w", i)),
    )
    observers: list[Any] = []
    instrument_stage(stage, observers)
    stage.forward_one_chunk(0, ())
    seen: list[tuple[Any, ...]] = []
    observers.append(lambda *event: seen.append(event))
    stage.forward_one_chunk(1, (), None, save_forward_output=False)
    stage.backward_one_chunk(1, loss=None, full_backward=True, last_backward=False)
    stage.backward_one_chunk(2, loss=None, full_backward=False, last_backward=False)
    stage.backward_weight_one_chunk(2, last_backward=True)
    assert calls == [("f", 0), ("f", 1), ("b", True), ("b", False), ("w", 2)]
    actions = [(s, a, m) for s, a, m, _, _ in seen]
    assert actions == [
        (3, "forward", 1),
        (3, "backward", 1),
        (3, "backward_input", 2),
        (3, "backward_weight", 2),
    ]
    assert all(start <= end for *_, start, end in seen)


def test_wait_observers_time_torchs_p2p_waits_inside_the_block_only() -> None:
    from torch.distributed.pipelining import schedules as ts

    waited: list[Any] = []

    class Work:
        def wait(self) -> None:
            waited.append(self)

    seen: list[tuple[float, float]] = []
    observers: list[Any] = [lambda start, end: seen.append((start, end))]
    with observing_waits([]):  # nothing to time: nothing wrapped or timed
        ts._wait_batch_p2p([Work()])
    with observing_waits(observers):
        ts._wait_batch_p2p([Work(), Work()])
        with observing_waits(observers):  # nested: each active list is told once
            ts._wait_batch_p2p([Work()])
    ts._wait_batch_p2p([Work()])  # outside: not timed
    assert len(waited) == 5
    assert len(seen) == 3 and all(start <= end for start, end in seen)


@pytest.mark.parametrize(
    "old, new",
    [
        (
            "lightning_mmpar.parallel.pipeline_schedules",
            "lightning_mmpar.parallel.pipeline.schedules",
        ),
        ("lightning_mmpar.parallel.pipeline_steps", "lightning_mmpar.parallel.pipeline.steps"),
    ],
)
def test_old_pipeline_module_paths_warn(old: str, new: str) -> None:
    """The modules moved into ``parallel/pipeline/`` keep their old paths one release."""
    import importlib
    import sys

    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=re.escape(f"{old} moved to {new}")):
        module = importlib.import_module(old)
    target = importlib.import_module(new)
    assert all(getattr(module, name) is getattr(target, name) for name in module.__all__)


def test_in_flight_micro_batches_is_deprecated_for_the_facts() -> None:
    from lightning_mmpar.layout.schedules import in_flight
    from lightning_mmpar.parallel.pipeline.schedules import in_flight_micro_batches

    ranks = stage_ranks("interleaved_1f1b", 8, 4)
    with pytest.warns(DeprecationWarning, match="lightning_mmpar.layout.schedules.in_flight"):
        got = in_flight_micro_batches("interleaved_1f1b", ranks, 4, 8)
    assert got == in_flight("interleaved_1f1b", 4, 2, 8)
