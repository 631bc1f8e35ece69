"""``python -m lightning_mmpar.recipes.planner`` in-process on the CPU recipe (no process group)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from lightning_mmpar.config import ParallelConfig
from lightning_mmpar.layout import ParallelLayout
from lightning_mmpar.layout.planner import candidate_layouts
from lightning_mmpar.recipes import planner as cli
from lightning_mmpar.recipes.partition import build_module, data_args
from lightning_mmpar.recipes.yaml_layout import yaml_layout
from lightning_mmpar.strategy import MultimodalParallelStrategy

ROOT = Path(__file__).parents[2]
CPU = str(ROOT / "recipes" / "clip_llama_cpu.yaml")
MOE = str(ROOT / "recipes" / "clip_llama_moe_cpu.yaml")
VQA = str(ROOT / "recipes" / "digits_vqa_cpu.yaml")  # ragged: non-colocated towers take it
TOPO = ROOT / "tests" / "fixtures" / "topology"
PCIE = str(TOPO / "pcie_4gpu_2numa.txt")


def test_plan_cpu_recipe_table_rejections_placement_and_yaml(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_yaml = tmp_path / "best.yaml"
    argv = [
        "--config",
        CPU,
        "--gpus",
        "4",
        "--device",
        "cpu",
        "--topo",
        PCIE,
        "--top",
        "5",
        "--write-yaml",
        str(out_yaml),
    ]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert "4 x cpu (32-true" in lines[0]
    assert lines[1] == f"topology: {PCIE}: 1 node x 4 GPUs, PIX / PHB / SYS"
    header = next(i for i, ln in enumerate(lines) if ln.startswith("#  layout"))
    rows = [ln.split() for ln in lines[header + 1 : header + 6]]
    steps = [float(r[-2]) for r in rows]
    assert len(rows) == 5 and steps == sorted(steps)
    assert all(r[0] == str(i) for i, r in enumerate(rows, 1))
    # the strategy's own check, its own message: the CPU model's 2 key-value heads refuse tp 4
    assert any(
        "LanguageConfig.num_key_value_heads (2) must be divisible by the tensor-parallel size "
        "(4); nearest valid num_key_value_heads: 4; or tensor_parallel 1 or 2." in ln
        for ln in lines
    )
    assert any(ln.startswith("placement [") and "vs Megatron order" in ln for ln in lines)
    # the fragment: what the recipe's parser and the strategy accept
    fragment = yaml.safe_load(out_yaml.read_text())
    assert text.endswith(out_yaml.read_text())
    args = fragment["trainer"]["strategy"]["init_args"]
    MultimodalParallelStrategy(**args)
    assert (fragment["trainer"]["devices"], fragment["trainer"]["num_nodes"]) == (4, 1)
    config = yaml.safe_load(Path(CPU).read_text())
    module, data = build_module(cli._merge(config, {k: fragment[k] for k in ("model", "data")}))
    assert data.batch_size == fragment["data"]["batch_size"]
    assert module.plan_options.sequence_parallel == fragment["model"]["plan"]["sequence_parallel"]
    tp, pp = args.get("tensor_parallel", 1), args.get("pipeline_parallel", 1)
    assert 4 % (tp * pp) == 0
    layout_args = {
        k: v for k, v in args.items() if k not in ("placement", "activation_checkpointing")
    }
    ParallelConfig(**layout_args).check_batch_size(data.batch_size)
    # the global batch is the YAML's (72 per dp rank x dp 1): every layout keeps it
    assert data.batch_size * (4 // (tp * pp)) == 72
    # the workload priced, and the YAML's own layout (tp 2 x pp 2) with its rank and the parts
    # of its step next to the best's
    assert lines[2].startswith("workload: 9 text tokens per sample (the YAML's data.max_length)")
    own = next(i for i, ln in enumerate(lines) if ln.startswith("the YAML's layout: tp 2 pp 2"))
    ranked = int(lines[0].split(" layouts fit")[0].rsplit(" ", 1)[1])
    place, total = map(int, lines[own].split(": rank ")[1].split(",")[0].split(" of "))
    # the YAML's batch of 72 per dp rank in pipeline_parallel (2) micro-batches of 36: one of
    # the candidates, so it is counted once
    assert " mb 2x36 fsdp: " in lines[own] and 1 < place <= total == ranked
    assert lines[own + 1].startswith("  why (this layout vs the best, largest gap first):")
    assert any(ln.startswith("  pipeline bubble: ") for ln in lines[own + 2 : own + 9])


def test_workload_options_price_the_users_text_and_images(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--text-length, --image-tokens and --images-per-sample replace the YAML's caption length,
    ViT grid and one image per sample: the workload line says so and the checks see them
    (sequence parallelism at tp 2 refuses an odd text length: 9 tokens in the YAML, accepted at
    10)."""
    base = ["--config", CPU, "--gpus", "4", "--device", "cpu", "--top", "3"]
    assert cli.main(base) == 0
    before = capsys.readouterr().out
    assert "shards the text (9 tokens)" in before
    assert ", 1 image per sample (the default)\n" in before
    options = ["--text-length", "10", "--image-tokens", "64", "--images-per-sample", "2.5"]
    assert cli.main([*base, *options]) == 0
    after = capsys.readouterr().out
    assert (
        "workload: 10 text tokens per sample (--text-length), 64 image tokens per image " in after
    )
    assert "(--image-tokens: image_size 64), 2.5 images per sample (--images-per-sample)" in after
    assert "shards the text" not in after


def test_plan_rejects_layouts_over_the_memory_limit_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        cli.main(
            [
                "--config",
                CPU,
                "--gpus",
                "2",
                "--device",
                "cpu",
                "--memory-gib",
                "0.0001",
                "--write-yaml",
                str(tmp_path / "x.yaml"),
            ]
        )
        == 1
    )
    text = capsys.readouterr().out
    assert "0 layouts fit" in text and "\nno layout fits\n" in text and "#  layout" not in text
    assert "topology: 1 node x 2 GPUs, NVSWITCH (assumed; pass --topo)" in text
    # colocated only (was 40: 8 more of 1 language + 1 vision rank, with and without
    # checkpointing, at 1, 2, 4 and 8 batches per step, which the recipe's preflight refuses for
    # this caption data), said once
    assert "rejected: 32 layouts, 2 reasons" in text
    assert text.count("no non-colocated layout (+ V vision): vision_ranks (the vision") == 1
    memory = [ln for ln in text.splitlines() if "> 0.0001 GiB" in ln]
    assert len(memory) == 1 and "needs " in memory[0] and "parameters" in memory[0]
    # the example is the layout closest to fitting: pp 2 with checkpointing holds the least
    assert "pp 2 " in memory[0] and memory[0].split(":")[0].endswith("ckpt (and 29 more)")
    assert not (tmp_path / "x.yaml").exists() and "--write-yaml" in text and "not written" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--config", CPU, "--gpus", "0"], "--gpus (0) must be >= 1"),
        (["--config", CPU, "--gpus", "4", "--device", "tpu"], "--device 'tpu' is unknown"),
        (["--config", "nope.yaml", "--gpus", "4"], "no such file"),
        (["--config", CPU, "--gpus", "4", "--memory-gib", "-1"], "--memory-gib (-1.0) must be"),
        (
            ["--config", CPU, "--gpus", "4", "--device", "a100", "--precision", "fp8"],
            "precision 'fp8' has no peak figure on A100",
        ),
        (["--config", CPU, "--gpus", "3", "--topo", PCIE], "describes 4 devices in 1 node, --g"),
        (
            ["--config", CPU, "--gpus", "32", "--topo", str(TOPO / "two_nodes_h100.yaml")],
            "describes 16 devices in 2 nodes, --gpus is 32; give a one-node description",
        ),
        (["--config", CPU, "--gpus", "4", "--max-tp", "0"], "--max-tp (0) must be >= 1"),
        (["--config", CPU, "--gpus", "4", "--top", "0"], "--top (0) must be >= 1"),
        (["--config", CPU, "--gpus", "4", "--global-batch", "-3"], "--global-batch (-3) must be"),
        (["--config", CPU, "--gpus", "4", "--text-length", "0"], "--text-length (0) must be"),
        (
            ["--config", CPU, "--gpus", "4", "--images-per-sample", "-1"],
            "--images-per-sample (-1.0) must be a finite number >= 0",
        ),
        (
            ["--config", CPU, "--gpus", "4", "--samples-per-row", "0.5"],
            "--samples-per-row (0.5) must be a finite number >= 1",
        ),
        (
            ["--config", CPU, "--gpus", "4", "--samples-per-row", "2"],
            "--samples-per-row (2) prices packed rows; the YAML's data (RecipeDigitsCaptions) "
            "puts one sample per row",
        ),
        (  # DigitsVQA: 1.5 images per sample, 6 image slots per row
            ["--config", VQA, "--gpus", "4", "--samples-per-row", "40"],
            "--samples-per-row (40 samples per row) at 1.5 images per sample puts 60 images in "
            "a row; the YAML's data.max_images_per_row is 6: give --samples-per-row <= 4",
        ),
        (  # 64 tokens per row
            ["--config", VQA, "--gpus", "4", "--samples-per-row", "3", "--text-length", "30"],
            "--samples-per-row (3 samples per row) at 30 tokens each (--text-length) needs 90 "
            "tokens; the YAML's data.max_tokens is 64: give --samples-per-row <= 2.13333",
        ),
        (
            ["--config", CPU, "--gpus", "4", "--image-tokens", "10"],
            "--image-tokens (10) must be a square number of patches",
        ),
        (["--config", "BAD_CONFIG", "--gpus", "4"], "BAD_CONFIG' is not valid YAML: while parsing"),
        (["--config", "BAD_TRAINER", "--gpus", "4"], "BAD_TRAINER': trainer (3) must be a mapping"),
        (
            ["--config", CPU, "--gpus", "4", "--topo", "BAD_TOPO"],
            "BAD_TOPO': topology YAML: text is not valid YAML: while parsing a flow sequence",
        ),
    ],
)
def test_invalid_arguments_exit_2_with_the_reason(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = {
        "BAD_CONFIG": "model: [1, 2\n",
        "BAD_TOPO": "gpus: [1,2\n",  # unclosed sequences
        "BAD_TRAINER": "trainer: 3\nmodel: {}\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    argv = [str(tmp_path / a) if a in files else a for a in argv]
    with pytest.raises(SystemExit) as err:
        cli.main(argv)
    assert err.value.code == 2
    assert message in capsys.readouterr().err


def test_moe_recipe_ranks_expert_parallel_layouts(capsys: pytest.CaptureFixture[str]) -> None:
    """The MoE dispatch (``ep.all_to_all_v``) is timed as an all-to-all: ep 2 layouts rank."""
    assert (
        cli.main(
            ["--config", MOE, "--gpus", "4", "--device", "cpu", "--max-tp", "1", "--top", "100"]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "all_to_all_v" not in text and "must be one of" not in text
    rows = [ln.split() for ln in text.splitlines() if ln[:1].isdigit() and " ep " in ln]
    ep2 = [r for r in rows if r[r.index("ep") + 1] == "2"]
    assert ep2 and all(0 < float(r[-2]) < float("inf") for r in rows)
    assert "rejected: " not in text or "ep 2" not in text.split("rejected: ")[1]


def _alternative(value: object, options: list[object]) -> object:
    return next(o for o in options if o != value)


@pytest.mark.parametrize("recipe", sorted((ROOT / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_fragment_merged_over_a_recipe_overrides_every_layout_field(recipe: Path) -> None:
    """jsonargparse merges a later ``--config`` per key (init_args of the same class_path too):
    the fragment must set every layout field, or the recipe's own values survive."""
    config = yaml.safe_load(recipe.read_text())
    old = config["trainer"]["strategy"].get("init_args") or {}
    options = config["model"].get("plan") or {}
    layout = ParallelLayout(
        tp=_alternative(old.get("tensor_parallel", 1), [8, 1]),
        pp=_alternative(old.get("pipeline_parallel", 1), [4, 1]),
        dp=4,
        ep=_alternative(old.get("expert_parallel", 1), [4, 1]),
        virtual=_alternative(old.get("virtual_pipeline", 1), [2, 1]),
        micro_batches=_alternative(old.get("micro_batches"), [16, 8]),
        micro_batch_size=3,
        accumulate=_alternative(config["trainer"].get("accumulate_grad_batches", 1), [3, 2]),
        schedule=_alternative(old.get("schedule", "1f1b"), ["looped_bfs", "interleaved_1f1b"]),
        partition=_alternative(old.get("partition", "equal"), ["memory", "equal"]),
        data_parallel=_alternative(old.get("data_parallel", "fsdp"), ["ddp", "fsdp"]),
        sequence_parallel=not options.get("sequence_parallel", False),
        vision_parallel=_alternative(options.get("vision_parallel", "tp"), ["dp", "tp"]),
        activation_checkpointing=old.get("activation_checkpointing") is None,
    )
    assert layout.micro_batches * layout.micro_batch_size != data_args(config)["batch_size"]
    order = list(range(layout.world))[::-1]
    merged = cli._merge(config, cli.fragment(layout, order))
    args = merged["trainer"]["strategy"]["init_args"]
    expected = {
        "tensor_parallel": layout.tp,
        "pipeline_parallel": layout.pp,
        "virtual_pipeline": layout.virtual,
        "expert_parallel": layout.ep,
        "micro_batches": layout.micro_batches,
        "schedule": layout.schedule,
        "data_parallel": layout.data_parallel,
        "partition": layout.partition,
        "placement": order,
        "activation_checkpointing": "layers" if layout.activation_checkpointing else None,
        "vision_ranks": layout.vision_ranks,
        "vision_data_parallel": layout.vision_data_parallel,
    }
    assert {k: args.get(k) for k in expected} == expected
    assert set(args) - set(expected) <= set(old) - set(expected)  # nothing else added
    strategy = MultimodalParallelStrategy(**{k: args[k] for k in expected})
    got = strategy.config
    assert (got.tensor_parallel, got.pipeline_parallel, got.expert_parallel) == (
        layout.tp,
        layout.pp,
        layout.ep,
    )
    assert (got.num_micro_batches, got.schedule) == (layout.micro_batches, layout.schedule)
    plan_options = merged["model"]["plan"]
    assert plan_options["sequence_parallel"] == layout.sequence_parallel
    assert plan_options["vision_parallel"] == layout.vision_parallel
    assert "tensor_parallel" not in merged["model"]  # the degree is the strategy's
    assert merged["data"]["batch_size"] == layout.micro_batches * layout.micro_batch_size
    assert merged["trainer"]["accumulate_grad_batches"] == layout.accumulate
    # without a pipeline micro_batches is null (ParallelConfig refuses it at pp 1), and
    # Megatron's order writes placement null: neither recipe value survives either
    flat = cli.fragment(ParallelLayout(dp=4), None)["trainer"]["strategy"]["init_args"]
    assert flat["micro_batches"] is None and flat["placement"] is None
    assert flat["activation_checkpointing"] is None
    assert flat["pipeline_parallel"] == 1 and flat["tensor_parallel"] == 1


def test_accumulating_noncolocated_layouts_round_trip_through_their_yaml() -> None:
    """The planner's accumulating non-colocated candidates (the vision rank one batch ahead):
    the fragment sets ``trainer.accumulate_grad_batches`` and ``data.batch_size`` per batch,
    and the YAML's own layout read back from the merged recipe is the candidate."""
    config = yaml.safe_load(Path(CPU).read_text())
    module, _ = build_module(config)
    base = cli.base_layout(config, module, "32-true")
    found = candidate_layouts(4, 8, global_batch=72, vision_ranks=(1, 2), base=base)
    chosen = [x for x in found if x.accumulate > 1]
    assert {x.accumulate for x in chosen} == {2, 4, 8} and {x.vision_ranks for x in chosen} == {
        1,
        2,
    }
    fields = ("tp", "pp", "virtual", "dp", "num_micro_batches", "micro_batch_size", "accumulate")
    for layout in chosen:
        merged = cli._merge(config, cli.fragment(layout))
        assert merged["trainer"]["accumulate_grad_batches"] == layout.accumulate
        assert merged["data"]["batch_size"] * layout.dp * layout.accumulate == 72
        back = yaml_layout(merged, base, 4)
        assert isinstance(back, ParallelLayout)
        assert [getattr(back, f) for f in fields] == [getattr(layout, f) for f in fields]
        assert (back.vision_ranks, back.data_parallel) == (
            layout.vision_ranks,
            layout.data_parallel,
        )
    args = cli.fragment(chosen[-1])["trainer"]["strategy"]["init_args"]
    assert MultimodalParallelStrategy(**args).config.vision_ranks == chosen[-1].vision_ranks


def test_old_module_name_runs_the_planner_with_a_deprecation_warning(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``lightning_mmpar.recipes.plan`` (renamed: ``plans/plan.py`` shares its basename) is the
    planner module for one more release, imported or run with ``-m``."""
    import importlib
    import runpy
    import sys

    monkeypatch.delitem(sys.modules, "lightning_mmpar.recipes.plan", raising=False)
    with pytest.warns(DeprecationWarning, match=r"use lightning_mmpar\.recipes\.planner"):
        old = importlib.import_module("lightning_mmpar.recipes.plan")
    assert old is cli and old.fragment is cli.fragment
    argv = ["plan", "--config", CPU, "--gpus", "1", "--device", "cpu", "--top", "1"]
    monkeypatch.setattr(sys, "argv", argv)
    del sys.modules["lightning_mmpar.recipes.plan"]  # as a fresh `python -m` finds it
    with (
        pytest.warns(DeprecationWarning, match="recipes.planner"),
        pytest.raises(SystemExit) as end,
    ):
        runpy.run_module("lightning_mmpar.recipes.plan", run_name="__main__")
    assert end.value.code == 0 and "1 x cpu" in capsys.readouterr().out


LLAVA_YAML = str(ROOT / "recipes" / "llava_7b_16gpu.yaml")
LLAVA_13B = ROOT / "recipes" / "hf" / "llava-1.5-13b" / "config.json"


def test_llava_from_config_json_alone(capsys: pytest.CaptureFixture[str]) -> None:
    """LLaVA-1.5-7B priced from its config.json alone (no weights, tokenizer or data), beside
    the YAML's tp4 x pp2 x dp2 launch; sequence parallelism refused (spliced image tokens),
    tp 8 not (no adapter to split); ``--hf-config`` swaps in the 13B; the partitioner too."""
    from lightning_mmpar.recipes import partition
    from lightning_mmpar.recipes.hf_plan import CheckpointShapes, with_checkpoint

    assert cli.main(["--config", LLAVA_YAML, "--gpus", "16", "--device", "h200"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "59 blocks, 16 x h200 (bf16-mixed" in lines[0]
    assert (
        "2048 tokens per row (the YAML's data.max_tokens" in lines[2]
        and "576 image tokens per image" in lines[2]
    )
    header = next(i for i, ln in enumerate(lines) if ln.startswith("#") and "layout (" in ln)
    ranked = [ln for ln in lines[header + 1 :] if ln[:1].isdigit()]
    assert ranked and not any(" sp " in ln for ln in ranked)
    assert any(
        ln.startswith("the YAML's layout: tp 4 pp 2 v 1 dp 2 ep 1 mb 4x8 fsdp") for ln in lines
    )
    assert any(
        "sequence_parallel (True) is not supported: spliced image tokens" in ln for ln in lines
    )
    assert not any("AdapterConfig" in ln for ln in lines)
    config = with_checkpoint(partition.load_recipe(LLAVA_YAML), LLAVA_13B)
    module, data = build_module(config)
    assert isinstance(data, CheckpointShapes) and data.vocab_size == 32064
    assert module.load_report is None  # nothing read
    params = sum(p.numel() for p in module.fusion_model.parameters())
    assert module.fusion_config.language.num_hidden_layers == 40
    # LLaVA-1.5-13B's 13.35 B, less the last ViT layer (never run), plus the contrastive heads
    assert abs(params / 13.35e9 - 1) < 2e-3, params
    argv = ["--config", LLAVA_YAML, "--hf-config", str(LLAVA_13B.parent), "--pp", "4"]
    assert partition.main(argv) == 0
    assert (
        "67 blocks, pp 4" in capsys.readouterr().out
    )  # stem, 23 ViT layers, pool, bridge, 40, head
    with pytest.raises(ValueError, match=r"not a config\.json"):
        with_checkpoint({}, ROOT / "recipes")


QWEN = {
    "qwen2-vl-7b-instruct": (28, 8.29e9, "qwen2_vl"),
    "qwen2.5-vl-72b-instruct": (80, 73.4e9, "qwen2_5_vl"),
    "qwen3-vl-30b-a3b-instruct": (48, 31.1e9, "qwen3_vl_moe"),
}
"""recipes/hf/<dir>: decoder layers, published parameters (the model cards'), model_type."""


@pytest.mark.parametrize("name", list(QWEN))
def test_qwen_from_config_json_alone(name: str) -> None:
    """Each Qwen-VL config.json alone (no weights, tokenizer or data) builds the fusion model
    the planner prices (:mod:`lightning_mmpar.models.hf.qwen_plan`): the published parameter
    count within 1% (the merger and DeepStack differences), 256 language tokens per image from
    1024 merged ViT patches, the ViT blocks priced at the patches, the rest at the tokens."""
    from lightning_mmpar.models.hf.checkpoint import hf_config
    from lightning_mmpar.recipes.hf_plan import CheckpointShapes, with_checkpoint

    layers, published, kind = QWEN[name]
    path = ROOT / "recipes" / "hf" / name / "config.json"
    assert hf_config(path.parent).model_type == kind
    config = with_checkpoint(cli.load_recipe(LLAVA_YAML), path)
    assert "pretrained" not in config["model"] and config["model"]["fusion"]
    module, data = build_module(config)
    assert isinstance(data, CheckpointShapes) and module.load_report is None
    fusion = module.fusion_config
    assert fusion.language.num_hidden_layers == layers
    assert (fusion.vision.tokens, fusion.vision.grid, fusion.vision.spatial_merge) == (256, 32, 2)
    assert (fusion.language.moe is not None) == (kind == "qwen3_vl_moe")
    params = sum(p.numel() for p in module.fusion_model.parameters())
    assert abs(params / published - 1) < 0.01, params
    specs = {s.name: s for s in module.pipeline_block_specs(64)}
    blocks = dict(zip(specs, module.pipeline_blocks(), strict=True))
    for block, tokens in (("vision.layer0", 1024), ("bridge", 256)):
        assert specs[block].flops == blocks[block].cost(tokens, 64).flops


def test_qwen2_vl_planned_from_its_config_json(capsys: pytest.CaptureFixture[str]) -> None:
    """The planner ranks Qwen2-VL-7B's layouts from its config.json on 8 GPUs (28 heads: tp 8
    refused, naming the heads); ``--image-tokens`` sets the tokens per image (dynamic
    resolution) through the merger; the YAML's own layout is priced at ``--global-batch`` too
    (its micro-batches of 32 at dp 1, not the YAML's 8), and the header says the batch."""
    qwen = ROOT / "recipes" / "hf" / "qwen2-vl-7b-instruct" / "config.json"
    argv = ["--config", LLAVA_YAML, "--gpus", "8", "--hf-config", str(qwen), "--top", "1"]
    argv += ["--global-batch", "128"]
    assert cli.main([*argv, "--no-noncolocated", "--image-tokens", "64"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "128 samples per step" in lines[0]
    own = next(ln for ln in lines if ln.startswith("the YAML's layout"))
    assert own.startswith("the YAML's layout: tp 4 pp 2 v 1 dp 1 ep 1 mb 4x32"), own
    assert "64 image tokens per image (--image-tokens: image_size 224" in lines[2]
    assert "the ViT's 256 patches merged" in lines[2]
    assert any("num_attention_heads (28) must be divisible" in ln for ln in lines)


def test_ragged_yaml_prices_the_row_budget_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    """A ragged YAML's ``data.max_tokens`` is a packed row's budget (an upper bound), not a
    sample's text length: the workload line says so and how to give the samples' mean."""
    argv = ["--config", str(ROOT / "recipes" / "digits_vqa_cpu.yaml"), "--gpus", "4"]
    assert cli.main([*argv, "--device", "cpu", "--top", "1"]) == 0
    workload = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("workload"))
    assert workload.startswith(
        "workload: 64 tokens per row (the YAML's data.max_tokens: a packed row's budget, an "
        "upper bound of the work; pass --text-length for your samples' mean)"
    ), workload
    assert "data.max_length" not in workload


def test_vision_fsdp_candidates_are_ranked_with_full_copies(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--vision-fsdp``: the non-colocated layouts with 2 vision ranks are ranked both as full
    copies and sharded (``+ 2 vision fsdp``); without it, full copies only. On ragged data:
    caption data is refused (:func:`test_caption_data_gets_no_noncolocated_layout`)."""
    argv = ["--config", VQA, "--gpus", "4", "--device", "cpu", "--vision-ranks", "2"]
    assert cli.main([*argv, "--top", "200"]) == 0
    assert "+ 2 vision fsdp" not in capsys.readouterr().out
    assert cli.main([*argv, "--vision-fsdp", "--top", "200"]) == 0
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if "+ 2 vision" in ln]
    assert any("+ 2 vision fsdp" in ln for ln in rows) and any(
        "+ 2 vision" in ln and "vision fsdp" not in ln for ln in rows
    )


def test_caption_data_gets_no_noncolocated_layout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Non-colocated towers take ragged batches: for caption data (one image per sample), which
    the recipe's preflight refuses under ``vision_ranks``, the planner ranks no ``+ V vision``
    layout and says why once, and refuses ``--vision-ranks N`` with the preflight's message
    (exit 2); its fragment was the one the recipe then refused."""
    from lightning_mmpar.recipes.preflight import vision_ranks_refusal

    argv = ["--config", CPU, "--gpus", "3", "--device", "cpu", "--vision-fsdp"]
    assert cli.main([*argv, "--top", "200"]) == 0
    out = capsys.readouterr().out
    data = build_module(yaml.safe_load(Path(CPU).read_text()))[1]
    assert out.count(f"no non-colocated layout (+ V vision): {vision_ranks_refusal(data)}\n") == 1
    assert re.search(r"\+ \d+ vision", out) is None  # "+1 vision", "+2 vision fsdp" were ranked
    with pytest.raises(SystemExit) as err:
        cli.main([*argv, "--vision-ranks", "2", "--write-yaml", str(tmp_path / "f.yaml")])
    assert err.value.code == 2 and not (tmp_path / "f.yaml").exists()
    assert f"error: {vision_ranks_refusal(data, 2)}\n" in capsys.readouterr().err
    assert cli.main([*argv, "--vision-ranks", "0", "--top", "1"]) == 0
    assert "no non-colocated layout" not in capsys.readouterr().out


@pytest.mark.parametrize(("gpus", "rows"), [(8, "3.6"), (8, "1.5"), (4, "2.5")])
def test_packed_fragment_keeps_the_global_batch_and_sets_rows_multiple(
    gpus: int, rows: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--samples-per-row``: the fragment's ``data.batch_size`` x dp x accumulation is the
    YAML's 32 samples per step (dp divides the samples, not the rounded rows), and its
    ``data.rows_multiple`` (the YAML says 2) makes every packed batch's rows split into the
    layout's micro-batches (each over tp under vision_parallel='dp'), so the recipe's
    pre-launch check and the strategy accept it whatever rows packing gives."""
    out = tmp_path / "f.yaml"
    argv = ["--config", VQA, "--gpus", str(gpus), "--samples-per-row", rows, "--device", "cpu"]
    assert cli.main([*argv, "--write-yaml", str(out)]) == 0
    assert "32 samples per step in " in capsys.readouterr().out
    run = cli._prepare(cli._parser().parse_args(argv))
    ranked = [p.layout for p in cli._rank(cli._parser().parse_args(argv), run)[0]]
    frags = [yaml.safe_load(out.read_text())]
    frags += [cli.fragment(x, None, 1, float(rows), global_batch=32, packs=True) for x in ranked]
    assert {x.dp_size for x in ranked} > {1}
    for frag in frags:
        init = frag["trainer"]["strategy"]["init_args"]
        dp = (frag["trainer"]["devices"] - init["vision_ranks"]) // (
            init["tensor_parallel"] * init["pipeline_parallel"]
        )
        assert frag["data"]["batch_size"] * dp * frag["trainer"]["accumulate_grad_batches"] == 32
        step = init["micro_batches"] or 1
        if frag["model"]["plan"]["vision_parallel"] == "dp" and not init["vision_ranks"]:
            step *= init["tensor_parallel"]
        assert frag["data"]["rows_multiple"] == step
    with pytest.raises(ValueError, match="not divisible by the layout's dp x accumulate"):
        cli.fragment(ParallelLayout(dp=3), samples_per_row=2.0, global_batch=32)


def test_shipped_qwen_recipe_packs_and_refuses_noncolocated_towers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """recipes/qwen_sft_cpu.yaml (``model.pretrained.hf``, ``data.pack: true``; here on the
    config-only Qwen2-VL-7B directory, no weights or data read): the planner reads the packing
    from the YAML's data (``--samples-per-row`` is priced, not refused as one sample per row)
    and, since the vision ranks do not read pretrained towers (the recipe refuses them), offers
    no non-colocated layout and refuses ``--vision-ranks N`` with the pre-launch check's rule."""
    from lightning_mmpar.recipes.preflight import vision_ranks_refusal

    config = yaml.safe_load((ROOT / "recipes" / "qwen_sft_cpu.yaml").read_text())
    config["model"]["pretrained"]["hf"] = str(ROOT / "recipes" / "hf" / "qwen2-vl-7b-instruct")
    path = tmp_path / "qwen.yaml"
    path.write_text(yaml.safe_dump(config))
    argv = ["--config", str(path), "--gpus", "8", "--top", "50"]
    assert cli.main([*argv, "--samples-per-row", "2.5", "--write-yaml", str(tmp_path / "f")]) == 0
    out = capsys.readouterr().out
    assert "2.5 samples per packed row (--samples-per-row): 2.5 images per row" in out
    assert (
        f"no non-colocated layout (+ V vision): {vision_ranks_refusal(None, pretrained=True)}"
        in out
    )
    assert re.search(r"\+ \d+ vision", out) is None
    assert "rows_multiple" in yaml.safe_load((tmp_path / "f").read_text())["data"]
    with pytest.raises(SystemExit) as err:
        cli.main([*argv, "--vision-ranks", "2"])
    assert err.value.code == 2
    assert vision_ranks_refusal(None, 2, pretrained=True) in capsys.readouterr().err
    assert cli.main(argv) == 0  # its tp 2 on 8 devices: dp 4, which 3 samples do not fill
    own = next(ln for ln in capsys.readouterr().out.splitlines() if "the YAML's layout" in ln)
    assert own == (
        "the YAML's layout (tp 2 pp 1 v 1 dp 4 ep 1 mb 1x3 fsdp): not priced at the planner's "
        "3 samples per step, which its dp x accumulation x micro-batches (4) on 8 devices does "
        "not divide; give --global-batch a multiple of 4 to compare it"
    )


def _ranked_rows(out: str) -> list[str]:
    lines = out.splitlines()
    header = next(i for i, ln in enumerate(lines) if re.match(r"#\s+layout", ln))
    return [ln for ln in lines[header + 1 :] if re.match(r"\d+ ", ln)]


def test_the_yamls_own_layout_is_priced_at_the_planners_batch_and_ranked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The YAML's own layout is compared at the candidates' samples per step (it was priced at
    its per-rank batch on the planner's dp: 4 x 3 samples against the candidates' 3, "faster"
    than the #1 yet absent from the table); one that fits but is not enumerated (3
    micro-batches on a pipeline of 2) joins the ranking, marked, at the rank its line says."""
    config = yaml.safe_load(Path(VQA).read_text())
    config["trainer"]["strategy"]["init_args"]["micro_batches"] = 3
    config["data"]["init_args"]["batch_size"] = 24
    path = tmp_path / "vqa.yaml"
    path.write_text(yaml.safe_dump(config))
    argv = ["--config", str(path), "--device", "cpu", "--top", "500", "--no-noncolocated"]
    assert cli.main([*argv, "--gpus", "4"]) == 0
    out = capsys.readouterr().out
    own = next(ln for ln in out.splitlines() if ln.startswith("the YAML's layout"))
    rows = _ranked_rows(out)
    marked = [r for r in rows if "(the YAML's)" in r]
    assert len(marked) == 1 and "tp 2 pp 2 v 1 dp 1 ep 1 mb 3x8 fsdp (the YAML's)" in marked[0]
    assert own.startswith("the YAML's layout: tp 2 pp 2 v 1 dp 1 ep 1 mb 3x8 fsdp: rank ")
    assert f"rank {marked[0].split()[0]} of {len(rows)}," in own
