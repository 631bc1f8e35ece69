"""DeepSpeed JSON -> engine and strategy arguments (pure mapping, no process group)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from lightning_mmpar.parallel.deepspeed_mapping import (
    ZERO3_NOTE,
    map_deepspeed_config,
    resolve_batch,
)
from lightning_mmpar.recipes.deepspeed_cli import optim_from_deepspeed

YAML = str(Path(__file__).resolve().parents[3] / "recipes" / "clip_llama_cpu.yaml")


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


# ---------------------------------------------------------------- issue 15 item 8: no key dropped
def test_training_keys_map_to_trainer_and_batch() -> None:
    config = {
        "train_batch_size": 64,
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 4,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3},
    }
    plan = map_deepspeed_config(config, layout={"tensor_parallel": 2}, world_size=4)  # dp 2
    assert plan.trainer_kwargs == {
        "accumulate_grad_batches": 4,
        "gradient_clip_val": 1.0,
        "precision": "bf16-mixed",
    }
    assert plan.batch_size == 8 and plan.unmapped == []
    assert map_deepspeed_config({"fp16": {"enabled": True}}).trainer_kwargs == {
        "precision": "16-mixed"
    }
    off = map_deepspeed_config({"bf16": {"enabled": False}})
    assert off.trainer_kwargs == {"precision": "32-true"}


def test_train_batch_size_rule_is_deepspeeds() -> None:
    assert resolve_batch({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2) == (4, 4)
    assert resolve_batch({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 2) == (8, 2)
    assert resolve_batch({"train_batch_size": 32}, 2, accumulation=4) == (4, None)
    assert resolve_batch({"train_batch_size": 32}, None) == (None, None)
    with pytest.raises(
        ValueError,
        match=r"train_batch_size \(30\) != .*\(4\) \* .*\(2\) \* .*"
        r"\(2\) = 16",
    ):
        resolve_batch(
            {
                "train_batch_size": 30,
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 2,
            },
            2,
        )
    with pytest.raises(ValueError, match=r"train_batch_size \(30\) must be a multiple"):
        resolve_batch({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, 2)
    with pytest.raises(ValueError, match=r"fp16.enabled and bf16.enabled are both true"):
        map_deepspeed_config({"fp16": {"enabled": True}, "bf16": {"enabled": True}})


def test_misspelled_keys_are_named_with_the_closest_and_keep_the_layouts_engine() -> None:
    for config, wrong, right in (
        ({"zero_optimisation": {"stage": 2}}, "zero_optimisation", "zero_optimization"),
        ({"zero_optimization": {"stgae": 2}}, "zero_optimization.stgae", "stage"),
    ):
        plan = map_deepspeed_config(config, layout={"data_parallel": "fsdp"})
        assert plan.zero_stage is None and plan.strategy_kwargs["data_parallel"] == "fsdp"
        assert f"unknown DeepSpeed key {wrong!r}; did you mean {right!r}?" in plan.unmapped
    plan = map_deepspeed_config(
        {
            "steps_per_print": 10,
            "zero_optimization": {"stage": 3, "overlap_comm": True},
            "fp16": {"enabled": False, "loss_scale": 0},
        }
    )
    assert plan.unmapped == [
        "'steps_per_print' has no counterpart under mm_parallel and is ignored",
        "'zero_optimization.overlap_comm' is DeepSpeed's own; mm_parallel (FSDP2/DDP) ignores it",
        "'fp16.loss_scale' has no counterpart under mm_parallel",
    ]


def test_zero_2_drops_what_lightning_refuses_and_maps_it_to_the_trainer() -> None:
    config = {
        "zero_optimization": {"stage": 2},
        "gradient_accumulation_steps": 2,
        "train_batch_size": 16,
        "steps_per_print": 5,
    }
    plan = map_deepspeed_config(config, world_size=2)
    assert plan.engine == "deepspeed" and plan.unmapped == []
    assert plan.trainer_kwargs == {"accumulate_grad_batches": 2} and plan.batch_size == 4
    assert plan.strategy_kwargs["config"] == {
        "zero_optimization": {"stage": 2},
        "train_batch_size": 16,
        "steps_per_print": 5,
        "train_micro_batch_size_per_gpu": 4,
    }


def test_optimizer_and_scheduler_map_to_model_optim() -> None:
    optim, notes = optim_from_deepspeed(
        {
            "optimizer": {
                "type": "AdamW",
                "params": {"lr": 2e-4, "weight_decay": 0.1, "betas": [0.9, 0.95], "eps": 1e-8},
            },
            "scheduler": {
                "type": "WarmupCosineLR",
                "params": {"warmup_num_steps": 5, "cos_min_ratio": 0.05, "total_num_steps": 100},
            },
        }
    )
    assert optim == {"lr": 2e-4, "weight_decay": 0.1, "warmup_steps": 5, "min_lr_ratio": 0.05}
    assert notes[0].startswith("'optimizer.params.betas' ([0.9, 0.95])")
    assert notes[1].startswith("'scheduler.params.total_num_steps'") and len(notes) == 2
    _, notes = optim_from_deepspeed(
        {"optimizer": {"type": "Lamb"}, "scheduler": {"type": "OneCycle"}}
    )
    assert "'Lamb'" in notes[0] and "'OneCycle'" in notes[1]


def test_cli_applies_the_json_and_strict_refuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from lightning.pytorch import Trainer

    from lightning_mmpar.recipes.cli import run_cli

    monkeypatch.setattr(Trainer, "fit", lambda *a, **k: None)
    ds = tmp_path / "ds.json"
    ds.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": 36,
                "gradient_accumulation_steps": 2,
                "gradient_clipping": 0.5,
                "bf16": {"enabled": True},
                "optimizer": {"type": "AdamW", "params": {"lr": 0.002}},
                "zero_optimisation": {},
            }
        )
    )
    args = [
        "fit",
        "--config",
        YAML,
        "--trainer.accumulate_grad_batches",
        "3",
        "--deepspeed",
        str(ds),
    ]
    with caplog.at_level(logging.INFO), pytest.warns(UserWarning, match="did you mean 'zero_opt"):
        cli = run_cli(args)
    t = cli.trainer
    # the YAML is pp 2: as in DeepSpeed's PipelineEngine, one step is one pipeline flush of
    # gradient_accumulation_steps (2) micro-batches of train_micro_batch_size_per_gpu (36)
    # samples, nothing accumulated on top (it was 2 micro-batches of 18, two flushes a step)
    assert (t.accumulate_grad_batches, t.gradient_clip_val, t.precision) == (1, 0.5, "bf16-mixed")
    assert t.strategy.config.micro_batches == 2 and t.strategy.config.num_micro_batches == 2
    assert cli.datamodule.batch_size == 72 and cli.model.optim.lr == 0.002
    assert t.strategy.config.data_parallel == "fsdp"  # the YAML's: the JSON gives no stage
    assert "timeout" in cli.config["fit"]["trainer"]["strategy"]["init_args"]  # YAML's kept
    assert (
        "gradient_accumulation_steps 2 = the pipeline's micro-batches (1) replaces "
        "trainer.accumulate_grad_batches (3)" in caplog.text
    )
    assert "a step runs 2 micro-batches of 36 samples per data-parallel rank" in caplog.text
    with pytest.raises(ValueError, match=r"--deepspeed_strict.*'zero_optimisation'; did you mean"):
        run_cli([*args, "--deepspeed_strict", "true"])


# ------------------------------------------------------- issue 31: DeepSpeed's meaning under pp
def test_pipeline_micro_batch_is_deepspeeds_and_a_zero_stage_sharding_nothing_is_said() -> None:
    """Under pipeline parallelism, as in DeepSpeed's PipelineEngine: a micro-batch holds
    ``train_micro_batch_size_per_gpu`` samples and a step flushes ``gradient_accumulation_steps``
    micro-batches once (before: micro 24 became 2 micro-batches of 12, two flushes a step)."""
    config = {
        "train_micro_batch_size_per_gpu": 24,
        "gradient_accumulation_steps": 3,
        "train_batch_size": 144,
        "zero_optimization": {"stage": 3},
    }
    layout = {"tensor_parallel": 2, "pipeline_parallel": 2, "micro_batches": 2}
    plan = map_deepspeed_config(config, layout=layout, world_size=8)  # dp 2: 24 x 3 x 2 = 144
    assert plan.batch_size == 72 and plan.strategy_kwargs["micro_batches"] == 3
    assert plan.trainer_kwargs == {"accumulate_grad_batches": 1}
    assert plan.info == [
        "pipeline parallelism (pp 2): a step runs 3 micro-batches of 24 samples per "
        "data-parallel rank and one pipeline flush, as DeepSpeed's PipelineEngine does "
        "(train_micro_batch_size_per_gpu = the micro-batch, gradient_accumulation_steps = the "
        "micro-batches per step): micro_batches=3, accumulate_grad_batches=1, batch_size=72"
    ]
    # without the steps: the layout's micro-batches (here the default, pp) hold 24 each
    plan = map_deepspeed_config(
        {"train_micro_batch_size_per_gpu": 24}, layout=layout | {"micro_batches": None}
    )
    assert plan.batch_size == 48 and plan.strategy_kwargs["micro_batches"] is None
    assert "accumulate_grad_batches" not in plan.trainer_kwargs
    # pp 1 keeps Lightning's accumulation
    plan = map_deepspeed_config(config, layout={"tensor_parallel": 2}, world_size=4)
    assert (plan.batch_size, plan.trainer_kwargs["accumulate_grad_batches"]) == (24, 3)
    # a ZeRO stage over a data-parallel size of 1 shards nothing: said, once
    for stage, layout, world in (
        (3, {"tensor_parallel": 2, "pipeline_parallel": 2}, 4),
        (1, {}, 1),
    ):
        plan = map_deepspeed_config(
            {"zero_optimization": {"stage": stage}}, layout=layout, world_size=world
        )
        said = [line for line in plan.info if "shards nothing" in line]
        assert len(said) == 1 and f"zero_optimization.stage {stage} shards nothing here" in said[0]
    plan = map_deepspeed_config({"zero_optimization": {"stage": 3}}, world_size=2)
    assert plan.info == []
