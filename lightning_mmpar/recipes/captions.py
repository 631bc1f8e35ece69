"""Deprecated alias of :mod:`lightning_mmpar.recipes.caption_writer`; removed in the next
release (YAML class path: ``lightning_mmpar.recipes.CaptionWriter``)."""

import warnings

from lightning_mmpar.recipes.caption_writer import CaptionWriter

__all__ = ["CaptionWriter"]

warnings.warn(
    "lightning_mmpar.recipes.captions moved to lightning_mmpar.recipes.caption_writer; use "
    "lightning_mmpar.recipes.CaptionWriter (this alias goes in the next release).",
    DeprecationWarning,
    stacklevel=2,
)
