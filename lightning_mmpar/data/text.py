"""What the caption data modules share: the tokenizer interface, class prompts and labels.

Any object with the :class:`CaptionTokenizer` interface tokenises captions (the package's
:class:`~lightning_mmpar.data.tokenizer.WordTokenizer`, or an adapter of a Hugging Face
tokenizer with the same methods). Zero-shot class prompts are one template filled with each class
name (CLIP's prompt engineering, Radford et al. 2021, section 3.1.4).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from lightning_mmpar.data.tokenizer import WordTokenizer

__all__ = ["CaptionTokenizer", "ClassPrompts", "parse_label"]


@runtime_checkable
class CaptionTokenizer(Protocol):
    """Interface the data modules and the recipe use (that of ``WordTokenizer``)."""

    @property
    def vocab_size(self) -> int:
        """Number of token ids (the LM head's output size)."""
        ...

    def __call__(self, texts: Sequence[str], max_length: int) -> dict[str, torch.Tensor]:
        """``input_ids`` / ``attention_mask`` / ``target_ids`` ``[len(texts), max_length]``."""
        ...

    def encode(self, text: str) -> list[int]:
        """Ids of one text, ``<bos>`` and ``<eos>`` included."""
        ...

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ids (special tokens dropped)."""
        ...


class ClassPrompts:
    """Mixin of a caption data module with ``tokenizer``, ``max_length``, ``class_names``,
    ``prompt_template`` and ``datasets`` attributes (and ``_ensure_tokenizer()``, which builds
    the tokenizer if it is not there yet): zero-shot class prompts, the vocabulary size, and
    the tokenizer in Lightning checkpoints."""

    tokenizer: Any
    datasets: dict[str, Any]
    max_length: int
    class_names: tuple[str, ...]
    prompt_template: str

    def _ensure_tokenizer(self) -> Any:
        return self.tokenizer

    @property
    def vocab_size(self) -> int:
        """Tokenizer vocabulary size (the LM head's output size; builds the tokenizer if
        needed, so the CLI can link it to ``model.vocab_size`` before ``setup``)."""
        return int(self._ensure_tokenizer().vocab_size)

    def class_prompts(self) -> dict[str, torch.Tensor]:
        """``prompt_template`` filled with each class name, tokenised: ``input_ids [K, T]``,
        ``attention_mask``, ``target_ids`` (K = ``len(class_names)``); ``{}`` without class
        names (the recipe then skips zero-shot metrics)."""
        if not self.class_names:
            return {}
        texts = [self.prompt_template.format(name=name) for name in self.class_names]
        return dict(self._ensure_tokenizer()(texts, self.max_length))

    def state_dict(self) -> dict[str, Any]:
        """Carried by Lightning checkpoints: a built/loaded :class:`WordTokenizer` (other
        tokenizers are configuration: they come back from the YAML)."""
        tok = self.tokenizer
        return {"tokenizer": tok.to_dict() if isinstance(tok, WordTokenizer) else None}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the tokenizer saved in a checkpoint (into the datasets too)."""
        if state_dict.get("tokenizer") is not None:
            self.tokenizer = WordTokenizer.from_dict(state_dict["tokenizer"], source="checkpoint")
            for dataset in self.datasets.values():
                dataset.tokenizer = self.tokenizer


def check_classes(owner: str, class_names: Sequence[str] | None, template: str) -> tuple[str, ...]:
    """``class_names`` as a tuple, after checking them and the prompt template.

    Raises:
        ValueError: repeated or empty names, or a template without ``{name}``.
    """
    names = tuple(class_names or ())
    if len(set(names)) != len(names) or any(not n.strip() for n in names):
        raise ValueError(
            f"{owner}: class_names ({list(names)}) must be distinct, non-empty names; "
            "fix the list (index = label)."
        )
    if names and "{name}" not in template:
        raise ValueError(
            f"{owner}: prompt_template ({template!r}) must contain {{name}}, "
            "e.g. 'a photo of a {name}'."
        )
    return names


def parse_label(value: Any, class_names: Sequence[str]) -> int | str:
    """The class index of ``value`` (an index, its text, or a class name), or why it is not
    one (a ``str`` reason)."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", errors="replace")
    text = str(value).strip()
    if text in class_names:
        return class_names.index(text)
    if text.lstrip("-").isdigit() and 0 <= int(text) < len(class_names):
        return int(text)
    return f"label {value!r} is neither a class name nor an index in 0..{len(class_names) - 1}"
