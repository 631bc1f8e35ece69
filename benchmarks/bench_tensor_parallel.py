"""One fused-model train step under TP=2 (gloo, CPU): combine and vision-placement options.

    python benchmarks/bench_tensor_parallel.py     # writes docs/results/tensor_parallel.json

Four layouts - cross-attention combine ``all_reduce`` / ``all_gather`` x vision ``tp`` /
``replicate`` - plus the unsharded model on every rank, all built in one spawned 2-rank world and
timed round-robin (so machine load hits every layout alike). A step is forward, vocab-parallel
cross-entropy + a feature term, backward and an SGD update; a step's time is the slowest rank's.
Reported: median and min seconds per step, and each layout's ratio to the unsharded step.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from open_clip.transformer import VisionTransformer
from torch.distributed.device_mesh import init_device_mesh
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_mmpar.models.adapter import AdapterConfig
from lightning_mmpar.models.convert import build_fusion_model
from lightning_mmpar.models.fusion import FusionModel
from lightning_mmpar.parallel.numerics import vocab_parallel_cross_entropy
from lightning_mmpar.plans.fusion import apply_tensor_parallel
from lightning_mmpar.testing import spawn

sys.path.insert(0, str(Path(__file__).parent))
from report import write_result

LAYOUTS = {
    "all_reduce+vision_tp": dict(vl_combine="all_reduce", vision_parallel="tp"),
    "all_gather+vision_tp": dict(vl_combine="all_gather", vision_parallel="tp"),
    "all_reduce+vision_replicate": dict(vl_combine="all_reduce", vision_parallel="replicate"),
    "all_gather+vision_replicate": dict(vl_combine="all_gather", vision_parallel="replicate"),
}
SIZES = dict(batch=4, text=32, image=64, patch=8, width=128, vocab=512)


def build() -> FusionModel:
    torch.manual_seed(0)
    w = SIZES["width"]
    visual = VisionTransformer(
        image_size=SIZES["image"],
        patch_size=SIZES["patch"],
        width=w,
        layers=4,
        heads=8,
        mlp_ratio=4.0,
        output_dim=w,
    )
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=SIZES["vocab"],
            hidden_size=w,
            intermediate_size=4 * w,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
        )
    )
    adapter = AdapterConfig(num_blocks=2, heads=8, width=w, ffn_width=4 * w, dropout=0.0)
    return build_fusion_model(visual, llama, adapter=adapter, contrastive_dim=64)


def step(model: FusionModel, opt: torch.optim.Optimizer, batch: tuple[torch.Tensor, ...]) -> float:
    images, ids, labels = batch
    dist.barrier()
    start = time.perf_counter()
    out = model(images, ids)
    loss = vocab_parallel_cross_entropy(out.logits, labels)
    loss = loss + (out.image_features * out.text_features).sum()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def worker(rank: int, world: int, rounds: int) -> dict[str, list[float]]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    vl_group, _ = dist.new_subgroups_by_enumeration([list(range(world))])
    base = build()
    models = {"unsharded": copy.deepcopy(base)}
    for name, options in LAYOUTS.items():
        models[name] = apply_tensor_parallel(
            copy.deepcopy(base), mesh, vl_group=vl_group, **options
        )
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-4) for k, m in models.items()}
    torch.manual_seed(1)
    b, t = SIZES["batch"], SIZES["text"]
    ids = torch.randint(0, SIZES["vocab"], (b, t))
    batch = (torch.randn(b, 3, SIZES["image"], SIZES["image"]), ids, ids.roll(-1, dims=1))
    times: dict[str, list[float]] = {k: [] for k in models}
    for r in range(rounds + 2):
        for name, model in models.items():
            elapsed = step(model, opts[name], batch)
            if r >= 2:  # two warm-up rounds
                times[name].append(elapsed)
    return times


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out-dir", type=Path, default=None, help="default docs/results")
    parser.add_argument("--smoke", action="store_true", help="one round")
    args = parser.parse_args(argv)
    times = spawn(worker, 2, 1 if args.smoke else args.rounds)[0]
    base = statistics.median(times["unsharded"])
    result: dict[str, Any] = {
        "benchmark": "bench_tensor_parallel",
        "setup": {"tp": 2, "backend": "gloo", "device": "cpu", **SIZES, "rounds": args.rounds},
        "step_seconds": {
            k: {"median": statistics.median(v), "min": min(v)} for k, v in times.items()
        },
        "ratio_to_unsharded": {k: statistics.median(v) / base for k, v in times.items()},
    }
    med = {k: statistics.median(v) for k, v in times.items()}
    result["ratios"] = {
        "all_gather/all_reduce (vision tp)": med["all_gather+vision_tp"]
        / med["all_reduce+vision_tp"],
        "all_gather/all_reduce (vision replicate)": med["all_gather+vision_replicate"]
        / med["all_reduce+vision_replicate"],
        "vision replicate/tp (all_reduce)": med["all_reduce+vision_replicate"]
        / med["all_reduce+vision_tp"],
    }
    write_result("tensor_parallel", result, args.out_dir)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
