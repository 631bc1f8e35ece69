"""No tax for our blocks: a LLaVA training step through the package's pipeline blocks vs
transformers' own ``LlavaForConditionalGeneration``, same weights, same batch (one process,
float32, CPU).

    python benchmarks/bench_hf_tax.py                  # docs/results/hf_tax.json
    python benchmarks/bench_hf_tax.py --smoke --out-dir /tmp/r   # tiny sizes, 1 step a side

**Model.** A LLaVA-1.5-shaped checkpoint written offline with random weights (``--size``):
CLIP ViT (``vision_feature_layer`` -2, class token dropped, quick_gelu), the ``mlp2x``
projector, a Llama decoder with grouped-query attention. transformers loads it with
``from_pretrained`` (``attn_implementation="sdpa"``); ours with
:func:`lightning_mmpar.models.from_hf` (the same tensors).

**Batch.** ``--batch-size`` samples of one image and ``--text`` text tokens each, one sample per
row (no padding: both sides do the same work), through
:class:`~lightning_mmpar.data.MultimodalCollator` (spliced image tokens); the labels score every
text token but the image tokens and the first token.

**Step.** Forward, the token-mean next-token loss over the labels, backward, AdamW
(``foreach`` default) and ``zero_grad``: transformers' ``model(..., labels=...).loss``; ours
``FusionModel.forward_ragged`` and the recipe's ``caption_loss`` (the same cross-entropy).
Ours runs ``vision_feature_layer`` (-2) layers of the ViT, transformers all of them (its
last layer's output is unused): one ViT layer of the step's work less.

**Sides**, interleaved A B C, C B A (:func:`report.interleaved`), ``--repeats`` times,
``--steps`` steps each: ``theirs`` (transformers); ``ours`` (the blocks as the recipe runs
LLaVA's caption-only objective: ``FusionModel.text_stream`` off); ``ours_text_stream`` (the
blocks also running the text-only stream that the contrastive and MML terms read: what the
same model cost before). Ratios are ours over theirs (below 1: ours faster), median over the
repeats with their spread (:func:`report.ratio_stats`). The first step's losses of the three
sides must agree (1e-5).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from report import interleaved, ratio_stats, write_result

SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "small": {
        "vision": {"hidden_size": 192, "intermediate_size": 768, "num_hidden_layers": 4},
        "vision_more": {"num_attention_heads": 6, "image_size": 112, "patch_size": 14},
        "text": {"vocab_size": 4096, "hidden_size": 384, "intermediate_size": 1024},
        "text_more": {"num_hidden_layers": 4, "num_attention_heads": 6, "num_key_value_heads": 2},
    },
    "tiny": {
        "vision": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3},
        "vision_more": {"num_attention_heads": 4, "image_size": 16, "patch_size": 4},
        "text": {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64},
        "text_more": {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2},
    },
}
"""Checkpoint sizes: ``small`` (the measured one: 64 image tokens of width 192, a 4-layer
decoder of width 384 with 6 query / 2 key-value heads, 4096 tokens) and ``tiny``
(``--smoke``)."""


def write_checkpoint(folder: Path, size: str, seed: int) -> tuple[Path, int]:
    """A LLaVA directory of ``SIZES[size]`` with random weights; returns it and the image
    token id (the vocabulary's last id)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig
    from transformers import LlavaForConditionalGeneration as Llava

    s = SIZES[size]
    vision = CLIPVisionConfig(**s["vision"], **s["vision_more"], hidden_act="quick_gelu")
    text = LlamaConfig(**s["text"], **s["text_more"])
    image_token = s["text"]["vocab_size"] - 1
    grid = s["vision_more"]["image_size"] // s["vision_more"]["patch_size"]
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_token,
        image_seq_length=grid * grid,
    )
    torch.manual_seed(seed)
    Llava(config).save_pretrained(str(folder))
    return folder, image_token


def make_batch(
    size: str, image_token: int, args: argparse.Namespace
) -> tuple[dict[str, torch.Tensor], int]:
    """The collated batch (module docstring) and its image tokens per image."""
    from lightning_mmpar.data import MultimodalCollator

    s = SIZES[size]["vision_more"]
    tokens = (s["image_size"] // s["patch_size"]) ** 2
    g = torch.Generator().manual_seed(args.seed)
    samples = []
    for i in range(args.batch_size):
        text = torch.randint(4, image_token, (args.text,), generator=g)
        ids = torch.cat([text[:2], torch.tensor([image_token]), text[2:]])
        pix = torch.randn(1, 3, s["image_size"], s["image_size"], generator=g)
        samples.append(
            {"id": f"s{i}", "input_ids": ids, "labels": ids.clone(), "pixel_values": pix}
        )
    collate = MultimodalCollator(
        max_tokens=args.text + 1 + tokens,
        pack=False,
        image_seq_length=tokens,
        image_token_id=image_token,
    )
    return collate(samples), tokens


def theirs_step(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """transformers' forward and loss (its own shift and token mean)."""
    pixels = batch["pixel_values"][batch["image_mask"]]
    return model(input_ids=batch["input_ids"], pixel_values=pixels, labels=batch["labels"]).loss


def ours_step(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Our blocks' forward and the recipe's next-token loss (``caption_loss``)."""
    from lightning_mmpar.losses.caption import caption_loss

    return caption_loss(model.forward_ragged(batch).logits, batch["labels"])


def timed(model: Any, step: Any, batch: dict[str, torch.Tensor], steps: int) -> Any:
    """A callable running ``steps`` training steps, returning their seconds; the losses of
    every call are appended to its ``losses``."""
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=1e-5, weight_decay=0.0
    )
    losses: list[float] = []

    def run() -> list[float]:
        seconds = []
        for _ in range(steps):
            start = time.perf_counter()
            loss = step(model, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            seconds.append(time.perf_counter() - start)
            losses.append(float(loss.detach()))
        return seconds

    run.losses = losses  # type: ignore[attr-defined]
    return run


def sides(path: Path, batch: dict[str, torch.Tensor], steps: int) -> dict[str, Any]:
    """``{side: timed callable}``: transformers, ours, ours with the text-only stream."""
    from transformers import LlavaForConditionalGeneration

    from lightning_mmpar.models import from_hf

    theirs = LlavaForConditionalGeneration.from_pretrained(
        str(path), local_files_only=True, attn_implementation="sdpa"
    ).train()
    ours = from_hf(path).train()
    ours.text_stream = False
    with_text = from_hf(path).train()
    assert with_text.text_stream
    return {
        "theirs": timed(theirs, theirs_step, batch, steps),
        "ours": timed(ours, ours_step, batch, steps),
        "ours_text_stream": timed(with_text, ours_step, batch, steps),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one step a side")
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--text", type=int, default=96, help="text tokens per sample")
    p.add_argument("--steps", type=int, default=2, help="timed steps per side and repeat")
    p.add_argument("--repeats", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.smoke:
        args.size, args.batch_size, args.text, args.steps, args.repeats = "tiny", 2, 8, 1, 2
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path, image_token = write_checkpoint(Path(tmp), args.size, args.seed)
        batch, tokens = make_batch(args.size, image_token, args)
        runs = sides(path, batch, args.steps)
        first = {name: run()[0] for name, run in runs.items()}  # warm-up; its losses compared
        losses = {name: run.losses[0] for name, run in runs.items()}
        times = interleaved(runs, args.repeats)
    ref = losses["theirs"]
    same = all(abs(v - ref) <= 1e-5 * abs(ref) for v in losses.values())
    payload = {
        "config": {k: v for k, v in vars(args).items() if k != "out_dir"} | {"threads": 1},
        "sizes": SIZES[args.size],
        "batch": {"rows": batch["input_ids"].shape[0], "tokens": batch["input_ids"].shape[1]},
        "image_tokens": tokens,
        "first_loss": losses,
        "same_loss": same,
        "warmup_s": first,
        "ours": ratio_stats(times["ours"], times["theirs"]),
        "ours_text_stream": ratio_stats(times["ours_text_stream"], times["theirs"]),
        "target": 1.10,
    }
    payload["met"] = payload["ours"]["ratio"] <= payload["target"]
    write_result("hf_tax", payload, args.out_dir)
    for side in ("ours", "ours_text_stream"):
        r = payload[side]
        print(
            f"{side:17} {r['ours_s'] * 1e3:8.1f} ms vs transformers {r['theirs_s'] * 1e3:8.1f} ms"
            f": x{r['ratio']:.3f} (spread {r['spread']:.3f})"
        )
    print(f"first-step losses {losses} same={same}")
    return payload


if __name__ == "__main__":
    main()
