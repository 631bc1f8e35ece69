"""docs/planner.md's Qwen-VL tables: the layout planner run on Qwen2-VL-7B, Qwen2.5-VL-72B and
Qwen3-VL-30B-A3B from their config.json alone (recipes/hf/), on 8, 16, 32 and 64 H100 / H200
GPUs, beside the brief's launch (tp 4 x pp 2, data parallel the rest); and the best
non-colocated layout (the vision tower on its own ranks) against the best colocated one.

    python benchmarks/plan_qwen.py                 # the layout tables (no process)
    python benchmarks/plan_qwen.py --noncolocated  # the colocated vs non-colocated table
    python benchmarks/plan_qwen.py --noncolocated --tower-overlap  # its pipelined bound
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


def ranking(
    directory: str, gpus: int, device: str, train_vision: bool, overlap: bool = False
) -> list[Any]:
    """One planner run's ranked predictions (colocated and non-colocated, best first;
    ``overlap``: ``--tower-overlap``)."""
    config = yaml.safe_load(YAML.read_text())
    config["model"]["finetune"]["train_vision"] = train_vision
    config["data"]["init_args"]["batch_size"] = GLOBAL_BATCH // (gpus // 8)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "qwen.yaml"
        path.write_text(yaml.safe_dump(config))
        hf = ROOT / "recipes" / "hf" / directory / "config.json"
        argv = ["--config", str(path), "--hf-config", str(hf), "--gpus", str(gpus)]
        argv += ["--device", device, "--global-batch", str(GLOBAL_BATCH)]
        argv += ["--tower-overlap"] if overlap else []
        args = planner._parser().parse_args(argv)
        ranked, _ = planner._rank(args, planner._prepare(args))
    return ranked


def _cell(p: Any, ranked: list[Any], against: Any) -> str:
    """``layout, step (MFU; rank)`` and the tokens/s-per-GPU ratio against ``against``."""
    if p is None:
        return "none fits | "
    gain = "" if p is against else f" | x{against.step_seconds / p.step_seconds:.2f}"
    where = f"{100 * p.mfu:.1f}% MFU; rank {ranked.index(p) + 1}"
    return f"{describe(p.layout)}, {p.step_seconds:.3f} s ({where}){gain}"


def noncolocated_table(gpus: int = 16, device: str = "h100", overlap: bool = False) -> str:
    """Markdown: per model and ViT mode, the best colocated layout, the best non-colocated one
    (as the strategy runs it: the vision rank one batch ahead inside accumulation windows) and
    the best non-colocated one at one batch per step (the serial exchange), with the predicted
    tokens/s-per-GPU ratio against the colocated one (its step / theirs); ``overlap``: the
    non-colocated ones priced with ``--tower-overlap``."""
    out = [
        "| model, ViT | best colocated | best non-colocated | x | best non-colocated, "
        "one batch per step (serial) | x |",
        "|---|---|---|---|---|---|",
    ]
    for title, directory in NONCOLOCATED.items():
        for train in (False, True):
            ranked = ranking(directory, gpus, device, train, overlap)
            co = next(p for p in ranked if not p.layout.vision_ranks)
            apart = next((p for p in ranked if p.layout.vision_ranks), None)
            serial = next(
                (p for p in ranked if p.layout.vision_ranks and p.layout.accumulate == 1), None
            )
            mode = "trained" if train else "frozen"
            cells = [_cell(p, ranked, co) for p in (co, apart, serial)]
            out.append(f"| {title}, {mode} | {' | '.join(cells)} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="Qwen2-VL-7B on 8 H100s only")
    p.add_argument("--noncolocated", action="store_true", help="the non-colocated table")
    p.add_argument("--tower-overlap", action="store_true", help="--noncolocated: the bound")
    p.add_argument("--devices", default="h100,h200")
    p.add_argument("--models", default=",".join(MODELS))
    args = p.parse_args(argv)
    if args.smoke:
        text = tables(["Qwen2-VL-7B-Instruct"], ["h100"], [8])
    elif args.noncolocated:
        text = noncolocated_table(overlap=args.tower_overlap)
    else:
        models = [m.strip() for m in args.models.split(",") if m.strip()]
        text = tables(models, args.devices.split(","), [8, 16, 32, 64])
    print(text, flush=True)
    return text


if __name__ == "__main__":
    main()
