"""A tiny LLaVA checkpoint directory and a tiny conversation set, written offline.

``python -m lightning_mmpar.examples.tiny_llava runs/tiny_llava`` writes::

    runs/tiny_llava/model/   config.json, model.safetensors (LlavaForConditionalGeneration:
                             CLIP ViT 16 px in 4 px patches, 3 layers of width 32; Llama 2
                             layers, 4 query / 2 key-value heads, 64 tokens), tokenizer files
                             (a word-level tokenizer with a chat template and <image>),
                             preprocessor_config.json (CLIPImageProcessor, 16 px)
    runs/tiny_llava/data/    train.json (LLaVA format: text-only, one-image and two-image
                             conversations), images/*.png (coloured squares)

what ``recipes/llava_sft_cpu.yaml`` fine-tunes (``model.pretrained.hf``). Nothing touches the
network; the same seed writes the same files. A real checkpoint directory
(``llava-hf/llava-1.5-7b-hf`` saved locally) has the same layout.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

__all__ = ["CHAT_TEMPLATE", "RECORDS", "write_tiny_llava"]

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> "
    "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
"""A minimal chat template (user / assistant turns, each closed by ``<|end|>``)."""
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|end|>", "<image>"]
COLOURS = {"red": (200, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 200)}
WORDS = "what colour is it ? the first second square are they same different yes no two plus"
WORDS += " three five four one and"
VOCAB = 64
"""Rows of the tiny model's embedding (the tokenizer's words and specials fit in them)."""


def _records() -> list[dict[str, Any]]:
    """Conversations over the coloured squares: one-image, two-image and text-only."""
    out: list[dict[str, Any]] = []
    names = list(COLOURS)
    for i, name in enumerate(names):
        out.append(
            {
                "id": f"one-{name}",
                "image": f"images/{name}.png",
                "conversations": [
                    {"from": "human", "value": "<image>\nwhat colour is it ?"},
                    {"from": "gpt", "value": name},
                ],
            }
        )
        other = names[(i + 1) % len(names)]
        out.append(
            {
                "id": f"two-{name}-{other}",
                "image": [f"images/{name}.png", f"images/{other}.png"],
                "conversations": [
                    {"from": "human", "value": "<image> <image>\nare they the same colour ?"},
                    {"from": "gpt", "value": "no"},
                    {"from": "human", "value": "what colour is the first square ?"},
                    {"from": "gpt", "value": name},
                ],
            }
        )
    out.append(
        {
            "id": "text-sum",
            "conversations": [
                {"from": "human", "value": "what is two plus three ?"},
                {"from": "gpt", "value": "five"},
            ],
        }
    )
    out.append(
        {
            "id": "text-sum2",
            "conversations": [
                {"from": "human", "value": "what is one plus three ?"},
                {"from": "gpt", "value": "four"},
            ],
        }
    )
    return out


RECORDS = _records()
"""The conversations ``train.json`` holds (8 records)."""


def _tokenizer(path: Path) -> int:
    """A word-level transformers tokenizer with :data:`CHAT_TEMPLATE` saved at ``path``;
    returns the ``<image>`` id."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted(set(WORDS.split()) | set(COLOURS))
    vocab = {w: i for i, w in enumerate([*SPECIAL, *words])}
    assert len(vocab) <= VOCAB
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=SPECIAL[4:],
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(path))
    return vocab["<image>"]


def _model(path: Path, image_token: int, seed: int) -> None:
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=16,
        patch_size=4,
    )
    text = LlamaConfig(  # type: ignore[call-arg]  # rope_theta: a **kwargs field in transformers 5
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=5000.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_token,
        image_seq_length=16,
    )
    torch.manual_seed(seed)
    LlavaForConditionalGeneration(config).save_pretrained(str(path))
    CLIPImageProcessor(size={"shortest_edge": 16}, crop_size=16).save_pretrained(str(path))


def write_tiny_llava(root: str | Path, *, seed: int = 0) -> dict[str, Path]:
    """Write the tiny LLaVA directory and conversations under ``root`` (module docstring).

    Returns ``{"model": root/model, "train_file": root/data/train.json, "image_root":
    root/data}``.
    """
    from PIL import Image

    root = Path(root)
    model, data = root / "model", root / "data"
    (data / "images").mkdir(parents=True, exist_ok=True)
    model.mkdir(parents=True, exist_ok=True)
    _model(model, _tokenizer(model), seed)
    for name, rgb in COLOURS.items():
        Image.new("RGB", (20, 16), rgb).save(data / "images" / f"{name}.png")
    train = data / "train.json"
    train.write_text(json.dumps(RECORDS, indent=1))
    return {"model": model, "train_file": train, "image_root": data}


def main(argv: list[str] | None = None) -> None:
    """``python -m lightning_mmpar.examples.tiny_llava OUT [--seed N]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="folder to write model/ and data/ into")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    paths = write_tiny_llava(args.out, seed=args.seed)
    for name, path in paths.items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
