"""LLaVA-format conversations: the JSON reader (0, 1, 2 images; text-only), labels on the
assistant turns only (plain format and a chat template), bad input named, WebDataset shards
with several images per sample, and the data module's padded and packed batches."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from PIL import Image

from lightning_mmpar.data import ConversationDataModule
from lightning_mmpar.data.chat import ChatEncoder, image_token_id
from lightning_mmpar.data.conversations import word_tokenizer_for
from lightning_mmpar.data.llava import parse_record, read_conversations
from lightning_mmpar.data.tokenizer import IGNORE_INDEX
from tests.builders import word_level_tokenizer

RECORDS: list[dict[str, Any]] = [
    {
        "id": "two",
        "image": ["a.png", "b.png"],
        "conversations": [
            {"from": "human", "value": "<image>\n<image>\nwhat differs between them?"},
            {"from": "gpt", "value": "the colour"},
        ],
    },
    {
        "id": "one",
        "image": "a.png",
        "conversations": [
            {"from": "human", "value": "<image>\nwhat colour is it?"},
            {"from": "gpt", "value": "red"},
            {"from": "human", "value": "are you sure?"},
            {"from": "gpt", "value": "yes it is red"},
        ],
    },
    {
        "id": "text",
        "conversations": [
            {"from": "human", "value": "what is two plus three?"},
            {"from": "gpt", "value": "five"},
        ],
    },
]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> "
    "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def _write(tmp: Path, records: list[dict[str, Any]] = RECORDS) -> Path:
    for name, colour in (("a.png", "red"), ("b.png", "blue")):
        Image.new("RGB", (12, 10), colour).save(tmp / name)
    path = tmp / "data.json"
    path.write_text(json.dumps(records))
    return path


def _targets(tok: Any, ids: torch.Tensor, labels: torch.Tensor) -> list[str]:
    """The decoded runs of consecutive target positions."""
    runs: list[list[int]] = []
    for t, (i, lab) in enumerate(zip(ids.tolist(), labels.tolist(), strict=True)):
        if lab != IGNORE_INDEX:
            assert lab == i
            if not runs or labels[t - 1] == IGNORE_INDEX:
                runs.append([])
            runs[-1].append(i)
    return [" ".join(tok.vocab[i] for i in run) for run in runs]


def test_reader_images_markers_and_plain_labels(tmp_path: Path) -> None:
    module = ConversationDataModule(
        train_file=str(_write(tmp_path)), image_root=str(tmp_path), image_size=16
    )
    data = module.dataset("train")
    tok = module.tokenizer
    assert isinstance(tok, object) and module.image_token_id == tok.vocab.index("<image>")
    samples = {s["id"]: s for s in (data[i] for i in range(len(data)))}
    assert {k: tuple(s["pixel_values"].shape) for k, s in samples.items()} == {
        "two": (2, 3, 16, 16),
        "one": (1, 3, 16, 16),
        "text": (0, 3, 16, 16),
    }
    for sample in samples.values():  # one marker per image; markers are never targets
        marker = sample["input_ids"] == module.image_token_id
        assert int(marker.sum()) == sample["pixel_values"].shape[0]
        assert (sample["labels"][marker] == IGNORE_INDEX).all()
    one = samples["one"]  # the assistant turns (+ <eos>) only, the user turns never
    assert _targets(tok, one["input_ids"], one["labels"]) == ["red <eos>", "yes it is red <eos>"]
    assert (
        tok.decode(one["input_ids"])
        == "<image> what colour is it ? red are you sure ? yes it is red"
    )
    text = samples["text"]
    assert _targets(tok, text["input_ids"], text["labels"]) == ["five <eos>"]


def _hf_tokenizer(path: Path, words: list[str], template: str | None) -> Path:
    special = ["<pad>", "<s>", "</s>", "<unk>", "<image>", "<|user|>", "<|assistant|>", "<|end|>"]
    word_level_tokenizer(path, [*special, *words], special[4:], template)
    return path


WORDS = "what differs between them ? the colour is it red are you sure yes two plus three five"


def test_chat_template_labels_only_the_assistant_turns(tmp_path: Path) -> None:
    tok_dir = _hf_tokenizer(tmp_path / "tok", WORDS.split(), TEMPLATE)
    module = ConversationDataModule(
        train_file=str(_write(tmp_path)),
        image_root=str(tmp_path),
        image_size=16,
        tokenizer=str(tok_dir),
    )
    data = module.dataset("train")
    hf = module.tokenizer.tokenizer  # type: ignore[union-attr]
    one = data[1]
    ids, labels = one["input_ids"], one["labels"]
    # the whole sequence is the template's rendering, markers as the image token
    rendered = hf.apply_chat_template(
        [
            {"role": "user" if t["from"] == "human" else "assistant", "content": t["value"]}
            for t in RECORDS[1]["conversations"]
        ],
        tokenize=False,
    )
    assert ids.tolist() == hf(rendered, add_special_tokens=False)["input_ids"]
    runs, run = [], []
    for i, lab in zip(ids.tolist(), labels.tolist(), strict=True):
        if lab != IGNORE_INDEX:
            run.append(i)
        elif run:
            runs.append(hf.decode(run))
            run = []
    runs += [hf.decode(run)] if run else []
    assert runs == ["red <|end|>", "yes it is red <|end|>"]  # answers + end of turn, no prompt
    assert module.image_token_id == hf.convert_tokens_to_ids("<image>") == ids[2]
    # use_chat_template=False: the plain format (<s> ... </s>) with the same tokenizer
    plain = ChatEncoder(module.tokenizer, use_template=False)
    ids2, labels2 = plain(parse_record(RECORDS[2], "r").turns)
    assert hf.convert_ids_to_tokens(ids2[labels2 != IGNORE_INDEX]) == ["five", "</s>"]
    assert ids2[0] == hf.bos_token_id


def test_json_lines_read_like_a_list(tmp_path: Path) -> None:
    lines = tmp_path / "data.jsonl"
    lines.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n")
    assert read_conversations(lines) == read_conversations(_write(tmp_path))
    assert [r.images for r in read_conversations(lines)] == [("a.png", "b.png"), ("a.png",), ()]


def test_bad_input_is_named(tmp_path: Path) -> None:
    bad = json.loads(json.dumps(RECORDS))
    bad[0]["conversations"][0]["value"] = "<image>\nwhat differs?"  # 1 marker, 2 images
    with pytest.raises(ValueError, match=r"sample 'two' .*1 <image> markers but 2 images"):
        read_conversations(_write(tmp_path, bad))
    missing = json.loads(json.dumps(RECORDS))
    missing[1]["image"] = "gone.png"
    module = ConversationDataModule(
        train_file=str(_write(tmp_path, missing)), image_root=str(tmp_path), image_size=16
    )
    with pytest.raises(ValueError, match=r"sample 'one': image '.*gone\.png' is missing"):
        module.dataset("train")[1]
    (tmp_path / "a.png").write_bytes(b"not a png")
    with pytest.raises(ValueError, match=r"sample 'two': image '.*a\.png' is unreadable"):
        module.dataset("train")[0]
    with pytest.raises(ValueError, match=r"sample 'x': turn 'from' 'bot'"):
        ChatEncoder(word_tokenizer_for(["hi"]))([("bot", "hi")], "x")
    with pytest.raises(ValueError, match="no image token '<img>'"):
        image_token_id(word_tokenizer_for(["hi"]), "<img>")
    with pytest.raises(ValueError, match="exactly one"):
        ConversationDataModule(image_size=16)


def test_collator_refuses_markers_that_do_not_match_the_images(tmp_path: Path) -> None:
    module = ConversationDataModule(
        train_file=str(_write(tmp_path)), image_root=str(tmp_path), image_size=16
    )
    sample = dict(module.dataset("train")[0])
    sample["pixel_values"] = sample["pixel_values"][:1]
    with pytest.raises(ValueError, match=r"sample 'two' has 2 image marker.*but 1 image"):
        module.collator()([sample])


def test_batches_padded_and_packed(tmp_path: Path) -> None:
    path = _write(tmp_path, RECORDS * 4)
    batches = {}
    for pack in (False, True):
        module = ConversationDataModule(
            train_file=str(path),
            image_root=str(tmp_path),
            image_size=16,
            batch_size=6,
            pack=pack,
            max_tokens=64,
            val_fraction=0.25,
        )
        module.setup("fit")
        assert (len(module.datasets["train"]), len(module.datasets["val"])) == (9, 3)
        batches[pack] = next(iter(module.train_dataloader()))
    padded, packed = batches[False], batches[True]
    assert padded["input_ids"].shape[0] == 6 and packed["input_ids"].shape[0] < 6
    assert packed["input_ids"].shape[1] <= 64
    tokens = {k: int((b["sample_ids"] >= 0).sum()) for k, b in batches.items()}
    assert tokens[False] == tokens[True]  # the same samples, fewer pad positions
    assert padded["image_mask"].sum() == packed["image_mask"].sum()
    assert packed["sample_ids"].max() >= 1  # at least one row holds two samples
    module = ConversationDataModule(
        train_file=str(path),
        image_root=str(tmp_path),
        image_size=16,
        batch_size=6,
        pack=True,
        max_tokens=64,
        val_fraction=0.25,
        rows_multiple=4,  # a pipeline's micro_batches: empty rows make up the rest
    )
    module.setup("fit")
    rows = next(iter(module.train_dataloader()))
    n = packed["input_ids"].shape[0]
    assert rows["input_ids"].shape[0] == 4 * -(-n // 4) > n
    for key, value in packed.items():
        assert torch.equal(rows[key][:n], value), key
    empty = {k: v[n:] for k, v in rows.items()}
    assert (empty["sample_ids"] == -1).all() and (empty["labels"] == IGNORE_INDEX).all()
    assert (empty["input_ids"] == module.pad_token_id).all() and not empty["image_mask"].any()


class _Counting(LightningModule):
    """One weight trained on the rows' token counts; counts the validation batches."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(()))
        self.val_batches = 0

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.w * (batch["sample_ids"] >= 0).float().mean()

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.val_batches += 1

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize(("val_fraction", "val_batches"), [(0.0, 0), (0.25, 1)])
def test_val_fraction_zero_trains_without_validation(
    tmp_path: Path, val_fraction: float, val_batches: int
) -> None:
    """``val_fraction: 0`` (no val file) is no validation: the loader is ``[]`` and fit
    skips the loop; it raised ``no val data`` at the first validation before."""
    module = ConversationDataModule(
        train_file=str(_write(tmp_path, RECORDS * 4)),
        image_root=str(tmp_path),
        image_size=16,
        batch_size=3,
        max_tokens=64,
        pack=True,
        val_fraction=val_fraction,
    )
    model = _Counting()
    trainer = Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, datamodule=module)
    assert trainer.global_step == len(module.datasets["train"]) // 3
    assert model.val_batches == val_batches
    assert (module.val_dataloader() == []) == (val_fraction == 0)


def _shard(path: Path, samples: list[tuple[str, dict[str, Any], list[str]]]) -> None:
    with tarfile.open(path, "w") as tar:
        for key, record, colours in samples:
            files = {f"{key}.json": json.dumps(record).encode()}
            for n, colour in enumerate(colours):
                buf = io.BytesIO()
                Image.new("RGB", (8, 8), colour).save(buf, format="PNG")
                files[f"{key}.{n}.png"] = buf.getvalue()
            for name, data in files.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def test_webdataset_shards_with_several_images(tmp_path: Path) -> None:
    conv = {k: [dict(t) for t in r["conversations"]] for k, r in ((r["id"], r) for r in RECORDS)}
    _shard(
        tmp_path / "s-0.tar",
        [
            ("k2", {"conversations": conv["two"]}, ["red", "blue"]),
            ("k0", {"conversations": conv["text"]}, []),
        ],
    )
    _shard(
        tmp_path / "s-1.tar",
        [
            ("k1", {"id": "one", "conversations": conv["one"]}, ["red"]),
            ("kb", {"conversations": conv["one"]}, ["red", "red"]),
        ],
    )
    module = ConversationDataModule(
        train_shards=str(tmp_path / "s-{0..1}.tar"), image_size=16, batch_size=1, on_error="skip"
    )
    module.setup("fit")
    data = module.datasets["train"]
    data.shuffle = False
    samples = list(iter(data))
    assert [s["id"] for s in samples] == ["k2", "k0", "one", "k2"]  # kb skipped, k2 stands in
    assert [s["pixel_values"].shape[0] for s in samples] == [2, 0, 1, 2]
    red, blue = samples[0]["pixel_values"][:, 0, 0, 0].tolist()
    assert red != blue  # the images in order: .0 then .1
    strict = ConversationDataModule(train_shards=str(tmp_path / "s-1.tar"), image_size=16)
    strict.setup("fit")
    strict.datasets["train"].shuffle = False
    with pytest.raises(ValueError, match=r"s-1\.tar, sample 'kb'.*1 <image> markers but 2 images"):
        list(iter(strict.datasets["train"]))
    batch = next(iter(module.train_dataloader()))
    assert batch["pixel_values"].ndim == 5 and batch["input_ids"].shape[0] == 1
