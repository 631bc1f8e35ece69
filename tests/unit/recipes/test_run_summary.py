"""``RunSummary(caption_batches=...)``: validated at construction, and the greedy caption
accuracy measured on exactly that many validation batches (the slowest part of a short run)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from lightning_mmpar.recipes.summary import RunSummary


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True])
def test_caption_batches_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="caption_batches"):
        RunSummary(caption_batches=bad)


class _Module:
    def __init__(self) -> None:
        self.seen: list[int] = []

    def generate_accuracy(self, batches: Any) -> float:
        self.seen = list(batches)
        return 0.5


@pytest.mark.parametrize(("limit", "seen"), [(None, [0, 1, 2, 3]), (2, [0, 1]), (0, None)])
def test_caption_batches_limits_the_measurement(
    tmp_path: Path, limit: int | None, seen: list[int] | None
) -> None:
    trainer: Any = SimpleNamespace(
        datamodule=SimpleNamespace(val_dataloader=lambda: iter(range(4))),
        checkpoint_callback=None,
        logger=None,
        default_root_dir=str(tmp_path),
        global_step=3,
        world_size=1,
        is_global_zero=True,
        strategy=SimpleNamespace(),
    )
    module = _Module()
    summary = RunSummary(plots=False, caption_batches=limit)
    summary.on_fit_start(trainer, module)  # type: ignore[arg-type]
    summary.on_fit_end(trainer, module)  # type: ignore[arg-type]
    if seen is None:
        assert module.seen == []
    else:
        assert module.seen == seen


def test_skipped_steps_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Steps skipped by ``on_nonfinite="skip"`` are in the summary and its printed line."""
    trainer: Any = SimpleNamespace(
        datamodule=None,
        checkpoint_callback=None,
        logger=None,
        default_root_dir=str(tmp_path),
        global_step=3,
        world_size=1,
        is_global_zero=True,
        strategy=SimpleNamespace(nonfinite=SimpleNamespace(skipped=2)),
    )
    summary = RunSummary(plots=False)
    summary.on_fit_start(trainer, _Module())  # type: ignore[arg-type]
    summary.on_fit_end(trainer, _Module())  # type: ignore[arg-type]
    assert summary.summary["skipped_steps"] == 2
    trainer.strategy = SimpleNamespace()  # no guard (other strategies): 0
    summary.on_fit_end(trainer, _Module())  # type: ignore[arg-type]
    assert summary.summary["skipped_steps"] == 0
