"""Sequence packing vs padding on ragged multimodal data: the fraction of non-pad tokens and
target tokens per second of a training step, on LLaVA-format conversations and on the digits
question task, in one run (one process, CPU).

    python benchmarks/bench_packing.py                 # docs/results/packing.json
    python benchmarks/bench_packing.py --smoke --out-dir /tmp/r   # tiny sizes, 1 batch a side

**Data.** (1) ``conversations``: a synthetic LLaVA-format JSON written to a temporary folder
(``--records`` records, 0-3 images each, 1-3 rounds, user turns of 4-40 words and answers of
1-120 words, long-tailed as SFT data is), read by
:class:`~lightning_mmpar.data.ConversationDataModule`; (2) ``digits_vqa``:
:class:`~lightning_mmpar.data.DigitsVQA` (0-3 digits per question, short answers). Each side
takes the same ``--batches`` batches of ``--batch-size`` samples (same seed, same order):
``padded`` puts one sample per row padded to the batch's longest, ``packed`` fills rows of
``--max-tokens`` (``--digits-max-tokens`` for the digits) first-fit
(:class:`~lightning_mmpar.data.MultimodalCollator`).

**Measured.** ``non_pad_fraction``: tokens of samples / (rows x row length) over the batches;
``target_tokens_per_s``: the batches' target tokens (labels != -100) over the wall time of
training steps (forward, loss, backward, AdamW step) of the package's fusion model on them,
``FusionModel.forward_ragged`` (block-diagonal causal attention from ``sample_ids``); both
sides interleaved A B, B A (:func:`report.interleaved`), ``--repeats`` times; the ratio is
packed over padded (above 1: packing faster), with its spread over the repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from report import interleaved, write_result

IMAGE_SIZE = 16


def write_conversations(folder: Path, records: int, seed: int) -> Path:
    """A LLaVA-format JSON of ``records`` conversations (module docstring) and its images."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range(200)]
    for i in range(8):
        pixels = rng.integers(0, 256, size=(IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"img{i}.png")
    out = []
    for n in range(records):
        k = int(rng.integers(4))
        turns = []
        for r in range(int(rng.integers(1, 4))):
            question = " ".join(rng.choice(words, size=int(rng.integers(4, 41))))
            answer_len = int(min(120, 1 + rng.lognormal(2.5, 1.0)))
            marker = "<image>\n" * k if r == 0 else ""
            turns += [
                {"from": "human", "value": marker + question},
                {"from": "gpt", "value": " ".join(rng.choice(words, size=answer_len))},
            ]
        record: dict[str, Any] = {"id": f"c{n}", "conversations": turns}
        if k:
            record["image"] = [f"img{int(j)}.png" for j in rng.integers(8, size=k)]
        out.append(record)
    path = folder / "conversations.json"
    path.write_text(json.dumps(out))
    return path


def data_modules(folder: Path, args: argparse.Namespace) -> dict[str, dict[bool, Any]]:
    """``{dataset: {pack: data module}}`` (set up)."""
    from lightning_mmpar.data import ConversationDataModule, DigitsVQA

    path = write_conversations(folder, args.records, args.seed)
    common = {"batch_size": args.batch_size, "seed": args.seed}
    out: dict[str, dict[bool, Any]] = {"conversations": {}, "digits_vqa": {}}
    for pack in (False, True):
        out["conversations"][pack] = ConversationDataModule(
            train_file=str(path),
            image_root=str(folder),
            image_size=IMAGE_SIZE,
            pack=pack,
            max_tokens=args.max_tokens,
            **common,
        )
        out["digits_vqa"][pack] = DigitsVQA(
            image_size=IMAGE_SIZE,
            train_samples=args.records,
            val_samples=8,
            pack=pack,
            max_tokens=args.digits_max_tokens,
            **common,
        )
    for sides in out.values():
        for data in sides.values():
            data.setup("fit")
    return out


def batch_stats(batches: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """Rows, row length, tokens of samples, target tokens and the non-pad fraction."""
    slots = sum(b["input_ids"].numel() for b in batches)
    real = sum(int((b["sample_ids"] >= 0).sum()) for b in batches)
    return {
        "rows": sum(b["input_ids"].shape[0] for b in batches),
        "row_tokens": [b["input_ids"].shape[1] for b in batches],
        "token_slots": slots,
        "sample_tokens": real,
        "target_tokens": sum(int((b["labels"] != -100).sum()) for b in batches),
        "images": sum(int(b["image_mask"].sum()) for b in batches),
        "non_pad_fraction": real / slots,
    }


def make_model(vocab_size: int, seed: int) -> Any:
    """The recipe's tiny fusion model (recipes/clip_llama_cpu.yaml's sizes) at 16-pixel images."""
    from lightning_mmpar.models import (
        AdapterConfig,
        FusionConfig,
        FusionModel,
        LanguageConfig,
        VisionConfig,
    )

    torch.manual_seed(seed)
    config = FusionConfig(
        vision=VisionConfig(
            image_size=IMAGE_SIZE,
            patch_size=8,
            width=64,
            layers=2,
            heads=4,
            mlp_ratio=2.0,
            output_dim=64,
            pool_type="tok",
        ),
        language=LanguageConfig(
            vocab_size=vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
        adapter=AdapterConfig(num_blocks=1, heads=4, width=64, ffn_width=128, dropout=0.0),
        contrastive_dim=64,
    )
    return FusionModel(config)


def train_steps(model: Any, batches: list[dict[str, torch.Tensor]]) -> list[float]:
    """Seconds of one training step per batch (token-mean next-token loss over the targets)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seconds = []
    for batch in batches:
        start = time.perf_counter()
        logits = model.forward_ragged(batch).logits
        labels = batch["labels"][:, 1:]
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten(), ignore_index=-100)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - start)
    return seconds


def measure(sides: dict[bool, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Stats and timed steps of one dataset, padded vs packed on the same samples."""
    batches = {}
    for pack, data in sides.items():
        loader = iter(data.train_dataloader())
        batches[pack] = [next(loader) for _ in range(args.batches)]
    vocab = sides[False].vocab_size
    models = {pack: make_model(vocab, args.seed) for pack in sides}
    train_steps(models[False], batches[False][:1])  # warm-up (allocator, first-call costs)
    train_steps(models[True], batches[True][:1])
    runs = interleaved(
        {
            "padded": lambda: train_steps(models[False], batches[False]),
            "packed": lambda: train_steps(models[True], batches[True]),
        },
        args.repeats,
    )
    out: dict[str, Any] = {}
    for name, pack in (("padded", False), ("packed", True)):
        stats = batch_stats(batches[pack])
        per_repeat = [stats["target_tokens"] / sum(r) for r in runs[name]]
        stats["target_tokens_per_s"] = statistics.median(per_repeat)
        stats["per_repeat_tokens_per_s"] = per_repeat
        stats["truncated"] = sides[pack].collator().stats["truncated"]
        out[name] = stats
    ratios = [
        p / q
        for p, q in zip(
            out["packed"]["per_repeat_tokens_per_s"],
            out["padded"]["per_repeat_tokens_per_s"],
            strict=True,
        )
    ]
    out["speedup"] = {"ratio": statistics.median(ratios), "spread": max(ratios) - min(ratios)}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one batch a side")
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument("--records", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=512, help="row budget, conversations")
    p.add_argument("--digits-max-tokens", type=int, default=64, help="row budget, digits task")
    p.add_argument("--batches", type=int, default=6)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.smoke:
        args.records, args.batch_size, args.batches, args.repeats = 32, 6, 1, 2
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, sides in data_modules(Path(tmp), args).items():
            results[name] = measure(sides, args)
    config = {k: v for k, v in vars(args).items() if k != "out_dir"} | {"threads": 1}
    payload = {"config": config, "packing": results}
    write_result("packing", payload, args.out_dir)
    for name, r in results.items():
        print(
            f"{name:14} non-pad {r['padded']['non_pad_fraction']:.3f} -> "
            f"{r['packed']['non_pad_fraction']:.3f}; target tok/s "
            f"{r['padded']['target_tokens_per_s']:.0f} -> {r['packed']['target_tokens_per_s']:.0f}"
            f" (x{r['speedup']['ratio']:.2f}, spread {r['speedup']['spread']:.2f})"
        )
    return payload


if __name__ == "__main__":
    main()
