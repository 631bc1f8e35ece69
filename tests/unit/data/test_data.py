"""Tokenizer, the offline digits data module and CSV/JSONL caption datasets."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from sklearn.datasets import load_digits

from lightning_mmpar.data.captions import (
    CLIP_MEAN,
    CLIP_STD,
    CaptionsDataModule,
    CaptionsDataset,
    CaptionsFormat,
)
from lightning_mmpar.data.digits import CLASS_NAMES, TEMPLATES, DigitsCaptions, fill
from lightning_mmpar.data.tokenizer import WordTokenizer
from lightning_mmpar.data.transforms import ImagePreprocess


def test_tokenizer_encode_pad_truncate_and_roundtrip(tmp_path: Path) -> None:
    tok = WordTokenizer.build(["a cat, a dog", "The cat"])
    assert tok.vocab == ["<pad>", "<bos>", "<eos>", "<unk>", "a", "cat", ",", "dog", "the"]
    assert tok.encode("A cat bird") == [1, 4, 5, 3, 2]
    assert tok.decode(tok.encode("the dog , a cat")) == "the dog , a cat"
    batch = tok(["a cat", "the cat, a dog"], max_length=5)
    assert batch["input_ids"].tolist() == [[1, 4, 5, 2, 0], [1, 8, 5, 6, 2]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert batch["target_ids"].tolist() == [[1, 4, 5, 2, -100], [1, 8, 5, 6, 2]]
    path = tok.save(tmp_path / "tok")
    assert path.name == "tokenizer.json"
    assert WordTokenizer.load(tmp_path / "tok") == tok
    assert WordTokenizer.build(["b a", "a"], max_size=5).vocab[4:] == ["a"]


def test_tokenizer_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"tokenizer file .*tokenizer.json does not exist"):
        WordTokenizer.load(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{oops")
    with pytest.raises(ValueError, match=r"tokenizer.json: invalid JSON at line 1"):
        WordTokenizer.load(tmp_path)
    with pytest.raises(ValueError, match=r"vocab must start with the special tokens"):
        WordTokenizer(vocab=["a", "b"])
    with pytest.raises(ValueError, match=r"max_length \(1\) must be >= 2"):
        WordTokenizer.build(["a"])(["a"], max_length=1)


@pytest.fixture(scope="module")
def digits() -> DigitsCaptions:
    dm = DigitsCaptions(image_size=16, batch_size=8, seed=3)
    dm.setup()
    return dm


def test_digits_batches_split_and_pixels(digits: DigitsCaptions) -> None:
    batch = next(iter(digits.train_dataloader()))
    assert batch["images"].shape == (8, 3, 16, 16) and batch["images"].dtype == torch.float32
    for key in ("input_ids", "attention_mask", "target_ids"):
        assert batch[key].shape == (8, digits.max_length) and batch[key].dtype == torch.long
    assert (batch["input_ids"][:, 0] == digits.tokenizer.bos_id).all()
    assert batch["labels"].shape == (8,)
    assert digits.train is not None and digits.val is not None
    assert (len(digits.train), len(digits.val)) == (1437, 360)
    assert set(digits.train.indices.tolist()).isdisjoint(digits.val.indices.tolist())
    assert abs(digits.train.images.mean().item()) < 1e-4
    assert digits.train.images.std().item() == pytest.approx(1.0, abs=1e-3)
    again = DigitsCaptions(image_size=8, seed=3)
    again.setup()
    assert again.train is not None and torch.equal(again.train.indices, digits.train.indices)
    # At image_size 8 upsampling is the identity: un-normalise and compare with sklearn.
    raw = torch.tensor(load_digits().images, dtype=torch.float32)[again.train.indices] / 16
    pix = again.train.images
    restored = pix * (raw.std() / pix.std()) + raw.mean() - pix.mean() * raw.std() / pix.std()
    torch.testing.assert_close(restored[:, 0], raw, atol=1e-4, rtol=0)
    torch.testing.assert_close(restored[:, 2], raw, atol=1e-4, rtol=0)
    torch.testing.assert_close(
        again.train.labels, torch.tensor(load_digits().target)[again.train.indices]
    )


def test_digits_captions_match_labels_and_hold_out_prompt(digits: DigitsCaptions) -> None:
    assert digits.train is not None
    prompts = {fill(TEMPLATES[-1], c) for c in range(10)}
    seen_templates: set[str] = set()
    for ids, label in zip(
        digits.train.text["input_ids"][:300], digits.train.labels[:300], strict=True
    ):
        caption = digits.tokenizer.decode(ids.tolist())
        assert caption not in prompts
        words = caption.split()
        assert CLASS_NAMES[label] in words or str(int(label)) in words
        seen_templates.update(t for t in TEMPLATES if fill(t, int(label)) == caption)
    assert len(seen_templates) == len(TEMPLATES) - 1
    class_prompts = digits.class_prompts()
    assert class_prompts["input_ids"].shape == (10, digits.max_length)
    decoded = [digits.tokenizer.decode(r.tolist()) for r in class_prompts["input_ids"]]
    assert decoded == [fill(TEMPLATES[-1], c) for c in range(10)]
    assert digits.tokenizer.unk_id not in class_prompts["input_ids"]


def test_digits_tokenizer_travels(digits: DigitsCaptions, tmp_path: Path) -> None:
    other = DigitsCaptions(templates=("{name} and {digit}", "x {name}"))
    other.load_state_dict(digits.state_dict())
    assert other.tokenizer == digits.tokenizer and other.max_length == digits.max_length
    digits.save_tokenizer(tmp_path)
    assert DigitsCaptions(tokenizer_dir=str(tmp_path)).tokenizer == digits.tokenizer


def test_digits_validation() -> None:
    with pytest.raises(ValueError, match=r"val_fraction \(1.5\) must be in \(0, 1\)"):
        DigitsCaptions(val_fraction=1.5)
    with pytest.raises(ValueError, match=r"prompt_template \(9\) must index templates"):
        DigitsCaptions(prompt_template=9)
    with pytest.raises(ValueError, match=r"template 'a digit' must contain"):
        DigitsCaptions(templates=("a digit", "a {name}"))
    with pytest.raises(ValueError, match=r"needs at least 2"):
        DigitsCaptions(templates=("a {name}",))


COLOURS = {"red.png": (255, 0, 0), "green.png": (0, 255, 0), "blue.jpg": (0, 0, 255)}


def _images(root: Path) -> None:
    for name, colour in COLOURS.items():
        Image.new("RGB", (20, 12), colour).save(root / name)
    (root / "broken.png").write_bytes(b"not an image at all")


def _csv(root: Path, lines: list[str], name: str = "train.csv") -> Path:
    path = root / name
    path.write_text("\n".join(lines) + "\n")
    return path


def test_csv_dataset_items(tmp_path: Path) -> None:
    _images(tmp_path)
    file = _csv(tmp_path, ["filepath,title", "red.png,a red square", "blue.jpg,a blue box"])
    ds = CaptionsDataset(file, image_size=8, max_length=6)
    assert len(ds) == 2 and ds.num_skipped == 0
    item = ds[0]
    assert item["images"].shape == (3, 8, 8)
    expected = [(1.0 - CLIP_MEAN[0]) / CLIP_STD[0], -CLIP_MEAN[1] / CLIP_STD[1]]
    torch.testing.assert_close(item["images"][0], torch.full((8, 8), expected[0]))
    torch.testing.assert_close(item["images"][1], torch.full((8, 8), expected[1]))
    assert ds.tokenizer.decode(item["input_ids"].tolist()) == "a red square"
    assert item["target_ids"][-1].item() == -100


def test_tsv_custom_columns_and_jsonl(tmp_path: Path) -> None:
    _images(tmp_path)
    sub = tmp_path / "sub"
    sub.mkdir()
    tsv = _csv(sub, ["text\timg", "a green thing\tgreen.png"], name="set.tsv")
    fmt = CaptionsFormat(image_column="img", caption_column="text", image_root=str(tmp_path))
    assert CaptionsDataset(tsv, fmt=fmt).captions == ["a green thing"]
    semi = _csv(tmp_path, ["filepath;title", "red.png;red, with a comma"], name="semi.csv")
    ds = CaptionsDataset(semi, fmt=CaptionsFormat(separator=";"))
    assert ds.captions == ["red, with a comma"]
    jsonl = tmp_path / "set.jsonl"
    rows = [{"filepath": "red.png", "title": "red"}, {"filepath": "green.png", "title": "green"}]
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert CaptionsDataset(jsonl).captions == ["red", "green"]


BAD_CASES = [
    ("missing.png,gone", r"train.csv, line 3: missing image 'missing.png'"),
    ("broken.png,broken", r"train.csv, line 3: unreadable image 'broken.png'"),
    ("red.png,too,many", r"train.csv, line 3: malformed row: 3 fields where the header has 2"),
    ("red.png,", r"train.csv, line 3: malformed row: 'title' is missing or empty"),
]


@pytest.mark.parametrize(("row", "message"), BAD_CASES)
def test_csv_errors_name_file_and_line(tmp_path: Path, row: str, message: str) -> None:
    _images(tmp_path)
    file = _csv(tmp_path, ["filepath,title", "red.png,fine", row, "green.png,fine too"])
    with pytest.raises(ValueError, match=message + r".*on_error='skip'"):
        CaptionsDataset(file)
    ds = CaptionsDataset(file, on_error="skip")
    assert ds.captions == ["fine", "fine too"] and ds.num_skipped == 1
    assert ds.skipped[0].line == 3


def test_jsonl_errors(tmp_path: Path) -> None:
    _images(tmp_path)
    lines = ['{"filepath": "red.png", "title": "ok"}', "{broken", "[1, 2]", '{"title": "x"}']
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"d.jsonl, line 2: malformed row: invalid JSON"):
        CaptionsDataset(tmp_path / "d.jsonl")
    ds = CaptionsDataset(tmp_path / "d.jsonl", on_error="skip")
    assert [s.line for s in ds.skipped] == [2, 3, 4]
    assert "not a JSON object" in ds.skipped[1].reason
    assert "'filepath' is missing" in ds.skipped[2].reason


def test_header_and_file_errors(tmp_path: Path) -> None:
    file = _csv(tmp_path, ["path,caption", "a.png,x"])
    with pytest.raises(ValueError, match=r"train.csv, line 1: header .* lacks column\(s\)"):
        CaptionsDataset(file)
    with pytest.raises(ValueError, match=r"caption file .*nope.csv does not exist"):
        CaptionsDataset(tmp_path / "nope.csv")
    with pytest.raises(ValueError, match=r"on_error \('ignore'\) must be"):
        CaptionsDataset(file, on_error="ignore")  # type: ignore[arg-type]


def test_load_time_failure_without_verification(tmp_path: Path) -> None:
    _images(tmp_path)
    file = _csv(tmp_path, ["filepath,title", "broken.png,bad", "red.png,red"])
    raising = CaptionsDataset(file, verify_images=False)
    with pytest.raises(ValueError, match=r"train.csv, line 2: unreadable image"):
        raising[0]
    skipping = CaptionsDataset(file, verify_images=False, on_error="skip")
    assert skipping.tokenizer.decode(skipping[0]["input_ids"].tolist()) == "red"
    assert skipping.num_skipped == 1


def test_datamodule_skips_reports_and_carries_tokenizer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _images(tmp_path)
    train = _csv(tmp_path, ["filepath,title", "red.png,red", "gone.png,x", "green.png,green"])
    val = _csv(tmp_path, ["filepath,title", "blue.jpg,blue"], name="val.csv")
    dm = CaptionsDataModule(
        train_file=str(train), val_file=str(val), image_size=8, batch_size=2, on_error="skip"
    )
    with caplog.at_level(logging.WARNING):
        dm.setup()
    assert dm.num_skipped == {"train": 1, "val": 0}
    assert "skipped 1 of 3 rows" in caplog.text
    batch = next(iter(dm.train_dataloader()))
    assert batch["images"].shape == (2, 3, 8, 8)
    assert dm.tokenizer is not None and dm.tokenizer.vocab[4:] == ["green", "red"]
    val_batch = next(iter(dm.val_dataloader()))
    assert dm.tokenizer.decode(val_batch["input_ids"][0].tolist()) == "<unk>"
    restored = CaptionsDataModule(train_file=str(train))
    restored.load_state_dict(dm.state_dict())
    assert restored.tokenizer == dm.tokenizer


def test_ignore_index_is_torch_cross_entropy_default() -> None:
    """``data`` defines the padding target itself (it imports no loss): torch's default."""
    from lightning_mmpar.data import IGNORE_INDEX

    assert IGNORE_INDEX == torch.nn.CrossEntropyLoss().ignore_index == -100
    batch = WordTokenizer.build(["a cat"])(["a cat", "a"], max_length=5)
    assert batch["target_ids"][1].tolist()[-2:] == [IGNORE_INDEX, IGNORE_INDEX]


def test_datamodule_labels_prompts_tokenizer_and_preprocess(tmp_path: Path) -> None:
    _images(tmp_path)
    lines = [
        "filepath,title,kind",
        "red.png,a red square,red",
        "blue.jpg,a blue box,1",
        "green.png,a green one,purple",
    ]
    train = _csv(tmp_path, lines)
    kw: dict[str, Any] = {"train_file": str(train), "image_size": 8, "max_length": 6}
    kw["batch_size"] = 2
    dm = CaptionsDataModule(
        **kw,
        label_column="kind",
        class_names=["red", "blue"],
        on_error="skip",
        prompt_template="a {name} thing",
        preprocess=ImagePreprocess(mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)),
    )
    assert dm.vocab_size == dm.tokenizer.vocab_size  # builds the tokenizer before setup
    assert "thing" in dm.tokenizer.vocab  # the prompts' words are in the vocabulary
    assert dm.num_skipped == {"train": 1}  # 'purple' is no class
    prompts = dm.class_prompts()
    assert dm.tokenizer.decode(prompts["input_ids"][1].tolist()) == "a blue thing"
    batch = next(iter(dm.train_dataloader()))
    assert sorted(batch["labels"].tolist()) == [0, 1]
    torch.testing.assert_close(
        batch["images"][:, 0].flatten().unique().sort().values, torch.tensor([-1.0, 1.0])
    )
    mine = WordTokenizer.build(["a red square"])
    other = CaptionsDataModule(**kw, tokenizer=mine)
    assert other.tokenizer is mine and other.class_prompts() == {}
    with pytest.raises(ValueError, match=r"class_names \(\['red'\]\) and label_column \(None\)"):
        CaptionsDataModule(**kw, class_names=["red"])
    with pytest.raises(ValueError, match=r"prompt_template \('a photo'\) must contain \{name\}"):
        CaptionsDataModule(
            **kw, class_names=["red"], label_column="kind", prompt_template="a photo"
        )
