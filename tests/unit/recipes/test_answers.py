"""Greedy answers to ragged prompts: chunks of equal prompt length and fixed row count, every
chunk decoded for the same number of steps, answers cut at <eos>, exact-match accuracy."""

from __future__ import annotations

import pytest
import torch

from lightning_mmpar.data import DigitsVQA
from lightning_mmpar.recipes.answers import answer_accuracy, greedy_answers


def test_greedy_answers_of_an_oracle_and_a_broken_model() -> None:
    data = DigitsVQA(image_size=8, train_samples=4, val_samples=30, batch_size=4)
    prompts = data.prompts("val")
    tok = data.tokenizer
    truth = {p["id"]: tok.encode(p["answer"])[1:] for p in prompts}  # answer ids + <eos>
    calls: list[tuple[int, int, int]] = []

    def key(ids: list[int], pixels: torch.Tensor) -> tuple[tuple[int, ...], float]:
        return tuple(ids), round(float(pixels.sum()), 2)  # the question and its images

    by_prompt = {key(p["input_ids"].tolist(), p["pixel_values"]): truth[p["id"]] for p in prompts}

    def model(batch: dict[str, torch.Tensor], position: int) -> torch.Tensor:
        rows, length = batch["input_ids"].shape
        calls.append((rows, length, position))
        assert length == position + 1  # every row read at its last token
        out = []
        for r in range(rows):
            ids = batch["input_ids"][r].tolist()
            pixels = batch["pixel_values"][r][batch["image_mask"][r]]
            n = next(len(k) for k, _ in by_prompt if tuple(ids[: len(k)]) == k)
            answer = by_prompt[key(ids[:n], pixels)] + [tok.pad_id] * 8
            out.append(answer[len(ids) - n])
        return torch.tensor(out)

    collate = data.unpacked_collator()
    kwargs = {"decode": tok.decode, "eos": tok.eos_id, "device": torch.device("cpu")}
    answers = greedy_answers(prompts, model, collate, chunk=4, max_new_tokens=5, **kwargs)
    assert answers == [p["answer"] for p in prompts]
    assert answer_accuracy(prompts, answers) == 1.0
    lengths = {len(p["input_ids"]) for p in prompts}
    chunks = sum(-(-sum(len(p["input_ids"]) == n for p in prompts) // 4) for n in lengths)
    assert len(calls) == 5 * chunks and {rows for rows, _, _ in calls} == {4}

    def padded(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return collate(samples + samples[-1:] * (-len(samples) % 3))  # rows_multiple 3's rows

    got = greedy_answers(prompts, model, padded, chunk=4, max_new_tokens=5, **kwargs)
    assert got == answers and {rows for rows, _, _ in calls[-5:]} == {6}  # pad rows dropped
    wrong = greedy_answers(
        prompts,
        lambda b, p: torch.full((b["input_ids"].shape[0],), 7),
        collate,
        chunk=4,
        max_new_tokens=2,
        **kwargs,
    )
    assert answer_accuracy(prompts, wrong) == sum(p["answer"] == wrong[0] for p in prompts) / 30
    with pytest.raises(ValueError, match="chunk"):
        greedy_answers(prompts, model, collate, chunk=0, **kwargs)
