"""Caption files: CSV/TSV (open_clip's ``filepath``/``title`` layout) or JSONL rows, checked.

Every row is checked when a file is indexed: a malformed row, a missing image or (with
``verify_images``) an image PIL cannot read raises a ``ValueError`` naming the file, the line and
the fix, or with ``on_error="skip"`` is left out, counted and reported (:class:`SkippedRow`).
"""

from __future__ import annotations

import csv
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from PIL import Image

from lightning_mmpar.data.text import parse_label
from lightning_mmpar.data.tokenizer import SPECIAL_TOKENS

log = logging.getLogger(__name__)
OnError = Literal["raise", "skip"]
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
    label_column: str | None = None
    """Column (CSV) or key (JSONL) of the class label (a class name or index); None: no labels."""
    class_names: tuple[str, ...] = ()
    """Class names (index = label) that ``label_column`` values are matched against."""

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
    label: int = -1
    """Class index (``label_column``), -1 without labels."""


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
        needed = [fmt.image_column, fmt.caption_column, *filter(None, [fmt.label_column])]
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
    label = -1
    if fmt.label_column is not None:
        parsed = parse_label(record.get(fmt.label_column, ""), fmt.class_names)
        if isinstance(parsed, str):
            return f"malformed row: {fmt.label_column!r}: {parsed}"
        label = parsed
    return CaptionRow(path=full, caption=caption.strip(), line=0, label=label)


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
            rows.append(replace(checked, line=line))
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
