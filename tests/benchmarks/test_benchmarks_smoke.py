"""Every benchmark runs for one short iteration (``--smoke``) and its correctness checks hold
(issue 14): nothing here depends on timings, only on what the benchmarks assert about the work
they compare (the same losses on both sides, counted calls and bytes equal to the model's)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from run_all import BENCHMARKS  # noqa: E402


def _overhead(r: dict[str, Any]) -> None:
    pairs = [p for world in r["results"].values() for p in world.values()]
    assert pairs and all(p["same_work"] for p in pairs), pairs


def _planner(r: dict[str, Any]) -> None:
    assert r["calls"] and all(c["equal"] for c in r["calls"].values()), r["calls"]
    assert set(r["measured_step_s"]) == set(r["predicted"])


def _pipeline(r: dict[str, Any]) -> None:
    rows = r["results"]["pp2"]
    assert rows and all(row["step_s"] > 0 for row in rows.values())


CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "overhead": _overhead, "planner": _planner, "pipeline": _pipeline,
}  # fmt: skip


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_benchmark_smoke(name: str, tmp_path: Path) -> None:
    script = ROOT / "benchmarks" / BENCHMARKS[name][0]
    done = subprocess.run(
        [sys.executable, str(script), "--smoke", "--out-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=ROOT, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / f"{name}.json").read_text())
    assert result["machine"]["cpus"] and result["command"]
    CHECKS.get(name, lambda r: None)(result)


def test_results_page_renders_the_committed_results() -> None:
    """docs/results.md is generated from docs/results/*.json: every benchmark has a section,
    and the committed page is the generator's output for the committed JSON."""
    from results_md import render

    text = render()
    assert all(f"## {name}:" in text for name in BENCHMARKS)
    assert (ROOT / "docs" / "results.md").read_text() == text
