"""docs/planner.md's Qwen-VL tables: the layout planner run on Qwen2-VL-7B, Qwen2.5-VL-72B and
Qwen3-VL-30B-A3B from their config.json alone (recipes/hf/), on 8, 16, 32 and 64 H100 / H200
GPUs, beside the brief's launch (tp 4 x pp 2, data parallel the rest); and the best
non-colocated layout (the vision tower on its own ranks) against the best colocated one.

    python benchmarks/plan_qwen.py                 # the layout tables (no process)
    python benchmarks/plan_qwen.py --noncolocated  # the colocated vs non-colocated table
    python benchmarks/plan_qwen.py --smoke         # Qwen2-VL-7B on 8 H100s only

Each row group is one planner run, what ``python -m lightning_mmpar.recipes.planner --config
recipes/llava_7b_16gpu.yaml --hf-config recipes/hf/<model>/config.json --gpus N --device D
--global-batch 128 --vision-ranks 0`` prints: the recipe's LLaVA-1.5-style second stage (ViT
frozen, caption loss, bf16-mixed, 2048 tokens per row) at 128 samples of one image of 256
language tokens (1024 ViT patches) each; colocated layouts only (``--vision-ranks 0``; the
non-colocated ones are the ``--noncolocated`` table's). The launch's layout (:mod:`plan_llava`)
is priced the same way, with its rank.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import plan_llava
import yaml
from plan_llava import GLOBAL_BATCH, ROOT, YAML

from lightning_mmpar.layout.planner import describe
from lightning_mmpar.recipes import planner

MODELS = {
    "Qwen2-VL-7B-Instruct": "qwen2-vl-7b-instruct",
    "Qwen2.5-VL-72B-Instruct": "qwen2.5-vl-72b-instruct",
    "Qwen3-VL-30B-A3B-Instruct": "qwen3-vl-30b-a3b-instruct",
}
"""Table title -> recipes/hf/<directory>."""
NONCOLOCATED = {
    "Qwen2-VL-7B-Instruct": "qwen2-vl-7b-instruct",
    "Qwen2.5-VL-32B-Instruct (27B-class)": "qwen2.5-vl-32b-instruct",
}
"""The models of the colocated vs non-colocated table."""


def tables(models: list[str], devices: list[str], sizes: list[int]) -> str:
    """Every model and device: one markdown table over the GPU counts (colocated)."""
    return plan_llava.tables(models, devices, sizes, MODELS, ["--vision-ranks", "0"])


def best_pair(directory: str, gpus: int, device: str, train_vision: bool) -> tuple[Any, Any]:
    """The best colocated and the best non-colocated prediction of one planner run."""
    config = yaml.safe_load(YAML.read_text())
    config["model"]["finetune"]["train_vision"] = train_vision
    config["data"]["init_args"]["batch_size"] = GLOBAL_BATCH // (gpus // 8)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "qwen.yaml"
        path.write_text(yaml.safe_dump(config))
        hf = ROOT / "recipes" / "hf" / directory / "config.json"
        argv = ["--config", str(path), "--hf-config", str(hf), "--gpus", str(gpus)]
        argv += ["--device", device, "--global-batch", str(GLOBAL_BATCH)]
        args = planner._parser().parse_args(argv)
        ranked, _ = planner._rank(args, planner._prepare(args))
    colocated = next(p for p in ranked if not p.layout.vision_ranks)
    apart = next((p for p in ranked if p.layout.vision_ranks), None)
    return colocated, apart


def noncolocated_table(gpus: int = 16, device: str = "h100") -> str:
    """Markdown: per model and ViT mode, the best of each kind and the predicted gain."""
    out = [
        "| model, ViT | best colocated | best non-colocated | tokens/s per GPU |",
        "|---|---|---|---|",
    ]
    for title, directory in NONCOLOCATED.items():
        for train in (False, True):
            co, apart = best_pair(directory, gpus, device, train)
            mode = "trained" if train else "frozen"
            far = (
                "none fits"
                if apart is None
                else f"{describe(apart.layout)}, {apart.step_seconds:.3f} s"
            )
            gain = "" if apart is None else f"x{co.step_seconds / apart.step_seconds:.2f}"
            near = f"{describe(co.layout)}, {co.step_seconds:.3f} s"
            out.append(f"| {title}, {mode} | {near} | {far} | {gain} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="Qwen2-VL-7B on 8 H100s only")
    p.add_argument("--noncolocated", action="store_true", help="the non-colocated table")
    p.add_argument("--devices", default="h100,h200")
    p.add_argument("--models", default=",".join(MODELS))
    args = p.parse_args(argv)
    if args.smoke:
        text = tables(["Qwen2-VL-7B-Instruct"], ["h100"], [8])
    elif args.noncolocated:
        text = noncolocated_table()
    else:
        models = [m.strip() for m in args.models.split(",") if m.strip()]
        text = tables(models, args.devices.split(","), [8, 16, 32, 64])
    print(text, flush=True)
    return text


if __name__ == "__main__":
    main()
