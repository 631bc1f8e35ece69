"""Greedy captioning: one token loop for every layout.

The loop (:func:`greedy_decode`) owns the caption being written; a ``next_token`` function
returns the argmax token at one position of the model's logits for the current prefix. Without
a pipeline it runs the blocks on this rank; under pipeline parallelism it runs a forward-only
schedule and the last stage's tokens are broadcast to its pipeline peers. Both see the same
inputs: step ``t`` feeds ``ids[:, :t]`` (right-padded, its attention mask covering the prefix)
and reads the logits at position ``t - 1``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

__all__ = ["NextToken", "greedy_decode", "next_tokens"]

NextToken = Callable[[dict[str, Tensor], int], Tensor]
"""``next_token(step_batch, position) -> [B]`` token ids (any device)."""


def next_tokens(logits: Tensor, position: int, vocab_size: int) -> Tensor:
    """``[B]`` argmax of ``logits[:, position, :vocab_size]`` (padded vocabulary entries are
    never chosen); a vocab-sharded DTensor is gathered first (collective over its mesh)."""
    full = logits.full_tensor() if isinstance(logits, DTensor) else logits
    return full[:, position, :vocab_size].argmax(-1)


def greedy_decode(
    next_token: NextToken, batch: dict[str, Tensor], *, bos: int, eos: int, pad: int
) -> Tensor:
    """Greedy captions ``[B, L]`` from ``<bos>``, ``L = batch["input_ids"].shape[1]``.

    Each step hands ``next_token`` the batch with ``input_ids`` (and ``target_ids``) replaced by
    the caption so far and ``attention_mask`` covering its prefix; rows that produced ``<eos>``
    are padded from then on. Always runs ``L - 1`` steps, so every data-parallel rank calls
    FSDP's gathers, and every pipeline rank the schedule, the same number of times.
    """
    ids = torch.full_like(batch["input_ids"], pad)
    ids[:, 0] = bos
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    for t in range(1, ids.shape[1]):
        mask = torch.zeros_like(ids)
        mask[:, :t] = 1
        step = {**batch, "input_ids": ids, "attention_mask": mask, "target_ids": ids}
        nxt = next_token(step, t - 1).to(ids.device)
        ids[:, t] = torch.where(done, pad, nxt)
        done |= ids[:, t] == eos
    return ids
