"""Ragged batches of dynamic-resolution images (Qwen2-VL / Qwen2.5-VL): the variant of
:class:`~lightning_mmpar.data.packing.MultimodalCollator` whose images have their own sizes.

A *sample* is the Qwen processor's output for one conversation, with one marker per image::

    id              str: names the sample in errors
    input_ids       LongTensor [L]: each image is ONE marker token image_token_id
    labels          LongTensor [L]: the tokens to predict (-100: no loss)
    pixel_values    FloatTensor [N_patches, C*T*p*p]: the sample's images' patches, in order
    image_grid_thw  LongTensor [I, 3]: each image's patch grid (t, h, w); I = markers

The collator expands marker ``i`` into ``t h w / merge^2`` image tokens, packs samples into
rows (first fit, in order) and returns batch-first tensors (``B`` rows, ``T`` tokens, ``P``
patch positions, ``I`` image slots)::

    input_ids, labels, sample_ids  [B, T]      as MultimodalCollator's
    position_ids                   [B, 3, T]   M-RoPE (t, h, w) positions, restarting per
                                               sample (transformers' get_rope_index, batch-first)
    pixel_values                   [B, P, F]   each row's images' patches one after another
    image_grid_thw                 [B, I, 3]   grid of each slot (zeros: empty slot)
    image_mask                     [B, I]      slot holds an image

Every tensor is batch-first, so micro-batching splits them by row and a pipeline stage sends
them as they are; with ``max_patches_per_row``, ``max_images_per_row`` and
``pad_to_max_tokens`` every batch has the same shapes (what pipeline parallelism needs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from lightning_mmpar.data.packing import IGNORE_INDEX, OVERFLOW_KEY, overflow_counts

__all__ = ["QWEN_VL_BATCH_KEYS", "QwenVLCollator", "mrope_positions"]

QWEN_VL_BATCH_KEYS: tuple[str, ...] = (
    "input_ids",
    "labels",
    "position_ids",
    "sample_ids",
    "pixel_values",
    "image_grid_thw",
    "image_mask",
)
"""The keys of a collated Qwen-VL batch."""


def mrope_positions(ids: Tensor, grid_thw: Tensor, image_token_id: int, merge: int) -> Tensor:
    """``[3, L]`` M-RoPE positions of one sample ``ids [L]`` whose images have the patch grids
    ``grid_thw [I, 3]`` (in order). Each run of ``image_token_id`` is one image (transformers
    groups runs of image tokens the same way: two images need a text token between them, as
    Qwen's ``<|vision_start|>`` / ``<|vision_end|>`` are).

    Raises:
        ValueError: the runs and ``grid_thw`` disagree (count or tokens per image).
    """
    is_image = (ids == image_token_id).tolist()
    runs: list[tuple[bool, int]] = []
    for flag in is_image:
        if runs and runs[-1][0] == flag:
            runs[-1] = (flag, runs[-1][1] + 1)
        else:
            runs.append((flag, 1))
    n_runs = sum(1 for flag, _ in runs if flag)
    if n_runs != grid_thw.shape[0]:
        raise ValueError(
            f"mrope_positions: {n_runs} run(s) of image tokens (id {image_token_id}) but "
            f"{grid_thw.shape[0]} image grid(s); separate images by a text token."
        )
    parts, pos, image = [], 0, 0
    for flag, n in runs:
        if not flag:
            parts.append(torch.arange(pos, pos + n).expand(3, n))
            pos += n
            continue
        t, h, w = (int(v) for v in grid_thw[image])
        h, w = h // merge, w // merge
        if t * h * w != n:
            raise ValueError(
                f"mrope_positions: image {image} has {n} image tokens but its grid "
                f"{list(grid_thw[image].tolist())} merged by {merge} gives {t * h * w}."
            )
        grid = torch.stack(
            torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        )
        parts.append(grid.reshape(3, -1) + pos)
        pos += max(h, w)
        image += 1
    if not parts:
        return torch.zeros(3, 0, dtype=torch.long)
    return torch.cat(parts, dim=1).long()


@dataclass
class _Sample:
    id: str
    input_ids: Tensor
    labels: Tensor
    positions: Tensor
    pixel_values: Tensor
    grid: Tensor


def _fields(sample: Mapping[str, Any]) -> tuple[str, Tensor, Tensor, Tensor, Tensor]:
    sid = str(sample.get("id", "<no id>"))
    for key in ("input_ids", "labels", "pixel_values", "image_grid_thw"):
        if key not in sample:
            raise ValueError(
                f"sample {sid!r} has no {key!r}; a Qwen-VL sample needs input_ids, labels, "
                "pixel_values [N_patches, F] and image_grid_thw [I, 3] (0 rows: text only)."
            )
    ids, labels = sample["input_ids"].long(), sample["labels"].long()
    pix, grid = sample["pixel_values"], sample["image_grid_thw"].long().reshape(-1, 3)
    if ids.ndim != 1 or labels.shape != ids.shape:
        raise ValueError(f"sample {sid!r}: input_ids and labels must be 1-d of one length.")
    if pix.ndim != 2 or pix.shape[0] != int(grid.prod(-1).sum()):
        raise ValueError(
            f"sample {sid!r}: pixel_values {tuple(pix.shape)} must be [N_patches, F] with "
            f"N_patches = sum of t*h*w over image_grid_thw ({int(grid.prod(-1).sum())})."
        )
    return sid, ids, labels, pix, grid


@dataclass(kw_only=True)
class QwenVLCollator:
    """Collate Qwen-VL samples with 0..N images of any size into a packed batch (module
    docstring).

    Args:
        max_tokens: token budget of one row, image tokens counted.
        image_token_id: the image marker / image-token id (``config.image_token_id``).
        spatial_merge_size: the vision merger's ``merge`` (image tokens = ``t h w / merge^2``).
        pad_token_id: the id on padding positions.
        pack: several samples per row (first fit, in order); ``False``: one per row.
        max_images_per_row: fixed slot count ``I`` (``None``: the most of any row).
        max_patches_per_row: fixed patch positions ``P`` (``None``: the most of any row); a row
            never holds more.
        pad_to_max_tokens: pad every row to ``max_tokens``.
        overflow: a sample over ``max_tokens`` (or ``max_patches_per_row``, or with more
            images than ``max_images_per_row``): ``"drop"`` (counted in :attr:`stats`) or
            ``"error"``. Cutting a dynamic-resolution image is not offered.

    Raises:
        ValueError: a malformed sample (markers vs ``image_grid_thw``, patches vs grids); an
            oversize sample with ``overflow="error"``; every sample dropped.
    """

    max_tokens: int
    image_token_id: int
    spatial_merge_size: int = 2
    pad_token_id: int = 0
    pack: bool = True
    max_images_per_row: int | None = None
    max_patches_per_row: int | None = None
    pad_to_max_tokens: bool = False
    overflow: Literal["drop", "error"] = "error"
    stats: dict[str, int] = field(default_factory=lambda: {"samples": 0, "dropped": 0, "rows": 0})
    """Counts since construction: samples seen, dropped, rows emitted."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"QwenVLCollator.max_tokens ({self.max_tokens}) must be >= 1.")
        if self.overflow not in ("drop", "error"):
            raise ValueError(
                f"QwenVLCollator.overflow ({self.overflow!r}) must be 'drop' or 'error'."
            )

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, Tensor]:
        items = [it for s in samples if (it := self._prepare(s)) is not None]
        if not items:
            raise ValueError(
                f"QwenVLCollator: all {len(samples)} sample(s) were dropped as oversize; raise "
                "max_tokens / max_patches_per_row / max_images_per_row."
            )
        rows = self._rows(items)
        self.stats["rows"] += len(rows)
        out = self._tensors(rows, items[0].pixel_values)
        out[OVERFLOW_KEY] = overflow_counts([0] * len(rows), len(samples) - len(items))
        return out

    def _expand(self, sid: str, ids: Tensor, labels: Tensor, grid: Tensor) -> tuple[Tensor, ...]:
        markers = int((ids == self.image_token_id).sum())
        if markers != grid.shape[0]:
            raise ValueError(
                f"sample {sid!r} has {markers} image marker(s) (token id {self.image_token_id}) "
                f"but {grid.shape[0]} image grid(s); each image needs exactly one marker."
            )
        repeats = torch.ones_like(ids)
        repeats[ids == self.image_token_id] = grid.prod(-1) // self.spatial_merge_size**2
        labels = labels.clone()
        labels[ids == self.image_token_id] = IGNORE_INDEX
        labels[:1] = IGNORE_INDEX
        return ids.repeat_interleave(repeats), labels.repeat_interleave(repeats)

    def _oversize(self, ids: Tensor, pix: Tensor, grid: Tensor) -> str | None:
        if len(ids) > self.max_tokens:
            return f"{len(ids)} tokens (image tokens counted) > max_tokens ({self.max_tokens})"
        if self.max_patches_per_row is not None and pix.shape[0] > self.max_patches_per_row:
            return f"{pix.shape[0]} patches > max_patches_per_row ({self.max_patches_per_row})"
        if self.max_images_per_row is not None and grid.shape[0] > self.max_images_per_row:
            return f"{grid.shape[0]} images > max_images_per_row ({self.max_images_per_row})"
        return None

    def _prepare(self, sample: Mapping[str, Any]) -> _Sample | None:
        sid, ids, labels, pix, grid = _fields(sample)
        self.stats["samples"] += 1
        ids, labels = self._expand(sid, ids, labels, grid)
        problem = self._oversize(ids, pix, grid)
        if problem is not None:
            if self.overflow == "error":
                raise ValueError(
                    f"sample {sid!r} has {problem}; raise the limit or set overflow='drop'."
                )
            self.stats["dropped"] += 1
            return None
        pos = mrope_positions(ids, grid, self.image_token_id, self.spatial_merge_size)
        return _Sample(sid, ids, labels, pos, pix, grid)

    def _fits(self, row: list[_Sample], item: _Sample) -> bool:
        tokens = sum(len(s.input_ids) for s in row) + len(item.input_ids)
        patches = sum(s.pixel_values.shape[0] for s in row) + item.pixel_values.shape[0]
        images = sum(s.grid.shape[0] for s in row) + item.grid.shape[0]
        return (
            tokens <= self.max_tokens
            and (self.max_patches_per_row is None or patches <= self.max_patches_per_row)
            and (self.max_images_per_row is None or images <= self.max_images_per_row)
        )

    def _rows(self, items: list[_Sample]) -> list[list[_Sample]]:
        rows: list[list[_Sample]] = []
        for item in items:
            target = next((r for r in rows if self.pack and self._fits(r, item)), None)
            if target is None:
                target = []
                rows.append(target)
            target.append(item)
        return rows

    def _shape(self, rows: list[list[_Sample]]) -> tuple[int, int, int]:
        """``(T, P, I)``; ``P`` at least one merge unit (a text-only batch runs the ViT on one
        padding unit, so every rank's vision tower takes part)."""
        t = self.max_tokens
        if not self.pad_to_max_tokens:
            t = max(sum(len(s.input_ids) for s in r) for r in rows)
        p = self.max_patches_per_row
        if p is None:
            p = max(
                self.spatial_merge_size**2, *(sum(s.pixel_values.shape[0] for s in r) for r in rows)
            )
        i = self.max_images_per_row
        if i is None:
            i = max(sum(s.grid.shape[0] for s in r) for r in rows)
        return t, p, i

    def _tensors(self, rows: list[list[_Sample]], like: Tensor) -> dict[str, Tensor]:
        b, (t, p, i) = len(rows), self._shape(rows)
        out = {
            "input_ids": torch.full((b, t), self.pad_token_id, dtype=torch.long),
            "labels": torch.full((b, t), IGNORE_INDEX, dtype=torch.long),
            "position_ids": torch.zeros(b, 3, t, dtype=torch.long),
            "sample_ids": torch.full((b, t), -1, dtype=torch.long),
            "pixel_values": like.new_zeros(b, p, like.shape[1]),
            "image_grid_thw": torch.zeros(b, i, 3, dtype=torch.long),
            "image_mask": torch.zeros(b, i, dtype=torch.bool),
        }
        for r, row in enumerate(rows):
            tok = patch = img = 0
            for s, item in enumerate(row):
                n, m, k = len(item.input_ids), item.pixel_values.shape[0], item.grid.shape[0]
                out["input_ids"][r, tok : tok + n] = item.input_ids
                out["labels"][r, tok : tok + n] = item.labels
                out["position_ids"][r, :, tok : tok + n] = item.positions
                out["sample_ids"][r, tok : tok + n] = s
                out["pixel_values"][r, patch : patch + m] = item.pixel_values
                out["image_grid_thw"][r, img : img + k] = item.grid
                out["image_mask"][r, img : img + k] = True
                tok, patch, img = tok + n, patch + m, img + k
        return out
