"""The strategy's precision plugins clip by the global norm; other plugins are refused."""

from __future__ import annotations

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.precision import DoublePrecision

from lightning_mmpar import MultimodalParallelStrategy
from lightning_mmpar.precision import (
    GlobalNormClipping,
    ParallelHalfPrecision,
    ParallelMixedPrecision,
    ParallelPrecision,
)


@pytest.mark.parametrize(
    ("precision", "plugin"),
    [
        ("32-true", ParallelPrecision),
        ("bf16-mixed", ParallelMixedPrecision),
        ("bf16-true", ParallelHalfPrecision),
    ],
)
def test_lightning_plugins_become_global_norm_plugins(precision: str, plugin: type) -> None:
    trainer = Trainer(
        strategy=MultimodalParallelStrategy(), accelerator="cpu", devices=1, precision=precision
    )
    used = trainer.strategy.precision_plugin
    assert type(used) is plugin and isinstance(used, GlobalNormClipping)
    assert used.clip_fn == trainer.strategy._clip_grad_by_norm  # type: ignore[attr-defined]
    if precision == "bf16-mixed":
        assert used.precision == "bf16-mixed" and used.device == "cpu"  # type: ignore[attr-defined]


def test_clipping_with_a_local_norm_plugin_is_refused() -> None:
    trainer = Trainer(
        strategy=MultimodalParallelStrategy(),
        accelerator="cpu",
        devices=1,
        plugins=[DoublePrecision()],
        gradient_clip_val=1.0,
    )
    with pytest.raises(ValueError, match=r"gradient_clip_val \(1.0\) needs a precision plugin"):
        trainer.strategy._check_clipping(trainer)  # type: ignore[attr-defined]


def test_plugin_outside_the_strategy_says_so() -> None:
    with pytest.raises(RuntimeError, match="outside MultimodalParallelStrategy"):
        ParallelPrecision().clip_grad_by_norm(None, 1.0)  # type: ignore[arg-type]
