"""Memory per rank and communication per step of each layout, measured against the cost model.

    python benchmarks/bench_memory_comm.py            # docs/results/memory_comm.{json,png}
    python benchmarks/bench_memory_comm.py --smoke    # 2 processes, dp2 fsdp + tp2, 2 steps

Issue #14 items 4 and 5, on the product's own fusion model: ``recipes/clip_llama_cpu.yaml``'s
module and data (``clip_llama_moe_cpu.yaml``'s for the expert-parallel layout) trained by
``MultimodalParallelStrategy`` on one spawned world of 4 gloo processes, one layout after another,
at one global batch (``--global-batch`` samples per optimizer step, ``data.batch_size = global /
dp``), ``--steps`` AdamW steps (>= 2).

**Memory** (item 4), per rank after training: the parameter + gradient + AdamW-state bytes of the
tensors the rank holds (``lightning_mmpar.parallel.comm_count.state_bytes_of``: DTensor local
shards, ``.grad``, ``optimizer.state``), against (a) the ideal ``full / (tp * pp * shard)``
(``shard``: dp under FSDP, 1 under DDP; ``full``: the same bytes of a one-process run of the same
module, measured the same way) as a ratio, target within 5%, and (b) the analytical
:func:`lightning_mmpar.layout.memory.state_bytes` (exact). On CPU no caching allocator reports
usage: the allocator's view here is the bytes of the distinct storages behind those tensors
(``untyped_storage().nbytes()``, deduplicated), which includes FSDP2's shard padding.

**Communication** (item 5), per rank: bytes by ``"<dim>.<kind>"`` of every collective of
optimizer step 2 (``lightning_mmpar.parallel.comm_count.CommCounter``, a dispatch mode that sees
every c10d and functional collective), against :func:`lightning_mmpar.layout.comm.comm_bounds`
(the planner's cost model; equal for every exact key, within bounds for the routing-dependent
MoE token dispatch ``ep.all_to_all_v``). The same measurement as tests/recipes/
test_parity_matrix.py's, on the shipped CPU recipes instead of the tests' tiny model.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from lightning.pytorch import Callback

sys.path.insert(0, str(Path(__file__).parent))
from report import CPU_YAML, ROOT, save_figure, write_result

MOE_YAML = ROOT / "recipes" / "clip_llama_moe_cpu.yaml"
SCHEDULE = {"pipeline_parallel": 2, "micro_batches": 2, "schedule": "1f1b"}
LAYOUTS: dict[str, dict[str, Any]] = {
    "dp4 fsdp": {"data_parallel": "fsdp"},
    "dp4 ddp": {"data_parallel": "ddp"},
    "tp2 dp2": {"tensor_parallel": 2},
    "pp2 dp2": dict(SCHEDULE),
    "tp2 pp2": {"tensor_parallel": 2, **SCHEDULE},
    "ep2 dp4 (moe)": {"expert_parallel": 2},
}
"""Strategy arguments per layout of the 4-process world (dp: the rest, FSDP unless ``ddp``);
``(moe)``: the MoE recipe (4 experts; dp 4 = edp 2 x ep 2)."""
SMOKE_LAYOUTS: dict[str, dict[str, Any]] = {"dp2 fsdp": {}, "tp2": {"tensor_parallel": 2}}


def recipe(name: str, global_batch: int, dp: int) -> dict[str, Any]:
    """The recipe YAML of layout ``name`` with ``data.batch_size = global_batch / dp``."""
    config = yaml.safe_load((MOE_YAML if "moe" in name else CPU_YAML).read_text())
    config["data"]["batch_size"] = global_batch // dp
    return config


def degrees(args: dict[str, Any], world: int) -> dict[str, int]:
    tp, pp = args.get("tensor_parallel", 1), args.get("pipeline_parallel", 1)
    return {"tp": tp, "pp": pp, "dp": world // (tp * pp), "ep": args.get("expert_parallel", 1)}


def layout_spec(args: dict[str, Any], world: int, global_batch: int) -> Any:
    """The cost model's :class:`~lightning_mmpar.layout.ParallelLayout` of strategy ``args``."""
    from lightning_mmpar.layout import ParallelLayout

    d = degrees(args, world)
    m = args.get("micro_batches", 1) if d["pp"] > 1 else 1
    return ParallelLayout(
        tp=d["tp"],
        pp=d["pp"],
        dp=d["dp"],
        ep=d["ep"],
        micro_batches=m,
        micro_batch_size=global_batch // d["dp"] // m,
        schedule=args.get("schedule", "1f1b"),
        data_parallel=args.get("data_parallel", "fsdp"),
    )


def storage_bytes(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the distinct storages behind the parameters (local shards), their gradients and
    the optimizer state: what is allocated for them, FSDP2's padding included."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor):
            t = t.to_local() if isinstance(t, DTensor) else t
            s = t.untyped_storage()
            seen[s.data_ptr() or id(s)] = s.nbytes()

    for p in module.parameters():
        add(p)
        add(p.grad)
    for state in optimizer.state.values():
        for v in state.values():
            add(v)
    return sum(seen.values())


class Meter(Callback):
    """Bytes by ``"<dim>.<kind>"`` of every collective of optimizer step 2 (end of batch 0 to end
    of batch 1, as tests/recipes/parity_matrix_worker.Meter), then the state bytes held."""

    def __init__(self) -> None:
        self.counter: Any = None
        self.bytes: dict[str, int] = {}
        self.state: tuple[int, ...] = ()
        self.storage = 0

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        from lightning_mmpar.parallel.comm_count import CommCounter

        if args[-1] == 0 and hasattr(trainer.strategy, "parallel_dims"):  # one process: none
            self.counter = CommCounter(trainer.strategy.parallel_dims).__enter__()
        elif args[-1] == 1 and self.counter is not None:
            self.counter.__exit__(None, None, None)
            self.bytes = {k: v for k, v in self.counter.bytes.items() if k != "self"}

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        from lightning_mmpar.parallel.comm_count import state_bytes_of

        self.state = state_bytes_of(pl_module, trainer.optimizers[0])
        self.storage = storage_bytes(pl_module, trainer.optimizers[0])


def fit(config: dict[str, Any], strategy: Any, devices: int, steps: int) -> tuple[Any, Meter]:
    from lightning.pytorch import seed_everything

    from lightning_mmpar.recipes.partition import build_module
    from lightning_mmpar.testing import quiet_trainer

    seed_everything(0, verbose=False)
    module, data = build_module(config, meta=False)
    meter = Meter()
    trainer = quiet_trainer(
        devices=devices, strategy=strategy, max_steps=steps, limit_val_batches=0, callbacks=[meter]
    )
    trainer.fit(module, datamodule=data)
    return module, meter


def worker(
    rank: int, world: int, layouts: dict[str, dict[str, Any]], global_batch: int, steps: int
) -> dict[str, Any]:
    from lightning_mmpar import MultimodalParallelStrategy

    torch.set_num_threads(1)
    out = {}
    for name, args in layouts.items():
        start = time.perf_counter()
        config = recipe(name, global_batch, degrees(args, world)["dp"])
        _, meter = fit(config, MultimodalParallelStrategy(**args), world, steps)
        out[name] = {
            "comm": meter.bytes,
            "state": meter.state,
            "storage": meter.storage,
            "seconds": time.perf_counter() - start,
        }
    return out


def one_process(name: str, global_batch: int, steps: int) -> dict[str, int]:
    """``full``: the state bytes of a one-process run (no strategy) of layout ``name``'s model."""
    config = recipe(name, global_batch, 1)
    config["data"]["batch_size"] = min(config["data"]["batch_size"], 8)  # state: batch-free
    _, meter = fit(config, "auto", 1, steps)
    p, g, o = meter.state
    return {"parameters": p, "gradients": g, "optimizer": o, "total": p + g + o}


def replicated(model: Any, spec: Any) -> dict[str, Any]:
    """Where a rank holds more than ``1 / (tp pp shard)``: the state bytes (parameter, and for
    trainable ones gradient + 2 AdamW moments) of parameters tensor parallelism leaves whole
    (``tp_dim`` None: norms, biases of row-parallel layers, position embeddings, the vision
    tower's replicated parts), the extra gradient bytes of ``full_grad`` ones (a vocab-parallel
    embedding's gradient comes back unsharded) and the 0-dim parameters FSDP2 keeps whole."""
    whole = [p for p in model.params if p.tp_dim is None and not p.expert]
    size = {p.name: p.numel * p.element_size * (4 if p.trainable else 1) for p in whole}
    top = sorted(size, key=size.__getitem__, reverse=True)[:4]
    return {
        "tp_replicated_state_bytes": sum(size.values()) if spec.tp > 1 else 0,
        "largest_tp_replicated": {n: size[n] for n in top} if spec.tp > 1 else {},
        "full_grad_bytes": sum(p.numel * p.element_size for p in model.params if p.full_grad),
        "zero_dim_params": sum(1 for p in model.params if not p.shape),
    }


def predicted(name: str, args: dict[str, Any], world: int, global_batch: int) -> Any:
    """Per rank: (analytical StateBytes, comm_bounds) of the layout; :func:`replicated`."""
    from lightning_mmpar.layout.comm import comm_bounds
    from lightning_mmpar.layout.memory import state_bytes
    from lightning_mmpar.plans.fusion_cost import fusion_model_spec
    from lightning_mmpar.recipes.partition import build_module
    from lightning_mmpar.topology import ParallelDims

    module, data = build_module(recipe(name, global_batch, 1))
    data.setup()
    prompts = tuple(data.class_prompts()["input_ids"].shape)
    spec = layout_spec(args, world, global_batch)
    model = fusion_model_spec(module, spec, int(data.max_length), prompts)  # type: ignore[arg-type]
    dims = ParallelDims(world_size=world, tp=spec.tp, pp=spec.pp, ep=spec.ep)
    out = []
    for rank in range(world):
        coords = dims.rank_coords(rank)
        out.append((state_bytes(model, spec, coords), comm_bounds(model, spec, coords["pp"])))
    return out, replicated(model, spec)


def compare(
    name: str,
    args: dict[str, Any],
    world: int,
    global_batch: int,
    ranks: list[dict[str, Any]],
    full: dict[str, int],
) -> dict[str, Any]:
    """Memory ratios and comm equality of one layout, per rank."""
    d = degrees(args, world)
    shard = d["dp"] if args.get("data_parallel", "fsdp") == "fsdp" else 1
    ideal = full["total"] / (d["tp"] * d["pp"] * shard)
    rows = []
    expected, excess = predicted(name, args, world, global_batch)
    for rank, (got, (state, bounds)) in enumerate(zip(ranks, expected, strict=True)):
        measured = sum(got["state"])
        exact = {k: lo for k, (lo, hi) in bounds.items() if lo == hi}
        counted = {k: v for k, v in got["comm"].items() if k in exact or k not in bounds}
        ranged = {k: [got["comm"].get(k, 0), *bounds[k]] for k in bounds.keys() - exact.keys()}
        rows.append(
            {
                "rank": rank,
                "state_bytes": list(got["state"]),
                "measured_bytes": measured,
                "ideal_bytes": ideal,
                "ratio_to_ideal": measured / ideal,
                "analytical_bytes": [state.parameters, state.gradients, state.optimizer],
                "state_equal": tuple(got["state"])
                == (state.parameters, state.gradients, state.optimizer),
                "storage_bytes": got["storage"],
                "comm": got["comm"],
                "comm_expected": exact,
                "comm_equal": counted == exact
                and all(lo <= v <= hi for v, lo, hi in ranged.values()),
                "comm_ranged": ranged,
            }
        )
    ratios = [r["ratio_to_ideal"] for r in rows]
    share = excess["tp_replicated_state_bytes"] / full["total"]
    excess["tp_replicated_share"] = share  # pp 1: a rank holds (1 - f) / tp + f of its share
    excess["ratio_explained"] = 1 + share * (d["tp"] - 1) if d["pp"] == 1 else None
    return {
        "degrees": d,
        "shard": shard,
        "full": full,
        "ideal_bytes": ideal,
        "ranks": rows,
        "replicated": excess,
        "ratio_max": max(ratios),
        "ratio_mean": sum(ratios) / len(ratios),
        "within_5pct": max(abs(r - 1) for r in ratios) <= 0.05,
        "state_equal": all(r["state_equal"] for r in rows),
        "comm_equal": all(r["comm_equal"] for r in rows),
        "seconds": max(r["seconds"] for r in ranks),
    }


def plot(results: dict[str, Any], out_dir: Path | None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    names = list(results)
    world = max(len(r["ranks"]) for r in results.values())
    width = 0.8 / world
    for rank in range(world):
        xs = [i + (rank - (world - 1) / 2) * width for i in range(len(names))]
        ys = [results[n]["ranks"][rank]["ratio_to_ideal"] for n in names]
        ax.bar(xs, ys, width, label=f"rank {rank}")
    ax.axhline(1.0, color="k", lw=0.8)
    for y in (0.95, 1.05):
        ax.axhline(y, color="k", ls=":", lw=0.8)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("held bytes / (full / (tp pp shard))")
    ax.set_title("parameter + gradient + AdamW bytes per rank vs ideal (dotted: 5%)")
    ax.legend(fontsize=7)
    return save_figure(fig, "memory_comm", out_dir)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from lightning_mmpar.testing import spawn

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="2 processes, dp2 fsdp + tp2, 2 steps")
    p.add_argument("--global-batch", type=int, default=24, help="samples per optimizer step")
    p.add_argument("--steps", type=int, default=2, help="AdamW steps per layout (>= 2)")
    p.add_argument("--out-dir", type=Path, default=None, help="default docs/results")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps must be >= 2: optimizer step 2 is the one counted")
    world, layouts = (2, SMOKE_LAYOUTS) if args.smoke else (4, LAYOUTS)
    batch = 8 if args.smoke else args.global_batch
    started = time.perf_counter()
    per_rank = spawn(worker, world, layouts, batch, args.steps, timeout=900)
    torch.set_num_threads(1)
    fulls = {
        moe: one_process("moe" if moe else "dense", batch, 2)
        for moe in {"moe" in n for n in layouts}
    }
    results = {
        n: compare(n, a, world, batch, [r[n] for r in per_rank], fulls["moe" in n])
        for n, a in layouts.items()
    }
    print(
        f"{'layout':15} {'rank':>4} {'held MB':>8} {'ideal MB':>8} {'ratio':>6} "
        f"{'=analytic':>9} {'storage MB':>10} {'comm MB':>8} {'=model':>6}"
    )
    for n, r in results.items():
        for row in r["ranks"]:
            print(
                f"{n:15} {row['rank']:4} {row['measured_bytes'] / 1e6:8.3f} "
                f"{row['ideal_bytes'] / 1e6:8.3f} {row['ratio_to_ideal']:6.3f} "
                f"{row['state_equal']!s:>9} {row['storage_bytes'] / 1e6:10.3f} "
                f"{sum(row['comm'].values()) / 1e6:8.3f} {row['comm_equal']!s:>6}"
            )
    payload = {
        "config": {
            "world": world,
            "global_batch": batch,
            "steps": args.steps,
            "layouts": layouts,
            "smoke": args.smoke,
        },
        "memory_comm": results,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    write_result("memory_comm", payload, args.out_dir)
    if not args.smoke:
        plot(results, args.out_dir)
    return payload


if __name__ == "__main__":
    main()
