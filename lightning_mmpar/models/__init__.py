"""Plain-torch models (no ``torch.distributed``): the CLIP-ViT + adapter + LLaMA fusion model,
its towers, its pipeline blocks with their costs, open_clip / transformers converters,
transformers vision-language checkpoints (``hf``: :func:`from_hf`, :func:`save_hf`), and the
multimodal mixture-of-experts feed-forward layer (``moe``, ``moe_routing``)."""

from lightning_mmpar.models.adapter import AdapterConfig, CrossModalAdapter
from lightning_mmpar.models.block_cost import BlockCost, CostTally
from lightning_mmpar.models.blocks import MAX_LOGIT_SCALE, FusionBlock, FusionOutput
from lightning_mmpar.models.convert import (
    build_fusion_model,
    export_llama,
    export_open_clip_visual,
    import_llama,
    import_open_clip_visual,
    open_clip_model_config,
    save_llama_pretrained,
)
from lightning_mmpar.models.decoding import DecodeCache
from lightning_mmpar.models.fusion import FusionConfig, FusionModel, freeze_for_finetuning
from lightning_mmpar.models.heads import MomentumHeads, TextPooler, ema_update, momentum_copy
from lightning_mmpar.models.hf import (
    FAMILIES,
    HFFamily,
    from_hf,
    hf_data_args,
    hf_fusion_config,
    save_hf,
)
from lightning_mmpar.models.language import LanguageConfig, LanguageModel, LlamaDecoderLayer
from lightning_mmpar.models.moe import MoEFeedForward, MoEStats, RoutingPlan, TokenDensity
from lightning_mmpar.models.moe_density import GradientDensity
from lightning_mmpar.models.moe_experts import GroupedExperts, grouped_mm_supported, swiglu_experts
from lightning_mmpar.models.moe_routing import (
    MoEConfig,
    RouteDecision,
    aligned_sequence_length,
    alignment_padding_mask,
    expert_capacity,
    load_balancing_loss,
    route_tokens,
    router_z_loss,
    updated_expert_bias,
)
from lightning_mmpar.models.vision import VisionBlock, VisionConfig, VisionTower

__all__ = [
    "FAMILIES",
    "MAX_LOGIT_SCALE",
    "AdapterConfig",
    "BlockCost",
    "CostTally",
    "CrossModalAdapter",
    "DecodeCache",
    "FusionBlock",
    "FusionConfig",
    "FusionModel",
    "FusionOutput",
    "GradientDensity",
    "GroupedExperts",
    "HFFamily",
    "LanguageConfig",
    "LanguageModel",
    "LlamaDecoderLayer",
    "MoEConfig",
    "MoEFeedForward",
    "MoEStats",
    "MomentumHeads",
    "RouteDecision",
    "RoutingPlan",
    "TextPooler",
    "TokenDensity",
    "VisionBlock",
    "VisionConfig",
    "VisionTower",
    "aligned_sequence_length",
    "alignment_padding_mask",
    "build_fusion_model",
    "ema_update",
    "expert_capacity",
    "export_llama",
    "export_open_clip_visual",
    "freeze_for_finetuning",
    "from_hf",
    "grouped_mm_supported",
    "hf_data_args",
    "hf_fusion_config",
    "import_llama",
    "import_open_clip_visual",
    "load_balancing_loss",
    "momentum_copy",
    "open_clip_model_config",
    "route_tokens",
    "router_z_loss",
    "save_hf",
    "save_llama_pretrained",
    "swiglu_experts",
    "updated_expert_bias",
]
