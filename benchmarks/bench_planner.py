"""The layout planner's cost model against measurement (CPU), and its predictions at scale.

    python benchmarks/bench_planner.py     # measure + predict layouts, docs/results/planner.json
    python benchmarks/bench_planner.py --smoke --out-dir /tmp/r   # 2 layouts, 3 steps, 1 round
    python benchmarks/bench_planner.py --scale  # docs/planner.md's tables; --measure-cpu: cpu
    python benchmarks/bench_planner.py --noncolocated  # towers on their own ranks vs colocated

**Measurement**: ``recipes/clip_llama_cpu.yaml``'s model and data trained by
``Trainer(strategy=MultimodalParallelStrategy(...))`` on 4 gloo processes, one layout after
another, round-robin (machine load hits them alike), at one global batch (``--global-batch``
samples per optimizer step: ``data.batch_size = global / dp``). A step's time is the slowest
rank's, the median over the steps after ``--warmup``. In the same world: the CPU's fp32 matmul
rate on one thread at the model's shapes (``cores / processes`` of it per process when the
processes outnumber the cores), the fixed cost per block and micro-batch
(``DeviceSpec.overhead``: the blocks timed at micro-batch 1 and 8, the intercept), and gloo's
alpha-beta (all-reduce of 4 B and 4 MiB, the ring formula solved: a loopback link class; the
latency is a call's cost under load, :mod:`sync_latency`, when larger than the idle one), and
the host work per DTensor / FSDP2 call (:mod:`call_overhead`, a synthetic model). Each layout's
collective calls of step 3 are counted (``CommCounter.calls``) and compared with
:func:`lightning_mmpar.layout.comm.comm_calls` on every rank.

**Prediction**: :func:`lightning_mmpar.layout.cost.predict` of each layout with that device
(``shared = processes / cores``) and link class; **Spearman's rank correlation** of predicted vs
measured step times goes to the JSON.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from bench_stability import StepTimer  # the same per-batch wall-time callback
from call_overhead import gloo_alpha_beta, host_call_seconds
from lightning.pytorch import Callback
from report import write_result
from sync_latency import loaded_call_seconds

ROOT = Path(__file__).resolve().parents[1]
YAML = ROOT / "recipes" / "clip_llama_cpu.yaml"
WORLD = 4

LAYOUTS: dict[str, dict[str, Any]] = {
    "dp4 ddp": {"data_parallel": "ddp"},
    "dp4 fsdp": {"data_parallel": "fsdp"},
    "tp2 dp2": {"tensor_parallel": 2},
    "pp2 dp2": {"pipeline_parallel": 2, "micro_batches": 4},
    "pp2 dp2 ddp": {"pipeline_parallel": 2, "micro_batches": 4, "data_parallel": "ddp"},
    "tp2 pp2": {"tensor_parallel": 2, "pipeline_parallel": 2, "micro_batches": 4},
    "pp4": {"pipeline_parallel": 4, "micro_batches": 8},
}
"""Strategy arguments per layout (4 processes, dp the rest; no tp 4: the model has 2 kv heads)."""


def _dp(args: dict[str, Any]) -> int:
    return WORLD // (args.get("tensor_parallel", 1) * args.get("pipeline_parallel", 1))


def layout_spec(
    args: dict[str, Any],
    global_batch: int,
    precision: str = "32-true",
    dp: int | None = None,
    **extra: Any,
) -> Any:
    """The ``ParallelLayout`` of a benchmark layout's strategy ``args`` (``dp``: the language
    data-parallel degree when the world is not all language ranks; ``extra``: more fields)."""
    from lightning_mmpar.layout import ParallelLayout

    pp, dp = args.get("pipeline_parallel", 1), _dp(args) if dp is None else dp
    m = args.get("micro_batches", 1) if pp > 1 else 1
    accumulate = extra.pop("accumulate", 1)
    return ParallelLayout(
        tp=args.get("tensor_parallel", 1),
        pp=pp,
        dp=dp,
        micro_batches=m,
        micro_batch_size=global_batch // dp // m // accumulate,
        accumulate=accumulate,
        schedule="1f1b",
        data_parallel=args.get("data_parallel", "fsdp"),
        precision=precision,
        **extra,
    )


def matmul_flops(rows: int, width: int, seconds: float = 0.5) -> float:
    """fp32 FLOP/s of ``[rows, width] x [width, 2 width]`` on this thread."""
    a, b = torch.randn(rows, width), torch.randn(width, 2 * width)
    for _ in range(5):
        a @ b
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        n += 1
    return 2.0 * rows * width * 2 * width * n / (time.perf_counter() - start)


def block_overhead(repeats: int = 10, config: dict[str, Any] | None = None) -> float:
    """Fixed seconds per block per micro-batch (forward + backward) on this thread: the CPU
    model's blocks (``config``'s, default :data:`YAML`'s) timed at micro-batch 1 and 8,
    ``t(b) = n_blocks * overhead + b * c``."""
    from lightning.pytorch import seed_everything

    from lightning_mmpar.models.fusion import FusionModel
    from lightning_mmpar.recipes.partition import build_module

    seed_everything(0, verbose=False)
    config = config if config is not None else yaml.safe_load(YAML.read_text())
    module, data = build_module(config, meta=False)
    module.configure_model()
    blocks, size = module.pipeline_blocks(), module.fusion_config.vision.image_size

    def timed(b: int) -> float:
        ids = torch.randint(0, 32, (b, int(data.max_length)))
        state = FusionModel.pipeline_inputs(torch.randn(b, 3, size, size), ids)
        times = []
        for _ in range(repeats):
            start, out = time.perf_counter(), state
            for block in blocks:  # training mode: modules start in it
                out = block(*out)
            sum(t.float().sum() for t in out if t.requires_grad).backward()
            times.append(time.perf_counter() - start)
        return statistics.median(times[2:])

    t1, t8 = timed(1), timed(8)
    return max(0.0, (8 * t1 - t8) / 7 / len(blocks))


class CallMeter(Callback):
    """Collective calls and bytes by ``"<dim>.<kind>"`` of optimizer step 3 (as the parity
    matrix's ``Meter``: from the end of step 2 to the end of step 3; step 2 holds torch DDP's
    one-off bucket-rebuild broadcast)."""

    def __init__(self) -> None:
        self.counter: Any = None
        self.calls: dict[str, int] = {}

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        from lightning_mmpar.parallel import CommCounter

        if args[-1] == 1:
            self.counter = CommCounter(trainer.strategy.parallel_dims).__enter__()
        elif args[-1] == 2 and self.counter is not None:
            self.counter.__exit__(None, None, None)
            self.calls = {k: v for k, v in self.counter.calls.items() if k != "self"}


def run_one(
    size: int, args: dict[str, Any], global_batch: int, steps: int, count: bool = False
) -> tuple[list[float], dict[str, int]]:
    from lightning.pytorch import seed_everything

    from lightning_mmpar import MultimodalParallelStrategy
    from lightning_mmpar.recipes.partition import build_module
    from lightning_mmpar.testing import quiet_trainer

    config = yaml.safe_load(YAML.read_text())
    config["data"]["batch_size"] = global_batch // _dp(args)
    seed_everything(0, verbose=False)
    module, data = build_module(config, meta=False)
    timer, meter = StepTimer(), CallMeter()
    trainer = quiet_trainer(
        devices=size,
        strategy=MultimodalParallelStrategy(**args),
        max_steps=steps,
        limit_val_batches=0,
        callbacks=[timer, meter] if count else [timer],
    )
    trainer.fit(module, datamodule=data)
    return timer.times, meter.calls


def worker(
    rank: int, size: int, names: list[str], global_batch: int, steps: int, rounds: int
) -> dict[str, Any]:
    torch.set_num_threads(1)
    from lightning_mmpar.layout.devices import DeviceGraph

    times: dict[str, list[list[float]]] = {n: [] for n in names}
    calls = {n: run_one(size, LAYOUTS[n], global_batch, 3, count=True)[1] for n in names}
    for _ in range(rounds):
        for name in names:
            times[name].append(run_one(size, LAYOUTS[name], global_batch, steps)[0])
    alpha, beta = gloo_alpha_beta(size)  # latency: a call's cost under load if larger
    alpha = max(alpha, loaded_call_seconds() / (2 * (size - 1)))
    graph = DeviceGraph.from_yaml(
        {"nodes": 1, "gpus_per_node": size, "intra": {"bandwidth": beta, "latency": alpha}}
    )
    host = host_call_seconds(graph)
    flops = matmul_flops(global_batch * 16, 64) if rank == 0 else 0.0
    overhead = block_overhead() if rank == 0 else 0.0
    return {
        "times": times,
        "calls": calls,
        "alpha": alpha,
        "beta": beta,
        "flops": flops,
        "overhead": overhead,
        "host_call_s": host,
    }


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rho: Pearson's correlation of the ranks (ties share their average rank)."""

    def ranks(v: list[float]) -> list[float]:
        s = sorted(v)
        return [(s.index(a) + len(s) - 1 - s[::-1].index(a)) / 2 for a in v]

    rx, ry = ranks(x), ranks(y)
    if len(set(rx)) < 2 or len(set(ry)) < 2:
        return 0.0
    return statistics.correlation(rx, ry)


def predict_cpu(
    names: list[str],
    global_batch: int,
    flops: float,
    overhead: float,
    alpha: float,
    beta: float,
    call_s: float,
) -> dict[str, dict[str, Any]]:
    """The cost model's step time of each layout on this machine's measured figures: one
    thread's fp32 rate and block overhead, ``shared = processes / cores`` when the processes
    outnumber the cores, ``call_s`` host seconds per collective call, the gloo link."""
    from lightning_mmpar.layout.comm import comm_calls
    from lightning_mmpar.layout.cost import DeviceSpec, predict
    from lightning_mmpar.layout.devices import DeviceGraph
    from lightning_mmpar.plans.fusion_cost import fusion_model_spec
    from lightning_mmpar.recipes.partition import build_module

    shared = max(1.0, WORLD / (os.cpu_count() or 1))
    device = DeviceSpec(
        "cpu",
        {"fp32": flops / 1e12},
        16.0,
        efficiency=1.0,
        overhead=overhead,
        call_overhead=call_s,
        shared=shared,
    )
    graph = DeviceGraph.from_yaml(
        {"nodes": 1, "gpus_per_node": WORLD, "intra": {"bandwidth": beta, "latency": alpha}}
    )
    config = yaml.safe_load(YAML.read_text())
    module, data = build_module(config)
    out = {}
    for name in names:
        layout = layout_spec(LAYOUTS[name], global_batch)
        model = fusion_model_spec(module, layout, int(data.max_length))
        p = predict(model, layout, device, graph)
        out[name] = {
            "step_s": p.step_seconds,
            "compute_s": p.compute_seconds,
            "bubble": p.bubble,
            "comm_s": p.comm_seconds,
            "calls": [comm_calls(model, layout, r) for r in range(layout.pp)],
        }
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from lightning_mmpar.testing import spawn

    names = [n.strip() for n in args.layouts.split(",")]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        raise SystemExit(f"unknown layouts {unknown}; choose from {list(LAYOUTS)}")
    started = time.perf_counter()
    per_rank = spawn(worker, WORLD, names, args.global_batch, args.steps, args.rounds, timeout=3600)
    measured = {}
    for name in names:
        steps = []
        for r in range(args.rounds):
            runs = [rank["times"][name][r] for rank in per_rank]
            steps += [max(ts) for ts in zip(*runs, strict=True)][args.warmup :]
        measured[name] = statistics.median(steps)
    alpha = statistics.median(r["alpha"] for r in per_rank)
    beta = statistics.median(r["beta"] for r in per_rank)
    flops, overhead = per_rank[0]["flops"], per_rank[0]["overhead"]
    host = {k: statistics.median(r["host_call_s"][k] for r in per_rank) for k in ("fsdp", "tp")}
    call_s = statistics.mean(host.values())
    predicted = predict_cpu(names, args.global_batch, flops, overhead, alpha, beta, call_s)
    calls = {}
    for n in names:  # counted on every rank vs comm_calls of its pipeline rank
        pp = LAYOUTS[n].get("pipeline_parallel", 1)
        counted = [r["calls"][n] for r in per_rank]
        expected = [predicted[n]["calls"][rank // (WORLD // pp)] for rank in range(WORLD)]
        calls[n] = {
            "counted": counted,
            "predicted": expected,
            "equal": all(c == e for c, e in zip(counted, expected, strict=True)),
        }
        if not calls[n]["equal"]:
            print(f"{n}: calls counted {counted[0]} predicted {expected[0]} (rank 0)")
    rho = spearman([measured[n] for n in names], [predicted[n]["step_s"] for n in names])
    for n in names:
        print(
            f"{n:10} measured {measured[n] * 1e3:8.1f} ms  predicted "
            f"{predicted[n]['step_s'] * 1e3:8.1f} ms"
        )
    print(f"Spearman rank correlation: {rho:.3f}")
    return {
        "config": {
            "yaml": str(YAML.relative_to(ROOT)),
            "processes": WORLD,
            "global_batch": args.global_batch,
            "steps": args.steps,
            "warmup": args.warmup,
            "rounds": args.rounds,
        },
        "cpu_fp32_flops_one_thread": flops,
        "cpu_overhead_s_per_block_micro_batch": overhead,
        "gloo": {"latency_s": alpha, "bandwidth_bytes_s": beta},
        "host_call_s": host,
        "call_overhead_s": call_s,
        "calls": calls,
        "measured_step_s": measured,
        "predicted": predicted,
        "spearman": rho,
        "wall_s": round(time.perf_counter() - started, 1),
    }


VIT_L14_336 = {
    "image_size": 336,
    "patch_size": 14,
    "width": 1024,
    "layers": 24,
    "heads": 16,
    "output_dim": 768,
}
SCALE_MODELS: dict[str, dict[str, Any]] = {
    # Qwen2-VL-7B-sized: ViT-L/14 at 336 px (576 patches) + Llama-2-7B dims
    "7B": {
        "vision": VIT_L14_336,
        "language": {
            "hidden_size": 4096,
            "intermediate_size": 11008,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
        },
        "adapter": {"num_blocks": 4, "heads": 32, "width": 4096, "ffn_width": 16384},
    },
    # 70B-class: the same ViT + Llama-2-70B dims (GQA: 8 key-value heads)
    "70B": {
        "vision": VIT_L14_336,
        "language": {
            "hidden_size": 8192,
            "intermediate_size": 28672,
            "num_hidden_layers": 80,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
        },
        "adapter": {"num_blocks": 4, "heads": 64, "width": 8192, "ffn_width": 32768},
    },
}
"""docs/planner.md's models: ViT frozen (the recipe's default), adapters + decoder + embeddings
trained, vocabulary 32000, text length 2048."""
SCALE_WORLDS = (8, 16, 64, 256, 1024)
TEXT_LENGTH = 2048


def scale_module(name: str) -> Any:
    """The ``ClipLlamaModule`` of :data:`SCALE_MODELS` ``name``, built on the meta device."""
    from lightning_mmpar.models.adapter import AdapterConfig
    from lightning_mmpar.models.fusion import FusionConfig
    from lightning_mmpar.models.language import LanguageConfig
    from lightning_mmpar.models.vision import VisionConfig
    from lightning_mmpar.recipes.module import ClipLlamaModule
    from lightning_mmpar.recipes.options import FinetuneConfig

    dims = SCALE_MODELS[name]
    fusion = FusionConfig(
        vision=VisionConfig(**dims["vision"]),
        language=LanguageConfig(**dims["language"]),
        adapter=AdapterConfig(**dims["adapter"]),
        contrastive_dim=768,
    )
    module = ClipLlamaModule(
        fusion=fusion,
        vocab_size=32000,
        finetune=FinetuneConfig(train_vision=False, train_decoder_layers=-1, train_embeddings=True),
    )
    with torch.device("meta"):
        module.configure_model()
    return module


def scale_graph(world: int) -> Any:
    """Nodes of 8 GPUs on NVSwitch (the default link classes), joined by one 400 Gb/s NIC per GPU
    (50 GB/s, 5 us: InfiniBand NDR as in NVIDIA's DGX H100 reference architecture)."""
    from lightning_mmpar.layout.devices import DeviceGraph, LinkClass

    return DeviceGraph.uniform(8, 8).replicate(world // 8, LinkClass("NET", 50e9, 5e-6))


def scale_plan(model: Any, world: int, device: Any, accept: Any, base: Any) -> list[Any]:
    """Ranked layouts at scale: global batch ``max(64, 2 x world)``, v 1 or 2, sequence
    parallelism with tp, FSDP."""
    from lightning_mmpar.layout.planner import plan

    ranked, _ = plan(
        model,
        world,
        device,
        scale_graph(world),
        accept=accept,
        global_batch=max(64, 2 * world),
        virtual=(1, 2),
        sequence_parallel=(True,),
        data_parallel=("fsdp",),
        base=base,
    )
    return ranked


def scale_tables(devices: tuple[str, ...] = ("h100", "h200"), top: int = 3) -> str:
    """Markdown: the best predicted layouts of each model on 8 .. 1024 GPUs, bf16, global
    batch ``max(64, 2 x GPUs)`` sequences, on :func:`scale_graph`."""
    from lightning_mmpar.layout import ParallelLayout
    from lightning_mmpar.layout.cost import DEVICES, GIB, predict
    from lightning_mmpar.layout.planner import describe
    from lightning_mmpar.recipes.planner import accept_layout, spec_cache

    lines = []
    for name in SCALE_MODELS:
        module = scale_module(name)
        base = ParallelLayout(precision="bf16-mixed", sequence_parallel=True)
        model = spec_cache(module, TEXT_LENGTH)
        accept = accept_layout(module, TEXT_LENGTH)
        for dev in devices:
            lines += [
                f"\n### {name} fusion on {dev.upper()} (bf16)\n",
                "| GPUs | global batch | layout | mem/rank GiB | comm GB/step | bubble "
                "| step s | MFU |",
                "|---|---|---|---|---|---|---|---|",
            ]
            for world in SCALE_WORLDS:
                batch, graph = max(64, 2 * world), scale_graph(world)
                ranked = scale_plan(model, world, DEVICES[dev], accept, base)
                picks = ranked[:top]
                if world == 16 and name == "7B":  # the brief's launch, wherever it ranks
                    brief = ParallelLayout(
                        tp=4,
                        pp=2,
                        dp=2,
                        virtual=2,
                        micro_batches=4,
                        micro_batch_size=batch // 2 // 4,
                        schedule="interleaved_1f1b",
                        sequence_parallel=True,
                        precision="bf16-mixed",
                    )
                    picks.append(predict(model(brief), brief, DEVICES[dev], graph))
                for p in picks or []:
                    lines.append(
                        f"| {world} | {batch} | {describe(p.layout)} | "
                        f"{p.memory.total / GIB:.1f} | {p.comm_total_bytes / 1e9:.1f} | "
                        f"{p.bubble:.3f} | {p.step_seconds:.3f} | {100 * p.mfu:.1f}% |"
                    )
                if not ranked:
                    lines.append(f"| {world} | {batch} | no layout fits | | | | | |")
    lines += fp8_anchor()
    return "\n".join(lines)


def fp8_anchor() -> list[str]:
    """The 7B fusion's best bf16 layout on 8 H100s, predicted again in fp8 (torchtitan's
    Float8 anchor: +28% on Llama 3.1 8B, 8 H100s; Liang et al. 2024)."""
    from dataclasses import replace

    from lightning_mmpar.layout import ParallelLayout
    from lightning_mmpar.layout.cost import DEVICES, predict
    from lightning_mmpar.layout.planner import describe
    from lightning_mmpar.recipes.planner import accept_layout, spec_cache

    module = scale_module("7B")
    model, h100 = spec_cache(module, TEXT_LENGTH), DEVICES["h100"]
    base = ParallelLayout(precision="bf16-mixed", sequence_parallel=True)
    bf16 = scale_plan(model, 8, h100, accept_layout(module, TEXT_LENGTH), base)[0]
    fp8 = predict(model(bf16.layout), replace(bf16.layout, precision="fp8"), h100, scale_graph(8))
    gain = bf16.step_seconds / fp8.step_seconds - 1
    return [
        f"\n7B on 8 H100, {describe(bf16.layout)}: bf16 {bf16.step_seconds:.3f} s/step, fp8 "
        f"{fp8.step_seconds:.3f} s/step: +{100 * gain:.0f}% throughput predicted"
    ]


def towers_worker(
    rank: int,
    size: int,
    names: list[str],
    global_batch: int,
    steps: int,
    rounds: int,
    accumulate: int = 1,
) -> dict[str, Any]:
    """:mod:`bench_noncolocated`'s world (its layouts, interleaved rounds), then this machine's
    figures as :func:`worker` measures them (the matmul rate at the tower's width, the block
    overhead of its model)."""
    import bench_noncolocated as nc

    from lightning_mmpar.layout.devices import DeviceGraph

    runs = nc.worker(rank, size, names, global_batch, steps, rounds, accumulate)
    alpha, beta = gloo_alpha_beta(size)
    alpha = max(alpha, loaded_call_seconds() / (2 * (size - 1)))
    graph = DeviceGraph.from_yaml(
        {"nodes": 1, "gpus_per_node": size, "intra": {"bandwidth": beta, "latency": alpha}}
    )
    host = host_call_seconds(graph)
    width = nc.MODEL["vision"]["width"]
    flops = matmul_flops(global_batch * 16, width) if rank == 0 else 0.0
    config = nc.config(global_batch, {}, accumulate)
    overhead = block_overhead(config=config) if rank == 0 else 0.0
    return {
        "runs": runs,
        "alpha": alpha,
        "beta": beta,
        "flops": flops,
        "overhead": overhead,
        "host_call_s": host,
    }


def towers_layout(
    args: dict[str, Any], global_batch: int, vision_parallel: str, accumulate: int = 1
) -> Any:
    """The ``ParallelLayout`` of a :mod:`bench_noncolocated` layout (2 processes)."""
    import bench_noncolocated as nc

    return layout_spec(
        args,
        global_batch,
        dp=nc.dp_of(args),
        vision_parallel=vision_parallel,
        vision_ranks=args.get("vision_ranks", 0),
        accumulate=accumulate,
    )


def predict_towers(
    names: list[str],
    global_batch: int,
    images: float,
    cal: dict[str, float],
    accumulate: int = 1,
) -> dict[str, dict[str, Any]]:
    """The cost model's step of each :mod:`bench_noncolocated` layout on ``cal`` (this
    machine's ``flops``, ``overhead``, ``alpha``, ``beta``, ``call_s``), at ``images`` per
    sample (as measured); ``shared = processes / cores`` when the processes outnumber the
    cores."""
    import bench_noncolocated as nc

    from lightning_mmpar.layout.cost import DeviceSpec, predict
    from lightning_mmpar.layout.devices import DeviceGraph
    from lightning_mmpar.recipes.partition import build_module
    from lightning_mmpar.recipes.planner import spec_cache

    device = DeviceSpec(
        "cpu",
        {"fp32": cal["flops"] / 1e12},
        16.0,
        efficiency=1.0,
        overhead=cal["overhead"],
        call_overhead=cal["call_s"],
        shared=max(1.0, nc.WORLD / (os.cpu_count() or 1)),
    )
    link = {"bandwidth": cal["beta"], "latency": cal["alpha"]}
    graph = DeviceGraph.from_yaml({"nodes": 1, "gpus_per_node": nc.WORLD, "intra": link})
    module, data = build_module(nc.config(global_batch, {}, accumulate))
    spec = spec_cache(module, int(data.max_length), images)
    out = {}
    vision_parallel = module.plan_options.vision_parallel
    for name in names:
        layout = towers_layout(nc.LAYOUTS[name], global_batch, vision_parallel, accumulate)
        p = predict(spec(layout), layout, device, graph)
        out[name] = {"step_s": p.step_seconds, "breakdown": p.breakdown, "idle": p.idle}
    return out


def agreement(measured: dict[str, float], predicted: dict[str, float], ours: str) -> list[Any]:
    """Per colocated layout: whether ``ours`` (the non-colocated layout) is faster, measured
    and predicted, and whether the two agree."""
    rows = []
    for name in measured:
        if name == ours:
            continue
        m, p = measured[ours] < measured[name], predicted[ours] < predicted[name]
        rows.append({"against": name, "measured_faster": m, "predicted_faster": p, "agree": m == p})
    return rows


def measure_towers(args: argparse.Namespace) -> dict[str, Any]:
    """Colocated against non-colocated on 2 processes (:mod:`bench_noncolocated`'s layouts and
    world), measured and predicted with this machine's calibration; the order of each
    colocated layout against the non-colocated one, measured vs predicted."""
    import bench_noncolocated as nc

    from lightning_mmpar.testing import spawn

    names, gb, acc = args.towers_layouts, args.global_batch, args.accumulate
    per_rank = spawn(towers_worker, nc.WORLD, names, gb, args.steps, args.rounds, acc, timeout=3600)
    collected = nc.collect([r["runs"] for r in per_rank], names, args.rounds, acc)
    write_result("noncolocated", nc.result(collected, args), args.out_dir)  # the same run
    summary = nc.summarise(collected, args.warmup)
    measured = {n: s["step_s"] for n, s in summary["layouts"].items()}
    host = {k: statistics.median(r["host_call_s"][k] for r in per_rank) for k in ("fsdp", "tp")}
    cal = {
        "flops": per_rank[0]["flops"],
        "overhead": per_rank[0]["overhead"],
        "alpha": statistics.median(r["alpha"] for r in per_rank),
        "beta": statistics.median(r["beta"] for r in per_rank),
        "call_s": statistics.mean(host.values()),
    }
    images = statistics.mean(c["images_per_sample"] for c in collected.values())
    predicted = predict_towers(names, gb, images, cal, acc)
    steps = {n: p["step_s"] for n, p in predicted.items()}
    rows = agreement(measured, steps, nc.NONCOLOCATED)
    critical = {n: s["cpu_critical_s"] for n, s in summary["layouts"].items()}
    rows_cpu = agreement(critical, steps, nc.NONCOLOCATED)
    rho = spearman([measured[n] for n in names], [steps[n] for n in names])
    rho_cpu = spearman([critical[n] for n in names], [steps[n] for n in names])
    for n in names:
        print(f"{n:22} measured {measured[n] * 1e3:8.1f} ms  predicted {steps[n] * 1e3:8.1f} ms")
    for r in rows_cpu:
        print(
            f"on the CPU critical path, against {r['against']}: measured faster "
            f"{r['measured_faster']}, predicted {r['predicted_faster']}"
        )
    for r in rows:
        print(
            f"{nc.NONCOLOCATED} faster than {r['against']}: measured {r['measured_faster']}, "
            f"predicted {r['predicted_faster']} ({'agree' if r['agree'] else 'DISAGREE'})"
        )
    print(f"Spearman rank correlation: {rho:.3f} (CPU critical path: {rho_cpu:.3f})")
    return {
        "config": {
            "global_batch": gb,
            "accumulate": acc,
            "steps": args.steps,
            "warmup": args.warmup,
            "rounds": args.rounds,
            "processes": nc.WORLD,
            "model": nc.MODEL,
            "images_per_sample": images,
        },
        "load_average": list(os.getloadavg()),
        "calibration": cal,
        "measured_step_s": measured,
        "measured_cpu_critical_s": critical,
        "ratio": summary.get("ratio"),
        "spread": summary.get("spread"),
        "predicted": predicted,
        "agreement": rows,
        "all_agree": all(r["agree"] for r in rows),
        "spearman": rho,
        "agreement_cpu_critical": rows_cpu,
        "all_agree_cpu_critical": all(r["agree"] for r in rows_cpu),
        "spearman_cpu_critical": rho_cpu,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--global-batch", type=int, default=48)
    p.add_argument("--steps", type=int, default=8, help="steps per run")
    p.add_argument("--warmup", type=int, default=3, help="first steps not timed")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out-dir", type=Path, default=None, help="default docs/results")
    p.add_argument("--smoke", action="store_true", help='"dp4 ddp,tp2 pp2", 3 steps, 1 round')
    p.add_argument("--scale", action="store_true", help="print docs/planner.md's tables")
    p.add_argument("--measure-cpu", action="store_true", help="one-thread fp32 matmul rate")
    p.add_argument(
        "--noncolocated",
        action="store_true",
        help="bench_noncolocated's 2-process layouts, measured vs predicted "
        "(docs/results/planner_noncolocated.json and noncolocated.json; --global-batch "
        "default 32)",
    )
    p.add_argument(
        "--accumulate",
        type=int,
        default=4,
        help="--noncolocated: batches per optimizer step (the vision rank runs one ahead)",
    )
    args = p.parse_args(argv)
    if args.measure_cpu:
        torch.set_num_threads(1)
        rates = [matmul_flops(args.global_batch * 16, 64) for _ in range(5)]
        print(f"cpu fp32, one thread: {statistics.median(rates) / 1e12:.4f} TFLOP/s")
        return {}
    if args.scale:
        print(scale_tables())
        return {}
    if args.smoke:
        args.layouts, args.steps, args.rounds = "dp4 ddp,tp2 pp2", 3, 1
    args.warmup = min(args.warmup, args.steps - 1)
    if args.noncolocated:
        _towers_args(args, p.get_default("global_batch"))
        report = measure_towers(args)
        write_result("planner_noncolocated", report, args.out_dir)
        return report
    report = measure(args)
    write_result("planner", report, args.out_dir)
    return report


def _towers_args(args: argparse.Namespace, default_global_batch: int) -> None:
    """``--noncolocated``'s settings: :mod:`bench_noncolocated`'s layouts (under ``--smoke`` its
    two: dp2 DDP and the non-colocated one, at most 2 batches per step) and a global batch of
    32 unless one is given."""
    import bench_noncolocated as nc

    if args.global_batch == default_global_batch:
        args.global_batch = 32
    args.towers_layouts = list(nc.LAYOUTS)
    if args.smoke:
        args.towers_layouts = ["dp2 ddp", nc.NONCOLOCATED]
        args.accumulate = min(args.accumulate, 2)


if __name__ == "__main__":
    main()
