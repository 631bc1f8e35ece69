"""Greedy answers to ragged prompts (questions over 0..N images) and their exact-match accuracy.

A prompt is a contract sample cut before its answer (``id``, ``input_ids``, ``labels``,
``pixel_values``) with the expected ``answer`` text (``DigitsVQA.prompts``). Prompts are decoded
in chunks of equal prompt length and a fixed row count (the last chunk of a length repeats its
last prompt), so every row's next token is read at the same position of a right-padded,
unpacked batch and every pipeline micro-batch has the same shapes. Each chunk runs
``max_new_tokens`` steps whatever the answers (the uncached loop of
:func:`~lightning_mmpar.recipes.generation.greedy_decode`: the whole sequence so far through
every block per step): every rank (tensor, pipeline and data-parallel peers alike) decodes every
prompt in the same order, so the collectives of every step line up and no rank waits on
another.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_mmpar.data.tokenizer import IGNORE_INDEX
from lightning_mmpar.recipes.metrics import AnswerAccuracy

__all__ = ["answer_accuracy", "greedy_answers"]

NextToken = Callable[[dict[str, Tensor], int], Tensor]
"""``next_token(batch, position) -> [B]`` the greedy token after ``position`` of every row."""


def _decode_chunk(
    rows: Sequence[Mapping[str, Any]],
    next_token: NextToken,
    collate: Callable[[list[dict[str, Any]]], dict[str, Tensor]],
    device: torch.device,
    max_new_tokens: int,
) -> list[list[int]]:
    """Generated ids of each row (equal prompt lengths), ``max_new_tokens`` steps; rows the
    collator adds to reach its ``rows_multiple`` (empty, after the prompts) are dropped."""
    length = len(rows[0]["input_ids"])
    out: list[list[int]] = [[] for _ in rows]
    for t in range(max_new_tokens):
        samples = []
        for row, new in zip(rows, out, strict=True):
            ids = torch.cat([row["input_ids"], torch.tensor(new, dtype=torch.long)])
            samples.append({**row, "input_ids": ids, "labels": torch.full_like(ids, IGNORE_INDEX)})
        batch = {k: v.to(device) for k, v in collate(samples).items()}
        nxt = next_token(batch, length + t - 1).tolist()[: len(rows)]  # rows_multiple's pad rows
        for generated, token in zip(out, nxt, strict=True):
            generated.append(int(token))
    return out


def greedy_answers(
    prompts: Sequence[Mapping[str, Any]],
    next_token: NextToken,
    collate: Callable[[list[dict[str, Any]]], dict[str, Tensor]],
    *,
    decode: Callable[[list[int]], str],
    eos: int,
    device: torch.device,
    max_new_tokens: int = 6,
    chunk: int = 8,
) -> list[str]:
    """The greedy answer text of every prompt (module docstring), cut at the first ``eos``.

    Args:
        prompts: samples cut before their answers (equal lengths are decoded together).
        next_token: the model's greedy next token of a collated batch at a position.
        collate: an unpacked collator (one prompt per row, right-padded).
        decode: token ids -> text; ``eos``: the end-of-answer id.
        max_new_tokens: decoding steps per chunk; ``chunk``: rows per batch (a multiple of
            the pipeline's micro-batches).

    Raises:
        ValueError: ``chunk`` or ``max_new_tokens`` < 1.
    """
    if chunk < 1 or max_new_tokens < 1:
        raise ValueError(f"chunk ({chunk}) and max_new_tokens ({max_new_tokens}) must be >= 1.")
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, p in enumerate(prompts):
        by_length[len(p["input_ids"])].append(i)
    answers = [""] * len(prompts)
    for _, indices in sorted(by_length.items()):
        for start in range(0, len(indices), chunk):
            part = indices[start : start + chunk]
            rows = [prompts[i] for i in part] + [prompts[part[-1]]] * (chunk - len(part))
            ids = _decode_chunk(rows, next_token, collate, device, max_new_tokens)
            for i, row in zip(part, ids, strict=False):
                answers[i] = decode(row[: row.index(eos)] if eos in row else row)
    return answers


def answer_accuracy(prompts: Sequence[Mapping[str, Any]], answers: Sequence[str]) -> float:
    """Exact-match accuracy of ``answers`` against the prompts' ``answer`` texts."""
    metric = AnswerAccuracy(sync_on_compute=False)
    metric.update(list(answers), [str(p["answer"]) for p in prompts])
    return float(metric.compute())
