"""LLaVA-format conversations with several images per sample in WebDataset tar shards.

A sample is the files of one key: ``<key>.json`` holding one record of the LLaVA JSON
(``{"id"?, "conversations": [...]}``; its ``image`` field, if any, is ignored) and its images
``<key>.0.png``, ``<key>.1.jpg``, ... in marker order (WebDataset's multi-file naming: the key
ends at the first dot), or ``<key>.png`` for a single image, or none for a text-only sample.
The split by dp rank and worker, the resumable position and ``on_error`` are those of
:class:`~lightning_mmpar.data.shards.ShardedCaptions`; a sample that cannot be used (markers
that do not match its images, an undecodable image, bad JSON) names shard and key.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from PIL import Image

from lightning_mmpar.data.chat import ChatEncoder
from lightning_mmpar.data.llava import Sample, make_sample, parse_record
from lightning_mmpar.data.shards import IMAGE_KEYS, ShardedCaptions

__all__ = ["ShardedConversations", "image_entries"]

_IMAGE_ENTRY = re.compile(r"^(?:(\d+)\.)?(" + "|".join(IMAGE_KEYS) + r")$")


def image_entries(raw: dict[str, Any]) -> list[str]:
    """The image entries (``"0.png"``, ``"1.jpg"`` or ``"png"``) of a raw sample, in order."""
    found = []
    for key in raw:
        match = _IMAGE_ENTRY.match(key)
        if match:
            found.append((int(match.group(1) or 0), key))
    return [key for _, key in sorted(found)]


class ShardedConversations(ShardedCaptions):
    """Samples of the batch contract (``id``, ``input_ids``, ``labels``, ``pixel_values [I, 3,
    S, S]``) from this dp rank's share of conversation shards (module docstring).

    Args:
        urls, sizes: shard files and their sample counts.
        encoder: a :class:`~lightning_mmpar.data.chat.ChatEncoder`.
        transform: PIL image -> ``[3, S, S]``; ``image_size`` is S.
        rank, world, shuffle, seed, on_error: as in
            :class:`~lightning_mmpar.data.shards.ShardedCaptions`.
    """

    def __init__(
        self,
        urls: Sequence[str],
        sizes: Sequence[int],
        *,
        encoder: ChatEncoder,
        transform: Callable[[Image.Image], torch.Tensor],
        image_size: int,
        rank: int = 0,
        world: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        on_error: str = "raise",
    ) -> None:
        super().__init__(
            urls,
            sizes,
            transform=transform,
            tokenizer=encoder.tokenizer,
            max_length=0,
            rank=rank,
            world=world,
            shuffle=shuffle,
            seed=seed,
            on_error=on_error,
        )
        self.encoder, self.image_size = encoder, image_size

    def decode(self, raw: dict[str, Any]) -> Sample | str:
        """The sample of a raw tar entry group, or the reason it cannot be used."""
        if "json" not in raw:
            return "no .json (the conversation record)"
        key = str(raw.get("__key__"))
        try:
            fields = json.loads(raw["json"])
            if not isinstance(fields, dict):
                return f".json holds {type(fields).__name__}, not a record object"
            names = image_entries(raw)
            record = parse_record({"id": key, **fields, "image": names}, "shard sample")
            pixels = []
            for name in names:
                with Image.open(io.BytesIO(raw[name])) as img:
                    pixels.append(self.transform(img.convert("RGB")))
            return make_sample(record, pixels, self.encoder, self.image_size)
        except (OSError, ValueError) as err:  # bad JSON, markers vs images, PIL, no answer
            return f"{type(err).__name__}: {err}"
