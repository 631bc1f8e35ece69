"""Image preprocessing from the vision tower's own configuration, through open_clip.

The transform is ``open_clip.image_transform`` (evaluation branch): resize (``resize_mode``:
``"shortest"`` side then centre-crop, ``"longest"`` side then pad, or ``"squash"``), RGB,
``ToTensor``, ``Normalize(mean, std)``. The values come, in increasing priority, from open_clip's
defaults (``PreprocessCfg``: OpenAI CLIP mean/std, bicubic, shortest), from ``from_pretrained``
(an open_clip model directory or config, or a model name with a pretrained tag) and from the
fields set explicitly.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import open_clip
import torch
from open_clip.transform import PreprocessCfg, image_transform_v2, merge_preprocess_dict
from PIL import Image

__all__ = ["CLIP_MEAN", "CLIP_STD", "ImagePreprocess", "clip_transform"]

CLIP_MEAN: tuple[float, ...] = tuple(open_clip.OPENAI_DATASET_MEAN)
"""Per-channel mean of CLIP's image normalisation (open_clip ``OPENAI_DATASET_MEAN``)."""
CLIP_STD: tuple[float, ...] = tuple(open_clip.OPENAI_DATASET_STD)
"""Per-channel std of CLIP's image normalisation (open_clip ``OPENAI_DATASET_STD``)."""


@dataclass(kw_only=True)
class ImagePreprocess:
    """How images become ``[3, S, S]`` float tensors (S = the data module's ``image_size``).

    Raises:
        ValueError: (at :meth:`resolve`) a mean/std that is not 3 numbers, a std <= 0, an
            unknown ``from_pretrained``, or a size there that differs from ``image_size``.
    """

    mean: tuple[float, float, float] | None = None
    """Per-channel mean; None: from ``from_pretrained``, else open_clip's OpenAI CLIP mean."""
    std: tuple[float, float, float] | None = None
    """Per-channel std (> 0); None: from ``from_pretrained``, else open_clip's OpenAI CLIP std."""
    interpolation: Literal["bicubic", "bilinear"] | None = None
    """Resize interpolation; None: from ``from_pretrained``, else bicubic."""
    resize_mode: Literal["shortest", "longest", "squash"] | None = None
    """None: from ``from_pretrained``, else ``shortest`` (resize the short side, centre-crop)."""
    from_pretrained: str | None = None
    """Where the vision tower's preprocessing is read: an open_clip model directory (its
    ``open_clip_config.json``), a transformers checkpoint directory (its image processor's
    ``preprocessor_config.json``: :func:`transformers_preprocess`), such a JSON file or a model
    config JSON (key ``preprocess_cfg``), or ``"<model name>:<pretrained tag>"`` of open_clip's
    registry (e.g. ``ViT-B-16-SigLIP:webli``: mean/std 0.5). A state-dict file carries none:
    defaults."""

    def resolve(self, image_size: int) -> PreprocessCfg:
        """open_clip's ``PreprocessCfg`` for ``image_size``: defaults < ``from_pretrained`` <
        explicit fields."""
        cfg: dict[str, Any] = asdict(PreprocessCfg())
        if self.from_pretrained:
            found = _pretrained_preprocess(self.from_pretrained)
            size = found.get("size")
            if size is not None and _side(size) != image_size:
                raise ValueError(
                    f"ImagePreprocess: from_pretrained {self.from_pretrained!r} is for "
                    f"{size}-pixel images but image_size is {image_size}; set image_size to "
                    f"{_side(size)} (the vision tower's input size)."
                )
            cfg = merge_preprocess_dict(cfg, found)
        explicit = {k: getattr(self, k) for k in ("mean", "std", "interpolation", "resize_mode")}
        cfg = merge_preprocess_dict(cfg, {**explicit, "size": image_size})
        for name in ("mean", "std"):
            values = cfg[name]
            if len(values) != 3 or (name == "std" and min(values) <= 0):
                raise ValueError(
                    f"ImagePreprocess: {name} ({values!r}) must be 3 numbers (RGB)"
                    + (", each > 0" if name == "std" else "")
                    + f"; e.g. open_clip's {CLIP_MEAN if name == 'mean' else CLIP_STD}."
                )
        return PreprocessCfg(**cfg)

    def transform(self, image_size: int) -> Callable[[Image.Image], torch.Tensor]:
        """open_clip's evaluation transform for :meth:`resolve` ``(image_size)``."""
        return image_transform_v2(self.resolve(image_size), is_train=False)


def clip_transform(
    image_size: int,
    *,
    mean: tuple[float, float, float] | None = None,
    std: tuple[float, float, float] | None = None,
    preprocess: ImagePreprocess | None = None,
) -> Callable[[Image.Image], torch.Tensor]:
    """PIL image -> ``[3, S, S]`` float (``S = image_size``): open_clip's transform with
    ``preprocess`` (default: open_clip's defaults, bicubic short-side resize, centre crop, OpenAI
    CLIP mean/std); ``mean``/``std`` override it."""
    pre = preprocess or ImagePreprocess()
    if mean is not None or std is not None:
        pre = ImagePreprocess(**{**asdict(pre), "mean": mean or pre.mean, "std": std or pre.std})
    return pre.transform(image_size)


def _side(size: Any) -> int:
    return int(size if isinstance(size, int) else max(size))


HF_PROCESSOR = "preprocessor_config.json"
"""A transformers checkpoint directory's image processor config (``CLIPImageProcessor``)."""
_RESAMPLE = {2: "bilinear", 3: "bicubic"}
"""PIL resampling ids of the image processors -> open_clip's interpolation names."""


def transformers_preprocess(path: Path) -> dict[str, Any]:
    """The preprocessing keys of a transformers ``CLIPImageProcessor`` config
    (``preprocessor_config.json``): resize the shortest side to ``size.shortest_edge``, centre
    crop ``crop_size`` (open_clip's ``shortest`` mode when the two are equal), ``image_mean``,
    ``image_std``, ``resample`` (bicubic / bilinear).

    Raises:
        ValueError: a processor this transform does not reproduce (naming the field): a crop
            other than the resized side, another resampling, no normalisation.
    """
    config = json.loads(path.read_text())
    size = config.get("size") or {}
    crop = config.get("crop_size") or {}
    side = size.get("shortest_edge") if isinstance(size, dict) else size
    crop_side = crop.get("height") if isinstance(crop, dict) else crop
    resample = config.get("resample", 3)
    bad = [
        ("size.shortest_edge", side, crop_side is not None and side != crop_side),
        ("resample", resample, resample not in _RESAMPLE),
        ("do_normalize", config.get("do_normalize"), config.get("do_normalize") is False),
    ]
    for name, value, wrong in bad:
        if wrong:
            raise ValueError(
                f"ImagePreprocess: {path} {name} = {value!r} is not supported (crop_size "
                f"{crop_side!r}); set data.preprocess fields explicitly instead."
            )
    found: dict[str, Any] = {"resize_mode": "shortest", "interpolation": _RESAMPLE[resample]}
    found |= {"mean": config.get("image_mean"), "std": config.get("image_std"), "size": side}
    return {k: v for k, v in found.items() if v is not None}


def _pretrained_preprocess(source: str) -> dict[str, Any]:
    """Preprocessing keys (``mean``, ``std``, ``interpolation``, ``resize_mode``, ``size``) of
    ``source`` (see :attr:`ImagePreprocess.from_pretrained`)."""
    path = Path(source)
    if path.is_dir() and (path / HF_PROCESSOR).is_file():
        return transformers_preprocess(path / HF_PROCESSOR)
    if path.is_dir():
        path = path / "open_clip_config.json"
        if not path.is_file():
            return {}  # a directory of weights only: open_clip falls back to its defaults too
    if path.suffix == ".json" and path.is_file():
        try:
            config = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"ImagePreprocess: {path} is not valid JSON ({err}).") from None
        found = dict(config.get("preprocess_cfg") or {})
        vision = (config.get("model_cfg") or config).get("vision_cfg") or {}
        if "size" not in found and "image_size" in vision:
            found["size"] = vision["image_size"]
        return found
    if path.is_file():
        return {}  # a state dict carries no preprocessing
    name, _, tag = source.partition(":")
    if open_clip.get_model_config(name) is None:
        raise ValueError(
            f"ImagePreprocess: from_pretrained {source!r} is neither a file, a directory nor an "
            "open_clip model name; pass an open_clip model directory, its open_clip_config.json, "
            "or '<model>:<tag>' from open_clip.list_pretrained()."
        )
    found = dict(open_clip.get_pretrained_cfg(name, tag)) if tag else {}
    found["size"] = open_clip.get_model_config(name)["vision_cfg"].get("image_size")
    return {k: v for k, v in found.items() if v is not None}
