"""Every invalid layout raises a ``ValueError`` naming field, value and fix; valid layouts map
ranks in Megatron order (tp fastest, then ep, then edp, then pp). No process group needed."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch import Trainer

from lightning_mmpar import MultimodalParallelStrategy, ParallelConfig, ParallelDims
from lightning_mmpar.parallel.pipeline import partition


def _exact(message: str) -> str:
    return "^" + re.escape(message) + "$"


# ---------------------------------------------------------------- ParallelDims
def test_world_not_divisible_by_model_parallel() -> None:
    msg = (
        "world_size (6) must be divisible by tensor_parallel * pipeline_parallel (2 * 2 = 4); "
        "change the number of devices to a multiple of 4 or reduce the model-parallel sizes."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        ParallelDims(world_size=6, tp=2, pp=2)


def test_expert_parallel_must_divide_data_parallel() -> None:
    msg = (
        "expert_parallel (3) must divide the data-parallel size (4 = world_size 8 / "
        "(tensor_parallel 2 * pipeline_parallel 1)); choose expert_parallel from [1, 2, 4]."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        ParallelDims(world_size=8, tp=2, ep=3)


@pytest.mark.parametrize("name", ["world_size", "tp", "pp", "ep"])
@pytest.mark.parametrize("value", [0, -2, True])
def test_dims_non_positive(name: str, value: int) -> None:
    kwargs = {"world_size": 8, name: value}
    fix = "pass the number of ranks" if name == "world_size" else "use 1 to disable it"
    msg = f"{name} ({value}) must be a positive integer; {fix}."
    with pytest.raises(ValueError, match=_exact(msg)):
        ParallelDims(**kwargs)


# ---------------------------------------------------------------- ParallelConfig
@pytest.mark.parametrize(
    "name",
    [
        "tensor_parallel",
        "pipeline_parallel",
        "expert_parallel",
        "virtual_pipeline",
        "micro_batches",
    ],
)
@pytest.mark.parametrize("value", [0, -1, True, 2.0])
def test_config_non_positive(name: str, value: Any) -> None:
    msg = f"{name} ({value!r}) must be a positive integer; use 1 to disable it."
    with pytest.raises(ValueError, match=_exact(msg)):
        ParallelConfig(**{name: value})


def test_virtual_pipeline_needs_pipeline_parallel() -> None:
    msg = (
        "virtual_pipeline (2) needs pipeline_parallel > 1 (got 1); "
        "set pipeline_parallel >= 2 or virtual_pipeline=1."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        ParallelConfig(virtual_pipeline=2, schedule="interleaved_1f1b")


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_virtual_pipeline_needs_multi_stage_schedule(schedule: str) -> None:
    msg = (
        f"virtual_pipeline (2) needs a multi-stage schedule (got {schedule!r}); set schedule to "
        "one of dualpipev, interleaved_1f1b, interleaved_zero_bubble, looped_bfs, "
        "zbv_zero_bubble or virtual_pipeline=1."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        ParallelConfig(pipeline_parallel=2, virtual_pipeline=2, schedule=schedule)  # type: ignore[arg-type]


def test_interleaved_schedule_needs_virtual_pipeline() -> None:
    msg = (
        "schedule='interleaved_1f1b' needs virtual_pipeline >= 2 (got 1); "
        "set virtual_pipeline=2 or use schedule='1f1b'."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        ParallelConfig(pipeline_parallel=2, schedule="interleaved_1f1b")


@pytest.mark.parametrize("schedule, virtual", [("1f1b", 1)])
def test_fewer_micro_batches_than_pipeline_ranks(schedule: str, virtual: int) -> None:
    msg = (
        f"micro_batches (2) must be >= pipeline_parallel (4) for the {schedule} schedule; "
        "set micro_batches to at least 4."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        ParallelConfig(
            pipeline_parallel=4,
            virtual_pipeline=virtual,
            micro_batches=2,
            schedule=schedule,  # type: ignore[arg-type]
        )


def test_gpipe_accepts_fewer_micro_batches() -> None:
    assert ParallelConfig(pipeline_parallel=4, micro_batches=2, schedule="gpipe").num_stages == 4


def test_interleaved_micro_batches_multiple_of_rounds() -> None:
    msg = (
        "micro_batches (5) must be a multiple of its rounds (2 = micro_batches // "
        "pipeline_parallel) for interleaved_1f1b; use 4."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        ParallelConfig(
            pipeline_parallel=2, virtual_pipeline=2, micro_batches=5, schedule="interleaved_1f1b"
        )


def test_unknown_schedule() -> None:
    msg = (
        "schedule ('zero_bubble') is not a known pipeline schedule; "
        "choose one of gpipe, 1f1b, interleaved_1f1b, looped_bfs, interleaved_zero_bubble, "
        "zbv_zero_bubble, dualpipev."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        ParallelConfig(schedule="zero_bubble")  # type: ignore[arg-type]


def test_unknown_data_parallel() -> None:
    msg = "data_parallel ('zero3') is not a known engine; choose one of fsdp, ddp, none."
    with pytest.raises(ValueError, match=_exact(msg)):
        ParallelConfig(data_parallel="zero3")  # type: ignore[arg-type]


# ---------------------------------------------------------------- pipeline partition
def test_too_few_blocks_for_stages() -> None:
    msg = (
        "pipeline stages (4 = pipeline_parallel * virtual_pipeline) exceed the model's pipeline "
        "blocks (3); use at most 3 stages or a deeper model."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        partition(3, 4)


def test_partition_gives_remainder_to_early_stages() -> None:
    assert partition(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert partition(4, 4) == [range(i, i + 1) for i in range(4)]


# ---------------------------------------------------------------- Trainer construction
def _trainer(strategy: Any, devices: int, root: Path) -> Trainer:
    return Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        default_root_dir=root,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def test_trainer_rejects_world_not_divisible_by_tp(tmp_path: Path) -> None:
    msg = (
        "world_size (4) must be divisible by tensor_parallel * pipeline_parallel (3 * 1 = 3); "
        "change the number of devices to a multiple of 3 or reduce the model-parallel sizes."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        _trainer(MultimodalParallelStrategy(tensor_parallel=3), 4, tmp_path)


def test_trainer_rejects_expert_parallel_not_dividing_dp(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^expert_parallel \(3\) must divide .*from \[1, 2, 4\]"):
        _trainer(MultimodalParallelStrategy(expert_parallel=3), 4, tmp_path)


def test_strategy_rejects_bad_config_at_construction() -> None:
    with pytest.raises(ValueError, match=r"^virtual_pipeline \(2\) needs pipeline_parallel > 1"):
        MultimodalParallelStrategy(virtual_pipeline=2, schedule="interleaved_1f1b")


def test_registered_string_builds_our_strategy(tmp_path: Path) -> None:
    trainer = _trainer("mm_parallel", 2, tmp_path)
    assert type(trainer.strategy) is MultimodalParallelStrategy
    dims = trainer.strategy.parallel_dims
    assert (dims.world_size, dims.tp, dims.pp, dims.ep, dims.dp) == (2, 1, 1, 1, 2)


# ---------------------------------------------------------------- rank layout by hand
def test_groups_tp2_pp2() -> None:
    dims = ParallelDims(world_size=8, tp=2, pp=2)
    assert dims.shape == (2, 2, 1, 2)
    assert dims.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.groups("edp") == dims.groups("dp")
    assert dims.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.groups("ep") == [[r] for r in range(8)]
    assert dims.rank_coords(6) == {"tp": 0, "ep": 0, "edp": 1, "pp": 1, "dp": 1}


def test_groups_tp2_ep2() -> None:
    dims = ParallelDims(world_size=8, tp=2, ep=2)
    assert (dims.dp, dims.edp, dims.shape) == (4, 2, (1, 2, 2, 2))
    assert dims.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert dims.groups("pp") == [[r] for r in range(8)]
    assert dims.rank_coords(5) == {"tp": 1, "ep": 0, "edp": 1, "pp": 0, "dp": 2}
    assert dims.rank_coords(7) == {"tp": 1, "ep": 1, "edp": 1, "pp": 0, "dp": 3}


def test_groups_match_megatron_docstring_example() -> None:
    """``initialize_model_parallel``'s docstring: 16 GPUs, tp=2, pp=4."""
    dims = ParallelDims(world_size=16, tp=2, pp=4)
    assert dims.groups("dp") == [
        [0, 2],
        [1, 3],
        [4, 6],
        [5, 7],
        [8, 10],
        [9, 11],
        [12, 14],
        [13, 15],
    ]
    assert dims.groups("tp") == [[2 * i, 2 * i + 1] for i in range(8)]
    assert dims.groups("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]


def test_every_rank_in_exactly_one_group_per_dim() -> None:
    dims = ParallelDims(world_size=16, tp=2, pp=2, ep=2)
    for name in ("tp", "pp", "dp", "ep", "edp"):
        groups = dims.groups(name)
        assert sorted(r for g in groups for r in g) == list(range(16)), name
        for rank in range(16):
            (group,) = [g for g in groups if rank in g]
            assert group.index(rank) == dims.rank_coords(rank)[name], (name, rank)


def test_unknown_dim_and_early_mesh_access() -> None:
    dims = ParallelDims(world_size=4, tp=2)
    with pytest.raises(
        KeyError, match="unknown mesh dimension 'cp'; valid names: pp, edp, ep, tp, dp"
    ):
        dims.groups("cp")
    with pytest.raises(RuntimeError, match=r"^Accessing the device mesh before processes"):
        dims.get_mesh("tp")
    with pytest.raises(RuntimeError, match=r"^Accessing the device mesh before processes"):
        _ = dims.vl_group


@pytest.mark.parametrize(
    ("partition", "match"),
    [
        ("fastest", "not a known mode"),
        ("ratio:1:1:1", "sums to 3 stages"),
        ([3, 2, 5], "increasing"),
        ([2], "1 boundaries for 4 stages"),
    ],
)
def test_bad_partition_refused_at_construction(partition: Any, match: str) -> None:
    """``partition=`` is checked with the layout (stage count pp * v) before any process starts."""
    with pytest.raises(ValueError, match=match):
        MultimodalParallelStrategy(
            pipeline_parallel=2,
            virtual_pipeline=2,
            schedule="interleaved_1f1b",
            partition=partition,
        )


def test_partition_without_pipeline_is_an_ineffective_option() -> None:
    notes = ParallelConfig(partition="balanced").ineffective_options()
    assert any("partition ('balanced') has no effect" in n for n in notes), notes
    assert ParallelConfig(pipeline_parallel=2, partition="balanced").partition_mode == "balanced"


def test_balanced_partition_needs_block_costs() -> None:
    """A module without ``pipeline_block_specs()`` gets ``equal`` / ``ratio`` / boundaries by its
    blocks' kinds; ``balanced`` is refused, naming the method to implement."""
    from torch import nn

    from lightning_mmpar.parallel.pipeline.stages import module_stage_plan

    class Blocks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(4))
            for layer, kind in zip(
                self.layers, ("vision", "aligner", "language", "head"), strict=True
            ):
                layer.kind = kind  # type: ignore[assignment]

        def pipeline_blocks(self) -> list[nn.Module]:
            return list(self.layers)

    module = Blocks()
    assert [list(r) for r in module_stage_plan(module, 2, 1, "equal").ranges] == [[0, 1], [2, 3]]
    ratio = module_stage_plan(module, 3, 1, "ratio:1:1:1").ranges
    assert [list(r) for r in ratio] == [[0], [1], [2, 3]]
    with pytest.raises(ValueError, match="pipeline_block_specs"):
        module_stage_plan(module, 2, 1, "balanced")
    # the plan places stages as the schedule runs them: V layout, last stage on rank 0
    v = module_stage_plan(module, 2, 2, "equal", schedule="zbv_zero_bubble", micro_batches=4)
    # ZB-V at pp 2, m 4: rank 0 holds 3 of stage 0 and 1 of stage 3, rank 1 2 and 2
    assert v.ranks == [0, 1, 1, 0] and v.in_flight_micro_batches == [3, 2, 2, 1]
    gpipe = module_stage_plan(module, 2, 1, "equal", schedule="gpipe", micro_batches=4)
    assert gpipe.in_flight_micro_batches == [4, 4]  # every forward before any backward
