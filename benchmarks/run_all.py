"""Run every benchmark, one after another; each writes docs/results/<name>.json (+ .png).

    python benchmarks/run_all.py                     # full runs (2-core budget: ~15 minutes)
    python benchmarks/run_all.py --smoke --out-dir /tmp/r   # each for one short iteration
    python benchmarks/run_all.py --only overhead,zero

Each benchmark runs in its own Python process (``python benchmarks/<script> [--smoke]
--out-dir DIR``), so one failing does not hide the others; the exit status is non-zero when any
failed. Wall seconds per benchmark go to ``<out-dir>/run_all.json``. docs/results.md shows the
results and the command behind each.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from report import RESULTS, write_result

HERE = Path(__file__).resolve().parent
BENCHMARKS: dict[str, tuple[str, str]] = {
    "overhead": ("bench_overhead.py", "1-2: vs Lightning ddp, FSDP2, tensor parallel"),
    "zero": ("bench_zero.py", "3, 8: FSDP2 / DDP vs DeepSpeed ZeRO-2 / ZeRO-3; torchtitan"),
    "memory_comm": ("bench_memory_comm.py", "4-5: memory per rank vs ideal; bytes per collective"),
    "pipeline": ("bench_pipeline.py", "6: schedules, partitions; bubble vs formula"),
    "scaling": ("bench_scaling.py", "7: step time and memory as the work doubles"),
    "planner": ("bench_planner.py", "planner: predicted vs measured step-time ranking"),
    "tensor_parallel": ("bench_tensor_parallel.py", "tp2 combine and vision placement options"),
    "stability": ("bench_stability.py", "stability callbacks' overhead; fp8 emulation speed"),
    "learning": (
        "bench_learning.py",
        "the CPU recipes trained through the CLI to a 0.6 zero-shot bar",
    ),
    "packing": (
        "bench_packing.py",
        "ragged data: non-pad fraction and target tokens/s, packed vs padded",
    ),
    "noncolocated": (
        "bench_planner.py",
        "the vision tower on its own rank vs colocated: step time on the same work, measured "
        "and predicted by the planner",
    ),
    "hf_tax": (
        "bench_hf_tax.py",
        "LLaVA training step: our blocks vs transformers' own model (CPU, fp32)",
    ),
    "hf_tax_qwen": (
        "bench_hf_tax_qwen.py",
        "Qwen2-VL, Qwen2.5-VL, Qwen3-VL-MoE training step: our blocks vs transformers (CPU, fp32)",
    ),
}
"""Benchmark name -> (script, what it measures: the issue's item numbers)."""

ARGS: dict[str, tuple[str, ...]] = {"noncolocated": ("--noncolocated", "--rounds", "3")}
"""Benchmark name -> the script's arguments beyond ``--smoke`` / ``--out-dir``:
``bench_planner.py --noncolocated`` runs :mod:`bench_noncolocated`'s world once and writes
both noncolocated.json and planner_noncolocated.json from it."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="each benchmark for one iteration")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--only", default=",".join(BENCHMARKS), help="comma-separated names")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        raise SystemExit(f"--only: unknown benchmarks {unknown}; choose from {list(BENCHMARKS)}")
    rows: dict[str, dict[str, Any]] = {}
    for name in names:
        script, what = BENCHMARKS[name]
        cmd = [sys.executable, str(HERE / script), *ARGS.get(name, ())]
        if Path(args.out_dir).resolve() != RESULTS.resolve():
            cmd += ["--out-dir", str(args.out_dir)]
        cmd += ["--smoke"] if args.smoke else []
        print(f"== {name}: {what}\n   {' '.join(cmd[1:])}", flush=True)
        start = time.perf_counter()
        rc = subprocess.run(cmd, check=False).returncode
        rows[name] = {"script": script, "rc": rc, "wall_s": round(time.perf_counter() - start, 1)}
    print(f"\n{'benchmark':16} {'rc':>3} {'wall s':>8}")
    for name, row in rows.items():
        print(f"{name:16} {row['rc']:>3} {row['wall_s']:>8}")
    total = sum(r["wall_s"] for r in rows.values())
    print(f"{'total':16} {'':>3} {total:>8.1f}")
    write_result(
        "run_all", {"smoke": args.smoke, "benchmarks": rows, "total_s": total}, args.out_dir
    )
    return 1 if any(r["rc"] for r in rows.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
