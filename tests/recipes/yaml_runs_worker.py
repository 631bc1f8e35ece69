"""Each shipped recipe YAML trained for 2 steps on CPU (issue 9), its model shrunk in width.

The GPU YAMLs keep their schedule, micro-batches, virtual stages, sequence parallelism,
data-parallel engine, precision and adapter count; widths, depth (2 ViT layers, 2 decoder
layers, 8 for the 16-GPU YAML's 2 x 8 virtual stages), image size and batch shrink to CPU size,
and the layout is scaled to at most 4 processes. Every run's captions are cut to
:data:`CAPTION_TOKENS` tokens (``data.max_length``; the digits' longest caption has 9, the
16-GPU YAMLs set 12, and 4 is divisible by their sequence-parallel tp): the run summary's greedy
decoding makes ``max_length - 1`` passes through the YAML's layout, and under sequence
parallelism or MoE (no key/value cache) each pass is a whole forward-only pipeline schedule, 16
stages for the 16-GPU YAMLs (3 passes instead of 11 took their decoding from ~30 s to ~4-7 s
each on a loaded machine). Three passes run the same code as eleven (the first one, then passes
fed back the decoded tokens); the decoding's numerics against one process are checked in
``tests/recipes/test_generation.py``. The CPU YAMLs train (and the summary decodes) batches of 8
rows per rank instead of 72: the uncached MoE decoding of 72 rows cost more than its training.

* ``clip_llama_cpu``: its own layout and model, tp 2 x pp 2 (4 processes), as shipped;
* ``clip_llama_moe_cpu``: its own layout and model, expert 2 x tensor 2 x dp 2 (FSDP2, 4
  processes), as shipped, with the expert-load monitor (router statistics, heatmap);
* ``clip_llama_1gpu``: its own layout, one process (``data_parallel: none``);
* ``clip_llama_8gpu``: tp 4 x pp 2 -> tp 2 x pp 2 (4 processes; 1F1B, 4 micro-batches, FSDP2);
* ``clip_llama_16gpu``: tp 4 x pp 2 x dp 2 on 16 GPUs -> tp 2 x pp 2 on 4 processes (sequence
  parallel, interleaved 1F1B with 8 virtual stages per rank, FSDP2 engine). Eight CPU processes
  on 2 cores made these runs take over 15 minutes; the 8-process layout with the same options
  (sequence parallel, interleaved, FSDP2 over dp 2) is in the parity matrix.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
STEPS = 2
CAPTION_TOKENS = 4
"""Caption length of every run (``data.max_length``): <bos>, 2 words, <eos>."""


def _tiny_model(heads: int, decoder_layers: int, moe: bool = False) -> dict[str, Any]:
    tiny_moe = {"moe": {"num_experts": 8, "top_k": 2, "ffn_width": 32, "router_dim": 8}}
    return {
        "fusion": {
            "vision": {
                "image_size": 16,
                "patch_size": 8,
                "width": 32,
                "layers": 2,
                "heads": heads,
                "output_dim": 16,
            },
            "language": {
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": decoder_layers,
                "num_attention_heads": heads,
                "num_key_value_heads": heads,
                **(tiny_moe if moe else {}),
            },
            "adapter": {"heads": heads, "width": 32, "ffn_width": 64},
            "contrastive_dim": 16,
        }
    }


RUNS: dict[str, dict[str, Any]] = {
    "clip_llama_cpu": {"world": 4, "strategy": {}, "model": {}, "data": {"batch_size": 8}},
    "clip_llama_moe_cpu": {"world": 4, "strategy": {}, "model": {}, "data": {"batch_size": 8}},
    "clip_llama_1gpu": {
        "world": 1,
        "strategy": {},
        "model": _tiny_model(4, decoder_layers=2),
        "data": {"image_size": 16, "batch_size": 8},
    },
    "clip_llama_8gpu": {
        "world": 4,
        "strategy": {"tensor_parallel": 2},
        "model": _tiny_model(4, decoder_layers=2),
        "data": {"image_size": 16, "batch_size": 8},
    },
    "clip_llama_16gpu": {
        "world": 4,
        "strategy": {"tensor_parallel": 2},
        "model": _tiny_model(4, decoder_layers=8),  # 18 blocks for 2 x 8 virtual stages
        "data": {"image_size": 16, "batch_size": 8},
    },
    "clip_llama_moe_16gpu": {  # tp 1: pp 2 x dp 2 with ep 2, interleaved (v 8)
        "world": 4,
        "strategy": {"tensor_parallel": 1},
        "model": _tiny_model(4, decoder_layers=8, moe=True),
        "data": {"image_size": 16, "batch_size": 8},
    },
}
"""Per YAML: the processes it runs on and the overrides of its strategy, model and data."""


def overrides(name: str, root: Path) -> dict[str, Any]:
    """The override YAML of one run (CPU, :data:`STEPS` steps, no validation, the summary kept,
    captions of :data:`CAPTION_TOKENS` tokens)."""
    run = RUNS[name]
    shipped = yaml.safe_load((RECIPES / f"{name}.yaml").read_text())
    strategy = shipped["trainer"]["strategy"]
    strategy["init_args"].update(run["strategy"])
    return {
        "trainer": {
            "accelerator": "cpu",
            "devices": run["world"],
            "num_nodes": 1,
            "max_steps": STEPS,
            "limit_val_batches": 0,
            "logger": False,
            "enable_progress_bar": False,
            "default_root_dir": str(root),
            "strategy": strategy,
            "callbacks": [
                *(
                    [{"class_path": "lightning_mmpar.callbacks.ExpertLoadMonitor"}]
                    if "moe" in name
                    else []
                ),
                {
                    "class_path": "lightning_mmpar.recipes.summary.RunSummary",
                    "init_args": {"plots": False, "caption_batches": 1},
                },
            ],
        },
        "model": run["model"],
        "data": {**run["data"], "max_length": CAPTION_TOKENS},
    }


def run(name: str, root: Path) -> dict[str, Any]:
    """Fit ``name`` in this process (every rank of the world calls it) and return
    ``{"summary": summary.json, "precision": trainer precision, "printed": what the run
    summary printed on rank 0}``."""
    from tests.recipes import cli_worker

    root.mkdir(parents=True, exist_ok=True)
    extra = root / f"overrides.{os.getpid()}.yaml"  # one per rank: no rank reads another's write
    extra.write_text(yaml.safe_dump(overrides(name, root)))
    args = ["fit", "--config", str(RECIPES / f"{name}.yaml"), "--config", str(extra)]
    cli, printed = cli_worker.run(args)
    summary = json.loads((root / "summary.json").read_text())
    return {"summary": summary, "precision": cli.trainer.precision, "printed": printed}


def names(world_size: int) -> list[str]:
    """The YAMLs that run on ``world_size`` processes."""
    return [name for name, spec in RUNS.items() if spec["world"] == world_size]


def world(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Every YAML run of this world size."""
    return {name: run(name, Path(root) / name) for name in names(world_size)}
