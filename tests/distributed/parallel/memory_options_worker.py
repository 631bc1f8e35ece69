"""Workers of tests/distributed/parallel/test_memory_options.py (importable by spawned processes).

Each run trains the toy transformer (:mod:`lightning_mmpar.examples.toy_transformer`) for
``STEPS`` steps under ``mm_parallel`` with one set of precision / memory options and returns the
logged losses, the first-step full gradients, the final full weights and what the options did.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader

from lightning_mmpar import MultimodalParallelStrategy
from lightning_mmpar.callbacks import DriftConfig, FP8Training
from lightning_mmpar.examples.toy_transformer import ToyConfig, ToyTransformer
from lightning_mmpar.precision import FP8Policy, fp8_modules
from tests.distributed.parallel import parity_worker as pw

STEPS = 5  # one epoch of the parity data


def toy_with_kinds(cfg: ToyConfig) -> ToyTransformer:
    """The toy with BlockSpec kinds on its blocks (embedding ``vision``, layers ``language``,
    head ``head``), so checkpointing by kind has something to select."""
    torch.manual_seed(0)
    model = ToyTransformer(cfg)
    model.embed.kind = "vision"  # type: ignore[assignment]
    for layer in model.layers:
        layer.kind = "language"  # type: ignore[assignment]
    model.head.kind = "head"  # type: ignore[assignment]
    return model


def fit(world: int, tp: int = 1, pp: int = 1, fp8: bool = False, **memory: Any) -> dict[str, Any]:
    """Train one layout (dp = world / (tp * pp)) with ``memory`` options (strategy arguments)
    and, with ``fp8``, the :class:`FP8Training` callback (emulated FP8; head kept in FP32)."""
    cfg = ToyConfig()
    model = toy_with_kinds(cfg)
    strategy = MultimodalParallelStrategy(
        tensor_parallel=tp,
        pipeline_parallel=pp,
        micro_batches=2 * pp if pp > 1 else None,
        **memory,
    )
    rec = pw.Recorder()
    callbacks: list[Any] = [rec]
    if fp8:
        policy = FP8Policy(keep_high_precision=("head.*",), high_precision="fp32", backend="auto")
        callbacks.append(FP8Training(policy, drift=DriftConfig(log_dir=tempfile.mkdtemp())))
    trainer = pw._trainer(strategy, world, STEPS, callbacks)
    dp = world // (tp * pp)
    trainer.fit(model, DataLoader(pw.dataset(cfg), batch_size=pw.GLOBAL_BATCH // dp))
    blocks = model.pipeline_blocks()
    fsdp = [m for m in model.modules() if isinstance(m, FSDPModule)]
    policies = [m._get_fsdp_state()._fsdp_param_group for m in fsdp]  # type: ignore[operator]
    return {
        "losses": rec.losses,
        "grads": rec.grads,
        "weights": pw.full_weights(model),
        "wrapped": [i for i, b in enumerate(blocks) if getattr(b, "_mmpar_block_options", False)],
        "fsdp_units": len(fsdp),
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "mp": sorted({str(g.mp_policy.param_dtype) for g in policies if g is not None}),
        "offload": sorted({type(g.offload_policy).__name__ for g in policies if g is not None}),
        "fp8": sorted(n for n, m in fp8_modules(model).items() if m.precision == "fp8"),
        "fp8_counters": dict(callbacks[-1].counters) if fp8 else {},
    }


def run_all(rank: int, world: int, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Every run of ``runs`` (name -> :func:`fit` keyword arguments, or :func:`fit_recipe`'s
    for a run with a ``recipe``) in this one world."""
    return {
        name: fit_recipe(world, **kw) if "recipe" in kw else fit(world, **kw)
        for name, kw in runs.items()
    }


RECIPES = Path(__file__).resolve().parents[3] / "recipes"


def yaml_precision_sections(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The commented ``precision.fp8`` section (FP8Training's arguments) and ``memory``
    strategy options of the shipped ``recipes/<name>.yaml``, uncommented."""
    import re

    import yaml

    lines = (RECIPES / f"{name}.yaml").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# precision.fp8:"))
    block = [line[2:] for line in lines[start:] if re.match(r"# (precision:|  )", line)]
    entry = yaml.safe_load("\n".join(block))["precision"]["fp8"]
    (memory,) = [line.split("# memory:", 1)[1] for line in lines if "# memory:" in line]
    return entry, yaml.safe_load(memory)


def fit_recipe(world: int, recipe: str, tp: int, steps: int = 3) -> dict[str, Any]:
    """The recipe CLI on ``recipes/<name>.yaml`` with its precision sections uncommented, the
    model shrunk to CPU size, tensor parallel ``tp``, for ``steps`` steps."""
    import yaml

    from lightning_mmpar.recipes.cli import run_cli

    name = recipe
    entry, memory = yaml_precision_sections(name)
    shipped = yaml.safe_load((RECIPES / f"{name}.yaml").read_text())
    strategy = shipped["trainer"]["strategy"]
    strategy["init_args"].update(tensor_parallel=tp, pipeline_parallel=1, **memory)
    # no pipeline: the shipped YAML's pipeline options are reset (refused at pp 1), not dropped
    # (a key left out of this override keeps the shipped YAML's value)
    strategy["init_args"].update(micro_batches=None, virtual_pipeline=1, schedule="1f1b")
    root = Path(tempfile.mkdtemp())
    heads = 4
    override = {
        "trainer": {
            "accelerator": "cpu",
            "devices": world,
            "num_nodes": 1,
            "max_steps": steps,
            "precision": "32-true",
            "limit_val_batches": 0,
            "logger": False,
            "enable_progress_bar": False,
            "enable_checkpointing": False,
            "default_root_dir": str(root),
            "strategy": strategy,
            "callbacks": [],
        },
        "precision": {"fp8": entry},
        "model": {
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
                    "num_hidden_layers": 2,
                    "num_attention_heads": heads,
                    "num_key_value_heads": heads,
                },
                "adapter": {"heads": heads, "width": 32, "ffn_width": 64},
                "contrastive_dim": 16,
            }
        },
        "data": {"image_size": 16, "batch_size": 8},
    }
    extra = root / "override.yaml"
    extra.write_text(yaml.safe_dump(override))
    cli = run_cli(["fit", "--config", str(RECIPES / f"{name}.yaml"), "--config", str(extra)])
    trainer, module = cli.trainer, cli.model
    (fp8,) = [c for c in trainer.callbacks if isinstance(c, FP8Training)]
    mods = fp8_modules(module)
    fsdp = [m for m in module.modules() if isinstance(m, FSDPModule)]
    groups = [m._get_fsdp_state()._fsdp_param_group for m in fsdp]  # type: ignore[operator]
    return {
        "steps": trainer.global_step,
        "loss": float(trainer.callback_metrics["train_loss"]),
        "fp8": sorted(n for n, m in mods.items() if m.precision == "fp8"),
        "pinned": sorted(n for n, m in mods.items() if m.pinned),
        "counters": dict(fp8.counters),
        "mp": sorted({str(g.mp_policy.param_dtype) for g in groups if g is not None}),
        "checkpointed": [
            getattr(b, "kind", "")
            for b in module.pipeline_blocks()
            if getattr(b, "_mmpar_block_options", False)
        ],
    }
