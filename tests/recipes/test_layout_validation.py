"""One layout value, one validation (issue 27, item 3).

``lightning_mmpar.layout.validate`` is the check of the strategy (``ParallelConfig``,
``ParallelDims``, the model's plan), of the recipe's pre-launch check (``preflight``) and of the
planner (``python -m lightning_mmpar.recipes.planner``). Here: every layout the planner ranks for
each shipped recipe YAML passes every check the strategy runs, and a table of refused layouts is
refused by the strategy, the pre-launch check and the planner with the same message.
No process group: the strategy's checks run as a run meets them, without launching it.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from lightning.pytorch import Trainer

from lightning_mmpar import MultimodalParallelStrategy, ParallelDims
from lightning_mmpar.layout import ParallelLayout, describe
from lightning_mmpar.layout import planner as layout_planner
from lightning_mmpar.layout.cost import DEVICES
from lightning_mmpar.plans.fusion import FusionPlanOptions, check_fusion_layout
from lightning_mmpar.recipes import planner
from lightning_mmpar.recipes.partition import build_module
from lightning_mmpar.recipes.preflight import preflight

ROOT = Path(__file__).parents[2]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
CPU = ROOT / "recipes" / "clip_llama_cpu.yaml"
MOE = ROOT / "recipes" / "clip_llama_moe_cpu.yaml"
SPEC_CACHE = planner.spec_cache


def _config(recipe: Path) -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load(recipe.read_text())
    return config


def _world(config: dict[str, Any]) -> int:
    trainer = config["trainer"]
    return int(trainer.get("devices", 1)) * int(trainer.get("num_nodes", 1))


def _strategy_args(layout: ParallelLayout) -> dict[str, Any]:
    args: dict[str, Any] = planner.fragment(layout)["trainer"]["strategy"]["init_args"]
    return args


def strategy_refusal(layout: ParallelLayout, world: int, module: Any) -> str | None:
    """The strategy's checks in the order a run meets them: its construction
    (``ParallelConfig``), the Trainer's (``ParallelDims``, ``check_world``), the pipeline's
    batch check and the model's plan in ``configure_model`` (``check_fusion_layout``, the first
    thing ``parallelize_fusion`` does)."""
    try:
        config = MultimodalParallelStrategy(**_strategy_args(layout)).config
        dims = ParallelDims(
            world_size=world - config.vision_ranks,  # the language ranks (non-colocated)
            tp=config.tensor_parallel,
            pp=config.pipeline_parallel,
            ep=config.expert_parallel,
        )
        config.check_world(world)
        config.check_batch_size(layout.local_batch)
        options = FusionPlanOptions(
            vision_parallel=layout.vision_parallel,  # type: ignore[arg-type]
            sequence_parallel=layout.sequence_parallel,
        )
        check_fusion_layout(module._resolved_config(dims.tp), dims, options)
    except ValueError as err:
        return str(err)
    return None


def preflight_refusal(layout: ParallelLayout, world: int, recipe: Path) -> str | None:
    """The recipe CLI before launch: the planner's YAML fragment merged over the recipe, the
    Trainer built on ``world`` CPU devices, then ``preflight``."""
    config = _config(recipe)
    fragment = planner.fragment(layout)
    module, data = build_module(
        planner._merge(config, {k: fragment[k] for k in ("model", "data")}), meta=False
    )
    try:
        trainer = Trainer(
            strategy=MultimodalParallelStrategy(**_strategy_args(layout)),
            accelerator="cpu",
            devices=world,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        preflight(trainer, module, data)
    except ValueError as err:
        return str(err)
    return None


def planner_refusal(layout: ParallelLayout, world: int, recipe: Path) -> str | None:
    """``plan`` on ``world`` devices given this one candidate, with the recipe model's facts."""
    module, data = build_module(_config(recipe))
    text_length = int(data.max_length)
    _, rejected = layout_planner.plan(
        planner.spec_cache(module, text_length),
        world,
        DEVICES["cpu"],
        candidates=[layout],
        facts=planner.layout_facts(module, text_length),
    )
    return rejected[0].reason if rejected else None


# ---------------------------------------------------------------- refused by all three
REFUSED = [
    (
        "tp does not divide the key-value heads",
        CPU,
        {"tp": 4, "dp": 1, "micro_batch_size": 72},
        4,
        "LanguageConfig.num_key_value_heads (2) must be divisible by the tensor-parallel size (4)",
    ),
    (
        "tp * pp does not divide the world",
        CPU,
        {"tp": 2, "pp": 2, "dp": None, "micro_batches": 2, "micro_batch_size": 36},
        6,
        "world_size (6) must be divisible by tensor_parallel * pipeline_parallel (2 * 2 = 4)",
    ),
    (
        "1f1b with fewer micro-batches than pipeline ranks",
        CPU,
        {"pp": 4, "dp": 1, "micro_batches": 2, "micro_batch_size": 36},
        4,
        "micro_batches (2) must be >= pipeline_parallel (4) for the 1f1b schedule",
    ),
    (
        "interleaved schedule, micro-batches not a multiple of the rounds",
        CPU,
        {
            "pp": 2,
            "dp": 2,
            "virtual": 2,
            "schedule": "interleaved_1f1b",
            "micro_batches": 5,
            "micro_batch_size": 4,
        },
        4,
        "micro_batches (5) must be a multiple of its rounds (2 = micro_batches // "
        "pipeline_parallel) for interleaved_1f1b; use 4.",
    ),
    (
        "dualpipev with fewer micro-batches than stages",
        CPU,
        {
            "pp": 2,
            "dp": 2,
            "virtual": 2,
            "schedule": "dualpipev",
            "micro_batches": 2,
            "micro_batch_size": 4,
            "data_parallel": "ddp",
        },
        4,
        "micro_batches (2) must be >= the pipeline stages (4 = pipeline_parallel * "
        "virtual_pipeline) for the dualpipev schedule",
    ),
    (
        "V schedule with virtual_pipeline 3",
        CPU,
        {
            "pp": 2,
            "dp": 2,
            "virtual": 3,
            "schedule": "zbv_zero_bubble",
            "micro_batches": 4,
            "micro_batch_size": 2,
            "data_parallel": "ddp",
        },
        4,
        "schedule='zbv_zero_bubble' needs virtual_pipeline=2 (got 3)",
    ),
    (
        "virtual stages under 1f1b",
        CPU,
        {"pp": 2, "dp": 2, "virtual": 2, "micro_batches": 2, "micro_batch_size": 4},
        4,
        "virtual_pipeline (2) needs a multi-stage schedule (got '1f1b')",
    ),
    (
        "zero-bubble schedule with FSDP over replicas",
        CPU,
        {
            "pp": 2,
            "dp": 2,
            "virtual": 2,
            "schedule": "interleaved_zero_bubble",
            "micro_batches": 4,
            "micro_batch_size": 2,
        },
        4,
        "schedule='interleaved_zero_bubble' cannot run with data_parallel='fsdp' over 2",
    ),
    (
        "data_parallel none over replicas",
        CPU,
        {"dp": 2, "data_parallel": "none", "micro_batch_size": 36},
        2,
        "data_parallel ('none') cannot run 2 data-parallel replicas",
    ),
    (
        "expert parallelism without MoE layers",
        CPU,
        {"dp": 4, "ep": 2, "micro_batch_size": 18},
        4,
        "expert_parallel (2) needs mixture-of-experts layers, but model.fusion.language.moe",
    ),
    (
        "ep does not divide dp",
        MOE,
        {"dp": 4, "ep": 3, "micro_batch_size": 18},
        4,
        "expert_parallel (3) must divide the data-parallel size (4 = world_size 4",
    ),
    (
        "ep does not divide the experts",
        MOE,
        {"dp": 3, "ep": 3, "micro_batch_size": 24},
        3,
        "model.fusion.language.moe.num_experts (4) must be divisible by expert_parallel (3)",
    ),
    (
        "sequence parallelism with MoE layers",
        MOE,
        {"tp": 2, "dp": 2, "sequence_parallel": True, "micro_batch_size": 36},
        4,
        "plan.sequence_parallel (True) is not supported with mixture-of-experts",
    ),
]


@pytest.mark.parametrize(
    ("recipe", "fields", "world", "expected"),
    [row[1:] for row in REFUSED],
    ids=[row[0] for row in REFUSED],
)
def test_refused_by_strategy_preflight_and_planner_with_one_message(
    recipe: Path, fields: dict[str, Any], world: int, expected: str
) -> None:
    layout = ParallelLayout(**fields)
    module, _ = build_module(_config(recipe))
    by_strategy = strategy_refusal(layout, world, module)
    assert by_strategy is not None and expected in by_strategy, by_strategy
    assert preflight_refusal(layout, world, recipe) == by_strategy
    assert planner_refusal(layout, world, recipe) == by_strategy


# ---------------------------------------------------------------- ranked -> accepted
def _instant(spec: Any, layout: Any, *args: Any) -> Any:
    """A prediction that fits, without pricing (for the recipes whose every layout would take
    minutes to price): the planner then ranks every layout its validation accepts."""
    memory = SimpleNamespace(total=0)
    return SimpleNamespace(
        layout=layout,
        fits=True,
        step_seconds=1.0,
        memory=memory,
        comm_total_bytes=0,
        bubble=0.0,
        mfu=0.0,
        placement=None,
        breakdown={"compute": 1.0},
    )


def _one_spec(module: Any, text_length: int, images_per_sample: float = 1.0) -> Any:
    """The model spec of the first layout asked for every layout (the layouts are not priced,
    :func:`_instant`; a spec per tp and ep takes seconds to build)."""
    spec, built = SPEC_CACHE(module, text_length, images_per_sample), []

    def model(layout: Any) -> Any:
        if not built:
            built.append(spec(layout))
        return built[0]

    return model


def _with_local_files(recipe: Path, root: Path) -> Path:
    """A LLaVA or Qwen YAML names files a user brings (a checkpoint directory, a conversation
    JSON): a copy of it on the offline tiny model's files (``examples.tiny_llava`` /
    ``examples.tiny_qwen``; a config-only checkpoint directory the YAML names is kept), other
    YAMLs as they are."""
    from lightning_mmpar.examples.tiny_llava import write_tiny_llava
    from lightning_mmpar.examples.tiny_qwen import write_tiny_qwen

    writers = {"llava": write_tiny_llava, "qwen": write_tiny_qwen}
    write = next((w for name, w in writers.items() if recipe.name.startswith(name)), None)
    if write is None:
        return recipe
    files, config = write(root / "tiny"), _config(recipe)
    pretrained = config["model"].setdefault("pretrained", {})
    if not (ROOT / str(pretrained.get("hf", "")) / "config.json").exists():
        pretrained["hf"] = str(files["model"])
    data = config["data"]["init_args"]
    data.update(train_file=str(files["train_file"]), image_root=str(files["image_root"]))
    copy = root / recipe.name
    copy.write_text(yaml.safe_dump(config))
    return copy


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.name for p in RECIPES])
def test_every_layout_the_planner_ranks_the_strategy_accepts(
    recipe: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    """The CPU recipes are priced for real; the GPU ones with every layout fitting (a superset
    of what the planner ranks on a device of any memory size)."""
    ranked: list[ParallelLayout] = []
    plan = layout_planner.plan

    def recording(*args: Any, **kwargs: Any) -> Any:
        out = plan(*args, **kwargs)
        ranked.extend(p.layout for p in out[0])
        return out

    monkeypatch.setattr(planner, "plan", recording)
    recipe = _with_local_files(recipe, tmp_path)
    priced = "cpu" in recipe.name
    if not priced:
        monkeypatch.setattr(layout_planner, "_predict", _instant)
        monkeypatch.setattr(planner, "spec_cache", _one_spec)
    config = _config(recipe)
    world = _world(config)
    device = ["--device", "cpu"] if priced else []
    assert planner.main(["--config", str(recipe), "--gpus", str(world), "--top", "1", *device]) == 0
    capsys.readouterr()
    module, _ = build_module(config)
    assert ranked
    refused = {describe(x): strategy_refusal(x, world, module) for x in ranked}
    assert not {k: v for k, v in refused.items() if v is not None}


def test_preflight_names_rows_multiple_for_packed_data() -> None:
    """Packed data (``data.pack: true``): a batch of ``data.batch_size`` samples fills a
    varying number of rows (2 samples can pack into 1 row, which 2 micro-batches cannot
    split), so the batch / micro-batch rule is checked on ``data.rows_multiple``, the fix."""
    config = _config(ROOT / "recipes" / "digits_vqa_cpu.yaml")
    layout = ParallelLayout(tp=2, pp=2, dp=1, micro_batches=2, micro_batch_size=1)
    for rows, refused in ((1, True), (2, False), (4, False)):
        config["data"]["init_args"] |= {"batch_size": 2, "rows_multiple": rows}
        module, data = build_module(config, meta=False)
        trainer = Trainer(
            strategy=MultimodalParallelStrategy(**_strategy_args(layout)),
            accelerator="cpu",
            devices=4,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        if not refused:
            preflight(trainer, module, data)
            continue
        with pytest.raises(ValueError) as err:
            preflight(trainer, module, data)
        assert str(err.value).startswith(
            "data.rows_multiple (1) must be divisible by micro_batches (2) under pipeline "
            "parallelism; use a multiple of 2"
        )
        assert "padded to a multiple of data.rows_multiple" in str(err.value)
