"""Checkpoints for the export tests: the CPU recipe YAML, its model shrunk, trained 2 steps
under ``mm_parallel`` in two layouts of one 4-process gloo world (importable by spawned ranks).

* ``tp2_pp2``: the YAML's own layout, tensor 2 x pipeline 2 (1F1B, 2 micro-batches);
* ``tp2_dp2``: tensor 2 x data-parallel 2 with FSDP2 (2-D DTensor shards).

The model: a 1-layer ViT, one adapter block, 2 joint-attention decoder layers (text temperature
0.7, which the LLaMA export folds into ``k_proj``); the digits tokenizer's vocabulary is padded
to the YAML's ``vocab_multiple`` 8 (the export strips the padding rows).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
STEPS = 2
LAYOUTS: dict[str, dict[str, Any]] = {
    "tp2_pp2": {"tensor_parallel": 2, "pipeline_parallel": 2},
    "tp2_dp2": {"tensor_parallel": 2, "pipeline_parallel": 1, "data_parallel": "fsdp"},
}
"""Run name -> overrides of the YAML strategy's ``init_args``."""
MODEL: dict[str, Any] = {
    "fusion": {
        "vision": {
            "image_size": 16,
            "patch_size": 8,
            "width": 32,
            "layers": 1,
            "heads": 2,
            "mlp_ratio": 2.0,
            "output_dim": 16,
            "pool_type": "tok",
        },
        "language": {
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "joint_attention": True,
            "text_temperature": 0.7,
        },
        "adapter": {"num_blocks": 1, "heads": 2, "width": 32, "ffn_width": 48, "dropout": 0.0},
        "contrastive_dim": 16,
    }
}


def checkpoint_dir(root: Path, name: str) -> Path:
    """Where run ``name`` under ``root`` leaves its ``last.ckpt`` directory."""
    return root / name / "checkpoints" / "last.ckpt"


def overrides(name: str, root: Path) -> dict[str, Any]:
    """The override YAML of run ``name``: CPU, 2 steps, no validation, only ModelCheckpoint."""
    shipped = yaml.safe_load((RECIPES / "clip_llama_cpu.yaml").read_text())
    strategy = shipped["trainer"]["strategy"]
    strategy["init_args"].update(LAYOUTS[name])
    return {
        "trainer": {
            "devices": 4,
            "max_steps": STEPS,
            "limit_val_batches": 0,
            "logger": False,
            "enable_progress_bar": False,
            "default_root_dir": str(root / name),
            "strategy": strategy,
            "callbacks": [
                {
                    "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                    "init_args": {"save_last": True, "save_top_k": 0},
                }
            ],
        },
        "model": MODEL,
        "data": {"image_size": 16, "batch_size": 8},
    }


def world(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Fit every layout (each rank of the 4-process world calls it); return the global steps."""
    from lightning_mmpar.recipes.cli import run_cli

    steps = {}
    for name in LAYOUTS:
        base = Path(root)
        base.mkdir(parents=True, exist_ok=True)
        extra = base / f"overrides.{name}.{os.getpid()}.yaml"  # one per rank
        extra.write_text(yaml.safe_dump(overrides(name, base)))
        config = str(RECIPES / "clip_llama_cpu.yaml")
        cli = run_cli(["fit", "--config", config, "--config", str(extra)])
        cli.trainer.strategy.barrier()
        steps[name] = cli.trainer.global_step
    return {"rank": rank, "steps": steps}


def tiny_fusion_config() -> Any:
    """:data:`MODEL`'s fusion config as the dataclass (vocabulary left to the module)."""
    from lightning.pytorch.cli import instantiate_module

    from lightning_mmpar.recipes.module import ClipLlamaModule

    return instantiate_module(ClipLlamaModule, MODEL).fusion_config
