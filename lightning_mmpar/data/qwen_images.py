"""A Qwen2-VL / Qwen2.5-VL checkpoint directory's image processor, read offline, for the
conversation data (:class:`~lightning_mmpar.data.conversations.ConversationDataModule`'s
``image_processor``).

Each image becomes what transformers' ``Qwen2VLImageProcessor`` computes for it (dynamic
resolution: resized to multiples of ``patch_size * merge_size`` within ``min_pixels`` /
``max_pixels``, normalised, cut into ``temporal_patch_size x patch_size^2`` patches):
``pixel_values [t h w, C T p p]`` and ``image_grid_thw [3]``. The image-token ids come from the
directory's ``config.json`` (``image_token_id``, ``vision_start_token_id``,
``vision_end_token_id``): each ``<image>`` marker of the text becomes
``<|vision_start|> <|image_pad|> <|vision_end|>`` as Qwen's chat template writes an image, and
:class:`~lightning_mmpar.data.qwen_packing.QwenVLCollator` expands the middle token into the
image's ``t h w / merge^2`` tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from PIL import Image

__all__ = ["QwenImages"]

TOKEN_FIELDS = ("vision_start_token_id", "image_token_id", "vision_end_token_id")
"""``config.json`` fields of the ids a marker becomes, in order."""


class QwenImages:
    """PIL image -> ``(pixel_values [N, F], image_grid_thw [3])`` with the image processor of
    ``directory`` (``AutoImageProcessor.from_pretrained(local_files_only=True)``).

    Attributes:
        merge_size: the vision merger's ``merge`` (image tokens = ``t h w / merge^2``).
        patch_dim: ``F = C T p p``, the width of one patch row.
        marker_ids: the ids one marker becomes (vision start, image token, vision end).

    Raises:
        ValueError: no ``preprocessor_config.json`` / ``config.json``, a processor without
            ``merge_size`` / ``temporal_patch_size`` (not a Qwen-VL one), or a config without
            the token ids (naming the field).
    """

    def __init__(self, directory: str | Path) -> None:
        path = Path(directory)
        if (
            not (path / "preprocessor_config.json").is_file()
            or not (path / "config.json").is_file()
        ):
            raise ValueError(
                f"data.image_processor ({str(path)!r}) needs preprocessor_config.json and "
                "config.json: pass a Qwen2-VL / Qwen2.5-VL directory (save_pretrained of the "
                "model and its processor)."
            )
        from transformers import AutoImageProcessor

        self.processor: Any = AutoImageProcessor.from_pretrained(str(path), local_files_only=True)
        merge = getattr(self.processor, "merge_size", None)
        temporal = getattr(self.processor, "temporal_patch_size", None)
        if merge is None or temporal is None:
            raise ValueError(
                f"data.image_processor ({str(path)!r}) is a {type(self.processor).__name__}, "
                "not a Qwen2-VL image processor (no merge_size / temporal_patch_size)."
            )
        config = json.loads((path / "config.json").read_text())
        missing = [f for f in TOKEN_FIELDS if not isinstance(config.get(f), int)]
        if missing:
            raise ValueError(f"{path / 'config.json'} has no {missing}; a Qwen-VL config has them.")
        self.merge_size = int(merge)
        self.patch_dim = 3 * int(temporal) * int(self.processor.patch_size) ** 2
        self.marker_ids = tuple(int(config[f]) for f in TOKEN_FIELDS)
        self.image_token_id = self.marker_ids[1]

    def __call__(self, image: Image.Image) -> tuple[torch.Tensor, torch.Tensor]:
        """``(pixel_values [t h w, F], image_grid_thw [3])`` of one RGB image."""
        out = self.processor(images=[image], return_tensors="pt")
        return out["pixel_values"].float(), out["image_grid_thw"][0].long()
