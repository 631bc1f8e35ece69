"""Offline demo data: scikit-learn's 8x8 handwritten digits as small RGB images with captions.

Each of the 1,797 digits is upsampled (bilinear) to ``image_size``, copied to 3 channels and
normalised with the training split's pixel mean and std. Each image gets one caption from the
training templates (drawn once, seeded). One template is held out of every caption and used
only for the zero-shot class prompts (:meth:`DigitsCaptions.class_prompts`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_mmpar.data.hf_tokenizer import (
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
    tokenizer_from_dict,
)
from lightning_mmpar.data.sampler import ResumableRandomSampler
from lightning_mmpar.data.tokenizer import WordTokenizer

CLASS_NAMES: tuple[str, ...] = (
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
)
"""Spoken name of each digit class."""
TEMPLATES: tuple[str, ...] = (
    "a photo of the digit {name}",
    "a handwritten {digit}",
    "an image of the number {name}",
    "a drawing of a {name}",
    "the digit {digit} written by hand",
    "a blurry picture of the number {digit}",
    "a picture of the digit {name}",
)
"""Caption templates; ``{name}`` is the class name, ``{digit}`` the numeral."""
DIGITS_SAMPLES = 1797
"""Images in ``sklearn.datasets.load_digits()`` (a fixed dataset), counted without loading it."""


def split_sizes(val_fraction: float) -> tuple[int, int]:
    """``(train, held-out)`` digits of ``val_fraction``, as scikit-learn's ``train_test_split``
    counts them: ``ceil(val_fraction * 1797)`` held out, the rest for training."""
    held_out = math.ceil(val_fraction * DIGITS_SAMPLES)
    return DIGITS_SAMPLES - held_out, held_out


def fill(template: str, label: int) -> str:
    """The caption of ``template`` for digit ``label``."""
    return template.format(name=CLASS_NAMES[label], digit=str(label))


class DigitsDataset(Dataset[dict[str, torch.Tensor]]):
    """Precomputed tensors of one split; items are dicts of ``[3, H, W]`` / ``[T]`` tensors."""

    def __init__(
        self,
        *,
        images: torch.Tensor,
        labels: torch.Tensor,
        text: dict[str, torch.Tensor],
        indices: torch.Tensor,
    ) -> None:
        self.images, self.labels, self.text = images, labels, text
        self.indices = indices
        """Position of each sample in ``sklearn.datasets.load_digits()``."""

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        item = {k: v[index] for k, v in self.text.items()}
        return {"images": self.images[index], "labels": self.labels[index], **item}


class DigitsCaptions(pl.LightningDataModule):
    """scikit-learn digits as an image-caption data module (no download, no files).

    Batches: ``images [B, 3, H, W]`` float, ``input_ids`` / ``attention_mask`` /
    ``target_ids`` ``[B, T]`` long (``<bos> ... <eos>`` padded; target padding = -100),
    ``labels [B]`` the digit class. The tokenizer is derived from the templates at construction,
    so ``vocab_size`` is known before the model is built.

    Args:
        image_size: side of the square images (e.g. 32 or 64).
        batch_size: samples per batch and per data-parallel rank.
        val_fraction: fraction of the digits held out (stratified by class, seeded).
        seed: seed of the split and of the caption templates drawn per image.
        max_length: token length T; None fits the longest caption or prompt.
        templates: caption templates with ``{name}`` and/or ``{digit}``.
        prompt_template: index in ``templates`` of the one held out for zero-shot prompts.
        tokenizer_dir: load the tokenizer saved there instead of deriving it.
        tokenizer: a transformers tokenizer directory (``AutoTokenizer``, offline; e.g. the
            pretrained Llama's) instead of the word tokenizer
            (:class:`~lightning_mmpar.data.hf_tokenizer.HFTokenizer`).
        num_workers: DataLoader worker processes.
    """

    def __init__(
        self,
        *,
        image_size: int = 32,
        batch_size: int = 32,
        val_fraction: float = 0.2,
        seed: int = 0,
        max_length: int | None = None,
        templates: Sequence[str] = TEMPLATES,
        prompt_template: int = -1,
        tokenizer_dir: str | None = None,
        num_workers: int = 0,
        tokenizer: str | None = None,
    ) -> None:
        super().__init__()
        _validate(image_size, batch_size, val_fraction, templates, prompt_template)
        self.image_size, self.batch_size, self.seed = image_size, batch_size, seed
        self.val_fraction, self.num_workers = val_fraction, num_workers
        self.templates = tuple(templates)
        self.prompt_template = self.templates[prompt_template]
        self.train_templates = tuple(t for t in self.templates if t != self.prompt_template)
        every = [fill(t, c) for t in self.templates for c in range(10)]
        if tokenizer and tokenizer_dir:
            raise ValueError("set data.tokenizer (transformers) or data.tokenizer_dir, not both.")
        self.tokenizer: Tokenizer = (
            HFTokenizer(tokenizer)
            if tokenizer
            else load_tokenizer(tokenizer_dir)
            if tokenizer_dir
            else WordTokenizer.build(every)
        )
        self.max_length = max_length or self.tokenizer.max_length_for(every)
        self.train: DigitsDataset | None = None
        self.val: DigitsDataset | None = None

    @property
    def vocab_size(self) -> int:
        """Tokenizer vocabulary size (the LM head's output size)."""
        return self.tokenizer.vocab_size

    @property
    def class_names(self) -> tuple[str, ...]:
        """Class names, index = label."""
        return CLASS_NAMES

    def class_prompts(self) -> dict[str, torch.Tensor]:
        """The held-out template filled per class, tokenised: ``input_ids [10, T]`` etc."""
        return self.tokenizer([fill(self.prompt_template, c) for c in range(10)], self.max_length)

    def setup(self, stage: str | None = None) -> None:
        """Load the digits, split them, upsample and caption them (idempotent)."""
        if self.train is not None:
            return
        images, labels, train_idx, val_idx = digit_images(
            self.image_size, self.val_fraction, self.seed
        )
        rng = np.random.default_rng(self.seed)
        chosen = rng.integers(len(self.train_templates), size=len(labels))
        captions = [
            fill(self.train_templates[t], int(c)) for t, c in zip(chosen, labels, strict=True)
        ]
        self.train = self._split(images, labels, captions, train_idx)
        self.val = self._split(images, labels, captions, val_idx)

    def _split(
        self, images: torch.Tensor, labels: torch.Tensor, captions: list[str], idx: np.ndarray
    ) -> DigitsDataset:
        text = self.tokenizer([captions[i] for i in idx], self.max_length)
        index = torch.as_tensor(idx)
        return DigitsDataset(images=images[index], labels=labels[index], text=text, indices=index)

    def train_dataloader(self) -> DataLoader[dict[str, torch.Tensor]]:
        """Shuffled, last partial batch dropped (equal batches on every dp rank).

        A torchdata ``StatefulDataLoader`` over a :class:`ResumableRandomSampler` (seeded by
        ``seed`` and the epoch; Lightning swaps it for a ``DistributedSampler`` under dp > 1):
        Lightning saves its position in checkpoints and a run resumed mid-epoch continues with
        exactly the batches it would have seen next.
        """
        assert self.train is not None, "call setup() first"
        return StatefulDataLoader(
            self.train,
            batch_size=self.batch_size,
            sampler=ResumableRandomSampler(self.train, seed=self.seed),
            drop_last=True,
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> DataLoader[dict[str, torch.Tensor]]:
        """The held-out digits in a fixed order."""
        assert self.val is not None, "call setup() first"
        return DataLoader(self.val, batch_size=self.batch_size, num_workers=self.num_workers)

    def test_dataloader(self) -> DataLoader[dict[str, torch.Tensor]]:
        """Same as :meth:`val_dataloader` (there is no third split)."""
        return self.val_dataloader()

    def state_dict(self) -> dict[str, Any]:
        """Carried by Lightning checkpoints: the tokenizer and the caption length."""
        return {"tokenizer": self.tokenizer.to_dict(), "max_length": self.max_length}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the tokenizer saved in a checkpoint."""
        self.tokenizer = tokenizer_from_dict(state_dict["tokenizer"], source="checkpoint")
        self.max_length = int(state_dict["max_length"])

    def save_tokenizer(self, directory: str | Path) -> Path:
        """Write the tokenizer next to exported weights; returns the file written."""
        return self.tokenizer.save(directory)


def digit_images(
    image_size: int, val_fraction: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, np.ndarray]:
    """All 1,797 digits as ``images [N, 3, S, S]`` (bilinear upsampling, 3 channels,
    normalised by the training split's pixel mean and std), ``labels [N]`` and the train / val
    indices (stratified by class, seeded)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    pixels = torch.tensor(digits.images, dtype=torch.float32) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    train_idx, val_idx = train_test_split(
        np.arange(len(labels)), test_size=val_fraction, random_state=seed, stratify=digits.target
    )
    images = F.interpolate(pixels[:, None], size=image_size, mode="bilinear")
    images = images.clamp(0, 1).expand(-1, 3, -1, -1)
    train_pixels = images[torch.as_tensor(train_idx)]
    mean, std = train_pixels.mean(), train_pixels.std()
    return ((images - mean) / std).contiguous(), labels, train_idx, val_idx


def _validate(
    image_size: int,
    batch_size: int,
    val_fraction: float,
    templates: Sequence[str],
    prompt_template: int,
) -> None:
    if image_size < 8 or batch_size < 1:
        raise ValueError(
            f"image_size ({image_size}) must be >= 8 and batch_size ({batch_size}) >= 1."
        )
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction ({val_fraction}) must be in (0, 1), e.g. 0.2.")
    train, held_out = split_sizes(val_fraction)
    if min(train, held_out) < len(CLASS_NAMES):  # the split is stratified by class
        low = (len(CLASS_NAMES) - 1) / DIGITS_SAMPLES
        high = (DIGITS_SAMPLES - len(CLASS_NAMES)) / DIGITS_SAMPLES
        raise ValueError(
            f"val_fraction ({val_fraction}) leaves {train} training and {held_out} held-out "
            f"digits of {DIGITS_SAMPLES}; the split is stratified by class and needs at least "
            f"{len(CLASS_NAMES)} in each: use a val_fraction from {math.ceil(low * 1e4) / 1e4} "
            f"to {math.floor(high * 1e4) / 1e4}, e.g. 0.2."
        )
    if len(templates) < 2:
        raise ValueError(
            f"templates ({len(templates)} given) needs at least 2: one is held out for prompts."
        )
    if not -len(templates) <= prompt_template < len(templates):
        raise ValueError(
            f"prompt_template ({prompt_template}) must index templates (0..{len(templates) - 1})."
        )
    for t in templates:
        if "{name}" not in t and "{digit}" not in t:
            raise ValueError(f"template {t!r} must contain {{name}} or {{digit}}.")
