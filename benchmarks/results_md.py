"""Write docs/results.md from the benchmarks' JSON in docs/results/ (run it after run_all.py).

    python benchmarks/results_md.py            # docs/results/*.json -> docs/results.md

One section per benchmark of :data:`run_all.BENCHMARKS`: what it measures, the command and the
machine that produced the JSON, its key figures as a table, and its plot. A benchmark with no
JSON yet is listed as not run.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from report import RESULTS, ROOT

Summary = Callable[[dict[str, Any]], list[str]]


def _ms(s: float) -> str:
    return f"{1e3 * s:.1f}"


def _pipeline(r: dict[str, Any]) -> list[str]:
    out = [
        "| world | configuration | step ms | bubble measured | at the stage costs | formula | "
        "wait | post | host | outside | imbalance (FLOPs) | imbalance (timed) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = (
        "bubble_measured",
        "bubble_stage_cost",
        "bubble_formula",
        "bubble_wait",
        "bubble_post",
        "bubble_host",
        "bubble_outside",
        "imbalance",
        "measured_imbalance",
    )
    for world, rows in r["results"].items():
        for name, row in rows.items():
            cells = [f"{row[k]:.2f}" if k in row else "" for k in keys]
            out.append(f"| {world} | {name} | {_ms(row['step_s'])} | " + " | ".join(cells) + " |")
    for world, run in r.get("kept", {}).items():
        out.append(f"\n{world}: kept from `{run}` (this run re-measured the other worlds).")
    if "pp2eq" in r["results"]:
        out += ["", *PIPELINE_NOTE, "", _split_schedules_vs_1f1b(r["results"]["pp2eq"])]
    return out


def _split_schedules_vs_1f1b(rows: dict[str, Any]) -> str:
    """One sentence: the zero-bubble V schedules' measured bubble against 1F1B's (pp2eq)."""
    base = rows["1f1b equal"]["bubble_measured"]
    parts = []
    for name in ("zbv_zero_bubble v2 equal", "dualpipev v2 equal"):
        got = rows[name]["bubble_measured"]
        side = "below" if got < base else "not below"
        parts.append(f"{name.split()[0]} {got:.2f} ({side})")
    return f"In this run's `pp2eq` rows, against 1F1B's {base:.2f}: {', '.join(parts)}."


PIPELINE_NOTE = [
    "**Worlds.** `pp2eq` trains `bench_pipeline.EqualBlocks` (8 identical transformer blocks, "
    "width 64, 32 tokens, batch 72, 4 micro-batches, `partition='equal'`): every stage does "
    "the same work under every schedule, so its `at the stage costs` column is the formula "
    "(1F1B, GPipe, interleaved) or the formula at this CPU's backward costs (the zero-bubble "
    "schedules, below), and `measured - at the stage costs` is what the engine, torch's "
    "schedule and the transport add. `pp2`, `pp4` and `tp2` train the recipe model "
    "(`recipes/clip_llama_cpu.yaml`): its 9 blocks differ in cost, so no cut makes its stages "
    "equal (at pp 2 x v 2 every cut is at least 1.28 apart in FLOPs): there the stage "
    "imbalance is part of the gap, and the rows compare partitions and schedules on the "
    "product's own model. **Split of the bubble** (fractions of the span, `PipelineTimeline`):"
    " `wait` torch's point-to-point waits, `host` the time between a rank's own actions and "
    "waits (posting sends and receives, the schedule's bookkeeping), `outside` the fill and "
    "drain a rank spends outside torch's schedule (the 1F1B last stage's rank, done first, "
    "waits in the step's loss broadcast); `wait + host + outside` is the measured bubble.",
    "",
    "**Why ZBV and DualPipeV stay above their formula on this CPU.** The formula prices a "
    "zero-bubble step's input backward (I) and weight backward (W) at one forward each, the "
    "fused backward (B) at two. Measured on one thread (`python benchmarks/"
    "profile_pipeline.py --split-backward --model equal`, torch's `stage_backward` against "
    "`stage_backward_input` + `stage_backward_weight`, 30 alternated repeats, CPU ms, "
    "medians), one stage of `EqualBlocks` (2 blocks, one micro-batch): F 2.7-2.8, B 4.8-5.3, "
    "I 3.6-4.2, W 3.0-3.2, so I + W = 1.37-1.45 x B; on the recipe model (`--model recipe`, "
    "cut `[2, 6, 7]`) the decoder stage has F 1.9, B 2.43, I 2.44, W 1.64 (1.68 x B), and "
    "the stage of blocks 2-5 runs its whole backward in I (its parameters reach its outputs "
    "through no gradient-carrying input). On CPU the input backward alone costs 75-100 % of "
    "the fused one: torch's `stage_backward_input` first walks the stage's autograd graph in "
    "Python to group the parameters (`construct_reverse_graph`, `get_param_groups`) and hooks "
    "the intermediate nodes, and `stage_backward_weight` runs a second autograd pass from "
    "them; at this model's size (many small operators) that bookkeeping is a large share. So "
    "the split schedules do 35-70 % more backward work per micro-batch than 1F1B: torch's "
    "implementation on this CPU, not the engine.",
]
"""The pipeline section's explanation of its worlds and of the split backward's cost
(docs/results.md)."""


def _planner(r: dict[str, Any]) -> list[str]:
    out = [
        "| layout | measured ms | predicted ms | calls counted = predicted |",
        "|---|---|---|---|",
    ]
    for name, measured in r["measured_step_s"].items():
        equal = r.get("calls", {}).get(name, {}).get("equal")
        out.append(
            f"| {name} | {_ms(measured)} | {_ms(r['predicted'][name]['step_s'])} | "
            f"{'yes' if equal else 'no' if equal is not None else ''} |"
        )
    out.append(
        f"\nSpearman rank correlation, predicted vs measured: **{r['spearman']:.3f}**; "
        f"host work per DTensor / FSDP2 call: {r.get('host_call_s')}."
    )
    return out


def _tensor_parallel(r: dict[str, Any]) -> list[str]:
    out = ["| layout | median step ms | ratio to unsharded |", "|---|---|---|"]
    for name, row in r["step_seconds"].items():
        out.append(f"| {name} | {_ms(row['median'])} | {r['ratio_to_unsharded'][name]:.2f} |")
    return out


def _stability(r: dict[str, Any]) -> list[str]:
    out = [
        "| section | model | median step ms (off / monitor / monitor+fallback) |",
        "|---|---|---|",
    ]
    for key in ("callback_overhead_small", "callback_overhead_large", "fusion_ddp_overhead"):
        if key in r:
            med = r[key]["median_step_s"]
            out.append(
                f"| {key} | {r[key]['model']} | "
                + " / ".join(_ms(med[v]) for v in ("off", "monitor", "monitor+fallback"))
                + " |"
            )
    if "precision_cpu" in r:
        p = r["precision_cpu"]
        out.append(
            f"\nCPU precision ({p['model']}): bf16 / fp32 {p['ratio_bf16_vs_fp32']:.2f}, "
            f"fp8 emulation / fp32 {p['ratio_fp8_emulation_vs_fp32']:.2f}."
        )
    return out


def _ratio_rows(ratios: dict[str, dict[str, Any]], label: str) -> list[str]:
    out = [f"| {label} | ours ms | theirs ms | ratio | spread |", "|---|---|---|---|---|"]
    for name, r in ratios.items():
        out.append(
            f"| {name} | {_ms(r['ours_s'])} | {_ms(r['theirs_s'])} | {r['ratio']:.3f} | "
            f"{r['spread']:.3f} |"
        )
    return out


def _overhead(r: dict[str, Any]) -> list[str]:
    out = [
        "| procs | pair | vs | ours ms | theirs ms | ratio | spread | loop ratio (spread) "
        "| target | same losses |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for world, pairs in r["results"].items():
        for name, p in pairs.items():
            loop = (
                f"{p['loop_ratio']:.3f} ({p['loop_spread']:.3f})" if "loop_ratio" in p else ""
            )  # seconds per step of the whole loop (bench_overhead.loop_seconds), when measured
            out.append(
                f"| {world} | {name} | {p['theirs']} | {_ms(p['ours_s'])} | "
                f"{_ms(p['theirs_s'])} | {p['ratio']:.3f} | {p['spread']:.3f} | {loop} | "
                f"<= {p['target']} | {'yes' if p['same_work'] else 'NO'} |"
            )
    return out


def _zero(r: dict[str, Any]) -> list[str]:
    out = _ratio_rows(r["ratios"], "pair (ours / DeepSpeed)")
    out += [
        "",
        "| side | parameters | gradients | optimizer | fp32 master | other | total B |",
        "|---|---|---|---|---|---|---|",
    ]
    for side, b in r["bytes"].items():
        b = b[0] if isinstance(b, list) else b  # rank 0
        roles = ("parameters", "gradients", "optimizer", "master", "other")
        total = sum(int(b.get(k, 0)) for k in roles)
        cells = " | ".join(str(b.get(k, 0)) for k in roles)
        out.append(f"| {side} | {cells} | {total} |")
    out.append(
        f"\nFirst-step loss, every side vs mm_fsdp: {r['loss_check']}. torchtitan: "
        f"{r['torchtitan'].get('finding', r['torchtitan'])}"
    )
    return out


def _memory_comm(r: dict[str, Any]) -> list[str]:
    out = [
        "| layout | state / ideal (max, mean) | within 5% | state / honest ideal (max) | "
        "within 2% | state = model | comm = model |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, x in r["memory_comm"].items():
        ranged = {k: v for rank in x["ranks"] for k, v in rank.get("comm_ranged", {}).items()}
        note = f" (outside bounds: {ranged})" if ranged and not x["comm_equal"] else ""
        honest = x.get("honest_ratio_max")
        out.append(
            f"| {name} | {x['ratio_max']:.3f}, {x['ratio_mean']:.3f} | "
            f"{'yes' if x['within_5pct'] else 'no'} | "
            + (f"{honest:.4f} | {'yes' if x['honest_within_2pct'] else 'no'}" if honest else " | ")
            + f" | {'yes' if x['state_equal'] else 'NO'}"
            f" | {'yes' if x['comm_equal'] else 'NO'}{note} |"
        )
    definition = r.get("config", {}).get("ideal_definition")
    if definition:
        out += ["", f"Ideals: {definition}"]
    out += ["", *MEMORY_NOTE]
    for name, x in r["memory_comm"].items():
        out += _excess_table(name, x)
    return out + _at_scale(r.get("at_scale"))


MEMORY_NOTE = [
    "Why each cause is there (`lightning_mmpar.layout.memory_ideal`; the tables below give "
    "the largest rank's bytes, computed from the cost model and equal to the bytes measured "
    "on every rank): **replicated over tp** are the parameters the tensor-parallel plan leaves "
    "whole (`ParamSpec.tp_dim` None): norms and row-parallel biases (Megatron-LM's choice: a "
    "split would add a collective per use), the ViT stem (patch convolution, class and position "
    "embeddings) under `vision_parallel='tp'` (the whole tower under `replicate`; stem and "
    "blocks under `dp`), the small projections between towers (the ViT's `proj`, the bridge's "
    "`projector`, the contrastive heads) and the momentum heads (frozen: no gradient nor "
    "moments); under FSDP2 each is still sharded over dp (held `1 / dp`, checked by "
    "tests/unit/layout/test_memory_ideal.py). **Stage imbalance**: pipeline blocks are "
    "indivisible; for these layouts the equal cut is already the contiguous cut with the "
    "smallest largest rank (same test), so nothing is left to balance. **0-dim** parameters "
    "(gate scalars, the logit scale) and AdamW's 4-byte `step` per parameter are whole on "
    "every rank. Outside the state (not in the ratios): buffers (the MoE routers' "
    "`expert_bias` and masks), the gradient cache's features (`pipeline_features`' outputs on "
    "the last stage, both passes of one step) and FSDP2's shard padding. The "
    "replicated share is large here because the model is tiny (width 64): replicated tensors "
    "grow with the width, sharded ones with its square.",
]
"""The memory section's explanation of the causes (docs/results.md)."""


def _at_scale(x: dict[str, Any] | None) -> list[str]:
    """The 8-GPU recipe's largest rank, per partition, from the cost model alone."""
    if not x:
        return []
    out = [
        "",
        f"**At scale** (`recipes/{x['recipe']}`, cost model only, the largest rank): "
        "ratio to the ideal and the largest causes, per partition.",
        "",
        "| partition | state / ideal | state / honest ideal | largest causes (share of ideal) |",
        "|---|---|---|---|",
    ]
    for name, y in x.items():
        if not isinstance(y, dict):
            continue
        top = sorted(y["excess"].items(), key=lambda kv: -abs(kv[1][0]))[:3]
        causes = ", ".join(f"{k} {100 * share:.1f}%" for k, (_, share) in top)
        cut = f" {y['boundaries']}" if y.get("boundaries") else ""
        out.append(
            f"| {name}{cut} | {y['ratio_to_ideal']:.3f} | {y['ratio_to_honest']:.4f} | {causes} |"
        )
    return out


def _excess_table(name: str, x: dict[str, Any]) -> list[str]:
    """The largest rank's bytes above the ideal by cause (shares of the ideal), and what it
    holds outside the state (buffers, gradient-cache features)."""
    causes = x.get("excess_largest")
    if not causes:
        return []
    rank = x["ranks"][x["largest_rank"]]
    out = [
        "",
        f"**{name}**, rank {x['largest_rank']}: holds {rank['measured_bytes']:,} B, ideal "
        f"{x['ideal_bytes']:,.0f} B, honest ideal {rank['honest_ideal_bytes']:,.0f} B "
        f"(ratio {rank['ratio_to_ideal']:.4f}, {rank['ratio_to_honest']:.4f}).",
        "",
        "| above the ideal | bytes | share of the ideal |",
        "|---|---|---|",
    ]
    for cause, (value, share) in sorted(causes.items(), key=lambda kv: -abs(kv[1][0])):
        out.append(f"| {cause} | {value:,.0f} | {100 * share:.2f}% |")
    total = sum(v for v, _ in causes.values())
    out.append(f"| **total** | **{total:,.0f}** | **{100 * total / x['ideal_bytes']:.2f}%** |")
    out.append(
        f"\nOutside the state: buffers {rank['buffer_bytes']:,} B, gradient-cache features "
        f"of one step {rank['gradient_cache_bytes']:,} B, FSDP2 padding "
        f"{rank['storage_bytes'] - rank['measured_bytes']:,} B."
    )
    return out


def _scaling(r: dict[str, Any]) -> list[str]:
    out = [
        "| doubled | step-time exponent (expected from FLOPs) | memory exponent (expected) |",
        "|---|---|---|",
    ]
    for axis, x in r["scaling"].items():
        out.append(
            f"| {axis} | {x['time_exponent']:.2f} ({x['time_expected']:.2f}) | "
            f"{x['memory_exponent']:.2f} ({x['memory_expected']:.2f}) |"
        )
    return out


def _generic(r: dict[str, Any]) -> list[str]:
    """Top-level numbers, and the ``ratio`` of any nested comparison."""
    out = ["| figure | value |", "|---|---|"]

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            if "ratio" in value and isinstance(value["ratio"], int | float):
                spread = value.get("spread")
                extra = f" (spread {spread:.3f})" if isinstance(spread, int | float) else ""
                out.append(f"| {prefix} | {value['ratio']:.3f}{extra} |")
                return
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out.append(f"| {prefix} | {value:.4g} |")

    walk("", {k: v for k, v in r.items() if k not in ("machine", "command", "config")})
    return out


def _learning(r: dict[str, Any]) -> list[str]:
    out = [
        "| run | YAML | layout | steps | zero-shot acc | bar met | greedy caption acc | "
        "train loss first -> last | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, x in r["runs"].items():
        lay = x["layout"]
        layout = f"tp {lay['tp']} x pp {lay['pp']} x dp {lay['dp']}, ep {lay['ep']}"
        out.append(
            f"| {name} | `{x['yaml']}` | {layout} | {x['steps']} | {x['zero_shot_acc']:.3f} | "
            f"{'yes' if x['met'] else 'NO'} (>= {x['bar']}) | {x['caption_acc_greedy']:.3f} | "
            f"{x['first_train_loss']:.3f} -> {x['last_train_loss']:.3f} | {x['wall_s']} |"
        )
    out.append(
        "\nThe test suite's learning bars until it had to fit in 20 minutes on 2 cores; the "
        "tests keep short runs of the same commands (tests/recipes/test_clip_llama.py)."
    )
    return out


def _packing(r: dict[str, Any]) -> list[str]:
    out = [
        "| data | side | rows | row tokens | non-pad fraction | target tokens | target tokens/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for data, x in r["packing"].items():
        for side in ("padded", "packed"):
            s = x[side]
            out.append(
                f"| {data} | {side} | {s['rows']} | {min(s['row_tokens'])}-"
                f"{max(s['row_tokens'])} | {s['non_pad_fraction']:.3f} | {s['target_tokens']} | "
                f"{s['target_tokens_per_s']:.0f} |"
            )
    speed = ", ".join(
        f"{data} {x['speedup']['ratio']:.2f} (spread {x['speedup']['spread']:.2f})"
        for data, x in r["packing"].items()
    )
    out.append(f"\nTarget tokens/s, packed / padded (above 1: packing faster): {speed}.")
    return out


def _noncolocated(r: dict[str, Any]) -> list[str]:
    c = r["config"]
    out = [
        f"{c['processes']} processes, one core each; {c['global_batch']} samples per step, "
        f"{r['measured'][r['best_colocated']]['images_per_sample']:.2f} images per sample; "
        f"load average at the end {r['load_average'][0]:.1f} (1 min), "
        f"{r['load_average'][1]:.1f} (5 min).",
        "",
        "| layout | median step ms | tokens/s per process | CPU ms per step (all ranks) "
        "| CPU ms on the critical path | non-colocated / this (spread) |",
        "|---|---|---|---|---|---|",
    ]
    for name, x in r["layouts"].items():
        vs = r["against"].get(name)
        ratio = f"{vs['ratio']:.2f} ({vs['spread']:.2f})" if vs else ""
        out.append(
            f"| {name} | {_ms(x['step_s'])} | {x['tokens_per_s_per_process']:.1f} | "
            f"{_ms(x['cpu_s_all_ranks'])} | {_ms(x['cpu_critical_s'])} | {ratio} |"
        )
    cpu, accumulate = r["cpu_critical_ratio"], c.get("accumulate", 1)
    critical = (
        "both ranks' non-colocated (its exchange is serial with one batch per step)"
        if accumulate == 1
        else f"the busier rank's non-colocated too (its vision rank runs one batch ahead "
        f"inside each window of {accumulate} batches)"
    )
    out.append(
        f"\nEvery layout: {accumulate} batch(es) per optimizer step "
        f"(`accumulate_grad_batches`). Step time non-colocated / best colocated "
        f"({r['best_colocated']}): {r['ratio']:.2f} (spread {r['spread']:.2f} over "
        f"{c['rounds']} rounds). On the CPU critical path (the busiest rank's CPU seconds per "
        f"step colocated, {critical}), against {cpu['against']}: {cpu['ratio']:.2f}. A load "
        "average above the 2 cores gives the job's processes less than a core each and "
        "stretches the layouts whose ranks compute at once: run it on a quiet machine."
    )
    planned = RESULTS / "planner_noncolocated.json"
    if planned.exists():
        out += ["", *_planner_noncolocated(json.loads(planned.read_text()))]
    return out


def _planner_noncolocated(r: dict[str, Any]) -> list[str]:
    """``bench_planner.py --noncolocated``: predicted vs measured order of the same layouts."""
    out = [
        f"Planner vs measured (`{r.get('command', '')}`, load average "
        f"{r['load_average'][0]:.1f}; Spearman {r['spearman']:.2f}):",
        "",
        "| layout | measured ms | CPU critical path ms | predicted ms |",
        "|---|---|---|---|",
    ]
    for name, m in r["measured_step_s"].items():
        cpu = r["measured_cpu_critical_s"][name]
        out.append(f"| {name} | {_ms(m)} | {_ms(cpu)} | {_ms(r['predicted'][name]['step_s'])} |")
    out += [
        "",
        "| non-colocated faster than | measured (wall) | measured (CPU critical path) "
        "| predicted | agree (wall / CPU) |",
        "|---|---|---|---|---|",
    ]
    for a, b in zip(r["agreement"], r["agreement_cpu_critical"], strict=True):
        agree = f"{'yes' if a['agree'] else 'NO'} / {'yes' if b['agree'] else 'NO'}"
        out.append(
            f"| {a['against']} | {a['measured_faster']} | {b['measured_faster']} | "
            f"{a['predicted_faster']} | {agree} |"
        )
    return out


def _hf_tax(r: dict[str, Any]) -> list[str]:
    out = [
        "| side | step (ms) | transformers (ms) | ratio | spread | first-step loss |",
        "|---|---|---|---|---|---|",
    ]
    names = {"ours": "our blocks (caption-only: no text-only stream)"}
    names["ours_text_stream"] = "our blocks with the text-only stream"
    for side, label in names.items():
        x = r[side]
        out.append(
            f"| {label} | {x['ours_s'] * 1e3:.1f} | {x['theirs_s'] * 1e3:.1f} | "
            f"{x['ratio']:.3f} | {x['spread']:.3f} | {r['first_loss'][side]:.6f} |"
        )
    verdict = "met" if r["met"] else "NOT met"
    out.append(
        f"\nTarget: ratio <= {r['target']:.2f} ({verdict}); transformers' first-step loss "
        f"{r['first_loss']['theirs']:.6f} (same loss on every side: {r['same_loss']}). "
        f"Batch: {r['batch']['rows']} rows x {r['batch']['tokens']} tokens, "
        f"{r['image_tokens']} image tokens per image."
    )
    return out


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _hf_tax_qwen(r: dict[str, Any]) -> list[str]:
    out = [
        "| family | ours (ms) | transformers (ms) | ratio | spread (max - min) | fastest steps' "
        "ratio | repeats | same first-step loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for family, x in r["families"].items():
        o = x["ours"]
        out.append(
            f"| {family} | {o['ours_s'] * 1e3:.1f} | {o['theirs_s'] * 1e3:.1f} | "
            f"{o['ratio']:.3f} | {o['spread']:.3f} | {_fmt(o.get('ratio_of_fastest'))} | "
            f"{len(o['ratios'])} | {x['same_loss']} |"
        )
    verdict = "met" if r["met"] else "NOT met"
    out.append(f"\nTarget: ratio <= {r['target']:.2f} for every family ({verdict}).")
    return out


SUMMARIES: dict[str, Summary] = {
    "pipeline": _pipeline,
    "planner": _planner,
    "tensor_parallel": _tensor_parallel,
    "stability": _stability,
    "overhead": _overhead,
    "zero": _zero,
    "memory_comm": _memory_comm,
    "scaling": _scaling,
    "learning": _learning,
    "packing": _packing,
    "noncolocated": _noncolocated,
    "hf_tax": _hf_tax,
    "hf_tax_qwen": _hf_tax_qwen,
}
"""Per benchmark: its key figures as markdown lines (others: :func:`_generic`)."""


def render(results: Path = RESULTS) -> str:
    """docs/results.md's text from the JSON files in ``results``."""
    from run_all import BENCHMARKS

    lines = [
        "# Benchmark results",
        "",
        "Generated by `python benchmarks/results_md.py` from `docs/results/*.json`; every "
        "benchmark runs with `python benchmarks/run_all.py` (`--smoke` for one short "
        "iteration each). Where a section compares us with a peer, ratios are ours / theirs "
        "(below 1: faster), both sides interleaved in one invocation, with the spread of "
        "the per-repeat ratios; these machines are noisy (2 shared cores, a model of a "
        "few hundred thousand parameters): a spread as large as the gap means the "
        "comparison is inconclusive, and CPU ratios say little about GPUs at scale.",
        "",
    ]
    for name, (script, what) in BENCHMARKS.items():
        path = results / f"{name}.json"
        lines += [f"## {name}: {what}", ""]
        if not path.exists():
            lines += [f"Not run yet: `python benchmarks/{script}`.", ""]
            continue
        r = json.loads(path.read_text())
        m = r.get("machine", {})
        lines += [
            f"`{r.get('command', 'python benchmarks/' + script)}` on {m.get('cpus', '?')} "
            f"CPUs, torch {m.get('torch', '?')}, Lightning {m.get('lightning', '?')} "
            f"({m.get('platform', '')}).",
            "",
        ]
        lines += [*SUMMARIES.get(name, _generic)(r), ""]
        png = results / f"{name}.png"
        if png.exists():
            lines += [f"![{name}]({png.relative_to(ROOT / 'docs').as_posix()})", ""]
    lines += _gpu_sections(results)
    return "\n".join(lines)


def _gpu_runs(runs: dict[str, Any]) -> list[str]:
    """One table row per GPU run: step seconds, tokens/s, TFLOP/s, MFU, peak memory."""
    rows = ["| run | step s | tokens/s | TFLOP/s | MFU | peak GiB |", "|---|---|---|---|---|---|"]
    for kind, r in runs.items():
        if "step_s" not in r:
            rows.append(f"| {kind} | {r.get('skipped') or r.get('error')} | | | | |")
            continue
        mfu = "-" if r.get("mfu") is None else f"{r['mfu']:.1%}"
        mem = "-" if r.get("peak_memory_gib") is None else f"{r['peak_memory_gib']:.1f}"
        rows.append(
            f"| {kind} | {r['step_s']:.3f} | {r['tokens_per_s']:.0f} | "
            f"{r['achieved_tflops']:.1f} | {mfu} | {mem} |"
        )
    return rows


def _gpu_check(r: dict[str, Any]) -> list[str]:
    """gpu_check.json: the runs, the FP8 speed-up rounds, the forced fallback, the collectives."""
    fb, col = r["runs"]["fp8_fallback"]["fallback"], r["runs"]["bf16"]["collectives"]
    rounds = ", ".join(f"{x:.2f}" for x in r["fp8_speedup_rounds"])
    return [
        *_gpu_runs(r["runs"]),
        "",
        f"FP8 ({r['runs']['fp8']['fp8_backend']}) vs BF16: {r['fp8_speedup']:.2f}x "
        f"(rounds {rounds}). Forced FP8 -> BF16 fallback at step {fb['outlier_at_step']} on "
        f"`{fb['forced_module']}`: {'OK' if fb['ok'] else 'FAILED'} "
        f"({fb['counters']['redone_steps']} steps redone). Collectives ({col['backend']}, groups "
        f"{', '.join(col['groups'])}): {len(col['helpers'])} helper checks and {len(col['raw'])} "
        f"raw collectives, failed: {col['failed'] or 'none'}.",
    ]


def _gpu_llava(r: dict[str, Any]) -> list[str]:
    """gpu_llava.json: the runs and the packed / FP8 ratios."""

    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}x"

    runs = r["runs"]
    fill = {k: runs[k]["batches"]["non_pad_fraction"] for k in ("bf16_packed", "bf16_padded")}
    return [
        *_gpu_runs(runs),
        "",
        f"Packed vs padded tokens/s (BF16, eager): {fmt(r['packed_vs_padded_tokens_per_s'])} "
        f"(non-pad fraction {fill['bf16_packed']:.2f} vs {fill['bf16_padded']:.2f}). FP8 "
        f"(torchao) vs BF16: {fmt(r['fp8_speedup_eager'])} eager, "
        f"{fmt(r['fp8_speedup_compiled'])} with `compile_blocks` (one run each).",
        "",
        _llava_projector(r),
    ]


def _llava_projector(r: dict[str, Any]) -> str:
    """Which projector gpu_llava.json's figures were measured with: its ``projector``, or, for a
    JSON from before the script recorded one, the linear projector it then built."""
    if "projector" in r:
        return f"Projector: `{r['projector']}` (LLaVA-1.5's)."
    return (
        "Projector: linear (measured before gpu_llava.py built LLaVA-1.5's `mlp2x_gelu`; "
        "a new run records its projector)."
    )


def _gpu_sections(results: Path) -> list[str]:
    """The GPU checks' sections (``gpu_check.json``, ``gpu_llava.json``), or how to run them;
    and the host-CPU DDP pair measured on the GPU machine (``gpu_host_overhead.json``)."""
    lines: list[str] = []
    sections = {
        "gpu_check": (
            "the product's model on one GPU (BF16, FP8, forced FP8 fallback)",
            _gpu_check,
        ),
        "gpu_llava": (
            "a LLaVA-1.5-7B-shaped model on ragged batches (MFU, packing, torchao FP8)",
            _gpu_llava,
        ),
    }
    for name, (title, summary) in sections.items():
        lines += [f"## {name}: {title}", ""]
        path = results / f"{name}.json"
        if not path.exists():
            lines += [
                f"Not run on a GPU yet: `bash benchmarks/gpu_check.sh` on a CUDA machine writes "
                f"`docs/results/{name}.json`; its code path runs on CPU at tiny sizes in the "
                f"tests (`python benchmarks/{name}.py --smoke`).",
                "",
            ]
            continue
        r = json.loads(path.read_text())
        m = r.get("machine", {})
        lines += [
            f"`{r.get('command')}` on {r.get('device', '?')} (torch {m.get('torch', '?')}, "
            f"{r['warmup']} warm-up + {r['steps']} timed steps a run).",
            "",
            *summary(r),
            "",
        ]
    host = results / "gpu_host_overhead.json"
    if host.exists():
        r = json.loads(host.read_text())
        lines += [
            "## gpu_host_overhead: ours vs Lightning ddp on the GPU machine's 16 host cores",
            "",
            f"`{r.get('command')}` ({r['machine'].get('cpus', '?')} CPUs: each process has its "
            "own cores, unlike the 2-core machine above).",
            "",
            *SUMMARIES["overhead"](r),
            "",
        ]
    return lines


def main(argv: list[str] | None = None) -> None:
    import argparse

    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    out = ROOT / "docs" / "results.md"
    out.write_text(render())
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
