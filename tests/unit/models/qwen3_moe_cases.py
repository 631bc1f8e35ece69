"""A tiny Qwen3-VL-MoE built offline from transformers' ``Qwen3VLMoeConfig``: 3 ViT blocks with
DeepStack after blocks 0 and 1 and a 4 x 4 learned position grid (interpolated to every image
grid), 3 decoder layers (GQA 4 / 2 heads, head_dim 32 != hidden / heads, layer 1 dense), 4
experts top-2; the batch of :mod:`tests.unit.models.qwen_vl_cases` (a text-only sample, a
one-image sample, a sample with two images of different resolutions)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from tests.unit.models import qwen_vl_cases as qc

EXPERTS, TOP_K, EXPERT_WIDTH = 4, 2, 48


def hf_config(**text: Any) -> Any:
    """The tiny ``Qwen3VLMoeConfig`` (``text`` overrides text_config fields)."""
    from transformers import Qwen3VLMoeConfig

    t = {
        "vocab_size": qc.VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "moe_intermediate_size": EXPERT_WIDTH,
        "num_experts": EXPERTS,
        "num_experts_per_tok": TOP_K,
        "mlp_only_layers": [1],
        "rms_norm_eps": 1e-6,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [6, 5, 5],
            "mrope_interleaved": True,
        },
        **text,
    }
    v = {
        "depth": 3,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_heads": 4,
        "patch_size": qc.PATCH,
        "temporal_patch_size": qc.TEMPORAL,
        "out_hidden_size": 64,
        "num_position_embeddings": 16,
        "deepstack_visual_indexes": [0, 1],
    }
    ids = {
        "image_token_id": qc.IMG,
        "vision_start_token_id": qc.START,
        "vision_end_token_id": qc.END,
        "video_token_id": 103,
    }
    return Qwen3VLMoeConfig(text_config=t, vision_config=v, **ids)


def hf_model(seed: int = 0, **text: Any) -> Any:
    """The transformers model of :func:`hf_config`, random weights (seeded), fp32, eval; the
    router scaled up so top-k choices are far from ties."""
    from transformers import Qwen3VLMoeForConditionalGeneration

    torch.manual_seed(seed)
    config = hf_config(**text)
    config._attn_implementation = "sdpa"
    model = Qwen3VLMoeForConditionalGeneration(config).float().eval()
    with torch.no_grad():  # non-trivial norm weights and biases, decisive routers
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("mlp.gate.weight"):
                p.mul_(20.0)
    return model


def hf_logits(model: Any) -> Tensor:
    """transformers' logits ``[B, T, V]`` on the shared batch."""
    with torch.no_grad():
        return model(**qc.hf_inputs()).logits
