"""The CLIP-LLaMA recipe on layouts a new user tries first (issue 9), short CPU runs.

* tp 1 x pp 1 x dp 2 with the YAML's ``data_parallel: fsdp``: FSDP2 used to refuse the fusion
  model's 0-dim parameters (adapter gates, logit scale) and the run exited 1; it must train
  3 steps with finite losses and write its last checkpoint (FSDP2 shards next to replicated
  0-dim parameters). About 25 s on 2 CPU cores: the YAML's tiny model, no validation.
* tp 2 x dp 2 with FSDP2: the adapters' cross-attention runs on the dedicated vision-language
  mesh, which must derive from the same root mesh as the dp mesh, or ``fully_shard`` refuses
  to combine them ("Cannot concatenate DeviceMeshes derived from different device meshes").
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CPU_YAML = ROOT / "recipes" / "clip_llama_cpu.yaml"


def _fit(tmp_path: Path, trainer: dict, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    overrides = tmp_path / "overrides.yaml"
    overrides.write_text(yaml.safe_dump({"trainer": trainer}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    args = ["fit", "--config", str(CPU_YAML), "--config", str(overrides)]
    return subprocess.run(
        [sys.executable, "-m", "lightning_mmpar.recipes.clip_llama", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def _run_layout(tmp_path: Path, devices: int, tp: int) -> None:
    assert (
        yaml.safe_load(CPU_YAML.read_text())["trainer"]["strategy"]["init_args"]["data_parallel"]
        == "fsdp"
    ), "the run below relies on the YAML's engine"
    proc = _fit(
        tmp_path,
        {
            "devices": devices,
            "max_steps": 3,
            "limit_val_batches": 0,
            "logger": False,
            "enable_progress_bar": False,
            "default_root_dir": str(tmp_path),
            "strategy": {
                "class_path": "lightning_mmpar.strategy.MultimodalParallelStrategy",
                "init_args": {"tensor_parallel": tp, "pipeline_parallel": 1},
            },
            "callbacks": [
                {
                    "class_path": "lightning_mmpar.recipes.summary.RunSummary",
                    "init_args": {"plots": False},
                },
                {
                    "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                    "init_args": {"save_last": True, "save_top_k": 0},
                },
            ],
        },
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 3, summary
    layout = (summary["layout"]["tp"], summary["layout"]["pp"], summary["layout"]["dp"])
    assert layout == (tp, 1, devices // tp)
    rows = summary["history"]["train"]
    assert rows and all(math.isfinite(r["train_loss"]) for r in rows), rows
    assert Path(summary["checkpoint"]).exists(), summary["checkpoint"]


def test_dp2_fsdp_trains_the_fusion_model(tmp_path: Path) -> None:
    _run_layout(tmp_path, devices=2, tp=1)


def test_tp2_dp2_fsdp_trains_the_fusion_model(tmp_path: Path) -> None:
    _run_layout(tmp_path, devices=4, tp=2)
