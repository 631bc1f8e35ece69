"""docs/planner.md's LLaVA tables: the layout planner run on LLaVA-1.5-7B and 13B from their
config.json alone, on 8, 16, 32 and 64 H100 / H200 GPUs, beside the shipped launch
(recipes/llava_7b_16gpu.yaml: tensor 4 x pipeline 2, data parallel the rest).

    python benchmarks/plan_llava.py            # prints the markdown (no process, ~10 min)
    python benchmarks/plan_llava.py --smoke    # 7B on 8 H100s only

Each table row group is one planner run (what ``python -m lightning_mmpar.recipes.planner
--config recipes/llava_7b_16gpu.yaml --hf-config recipes/hf/<model>/config.json --gpus N
--device D --global-batch 128`` prints) at LLaVA-1.5's fine-tuning batch, 128 conversations of
up to 2048 tokens with one 336 px image (576 tokens) each: its three best layouts, then the
launch's layout (tp 4 x pp 2, 4 micro-batches, FSDP2, dp = N / 8, its per-rank batch set to
128 / dp for the same global batch) priced the same way, with its rank.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from lightning_mmpar.layout.planner import _predict, describe
from lightning_mmpar.recipes import planner
from lightning_mmpar.recipes.yaml_layout import yaml_layout

ROOT = Path(__file__).resolve().parents[1]
YAML = ROOT / "recipes" / "llava_7b_16gpu.yaml"
MODELS = {"LLaVA-1.5-7B": "llava-1.5-7b", "LLaVA-1.5-13B": "llava-1.5-13b"}
GLOBAL_BATCH = 128


def _row(label: str, p: Any) -> str:
    if not p.fits:
        return f"| {label} | does not fit: {p.reason} | | | | |"
    return (
        f"| {label} | {p.memory.total / 2**30:.1f} | {p.comm_total_bytes / 1e9:.1f} | "
        f"{p.bubble:.3f} | {p.step_seconds:.3f} | {100 * p.mfu:.1f}% |"
    )


def cell(
    directory: str, gpus: int, device: str, folder: Path, extra: Sequence[str] = ()
) -> list[str]:
    """Markdown rows of one planner run on ``recipes/hf/<directory>`` (``extra``: more planner
    arguments): its best three and the shipped launch's layout."""
    config = yaml.safe_load(YAML.read_text())
    dp = gpus // 8  # the launch: tp 4 x pp 2, data parallel the rest
    config["data"]["init_args"]["batch_size"] = GLOBAL_BATCH // dp  # the same global batch
    path = folder / f"llava_{gpus}.yaml"
    path.write_text(yaml.safe_dump(config))
    hf = ROOT / "recipes" / "hf" / directory / "config.json"
    argv = ["--config", str(path), "--hf-config", str(hf), "--gpus", str(gpus)]
    argv += ["--device", device, "--global-batch", str(GLOBAL_BATCH), *extra]
    args = planner._parser().parse_args(argv)
    run = planner._prepare(args)
    ranked, _ = planner._rank(args, run)
    rows = [_row(f"{gpus} | {describe(p.layout)}", p) for p in ranked[:3]]
    if not ranked:
        rows = [f"| {gpus} | no layout fits | | | | | |"]
    own = yaml_layout(run.config, run.base, gpus)
    if not isinstance(own, str):
        mine = _predict(run.model(own), own, run.device, run.graph, None, run.place)
        place = 1 + sum(p.step_seconds < mine.step_seconds for p in ranked)
        rank = f" (rank {place} of {len(ranked) + 1})" if mine.fits else ""
        rows.append(_row(f"{gpus} | **launch** {describe(own)}{rank}", mine))
    return rows


def tables(
    models: list[str],
    devices: list[str],
    sizes: list[int],
    directories: dict[str, str] | None = None,
    extra: list[str] | None = None,
) -> str:
    """Every model and device: one markdown table over the GPU counts (``directories``: table
    title -> recipes/hf/<directory>, default :data:`MODELS`; ``extra``: more planner options)."""
    directories = MODELS if directories is None else directories
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            for device in devices:
                out += [f"#### {model} on {device.upper()} (bf16)", ""]
                out += ["| GPUs | layout | mem/rank GiB | comm GB/step | bubble | step s | MFU |"]
                out += ["|---|---|---|---|---|---|---|"]
                for gpus in sizes:
                    out += cell(directories[model], gpus, device, Path(tmp), extra or [])
                out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="7B on 8 H100s only")
    args = p.parse_args(argv)
    if args.smoke:
        text = tables(["LLaVA-1.5-7B"], ["h100"], [8])
    else:
        text = tables(list(MODELS), ["h100", "h200"], [8, 16, 32, 64])
    print(text)
    return text


if __name__ == "__main__":
    main()
