"""Megatron-LM flags on the recipe CLI: the mapping (pure), then the CLI in this process (the
Trainer's ``fit`` stubbed: no process starts), with a DeepSpeed JSON that must agree."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from lightning_mmpar.recipes.megatron_cli import MegatronFlags, map_megatron_flags

YAML = str(Path(__file__).resolve().parents[3] / "recipes" / "clip_llama_cpu.yaml")


def _values(flags: MegatronFlags, **kwargs: object) -> dict[str, object]:
    out: dict[str, object] = {}
    for mapping in map_megatron_flags(flags, **kwargs):  # type: ignore[arg-type]
        out |= mapping.values
    return out


def test_sizes_and_virtual_stages_are_megatrons() -> None:
    flags = MegatronFlags(
        tensor_model_parallel_size=4,
        pipeline_model_parallel_size=2,
        expert_model_parallel_size=2,
        num_layers_per_virtual_pipeline_stage=2,
        sequence_parallel=True,
    )
    mappings = map_megatron_flags(flags, layout={"schedule": "1f1b"}, num_layers=32)
    assert [m.flag for m in mappings] == [
        "--tensor-model-parallel-size 4",
        "--pipeline-model-parallel-size 2",
        "--expert-model-parallel-size 2",
        "--num-layers-per-virtual-pipeline-stage 2",
        "--sequence-parallel",
    ]
    # Megatron-LM: virtual_pipeline_model_parallel_size = (32 / pp 2) / 2 = 8, interleaved
    assert mappings[3].values == {"virtual_pipeline": 8, "schedule": "interleaved_1f1b"}
    assert mappings[3].how == "32 decoder layers / (pp 2 x 2)"
    assert mappings[4].values == {"sequence_parallel": True}
    # v = 2 keeps a V schedule; v = 1 takes an interleaved schedule back to 1F1B
    layout = {"pipeline_parallel": 2, "schedule": "zbv_zero_bubble"}
    vpp = MegatronFlags(num_layers_per_virtual_pipeline_stage=4)
    assert _values(vpp, layout=layout, num_layers=16) == {"virtual_pipeline": 2}
    layout["schedule"] = "interleaved_1f1b"
    assert _values(vpp, layout=layout, num_layers=8) == {"virtual_pipeline": 1, "schedule": "1f1b"}
    # pp 1 resets the pipeline's options
    pp1 = MegatronFlags(pipeline_model_parallel_size=1)
    layout = {"pipeline_parallel": 2, "micro_batches": 2, "schedule": "gpipe"}
    assert _values(pp1, layout=layout) == {
        "pipeline_parallel": 1,
        "micro_batches": None,
        "schedule": "1f1b",
    }


@pytest.mark.parametrize(
    ("flags", "layout", "message"),
    [
        (
            {"num_layers_per_virtual_pipeline_stage": 3},
            {"pipeline_parallel": 2},
            r"--num-layers-per-virtual-pipeline-stage 3: the decoder's 32 layers .* give 16 "
            r"layers per pipeline rank, not a multiple of 3 .*divisor of 16: \[1, 2, 4, 8, 16\]",
        ),
        (
            {"num_layers_per_virtual_pipeline_stage": 2},
            {"pipeline_parallel": 3},
            r"give 10.6667 layers per pipeline rank",
        ),
        (
            {"num_layers_per_virtual_pipeline_stage": 2},
            {},
            r"needs pipeline parallelism \(pipeline_parallel is 1\)",
        ),
        ({"tensor_model_parallel_size": 0}, {}, r"--tensor-model-parallel-size \(0\) must be"),
        (
            {"micro_batch_size": 4, "global_batch_size": 60},
            {"tensor_parallel": 2},
            r"--global-batch-size \(60\) must be a multiple of --micro-batch-size \(4\) x "
            r"data-parallel size \(2\) = 8",
        ),
        (
            {"global_batch_size": 62},
            {"pipeline_parallel": 2},
            r"--global-batch-size 62: not a multiple of 2 micro-batches x data-parallel size 2",
        ),
    ],
)
def test_refusals_name_the_flag_and_the_fix(
    flags: dict[str, int], layout: dict[str, int], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        map_megatron_flags(MegatronFlags(**flags), layout=layout, world_size=4, num_layers=32)
    with pytest.raises(ValueError, match=r"the data-parallel size is unknown"):
        map_megatron_flags(MegatronFlags(global_batch_size=8), layout={}, world_size=None)


def test_batch_flags_are_micro_times_dp_times_micro_batches() -> None:
    both = MegatronFlags(micro_batch_size=4, global_batch_size=64)
    # pp 2 on 8 processes at tp 2: dp 2, 64 / (4 x 2) = 8 pipeline micro-batches per step
    layout = {"tensor_parallel": 2, "pipeline_parallel": 2, "micro_batches": 2}
    (mapping,) = map_megatron_flags(both, layout=layout, world_size=8)
    assert mapping.values == {"batch_size": 32, "micro_batches": 8, "accumulate_grad_batches": 1}
    assert mapping.how == "8 micro-batches of 4 per step on each data-parallel rank (dp 2)"
    # no pipeline: the 8 micro-batches are accumulated batches of 4
    values = _values(both, layout={"tensor_parallel": 4}, world_size=8, accumulation=3)
    assert values == {"batch_size": 4, "accumulate_grad_batches": 8}
    # one flag alone keeps the micro-batches configured: the pipeline's (default pp), or the
    # Trainer's accumulation
    micro = MegatronFlags(micro_batch_size=6)
    assert _values(micro, layout={"pipeline_parallel": 2}) == {"batch_size": 12}
    assert _values(micro, layout={}, accumulation=3) == {"batch_size": 6}
    glob = MegatronFlags(global_batch_size=48)
    assert _values(glob, layout={"pipeline_parallel": 2, "micro_batches": 3}, world_size=4) == {
        "batch_size": 24,
        "micro_batches": 3,
        "accumulate_grad_batches": 1,
    }


def test_apply_reads_the_layers_and_refuses_another_strategy(tmp_path: Path) -> None:
    """The virtual stages count a pretrained decoder's layers (its ``config.json``); a size flag
    with a strategy other than ``mm_parallel`` is refused; no strategy becomes ``mm_parallel``."""
    from jsonargparse import Namespace

    from lightning_mmpar.recipes.megatron_cli import apply_megatron_flags

    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 24}))
    cfg = Namespace(
        trainer=Namespace(strategy="auto", devices=4, accelerator="cpu"),
        model=Namespace(pretrained=Namespace(language=str(tmp_path))),
        pipeline_model_parallel_size=2,
        num_layers_per_virtual_pipeline_stage=3,
    )
    lines, keys = apply_megatron_flags(cfg)
    args = cfg["trainer.strategy.init_args"]
    assert (args.pipeline_parallel, args.virtual_pipeline, args.schedule) == (
        2,
        4,
        "interleaved_1f1b",
    )
    assert lines[0].startswith("--pipeline-model-parallel-size 2 -> trainer.strategy ('auto') ->")
    assert lines[1].endswith("(24 decoder layers / (pp 2 x 3))")
    assert keys["trainer.strategy.init_args.virtual_pipeline"].startswith("--num-layers-per")
    cfg["trainer.strategy"] = "ddp"
    with pytest.raises(ValueError, match=r"--pipeline-model-parallel-size 2 sets arguments of "):
        apply_megatron_flags(cfg)


def test_cli_maps_the_flags_once_and_a_json_must_agree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from lightning.pytorch import Trainer

    from lightning_mmpar.recipes.cli import run_cli

    monkeypatch.setattr(Trainer, "fit", lambda *a, **k: None)
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 0}, "train_batch_size": 144}))
    args = [
        "fit",
        "--config",
        YAML,  # tp 2 x pp 2, FSDP2, 4 processes
        "--trainer.strategy.init_args.micro_batches",  # 2 micro-batches (the YAML's default)
        "2",
        "--tensor-model-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "1",
        "--micro-batch-size",
        "36",
        "--global-batch-size",
        "144",
        "--sequence-parallel",
        "--data.max_length",  # the text tp 2 shards along the sequence
        "10",
        "--deepspeed",
        "--deepspeed_config",
        str(ds),
    ]
    with caplog.at_level(logging.INFO):
        cli = run_cli(args)
    config, trainer = cli.trainer.strategy.config, cli.trainer
    assert (config.tensor_parallel, config.pipeline_parallel, config.micro_batches) == (2, 1, None)
    assert config.data_parallel == "ddp"  # ZeRO stage 0, said below
    assert cli.datamodule.batch_size == 36 and trainer.accumulate_grad_batches == 2
    assert cli.model.plan_options.sequence_parallel is True
    lines = [r.getMessage() for r in caplog.records if "[lightning_mmpar]" in r.getMessage()]
    assert lines == [
        "[lightning_mmpar] --tensor-model-parallel-size 2 -> "
        "trainer.strategy.init_args.tensor_parallel=2",
        "[lightning_mmpar] --pipeline-model-parallel-size 1 -> "
        "trainer.strategy.init_args.pipeline_parallel=1 (was 2), "
        "trainer.strategy.init_args.micro_batches=None (was 2)",
        "[lightning_mmpar] --sequence-parallel -> model.plan.sequence_parallel=True (was False)",
        "[lightning_mmpar] --micro-batch-size 36 --global-batch-size 144 -> "
        "data.init_args.batch_size=36 (was 72), trainer.accumulate_grad_batches=2 (was 1) "
        "(2 accumulated batch(es) of 36 per step on each data-parallel rank (dp 2))",
        "[lightning_mmpar] DeepSpeed JSON zero_optimization.stage 0 ('ddp') replaces "
        "trainer.strategy.init_args.data_parallel ('fsdp')",
    ]
    # a JSON that gives another batch than the flags: refused, naming both
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 18}))
    with pytest.raises(ValueError, match=r"--micro-batch-size 36 --global-batch-size 144 sets "):
        run_cli(args)


def test_refusal_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_mmpar.recipes.cli import main

    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", YAML, "--num-layers-per-virtual-pipeline-stage", "3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert done.value.code == 2
    assert len(err) == 1 and err[0].startswith(
        "clip_llama fit: error: --num-layers-per-virtual-pipeline-stage 3: the decoder's 2 "
        "layers (model.fusion.language.num_hidden_layers) over pipeline_parallel 2 give 1 "
        "layers per pipeline rank, not a multiple of 3"
    ), err
