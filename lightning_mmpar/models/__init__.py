"""Plain-torch models (no ``torch.distributed``): the CLIP-ViT + adapter + LLaMA fusion model,
its towers, its pipeline blocks with their costs, and open_clip / transformers converters."""

from lightning_mmpar.models.adapter import AdapterConfig, CrossModalAdapter
from lightning_mmpar.models.blocks import MAX_LOGIT_SCALE, FusionBlock, FusionOutput
from lightning_mmpar.models.convert import (
    build_fusion_model,
    export_llama,
    export_open_clip_visual,
    import_llama,
    import_open_clip_visual,
    save_llama_pretrained,
)
from lightning_mmpar.models.cost import BlockCost, CostTally
from lightning_mmpar.models.fusion import FusionConfig, FusionModel, freeze_for_finetuning
from lightning_mmpar.models.heads import MomentumHeads, TextPooler, ema_update, momentum_copy
from lightning_mmpar.models.language import LanguageConfig, LanguageModel, LlamaDecoderLayer
from lightning_mmpar.models.vision import VisionBlock, VisionConfig, VisionTower

__all__ = [
    "MAX_LOGIT_SCALE",
    "AdapterConfig",
    "BlockCost",
    "CostTally",
    "CrossModalAdapter",
    "FusionBlock",
    "FusionConfig",
    "FusionModel",
    "FusionOutput",
    "LanguageConfig",
    "LanguageModel",
    "LlamaDecoderLayer",
    "MomentumHeads",
    "TextPooler",
    "VisionBlock",
    "VisionConfig",
    "VisionTower",
    "build_fusion_model",
    "ema_update",
    "export_llama",
    "export_open_clip_visual",
    "freeze_for_finetuning",
    "import_llama",
    "import_open_clip_visual",
    "momentum_copy",
    "save_llama_pretrained",
]
