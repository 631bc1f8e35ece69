"""``TrainerTopology.of(trainer)``: the one accessor of a run's layout, under any strategy."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import FSDPStrategy

from lightning_mmpar import MultimodalParallelStrategy, TrainerTopology
from lightning_mmpar.topology import ParallelDims


def test_one_device_without_a_strategy() -> None:
    topology = TrainerTopology.of(SimpleNamespace(strategy=None, world_size=1))
    assert (topology.dims.pp, topology.dims.dp, topology.micro_batches) == (1, 1, 1)
    assert topology.engine is None and topology.engine_with("observers") is None
    assert topology.owns_last_stage and topology.last_stage_rank == 0
    assert topology.dp_group is None and topology.stage_groups == []
    assert not topology.lightning_fsdp
    assert topology.as_dict() == {
        "strategy": "NoneType",
        "world": 1,
        "tp": 1,
        "pp": 1,
        "dp": 1,
        "ep": 1,
        "virtual": 1,
    }


@pytest.mark.parametrize(
    ("schedule", "virtual", "last"), [("1f1b", 1, 1), ("zbv_zero_bubble", 2, 0)]
)
def test_mm_parallel_before_set_up(schedule: str, virtual: int, last: int) -> None:
    strategy = MultimodalParallelStrategy(
        pipeline_parallel=2, schedule=schedule, virtual_pipeline=virtual, micro_batches=4
    )
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)
    topology = TrainerTopology.of(trainer)
    assert topology.dims is strategy.parallel_dims
    assert topology.engine is None and topology.micro_batches == 1  # no engine before set-up
    assert topology.last_stage_rank == last  # V layout: the last stage is on pp rank 0
    assert topology.strategy_name == "mm_parallel/fsdp" and topology.virtual == virtual
    assert topology.as_dict()["pp"] == 2 and topology.as_dict()["world"] == 2


def test_the_engine_answers_once_it_exists() -> None:
    engine: Any = SimpleNamespace(last_rank=0, num_micro_batches=6, observers=[])
    trainer = SimpleNamespace(strategy=SimpleNamespace(pipeline=engine), world_size=1)
    topology = TrainerTopology.of(trainer)
    assert topology.engine is engine and topology.engine_with("observers") is engine
    assert topology.engine_with("set_micro_batches") is None
    assert topology.micro_batches == 6 and topology.last_stage_rank == 0


def test_lightning_fsdp_is_recognised() -> None:
    topology = TrainerTopology(dims=ParallelDims(world_size=1), strategy=FSDPStrategy())
    assert topology.lightning_fsdp and topology.strategy_name == "FSDPStrategy"


def test_old_accessors_warn_and_answer_the_same() -> None:
    from lightning_mmpar.recipes import parallel_env

    trainer = SimpleNamespace(strategy=None, world_size=1)
    topology = TrainerTopology.of(trainer)
    expected = {
        "dp_group": topology.dp_group,
        "owns_last_stage": topology.owns_last_stage,
        "pipeline_parallel": topology.dims.pp,
        "layout": topology.as_dict(),
    }
    for name, value in expected.items():
        with pytest.warns(DeprecationWarning, match=f"parallel_env.{name}"):
            old = getattr(parallel_env, name)
        assert old(trainer) == value
    with pytest.raises(AttributeError):
        parallel_env.no_such_name  # noqa: B018


@pytest.mark.parametrize(
    ("old", "name", "new"),
    [
        ("lightning_mmpar.parallel", "ShardedCheckpointHooks", "lightning_mmpar.strategy"),
        (
            "lightning_mmpar.parallel.checkpoint_hooks",
            "ShardedCheckpointHooks",
            "lightning_mmpar.strategy",
        ),
        (
            "lightning_mmpar.parallel.stash",
            "GradientStash",
            "lightning_mmpar.strategy.gradient_stash",
        ),
        ("lightning_mmpar.parallel.data", "shard_experts", "lightning_mmpar.parallel.expert_data"),
        (
            "lightning_mmpar.parallel.data",
            "update_expert_biases",
            "lightning_mmpar.parallel.moe_state",
        ),
    ],
)
def test_moved_names_keep_their_old_path_for_a_release(old: str, name: str, new: str) -> None:
    import importlib

    with pytest.warns(DeprecationWarning, match=f"{name} moved to"):
        moved = getattr(importlib.import_module(old), name)
    assert moved is getattr(importlib.import_module(new), name)
