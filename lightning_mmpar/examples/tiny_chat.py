"""What the tiny offline checkpoint examples share: a word-level chat tokenizer and a small
LLaVA-format conversation set over coloured squares.

:func:`word_level_tokenizer` saves a transformers ``PreTrainedTokenizerFast`` (a word-level
vocabulary, whitespace pre-tokenizer, a chat template) without a download;
:func:`write_conversations` writes :data:`RECORDS` (text-only, one-image and two-image
conversations) as ``train.json`` and the squares as ``images/*.png``. Used by
:mod:`lightning_mmpar.examples.tiny_llava` and :mod:`lightning_mmpar.examples.tiny_qwen`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "COLOURS",
    "RECORDS",
    "WORDS",
    "main_of",
    "word_level_tokenizer",
    "write_conversations",
]

COLOURS = {"red": (200, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 200)}
"""The squares' names and RGB colours (``images/<name>.png``)."""
WORDS = "what colour is it ? the first second square are they same different yes no two plus"
WORDS += " three five four one and"
"""The conversations' words besides the colours (a tokenizer's vocabulary holds them all)."""


def _image_records() -> list[dict[str, Any]]:
    """A one-image and a two-image conversation per colour."""
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
    return out


def _text_records() -> list[dict[str, Any]]:
    """Two conversations without an image."""
    sums = (("sum", "two", "five"), ("sum2", "one", "four"))
    return [
        {
            "id": f"text-{name}",
            "conversations": [
                {"from": "human", "value": f"what is {first} plus three ?"},
                {"from": "gpt", "value": answer},
            ],
        }
        for name, first, answer in sums
    ]


RECORDS = _image_records() + _text_records()
"""The conversations ``train.json`` holds (8 records: 3 with one image, 3 with two, 2 text)."""


def word_level_tokenizer(
    path: str | Path, vocab: list[str], special: list[str], template: str | None
) -> None:
    """Save at ``path`` a word-level transformers tokenizer over ``vocab`` (ids in its order;
    ``<s>`` / ``</s>`` / ``<pad>`` / ``<unk>`` as bos / eos / pad / unk, ``special`` as its
    additional special tokens) with the chat ``template`` (``None``: none). Offline
    (``tokenizers``' ``WordLevel`` model, as transformers' ``PreTrainedTokenizerFast`` docs
    build one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=special,
    )
    if template:
        tok.chat_template = template
    tok.save_pretrained(str(path))


def write_conversations(data: str | Path, sizes: Mapping[str, tuple[int, int]]) -> Path:
    """Write :data:`RECORDS` as ``data/train.json`` and each colour of :data:`COLOURS` as
    ``data/images/<colour>.png`` of ``sizes[colour]`` = ``(width, height)`` pixels; returns
    the JSON's path."""
    from PIL import Image

    data = Path(data)
    (data / "images").mkdir(parents=True, exist_ok=True)
    for name, rgb in COLOURS.items():
        Image.new("RGB", sizes[name], rgb).save(data / "images" / f"{name}.png")
    train = data / "train.json"
    train.write_text(json.dumps(RECORDS, indent=1))
    return train


def write_example(
    root: str | Path,
    write_model: Callable[[Path, int], None],
    sizes: Mapping[str, tuple[int, int]],
    seed: int,
) -> dict[str, Path]:
    """``write_model(root/model, seed)`` (the model directory with its tokenizer and image
    processor) and the conversations with images of ``sizes`` under ``root/data``.

    Returns ``{"model": root/model, "train_file": root/data/train.json, "image_root":
    root/data}``.
    """
    root = Path(root)
    model, data = root / "model", root / "data"
    model.mkdir(parents=True, exist_ok=True)
    write_model(model, seed)
    train = write_conversations(data, sizes)
    return {"model": model, "train_file": train, "image_root": data}


def main_of(write: Callable[..., dict[str, Path]], doc: str, argv: list[str] | None) -> None:
    """The command line of a writer (``python -m <example> OUT [--seed N]``): ``write(OUT,
    seed=N)``, then each written path printed; ``doc``'s first line is the help text."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("out", help="folder to write model/ and data/ into")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name, path in write(args.out, seed=args.seed).items():
        print(f"{name}: {path}")
