"""GPU check of what LLaVA users run: a LLaVA-1.5-7B-shaped fusion model (spliced image tokens,
ragged packed batches) on one CUDA GPU - BF16 MFU, packed vs padded tokens/s, and FP8 vs BF16
through torchao's float8 training (eager and with ``compile_blocks``).

    bash benchmarks/gpu_check.sh             # runs this after gpu_check.py; JSON gpu_llava.json
    python benchmarks/gpu_llava.py --smoke --out-dir /tmp/r   # CPU, tiny sizes, 2 steps a run

**Model** (:data:`SIZES` ``llava7b``): LLaVA-1.5-7B's shapes (Liu et al. 2023, "Improved
Baselines with Visual Instruction Tuning"): a CLIP ViT-L/14 at 336 px (24 layers, width 1024,
576 patch tokens per image, frozen as in LLaVA's fine-tuning), LLaVA-1.5's projector
(``mlp2x_gelu``: Linear 1024 -> 4096, GELU, Linear 4096 -> 4096; ``FusionConfig.projector=
"mlp2x"``, :data:`PROJECTOR`) and Vicuna-7B's decoder (width 4096, 32 heads, FFN 11008,
vocabulary 32000) with its depth reduced from 32 to :data:`LLAVA_DEPTH` layers to fit one GPU's
step in seconds; spliced fusion (each image marker replaced by its 576 tokens,
``FusionConfig.fusion="spliced"``), no adapter blocks. It runs in the
recipe's ``ClipLlamaModule`` under ``Trainer(strategy=MultimodalParallelStrategy(), devices=1,
precision="bf16-mixed")``, the caption (LM) loss on the answer tokens only.

**Data** (seeded, synthetic, no network): LLaVA-style samples, 80% with one image (576 tokens)
and 20% text-only, text of 32 to 1024 tokens (log-uniform), the first ~40% of each sample's text
the prompt (no loss). ``packed`` fills ``rows`` rows of ``max_tokens`` first fit
(:class:`~lightning_mmpar.data.MultimodalCollator`, ``pad_to_max_tokens``: fixed shapes);
``padded`` puts ``rows`` samples a step, one per row, padded to the batch's longest.

**Figures** over the steps after ``--warmup`` (device synchronised around each):
``tokens_per_s`` (tokens of samples, pad excluded), ``target_tokens_per_s``, and ``mfu``: model
FLOPs of the step's useful work / (step seconds x the device's BF16 peak from
``layout.cost.DEVICES``), where model FLOPs (PaLM's MFU, Chowdhery et al. 2022, app. B) are
6 x trained matmul weights + 2 x frozen ones per token they see, plus attention: 6 d L len^2
per sample in the causal decoder (block-diagonal: each packed sample on its own), 4 d L P^2 per
image forward in the frozen ViT (P = 577 positions); pad tokens count nothing, so padding costs
MFU. **FP8** (``fp8_torchao``): the decoder's and the projector's linears converted by
``torchao.float8.convert_to_float8_training`` (via ``convert_to_fp8(backend="torchao")``; the
heads and the frozen ViT stay in BF16: :data:`KEEP_BF16`); when
torchao does not import, the runs record why and the speed-up is ``null``. Each run is a fresh
module and Trainer; a run that raises records its error and the others go on.
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_packing import batch_stats
from gpu_check import (
    Timer,
    add_run_args,
    peak_of,
    print_runs,
    resolve_run_args,
    result_header,
)
from report import write_result

LLAVA_DEPTH = 8
"""Decoder layers of the ``llava7b`` size (Vicuna-7B has 32)."""
SIZES: dict[str, dict[str, Any]] = {
    "llava7b": {
        "vision": {"image_size": 336, "patch_size": 14, "width": 1024, "layers": 24, "heads": 16},
        "language": {
            "hidden_size": 4096,
            "intermediate_size": 11008,
            "num_hidden_layers": LLAVA_DEPTH,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
        },
        "vocab_size": 32000,
        "max_tokens": 2048,
        "rows": 4,
        "text_tokens": (32, 1024),
    },
    "tiny": {
        "vision": {"image_size": 16, "patch_size": 8, "width": 32, "layers": 1, "heads": 2},
        "language": {
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        },
        "vocab_size": 64,
        "max_tokens": 48,
        "rows": 4,
        "text_tokens": (2, 40),
    },
}
"""Model, row and sample sizes (``llava7b``: about 1.9 B trained parameters + a 0.3 B ViT)."""
KEEP_BF16 = ("*head*", "*.block.*")
"""Linears left in BF16 under FP8: the LM head and the contrastive heads (``*head*``) and the frozen
ViT's blocks (``*.block.*``), as torchtitan's float8 converts the decoder's linears only."""
PROJECTOR = ("mlp2x", "gelu")
"""``FusionConfig.projector`` and ``projector_act``: LLaVA-1.5's ``mlp2x_gelu`` (the JSON's
``projector``; results before it was recorded were measured with a linear projector)."""
RUNS = ("bf16_packed", "bf16_padded", "fp8_torchao", "bf16_compiled", "fp8_torchao_compiled")
"""The runs, in order: packed vs padded in BF16 eager, then FP8 vs BF16 eager and compiled."""


def image_tokens(sizes: dict[str, Any]) -> int:
    """Tokens one image occupies in the decoder's sequence: ``(image_size / patch_size)^2``."""
    return int((sizes["vision"]["image_size"] // sizes["vision"]["patch_size"]) ** 2)


def build_module(sizes: dict[str, Any], fp8: bool) -> Any:
    """A seeded spliced-fusion ``ClipLlamaModule`` at ``sizes`` (frozen ViT, no adapters, caption
    loss only); ``fp8``: the decoder's and the projector's linears converted by torchao before
    the strategy wraps the model (:data:`KEEP_BF16` stay in BF16)."""
    from lightning_mmpar.models import AdapterConfig, FusionConfig, LanguageConfig, VisionConfig
    from lightning_mmpar.precision import FP8Policy, convert_to_fp8
    from lightning_mmpar.recipes.module import ClipLlamaModule
    from lightning_mmpar.recipes.options import FinetuneConfig, LossConfig, MMLConfig, OptimConfig

    class LlavaModule(ClipLlamaModule):
        def configure_model(self) -> None:
            if self.blocks is not None:
                return
            torch.manual_seed(0)
            super().configure_model()
            if fp8:
                assert self.blocks is not None
                policy = FP8Policy(backend="torchao", keep_high_precision=KEEP_BF16)
                convert_to_fp8(self.blocks, policy)

    width = sizes["vision"]["width"]
    fusion = FusionConfig(
        vision=VisionConfig(**sizes["vision"], output_dim=width),
        language=LanguageConfig(**sizes["language"]),
        adapter=AdapterConfig(num_blocks=0),
        contrastive_dim=width,
        fusion="spliced",
        image_token_id=sizes["vocab_size"] - 1,
        projector=PROJECTOR[0],
        projector_act=PROJECTOR[1],
    )
    return LlavaModule(
        fusion=fusion,
        vocab_size=sizes["vocab_size"],
        finetune=FinetuneConfig(train_vision=False, train_decoder_layers=-1, train_embeddings=True),
        loss=LossConfig(contrastive_weight=0.0, caption_weight=1.0, mml=MMLConfig(weight=0.0)),
        optim=OptimConfig(lr=1e-5, warmup_steps=1, min_lr_ratio=1.0),
    )


def samples(sizes: dict[str, Any], n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` LLaVA-style samples (module docstring): ``input_ids``/``labels`` ``[L]`` (one
    marker token per image), ``pixel_values [k, 3, H, W]``, ``k`` in {0, 1}."""
    g = torch.Generator().manual_seed(seed)
    px, marker, vocab = sizes["vision"]["image_size"], sizes["vocab_size"] - 1, sizes["vocab_size"]
    low, high = sizes["text_tokens"]
    image = torch.randn(1, 3, px, px, generator=g)
    out = []
    for i in range(n):
        u = float(torch.rand((), generator=g))
        length = int(math.exp(math.log(low) + u * (math.log(high) - math.log(low))))
        ids = torch.randint(3, vocab - 1, (length,), generator=g)
        with_image = float(torch.rand((), generator=g)) < 0.8
        if with_image:
            ids = torch.cat([ids[:1], torch.tensor([marker]), ids[1:]])
        labels = ids.clone()
        labels[: int(0.4 * len(ids)) + 1] = -100
        pixels = image if with_image else image[:0]
        out.append({"id": f"s{i}", "input_ids": ids, "labels": labels, "pixel_values": pixels})
    return out


def collated(sizes: dict[str, Any], pack: bool, steps: int, seed: int) -> list[dict[str, Any]]:
    """``steps`` batches of ``rows`` rows: packed rows filled first fit to ``max_tokens``
    (fixed shapes), or ``rows`` samples padded to the batch's longest."""
    from lightning_mmpar.data import MultimodalCollator

    rows = sizes["rows"]
    collate = MultimodalCollator(
        max_tokens=sizes["max_tokens"],
        image_token_id=sizes["vocab_size"] - 1,
        pack=pack,
        image_seq_length=image_tokens(sizes),
        max_images_per_row=None if not pack else sizes["max_tokens"] // image_tokens(sizes) + 1,
        pad_to_max_tokens=pack,
        overflow="truncate",
    )
    pool, batches = samples(sizes, steps * rows * 8, seed), []
    while len(batches) < steps:
        take = rows
        while pack and take < len(pool) and collate(pool[: take + 1])["input_ids"].shape[0] <= rows:
            take += 1
        batch = collate(pool[:take])
        if pack and batch["input_ids"].shape[0] < rows:
            break
        batches.append(batch)
        pool = pool[take:]
    return batches


def matmul_weights(module: Any) -> dict[str, int]:
    """Matmul weights of the model by role: ``vision`` (frozen ViT: 2-D weights + the patch
    convolution), ``trained`` (projector, decoder, LM head: 2-D weights that get gradients; the
    embedding table is a gather, not counted)."""
    model = module.fusion_model
    vision = sum(p.numel() for p in model.vision.parameters() if p.ndim >= 2)
    trained = sum(
        p.numel()
        for n, p in model.named_parameters()
        if p.ndim == 2 and p.requires_grad and not n.startswith("vision.") and "embed" not in n
    )
    return {"vision": vision, "trained": trained}


def model_flops(sizes: dict[str, Any], weights: dict[str, int], batch: dict[str, Any]) -> float:
    """Model FLOPs of one training step on ``batch`` (module docstring): pad tokens count
    nothing; each packed sample's causal attention on its own tokens; the frozen ViT forward."""
    lang, vis = sizes["language"], sizes["vision"]
    ids = batch["sample_ids"]
    lengths = [int((row == s).sum()) for row in ids for s in row.unique().tolist() if s >= 0]
    tokens, images = sum(lengths), int(batch["image_mask"].sum())
    positions = image_tokens(sizes) + 1
    decoder = 6 * weights["trained"] * tokens
    decoder += 6 * lang["hidden_size"] * lang["num_hidden_layers"] * sum(n * n for n in lengths)
    vit = 2 * weights["vision"] * positions + 4 * vis["width"] * vis["layers"] * positions**2
    return float(decoder + vit * images)


def run(kind: str, args: argparse.Namespace, sizes: dict[str, Any], root: str) -> dict[str, Any]:
    """One Trainer run (a :data:`RUNS` name); its figures, or the error it raised."""
    from lightning_mmpar import MultimodalParallelStrategy
    from lightning_mmpar.testing import quiet_trainer

    device, steps = torch.device(args.device), args.warmup + args.steps
    batches = collated(sizes, pack=kind != "bf16_padded", steps=steps, seed=0)
    module, timer = build_module(sizes, fp8=kind.startswith("fp8")), Timer()
    if device.type == "cuda":
        gc.collect()
        torch.cuda.reset_peak_memory_stats(device)
    trainer = quiet_trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu",
        devices=1,
        strategy=MultimodalParallelStrategy(compile_blocks=kind.endswith("compiled") or None),
        precision="bf16-mixed",
        max_steps=steps,
        limit_val_batches=0,
        use_distributed_sampler=False,
        callbacks=[timer],
        default_root_dir=f"{root}/{kind}",
    )
    start = time.perf_counter()
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))  # type: ignore[arg-type]
    wall, timed = time.perf_counter() - start, batches[args.warmup :]
    seconds = timer.times[args.warmup :]
    weights = matmul_weights(module)
    flops = [model_flops(sizes, weights, b) for b in timed]
    stats = batch_stats(timed)
    peak, matched = peak_of(device, "bf16-mixed")
    return {
        "step_s": statistics.median(seconds),
        "step_s_all": timer.times,
        "wall_s": wall,
        "tokens_per_s": stats["sample_tokens"] / sum(seconds),
        "target_tokens_per_s": stats["target_tokens"] / sum(seconds),
        "batches": stats,
        "model_tflop_per_step": statistics.mean(flops) / 1e12,
        "achieved_tflops": sum(flops) / sum(seconds) / 1e12,
        "mfu": None if peak is None else sum(flops) / sum(seconds) / peak,
        "peak": matched,
        "weights": weights,
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30
        if device.type == "cuda"
        else None,
        "losses": timer.losses,
        "losses_finite": all(math.isfinite(x) for x in timer.losses),
    }


def guarded(kind: str, args: argparse.Namespace, sizes: dict[str, Any], root: str) -> Any:
    """:func:`run`, its error recorded instead of raised (torchao absent, compile failing...)."""
    if kind.startswith("fp8"):
        try:
            import torchao  # type: ignore[import-not-found]  # noqa: F401
        except ImportError as err:
            return {"skipped": f"torchao does not import here: {err}"}
    try:
        return run(kind, args, sizes, root)
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}


def ratio(runs: dict[str, Any], a: str, b: str, key: str) -> float | None:
    """``runs[a][key] / runs[b][key]`` when both ran, else ``None``."""
    if key in runs.get(a, {}) and key in runs.get(b, {}):
        return float(runs[a][key] / runs[b][key])
    return None


def summarise(result: dict[str, Any]) -> None:
    """The headline ratios, and one line per run."""
    runs = result["runs"]
    result["packed_vs_padded_tokens_per_s"] = ratio(
        runs, "bf16_packed", "bf16_padded", "tokens_per_s"
    )
    result["fp8_speedup_eager"] = ratio(runs, "bf16_packed", "fp8_torchao", "step_s")
    result["fp8_speedup_compiled"] = ratio(runs, "bf16_compiled", "fp8_torchao_compiled", "step_s")
    print(f"gpu_llava on {result['device']} ({result['sizes']} sizes)")
    print_runs(runs, width=22)
    for key in ("packed_vs_padded_tokens_per_s", "fp8_speedup_eager", "fp8_speedup_compiled"):
        value = result[key]
        print(f"{key}: {'-' if value is None else f'{value:.3f}'}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(p, steps=8, tiny_help="tiny sizes")
    p.add_argument(
        "--runs",
        default=None,
        help="comma-separated run names (default: all; smoke:"
        " the eager ones, compiling on CPU takes minutes)",
    )
    args = p.parse_args(argv)
    resolve_run_args(args)
    default = [k for k in RUNS if not (args.smoke and k.endswith("compiled"))]
    kinds = [k for k in args.runs.split(",") if k] if args.runs else default
    if unknown := sorted(set(kinds) - set(RUNS)):
        p.error(f"--runs: unknown {unknown}; choose from {list(RUNS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_llava: no CUDA device here; nothing measured (exit 0).")
        return {"skipped": "no CUDA device"}
    name = "tiny" if args.tiny else "llava7b"
    result = result_header(args, name, SIZES[name])
    result["projector"] = f"{PROJECTOR[0]}_{PROJECTOR[1]}"
    sizes = SIZES[name]
    with tempfile.TemporaryDirectory() as root:
        for kind in kinds:
            result["runs"][kind] = guarded(kind, args, sizes, root)
            write_result("gpu_llava", result, args.out_dir)  # what ran so far survives a kill
    summarise(result)
    result["ok"] = all(r.get("losses_finite", "skipped" in r) for r in result["runs"].values())
    path = write_result("gpu_llava", result, args.out_dir)
    print(f"wrote {path}")
    if not result["ok"]:
        raise SystemExit("gpu_llava: a run failed or gave a non-finite loss (see the JSON)")
    return result


if __name__ == "__main__":
    main()
