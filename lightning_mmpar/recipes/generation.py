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
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_mmpar.models.fusion import FusionModel
from lightning_mmpar.recipes import parallel_env as penv
from lightning_mmpar.recipes.evaluation import named_digit

__all__ = ["CaptionGeneration", "NextToken", "greedy_decode", "next_tokens"]

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


class CaptionGeneration:
    """Greedy captioning, prediction and caption accuracy of the recipe's LightningModule
    (mixed in before ``LightningModule``; uses its blocks, tokenizer, digit classes and, under
    pipeline parallelism, the strategy's pipeline in decode mode)."""

    _decode_position: int | None
    _decoded: list[Tensor]

    @torch.no_grad()
    def generate(self: Any, images: Tensor, max_length: int) -> Tensor:
        """Greedy captions ``[B, max_length]`` from ``<bos>`` (pipeline_parallel 1 only)."""
        ids = torch.zeros(images.shape[0], max_length, dtype=torch.long, device=images.device)
        return self._greedy({"images": images, "input_ids": ids})

    def _greedy(self: Any, batch: dict[str, Tensor]) -> Tensor:
        """Greedy captions of ``batch``'s images (its ``input_ids`` give the shape), through the
        pipeline when the strategy runs one (batch size divisible by its micro-batches)."""
        tok = self._tokenizer
        bos, eos, pad = (tok.bos_id, tok.eos_id, tok.pad_id) if tok else (1, 2, 0)
        pipelined = penv.pipeline_parallel(self._trainer) > 1
        step = self._pipelined_next_token if pipelined else self._local_next_token
        return greedy_decode(step, batch, bos=bos, eos=eos, pad=pad)

    def _local_next_token(self: Any, step: dict[str, Tensor], position: int) -> Tensor:
        inputs = FusionModel.pipeline_inputs(
            step["images"], step["input_ids"], step["attention_mask"]
        )
        return next_tokens(self._run(inputs).logits, position, self.vocab_size)

    def _pipelined_next_token(self: Any, step: dict[str, Tensor], position: int) -> Tensor:
        """One forward-only schedule; the last stage picks the tokens (:meth:`pipeline_loss`
        in decode mode) and broadcasts them to its pipeline peers."""
        pipeline = self.trainer.strategy.pipeline  # type: ignore[attr-defined]
        self._decode_position, self._decoded = position, []
        try:
            pipeline.eval_step(step)
        finally:
            self._decode_position = None
        owner = self.head is not None
        b = step["input_ids"].shape[0]
        nxt = torch.cat(self._decoded) if owner else torch.zeros(b, dtype=torch.long)
        return penv.from_last_stage(self.trainer, nxt, owner)

    def predict_step(self: Any, batch: dict[str, Tensor], batch_idx: int) -> list[dict[str, Any]]:
        """Greedy captions of a batch of images, with the digit each names."""
        ids = self.generate(batch["images"], batch["input_ids"].shape[1])
        labels = batch.get("labels")
        rows = []
        for i, row in enumerate(ids.tolist()):
            caption = self._tokenizer.decode(row) if self._tokenizer else str(row)
            item: dict[str, Any] = {
                "caption": caption,
                "digit": named_digit(row, self._digit_classes),
            }
            if labels is not None:
                item["label"] = int(labels[i])
            rows.append(item)
        return rows

    @torch.no_grad()
    def generate_accuracy(self: Any, dataloader: Any) -> float | None:
        """Fraction of images whose greedy caption names their digit first (dp-summed)."""
        if self._tokenizer is None:
            return None
        was_training = self.training
        self.eval()
        hits = torch.zeros(2)
        for batch in dataloader:
            ids = self._greedy({k: v.to(self.device) for k, v in batch.items()})
            named = torch.tensor([named_digit(r, self._digit_classes) for r in ids.tolist()])
            hits += torch.tensor([float((named == batch["labels"]).sum()), float(len(named))])
        self.train(was_training)
        hits = penv.dp_sum(self._trainer, hits)
        return float(hits[0] / hits[1].clamp(min=1))
