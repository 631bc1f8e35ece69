"""A small word-level tokenizer built offline from captions, saved next to checkpoints.

Text is lower-cased and split into runs of letters/digits and single punctuation marks; ids
0-3 are the special tokens ``<pad> <bos> <eos> <unk>``. Encoded captions are
``<bos> w_1 ... w_k <eos> <pad> ...`` padded (or truncated, keeping ``<eos>``) to a fixed length.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

IGNORE_INDEX = -100
"""Target id of padding positions, skipped by the caption loss (torch's cross-entropy default)."""
SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<bos>", "<eos>", "<unk>")
"""Special tokens, in id order."""
TOKENIZER_FILE = "tokenizer.json"
"""File name written by :meth:`WordTokenizer.save` inside the target directory."""
_WORD = re.compile(r"[^\W_]+|[^\w\s]|_")


@dataclass(kw_only=True)
class WordTokenizer:
    """Word-level vocabulary with special tokens; build with :meth:`build`, persist with save."""

    vocab: list[str]
    """Tokens in id order; must start with :data:`SPECIAL_TOKENS`."""
    lowercase: bool = True
    """Lower-case text before splitting."""
    _ids: dict[str, int] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if tuple(self.vocab[: len(SPECIAL_TOKENS)]) != SPECIAL_TOKENS:
            raise ValueError(
                f"vocab must start with the special tokens {list(SPECIAL_TOKENS)}, got "
                f"{self.vocab[: len(SPECIAL_TOKENS)]}; build it with WordTokenizer.build."
            )
        if len(set(self.vocab)) != len(self.vocab):
            dup = sorted(t for t, c in Counter(self.vocab).items() if c > 1)
            raise ValueError(f"vocab has duplicate tokens {dup[:10]}; each token must be unique.")
        self._ids = {t: i for i, t in enumerate(self.vocab)}

    pad_id: int = field(default=0, init=False)
    """Id of ``<pad>``."""
    bos_id: int = field(default=1, init=False)
    """Id of ``<bos>``."""
    eos_id: int = field(default=2, init=False)
    """Id of ``<eos>``."""
    unk_id: int = field(default=3, init=False)
    """Id of ``<unk>`` (out-of-vocabulary words)."""

    @classmethod
    def build(
        cls,
        texts: Iterable[str],
        *,
        min_count: int = 1,
        max_size: int | None = None,
        lowercase: bool = True,
    ) -> WordTokenizer:
        """Vocabulary of the words of ``texts`` seen ``min_count`` times, most frequent first.

        Ties are broken alphabetically, so the same texts always give the same ids.
        ``max_size`` caps the vocabulary including the special tokens.
        """
        if max_size is not None and max_size <= len(SPECIAL_TOKENS):
            raise ValueError(
                f"max_size ({max_size}) must exceed the {len(SPECIAL_TOKENS)} special tokens."
            )
        counts = Counter(w for t in texts for w in _split(t, lowercase))
        words = sorted(
            (w for w, c in counts.items() if c >= min_count), key=lambda w: (-counts[w], w)
        )
        words = [w for w in words if w not in SPECIAL_TOKENS]
        if max_size is not None:
            words = words[: max_size - len(SPECIAL_TOKENS)]
        return cls(vocab=[*SPECIAL_TOKENS, *words], lowercase=lowercase)

    @property
    def vocab_size(self) -> int:
        """Number of tokens, special tokens included (the LM head's output size)."""
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        """``[bos, w_1, ..., w_k, eos]``; unknown words map to ``unk``."""
        words = [self._ids.get(w, self.unk_id) for w in _split(text, self.lowercase)]
        return [self.bos_id, *words, self.eos_id]

    def decode(self, ids: Iterable[int]) -> str:
        """Words of ``ids`` joined by spaces, special tokens other than ``<unk>`` dropped."""
        skip = {self.pad_id, self.bos_id, self.eos_id}
        return " ".join(self.vocab[int(i)] for i in ids if int(i) not in skip)

    def __call__(self, texts: Sequence[str], max_length: int) -> dict[str, torch.Tensor]:
        """Encode a batch: ``input_ids``, ``attention_mask``, ``target_ids`` (all ``[B, T]``).

        ``target_ids`` is ``input_ids`` with padding set to the loss's ignore index; the caption
        loss shifts it by one position itself.
        """
        return encode_batch(self.encode, texts, max_length, pad_id=self.pad_id, eos_id=self.eos_id)

    def max_length_for(self, texts: Iterable[str]) -> int:
        """Length of the longest encoded text (words + bos + eos)."""
        return max(len(self.encode(t)) for t in texts)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able state (what :meth:`save` writes and checkpoints may carry)."""
        return {"type": "word", "version": 1, "lowercase": self.lowercase, "vocab": self.vocab}

    @classmethod
    def from_dict(cls, state: dict[str, Any], *, source: str = "state") -> WordTokenizer:
        """Inverse of :meth:`to_dict`; ``source`` names the origin in error messages."""
        if not isinstance(state, dict) or state.get("type") != "word" or "vocab" not in state:
            raise ValueError(
                f"{source}: not a word tokenizer (expected keys type='word', vocab); "
                "write it with WordTokenizer.save."
            )
        return cls(vocab=list(state["vocab"]), lowercase=bool(state.get("lowercase", True)))

    def save(self, directory: str | Path) -> Path:
        """Write ``<directory>/tokenizer.json`` (directory created); return the file path."""
        path = Path(directory) / TOKENIZER_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path

    @classmethod
    def load(cls, directory: str | Path) -> WordTokenizer:
        """Read a tokenizer written by :meth:`save`."""
        path = Path(directory) / TOKENIZER_FILE
        if not path.is_file():
            raise ValueError(
                f"tokenizer file {path} does not exist; pass the directory given to "
                "WordTokenizer.save (or build a new one with WordTokenizer.build)."
            )
        try:
            state = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: invalid JSON at line {err.lineno} ({err.msg}).") from err
        return cls.from_dict(state, source=str(path))


def encode_batch(
    encode: Callable[[str], list[int]],
    texts: Sequence[str],
    max_length: int,
    *,
    pad_id: int,
    eos_id: int,
) -> dict[str, torch.Tensor]:
    """``input_ids``, ``attention_mask``, ``target_ids`` (all ``[B, max_length]`` long) of
    ``texts`` encoded by ``encode`` (``[bos, ..., eos]`` per text), for every tokenizer.

    Rows are right-padded with ``pad_id``; a text longer than ``max_length`` keeps its first
    tokens and ``eos_id`` last. The mask marks each row's real tokens by length, so a tokenizer
    whose pad id equals its eos id (Llama's) still counts its ``<eos>``. ``target_ids`` is
    ``input_ids`` with padding set to the loss's ignore index (the caption loss shifts it).

    Raises:
        ValueError: ``max_length < 2`` (no room for ``<bos>`` and ``<eos>``).
    """
    if max_length < 2:
        raise ValueError(f"max_length ({max_length}) must be >= 2 to hold <bos> and <eos>.")
    ids = torch.full((len(texts), max_length), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, text in enumerate(texts):
        tokens = encode(text)
        if len(tokens) > max_length:  # truncate the text, keep <eos> last
            tokens = [*tokens[: max_length - 1], eos_id]
        ids[row, : len(tokens)] = torch.tensor(tokens)
        mask[row, : len(tokens)] = 1
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "target_ids": ids.masked_fill(mask == 0, IGNORE_INDEX),
    }


def _split(text: str, lowercase: bool) -> list[str]:
    return _WORD.findall(text.lower() if lowercase else text)
