"""DeepSpeed JSON -> engine and strategy arguments (pure mapping, no process group)."""

from __future__ import annotations

from typing import Any

import pytest

from lightning_mmpar.parallel.deepspeed import ZERO3_NOTE, map_deepspeed_config


def test_brief_reference_json_maps_to_fsdp2_with_tp() -> None:
    plan = map_deepspeed_config(
        {
            "zero_optimization": {"stage": 3, "overlap_comm": True},
            "tensor_parallel": {"tp_size": 4},
        },
        layout={"pipeline_parallel": 2, "virtual_pipeline": 2, "schedule": "interleaved_1f1b"},
    )
    assert plan.engine == "mm_parallel" and plan.zero_stage == 3 and plan.note == ZERO3_NOTE
    assert plan.strategy_kwargs == {
        "tensor_parallel": 4,
        "pipeline_parallel": 2,
        "virtual_pipeline": 2,
        "schedule": "interleaved_1f1b",
        "data_parallel": "fsdp",
    }


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_1_2_use_deepspeeds_engine_with_the_json(stage: int) -> None:
    config = {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": 4}
    plan = map_deepspeed_config(config)
    assert plan.engine == "deepspeed" and plan.zero_stage == stage
    assert plan.strategy_kwargs == {"config": config} and plan.note is None


def test_stage_0_and_missing_section_map_to_ddp() -> None:
    for config in ({}, {"zero_optimization": {"stage": 0}}):
        plan = map_deepspeed_config(config)
        assert plan.engine == "mm_parallel"
        assert plan.strategy_kwargs == {"tensor_parallel": 1, "data_parallel": "ddp"}


def test_autotp_size_is_read_and_layout_tp_agrees() -> None:
    plan = map_deepspeed_config(
        {"zero_optimization": {"stage": 3}, "tensor_parallel": {"autotp_size": 2}},
        layout={"tensor_parallel": 2},
    )
    assert plan.strategy_kwargs["tensor_parallel"] == 2


@pytest.mark.parametrize(
    ("config", "layout", "message"),
    [
        ({"zero_optimization": {"stage": 4}}, None, r"zero_optimization.stage \(4\) is not a ZeRO"),
        ({"zero_optimization": {"stage": "3"}}, None, r"zero_optimization.stage \('3'\)"),
        (
            {"zero_optimization": {"stage": 2}, "tensor_parallel": {"tp_size": 2}},
            None,
            r"stage 2 runs on DeepSpeed's engine.*'tensor_parallel': 2.*use stage 3",
        ),
        (
            {"zero_optimization": {"stage": 1}},
            {"pipeline_parallel": 2},
            r"stage 1 runs on DeepSpeed's engine.*'pipeline_parallel': 2",
        ),
        (
            {"zero_optimization": {"stage": 3}, "tensor_parallel": {"tp_size": 4}},
            {"tensor_parallel": 2},
            r"tp_size \(4\).*contradicts the strategy's tensor_parallel \(2\)",
        ),
        ({"tensor_parallel": {"tp_size": 2, "autotp_size": 4}}, None, "disagree"),
        ({"tensor_parallel": {"tp_size": 0}}, None, r"tp_size \(0\) must be a positive integer"),
        (
            {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
            None,
            r"offload_param.device \('cpu'\) with stage 3 is not supported",
        ),
        ([1, 2], None, "must be a JSON object"),
    ],
)
def test_unknown_combinations_are_refused(
    config: Any, layout: dict[str, Any] | None, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        map_deepspeed_config(config, layout=layout)
