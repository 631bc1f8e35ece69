"""Caption data faults (issue 15 item 10): bad bytes name file and line, ``on_error`` covers
every per-row fault, and configuration fields are refused as configuration before any file is
read."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from PIL import Image

from lightning_mmpar.data.captions import CaptionsDataModule, CaptionsDataset

LATIN1 = "caf\xe9 au lait".encode("latin-1")  # b"caf\xe9 ...": 0xe9 alone is not UTF-8


def _images(root: Path) -> None:
    for name, colour in {"red.png": (255, 0, 0), "green.png": (0, 255, 0)}.items():
        Image.new("RGB", (20, 12), colour).save(root / name)


def _write(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_undecodable_byte_in_csv_names_file_line_and_is_skippable(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _images(tmp_path)
    # Enough good rows before the bad one that a buffered decoder would fail before line 40.
    good = [b"red.png,a red square %d" % i for i in range(38)]
    file = _write(
        tmp_path / "train.csv",
        [b"filepath,title", *good, b"green.png," + LATIN1, b"green.png,a green one"],
    )
    with pytest.raises(
        ValueError, match=r"train.csv, line 40: .*byte 0xe9 at character 14 is not UTF-8"
    ) as e:
        CaptionsDataset(file)
    assert "on_error='skip'" in str(e.value) and "image" not in str(e.value)
    with caplog.at_level(logging.WARNING):
        ds = CaptionsDataset(file, on_error="skip")
    assert len(ds) == 39 and ds.captions[-1] == "a green one"
    assert ds.num_skipped == 1 and ds.skipped[0].line == 40
    assert "0xe9" in ds.skipped[0].reason
    assert "skipped 1 of 40 rows" in caplog.text


def test_undecodable_byte_in_jsonl_and_in_header(tmp_path: Path) -> None:
    _images(tmp_path)
    rows = [json.dumps({"filepath": "red.png", "title": t}).encode() for t in ("one", "two")]
    bad = b'{"filepath": "green.png", "title": "' + LATIN1 + b'"}'
    file = _write(tmp_path / "d.jsonl", [rows[0], bad, rows[1]])
    with pytest.raises(ValueError, match=r"d.jsonl, line 2: .*byte 0xe9 at character 40"):
        CaptionsDataset(file)
    ds = CaptionsDataset(file, on_error="skip")
    assert ds.captions == ["one", "two"] and [s.line for s in ds.skipped] == [2]
    # The header is not a row: it always raises, naming line 1, under either policy.
    header = _write(tmp_path / "h.csv", [b"filepath,t\xeftle", b"red.png,x"])
    with pytest.raises(ValueError, match=r"h.csv, line 1: header .*byte 0xef.*UTF-8"):
        CaptionsDataset(header, on_error="skip")


def test_csv_parser_errors_are_per_row_faults(tmp_path: Path) -> None:
    _images(tmp_path)
    huge = b'red.png,"' + b"y" * 200_000 + b'"'  # over csv's field size limit
    file = _write(tmp_path / "t.csv", [b"filepath,title", b"red.png,ok", huge, b"green.png,fine"])
    with pytest.raises(ValueError, match=r"t.csv, line 3: malformed row: .*field limit"):
        CaptionsDataset(file)
    ds = CaptionsDataset(file, on_error="skip")
    assert ds.captions == ["ok", "fine"] and [s.line for s in ds.skipped] == [3]


def test_utf8_bom_is_not_part_of_the_header(tmp_path: Path) -> None:
    _images(tmp_path)
    file = _write(tmp_path / "bom.csv", [b"\xef\xbb\xbffilepath,title", b"red.png,red"])
    assert CaptionsDataset(file).captions == ["red"]


CONFIG_CASES = [
    ({"image_size": 0}, r"image_size \(0\) must be an integer >= 1"),
    ({"image_size": -3}, r"image_size \(-3\) must be an integer >= 1"),
    ({"image_size": 2.5}, r"image_size \(2.5\) must be an integer >= 1"),
    ({"max_length": 0}, r"max_length \(0\) must be an integer >= 2"),
    ({"max_length": 1}, r"max_length \(1\) must be an integer >= 2"),
]


@pytest.mark.parametrize(("kwargs", "message"), CONFIG_CASES)
def test_dataset_config_refused_before_reading(
    tmp_path: Path, kwargs: dict[str, float], message: str
) -> None:
    # The file does not exist: the configuration error must come first, and never blame a row.
    with pytest.raises(ValueError, match=r"CaptionsDataset: " + message + r"; set it to") as e:
        CaptionsDataset(tmp_path / "absent.csv", **kwargs)  # type: ignore[arg-type]
    assert "row" not in str(e.value) and "absent.csv" not in str(e.value)


DM_CASES = [
    *CONFIG_CASES,
    ({"batch_size": 0}, r"batch_size \(0\) must be an integer >= 1"),
    ({"num_workers": -1}, r"num_workers \(-1\) must be an integer >= 0"),
    ({"max_vocab": 4}, r"max_vocab \(4\) must be an integer >= 5"),
]


@pytest.mark.parametrize(("kwargs", "message"), DM_CASES)
def test_datamodule_config_refused_at_construction(
    tmp_path: Path, kwargs: dict[str, float], message: str
) -> None:
    absent = str(tmp_path / "absent")
    with pytest.raises(ValueError, match=r"CaptionsDataModule: " + message + r"; set it to"):
        CaptionsDataModule(
            train_file=str(tmp_path / "x.csv"),
            tokenizer_dir=absent,  # never read: the configuration is checked first
            **kwargs,  # type: ignore[arg-type]
        )


def test_valid_small_config_still_loads(tmp_path: Path) -> None:
    _images(tmp_path)
    file = _write(tmp_path / "ok.csv", [b"filepath,title", b"red.png,red"])
    ds = CaptionsDataset(file, image_size=1, max_length=2)
    assert ds[0]["images"].shape == (3, 1, 1) and ds[0]["input_ids"].shape == (2,)
    dm = CaptionsDataModule(train_file=str(file), num_workers=0, max_vocab=5, batch_size=1)
    dm.setup()
    assert dm.tokenizer is not None and dm.tokenizer.vocab_size == 5
    assert dm.val_dataloader() == []  # no val_file: no validation (raised "no val data")
