"""The shipped recipe YAMLs: valid layouts, and the reference launch's Megatron flags mapped."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
import yaml

from lightning_mmpar import MultimodalParallelStrategy, ParallelConfig, ParallelDims
from lightning_mmpar.models import MoEConfig

RECIPES = Path(__file__).resolve().parents[3] / "recipes"
YAMLS = sorted(RECIPES.glob("clip_llama_*.yaml")) + sorted(RECIPES.glob("digits_vqa_*.yaml"))


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


@pytest.mark.parametrize("path", YAMLS, ids=[p.stem for p in YAMLS])
def test_layout_of_every_yaml_is_valid(path: Path) -> None:
    config = _load(path)
    trainer = config["trainer"]
    args = trainer["strategy"]["init_args"]
    fields = {f.name for f in dataclasses.fields(ParallelConfig)}
    parallel = ParallelConfig(**{k: v for k, v in args.items() if k in fields})
    strategy_only = set(args) - fields  # process group, timeout, memory and numerics options
    assert strategy_only <= set(inspect.signature(MultimodalParallelStrategy).parameters), (
        path.name,
        strategy_only,
    )
    world = trainer.get("devices", 1) * trainer.get("num_nodes", 1)
    dims = ParallelDims(
        world_size=world,
        tp=parallel.tensor_parallel,
        pp=parallel.pipeline_parallel,
        ep=parallel.expert_parallel,
    )
    assert dims.dp >= 1
    assert "tensor_parallel" not in config["model"], path.name  # the degree: the strategy's
    language = config["model"]["fusion"]["language"]
    if "moe" in language:  # the MoE recipes: experts split over ep, no sequence parallel
        moe = MoEConfig(**language["moe"])
        assert dims.ep > 1 and moe.num_experts % dims.ep == 0, (path.name, dims)
        assert language.get("joint_attention") is True  # the vision router gets image tokens
        assert not config["model"].get("plan", {}).get("sequence_parallel", False)
        names = [c["class_path"].rsplit(".", 1)[-1] for c in trainer["callbacks"]]
        assert "ExpertLoadMonitor" in names and "RunSummary" in names, names
    else:
        assert dims.ep == 1


def test_16gpu_maps_megatron_layers_per_virtual_stage() -> None:
    """``--num-layers-per-virtual-pipeline-stage 2`` (Megatron-LM, the 16-GPU launch) means two
    decoder layers per virtual stage: ``v = num_layers / (pp * 2)`` stages per pipeline rank
    (megatron-core: ``virtual_pipeline_model_parallel_size``)."""
    config = _load(RECIPES / "clip_llama_16gpu.yaml")
    args = config["trainer"]["strategy"]["init_args"]
    layers = config["model"]["fusion"]["language"]["num_hidden_layers"]
    assert args["tensor_parallel"] == 4 and args["pipeline_parallel"] == 2
    assert args["virtual_pipeline"] == layers // (args["pipeline_parallel"] * 2)
