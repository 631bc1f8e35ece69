"""PipelineTimeline (issue 11, measured bubble): the formula, the measurement on synthetic
timelines, the callback on a fake engine (one process), the PNG, and a plain Trainer without a
pipeline (warned once, nothing recorded). The real pp 2 run is in
tests/recipes/pipeline_callbacks_worker.py (the 2-rank parity-matrix world)."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_mmpar.callbacks import DynamicMicroBatching, PipelineTimeline, formula_bubble
from lightning_mmpar.callbacks.pipeline_timeline import (
    FORMULA_SOURCES,
    Interval,
    bubble_split,
    draw_timeline,
    last_pass,
    measured_bubble,
    stage_costs,
)
from lightning_mmpar.testing import quiet_trainer


def gpipe(p: int, m: int) -> list[list[Interval]]:
    """GPipe with unit forward and backward: rank r runs forward i at r + i, then, after the
    last forward, backward i at (m + p - 1) + (p - 1 - r) + i."""
    out = []
    for r in range(p):
        fwd = [(r, "forward", i, float(r + i), float(r + i + 1)) for i in range(m)]
        t = m + p - 1 + p - 1 - r
        bwd = [(r, "backward", i, float(t + i), float(t + i + 1)) for i in range(m)]
        out.append(fwd + bwd)
    return out


def test_formula_values() -> None:
    assert formula_bubble("gpipe", 2, 4) == pytest.approx(1 / 5)
    assert formula_bubble("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert formula_bubble("1f1b", 1, 8) == 0.0
    assert formula_bubble("interleaved_1f1b", 4, 8, 2) == pytest.approx(3 / 19)
    assert formula_bubble("looped_bfs", 2, 4, 2) == pytest.approx(1 / 9)
    assert formula_bubble("interleaved_zero_bubble", 2, 4, 2) == pytest.approx(1 / 25)
    # the V schedules' fill and drain: p - 1 units of a 6 m + p - 1 step
    assert formula_bubble("zbv_zero_bubble", 2, 4, 2) == pytest.approx(1 / 25)
    assert formula_bubble("dualpipev", 2, 4, 2) == pytest.approx(1 / 25)
    assert set(FORMULA_SOURCES) == {
        "gpipe",
        "1f1b",
        "interleaved_1f1b",
        "looped_bfs",
        "interleaved_zero_bubble",
        "zbv_zero_bubble",
        "dualpipev",
    }
    with pytest.raises(ValueError, match=r"schedule \('pipedream'\) is unknown; use one of gpipe"):
        formula_bubble("pipedream", 2, 4)
    with pytest.raises(ValueError, match=r"micro_batches \(0\) must be a positive integer"):
        formula_bubble("1f1b", 2, 0)


@pytest.mark.parametrize(("p", "m"), [(2, 2), (2, 4), (4, 8)])
def test_measured_equals_formula_on_ideal_gpipe(p: int, m: int) -> None:
    bubble, span = measured_bubble(gpipe(p, m))
    assert span == 2 * (m + p - 1)
    assert bubble == pytest.approx(formula_bubble("gpipe", p, m), rel=1e-12)


def test_measured_bubble_unions_overlaps_and_counts_silent_ranks() -> None:
    rank0 = [(0, "forward", 0, 0.0, 2.0), (0, "backward", 0, 1.0, 3.0)]  # busy 3 of 4
    rank1 = [(1, "forward", 0, 3.0, 4.0)]  # busy 1 of 4
    assert measured_bubble([rank0, rank1]) == (pytest.approx(0.5), 4.0)
    assert measured_bubble([rank0, rank1, []])[0] == pytest.approx(8 / 12)
    with pytest.raises(ValueError, match="at least one interval"):
        measured_bubble([[], []])


def test_last_pass_drops_the_forward_only_pass() -> None:
    cache = [(0, "forward", i, float(i), i + 0.5) for i in range(2)]
    train = [(0, "forward", 0, 3.0, 4.0), (0, "forward", 1, 4.0, 5.0), (0, "backward", 0, 5, 6)]
    assert last_pass(list(reversed(cache + train))) == train
    assert last_pass(train) == train


def test_bubble_split_charges_waits_and_host() -> None:
    rank0 = [(0, "forward", 0, 0.0, 1.0), (0, "backward", 0, 3.0, 4.0)]  # busy 2 of 4
    rank1 = [(1, "forward", 0, 1.0, 2.0), (1, "backward", 0, 2.0, 3.0)]  # busy 2 of 4
    waits0 = [(1.0, 2.5), (-1.0, -0.5), (2.0, 2.2)]  # 1.5 inside (overlap once), one before
    split = bubble_split([rank0, rank1], [waits0, [(3.5, 9.0)]])
    want0 = {"compute": 0.5, "wait": 0.375, "post": 0.0, "host": 0.125, "outside": 0.0}
    assert split["ranks"][0] == pytest.approx(want0)
    # rank 1: nothing before its first action at 1 (fill, outside), host between 3 and 3.5
    want1 = {"compute": 0.5, "wait": 0.125, "post": 0.0, "host": 0.125, "outside": 0.25}
    assert split["ranks"][1] == pytest.approx(want1)
    bubble = split["wait"] + split["host"] + split["outside"]
    assert bubble == pytest.approx(measured_bubble([rank0, rank1])[0])
    assert split["compute"] == pytest.approx(0.5) and split["wait"] == pytest.approx(0.25)


def test_bubble_split_charges_posting_apart_from_host() -> None:
    """Posting sends / receives (the engine's post observers) is its own part: outside compute
    and waits, it is taken from host; a post before the rank's first action or wait is part of
    its fill (outside), as before."""
    rank0 = [(0, "forward", 0, 0.0, 1.0), (0, "backward", 0, 3.0, 4.0)]
    rank1 = [(1, "forward", 0, 1.0, 2.0), (1, "backward", 0, 2.0, 3.0)]
    waits = [[(1.0, 2.5)], [(3.5, 9.0)]]
    posts = [[(2.5, 2.75), (0.5, 1.0), (2.25, 2.5)], [(0.5, 1.0), (3.0, 3.25)]]
    split = bubble_split([rank0, rank1], waits, posts=posts)
    want0 = {"compute": 0.5, "wait": 0.375, "post": 0.0625, "host": 0.0625, "outside": 0.0}
    assert split["ranks"][0] == pytest.approx(want0)
    want1 = {"compute": 0.5, "wait": 0.125, "post": 0.0625, "host": 0.0625, "outside": 0.25}
    assert split["ranks"][1] == pytest.approx(want1)
    parts = split["wait"] + split["post"] + split["host"] + split["outside"]
    assert parts == pytest.approx(measured_bubble([rank0, rank1])[0])
    without = bubble_split([rank0, rank1], waits)  # posting unrecorded: it is host
    assert without["ranks"][0]["host"] == pytest.approx(want0["host"] + want0["post"])


def test_earlier_pass_and_loss_are_work_not_bubble() -> None:
    """A rank still finishing a forward-only pass inside the training span, or computing the
    loss, is busy: with the whole step as ``busy`` only the true gaps are bubble."""
    rank0 = [(0, "forward", 0, 0.0, 1.0), (0, "backward", 0, 3.0, 4.0)]
    rank1 = [(1, "forward", 0, 1.0, 2.0), (1, "loss", 0, 2.0, 2.5), (1, "backward", 0, 2.5, 3.0)]
    earlier = [(1, "forward", 0, -1.0, 0.5)]  # the cache pass's tail: 0.5 inside the span
    training = [rank0, [rank1[0], rank1[2]]]
    assert measured_bubble(training)[0] == pytest.approx(4.5 / 8)
    assert measured_bubble(training, [rank0, earlier + rank1])[0] == pytest.approx(3.5 / 8)
    split = bubble_split(training, [[(1.0, 3.0)], [(0.0, 1.0)]], [rank0, earlier + rank1])
    # rank 1 is done at 3: the drain to 4 is outside its schedule, not host work
    want1 = {"compute": 0.625, "wait": 0.125, "post": 0.0, "host": 0.0, "outside": 0.25}
    assert split["ranks"][1] == pytest.approx(want1)
    assert split["ranks"][0] == pytest.approx(
        {"compute": 0.5, "wait": 0.5, "post": 0.0, "host": 0.0, "outside": 0.0}
    )


def test_stage_costs_add_the_loss_to_its_stage() -> None:
    rank0 = [(0, "forward", i, 2.0 * i, 2.0 * i + 1) for i in range(3)]
    rank1 = [(1, "forward", 0, 0.0, 2.0), (1, "loss", 0, 2.0, 2.5), (1, "backward", 0, 3.0, 7.0)]
    rank1 += [(1, "loss", -1, 8.0, 9.0)]  # the coupled loss of the whole batch: not per mb
    assert stage_costs([rank0, rank1], "1f1b") == {0: {"F": 1.0}, 1: {"F": 2.5, "B": 4.0}}
    zb = stage_costs([[(0, "backward", 0, 0.0, 3.0), (0, "forward", 0, 0.0, 1.0)]], "dualpipev")
    assert zb == {0: {"F": 1.0, "I": 3.0}}  # a whole backward in the input step is its I


class FakeEngine:
    """The engine API the callbacks read."""

    def __init__(self, schedule: str = "gpipe", pp: int = 2, m: int = 4) -> None:
        self.observers: list[Any] = []
        self.wait_observers: list[Any] = []
        self.post_observers: list[Any] = []
        self.schedule_name, self.pp, self.num_stages, self.num_micro_batches = schedule, pp, pp, m
        self.stage_ids = [0]

    def set_micro_batches(self, n: int) -> None:
        if n < self.pp:
            raise ValueError(f"micro_batches ({n}) must be >= pipeline_parallel ({self.pp})")
        self.num_micro_batches = n


class FakeModule:
    def __init__(self) -> None:
        self.logged: dict[str, float] = {}

    def log(self, name: str, value: float, **kwargs: Any) -> None:
        self.logged[name] = value


def fake_trainer(engine: Any, root: Path) -> Any:
    return SimpleNamespace(
        strategy=SimpleNamespace(pipeline=engine),
        global_step=0,
        is_global_zero=True,
        world_size=1,
        log_dir=str(root),
        default_root_dir=str(root),
    )


def test_callback_records_chosen_steps_logs_and_draws(tmp_path: Path) -> None:
    engine, module = FakeEngine(m=2), FakeModule()
    trainer = fake_trainer(engine, tmp_path)
    cb = PipelineTimeline(steps=[1])
    cb.setup(trainer, module, "fit")  # type: ignore[arg-type]
    cb.on_fit_start(trainer, module)  # type: ignore[arg-type]
    assert engine.observers == [cb._observe] and engine.wait_observers == [cb._observe_wait]
    assert engine.post_observers == [cb._observe_post]
    for step in range(3):
        trainer.global_step = step
        cb.on_train_batch_start(trainer, module, None, step)  # type: ignore[arg-type]
        for interval in gpipe(1, 2)[0]:  # this process plays pp rank 0 only
            stage, action, mb, start, end = interval
            for observer in engine.observers:
                observer(stage, action, mb, cb._t0 + start, cb._t0 + end)
        for observer in engine.wait_observers:  # a wait before the first action: outside
            observer(cb._t0 - 1.0, cb._t0)
        trainer.global_step = step + 1
        cb.on_train_batch_end(trainer, module, None, None, step)  # type: ignore[arg-type]
    assert [r["step"] for r in cb.results] == [1]
    result = cb.results[0]
    assert result["measured"] == pytest.approx(0.0) and result["micro_batches"] == 2
    assert result["formula"] == pytest.approx(1 / 3)
    assert result["split"] == {
        "compute": 1.0,
        "wait": 0.0,
        "post": 0.0,
        "host": 0.0,
        "outside": 0.0,
        "ranks": [{"compute": 1.0, "wait": 0.0, "post": 0.0, "host": 0.0, "outside": 0.0}],
    }
    assert math.isnan(result["stage_cost"])  # pp 2 but one rank's intervals: stage 1 unknown
    assert math.isnan(module.logged.pop("pipeline_bubble_stage_cost"))
    assert module.logged == {
        "pipeline_bubble_measured": result["measured"],
        "pipeline_bubble_formula": result["formula"],
        "pipeline_bubble_wait": 0.0,
        "pipeline_bubble_post": 0.0,
        "pipeline_bubble_host": 0.0,
        "pipeline_bubble_outside": 0.0,
    }
    png = tmp_path / "pipeline_timeline.png"
    assert png.stat().st_size > 1000
    assert json.loads(png.with_suffix(".json").read_text())[0]["intervals"][0][0][1] == "forward"
    cb.on_fit_end(trainer, module)  # type: ignore[arg-type]
    assert engine.observers == [] and engine.wait_observers == []
    assert engine.post_observers == []


def test_draw_timeline_interleaved(tmp_path: Path) -> None:
    per_rank = gpipe(2, 2)
    per_rank[0] += [(2, "backward_input", 0, 7.0, 8.0), (2, "backward_weight", 0, 8.0, 9.0)]
    result = {
        "schedule": "interleaved_1f1b",
        "pp": 2,
        "virtual": 2,
        "num_stages": 4,
        "micro_batches": 2,
        "step": 3,
        "measured": 0.3,
        "formula": 0.2,
        "intervals": per_rank,
    }
    out = draw_timeline(result, tmp_path / "deep" / "t.png")
    assert out is not None and out.stat().st_size > 1000


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match=r"steps \(\[-1\]\) must be non-negative integers"):
        PipelineTimeline(steps=[-1])
    with pytest.raises(ValueError, match=r"every_n_steps \(0\) must be a positive integer"):
        PipelineTimeline(every_n_steps=0)


def test_plain_trainer_warns_once_and_trains(tmp_path: Path) -> None:
    """Both pipeline callbacks in a one-device Trainer: one warning each, training unchanged."""
    timeline, micro = PipelineTimeline(steps=[0, 1]), DynamicMicroBatching(every_n_steps=1)
    torch.manual_seed(0)
    trainer = quiet_trainer(
        max_steps=2, limit_val_batches=0, callbacks=[timeline, micro], default_root_dir=tmp_path
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(BoringModel())
    said = [str(w.message) for w in caught if "runs no pipeline schedule" in str(w.message)]
    assert len(said) == 2, said
    assert trainer.global_step == 2 and timeline.results == [] and micro.decisions == []
    assert not (tmp_path / "pipeline_timeline.png").exists()
