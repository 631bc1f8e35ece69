"""Images per sample in the fusion model's cost (``fusion_model_spec(images_per_sample=K)``,
``measure_blocks``): the vision work, the image stream and the ViT collectives scale with K; the
text's do not; K = 0 prices the zero dummy image a micro-batch without images still encodes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from lightning_mmpar.layout import ParallelLayout
from lightning_mmpar.layout.cost import DEVICES, predict
from lightning_mmpar.layout.model import ModelSpec
from lightning_mmpar.layout.stages import measure_blocks
from lightning_mmpar.plans.fusion_cost import fusion_model_spec, vision_images
from lightning_mmpar.recipes.module import ClipLlamaModule
from lightning_mmpar.recipes.planner import _with_image_tokens, base_layout, spec_cache
from tests.builders import tiny_fusion_config

ROOT = Path(__file__).parents[3]
T = 8


@pytest.fixture(scope="module")
def module() -> ClipLlamaModule:
    return ClipLlamaModule(fusion=tiny_fusion_config(), vocab_size=32)


def spec(module: ClipLlamaModule, k: float, **layout: Any) -> ModelSpec:
    return fusion_model_spec(module, ParallelLayout(**layout), T, images_per_sample=k)


def _names(s: ModelSpec, prefix: str) -> list[int]:
    return [i for i, b in enumerate(s.blocks) if b.name.startswith(prefix)]


def test_two_images_double_the_vision_work_and_the_image_stream(module: ClipLlamaModule) -> None:
    one, two = spec(module, 1.0, tp=2), spec(module, 2.0, tp=2)
    for i in _names(one, "vision."):
        assert two.blocks[i].flops == 2 * one.blocks[i].flops > 0
        assert two.blocks[i].activation_bytes == 2 * one.blocks[i].activation_bytes
        # every vision output is the image stream; the text ids / positions are not
        for a, b in zip(one.boundaries[i], two.boundaries[i], strict=True):
            assert b.bytes_per_sample == (2 if a.requires_grad else 1) * a.bytes_per_sample
        vit = [c for c in one.collectives[i] if c.dim == "tp"]
        assert [c.bytes_per_sample * 2 for c in vit] == [
            c.bytes_per_sample for c in two.collectives[i] if c.dim == "tp"
        ]
    bridge = _names(one, "bridge")[0]
    img, pooled, h, ht = (one.boundaries[bridge][j].bytes_per_sample for j in range(4))
    got = [two.boundaries[bridge][j].bytes_per_sample for j in range(4)]
    assert got == [2 * img, 2 * pooled, h, ht]  # the image stream doubles, the text does not
    head = _names(one, "head")[0]
    assert two.blocks[head].flops == one.blocks[head].flops  # the text's work stays
    for i in _names(one, "decoder"):  # joint attention: image keys and values double
        extra = two.blocks[i].flops - one.blocks[i].flops
        assert 0 < extra < one.blocks[i].flops
        text_rows = {c.bytes_per_sample for c in one.collectives[i] if c.phase == "forward"}
        assert text_rows == {c.bytes_per_sample for c in two.collectives[i] if c.phase == "forward"}


def test_text_only_prices_one_dummy_image_per_micro_batch(module: ClipLlamaModule) -> None:
    one = spec(module, 1.0, tp=2, micro_batch_size=4)
    none = spec(module, 0.0, tp=2, micro_batch_size=4)
    for i in _names(one, "vision."):  # the zero dummy: one image per micro-batch of 4
        assert none.blocks[i].flops == pytest.approx(one.blocks[i].flops / 4)
        assert all(b.bytes_per_sample == 0 for b in none.boundaries[i] if b.requires_grad)
    bridge = _names(one, "bridge")[0]
    assert [b.bytes_per_sample for b in none.boundaries[bridge][:2]] == [0, 0]  # no image slot
    for i in _names(one, "adapter"):  # no image tokens: no k / v rows to reduce
        sizes = {c.bytes_per_sample for c in none.collectives[i] if c.phase == "backward"}
        assert 0 in sizes and 0 not in {c.bytes_per_sample for c in one.collectives[i]}
    assert vision_images(0.0, 4) == 0.25 and vision_images(0.5, 4) == 0.5
    assert vision_images(0.1, 1) == 1.0 and vision_images(2.0, 8) == 2.0
    assert none.extra["images_per_sample"] == 0.0


def test_bad_images_per_sample_name_the_argument(module: ClipLlamaModule) -> None:
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"images_per_sample \((-1.0|nan|inf)\) must be"):
            spec(module, bad)
    block = SimpleNamespace(kind="vision", cost=None, parameters=list)
    with pytest.raises(ValueError, match=r"images_per_sample \(-0.5\) must be a finite number"):
        measure_blocks([block], 4, 8, ["v"], images_per_sample=-0.5)


def test_measure_blocks_scales_vision_and_interpolates_the_rest() -> None:
    def cost(n: int, t: int) -> Any:
        return SimpleNamespace(flops=10.0 * t + 3.0 * n, activation_bytes=2.0 * t + n)

    vision = SimpleNamespace(kind="vision", cost=lambda n, t: cost(n, 0), parameters=list)
    text = SimpleNamespace(kind="language", cost=cost, parameters=list)
    one = measure_blocks([vision, text], 4, 8, ["v", "d"])
    k = measure_blocks([vision, text], 4, 8, ["v", "d"], images_per_sample=2.5, vision_images=3)
    assert (one[0].flops, k[0].flops) == (12.0, 36.0)  # the tower: x vision_images
    assert (one[1].flops, k[1].flops) == (92.0, 80.0 + 2.5 * 12.0)  # text + K x image tokens
    assert k[1].activation_bytes == 16.0 + 2.5 * 4.0


def test_more_images_per_sample_change_the_16gpu_ranking() -> None:
    """The 16-GPU recipe on LLaVA-like captions (512 tokens, 576 image tokens): pp 2 x dp 8 is
    faster than tp 4 x dp 4 at one image per sample; at four images the ViT's work (whole on
    each pipeline's first rank, split 4 ways under tp 4) decides the other way."""
    from lightning_mmpar.recipes.partition import build_module, load_recipe

    config, _ = _with_image_tokens(load_recipe(str(ROOT / "recipes/clip_llama_16gpu.yaml")), 576)
    module, _ = build_module(config)
    base = replace(base_layout(config, module, "bf16-mixed"), data_parallel="ddp")
    pipeline = replace(base, pp=2, dp=8, micro_batches=8, micro_batch_size=1)
    tensor = replace(base, tp=4, dp=4, micro_batch_size=16, sequence_parallel=True)
    h100 = DEVICES["h100"]

    def seconds(k: float) -> tuple[float, float]:
        price = spec_cache(module, 512, k)
        a, b = (predict(price(x), x, h100).step_seconds for x in (pipeline, tensor))
        return a, b

    one, four = seconds(1.0), seconds(4.0)
    assert one[0] < one[1] and four[0] > four[1]


def test_planner_takes_images_per_sample_from_the_option_the_data_or_one() -> None:
    from lightning_mmpar.data import DigitsVQA
    from lightning_mmpar.recipes.planner import _images_per_sample

    data = DigitsVQA(max_images=3)
    given, unset = SimpleNamespace(images_per_sample=0.0), SimpleNamespace(images_per_sample=None)
    assert _images_per_sample(given, data) == (0.0, "--images-per-sample")
    assert _images_per_sample(unset, data) == (1.5, "the YAML's DigitsVQA.images_per_sample")
    assert _images_per_sample(unset, SimpleNamespace()) == (1.0, "the default")


def test_packed_rows_carry_all_their_samples_images() -> None:
    """``--samples-per-row S`` prices a packed row (tests/unit/data/test_packing.py: several
    samples share one): the vision work, its kept activations and the vision rows' memory are
    those of ``S x images_per_sample`` images per row, the text's are not, and a step's samples
    fill ``S`` times fewer rows."""
    from lightning_mmpar.recipes import planner

    argv = ["--config", str(ROOT / "recipes/digits_vqa_cpu.yaml"), "--gpus", "2"]
    one, four = (
        planner._prepare(planner._parser().parse_args([*argv, "--samples-per-row", s]))
        for s in ("1", "4")
    )
    assert "1.5 images per sample (the YAML's DigitsVQA.images_per_sample), 4 samples per " in (
        four.workload
    )
    assert four.workload.endswith("packed row (--samples-per-row): 6 images per row")
    layout = replace(one.base, dp=2, micro_batch_size=4)
    a, b = one.model(layout), four.model(layout)
    for i in _names(a, "vision."):
        assert b.blocks[i].flops == 4 * a.blocks[i].flops > 0
        assert b.blocks[i].activation_bytes == 4 * a.blocks[i].activation_bytes
    head = _names(a, "head")[0]
    assert b.blocks[head].flops == a.blocks[head].flops  # a row's text is the same row
    cpu = DEVICES["cpu"]
    pa, pb = predict(a, layout, cpu), predict(b, layout, cpu)
    assert pb.compute_seconds > pa.compute_seconds
    assert pb.memory.activations > pa.memory.activations
    args = planner._parser().parse_args([*argv, "--samples-per-row", "4", "--vision-ranks", "0"])
    ranked, _ = planner._rank(args, four)
    assert {p.layout.dp_size * p.layout.local_batch for p in ranked} == {8}  # 32 samples, 8 rows
    best = ranked[0].layout  # its YAML's data.batch_size: the samples that fill its rows
    assert planner.fragment(best, samples_per_row=4)["data"]["batch_size"] * best.dp_size == 32
