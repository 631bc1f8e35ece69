"""Plan-time validation of the fusion model's tensor-parallel plans (no process group needed)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_mmpar.models.fusion import FusionConfig, FusionModel
from lightning_mmpar.parallel.data import partial_over_tp_parameters
from lightning_mmpar.parallel.tensor import gather_rows, local_rows
from lightning_mmpar.plans.fusion import (
    FusionPlanOptions,
    apply_tensor_parallel,
    dropout_regions,
    fusion_plan,
    validate_tensor_parallel,
)
from lightning_mmpar.plans.fusion_vision import (
    apply_vision_data_parallel,
    check_vision_batch,
    parallelize_vision,
)
from lightning_mmpar.topology import ParallelDims
from tests.builders import tiny_fusion_config


def config(**changes: Any) -> FusionConfig:
    """The ``tp`` preset of :func:`tests.builders.tiny_fusion_config` (heads split over tp 2, 4)."""
    return tiny_fusion_config("tp", **changes)


@pytest.mark.parametrize(
    ("change", "tp", "message"),
    [
        (
            {"vision__heads": 2},
            4,
            r"vision.transformer.resblocks.\*.attn: VisionConfig.heads \(2\) "
            r"must be divisible by the tensor-parallel size \(4\); nearest valid heads: 4; "
            r"or tensor_parallel 1 or 2\.",
        ),
        (
            {"vision__mlp_ratio": 1.1875},
            4,
            r"vision.transformer.resblocks.\*.mlp: "
            r"VisionConfig.mlp_width \(38\) .*\(4\); nearest valid \w+: 36 or 40;",
        ),
        (
            {"vision__heads": 16, "vision__mlp_ratio": 1.75},
            16,
            r"VisionConfig.mlp_width \(56\) .* nearest valid \w+: 48 or 64;",
        ),
        (
            {"adapter__heads": 2, "adapter__width": 16},
            4,
            r"adapters.\*.attn: AdapterConfig.heads "
            r"\(2\) .* nearest valid \w+: 4;",
        ),
        (
            {"adapter__ffn_width": 26},
            4,
            r"adapters.\*.mlp: AdapterConfig.ffn_width \(26\) .* "
            r"nearest valid \w+: 24 or 28;",
        ),
        (
            {"language__num_attention_heads": 6, "language__num_key_value_heads": 2},
            4,
            r"language.layers.\*.self_attn: LanguageConfig.num_attention_heads \(6\) .* 4 or 8;",
        ),
        (
            {"language__num_key_value_heads": 2},
            4,
            r"language.layers.\*.self_attn: "
            r"LanguageConfig.num_key_value_heads \(2\) .* nearest valid \w+: 4;",
        ),
        (
            {"language__intermediate_size": 50},
            4,
            r"language.layers.\*.mlp: "
            r"LanguageConfig.intermediate_size \(50\) .* 48 or 52;",
        ),
        (
            {"language__vocab_size": 65},
            2,
            r"language.embed_tokens/lm_head: "
            r"LanguageConfig.vocab_size \(65\) .* \(2\); nearest valid \w+: 64 or 66;",
        ),
    ],
)
def test_indivisible_sizes_name_module_field_value_and_fix(
    change: dict[str, Any], tp: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        validate_tensor_parallel(config(**change), tp)


def test_replicated_vision_is_not_checked() -> None:
    validate_tensor_parallel(config(vision__heads=2), 4, vision_parallel="replicate")
    validate_tensor_parallel(config(vision__heads=2), 4, vision_parallel="dp")
    validate_tensor_parallel(config(), 4)
    with pytest.raises(ValueError, match=r"VisionConfig.layers is 0; use layers >= 1 or"):
        validate_tensor_parallel(config(vision__layers=0), 2, vision_parallel="dp")


def test_option_errors() -> None:
    with pytest.raises(ValueError, match=r"\('sharded'\) must be 'tp' or 'replicate' or 'dp'"):
        apply_tensor_parallel(None, None, vision_parallel="sharded")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"vl_combine \('sum'\) must be 'all_reduce' or"):
        apply_tensor_parallel(None, None, vl_combine="sum")  # type: ignore[arg-type]


def test_vision_dp_batch_check() -> None:
    check_vision_batch(4, 2)
    message = (
        r"vision_parallel='dp' splits the images of the micro-batch over the tensor-parallel "
        r"ranks: its size \(6\) must be divisible by tensor_parallel \(4\); use a multiple of "
        r"4 images per micro-batch \(e.g. 4: .*\) or vision_parallel='replicate'\."
    )
    with pytest.raises(ValueError, match=message):
        check_vision_batch(6, 4)
    foreign = ParallelDims(world_size=2, tp=2)  # another strategy's layout: no mm_parallel mesh
    with pytest.raises(
        ValueError, match=r"'dp' needs the mm_parallel strategy .* vision_parallel='replicate'"
    ):
        parallelize_vision(None, foreign, "dp")  # type: ignore[arg-type]
    parallelize_vision(None, foreign, "replicate")  # type: ignore[arg-type]


def test_vision_dp_plan_without_process_group() -> None:
    """One process: the row helpers are the identity and ``dp`` installs nothing; the plan has
    no vision styles (as ``replicate``); ViT dropout (none in open_clip's ViT) gets the
    ``tensor-parallel`` region under ``dp`` only."""
    torch.manual_seed(0)
    model = FusionModel(config())
    x = torch.randn(3, 2)
    assert local_rows(x, None) is x and gather_rows(x, None) is x
    apply_vision_data_parallel(model.vision, None)
    assert partial_over_tp_parameters(model) == []
    assert not model.vision.conv1._forward_pre_hooks
    for layout in ("replicate", "dp"):
        plan = fusion_plan(model, FusionPlanOptions(vision_parallel=layout))  # type: ignore[arg-type]
        assert all(not g.path.startswith("vision") for g in plan.tensor_parallel)
    model.vision.transformer.resblocks[0].register_module("drop", nn.Dropout(0.1))
    path = "vision.transformer.resblocks.0.drop"
    for layout, region in (("tp", "replicated"), ("dp", "tensor-parallel")):
        regions = dropout_regions(model, sequence_parallel=False, vision_parallel=layout)  # type: ignore[arg-type]
        assert regions[-1] == (path, region)
