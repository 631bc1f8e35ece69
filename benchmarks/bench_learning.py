"""Learning bars: the CPU recipes trained through their CLI until they must recognise digits.

    python benchmarks/bench_learning.py            # writes docs/results/learning.json
    python benchmarks/bench_learning.py --smoke    # the code path: 2 steps each, one process

Two runs of ``python -m lightning_mmpar.recipes.clip_llama fit`` on CPU, each ending with the
run summary (:class:`~lightning_mmpar.recipes.summary.RunSummary`) measured on the 360
held-out digits:

* ``recipe tp2 x pp2``: ``recipes/clip_llama_cpu.yaml`` at its shipped layout (tensor 2 x
  pipeline 2, 4 processes), 150 of the demo's 400 steps (cosine schedule over 150), validated
  once at the end; then the greedy caption accuracy of the first 72 held-out images;
* ``moe one process``: ``recipes/clip_llama_moe_cpu.yaml``'s model (4 experts top-2 in every
  decoder FFN) on one process, 200 steps; the summary's router statistics are kept.

Each must reach a zero-shot accuracy of :data:`BAR` (the issue's bar was 0.90, which the full
400-step demo reaches: docs/recipe.md; these shorter runs hold a lowered one). A full run exits
with status 1 when a bar is missed. These runs were the test suite's learning bars until the
suite had to fit in 20 minutes on 2 cores; the tests keep short runs of the same commands (a
checkpoint written, loaded on another layout, its captions equal to the summary's accuracy).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).parent))
from report import ROOT, write_result

BAR = 0.6
"""Zero-shot accuracy on the 360 held-out digits each run must reach (lowered from 0.90)."""
RUNS: dict[str, dict[str, Any]] = {
    "recipe tp2 x pp2": {"yaml": "clip_llama_cpu.yaml", "steps": 150, "trainer": {}},
    "moe one process": {
        "yaml": "clip_llama_moe_cpu.yaml",
        "steps": 200,
        "trainer": {"devices": 1, "strategy": "auto"},
        "callbacks": [{"class_path": "lightning_mmpar.callbacks.ExpertLoadMonitor"}],
    },
}
"""Run name -> the shipped YAML, its steps and the trainer settings that differ from it."""
SMOKE: dict[str, Any] = {
    "devices": 1,
    "strategy": "auto",
    "max_steps": 2,
    "val_check_interval": 2,
    "limit_val_batches": 1,
}
"""``--smoke``: each run on one process for 2 steps, validated on one batch (the code path of
the benchmark, not its figures; the tests run the shipped layouts)."""


def overrides(name: str, steps: int, root: Path, smoke: bool = False) -> dict[str, Any]:
    """The override YAML of one run: ``steps`` steps, one validation at the end, the run
    summary (greedy captions on one batch of 72 images), no logger, no checkpoint."""
    run = RUNS[name]
    return {
        "trainer": {
            "max_steps": steps,
            "val_check_interval": steps,
            "default_root_dir": str(root),
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            **run["trainer"],
            **(SMOKE if smoke else {}),
            "callbacks": [
                *run.get("callbacks", []),
                {
                    "class_path": "lightning_mmpar.recipes.summary.RunSummary",
                    "init_args": {"plots": False, "caption_batches": 1},
                },
            ],
        }
    }


def train(name: str, root: Path, smoke: bool = False) -> dict[str, Any]:
    """Run one CLI fit; its summary's figures and the wall seconds of the whole command."""
    root.mkdir(parents=True, exist_ok=True)
    extra = root / "overrides.yaml"
    extra.write_text(yaml.safe_dump(overrides(name, RUNS[name]["steps"], root, smoke)))
    config = str(ROOT / "recipes" / RUNS[name]["yaml"])
    cmd = [sys.executable, "-m", "lightning_mmpar.recipes.clip_llama", "fit"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    start = time.perf_counter()
    done = subprocess.run(
        [*cmd, "--config", config, "--config", str(extra)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{name}: the CLI failed\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    summary = json.loads((root / "summary.json").read_text())
    train_rows = summary["history"]["train"]
    return {
        "yaml": RUNS[name]["yaml"],
        "steps": summary["steps"],
        "layout": summary["layout"],
        "zero_shot_acc": summary["zero_shot_acc"],
        "caption_acc_greedy": summary["caption_acc_greedy"],
        "first_train_loss": train_rows[0]["train_loss"],
        "last_train_loss": train_rows[-1]["train_loss"],
        "router": summary.get("router"),
        "bar": BAR,
        "met": summary["zero_shot_acc"] >= BAR,
        "wall_s": round(wall, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="2 steps per run, one process")
    p.add_argument("--out-dir", type=Path, default=None)
    args = p.parse_args(argv)
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in RUNS:
            runs[name] = train(name, Path(tmp) / name.replace(" ", "_"), args.smoke)
            r = runs[name]
            print(
                f"{name}: {r['steps']} steps, zero-shot {r['zero_shot_acc']:.3f} (bar {BAR}), "
                f"greedy caption {r['caption_acc_greedy']:.3f}, {r['wall_s']} s",
                flush=True,
            )
    path = write_result("learning", {"smoke": args.smoke, "runs": runs}, args.out_dir)
    print(f"wrote {path}")
    missed = [n for n, r in runs.items() if not r["met"]]
    if missed and not args.smoke:
        print(f"below the bar {BAR}: {missed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
