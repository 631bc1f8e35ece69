"""Planning a transformers vision-language checkpoint from its ``config.json`` alone.

The planner (``python -m lightning_mmpar.recipes.planner``) and the partitioner
(``python -m lightning_mmpar.recipes.partition``) price a recipe YAML's model on the meta
device. With ``model.pretrained.hf`` (or their ``--hf-config``, which sets it) the model's
architecture is the checkpoint's (:func:`~lightning_mmpar.models.hf.hf_fusion_config`: only
``config.json`` is read, no weights, tokenizer or data needed), and the YAML's data section is
replaced by :class:`CheckpointShapes`: the shapes the cost model needs (the checkpoint's
vocabulary, the YAML data's ``max_tokens`` / ``max_length``, ``batch_size`` and packing
options), without
reading the data files or the tokenizer. A Qwen2-VL, Qwen2.5-VL or Qwen3-VL-MoE checkpoint is
priced as a fusion model of its shapes instead (``model.fusion``:
:func:`~lightning_mmpar.models.hf.qwen_plan.qwen_plan_fusion_config`, at the YAML data's
``image_tokens`` language tokens per image, else 256). ``recipes/hf/`` holds the published
configs (recipes/hf/README.md).
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningDataModule

from lightning_mmpar.models.hf import hf_fusion_config
from lightning_mmpar.models.hf.checkpoint import hf_config
from lightning_mmpar.models.hf.qwen_plan import (
    DEFAULT_IMAGE_TOKENS,
    is_qwen_config,
    qwen_plan_fusion_config,
)

__all__ = ["DEFAULT_TEXT_LENGTH", "CheckpointShapes", "checkpoint_dir", "with_checkpoint"]

DEFAULT_TEXT_LENGTH = 2048
"""Text tokens per sample when the YAML's data gives none (LLaVA-1.5's ``model_max_length``)."""


_ROW_OPTIONS = ("pack", "max_tokens", "max_images_per_row", "rows_multiple")
"""The YAML data's row options :class:`CheckpointShapes` keeps (its arguments of these names)."""


class CheckpointShapes(LightningDataModule):
    """A data module of shapes only (module docstring): ``vocab_size``, ``max_length`` (text
    tokens per sample), ``batch_size`` (per dp rank) and ``images_per_sample`` (``None``: the
    planner's default, 1); for the YAML's ragged data its row options as its ``collate_args``
    (``pack``: several samples per row, ``max_tokens``, ``max_images_per_row``,
    ``rows_multiple``), what the planner reads of packing (``--samples-per-row``, the
    fragment's ``data.rows_multiple``). It has no loaders: the planner and partitioner never
    train."""

    def __init__(
        self,
        *,
        vocab_size: int,
        max_length: int = DEFAULT_TEXT_LENGTH,
        batch_size: int = 1,
        images_per_sample: float | None = None,
        pack: bool | None = None,
        max_tokens: int | None = None,
        max_images_per_row: int | None = None,
        rows_multiple: int | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("max_length", max_length)):
            if value < 1:
                raise ValueError(f"CheckpointShapes: {name} ({value}) must be >= 1.")
        self.vocab_size, self.max_length, self.batch_size = vocab_size, max_length, batch_size
        self.images_per_sample = images_per_sample
        rows = (pack, max_tokens, max_images_per_row, rows_multiple)
        if pack is not None or max_tokens is not None:  # the YAML's data is ragged
            self.collate_args = {
                k: v for k, v in zip(_ROW_OPTIONS, rows, strict=True) if v is not None
            }


def checkpoint_dir(path: str | Path) -> Path:
    """The checkpoint directory of ``path``: a directory holding ``config.json``, or a
    ``config.json`` file (its folder).

    Raises:
        ValueError: no such directory or file, or a file not named ``config.json``.
    """
    p = Path(path)
    if p.is_file() and p.name == "config.json":
        return p.parent
    if p.is_dir() and (p / "config.json").is_file():
        return p
    raise ValueError(
        f"--hf-config {str(path)!r}: not a config.json nor a directory holding one; pass a "
        "transformers checkpoint's config.json (e.g. recipes/hf/llava-1.5-7b/config.json)."
    )


def with_checkpoint(config: dict[str, Any], hf: str | Path | None = None) -> dict[str, Any]:
    """``config`` (a recipe YAML) with ``model.pretrained.hf = hf`` when given (the towers'
    own ``vision`` / ``language`` options removed) and, when the model then reads a
    checkpoint, its data section replaced by :class:`CheckpointShapes` (module docstring).
    ``config`` is not changed.

    Raises:
        ValueError: ``hf`` is no checkpoint config (:func:`checkpoint_dir`), or its
            ``config.json`` is refused (:func:`~lightning_mmpar.models.hf.hf_fusion_config`).
    """
    out = copy.deepcopy(config)
    model = dict(out.get("model") or {})
    out["model"] = model
    if hf is not None:
        model["pretrained"] = {"hf": str(checkpoint_dir(hf))}
    path = (model.get("pretrained") or {}).get("hf")
    if not path:
        return out
    section = dict(out.get("data") or {})
    data = {k: v for k, v in section.items() if k not in ("class_path", "init_args")}
    data |= section.get("init_args") or {}
    length = data.get("max_tokens") or data.get("max_length") or DEFAULT_TEXT_LENGTH
    vocab = _priced_model(model, path, data).language.vocab_size
    shapes: dict[str, Any] = {
        "vocab_size": vocab,
        "max_length": int(length),
        "batch_size": int(data.get("batch_size", 1)),
    }
    if data.get("images_per_sample") is not None:
        shapes["images_per_sample"] = float(data["images_per_sample"])
    shapes |= {k: data[k] for k in _ROW_OPTIONS if data.get(k) is not None}  # packing kept
    name = f"{CheckpointShapes.__module__}.{CheckpointShapes.__name__}"
    out["data"] = {"class_path": name, "init_args": shapes}
    return out


def _priced_model(model: dict[str, Any], path: str, data: dict[str, Any]) -> Any:
    """The fusion config the planner prices for the checkpoint ``path``: a Qwen-VL one as
    ``model.fusion`` (``model.pretrained`` dropped: no weights are read), the YAML data's
    ``image_tokens`` per image; else the checkpoint's own (``model.pretrained.hf``)."""
    config = hf_config(path)
    if not is_qwen_config(config):
        return hf_fusion_config(path)
    tokens = int(data.get("image_tokens") or DEFAULT_IMAGE_TOKENS)
    fusion = qwen_plan_fusion_config(config, tokens)
    model.pop("pretrained", None)
    model["fusion"] = dataclasses.asdict(fusion)
    return fusion
