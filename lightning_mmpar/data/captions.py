"""Image-caption datasets from a CSV/TSV (open_clip's ``filepath``/``title`` layout) or JSONL.

Every row is checked when the dataset is built: a malformed row, a missing image or (with
``verify_images``) an image PIL cannot read raises a ``ValueError`` naming the file, the line and
the fix, or with ``on_error="skip"`` is left out, counted and reported (``dataset.skipped``).
"""

from __future__ import annotations

import csv
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchvision import transforms as T

from lightning_mmpar.data.sampler import ResumableRandomSampler
from lightning_mmpar.data.tokenizer import SPECIAL_TOKENS, WordTokenizer

log = logging.getLogger(__name__)
OnError = Literal["raise", "skip"]
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
"""Per-channel mean of CLIP's image normalisation (open_clip OPENAI_DATASET_MEAN)."""
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
"""Per-channel std of CLIP's image normalisation (open_clip OPENAI_DATASET_STD)."""
_LIMITS = {
    "image_size": (1, "the side of the square images, e.g. 224"),
    "max_length": (2, "the token length T, room for <bos> and <eos>, e.g. 32"),
    "batch_size": (1, "the per-rank batch size, e.g. 32"),
    "num_workers": (0, "0 (load in the main process) or a worker count"),
    "max_vocab": (len(SPECIAL_TOKENS) + 1, "None (no cap) or a vocabulary size"),
}


def _check_config(owner: str, on_error: str, **values: Any) -> None:
    """Refuse bad configuration fields (ValueError naming field, value and fix); reads no file."""
    if on_error not in ("raise", "skip"):
        raise ValueError(f"{owner}: on_error ({on_error!r}) must be 'raise' or 'skip'.")
    for name, value in values.items():
        low, fix = _LIMITS[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(
                f"{owner}: {name} ({value!r}) must be an integer >= {low}; set it to {fix}."
            )


def _undecodable(text: str) -> str | None:
    """Where ``text`` holds a byte that is not UTF-8: files are read with ``surrogateescape`` so
    that such a byte is a row fault (file, line), not a raw UnicodeDecodeError (utf-8-sig: BOM)."""
    for at, char in enumerate(text, start=1):
        if "\udc80" <= char <= "\udcff":
            return f"byte 0x{ord(char) - 0xDC00:02x} at character {at} is not UTF-8; save as UTF-8"
    return None


@dataclass(kw_only=True)
class CaptionsFormat:
    """How to read an image-caption file."""

    image_column: str = "filepath"
    """Column (CSV) or key (JSONL) holding the image path."""
    caption_column: str = "title"
    """Column (CSV) or key (JSONL) holding the caption."""
    separator: str | None = None
    """CSV field separator; None: tab for ``.tsv`` files, comma otherwise."""
    file_format: Literal["csv", "jsonl"] | None = None
    """None: JSONL for ``.jsonl``/``.json`` suffixes, CSV otherwise."""
    image_root: str | None = None
    """Directory relative image paths resolve against; None: the caption file's directory."""

    def resolve(self, file: Path) -> tuple[str, str, Path]:
        """``(format, separator, image root)`` for ``file``."""
        fmt = self.file_format or ("jsonl" if file.suffix in (".jsonl", ".json") else "csv")
        sep = self.separator or ("\t" if file.suffix == ".tsv" else ",")
        return fmt, sep, Path(self.image_root) if self.image_root else file.parent


@dataclass(kw_only=True, frozen=True)
class CaptionRow:
    """One usable sample."""

    path: Path
    """Resolved image path."""
    caption: str
    """Caption text."""
    line: int
    """1-based line of the row in its file."""


@dataclass(kw_only=True, frozen=True)
class SkippedRow:
    """A row left out under ``on_error="skip"``."""

    file: str
    """Caption file."""
    line: int
    """1-based line of the row."""
    reason: str
    """What was wrong with it."""


def _csv_records(file: Path, sep: str, fmt: CaptionsFormat) -> Iterator[tuple[int, Any]]:
    with file.open(newline="", encoding="utf-8-sig", errors="surrogateescape") as f:
        reader = csv.reader(f, delimiter=sep)
        header = next(reader, None)
        if header is not None and (bad := _undecodable(sep.join(header))):
            raise ValueError(f"{file}, line 1: header {bad}.")
        needed = [fmt.image_column, fmt.caption_column]
        if header is None or any(c not in header for c in needed):
            raise ValueError(
                f"{file}, line 1: header {header} lacks column(s) "
                f"{[c for c in needed if c not in (header or [])]}; set image_column/"
                f"caption_column, or the separator (now {sep!r})."
            )
        while True:
            try:
                row = next(reader)
            except StopIteration:
                return
            except csv.Error as err:  # e.g. a field over csv.field_size_limit(); parser resets
                yield reader.line_num, f"unreadable CSV ({err})"
                continue
            if not any(field.strip() for field in row):
                continue
            if bad := _undecodable(sep.join(row)):
                yield reader.line_num, bad
            elif len(row) != len(header):
                yield reader.line_num, f"{len(row)} fields where the header has {len(header)}"
            else:
                yield reader.line_num, dict(zip(header, row, strict=True))


def _jsonl_records(file: Path) -> Iterator[tuple[int, Any]]:
    with file.open(encoding="utf-8-sig", errors="surrogateescape") as f:
        for number, text in enumerate(f, start=1):
            if not text.strip():
                continue
            if bad := _undecodable(text):
                yield number, bad
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as err:
                yield number, f"invalid JSON ({err.msg} at column {err.colno})"
                continue
            yield number, record if isinstance(record, dict) else "not a JSON object"


def _check(record: Any, fmt: CaptionsFormat, root: Path, verify: bool) -> CaptionRow | str:
    """The row, or the reason it cannot be used."""
    if isinstance(record, str):
        return f"malformed row: {record}"
    path, caption = record.get(fmt.image_column), record.get(fmt.caption_column)
    for name, value in ((fmt.image_column, path), (fmt.caption_column, caption)):
        if not isinstance(value, str) or not value.strip():
            return f"malformed row: {name!r} is missing or empty (got {value!r})"
    full = Path(path)
    full = full if full.is_absolute() else root / full
    if not full.is_file():
        return f"missing image {path!r} (looked for {full})"
    if verify:
        try:
            with Image.open(full) as img:
                img.verify()
        except Exception as err:
            return f"unreadable image {path!r} ({type(err).__name__}: {err})"
    return CaptionRow(path=full, caption=caption.strip(), line=0)


def index_captions(
    file: str | Path,
    *,
    fmt: CaptionsFormat | None = None,
    on_error: OnError = "raise",
    verify_images: bool = True,
) -> tuple[list[CaptionRow], list[SkippedRow]]:
    """Parse and check every row of ``file``; return the usable rows and the skipped ones."""
    file, fmt = Path(file), fmt or CaptionsFormat()
    _check_config("index_captions", on_error)
    if not file.is_file():
        raise ValueError(f"caption file {file} does not exist; check the path.")
    kind, sep, root = fmt.resolve(file)
    records = _jsonl_records(file) if kind == "jsonl" else _csv_records(file, sep, fmt)
    rows: list[CaptionRow] = []
    skipped: list[SkippedRow] = []
    for line, record in records:
        checked = _check(record, fmt, root, verify_images)
        if isinstance(checked, CaptionRow):
            rows.append(CaptionRow(path=checked.path, caption=checked.caption, line=line))
        elif on_error == "raise":
            raise ValueError(
                f"{file}, line {line}: {checked}; fix or remove the row, or pass "
                "on_error='skip' to leave such rows out."
            )
        else:
            skipped.append(SkippedRow(file=str(file), line=line, reason=checked))
    if skipped:
        shown = "; ".join(f"line {s.line}: {s.reason}" for s in skipped[:3])
        total = len(rows) + len(skipped)
        log.warning("%s: skipped %d of %d rows (%s ...)", file, len(skipped), total, shown)
    return rows, skipped


def clip_transform(image_size: int) -> Callable[[Image.Image], torch.Tensor]:
    """Resize (bicubic) the short side, centre-crop, CLIP-normalise; RGB ``[3, S, S]``."""
    return T.Compose(
        [
            T.Resize(image_size, interpolation=T.InterpolationMode.BICUBIC),
            T.CenterCrop(image_size),
            T.ToTensor(),
            T.Normalize(CLIP_MEAN, CLIP_STD),
        ]
    )


class CaptionsDataset(Dataset[dict[str, torch.Tensor]]):
    """Images and tokenised captions of one file (items as in :class:`DigitsCaptions` batches,
    without ``labels``).

    Args:
        file: CSV/TSV or JSONL caption file.
        tokenizer: None builds a :class:`WordTokenizer` from this file's captions.
        image_size: side S of the square images (>= 1).
        max_length: token length T of ``input_ids`` (>= 2: ``<bos>`` and ``<eos>``).
        fmt: columns, separator, format and image root.
        on_error: ``"raise"`` at the first bad row, or ``"skip"`` and count (``skipped``).
        verify_images: open every image with PIL while indexing (catches unreadable files).
        transform: image transform; None is :func:`clip_transform`.

    Raises:
        ValueError: bad configuration (before any file is read), a bad row (file, line, fix).
    """

    def __init__(
        self,
        file: str | Path,
        *,
        tokenizer: WordTokenizer | None = None,
        image_size: int = 224,
        max_length: int = 32,
        fmt: CaptionsFormat | None = None,
        on_error: OnError = "raise",
        verify_images: bool = True,
        transform: Callable[[Image.Image], torch.Tensor] | None = None,
    ) -> None:
        _check_config("CaptionsDataset", on_error, image_size=image_size, max_length=max_length)
        self.file, self.on_error, self.max_length = Path(file), on_error, max_length
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
            return {"images": image, **{k: v[0] for k, v in text.items()}}
        raise ValueError(f"{self.file}: no image of the {len(self.rows)} rows could be read.")


class CaptionsDataModule(pl.LightningDataModule):
    """Train (and optional validation) caption files as a LightningDataModule.

    The tokenizer is loaded from ``tokenizer_dir`` or built from the training captions in
    :meth:`setup`; it travels in checkpoints (:meth:`state_dict`). Skipped rows are logged
    and counted in :attr:`num_skipped`. Arguments as in :class:`CaptionsDataset` and
    :class:`CaptionsFormat`; ``min_count``/``max_vocab`` shape a built vocabulary.
    """

    def __init__(
        self,
        *,
        train_file: str,
        val_file: str | None = None,
        image_column: str = "filepath",
        caption_column: str = "title",
        separator: str | None = None,
        file_format: Literal["csv", "jsonl"] | None = None,
        image_root: str | None = None,
        image_size: int = 224,
        max_length: int = 32,
        batch_size: int = 32,
        num_workers: int = 0,
        on_error: OnError = "raise",
        verify_images: bool = True,
        tokenizer_dir: str | None = None,
        min_count: int = 1,
        max_vocab: int | None = None,
    ) -> None:
        super().__init__()
        fields = {k: v for k, v in locals().items() if k in _LIMITS and v is not None}
        _check_config("CaptionsDataModule", on_error, **fields)
        self.files = {"train": train_file, "val": val_file}
        self.fmt = CaptionsFormat(
            image_column=image_column,
            caption_column=caption_column,
            separator=separator,
            file_format=file_format,
            image_root=image_root,
        )
        self.image_size, self.max_length, self.batch_size = image_size, max_length, batch_size
        self.num_workers, self.on_error, self.verify_images = num_workers, on_error, verify_images
        self.min_count, self.max_vocab = min_count, max_vocab
        self.tokenizer = WordTokenizer.load(tokenizer_dir) if tokenizer_dir else None
        self.datasets: dict[str, CaptionsDataset] = {}

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
            )
            if self.tokenizer is None:  # the train split comes first and fixes the vocabulary
                self.tokenizer = WordTokenizer.build(
                    dataset.captions, min_count=self.min_count, max_size=self.max_vocab
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
            sampler=ResumableRandomSampler(dataset) if train else None,
            drop_last=train,
            num_workers=self.num_workers,
        )

    def train_dataloader(self) -> DataLoader[dict[str, torch.Tensor]]:
        """Shuffled, last partial batch dropped (equal batches on every dp rank)."""
        return self._loader("train", True)

    def val_dataloader(self) -> DataLoader[dict[str, torch.Tensor]]:
        """The validation file in order."""
        return self._loader("val", False)

    def state_dict(self) -> dict[str, Any]:
        """Carried by Lightning checkpoints: the tokenizer."""
        return {"tokenizer": self.tokenizer.to_dict() if self.tokenizer else None}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the tokenizer saved in a checkpoint."""
        if state_dict.get("tokenizer") is not None:
            self.tokenizer = WordTokenizer.from_dict(state_dict["tokenizer"], source="checkpoint")
