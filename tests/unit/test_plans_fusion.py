"""Plan-time validation of the fusion model's tensor-parallel plans (no process group needed)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from lightning_mmpar.models.adapter import AdapterConfig
from lightning_mmpar.models.fusion import FusionConfig
from lightning_mmpar.models.language import LanguageConfig
from lightning_mmpar.models.vision import VisionConfig
from lightning_mmpar.plans.fusion import (
    apply_tensor_parallel,
    validate_tensor_parallel,
)


def config(**changes: Any) -> FusionConfig:
    vision = VisionConfig(image_size=16, patch_size=4, width=32, heads=4, mlp_ratio=2.0)
    language = LanguageConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=8, num_key_value_heads=4,
    )  # fmt: skip
    adapter = AdapterConfig(heads=4, width=16, ffn_width=24)
    parts = {"vision": vision, "language": language, "adapter": adapter}
    for tower in parts:
        fields = {k.split("__")[1]: v for k, v in changes.items() if k.startswith(tower + "__")}
        parts[tower] = dataclasses.replace(parts[tower], **fields)
    return FusionConfig(**parts)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("change", "tp", "message"),
    [
        ({"vision__heads": 2}, 4, r"vision.transformer.resblocks.\*.attn: VisionConfig.heads \(2\) "
         r"must be divisible by the tensor-parallel size \(4\); nearest valid sizes: 4\."),
        ({"vision__mlp_ratio": 1.1875}, 4, r"vision.transformer.resblocks.\*.mlp: "
         r"VisionConfig.mlp_width \(38\) .*\(4\); nearest valid sizes: 36 or 40\."),
        ({"vision__heads": 16, "vision__mlp_ratio": 1.75}, 16,
         r"VisionConfig.mlp_width \(56\) .* nearest valid sizes: 48 or 64\."),
        ({"adapter__heads": 2, "adapter__width": 16}, 4, r"adapters.\*.attn: AdapterConfig.heads "
         r"\(2\) .* nearest valid sizes: 4\."),
        ({"adapter__ffn_width": 26}, 4, r"adapters.\*.mlp: AdapterConfig.ffn_width \(26\) .* "
         r"nearest valid sizes: 24 or 28\."),
        ({"language__num_attention_heads": 6, "language__num_key_value_heads": 2}, 4,
         r"language.layers.\*.self_attn: LanguageConfig.num_attention_heads \(6\) .* 4 or 8\."),
        ({"language__num_key_value_heads": 2}, 4, r"language.layers.\*.self_attn: "
         r"LanguageConfig.num_key_value_heads \(2\) .* nearest valid sizes: 4\."),
        ({"language__intermediate_size": 50}, 4, r"language.layers.\*.mlp: "
         r"LanguageConfig.intermediate_size \(50\) .* 48 or 52\."),
        ({"language__vocab_size": 65}, 2, r"language.embed_tokens/lm_head: "
         r"LanguageConfig.vocab_size \(65\) .* \(2\); nearest valid sizes: 64 or 66\."),
    ],
)  # fmt: skip
def test_indivisible_sizes_name_module_field_value_and_fix(
    change: dict[str, Any], tp: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        validate_tensor_parallel(config(**change), tp)


def test_replicated_vision_is_not_checked() -> None:
    validate_tensor_parallel(config(vision__heads=2), 4, vision_parallel="replicate")
    validate_tensor_parallel(config(), 4)


def test_option_errors() -> None:
    with pytest.raises(ValueError, match=r"vision_parallel \('sharded'\) must be 'tp' or"):
        apply_tensor_parallel(None, None, vision_parallel="sharded")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"vl_combine \('sum'\) must be 'all_reduce' or"):
        apply_tensor_parallel(None, None, vl_combine="sum")  # type: ignore[arg-type]
