"""The digits question-answering task: 0..3 images per question, answers consistent with the
digits shown, targets on the answer only, prompts cut before the answer; exact-match accuracy."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from lightning_mmpar.data import DigitsVQA
from lightning_mmpar.data.tokenizer import IGNORE_INDEX
from lightning_mmpar.recipes.metrics import AnswerAccuracy


@pytest.fixture(scope="module")
def task() -> DigitsVQA:
    data = DigitsVQA(
        image_size=8, train_samples=200, val_samples=40, batch_size=8, pack=True, max_tokens=32
    )
    data.setup("fit")
    return data


def test_questions_answers_and_targets(task: DigitsVQA) -> None:
    from sklearn.datasets import load_digits

    digit_of = load_digits().target
    train = task.datasets["train"]
    kinds = Counter()
    tok = task.tokenizer
    for i, item in enumerate(train.items):
        sample = train[i]
        n = len(item.images)
        assert sample["pixel_values"].shape == (n, 3, 8, 8)
        assert int((sample["input_ids"] == task.image_token_id).sum()) == n
        target = sample["input_ids"][sample["labels"] != IGNORE_INDEX]
        assert tok.decode(target) == item.answer  # the answer (+ <eos>, dropped by decode)
        assert int(target[-1]) == tok.eos_id
        if item.question.startswith("which"):
            kinds["digits"] += 1
            assert item.answer == " ".join(str(digit_of[j]) for j in item.images)
        elif item.question.startswith("how many"):
            kinds["count"] += 1
            assert item.answer == str(n)
        else:
            kinds["plus"] += 1
            a, b = (int(w) for w in item.question.rstrip("?").split()[2::2])
            assert n == 0 and item.answer == str(a + b)
    assert set(Counter(len(it.images) for it in train.items)) == {0, 1, 2, 3}
    assert min(kinds.values()) > 5 and set(kinds) == {"digits", "count", "plus"}
    val_images = {j for it in task.datasets["val"].items for j in it.images}
    assert not val_images & {j for it in train.items for j in it.images}  # held-out digits


def test_prompts_stop_before_the_answer(task: DigitsVQA) -> None:
    prompts = task.prompts("val")
    assert len(prompts) == 40
    for p, sample in zip(prompts, task.datasets["val"], strict=True):
        n = len(p["input_ids"])
        assert torch.equal(p["input_ids"], sample["input_ids"][:n])
        assert (sample["labels"][:n] == IGNORE_INDEX).all() and sample["labels"][n] != IGNORE_INDEX
        assert task.tokenizer.decode(p["input_ids"]).endswith("?")
    batch = next(iter(task.train_dataloader()))
    assert batch["input_ids"].shape[0] < 8 and batch["pixel_values"].shape[2:] == (3, 8, 8)
    assert task.vocab_size == len(task.tokenizer.vocab)


def test_answer_accuracy_is_exact_match() -> None:
    acc = AnswerAccuracy()
    acc.update(["3 7", "2", " 1  4 "], ["3 7", "3", "1 4"])
    acc.update(["5"], ["15"])
    assert acc.compute().item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="2 predictions for 1 answers"):
        acc.update(["a", "b"], ["a"])


def test_recipe_yaml_data_section() -> None:
    """recipes/digits_vqa_cpu.yaml's data builds, and its packed batches split evenly into the
    strategy's pipeline micro-batches."""
    from pathlib import Path

    import yaml

    config = yaml.safe_load(
        (Path(__file__).resolve().parents[3] / "recipes" / "digits_vqa_cpu.yaml").read_text()
    )
    assert config["data"]["class_path"] == "lightning_mmpar.data.DigitsVQA"
    args = {**config["data"]["init_args"], "train_samples": 64, "val_samples": 8}
    data = DigitsVQA(**args)
    data.setup("fit")
    micro = config["trainer"]["strategy"]["init_args"]["micro_batches"]
    assert data.collate_args["pack"] and data.collate_args["rows_multiple"] == micro
    assert config["model"]["fusion"]["vision"]["image_size"] == data.image_size
    rows = [b["input_ids"].shape[0] for b in data.train_dataloader()]
    assert rows and all(r % micro == 0 for r in rows)
