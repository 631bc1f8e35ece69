"""``data_parallel="none"`` is refused once the world shows more than one data-parallel replica
(issue 9, fault 9): such replicas never average gradients and drift apart, silently.

``ParallelConfig`` alone does not know the world size; :meth:`ParallelConfig.check_world` runs
when the strategy computes its dims (Trainer construction). No process group needed.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from lightning.pytorch import Trainer

from lightning_mmpar import MultimodalParallelStrategy, ParallelConfig, ParallelDims


def _exact(message: str) -> str:
    return "^" + re.escape(message) + "$"


NONE_TP2_WORLD8 = (
    "data_parallel ('none') cannot run 4 data-parallel replicas (world_size 8 / "
    "(tensor_parallel 2 * pipeline_parallel 1)): their gradients would never be averaged. "
    "Set data_parallel='fsdp' or 'ddp', or run on 2 processes (devices * num_nodes)."
)


def test_none_with_replicas_is_refused() -> None:
    with pytest.raises(ValueError, match=_exact(NONE_TP2_WORLD8)):
        ParallelConfig(tensor_parallel=2, data_parallel="none").check_world(8)


def test_none_message_counts_pipeline_ranks() -> None:
    msg = (
        "data_parallel ('none') cannot run 2 data-parallel replicas (world_size 8 / "
        "(tensor_parallel 2 * pipeline_parallel 2)): their gradients would never be averaged. "
        "Set data_parallel='fsdp' or 'ddp', or run on 4 processes (devices * num_nodes)."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        ParallelConfig(tensor_parallel=2, pipeline_parallel=2, data_parallel="none").check_world(8)


@pytest.mark.parametrize(
    ("engine", "tp", "pp", "world"),
    [
        ("none", 1, 1, 1),  # one process
        ("none", 2, 2, 4),  # model parallel only: dp 1
        ("fsdp", 2, 1, 8),
        ("ddp", 1, 2, 8),
    ],
)
def test_layouts_that_pass(engine: str, tp: int, pp: int, world: int) -> None:
    cfg = ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, data_parallel=engine)  # type: ignore[arg-type]
    cfg.check_world(world)  # raises nothing


def test_world_not_divisible_is_named_as_parallel_dims_names_it() -> None:
    """One validation: ``check_world`` refuses a world the model-parallel sizes do not divide
    with ``ParallelDims``'s message (before, it left that to ``ParallelDims``)."""
    cfg = ParallelConfig(tensor_parallel=3, data_parallel="none")
    with pytest.raises(ValueError) as dims:
        ParallelDims(world_size=4, tp=3)
    with pytest.raises(ValueError, match=_exact(str(dims.value))):
        cfg.check_world(4)


def test_trainer_refuses_none_with_replicas(tmp_path: Path) -> None:
    """The strategy runs the check when Lightning builds the Trainer (``_make_dims``)."""
    msg = (
        "data_parallel ('none') cannot run 2 data-parallel replicas (world_size 4 / "
        "(tensor_parallel 2 * pipeline_parallel 1)): their gradients would never be averaged. "
        "Set data_parallel='fsdp' or 'ddp', or run on 2 processes (devices * num_nodes)."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        Trainer(
            strategy=MultimodalParallelStrategy(tensor_parallel=2, data_parallel="none"),
            accelerator="cpu",
            devices=4,
            default_root_dir=tmp_path,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
