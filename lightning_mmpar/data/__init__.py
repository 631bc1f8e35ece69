"""Data: the offline digits demo, CSV/JSONL caption datasets and a word-level tokenizer."""

from lightning_mmpar.data.captions import (
    CLIP_MEAN,
    CLIP_STD,
    CaptionRow,
    CaptionsDataModule,
    CaptionsDataset,
    CaptionsFormat,
    SkippedRow,
    clip_transform,
    index_captions,
)
from lightning_mmpar.data.digits import CLASS_NAMES, TEMPLATES, DigitsCaptions, DigitsDataset
from lightning_mmpar.data.sampler import ResumableRandomSampler
from lightning_mmpar.data.tokenizer import IGNORE_INDEX, SPECIAL_TOKENS, WordTokenizer

__all__ = [
    "CLASS_NAMES",
    "CLIP_MEAN",
    "CLIP_STD",
    "IGNORE_INDEX",
    "SPECIAL_TOKENS",
    "TEMPLATES",
    "CaptionRow",
    "CaptionsDataModule",
    "CaptionsDataset",
    "CaptionsFormat",
    "DigitsCaptions",
    "DigitsDataset",
    "ResumableRandomSampler",
    "SkippedRow",
    "WordTokenizer",
    "clip_transform",
    "index_captions",
]
