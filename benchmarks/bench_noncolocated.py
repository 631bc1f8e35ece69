"""The vision tower on its own ranks against colocated: step time on the same work (one run).

    python benchmarks/bench_noncolocated.py            # docs/results/noncolocated.json
    python benchmarks/bench_noncolocated.py --smoke --out-dir /tmp/r   # 1 repeat, 3 steps

**Work.** The ragged batches of the ragged-parity test (4 packed rows of 24 tokens mixing
text-only, one- and three-image samples, 16 px images) and its tiny fusion model in the recipe's
module, ``--steps`` steps per run (the first one builds the schedule and is not timed).

**Sides.** ``colocated``: ``tensor_parallel=2`` on 2 processes (the tower tp-sharded on both);
``noncolocated``: ``vision_ranks=1, tensor_parallel=2`` on 3 processes (the tower alone on the
third). Each repeat spawns one world per side, interleaved A B, B A (:func:`report.interleaved`).
A step's time is the slowest rank's (``on_train_batch_start`` to ``_end``).

**Reported.** ``ratio``: non-colocated over colocated step time (below 1: faster), median over
repeats, with its spread; ``device_seconds_ratio``: the same times the process counts (3 / 2):
what the extra rank costs per step. On a CPU machine with fewer cores than processes the ranks
share cores, so the figures say what the data flow costs here, not what separate GPUs would
give (Megatron-Bridge's MIMO reports its gains on GPUs).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback

sys.path.insert(0, str(Path(__file__).parent))
from report import interleaved, ratio_stats, write_result

SIDES: dict[str, tuple[int, dict[str, Any]]] = {
    "colocated": (2, {"tensor_parallel": 2}),
    "noncolocated": (3, {"tensor_parallel": 2, "vision_ranks": 1}),
}


class StepTimes(Callback):
    """Wall seconds of each training step on this rank."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.seconds.append(time.perf_counter() - self._start)


def worker(rank: int, world: int, strategy: dict[str, Any], steps: int) -> list[float]:
    """``steps`` steps of the ragged batches under ``strategy``; this rank's step seconds."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's tests/
    from torch.utils.data import DataLoader

    from lightning_mmpar import MultimodalParallelStrategy
    from tests.recipes import parity_matrix_worker as pm
    from tests.recipes import ragged_parity_worker as rp
    from tests.recipes import recipe_faults_worker as rw

    module = pm.build(rp.VOCAB, None)
    module.text_length = rp.TOKENS
    times = StepTimes()
    trainer = rw.quiet_trainer(
        strategy=MultimodalParallelStrategy(**strategy),
        devices=world,
        max_epochs=1,
        use_distributed_sampler=False,
        limit_val_batches=0,
        callbacks=[times],
    )
    trainer.fit(module, DataLoader(rp.batches(steps), batch_size=None))  # type: ignore[arg-type]
    return times.seconds


def run_side(name: str, steps: int) -> list[float]:
    """One world of ``name``: the slowest rank's seconds of each step but the first."""
    from lightning_mmpar.testing import spawn

    world, strategy = SIDES[name]
    per_rank = spawn(worker, world, strategy, steps, timeout=600)
    return [max(step) for step in zip(*per_rank, strict=True)][1:]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="1 repeat of 3 steps")
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    steps, repeats = (3, 1) if args.smoke else (args.steps, args.repeats)
    torch.set_num_threads(1)
    sides = {name: (lambda n=name: run_side(n, steps)) for name in SIDES}
    times = interleaved(sides, repeats)
    stats = ratio_stats(times["noncolocated"], times["colocated"])
    processes = {name: SIDES[name][0] for name in SIDES}
    payload = {
        "steps": steps,
        "repeats": repeats,
        "processes": processes,
        "step_seconds": times,
        **stats,
        "device_seconds_ratio": stats["ratio"] * processes["noncolocated"] / processes["colocated"],
    }
    path = write_result("noncolocated", payload, args.out_dir)
    print(
        f"non-colocated / colocated step time: {stats['ratio']:.2f} (spread {stats['spread']:.2f})"
    )
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
