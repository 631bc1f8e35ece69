"""Ragged multimodal batches: text with image markers and 0..N images per sample, packed.

A *sample* (what a dataset's ``__getitem__`` returns) is a dict::

    id            str: names the sample in errors
    input_ids     LongTensor [L]: text tokens; each image is ONE marker token image_token_id
    labels        LongTensor [L]: the tokens to predict (-100: no loss; prompt turns, markers)
    pixel_values  FloatTensor [I, C, H, W]: the sample's images in marker order, I >= 0

:class:`MultimodalCollator` turns a list of samples into one batch-first dict of tensors (so
micro-batching splits every tensor by row). With ``pack=True`` several samples share a row up to
``max_tokens`` (image tokens counted), with position ids restarting at 0 per sample and a
``sample_ids`` map from which the model builds block-diagonal causal attention (the packing of
torchtitan's multimodal sample packing, NeMo AutoModel's neat packing and Megatron's THD
format). The labels keep the unshifted convention of
:func:`lightning_mmpar.losses.caption.caption_loss` (logits at ``t`` are scored against
``labels[t + 1]``); the first token of every sample gets -100, so no sample is scored on the
first token of the next one.

Two fusion styles (``image_seq_length``): *spliced* (LLaVA, Qwen-VL; ``image_seq_length > 0``):
each marker is expanded into ``image_seq_length`` copies of ``image_token_id``, whose embeddings
the model replaces by the image's tokens (transformers' LlavaProcessor / ``masked_scatter``);
*cross-attention* (Flamingo; ``image_seq_length = 0``): the marker stays one token and text at
or after it attends to that image.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

__all__ = ["IGNORE_INDEX", "RAGGED_KEYS", "MultimodalCollator", "Overflow", "contrastive_pairs"]

IGNORE_INDEX = -100
"""Label value that contributes no loss (torch's cross-entropy default)."""
Overflow = Literal["truncate", "drop", "error"]
"""What :class:`MultimodalCollator` does with a sample longer than ``max_tokens``."""
RAGGED_KEYS: tuple[str, ...] = (
    "input_ids",
    "labels",
    "position_ids",
    "sample_ids",
    "pixel_values",
    "image_mask",
    "image_sample",
    "image_position",
)
"""The keys of a collated ragged batch, in the order the fusion model takes them."""
OVERFLOW_KEY = "overflow"
"""Batch key of the collator's per-batch counts ``[B, 2]`` long: column 0 the samples of each
row that were truncated, column 1 the samples dropped (all charged to row 0). The counts travel
with the batch, so they reach the training process whatever the DataLoader's ``num_workers``
(a worker process's :attr:`MultimodalCollator.stats` never does)."""


def overflow_counts(truncated: Sequence[int], dropped: int) -> Tensor:
    """``[B, 2]`` long (:data:`OVERFLOW_KEY`): ``truncated[r]`` samples cut in row ``r``;
    ``dropped`` samples left out of the batch, charged to row 0."""
    out = torch.zeros(len(truncated), 2, dtype=torch.long)
    out[:, 0] = torch.tensor(list(truncated), dtype=torch.long)
    if len(truncated):
        out[0, 1] = dropped
    return out


@dataclass
class _Item:
    """One sample after marker expansion (and truncation)."""

    id: str
    input_ids: Tensor
    labels: Tensor
    pixel_values: Tensor
    image_starts: list[int]
    truncated: bool = False


@dataclass
class _Row:
    """Samples assigned to one row and the tokens and images they use."""

    items: list[_Item] = field(default_factory=list)
    tokens: int = 0
    images: int = 0


def _count_markers(ids: Tensor, image_token_id: int) -> int:
    return int((ids == image_token_id).sum())


def _check_sample(sample: Mapping[str, Any], image_token_id: int) -> tuple[str, Tensor, Tensor]:
    """The sample's id, input ids and labels; ``ValueError`` on a malformed sample."""
    sid = str(sample.get("id", "<no id>"))
    for key in ("input_ids", "labels", "pixel_values"):
        if key not in sample:
            raise ValueError(
                f"sample {sid!r} has no {key!r}; a sample needs input_ids, labels "
                "and pixel_values ([0, C, H, W] for a text-only sample)."
            )
    ids, labels, pix = sample["input_ids"], sample["labels"], sample["pixel_values"]
    if ids.ndim != 1 or labels.shape != ids.shape:
        raise ValueError(
            f"sample {sid!r}: input_ids {tuple(ids.shape)} and labels {tuple(labels.shape)} must "
            "be 1-d and of the same length."
        )
    if pix.ndim != 4:
        raise ValueError(
            f"sample {sid!r}: pixel_values {tuple(pix.shape)} must be [I, C, H, W] (I = 0 for a "
            "text-only sample)."
        )
    markers = _count_markers(ids, image_token_id)
    if markers != pix.shape[0]:
        raise ValueError(
            f"sample {sid!r} has {markers} image marker(s) (token id {image_token_id}) in "
            f"input_ids but {pix.shape[0]} image(s) in pixel_values; each image needs exactly "
            "one marker."
        )
    return sid, ids.long(), labels.long()


@dataclass(kw_only=True)
class MultimodalCollator:
    """Collate samples with 0..N images into a ragged (optionally packed) batch.

    Args:
        max_tokens: token budget of one row, image tokens counted (>= 1).
        image_token_id: the marker token id (one per image in ``input_ids``).
        pad_token_id: the id on padding positions.
        pack: ``True``: several samples per row (first fit, in order) up to ``max_tokens``;
            ``False``: one sample per row, padded to the longest row of the batch.
        image_seq_length: tokens one image occupies in the language sequence: ``> 0`` spliced
            style (each marker expanded to that many ``image_token_id``), ``0`` cross-attention
            style (the marker stays one token).
        max_images_per_row: fixed image-slot count ``I`` (``None``: the most images of any row).
            A row never holds more; a sample with more images is refused.
        pad_to_max_tokens: pad every row to ``max_tokens`` (with ``max_images_per_row``: every
            batch has the same shapes, as a pipeline with fixed stage shapes needs).
        overflow: a sample longer than ``max_tokens``: ``"truncate"`` (cut at ``max_tokens``;
            an image whose tokens would be cut is dropped with its tokens), ``"drop"`` (left
            out), ``"error"`` (``ValueError``). Truncations and drops are counted in
            :attr:`stats`.

    Returns (``__call__``): a dict of batch-first tensors, ``B`` rows, ``T`` tokens, ``I``
    image slots: ``input_ids``, ``labels``, ``position_ids`` (0 on pad), ``sample_ids`` (index of
    the sample within its row, -1 on pad) all ``[B, T]`` long; ``pixel_values [B, I, C, H, W]``
    (empty slots zero), ``image_mask [B, I]`` bool, ``image_sample [B, I]`` and
    ``image_position [B, I]`` long (the image's sample and the token index of its marker, spliced:
    of its first image token; -1 on empty slots); ``overflow [B, 2]`` long
    (:data:`OVERFLOW_KEY`: this batch's truncated samples per row and dropped samples, which
    the recipe module logs as ``data/truncated`` / ``data/dropped``).

    Raises:
        ValueError: a bad argument; a sample whose markers do not match its image count (naming
            the sample id and both counts); with ``overflow="error"`` a sample over
            ``max_tokens``; a sample with more images than ``max_images_per_row``.
    """

    max_tokens: int
    image_token_id: int
    pad_token_id: int = 0
    pack: bool = True
    image_seq_length: int = 0
    max_images_per_row: int | None = None
    pad_to_max_tokens: bool = False
    overflow: Overflow = "truncate"
    stats: dict[str, int] = field(
        default_factory=lambda: {"samples": 0, "truncated": 0, "dropped": 0, "rows": 0}
    )
    """Counts since construction: samples seen, truncated, dropped, rows emitted."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"MultimodalCollator.max_tokens ({self.max_tokens}) must be >= 1.")
        if self.image_seq_length < 0:
            raise ValueError(
                f"MultimodalCollator.image_seq_length ({self.image_seq_length}) must be >= 0 "
                "(0: cross-attention style, the marker stays one token)."
            )
        if self.max_images_per_row is not None and self.max_images_per_row < 0:
            raise ValueError(
                f"MultimodalCollator.max_images_per_row ({self.max_images_per_row}) must be "
                ">= 0 or None (the most images of any row)."
            )
        if self.overflow not in ("truncate", "drop", "error"):
            raise ValueError(
                f"MultimodalCollator.overflow ({self.overflow!r}) must be 'truncate', 'drop' or "
                "'error'."
            )

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, Tensor]:
        items = [it for s in samples if (it := self._prepare(s)) is not None]
        if not items:
            raise ValueError(
                f"MultimodalCollator: all {len(samples)} sample(s) of the batch are longer than "
                f"max_tokens ({self.max_tokens}) and were dropped; raise max_tokens or use "
                "overflow='truncate'."
            )
        rows = self._rows(items)
        self.stats["rows"] += len(rows)
        out = self._tensors(rows, items[0].pixel_values)
        cut = [sum(it.truncated for it in row.items) for row in rows]
        out[OVERFLOW_KEY] = overflow_counts(cut, len(samples) - len(items))
        return out

    def _expand(self, sid: str, ids: Tensor, labels: Tensor, pix: Tensor) -> _Item:
        """Expand each marker to ``image_seq_length`` image tokens (spliced style); markers and
        image tokens get -100 labels, and so does the sample's first token."""
        labels = labels.clone()
        labels[ids == self.image_token_id] = IGNORE_INDEX
        labels[:1] = IGNORE_INDEX
        n = self.image_seq_length
        where = (ids == self.image_token_id).nonzero().flatten().tolist()
        if n <= 1:  # cross-attention (0) or one token per image: no expansion
            return _Item(sid, ids, labels, pix, where)
        repeats = torch.ones_like(ids)
        repeats[ids == self.image_token_id] = n
        starts = [w + k * (n - 1) for k, w in enumerate(where)]
        ids, labels = ids.repeat_interleave(repeats), labels.repeat_interleave(repeats)
        return _Item(sid, ids, labels, pix, starts)

    def _prepare(self, sample: Mapping[str, Any]) -> _Item | None:
        sid, ids, labels = _check_sample(sample, self.image_token_id)
        pix = sample["pixel_values"]
        cap = self.max_images_per_row
        if cap is not None and pix.shape[0] > cap:
            raise ValueError(
                f"sample {sid!r} has {pix.shape[0]} images, more than max_images_per_row "
                f"({cap}); raise max_images_per_row or split the sample."
            )
        self.stats["samples"] += 1
        item = self._expand(sid, ids, labels, pix)
        if len(item.input_ids) <= self.max_tokens:
            return item
        if self.overflow == "error":
            raise ValueError(
                f"sample {sid!r} has {len(item.input_ids)} tokens (image tokens counted), more "
                f"than max_tokens ({self.max_tokens}); raise max_tokens or set "
                "overflow='truncate' or 'drop'."
            )
        if self.overflow == "drop":
            self.stats["dropped"] += 1
            return None
        self.stats["truncated"] += 1
        return self._truncate(item)

    def _truncate(self, item: _Item) -> _Item:
        """Cut at ``max_tokens``; an image whose tokens do not all fit goes with its tokens."""
        cut, width = self.max_tokens, max(self.image_seq_length, 1)
        keep = [s for s in item.image_starts if s + width <= cut]
        if len(keep) < len(item.image_starts):
            cut = min(cut, item.image_starts[len(keep)])
        return _Item(
            item.id,
            item.input_ids[:cut],
            item.labels[:cut],
            item.pixel_values[: len(keep)],
            keep,
            truncated=True,
        )

    def _rows(self, items: list[_Item]) -> list[_Row]:
        """First fit in order (``pack``), or one sample per row."""
        rows: list[_Row] = []
        cap = self.max_images_per_row
        for item in items:
            n_tok, n_img = len(item.input_ids), item.pixel_values.shape[0]
            target = None
            if self.pack:
                for row in rows:
                    fits = row.tokens + n_tok <= self.max_tokens
                    if fits and (cap is None or row.images + n_img <= cap):
                        target = row
                        break
            if target is None:
                target = _Row()
                rows.append(target)
            target.items.append(item)
            target.tokens += n_tok
            target.images += n_img
        return rows

    def _tensors(self, rows: list[_Row], like: Tensor) -> dict[str, Tensor]:
        b = len(rows)
        t = self.max_tokens if self.pad_to_max_tokens else max(r.tokens for r in rows)
        slots = self.max_images_per_row
        if slots is None:
            slots = max(r.images for r in rows)
        out = {
            "input_ids": torch.full((b, t), self.pad_token_id, dtype=torch.long),
            "labels": torch.full((b, t), IGNORE_INDEX, dtype=torch.long),
            "position_ids": torch.zeros(b, t, dtype=torch.long),
            "sample_ids": torch.full((b, t), -1, dtype=torch.long),
            "pixel_values": like.new_zeros(b, slots, *like.shape[1:]),
            "image_mask": torch.zeros(b, slots, dtype=torch.bool),
            "image_sample": torch.full((b, slots), -1, dtype=torch.long),
            "image_position": torch.full((b, slots), -1, dtype=torch.long),
        }
        for r, row in enumerate(rows):
            tok = img = 0
            for s, item in enumerate(row.items):
                n = len(item.input_ids)
                out["input_ids"][r, tok : tok + n] = item.input_ids
                out["labels"][r, tok : tok + n] = item.labels
                out["position_ids"][r, tok : tok + n] = torch.arange(n)
                out["sample_ids"][r, tok : tok + n] = s
                for k, start in enumerate(item.image_starts):
                    out["pixel_values"][r, img] = item.pixel_values[k]
                    out["image_mask"][r, img] = True
                    out["image_sample"][r, img] = s
                    out["image_position"][r, img] = tok + start
                    img += 1
                tok += n
        return out


def contrastive_pairs(batch: Mapping[str, Tensor]) -> Tensor:
    """``[B, I]`` bool: image slots that form an image-caption pair for contrastive / MML terms,
    i.e. the only image of a sample that has at least one target token (a label != -100).
    Samples with 0 or several images, and images of samples without a caption, are left out."""
    sid, labels = batch["sample_ids"], batch["labels"]
    img_sample, mask = batch["image_sample"], batch["image_mask"]
    n = int(sid.max()) + 1 if sid.numel() else 0
    n = max(n, 1)
    s = sid.clamp(min=0)
    captioned = torch.zeros(sid.shape[0], n, dtype=torch.long, device=sid.device)
    captioned.scatter_add_(1, s, ((labels != IGNORE_INDEX) & (sid >= 0)).long())
    images = torch.zeros_like(captioned)
    images.scatter_add_(1, img_sample.clamp(min=0), mask.long())
    slot = img_sample.clamp(min=0, max=n - 1)
    one = images.gather(1, slot) == 1
    return mask & one & (captioned.gather(1, slot) > 0)
