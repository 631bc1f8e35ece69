"""GPU check: the fusion model on one device in BF16 and FP8 (and the FP8 fallback path forced
once), its tokens/s, MFU and peak memory, and every collective helper at world size 1.

    bash benchmarks/gpu_check.sh             # one CUDA GPU, < 5 minutes; no CUDA: exits 0
    python benchmarks/gpu_check.py --smoke --out-dir /tmp/r   # --device cpu --tiny, 4 steps

**Model**: the recipe's ``ClipLlamaModule`` at :data:`SIZES` (``realistic``: ViT-B/16 at 224 px,
frozen as the recipe's default fine-tuning policy has it, one adapter block and a 1B-class LLaMA:
16 layers of width 2048, 16 heads (4 key-value), FFN 5632, vocabulary 32000, all trained; batch
16 x 512 text tokens), trained by ``Trainer(strategy=MultimodalParallelStrategy(), devices=1,
precision="bf16-mixed")`` on random batches at the recipe's shapes (no network). **Runs**, each
a fresh module and Trainer: ``bf16``; ``fp8`` (every linear but the LM head converted by
``convert_to_fp8``: ``torch._scaled_mm`` on GPUs of capability >= 8.9, else the exact
emulation); ``fp8_fallback``: ``fp8`` with ``FP8FallbackCallback`` and, at one step, one FP8
layer's input scaled by :data:`OUTLIER` (its delayed scale overflows): that layer must fall
back to bf16 and the step be redone (``ok``: it fell back at that step, not before; what fell
back before the outlier is listed). The timed runs are interleaved, ``bf16 fp8`` then
``fp8 bf16`` (``fp8_2``, ``bf16_2``): the FP8 speed-up is the median of the two rounds' ratios.

**Figures** over the steps after ``--warmup`` (device synchronised around each): median step
seconds, tokens/s (the batch's image patches + text tokens / step), MFU = model FLOPs of a step
(``ClipLlamaModule.pipeline_block_specs``, the planner's count: frozen weights without their
weight gradient) / (step x peak of the matched ``layout.cost.DEVICES`` entry at the run's matmul
precision; ``null`` for a device without one, e.g. a CPU; PaLM's MFU, Chowdhery et al. 2022,
app. B), peak memory (``torch.cuda.max_memory_allocated``; ``null`` on CPU).

**Collectives**: at the end of the ``bf16`` run (the strategy's group live: NCCL on CUDA, gloo
on CPU) every public helper of ``parallel.comm`` runs on the world, dp, tp and pp groups, its
result checked (the identity at size 1; send/recv, with no peer, must raise ``ValueError``);
the helpers stop before the backend at size 1, so the collectives also run once through
``torch.distributed`` (the backend's kernels on the device).
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback

sys.path.insert(0, str(Path(__file__).parent))
from gpu_collectives import CollectiveProbe
from report import write_result

SIZES: dict[str, dict[str, Any]] = {
    "realistic": {
        "vision": {
            "image_size": 224,
            "patch_size": 16,
            "width": 768,
            "layers": 12,
            "heads": 12,
            "output_dim": 512,
        },
        "language": {
            "hidden_size": 2048,
            "intermediate_size": 5632,
            "num_hidden_layers": 16,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
        },
        "adapter": {"heads": 16, "width": 2048, "ffn_width": 5632, "dropout": 0.0},
        "contrastive_dim": 512,
        "vocab_size": 32000,
        "batch": 16,
        "text_length": 512,
        "train_vision": False,
    },
    "tiny": {
        "vision": {
            "image_size": 16,
            "patch_size": 8,
            "width": 32,
            "layers": 1,
            "heads": 2,
            "output_dim": 16,
        },
        "language": {
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        },
        "adapter": {"heads": 2, "width": 32, "ffn_width": 48, "dropout": 0.0},
        "contrastive_dim": 16,
        "vocab_size": 64,
        "batch": 4,
        "text_length": 16,
        "train_vision": True,
    },
}
"""Model and batch sizes (``realistic``: about 1.0 B parameters, 0.9 B trained)."""
OUTLIER = 1e4  # factor on one FP8 layer's input at the forced-fallback step


def build_module(sizes: dict[str, Any], fp8: bool) -> Any:
    """A seeded :class:`ClipLlamaModule` at ``sizes``; ``fp8``: its linears converted (LM head
    kept in bf16) right after the model is built, before the strategy wraps it."""
    from lightning_mmpar.models.adapter import AdapterConfig
    from lightning_mmpar.models.fusion import FusionConfig
    from lightning_mmpar.models.language import LanguageConfig
    from lightning_mmpar.models.vision import VisionConfig
    from lightning_mmpar.precision import FP8Policy, convert_to_fp8
    from lightning_mmpar.recipes.module import ClipLlamaModule
    from lightning_mmpar.recipes.options import FinetuneConfig, OptimConfig

    class CheckModule(ClipLlamaModule):
        def configure_model(self) -> None:
            if self.blocks is not None:
                return
            torch.manual_seed(0)
            super().configure_model()
            if fp8:
                assert self.blocks is not None
                convert_to_fp8(self.blocks, FP8Policy(keep_high_precision=("*lm_head",)))

    fusion = FusionConfig(
        vision=VisionConfig(**sizes["vision"]),
        language=LanguageConfig(**sizes["language"]),
        adapter=AdapterConfig(**sizes["adapter"]),
        contrastive_dim=sizes["contrastive_dim"],
    )
    finetune = FinetuneConfig(
        train_vision=sizes["train_vision"], train_decoder_layers=-1, train_embeddings=True
    )
    module = CheckModule(
        fusion=fusion,
        vocab_size=sizes["vocab_size"],
        finetune=finetune,
        optim=OptimConfig(lr=1e-4, warmup_steps=1, min_lr_ratio=1.0),
    )
    module.text_length = sizes["text_length"]
    return module


def batches(sizes: dict[str, Any], n: int) -> list[dict[str, torch.Tensor]]:
    """``n`` random batches at the recipe's shapes (token ids above the special ids 0-2)."""
    g = torch.Generator().manual_seed(0)
    b, t, px = sizes["batch"], sizes["text_length"], sizes["vision"]["image_size"]
    ids = [torch.randint(3, sizes["vocab_size"], (b, t), generator=g) for _ in range(n)]
    return [
        {
            "images": torch.randn(b, 3, px, px, generator=g),
            "input_ids": i,
            "attention_mask": torch.ones_like(i),
            "target_ids": i.clone(),
        }
        for i in ids
    ]


class Timer(Callback):
    """Per-batch wall seconds (device synchronised at both ends) and the logged losses."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.losses: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        torch.cuda.synchronize() if torch.cuda.is_initialized() else None
        self._t = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, *args: Any) -> None:
        torch.cuda.synchronize() if torch.cuda.is_initialized() else None
        self.times.append(time.perf_counter() - self._t)
        self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))


class ForceOverflow(Callback):
    """At step ``step``, scale one FP8 layer's input by :data:`OUTLIER`, once (not in the redo)."""

    def __init__(self, step: int, fallback: Any = None) -> None:
        self.step, self.target, self.fired_at, self._armed = step, "", -1, False
        self.fallback, self.fallen_before = fallback, list[str]()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        from lightning_mmpar.precision import fp8_modules

        mods = {n: m for n, m in fp8_modules(pl_module).items() if m.precision == "fp8"}
        self.target = next((n for n in mods if n.endswith("down_proj")), next(iter(mods)))
        mods[self.target].register_forward_pre_hook(self._hook)

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        self._armed = trainer.global_step == self.step and self.fired_at < 0
        if self._armed and self.fallback is not None:  # what fell back before the outlier
            self.fallen_before = sorted(self.fallback.fallen)

    def _hook(self, module: Any, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        if not self._armed:
            return args
        self._armed, self.fired_at = False, self.step
        return (args[0] * OUTLIER, *args[1:])


def peak_of(device: torch.device, precision: str) -> tuple[float | None, str]:
    """Peak FLOP/s of this device at ``precision`` (``bf16-mixed`` / ``fp8``) from
    :data:`DEVICES` by ``torch.cuda.get_device_name``, and what was matched (or why not)."""
    from lightning_mmpar.layout.cost import DEVICES

    if device.type != "cuda":
        return None, f"{device.type}: no peak figure for its {precision} matmuls"
    name = torch.cuda.get_device_name(device)
    if any(v in name.lower() for v in ("pcie", "nvl")):
        return None, f"{name}: DEVICES holds SXM figures only"
    key = next((k for k in DEVICES if k != "cpu" and k in name.lower()), None)
    if key is None:
        return None, f"{name}: not in DEVICES ({', '.join(DEVICES)})"
    try:
        return DEVICES[key].peak(precision), f"{name} -> DEVICES[{key!r}] {DEVICES[key].name}"
    except ValueError as err:
        return None, str(err)


def run(kind: str, args: argparse.Namespace, sizes: dict[str, Any], root: str) -> dict[str, Any]:
    """One Trainer run (``bf16``, ``fp8`` or ``fp8_fallback``); its figures."""
    from lightning_mmpar import MultimodalParallelStrategy
    from lightning_mmpar.callbacks import FP8FallbackCallback, GradientDriftMonitor
    from lightning_mmpar.precision import detect_backend, fp8_modules
    from lightning_mmpar.testing import quiet_trainer

    device, steps = torch.device(args.device), args.warmup + args.steps
    module = build_module(sizes, fp8=kind != "bf16")
    timer, checks, fallback = Timer(), CollectiveProbe(), None
    callbacks: list[Callback] = [timer, checks] if kind == "bf16" else [timer]
    if kind == "fp8_fallback":
        fallback = FP8FallbackCallback(monitor=GradientDriftMonitor(log_dir=f"{root}/{kind}"))
        force = ForceOverflow(step=args.warmup, fallback=fallback)
        callbacks += [force, fallback.mon, fallback]
    if device.type == "cuda":  # the earlier runs' Trainer/module cycles freed, then the peak reset
        gc.collect()
        torch.cuda.reset_peak_memory_stats(device)
    trainer = quiet_trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu",
        devices=1,
        strategy=MultimodalParallelStrategy(),
        precision="bf16-mixed",
        max_steps=steps,
        limit_val_batches=0,
        use_distributed_sampler=False,
        callbacks=callbacks,
        default_root_dir=f"{root}/{kind}",
    )
    start = time.perf_counter()
    trainer.fit(module, torch.utils.data.DataLoader(batches(sizes, steps), batch_size=None))  # type: ignore[arg-type]
    wall, step_s = time.perf_counter() - start, statistics.median(timer.times[args.warmup :])
    flops = sum(s.flops for s in module.pipeline_block_specs(sizes["text_length"])) * sizes["batch"]
    image_tokens = (sizes["vision"]["image_size"] // sizes["vision"]["patch_size"]) ** 2
    tokens = sizes["batch"] * (image_tokens + sizes["text_length"])
    peak, matched = peak_of(device, "bf16-mixed" if kind == "bf16" else "fp8")
    bf16_peak, _ = peak_of(device, "bf16-mixed")
    mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    out: dict[str, Any] = {
        "step_s": step_s,
        "step_s_all": timer.times,
        "wall_s": wall,
        "tokens_per_s": tokens / step_s,
        "samples_per_s": sizes["batch"] / step_s,
        "text_tokens_per_s": sizes["batch"] * sizes["text_length"] / step_s,
        "model_tflop_per_step": flops / 1e12,
        "achieved_tflops": flops / step_s / 1e12,
        "mfu": None if peak is None else flops / step_s / peak,
        "peak": matched,
        "mfu_vs_bf16_peak": None if bf16_peak is None else flops / step_s / bf16_peak,
        "peak_memory_gib": mem,
        "losses": timer.losses,
        "losses_finite": all(math.isfinite(x) for x in timer.losses),
    }
    if kind != "bf16":
        info, mods = detect_backend("auto"), fp8_modules(module).values()
        out["fp8_backend"] = f"{info.name} ({info.reason})"
        out["fp8_layers"] = [sum(m.precision == "fp8" for m in mods), len(mods)]
    if fallback is not None:  # ok: the forced module fell back at the outlier, not before
        fallen = sorted(fallback.fallen)
        out["fallback"] = {
            "forced_module": force.target,
            "outlier_at_step": force.fired_at,
            "counters": dict(fallback.counters),
            "fallen_back": fallen,
            "fell_back_before_outlier": force.fallen_before,
            "ok": force.fired_at >= 0
            and force.target in fallen
            and force.target not in force.fallen_before
            and fallback.counters["redone_steps"] >= 1,
        }
    if checks.result:
        out["collectives"] = checks.result
    return out


def print_runs(runs: dict[str, Any], width: int) -> None:
    """One line per run (``width``: the name column): step seconds, tokens/s, TFLOP/s, MFU, peak
    memory; a run without figures prints why (``skipped`` / ``error``)."""
    print(f"{'run':<{width}}{'step s':>9}{'tokens/s':>11}{'TFLOP/s':>9}{'MFU':>7}{'peak GiB':>10}")
    for kind, r in runs.items():
        if "step_s" not in r:
            print(f"{kind:<{width}}{r.get('skipped') or r.get('error')}")
            continue
        mfu = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
        mem = "-" if r["peak_memory_gib"] is None else f"{r['peak_memory_gib']:.1f}"
        print(
            f"{kind:<{width}}{r['step_s']:>9.4f}{r['tokens_per_s']:>11.0f}"
            f"{r['achieved_tflops']:>9.2f}{mfu:>7}{mem:>10}"
        )


def print_table(result: dict[str, Any]) -> None:
    """The runs' figures and the collective checks' summary, as a text table."""
    print(
        f"gpu_check on {result['device']} ({result['sizes']} sizes, {result['warmup']} warm-up "
        f"+ {result['steps']} timed steps)"
    )
    print_runs(result["runs"], width=13)
    bf, fb = result["runs"]["bf16"], result["runs"]["fp8_fallback"]
    cpu, f, col = bf["peak_memory_gib"] is None, fb["fallback"], bf["collectives"]
    print(
        f"MFU peak: {bf['peak']}; peak memory: "
        f"{'null (CPU: no allocator statistics)' if cpu else 'max_memory_allocated'}\n"
        f"fp8: {result['runs']['fp8']['fp8_backend']}; speed-up vs bf16 "
        f"{result['fp8_speedup']:.2f}x (rounds bf16 fp8, fp8 bf16: "
        f"{', '.join(f'{x:.2f}' for x in result['fp8_speedup_rounds'])})\n"
        f"fp8 fallback forced at step {f['outlier_at_step']} on {f['forced_module']}: "
        f"{'OK' if f['ok'] else 'FAILED'} (fell back: {f['fallen_back']}; before the "
        f"outlier: {f['fell_back_before_outlier'] or 'none'}; {f['counters']})\n"
        f"collectives ({col['backend']}, groups {col['groups']}): {len(col['helpers'])} helper "
        f"checks, {len(col['raw'])} raw; failed: {col['failed'] or 'none'}"
    )


def add_run_args(p: argparse.ArgumentParser, steps: int, tiny_help: str) -> None:
    """The options both GPU scripts take: device, tiny sizes, smoke, timed and untimed steps,
    output folder (``steps``: the default number of timed steps)."""
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help=tiny_help)
    p.add_argument("--smoke", action="store_true", help="--device cpu --tiny, 2 + 2 steps")
    p.add_argument(
        "--steps", type=int, default=None, help=f"timed steps (default {steps}; smoke 2)"
    )
    p.add_argument("--warmup", type=int, default=None, help="untimed steps (default 3; smoke 2)")
    p.add_argument("--out-dir", type=Path, default=None, help="default docs/results")
    p.set_defaults(default_steps=steps)


def resolve_run_args(args: argparse.Namespace) -> None:
    """``--smoke`` means CPU and tiny sizes; unset step counts take their defaults."""
    args.device, args.tiny = ("cpu", True) if args.smoke else (args.device, args.tiny)
    args.steps = args.steps or (2 if args.smoke else args.default_steps)
    args.warmup = args.warmup or (2 if args.smoke else 3)


def result_header(
    args: argparse.Namespace, sizes_name: str, sizes: dict[str, Any]
) -> dict[str, Any]:
    """The JSON's first fields (device, sizes, steps) and an empty ``runs``; one thread per
    process on CPU, as the CPU benchmarks run."""
    if args.device == "cpu":
        torch.set_num_threads(1)
    return {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "sizes": sizes_name,
        "model": sizes,
        "steps": args.steps,
        "warmup": args.warmup,
        "runs": {},
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(p, steps=10, tiny_help="the recipe tests' tiny sizes")
    args = p.parse_args(argv)
    resolve_run_args(args)
    if args.warmup < 2:
        p.error("--warmup must be >= 2: the forced FP8 outlier needs an amax history")
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device here; nothing measured (exit 0). The same code path "
            "runs on CPU: python benchmarks/gpu_check.py --device cpu --tiny"
        )
        return {"skipped": "no CUDA device"}
    name = "tiny" if args.tiny else "realistic"
    result = result_header(args, name, SIZES[name])
    sizes = SIZES[name]
    with tempfile.TemporaryDirectory() as root:  # A B, then B A: the fp8 speed-up interleaved
        for kind in ("bf16", "fp8", "fp8_fallback", "fp8_2", "bf16_2"):
            result["runs"][kind] = run(kind.removesuffix("_2"), args, sizes, root)
    runs = result["runs"]
    result["fp8_speedup_rounds"] = [
        runs[f"bf16{r}"]["step_s"] / runs[f"fp8{r}"]["step_s"] for r in ("", "_2")
    ]
    result["fp8_speedup"] = statistics.median(result["fp8_speedup_rounds"])
    result["ok"] = bool(
        all(r["losses_finite"] for r in runs.values())
        and runs["fp8_fallback"]["fallback"]["ok"]
        and runs["fp8"]["fp8_layers"][0] > 0
        and not runs["bf16"]["collectives"]["failed"]
    )
    path = write_result("gpu_check", result, args.out_dir)
    print_table(result)
    print(f"wrote {path}")
    if not result["ok"]:
        raise SystemExit("gpu_check: a check failed (see 'ok' fields in the JSON)")
    return result


if __name__ == "__main__":
    main()
