"""Data: the offline digits demo and question task, CSV/JSONL caption files, WebDataset shards,
LLaVA-format conversations with 0..N images, ragged batches (dynamic-resolution ones for
Qwen-VL), tokenizers and image preprocessing from the vision tower's config."""

from lightning_mmpar.data.caption_files import (
    CaptionRow,
    CaptionsFormat,
    SkippedRow,
    index_captions,
)
from lightning_mmpar.data.captions import CaptionsDataModule, CaptionsDataset
from lightning_mmpar.data.chat import IMAGE_MARKER, ChatEncoder
from lightning_mmpar.data.conversation_shards import ShardedConversations
from lightning_mmpar.data.conversations import ConversationDataModule, RaggedDataModule
from lightning_mmpar.data.digits import CLASS_NAMES, TEMPLATES, DigitsCaptions, DigitsDataset
from lightning_mmpar.data.digits_vqa import DigitsVQA
from lightning_mmpar.data.hf_tokenizer import HFTokenizer, load_tokenizer
from lightning_mmpar.data.llava import ConversationDataset, ConversationRecord, read_conversations
from lightning_mmpar.data.packing import RAGGED_KEYS, MultimodalCollator
from lightning_mmpar.data.qwen_packing import QWEN_VL_BATCH_KEYS, QwenVLCollator
from lightning_mmpar.data.sampler import ResumableRandomSampler
from lightning_mmpar.data.text import CaptionTokenizer
from lightning_mmpar.data.tokenizer import IGNORE_INDEX, SPECIAL_TOKENS, WordTokenizer
from lightning_mmpar.data.transforms import CLIP_MEAN, CLIP_STD, ImagePreprocess, clip_transform
from lightning_mmpar.data.webdataset import WebDatasetCaptions

__all__ = [
    "CLASS_NAMES",
    "CLIP_MEAN",
    "CLIP_STD",
    "IGNORE_INDEX",
    "IMAGE_MARKER",
    "QWEN_VL_BATCH_KEYS",
    "RAGGED_KEYS",
    "SPECIAL_TOKENS",
    "TEMPLATES",
    "CaptionRow",
    "CaptionTokenizer",
    "CaptionsDataModule",
    "CaptionsDataset",
    "CaptionsFormat",
    "ChatEncoder",
    "ConversationDataModule",
    "ConversationDataset",
    "ConversationRecord",
    "DigitsCaptions",
    "DigitsDataset",
    "DigitsVQA",
    "HFTokenizer",
    "ImagePreprocess",
    "MultimodalCollator",
    "QwenVLCollator",
    "RaggedDataModule",
    "ResumableRandomSampler",
    "ShardedConversations",
    "SkippedRow",
    "WebDatasetCaptions",
    "WordTokenizer",
    "clip_transform",
    "index_captions",
    "load_tokenizer",
    "read_conversations",
]
