"""An offline multi-image question-answering task on scikit-learn's digits: 0..3 images per
sample, answers learnt on the assistant turn only, scored by exact match of the greedy answer.

Each sample shows ``k`` digits (``k`` uniform in ``0..max_images``; the images of the training
split for training samples, of the held-out split for validation ones) and asks one question:

================================  ====================  ===========================
question                          images                answer
================================  ====================  ===========================
``which digits are shown?``       1..3                  the digits in order, ``3 7``
``how many images?``              0..3                  ``k`` as a numeral
``what is a plus b?``             0 (text only)         ``a + b`` as a numeral
================================  ====================  ===========================

The conversation is LLaVA's ``human`` turn (one ``<image>`` marker per image, then the question)
and one ``gpt`` turn (the answer), encoded in the plain format of
:class:`~lightning_mmpar.data.chat.ChatEncoder` with a :class:`WordTokenizer` of every question
and answer (``<bos> <image> <image> which digits are shown ? 3 7 <eos>``, targets ``3 7 <eos>``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_mmpar.data.chat import IMAGE_MARKER, ChatEncoder
from lightning_mmpar.data.conversations import RaggedDataModule, word_tokenizer_for
from lightning_mmpar.data.digits import digit_images
from lightning_mmpar.data.tokenizer import IGNORE_INDEX

__all__ = ["QUESTIONS", "DigitsVQA", "DigitsVQADataset", "VQAItem"]

QUESTIONS: dict[str, str] = {
    "digits": "which digits are shown?",
    "count": "how many images?",
    "plus": "what is {a} plus {b}?",
}
"""Question kind -> text (``plus``: ``{a}`` and ``{b}`` are digits)."""


@dataclass(frozen=True)
class VQAItem:
    """One question: the digits shown (indices into the image table), question and answer."""

    id: str
    images: tuple[int, ...]
    question: str
    answer: str


def draw_items(
    rng: np.random.Generator, pool: np.ndarray, labels: torch.Tensor, n: int, max_images: int
) -> list[VQAItem]:
    """``n`` questions over digits drawn from ``pool`` (module docstring's table)."""
    items = []
    for i in range(n):
        k = int(rng.integers(max_images + 1))
        shown = tuple(int(j) for j in rng.choice(pool, size=k, replace=False))
        if k and rng.random() < 0.6:
            question, answer = QUESTIONS["digits"], " ".join(str(int(labels[j])) for j in shown)
        elif k or rng.random() < 0.25:
            question, answer = QUESTIONS["count"], str(k)
        else:
            a, b = (int(x) for x in rng.integers(10, size=2))
            question, answer = QUESTIONS["plus"].format(a=a, b=b), str(a + b)
        items.append(VQAItem(f"q{i}", shown, question, answer))
    return items


def vocabulary_texts() -> list[str]:
    """Every question and answer the task can ask (the word tokenizer's vocabulary)."""
    texts = [QUESTIONS["digits"], QUESTIONS["count"]]
    texts += [QUESTIONS["plus"].format(a=a, b=b) for a in range(10) for b in range(10)]
    return texts + [str(n) for n in range(19)]


class DigitsVQADataset(Dataset[dict[str, Any]]):
    """The samples of the batch contract for ``items`` over ``images [N, 3, S, S]``."""

    def __init__(self, items: list[VQAItem], images: torch.Tensor, encoder: ChatEncoder) -> None:
        self.items, self.images, self.encoder = items, images, encoder

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, Any]:
        item = self.items[index]
        human = f"{IMAGE_MARKER}\n" * len(item.images) + item.question
        ids, labels = self.encoder((("human", human), ("gpt", item.answer)), item.id)
        return {
            "id": item.id,
            "input_ids": ids,
            "labels": labels,
            "pixel_values": self.images[list(item.images)],
        }

    def prompt(self, index: int) -> dict[str, Any]:
        """The sample cut before its answer (``input_ids`` up to the first target, labels all
        ignored) and the expected ``answer`` text: what greedy decoding continues."""
        sample = self[index]
        first = int((sample["labels"] != IGNORE_INDEX).nonzero()[0])
        ids = sample["input_ids"][:first]
        return {
            **sample,
            "input_ids": ids,
            "labels": torch.full_like(ids, IGNORE_INDEX),
            "answer": self.items[index].answer,
        }


class DigitsVQA(RaggedDataModule):
    """The digits question-answering task as ragged batches (module docstring).

    Args:
        image_size: side S of the square images.
        train_samples, val_samples: questions per split (drawn once, seeded).
        max_images: most images per sample (0..3 in the recipe).
        val_fraction: fraction of the digits held out for the validation questions.
        Others: as in :class:`~lightning_mmpar.data.conversations.RaggedDataModule`.

    Raises:
        ValueError: ``image_size < 8``, ``max_images`` not in 0..8, a sample count < 1, or
            ``val_fraction`` outside (0, 1).
    """

    def __init__(
        self,
        *,
        image_size: int = 16,
        train_samples: int = 2000,
        val_samples: int = 200,
        max_images: int = 3,
        val_fraction: float = 0.2,
        **ragged: Any,
    ) -> None:
        super().__init__(**ragged)
        if image_size < 8 or not 0 <= max_images <= 8 or min(train_samples, val_samples) < 1:
            raise ValueError(
                f"DigitsVQA: image_size ({image_size}) must be >= 8, max_images ({max_images}) "
                f"in 0..8, train_samples ({train_samples}) and val_samples ({val_samples}) >= 1."
            )
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"DigitsVQA: val_fraction ({val_fraction}) must be in (0, 1).")
        self.image_size, self.max_images, self.val_fraction = image_size, max_images, val_fraction
        self.sizes = {"train": train_samples, "val": val_samples}
        self.tokenizer = word_tokenizer_for(vocabulary_texts())
        self.encoder = ChatEncoder(self.tokenizer)
        self.image_token_id = self.encoder.image_token_id

    @property
    def images_per_sample(self) -> float:
        """Mean images per sample: ``max_images / 2`` (each sample shows ``k`` uniform in
        ``0..max_images``); the planner's default ``--images-per-sample``."""
        return self.max_images / 2

    def setup(self, stage: str | None = None) -> None:
        """Load and split the digits and draw the questions (idempotent)."""
        if self.datasets:
            return
        images, labels, train_idx, val_idx = digit_images(
            self.image_size, self.val_fraction, self.seed
        )
        for offset, (split, pool) in enumerate((("train", train_idx), ("val", val_idx))):
            rng = np.random.default_rng(self.seed + offset)
            items = draw_items(rng, pool, labels, self.sizes[split], self.max_images)
            self.datasets[split] = DigitsVQADataset(items, images, self.encoder)

    def prompts(self, split: str = "val") -> list[dict[str, Any]]:
        """Every question of ``split`` cut before its answer, with the ``answer`` text
        (:meth:`DigitsVQADataset.prompt`)."""
        self.setup("fit")
        data = self.datasets[split]
        return [data.prompt(i) for i in range(len(data))]
