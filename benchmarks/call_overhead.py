"""Host seconds one collective call costs beyond its wire time, on the package's paths (CPU).

On a GPU a collective's host work (Python, DTensor's sharding propagation, FSDP2's copy-in /
copy-out and hooks) overlaps the kernels; on a CPU rank it is CPU time taken from compute.
:func:`host_call_seconds` measures it on a small synthetic model, independently of the layouts
the planner benchmark predicts: a stack of residual MLP blocks (LayerNorm, Linear ``w -> 4w``,
GELU, Linear ``4w -> w``) at batch 2 and width 32 (nothing to compute, nothing to move), run
forward + backward

* sharded with FSDP2 (``fully_shard`` per block and at the root, over the world), and
* with the tensor-parallel styles torch and Megatron use (``ColwiseParallel`` on the first
  Linear, ``RowwiseParallel`` on the second: one all-reduce in forward, one in backward) over
  a ``tp = 2`` sub-mesh,

each timed against the same blocks unsharded, interleaved. Per call: the extra seconds over the
collectives :class:`~lightning_mmpar.parallel.comm_count.CommCounter` counts, less the wire time
the cost model gives those calls (:func:`lightning_mmpar.layout.devices.collective_seconds` on
the measured link). Collective: every rank calls it.
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any

import torch
from torch import nn


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


def _stack(blocks: int, width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[_Block(width) for _ in range(blocks)])


def _step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).sum().backward()
    model.zero_grad(set_to_none=True)


def _timed(model: nn.Module, x: torch.Tensor) -> float:
    start = time.perf_counter()
    _step(model, x)
    return time.perf_counter() - start


def host_call_seconds(
    graph: Any, blocks: int = 6, width: int = 32, repeats: int = 15
) -> dict[str, float]:
    """``{"fsdp": s, "tp": s}``: host seconds per collective call beyond the wire, >= 0
    (module doc). ``graph``: the cost model's ``DeviceGraph`` of this world (its link gives the
    wire time subtracted)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from lightning_mmpar.layout.devices import collective_seconds
    from lightning_mmpar.parallel.comm_count import CommCounter
    from lightning_mmpar.topology import ParallelDims

    world = dist.get_world_size()
    x = torch.randn(2, width)
    out = {}
    for name, dims in (
        ("fsdp", ParallelDims(world_size=world)),
        ("tp", ParallelDims(world_size=world, tp=2)),
    ):
        dims.build_mesh("cpu")
        plain = _stack(blocks, width)
        model = copy.deepcopy(plain)
        if name == "fsdp":
            for block in model:
                fully_shard(block, mesh=dims.get_mesh("dp"))
            fully_shard(model, mesh=dims.get_mesh("dp"))
        else:
            plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
            for block in model:
                parallelize_module(block, dims.get_mesh("tp"), plan)
        for _ in range(3):
            _step(model, x)
            _step(plain, x)
        with CommCounter(dims) as counter:
            _step(model, x)
        ours, base = [], []
        for _ in range(repeats):
            base.append(_timed(plain, x))
            ours.append(_timed(model, x))
        calls = sum(n for k, n in counter.calls.items() if k != "self")
        ranks = list(range(dims.size(name if name == "tp" else "dp")))
        wire = sum(
            n * collective_seconds(graph, k.partition(".")[2], ranks, counter.bytes[k] / n)
            for k, n in counter.calls.items()
            if k != "self"
        )
        extra = statistics.median(ours) - statistics.median(base) - wire
        out[name] = max(0.0, extra / max(1, calls))
    return out


def gloo_alpha_beta(world: int, repeats: int = 20) -> tuple[float, float]:
    """Per-hop latency (s) and bandwidth (bytes/s) of the ring all-reduce of this world."""
    from lightning_mmpar.parallel import comm

    def timed(numel: int) -> float:
        t = torch.zeros(numel)
        comm.all_reduce(t)
        times = []
        for _ in range(repeats):
            comm.barrier()
            start = time.perf_counter()
            comm.all_reduce(t)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    small, big, nbytes = timed(1), timed(2**20), 4 * 2**20
    steps = 2 * (world - 1)
    return small / steps, steps * (nbytes / world) / max(big - small, 1e-9)


def _worker(rank: int, size: int) -> dict[str, float]:
    torch.set_num_threads(1)
    from lightning_mmpar.layout.devices import DeviceGraph

    alpha, beta = gloo_alpha_beta(size)
    graph = DeviceGraph.from_yaml(
        {"nodes": 1, "gpus_per_node": size, "intra": {"bandwidth": beta, "latency": alpha}}
    )
    return host_call_seconds(graph)


def main(argv: list[str] | None = None) -> None:
    """``python benchmarks/call_overhead.py [--world 4]``: print the host seconds per call
    (bench_planner.py measures the same inside its own world and feeds the cost model)."""
    import argparse
    import sys
    from pathlib import Path

    from lightning_mmpar.testing import spawn

    sys.path.insert(0, str(Path(__file__).parent))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4, help="gloo processes, even (default 4)")
    args = p.parse_args(argv)
    if args.world < 2 or args.world % 2:
        p.error(f"--world {args.world}: the tensor-parallel case needs an even world >= 2")
    got = spawn(_worker, args.world, timeout=600)[0]
    print(
        f"host seconds per call beyond the wire, {args.world} gloo processes: "
        + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in got.items())
    )


if __name__ == "__main__":
    main()
