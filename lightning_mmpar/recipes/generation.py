"""Greedy captioning: a KV-cached token loop for every layout, and the uncached reference.

:func:`cached_greedy_decode` (the default of :meth:`CaptionGeneration.generate`) computes the
image side once and one new token per step (:mod:`lightning_mmpar.models.decoding`: the ViT,
projector and image keys at the prefill, then per token the adapters, the decoder layers against
their key/value caches and the LM head). Without a pipeline it runs this rank's blocks; under
pipeline parallelism each rank runs its stages in order on the whole batch
(:meth:`~lightning_mmpar.parallel.pipeline.PipelineEngine.run_in_order`: the prefill's stage
boundaries carry the image tokens, later ones the new token's hidden state), and the last
stage's tokens are broadcast to its pipeline peers. FSDP2 blocks are gathered around each call.

:func:`greedy_decode` is the uncached loop (``use_cache=False``, and the reference the cached one
equals token for token): step ``t`` feeds ``ids[:, :t]`` (right-padded, its attention mask
covering the prefix) through every block (under a pipeline: one forward-only schedule) and reads
the logits at position ``t - 1``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_mmpar.models.decoding import DecodeCache, check_cacheable, decode_block
from lightning_mmpar.models.fusion import FusionModel
from lightning_mmpar.recipes import parallel_env as penv
from lightning_mmpar.recipes.answers import answer_accuracy, greedy_answers
from lightning_mmpar.recipes.evaluation import named_digit
from lightning_mmpar.trainer_topology import TrainerTopology

__all__ = [
    "CachedStep",
    "CaptionGeneration",
    "NextToken",
    "cached_greedy_decode",
    "greedy_decode",
    "next_tokens",
]

NextToken = Callable[[dict[str, Tensor], int], Tensor]
"""``next_token(step_batch, position) -> [B]`` token ids (any device)."""

CachedStep = Callable[[Tensor], Tensor]
"""``step(new_ids [B, S]) -> [B]`` the next token after the cached prefix plus ``new_ids``."""


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


def cached_greedy_decode(step: CachedStep, like: Tensor, *, bos: int, eos: int, pad: int) -> Tensor:
    """Greedy captions ``[B, L]`` from ``<bos>`` (``like [B, L]`` gives shape and device),
    feeding ``step`` one token per call (the previous one; ``<bos>`` first) and keeping the
    rest in ``step``'s cache. Rows that produced ``<eos>`` are padded from then on (they still
    feed tokens, which no other row sees). Always ``L - 1`` calls, on every rank alike."""
    ids = torch.full_like(like, pad)
    ids[:, 0] = bos
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    for t in range(1, ids.shape[1]):
        nxt = step(ids[:, t - 1 : t]).to(ids.device)
        ids[:, t] = torch.where(done, pad, nxt)
        done |= ids[:, t] == eos
    return ids


@contextmanager
def _gathered(block: nn.Module) -> Iterator[None]:
    """``block``'s FSDP2 units unsharded (decoding calls its submodules directly, past the
    forward hooks that would gather them); a no-op without FSDP."""
    units = [m for m in block.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()


class CaptionGeneration:
    """Greedy captioning, prediction and caption accuracy of the recipe's LightningModule
    (mixed in before ``LightningModule``; uses its blocks, tokenizer, digit classes and, under
    pipeline parallelism, the strategy's pipeline in decode mode)."""

    _decode_position: int | None
    _decoded: list[Tensor]

    @torch.no_grad()
    def generate(
        self: Any, images: Tensor, max_length: int, use_cache: bool | None = None
    ) -> Tensor:
        """Greedy captions ``[B, max_length]`` (token ids) of ``images [B, 3, H, W]`` from
        ``<bos>``, at any layout (under pipeline parallelism every pipeline rank calls it).

        ``use_cache``: ``None`` (default) decodes with the key/value cache when the model allows
        it (:meth:`cache_refusal`), ``True`` requires it, ``False`` recomputes the whole prefix
        per token (:func:`greedy_decode`). Both give the same tokens.

        Raises:
            ValueError: ``use_cache=True`` for a model the cache does not support (the reason).
        """
        ids = torch.zeros(images.shape[0], max_length, dtype=torch.long, device=images.device)
        return self._greedy({"images": images, "input_ids": ids}, use_cache)

    def cache_refusal(self: Any) -> str | None:
        """Why this module cannot decode with a key/value cache (``None``: it can)."""
        if self.training:
            return "training mode (dropout); call eval() first"
        if self.plan_options.sequence_parallel and TrainerTopology.of(self._trainer).dims.tp > 1:
            return "sequence_parallel shards the text positions (one new token cannot be split)"
        return check_cacheable(list(self.blocks or []))

    def _greedy(self: Any, batch: dict[str, Tensor], use_cache: bool | None = None) -> Tensor:
        """Greedy captions of ``batch``'s images (its ``input_ids`` give the shape).

        Raises:
            ValueError: ``use_cache=True`` where a cache is not supported.
        """
        tok = self._tokenizer
        bos, eos, pad = (tok.bos_id, tok.eos_id, tok.pad_id) if tok else (1, 2, 0)
        pipelined = TrainerTopology.of(self._trainer).dims.pp > 1
        reason = self.cache_refusal() if use_cache is not False else None
        if use_cache and reason:
            raise ValueError(
                f"use_cache=True: cached decoding does not support {reason}; use use_cache=None "
                "(cache when supported) or use_cache=False."
            )
        if use_cache is False or reason:
            step = self._pipelined_next_token if pipelined else self._local_next_token
            return greedy_decode(step, batch, bos=bos, eos=eos, pad=pad)
        cached = self._cached_step(batch["images"], pipelined)
        return cached_greedy_decode(cached, batch["input_ids"], bos=bos, eos=eos, pad=pad)

    def _cached_step(self: Any, images: Tensor, pipelined: bool) -> CachedStep:
        """One cached decode step over this rank's blocks (stages in order under a pipeline)."""
        blocks, cache = self.pipeline_blocks(), DecodeCache()
        engine = TrainerTopology.of(self.trainer).engine if pipelined else None
        ranges = engine.stage_ranges if engine is not None else [range(len(blocks))]

        def step(new: Tensor) -> Tensor:
            def run(s: int, state: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
                for i in ranges[s]:
                    with _gathered(blocks[i]):
                        state = decode_block(blocks[i], state, new, cache)
                return state

            first = (images,) if cache.steps == 0 else ()
            out = run(0, first) if engine is None else engine.run_in_order(first, run)
            cache.advance(new.shape[1])
            if engine is None:
                return next_tokens(out[0], -1, self.vocab_size)
            owner = out is not None
            b = new.shape[0]
            nxt = (
                next_tokens(out[0], -1, self.vocab_size)
                if out
                else torch.zeros(b, dtype=torch.long)
            )
            return penv.from_last_stage(self.trainer, nxt.to(new.device), owner)

        return step

    @torch.no_grad()
    def answer_accuracy(self: Any, data: Any, split: str = "val", chunk: int = 8) -> float | None:
        """Exact match of the greedy answers to ``data.prompts(split)`` (questions over 0..N
        images, e.g. :class:`~lightning_mmpar.data.DigitsVQA`), every rank decoding every
        prompt in step (:mod:`lightning_mmpar.recipes.answers`); ``chunk`` rows per batch (a
        multiple of the pipeline's micro-batches). ``None`` without prompts or a tokenizer."""
        if not callable(getattr(data, "prompts", None)) or self._tokenizer is None:
            return None
        was_training = self.training
        self.eval()
        pipelined = TrainerTopology.of(self._trainer).dims.pp > 1
        prompts = data.prompts(split)
        answers = greedy_answers(
            prompts,
            self._pipelined_next_token if pipelined else self._ragged_next_token,
            data.unpacked_collator(),
            decode=self._tokenizer.decode,
            eos=self._tokenizer.eos_id,
            device=self.device,
            chunk=chunk,
        )
        self.train(was_training)
        return answer_accuracy(prompts, answers)

    def _ragged_next_token(self: Any, step: dict[str, Tensor], position: int) -> Tensor:
        logits = self._run(FusionModel.ragged_inputs(step)).logits
        return next_tokens(logits, position, self.vocab_size)

    def _local_next_token(self: Any, step: dict[str, Tensor], position: int) -> Tensor:
        inputs = FusionModel.pipeline_inputs(
            step["images"], step["input_ids"], step["attention_mask"]
        )
        return next_tokens(self._run(inputs).logits, position, self.vocab_size)

    def _pipelined_next_token(self: Any, step: dict[str, Tensor], position: int) -> Tensor:
        """One forward-only schedule; the last stage picks the tokens (:meth:`pipeline_loss`
        in decode mode) and broadcasts them to its pipeline peers."""
        pipeline = TrainerTopology.of(self.trainer).engine
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
        """Fraction of images whose greedy caption names their digit first (dp-summed);
        ``None`` without a tokenizer, without batches or when the batches carry no ``labels``
        (a caption file without ``label_column``: nothing to score, nothing decoded).

        Batches are cast as the Trainer's precision casts a step's batch
        (``precision_plugin.convert_input``: bf16 images for the bf16 weights of DeepSpeed's
        bf16 engine or ``bf16-true``; unchanged under ``32-true`` and ``bf16-mixed``). Every
        rank of a run holds the same data module, so all of them skip, or all decode, alike.
        """
        batches = iter(dataloader)
        first = next(batches, None)
        if self._tokenizer is None or first is None or "labels" not in first:
            return None
        plugin = getattr(self._trainer, "precision_plugin", None)
        convert = plugin.convert_input if plugin is not None else (lambda data: data)
        was_training = self.training
        self.eval()
        hits = torch.zeros(2)
        for batch in itertools.chain([first], batches):
            step = convert({k: v.to(self.device) for k, v in batch.items() if k != "labels"})
            ids = self._greedy(step)
            named = torch.tensor([named_digit(r, self._digit_classes) for r in ids.tolist()])
            hits += torch.tensor([float((named == batch["labels"]).sum()), float(len(named))])
        self.train(was_training)
        hits = penv.dp_sum(self._trainer, hits)
        return float(hits[0] / hits[1].clamp(min=1))
