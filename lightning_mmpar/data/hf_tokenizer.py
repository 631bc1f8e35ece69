"""A transformers tokenizer behind the interface the recipe uses from ``WordTokenizer``.

``HFTokenizer(path)`` loads ``transformers.AutoTokenizer.from_pretrained(path,
local_files_only=True)`` (a Llama directory holds its tokenizer next to the weights) and encodes
exactly like :class:`~lightning_mmpar.data.tokenizer.WordTokenizer`: ``<bos> tokens <eos>``,
right-padded with the pad id (the eos id when the tokenizer has no pad token, as Llama's), the
attention mask from the lengths (not from ``ids != pad``, so an eos used as pad is still
attended) and padding targets set to the loss's ignore index. Captions, class prompts and
generated captions go through it; :func:`load_tokenizer` and :func:`tokenizer_from_dict` pick
the word tokenizer or this one from a directory or a checkpoint's state.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_mmpar.data.tokenizer import TOKENIZER_FILE, WordTokenizer, encode_batch

__all__ = ["HFTokenizer", "load_tokenizer", "tokenizer_from_dict"]

HF_MARKER = "tokenizer_config.json"
"""File ``save_pretrained`` writes next to a transformers tokenizer."""


class HFTokenizer:
    """A local transformers tokenizer with the recipe's encoding (module docstring).

    Args:
        path: directory written by ``PreTrainedTokenizer(Fast).save_pretrained`` (e.g. a
            Llama model directory).

    Raises:
        ValueError: no tokenizer there, or it lacks a bos or eos token (set ``bos_token`` /
            ``eos_token`` in its ``tokenizer_config.json``).
    """

    def __init__(self, path: str | Path) -> None:
        from transformers import AutoTokenizer

        self.path = str(Path(path).resolve())
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        except (OSError, ValueError) as err:
            raise ValueError(
                f"data.tokenizer ({str(path)!r}): no transformers tokenizer there ({err}); pass "
                "a directory written by tokenizer.save_pretrained (e.g. the Llama directory)."
            ) from err
        tok = self.tokenizer
        if tok.bos_token_id is None or tok.eos_token_id is None:
            raise ValueError(
                f"data.tokenizer ({str(path)!r}) has no bos or eos token (bos={tok.bos_token!r}, "
                f"eos={tok.eos_token!r}); captions are <bos> ... <eos>: set both in "
                "tokenizer_config.json."
            )
        self.bos_id: int = int(tok.bos_token_id)
        self.eos_id: int = int(tok.eos_token_id)
        self.pad_id: int = int(tok.pad_token_id if tok.pad_token_id is not None else self.eos_id)
        self.unk_id: int = int(tok.unk_token_id if tok.unk_token_id is not None else -1)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (``len(tokenizer)``)."""
        return len(self.tokenizer)

    def encode(self, text: str) -> list[int]:
        """``[bos, t_1, ..., t_k, eos]`` (the tokenizer's own special tokens not added)."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return [self.bos_id, *ids, self.eos_id]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``, special tokens dropped."""
        return str(self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True))

    def __call__(self, texts: Sequence[str], max_length: int) -> dict[str, torch.Tensor]:
        """``input_ids``, ``attention_mask``, ``target_ids`` (all ``[B, T]`` long), as
        :meth:`WordTokenizer.__call__` (truncation keeps ``<eos>`` last)."""
        return encode_batch(self.encode, texts, max_length, pad_id=self.pad_id, eos_id=self.eos_id)

    def max_length_for(self, texts: Iterable[str]) -> int:
        """Length of the longest encoded text (tokens + bos + eos)."""
        return max(len(self.encode(t)) for t in texts)

    def to_dict(self) -> dict[str, Any]:
        """``{"type": "hf", "path": ...}``: checkpoints name the directory, not the vocabulary."""
        return {"type": "hf", "version": 1, "path": self.path}

    def save(self, directory: str | Path) -> Path:
        """``save_pretrained`` into ``directory`` (created); returns the directory."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save_pretrained(str(out))
        return out


Tokenizer = WordTokenizer | HFTokenizer


def load_tokenizer(directory: str | Path) -> Tokenizer:
    """The tokenizer saved in ``directory``: a transformers one (``tokenizer_config.json``) or
    a word tokenizer (``tokenizer.json`` of :meth:`WordTokenizer.save`)."""
    path = Path(directory)
    if (path / HF_MARKER).is_file():
        return HFTokenizer(path)
    if (path / TOKENIZER_FILE).is_file():
        return WordTokenizer.load(path)
    raise ValueError(
        f"no tokenizer in {str(path)!r}: expected {HF_MARKER} (transformers) or "
        f"{TOKENIZER_FILE} (WordTokenizer.save)."
    )


def tokenizer_from_dict(state: dict[str, Any], *, source: str = "state") -> Tokenizer:
    """Inverse of ``to_dict`` for either tokenizer (a transformers one is reloaded from its
    directory, which must still exist)."""
    if isinstance(state, dict) and state.get("type") == "hf":
        return HFTokenizer(state["path"])
    return WordTokenizer.from_dict(state, source=source)
