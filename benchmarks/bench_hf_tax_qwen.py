"""No tax for our blocks, Qwen families: a training step of Qwen2-VL, Qwen2.5-VL and
Qwen3-VL-MoE through the package's pipeline blocks vs transformers' own model, same weights,
same batch (one process, float32, CPU).

    python benchmarks/bench_hf_tax_qwen.py                  # docs/results/hf_tax_qwen.json
    python benchmarks/bench_hf_tax_qwen.py --smoke --out-dir /tmp/r   # tiny sizes, 1 step

**Models.** Per family a checkpoint written offline from transformers' config class with
random weights (``--size``; :data:`SIZES`): ``qwen2_vl`` (``Qwen2VLForConditionalGeneration``:
ViT with 2-D rotary positions, 2 x 2 patch merger, M-RoPE decoder with GQA),
``qwen2_5_vl`` (``Qwen2_5_VLForConditionalGeneration``: SwiGLU ViT with window attention and
one full-attention block) and ``qwen3_vl_moe`` (``Qwen3VLMoeForConditionalGeneration``:
learned interpolated positions, DeepStack, a decoder whose FFNs are top-k routed experts).
transformers loads each with ``from_pretrained`` (``attn_implementation="sdpa"``); ours with
:func:`lightning_mmpar.models.from_hf` (the same tensors).

**Batch.** ``--batch-size`` samples, one image each, of two resolutions in turn (dynamic
resolution: ``GRIDS``), and ``--text`` text tokens, one sample per row (right padding, the
same on both sides), through :class:`~lightning_mmpar.data.qwen_packing.QwenVLCollator`;
transformers gets the same ids, mask, patches and grids. The labels score every token.

**Step.** Forward, the token-mean next-token loss, backward, AdamW and ``zero_grad``:
transformers' ``model(..., labels=...).loss``; ours ``model(batch)`` and ``caption_loss``.

**Sides**, interleaved per family (:func:`report.interleaved`), ``--repeats`` times,
``--steps`` steps each; ratios ours over theirs (below 1: ours faster), median over the
repeats with their spread (:func:`report.ratio_stats`), and the ratio of the two sides'
fastest steps (``ratio_of_fastest``: the step least disturbed by other work on a shared
machine). The first step's losses of the two sides must agree (1e-5 relative).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_hf_tax import timed
from report import interleaved, ratio_stats, write_result

IMG, START, END, VIDEO = 4000, 4001, 4002, 4003
PATCH, TEMPORAL, MERGE = 14, 2, 2
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl_moe")
SIZES: dict[str, dict[str, Any]] = {
    "small": {
        "text": {"vocab_size": 4096, "hidden_size": 384, "intermediate_size": 1024},
        "layers": {"num_hidden_layers": 4, "num_attention_heads": 6, "num_key_value_heads": 2},
        "vision": {"width": 192, "depth": 4, "heads": 6},
        "moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 256},
        "grids": ((1, 16, 16), (1, 12, 20)),
    },
    "tiny": {
        "text": {"vocab_size": 4096, "hidden_size": 32, "intermediate_size": 64},
        "layers": {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2},
        "vision": {"width": 32, "depth": 2, "heads": 4},
        "moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
        "grids": ((1, 4, 4), (1, 4, 6)),
    },
}
"""Checkpoint sizes: ``small`` (the measured one: a ViT of width 192, 4 blocks, images of
16 x 16 and 12 x 20 patches (64 and 60 image tokens after the 2 x 2 merger); a 4-layer decoder
of width 384 with 6 query / 2 key-value heads, 4096 tokens; 8 experts top-2 for the MoE) and
``tiny`` (``--smoke``)."""


def _text(size: str, moe: bool) -> dict[str, Any]:
    s = SIZES[size]
    half = s["text"]["hidden_size"] // s["layers"]["num_attention_heads"] // 2
    rest = (half - half // 4) // 2  # Qwen2-VL's [16, 24, 24] of 64 at head_dim 128
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 1e6}
    rope["mrope_section"] = [half - 2 * rest, rest, rest]
    out = {**s["text"], **s["layers"], "rope_parameters": rope, "rms_norm_eps": 1e-6}
    out |= {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    if moe:
        rope["mrope_interleaved"] = True
        out |= s["moe"] | {"head_dim": 2 * half, "mlp_only_layers": []}
    return out


def hf_config(family: str, size: str) -> Any:
    """The transformers config of ``family`` at ``size`` (:data:`SIZES`)."""
    import transformers as tf

    v = SIZES[size]["vision"]
    common = {"depth": v["depth"], "num_heads": v["heads"], "patch_size": PATCH}
    common |= {"temporal_patch_size": TEMPORAL, "spatial_merge_size": MERGE}
    ids = {"image_token_id": IMG, "vision_start_token_id": START}
    ids |= {"vision_end_token_id": END, "video_token_id": VIDEO}
    out = SIZES[size]["text"]["hidden_size"]
    if family == "qwen2_vl":
        vision = {"embed_dim": v["width"], "hidden_size": out, "mlp_ratio": 4, **common}
        return tf.Qwen2VLConfig(vision_config=vision, text_config=_text(size, False), **ids)
    more = {"hidden_size": v["width"], "intermediate_size": 4 * v["width"]}
    more["out_hidden_size"] = out
    if family == "qwen2_5_vl":
        window = {"window_size": 4 * PATCH * MERGE, "fullatt_block_indexes": [v["depth"] - 1]}
        vision = {**common, **more, **window}
        return tf.Qwen2_5_VLConfig(vision_config=vision, text_config=_text(size, False), **ids)
    deep = {"num_position_embeddings": 64, "deepstack_visual_indexes": [0, v["depth"] // 2]}
    vision = {**common, **more, **deep}
    return tf.Qwen3VLMoeConfig(vision_config=vision, text_config=_text(size, True), **ids)


def hf_class(family: str) -> Any:
    import transformers as tf

    return {
        "qwen2_vl": tf.Qwen2VLForConditionalGeneration,
        "qwen2_5_vl": tf.Qwen2_5_VLForConditionalGeneration,
        "qwen3_vl_moe": tf.Qwen3VLMoeForConditionalGeneration,
    }[family]


def write_checkpoint(folder: Path, family: str, size: str, seed: int) -> Path:
    """A ``family`` directory of ``SIZES[size]`` with random weights."""
    torch.manual_seed(seed)
    hf_class(family)(hf_config(family, size)).save_pretrained(str(folder))
    return folder


def make_batch(size: str, args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(ours, theirs)``: the collated batch (module docstring) and transformers' inputs."""
    from lightning_mmpar.data.qwen_packing import QwenVLCollator

    g = torch.Generator().manual_seed(args.seed)
    grids, samples = SIZES[size]["grids"], []
    for i in range(args.batch_size):
        grid = torch.tensor([grids[i % len(grids)]])
        text = torch.randint(5, IMG, (args.text,), generator=g)
        ids = torch.cat([text[:2], torch.tensor([START, IMG, END]), text[2:]])
        pix = torch.randn(int(grid.prod()), 3 * TEMPORAL * PATCH * PATCH, generator=g)
        samples.append({"id": f"s{i}", "input_ids": ids, "labels": ids.clone()})
        samples[-1] |= {"pixel_values": pix, "image_grid_thw": grid}
    most = max(h * w for _, h, w in grids) // MERGE**2
    collate = QwenVLCollator(max_tokens=args.text + 3 + most, image_token_id=IMG, pack=False)
    batch = collate(samples)
    ids = batch["input_ids"]
    theirs = {
        "input_ids": ids,
        "attention_mask": (batch["sample_ids"] >= 0).long(),
        "mm_token_type_ids": (ids == IMG).int(),
        "pixel_values": torch.cat([s["pixel_values"] for s in samples]),
        "image_grid_thw": torch.cat([s["image_grid_thw"] for s in samples]),
        "labels": batch["labels"],
    }
    return batch, theirs


def _theirs_step(model: Any, inputs: dict[str, Any]) -> torch.Tensor:
    return model(**inputs).loss


def _ours_step(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    from lightning_mmpar.losses.caption import caption_loss

    return caption_loss(model(batch), batch["labels"])


def measure(family: str, args: argparse.Namespace) -> dict[str, Any]:
    """One family's sides interleaved; its losses, ratio and spread."""
    from lightning_mmpar.models import from_hf

    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(Path(tmp), family, args.size, args.seed)
        theirs = hf_class(family).from_pretrained(
            str(path), local_files_only=True, attn_implementation="sdpa"
        )
        ours = from_hf(path)
    batch, inputs = make_batch(args.size, args)
    runs = {
        "theirs": timed(theirs.float().train(), _theirs_step, inputs, args.steps),
        "ours": timed(ours.float().train(), _ours_step, batch, args.steps),
    }
    warm = {name: run()[0] for name, run in runs.items()}  # warm-up; its losses compared
    losses = {name: run.losses[0] for name, run in runs.items()}
    times = interleaved(runs, args.repeats)
    ref = losses["theirs"]
    stats = ratio_stats(times["ours"], times["theirs"])
    fastest = {side: min(t for run in times[side] for t in run) for side in times}
    stats["ratio_of_fastest"] = fastest["ours"] / fastest["theirs"]
    return {
        "first_loss": losses,
        "same_loss": abs(losses["ours"] - ref) <= 1e-5 * abs(ref),
        "warmup_s": warm,
        "batch": {"rows": batch["input_ids"].shape[0], "tokens": batch["input_ids"].shape[1]},
        "ours": stats,
        "met": stats["ratio"] <= args.target,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one step a side")
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--families", default=",".join(FAMILIES), help="comma-separated")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--text", type=int, default=96, help="text tokens per sample")
    p.add_argument("--steps", type=int, default=2, help="timed steps per side and repeat")
    p.add_argument("--repeats", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", type=float, default=1.10)
    args = p.parse_args(argv)
    if args.smoke:
        args.size, args.batch_size, args.text, args.steps, args.repeats = "tiny", 2, 8, 1, 2
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        p.error(f"--families: unknown {unknown}; choose from {list(FAMILIES)}")
    torch.set_num_threads(1)
    results = {family: measure(family, args) for family in families}
    payload = {
        "config": {k: v for k, v in vars(args).items() if k != "out_dir"} | {"threads": 1},
        "sizes": SIZES[args.size],
        "families": results,
        "target": args.target,
        "met": all(r["met"] for r in results.values()),
    }
    write_result("hf_tax_qwen", payload, args.out_dir)
    for family, r in results.items():
        x = r["ours"]
        print(
            f"{family:13} {x['ours_s'] * 1e3:8.1f} ms vs transformers {x['theirs_s'] * 1e3:8.1f}"
            f" ms: x{x['ratio']:.3f} (spread {x['spread']:.3f}; fastest steps "
            f"x{x['ratio_of_fastest']:.3f}); losses {r['first_loss']}"
        )
    return payload


if __name__ == "__main__":
    main()
