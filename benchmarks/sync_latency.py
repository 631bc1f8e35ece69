"""The cost of one synchronising collective on a loaded CPU world (for the planner benchmark).

Idle, a gloo all-reduce of 4 bytes returns in ~0.2 ms. During training every rank computes
between collectives, and when processes outnumber cores (4 gloo processes on 2 cores) a call
also waits for peers the scheduler has paused: the time-sharing of compute is no longer free.
:func:`loaded_call_seconds` measures that extra cost per call, independently of any layout:
every rank runs ``calls`` rounds of (``gap_s`` of one-thread matmul, then a 4-byte all-reduce)
and, separately, the same compute with no collective in between (ends on a barrier); the
difference per call is the loaded cost of one synchronising call.
"""

from __future__ import annotations

import time

import torch


def _compute(rounds: int) -> None:
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    for _ in range(rounds):
        a @ b


def _rounds_for(seconds: float) -> int:
    """Matmul rounds that take ``seconds`` on this thread (measured, idle)."""
    start, n = time.perf_counter(), 200
    _compute(n)
    per = (time.perf_counter() - start) / n
    return max(1, int(seconds / per))


def loaded_call_seconds(calls: int = 60, gap_s: float = 0.002, repeats: int = 3) -> float:
    """Extra seconds one 4-byte all-reduce over the world costs between compute gaps of
    ``gap_s`` (median over ``repeats``; >= 0). Collective: every rank calls it."""
    from lightning_mmpar.parallel import comm

    rounds = comm.all_reduce(torch.tensor(float(_rounds_for(gap_s))), op="max")
    rounds_n, flag = int(rounds.item()), torch.zeros(1)
    extra = []
    for _ in range(repeats):
        comm.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            _compute(rounds_n)
        comm.barrier()
        free = time.perf_counter() - start
        comm.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            _compute(rounds_n)
            comm.all_reduce(flag)
        comm.barrier()
        extra.append(max(0.0, (time.perf_counter() - start - free) / calls))
    return sorted(extra)[len(extra) // 2]


def _worker(rank: int, size: int, calls: int, gap_s: float) -> float:
    torch.set_num_threads(1)
    return loaded_call_seconds(calls=calls, gap_s=gap_s)


def main(argv: list[str] | None = None) -> None:
    """``python benchmarks/sync_latency.py [--world 4]``: print the loaded cost of one call."""
    import argparse

    from lightning_mmpar.testing import spawn

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4, help="gloo processes (default 4)")
    p.add_argument("--calls", type=int, default=60, help="timed rounds per repeat")
    p.add_argument("--gap-ms", type=float, default=2.0, help="compute between calls, ms")
    args = p.parse_args(argv)
    got = spawn(_worker, args.world, args.calls, args.gap_ms / 1e3, timeout=300)
    print(
        f"loaded cost of one 4-byte all-reduce, {args.world} gloo processes, "
        f"{args.gap_ms} ms compute between calls: {got[0] * 1e3:.3f} ms"
    )


if __name__ == "__main__":
    main()
