"""A tiny Qwen2-VL checkpoint directory and a tiny conversation set, written offline.

``python -m lightning_mmpar.examples.tiny_qwen runs/tiny_qwen`` writes::

    runs/tiny_qwen/model/   config.json, model.safetensors (Qwen2VLForConditionalGeneration:
                            a ViT of 4 px patches, 2 blocks of width 32, 4 heads, the 2 x 2
                            patch merger; a Qwen2 decoder of 2 layers, width 64, 4 query / 2
                            key-value heads, M-RoPE, 64 tokens), tokenizer files (a word-level
                            tokenizer with a Qwen chat template, <|im_start|> / <|im_end|>, and
                            the image tokens <|vision_start|> <|image_pad|> <|vision_end|>),
                            preprocessor_config.json (Qwen2VLImageProcessor: 4 px patches,
                            merge 2, 64 to 1024 pixels)
    runs/tiny_qwen/data/    train.json (LLaVA format: text-only, one-image and two-image
                            conversations), images/*.png (24 x 16, 16 x 32 and 16 x 16
                            pixels: image grids of 4 x 6, 8 x 4 and 4 x 4 patches)

what ``recipes/qwen_sft_cpu.yaml`` fine-tunes (``model.pretrained.hf``). Nothing touches the
network; the same seed writes the same files. A real checkpoint directory
(``Qwen/Qwen2-VL-2B-Instruct`` saved locally) has the same layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightning_mmpar.examples.tiny_chat import (
    COLOURS,
    RECORDS,
    WORDS,
    main_of,
    word_level_tokenizer,
    write_example,
)

__all__ = ["CHAT_TEMPLATE", "RECORDS", "write_tiny_qwen"]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)
"""A Qwen-style chat template (``<|im_start|>role text<|im_end|>``, the answer's end-of-turn
token ``<|im_end|>`` scored)."""
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
IMAGE_TOKENS = ["<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>"]
"""The config's ``image_token_id``, ``vision_start_token_id``, ``vision_end_token_id`` and
``video_token_id``, in that order."""
VOCAB = 64
"""Rows of the tiny model's embedding (the tokenizer's words and specials fit in them)."""
IMAGE_SIZES = {"red": (24, 16), "green": (16, 32), "blue": (16, 16)}
"""(width, height) of each square: the processor keeps them (multiples of 8 px)."""
PATCH, MERGE = 4, 2


def _tokenizer(path: Path) -> dict[str, int]:
    """The word-level tokenizer with :data:`CHAT_TEMPLATE` saved at ``path``; returns the ids
    of :data:`IMAGE_TOKENS`."""
    words = sorted(set(WORDS.split()) | set(COLOURS) | {"user", "assistant", "system"})
    vocab = [*SPECIAL, *words, *IMAGE_TOKENS]
    assert len(vocab) <= VOCAB
    word_level_tokenizer(path, vocab, [*SPECIAL[4:], *IMAGE_TOKENS], CHAT_TEMPLATE)
    return {token: vocab.index(token) for token in IMAGE_TOKENS}


def _model(path: Path, ids: dict[str, int], seed: int) -> None:
    """The random-weight ``Qwen2VLForConditionalGeneration`` and its image processor."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor

    vision = {"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 4, "mlp_ratio": 2}
    vision |= {"patch_size": PATCH, "temporal_patch_size": 2, "spatial_merge_size": MERGE}
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    text: dict[str, Any] = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96}
    text |= {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    text |= {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    text["rope_parameters"] = rope  # mrope_section sums to head_dim / 2 = 8
    tokens = [ids[t] for t in IMAGE_TOKENS]
    config = Qwen2VLConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=tokens[0],
        vision_start_token_id=tokens[1],
        vision_end_token_id=tokens[2],
        video_token_id=tokens[3],
    )
    torch.manual_seed(seed)
    Qwen2VLForConditionalGeneration(config).save_pretrained(str(path))
    Qwen2VLImageProcessor(
        patch_size=PATCH,
        temporal_patch_size=2,
        merge_size=MERGE,
        min_pixels=8 * 8,
        max_pixels=32 * 32,
    ).save_pretrained(str(path))


def write_tiny_qwen(root: str | Path, *, seed: int = 0) -> dict[str, Path]:
    """Write the tiny Qwen2-VL directory and conversations under ``root`` (module docstring).

    Returns ``{"model": root/model, "train_file": root/data/train.json, "image_root":
    root/data}``.
    """
    return write_example(root, _write_model, IMAGE_SIZES, seed)


def _write_model(path: Path, seed: int) -> None:
    _model(path, _tokenizer(path), seed)


def main(argv: list[str] | None = None) -> None:
    """``python -m lightning_mmpar.examples.tiny_qwen OUT [--seed N]``."""
    main_of(write_tiny_qwen, __doc__ or "", argv)


if __name__ == "__main__":
    main()
