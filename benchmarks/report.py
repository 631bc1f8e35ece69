"""What every benchmark shares: where results go, the machine record, interleaved timing.

Each benchmark writes ``docs/results/<name>.json`` (and ``<name>.png`` where it plots) with
:func:`write_result`; ``docs/results.md`` shows them. Comparisons run both sides in one
invocation, interleaved A B A B (:func:`interleaved`), and report the median of the paired
ratios with its spread (:func:`ratio_stats`): these machines are noisy, a ratio measured in one
run under one load is what can be compared.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
CPU_YAML = ROOT / "recipes" / "clip_llama_cpu.yaml"


def machine() -> dict[str, Any]:
    """The machine a result was measured on: cores, platform, torch and Lightning versions."""
    import lightning

    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
    }


def write_result(name: str, payload: dict[str, Any], out_dir: Path | None = None) -> Path:
    """Write ``payload`` + the machine + the command line to ``<out_dir>/<name>.json``
    (default ``docs/results/``); returns the path."""
    out = Path(out_dir) if out_dir is not None else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    record = {
        "command": "python " + " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "machine": machine(),
        **payload,
    }
    path.write_text(json.dumps(record, indent=1, default=float) + "\n")
    return path


def save_figure(fig: Any, name: str, out_dir: Path | None = None) -> Path:
    """Save a matplotlib figure as ``<out_dir>/<name>.png`` (default ``docs/results/``)."""
    out = Path(out_dir) if out_dir is not None else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def interleaved(
    sides: dict[str, Callable[[], Sequence[float]]], repeats: int
) -> dict[str, list[list[float]]]:
    """Run every side once per repeat, in turn, the order reversed every other repeat (A B, B A,
    A B ...: neither side always runs first, after the same neighbour); each call returns its
    per-step seconds. Returns ``{side: [per-step seconds of repeat 0, of repeat 1, ...]}``."""
    out: dict[str, list[list[float]]] = {k: [] for k in sides}
    names = list(sides)
    for i in range(repeats):
        for name in names if i % 2 == 0 else names[::-1]:
            out[name].append(list(sides[name]()))
    return out


def ratio_stats(
    ours: Sequence[Sequence[float]], theirs: Sequence[Sequence[float]]
) -> dict[str, Any]:
    """Median and spread of ``median(ours_i) / median(theirs_i)`` over paired repeats ``i``
    (ours' step time over the peer's: below 1 is faster). ``spread`` = max - min of the
    per-repeat ratios; ``ours_s`` / ``theirs_s``: median step seconds over all steps."""
    ratios = [
        statistics.median(a) / statistics.median(b) for a, b in zip(ours, theirs, strict=True)
    ]
    flat_a = [t for r in ours for t in r]
    flat_b = [t for r in theirs for t in r]
    return {
        "ratio": statistics.median(ratios),
        "spread": max(ratios) - min(ratios),
        "ratios": ratios,
        "ours_s": statistics.median(flat_a),
        "theirs_s": statistics.median(flat_b),
    }


if __name__ == "__main__":
    raise SystemExit(
        "report.py is the benchmarks' shared library (no CLI): run `python benchmarks/run_all.py`"
        " (every benchmark) or one `python benchmarks/bench_<name>.py --help`."
    )
