"""LLaVA-format conversations with 0..N images per sample, as ragged samples.

The JSON file is a list of records (LLaVA-1.5's ``llava_v1_5_mix665k.json`` layout)::

    [{"id": "000000033471",
      "image": "coco/train2017/000000033471.jpg",          # a path, a list of paths, or absent
      "conversations": [{"from": "human", "value": "<image>\\nWhat is on the table?"},
                        {"from": "gpt", "value": "A laptop and a cup."}]}]

Image paths are relative to ``image_root`` (or absolute). Every ``<image>`` marker stands for the
record's next image; the number of markers must equal the number of images. A sample is the
dict of the batch contract (``docs/losses_and_data.md``): ``id``, ``input_ids [L]``, ``labels
[L]`` (targets on the assistant turns only: :mod:`lightning_mmpar.data.chat`) and
``pixel_values [I, 3, S, S]`` (``I`` = markers, 0 for a text-only record); the collator
(:class:`~lightning_mmpar.data.packing.MultimodalCollator`) pads or packs them into batches.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch.utils.data import Dataset

from lightning_mmpar.data.chat import IMAGE_MARKER, ChatEncoder

__all__ = [
    "ConversationDataset",
    "ConversationRecord",
    "load_image",
    "parse_record",
    "read_conversations",
]

Sample = dict[str, Any]
"""``{"id": str, "input_ids": [L] long, "labels": [L] long, "pixel_values": [I, 3, S, S]}``."""


@dataclass(frozen=True)
class ConversationRecord:
    """One LLaVA-format record: its id, image paths (in marker order) and ``(from, value)``
    turns."""

    id: str
    images: tuple[str, ...]
    turns: tuple[tuple[str, str], ...]


def parse_record(raw: Any, where: str, marker: str = IMAGE_MARKER) -> ConversationRecord:
    """A checked :class:`ConversationRecord` of one JSON object; ``where`` names it in errors
    (e.g. ``"data.json, record 3"``); a record without ``id`` gets ``where`` as its id.

    Raises:
        ValueError: not an object, no ``conversations`` list of ``{"from", "value"}`` turns, an
            ``image`` that is not a path or a list of paths, or markers that do not match the
            images (the sample id and both counts).
    """
    if not isinstance(raw, dict) or not isinstance(raw.get("conversations"), list):
        raise ValueError(
            f"{where}: a record is an object with a 'conversations' list (LLaVA format), got "
            f"{str(raw)[:80]!r}."
        )
    sample_id = str(raw.get("id", where))
    image = raw.get("image")
    images = [] if image is None else [image] if isinstance(image, str) else image
    if not isinstance(images, list) or not all(isinstance(p, str) for p in images):
        raise ValueError(
            f"sample {sample_id!r} ({where}): 'image' must be a path or a list of "
            f"paths, got {image!r}."
        )
    turns = []
    for turn in raw["conversations"]:
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            raise ValueError(
                f"sample {sample_id!r} ({where}): a turn is {{'from': 'human'|'gpt', 'value': "
                f"str}}, got {str(turn)[:80]!r}."
            )
        turns.append((str(turn.get("from")), turn["value"]))
    markers = sum(value.count(marker) for _, value in turns)
    if markers != len(images):
        raise ValueError(
            f"sample {sample_id!r} ({where}): {markers} {marker} markers but {len(images)} "
            f"images; put one {marker} in the text per image, in order."
        )
    return ConversationRecord(sample_id, tuple(images), tuple(turns))


def read_conversations(file: str | Path) -> list[ConversationRecord]:
    """The records of a LLaVA-format JSON file (a list; a JSON-lines file of records works
    too), each checked by :func:`parse_record`.

    Raises:
        ValueError: the file is missing or not JSON, or a record is bad (file and record index).
    """
    path = Path(file)
    if not path.is_file():
        raise ValueError(f"conversation file {str(path)!r} does not exist; pass a LLaVA JSON.")
    text = path.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        try:
            data = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not JSON or JSON lines ({err}).") from err
    if not isinstance(data, list):
        raise ValueError(f"{path}: the top level must be a list of records (LLaVA format).")
    return [parse_record(raw, f"{path.name}, record {n}") for n, raw in enumerate(data)]


def load_image(
    path: str | Path, sample_id: str, transform: Callable[[Image.Image], torch.Tensor]
) -> torch.Tensor:
    """``transform`` of the RGB image at ``path``.

    Raises:
        ValueError: the file is missing or PIL cannot read it, naming the file and the sample.
    """
    try:
        with Image.open(path) as img:
            return transform(img.convert("RGB"))
    except (OSError, ValueError) as err:  # FileNotFoundError, UnidentifiedImageError, truncated
        reason = "missing" if isinstance(err, FileNotFoundError) else "unreadable"
        raise ValueError(
            f"sample {sample_id!r}: image {str(path)!r} is {reason} ({type(err).__name__}: "
            f"{err}); fix the file or drop the record."
        ) from err


def make_sample(
    record: ConversationRecord, pixels: Sequence[Any], encoder: ChatEncoder, size: int
) -> Sample:
    """The contract's sample of ``record`` with its images already as ``[3, S, S]`` tensors;
    images given as ``(patches [N, F], grid [3])`` pairs (a Qwen-VL image processor,
    :class:`~lightning_mmpar.data.qwen_images.QwenImages`) give ``pixel_values`` (the patches
    one after another) and ``image_grid_thw [I, 3]`` instead."""
    input_ids, labels = encoder(record.turns, record.id)
    if pixels and isinstance(pixels[0], tuple):
        patches = torch.cat([p[0] for p in pixels])
        grids = torch.stack([p[1] for p in pixels])
        sample = {"id": record.id, "input_ids": input_ids, "labels": labels}
        return sample | {"pixel_values": patches, "image_grid_thw": grids}
    stacked = torch.stack(list(pixels)) if pixels else torch.zeros(0, 3, size, size)
    return {"id": record.id, "input_ids": input_ids, "labels": labels, "pixel_values": stacked}


class ConversationDataset(Dataset[Sample]):
    """Records of a LLaVA-format file as samples (module docstring).

    Args:
        records: from :func:`read_conversations`.
        encoder: a :class:`~lightning_mmpar.data.chat.ChatEncoder` (tokenizer, template).
        transform: PIL image -> ``[3, S, S]``; ``image_size`` is S (for text-only samples'
            empty ``[0, 3, S, S]``).
        image_root: folder that relative image paths are under.

    Raises:
        ValueError: (``__getitem__``) a missing or unreadable image, naming the file and the
            sample id; the DataLoader re-raises it in the training process, which stops.
    """

    def __init__(
        self,
        records: Sequence[ConversationRecord],
        *,
        encoder: ChatEncoder,
        transform: Callable[[Image.Image], torch.Tensor],
        image_size: int,
        image_root: str | Path = ".",
    ) -> None:
        self.records, self.encoder, self.transform = list(records), encoder, transform
        self.image_size, self.image_root = image_size, Path(image_root)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> Sample:
        record = self.records[index]
        pixels = [load_image(self.image_root / p, record.id, self.transform) for p in record.images]
        return make_sample(record, pixels, self.encoder, self.image_size)
