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

from pathlib import Path

import torch

from lightning_mmpar.examples.tiny_chat import (
    COLOURS,
    RECORDS,
    WORDS,
    main_of,
    word_level_tokenizer,
    write_example,
)

__all__ = ["CHAT_TEMPLATE", "RECORDS", "write_tiny_llava"]

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> "
    "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
"""A minimal chat template (user / assistant turns, each closed by ``<|end|>``)."""
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|end|>", "<image>"]
VOCAB = 64
"""Rows of the tiny model's embedding (the tokenizer's words and specials fit in them)."""
IMAGE_SIZE = (20, 16)
"""(width, height) of every square (the processor resizes them to 16 x 16)."""


def _tokenizer(path: Path) -> int:
    """A word-level transformers tokenizer with :data:`CHAT_TEMPLATE` saved at ``path``;
    returns the ``<image>`` id."""
    vocab = [*SPECIAL, *sorted(set(WORDS.split()) | set(COLOURS))]
    assert len(vocab) <= VOCAB
    word_level_tokenizer(path, vocab, SPECIAL[4:], CHAT_TEMPLATE)
    return vocab.index("<image>")


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
    return write_example(root, _write_model, dict.fromkeys(COLOURS, IMAGE_SIZE), seed)


def _write_model(path: Path, seed: int) -> None:
    _model(path, _tokenizer(path), seed)


def main(argv: list[str] | None = None) -> None:
    """``python -m lightning_mmpar.examples.tiny_llava OUT [--seed N]``."""
    main_of(write_tiny_llava, __doc__ or "", argv)


if __name__ == "__main__":
    main()
