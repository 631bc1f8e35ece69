"""Image-caption datasets and a data module from CSV/TSV or JSONL caption files.

Rows are indexed and checked by :mod:`lightning_mmpar.data.caption_files` (file, line and fix
on a bad row, or ``on_error="skip"``: left out, counted, reported in ``dataset.skipped``);
images are preprocessed as the vision tower expects (:mod:`lightning_mmpar.data.transforms`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_mmpar.data.caption_files import (
    _LIMITS,
    CaptionRow,
    CaptionsFormat,
    OnError,
    SkippedRow,
    _check_config,
    index_captions,
)
from lightning_mmpar.data.sampler import ResumableRandomSampler
from lightning_mmpar.data.text import CaptionTokenizer, ClassPrompts, check_classes
from lightning_mmpar.data.tokenizer import WordTokenizer
from lightning_mmpar.data.transforms import CLIP_MEAN, CLIP_STD, ImagePreprocess, clip_transform

__all__ = [
    "CLIP_MEAN",
    "CLIP_STD",
    "CaptionRow",
    "CaptionsDataModule",
    "CaptionsDataset",
    "CaptionsFormat",
    "SkippedRow",
    "clip_transform",
    "index_captions",
]


class CaptionsDataset(Dataset[dict[str, torch.Tensor]]):
    """Images and tokenised captions of one file: items ``images [3, S, S]`` float,
    ``input_ids`` / ``attention_mask`` / ``target_ids`` ``[T]`` long, and ``labels`` (0-d long)
    when ``fmt.label_column`` is set.

    Args:
        file: CSV/TSV or JSONL caption file.
        tokenizer: a :class:`~lightning_mmpar.data.text.CaptionTokenizer`; None builds a
            :class:`WordTokenizer` from this file's captions.
        image_size: side S of the square images (>= 1).
        max_length: token length T of ``input_ids`` (>= 2: ``<bos>`` and ``<eos>``).
        fmt: columns, separator, format, image root, label column and class names.
        on_error: ``"raise"`` at the first bad row, or ``"skip"`` and count (``skipped``).
        verify_images: open every image with PIL while indexing (catches unreadable files).
        transform: image transform; None is :func:`clip_transform` (open_clip's defaults).

    Raises:
        ValueError: bad configuration (before any file is read), a bad row (file, line, fix).
    """

    def __init__(
        self,
        file: str | Path,
        *,
        tokenizer: CaptionTokenizer | None = None,
        image_size: int = 224,
        max_length: int = 32,
        fmt: CaptionsFormat | None = None,
        on_error: OnError = "raise",
        verify_images: bool = True,
        transform: Callable[[Image.Image], torch.Tensor] | None = None,
    ) -> None:
        _check_config("CaptionsDataset", on_error, image_size=image_size, max_length=max_length)
        self.file, self.on_error, self.max_length = Path(file), on_error, max_length
        self.labelled = fmt is not None and fmt.label_column is not None
        self.rows, self.skipped = index_captions(
            file, fmt=fmt, on_error=on_error, verify_images=verify_images
        )
        if not self.rows:
            raise ValueError(f"{file}: no usable rows ({len(self.skipped)} skipped).")
        self.tokenizer = tokenizer or WordTokenizer.build(self.captions)
        self.transform = transform or clip_transform(image_size)

    @property
    def captions(self) -> list[str]:
        """Caption of every usable row."""
        return [r.caption for r in self.rows]

    @property
    def num_skipped(self) -> int:
        """Rows left out (indexing, plus load failures in this process under ``"skip"``)."""
        return len(self.skipped)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        # An image can still fail here (verify_images=False, or changed since indexing): under
        # "skip" the next row stands in, so a batch never comes back short.
        for offset in range(len(self.rows)):
            row = self.rows[(index + offset) % len(self.rows)]
            try:
                with Image.open(row.path) as img:
                    image = self.transform(img.convert("RGB"))
            except Exception as err:
                reason = f"unreadable image {str(row.path)!r} ({type(err).__name__}: {err})"
                if self.on_error == "raise":
                    raise ValueError(
                        f"{self.file}, line {row.line}: {reason}; fix or remove the row, or "
                        "pass on_error='skip'."
                    ) from err
                self.skipped.append(SkippedRow(file=str(self.file), line=row.line, reason=reason))
                continue
            text = self.tokenizer([row.caption], self.max_length)
            item = {"images": image, **{k: v[0] for k, v in text.items()}}
            if self.labelled:
                item["labels"] = torch.tensor(row.label, dtype=torch.long)
            return item
        raise ValueError(f"{self.file}: no image of the {len(self.rows)} rows could be read.")


class CaptionsDataModule(ClassPrompts, pl.LightningDataModule):
    """Train (and optional validation / predict) caption files as a LightningDataModule.

    The tokenizer is ``tokenizer`` (any :class:`~lightning_mmpar.data.text.CaptionTokenizer`,
    e.g. ``class_path`` in YAML), loaded from ``tokenizer_dir``, or a :class:`WordTokenizer`
    built from the training captions (and the class prompts) when first needed (``vocab_size``
    or :meth:`setup`); a ``WordTokenizer`` travels in checkpoints (:meth:`state_dict`). With
    ``class_names`` (index = label) and ``label_column``, batches carry ``labels [B]`` and
    :meth:`class_prompts` gives the zero-shot prompts (``prompt_template`` per class). Images are
    preprocessed by ``preprocess`` (:class:`~lightning_mmpar.data.transforms.ImagePreprocess`:
    open_clip's defaults, or the vision tower's config via ``from_pretrained``). Skipped rows are
    logged and counted in :attr:`num_skipped`. Other arguments as in :class:`CaptionsDataset`
    and :class:`CaptionsFormat`; ``min_count``/``max_vocab`` shape a built vocabulary.

    Raises:
        ValueError: a bad field (named, with the fix) before any file is read; ``class_names``
            without ``label_column`` or the reverse.
    """

    def __init__(
        self,
        *,
        train_file: str,
        val_file: str | None = None,
        image_column: str = "filepath",
        caption_column: str = "title",
        label_column: str | None = None,
        separator: str | None = None,
        file_format: Literal["csv", "jsonl"] | None = None,
        image_root: str | None = None,
        image_size: int = 224,
        max_length: int = 32,
        batch_size: int = 32,
        num_workers: int = 0,
        on_error: OnError = "raise",
        verify_images: bool = True,
        tokenizer: CaptionTokenizer | None = None,
        tokenizer_dir: str | None = None,
        min_count: int = 1,
        max_vocab: int | None = None,
        class_names: Sequence[str] | None = None,
        prompt_template: str = "a photo of a {name}",
        preprocess: ImagePreprocess | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        fields = {k: v for k, v in locals().items() if k in _LIMITS and v is not None}
        _check_config("CaptionsDataModule", on_error, **fields)
        self.class_names = check_classes("CaptionsDataModule", class_names, prompt_template)
        if bool(self.class_names) != (label_column is not None):
            raise ValueError(
                f"CaptionsDataModule: class_names ({list(self.class_names)}) and label_column "
                f"({label_column!r}) go together: zero-shot prompts need a label per row; set "
                "both or neither."
            )
        self.prompt_template = prompt_template
        self.files = {"train": train_file, "val": val_file}
        self.fmt = CaptionsFormat(
            image_column=image_column,
            caption_column=caption_column,
            separator=separator,
            file_format=file_format,
            image_root=image_root,
            label_column=label_column,
            class_names=self.class_names,
        )
        self.image_size, self.max_length, self.batch_size = image_size, max_length, batch_size
        self.num_workers, self.on_error, self.verify_images = num_workers, on_error, verify_images
        self.min_count, self.max_vocab, self.seed = min_count, max_vocab, seed
        self.preprocess = preprocess or ImagePreprocess()
        self.transform = self.preprocess.transform(image_size)
        self.tokenizer = tokenizer or (WordTokenizer.load(tokenizer_dir) if tokenizer_dir else None)
        self.datasets: dict[str, CaptionsDataset] = {}

    def _ensure_tokenizer(self) -> Any:
        if self.tokenizer is None:
            self.setup("fit")
        return self.tokenizer

    def setup(self, stage: str | None = None) -> None:
        """Index the files (checking every row) and build the tokenizer if needed."""
        for split, file in self.files.items():
            if file is None or split in self.datasets:
                continue
            dataset = CaptionsDataset(
                file,
                tokenizer=self.tokenizer,
                image_size=self.image_size,
                max_length=self.max_length,
                fmt=self.fmt,
                on_error=self.on_error,
                verify_images=self.verify_images,
                transform=self.transform,
            )
            if self.tokenizer is None:  # the train split comes first and fixes the vocabulary
                prompts = [self.prompt_template.format(name=n) for n in self.class_names]
                self.tokenizer = WordTokenizer.build(
                    dataset.captions + prompts, min_count=self.min_count, max_size=self.max_vocab
                )
                dataset.tokenizer = self.tokenizer
            self.datasets[split] = dataset

    @property
    def num_skipped(self) -> dict[str, int]:
        """Rows skipped per split so far (``on_error="skip"``)."""
        return {split: ds.num_skipped for split, ds in self.datasets.items()}

    def _loader(self, split: str, train: bool) -> DataLoader[dict[str, torch.Tensor]]:
        if split not in self.datasets:
            raise ValueError(f"no {split} data: call setup() first, or pass {split}_file.")
        # torchdata's StatefulDataLoader: Lightning checkpoints the training loader's position,
        # so a run resumed mid-epoch continues with the batches it would have seen next.
        dataset = self.datasets[split]
        return StatefulDataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=ResumableRandomSampler(dataset, seed=self.seed) if train else None,
            drop_last=train,
            num_workers=self.num_workers,
        )

    def train_dataloader(self) -> DataLoader[dict[str, torch.Tensor]]:
        """Shuffled (seeded by ``seed`` and the epoch), last partial batch dropped (equal
        batches on every dp rank)."""
        return self._loader("train", True)

    def val_dataloader(self) -> DataLoader[dict[str, torch.Tensor]] | list[Any]:
        """The validation file in order; ``[]`` without ``val_file`` (no validation: Lightning
        skips the loop)."""
        return self._loader("val", False) if self.files["val"] is not None else []

    def predict_dataloader(self) -> DataLoader[dict[str, torch.Tensor]]:
        """The validation file in order (``predict`` captions it)."""
        return self._loader("val", False)
