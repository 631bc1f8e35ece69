"""Qwen2-VL / Qwen2.5-VL through this package's blocks against transformers' own forward: tiny
models built offline from the config classes; a batch with a text-only sample, a one-image
sample and a sample with two images of different resolutions; unpacked (one sample per row)
and packed rows; logits within 1e-5 relative."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_mmpar.data.qwen_packing import QwenVLCollator, mrope_positions
from lightning_mmpar.losses import caption_loss
from lightning_mmpar.models import from_hf, save_hf
from lightning_mmpar.models.hf import hf_fusion_config
from lightning_mmpar.models.hf.qwen2_vl import QwenVLModel
from lightning_mmpar.models.hf.qwen_convert import (
    export_qwen_vl_state,
    import_qwen_vl_state,
    qwen_vl_config,
    qwen_vl_from_hf,
    qwen_vl_from_transformers,
)
from tests.unit.models import qwen_vl_cases as qc

FAMILIES = ("qwen2_vl", "qwen2_5_vl")
RTOL = 1e-5


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request: pytest.FixtureRequest) -> tuple[object, object]:
    hf = qc.hf_model(request.param)
    return hf, qwen_vl_from_transformers(hf).eval()


def test_batch_mixes_text_only_one_and_two_image_samples_of_two_sizes() -> None:
    batch = qc.collate(pack=False)
    assert batch["image_mask"].sum(1).tolist() == [0, 1, 2]
    grids = batch["image_grid_thw"][2].tolist()
    assert grids[0] != grids[1]  # two resolutions in one sample
    assert batch["position_ids"].shape == (3, 3, batch["input_ids"].shape[1])


def test_positions_match_transformers_get_rope_index(pair: tuple[object, object]) -> None:
    hf, _ = pair
    inputs = qc.hf_inputs()
    want, _ = hf.model.get_rope_index(  # type: ignore[attr-defined]
        inputs["input_ids"],
        inputs["mm_token_type_ids"],
        image_grid_thw=inputs["image_grid_thw"],
        attention_mask=inputs["attention_mask"],
    )
    got = qc.collate(pack=False)["position_ids"]
    mask = inputs["attention_mask"].bool()
    assert torch.equal(got.transpose(0, 1)[:, mask], want[:, mask])


def test_unpacked_logits_match_transformers(pair: tuple[object, object]) -> None:
    hf, ours = pair
    want = qc.hf_logits(hf)
    batch = qc.collate(pack=False)
    with torch.no_grad():
        got = ours(batch)  # type: ignore[operator]
    keep = batch["sample_ids"] >= 0
    assert qc.relative(got[keep], want[keep]) <= RTOL


def test_packed_logits_match_transformers(pair: tuple[object, object]) -> None:
    hf, ours = pair
    want = qc.hf_logits(hf)
    batch = qc.collate(pack=True)
    assert batch["input_ids"].shape[0] < 3  # samples share a row
    assert int(batch["sample_ids"].max()) >= 1
    with torch.no_grad():
        got = ours(batch)  # type: ignore[operator]
    unpacked = qc.collate(pack=False)
    flat_got = got[batch["sample_ids"] >= 0]
    flat_want = want[unpacked["sample_ids"] >= 0]  # samples in the same order
    assert qc.relative(flat_got, flat_want) <= RTOL


def test_export_gives_back_transformers_state_dict(pair: tuple[object, object]) -> None:
    hf, ours = pair
    config = qwen_vl_config(hf.config)  # type: ignore[attr-defined]
    exported = export_qwen_vl_state(ours.state_dict(), config)  # type: ignore[attr-defined]
    original = hf.state_dict()  # type: ignore[attr-defined]
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in original)


def test_mrope_positions_of_an_image_between_text() -> None:
    ids = torch.tensor([5, qc.IMG, qc.IMG, qc.IMG, qc.IMG, qc.IMG, qc.IMG, 6])
    pos = mrope_positions(ids, torch.tensor([[1, 4, 6]]), qc.IMG, qc.MERGE)
    assert pos[:, 0].tolist() == [0, 0, 0]
    assert pos[:, 1:7].tolist() == [[1] * 6, [1, 1, 1, 2, 2, 2], [1, 2, 3, 1, 2, 3]]
    assert pos[:, 7].tolist() == [4, 4, 4]  # 1 + max(2, 3)


@pytest.mark.parametrize(
    ("field", "change"),
    [
        (
            "rope_type",
            {
                "rope_parameters": {
                    "rope_type": "yarn",
                    "factor": 2.0,
                    "rope_theta": 1e4,
                    "mrope_section": [2, 3, 3],
                }
            },
        ),
        (
            r"rope_parameters \['mrope_interleaved'\]",
            {
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 1e4,
                    "mrope_section": [2, 3, 3],
                    "mrope_interleaved": True,
                }
            },
        ),
        ("use_sliding_window", {"use_sliding_window": True}),
        ("attention_dropout", {"attention_dropout": 0.1}),
        ("hidden_act", {"hidden_act": "gelu"}),
    ],
)
def test_unsupported_text_config_values_are_refused(field: str, change: dict[str, object]) -> None:
    config = qc.hf_config("qwen2_vl")
    for key, value in change.items():
        setattr(config.text_config, key, value)
    with pytest.raises(ValueError, match=field):
        qwen_vl_config(config)


def test_unsupported_vision_activation_is_refused() -> None:
    config = qc.hf_config("qwen2_vl")
    config.vision_config.hidden_act = "relu"
    with pytest.raises(ValueError, match=r"vision_config\.hidden_act"):
        qwen_vl_config(config)


def test_training_step_matches_transformers(pair: tuple[object, object]) -> None:
    """Loss and every gradient of one step (the gradient of transformers' fused ``qkv`` split
    as the weights are) within 1e-5 relative."""
    hf, ours = pair
    inputs = qc.hf_inputs()
    batch = qc.collate(pack=False)
    hf.zero_grad()  # type: ignore[attr-defined]
    want = hf(**inputs, labels=batch["labels"]).loss  # type: ignore[operator]
    want.backward()
    got = caption_loss(ours(batch), batch["labels"])  # type: ignore[operator]
    ours.zero_grad()  # type: ignore[attr-defined]
    got.backward()
    assert abs(got.item() - want.item()) <= RTOL * abs(want.item())
    hf_grads = {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}  # type: ignore[attr-defined]
    want_grads = import_qwen_vl_state(hf_grads)
    got_grads = {n: p.grad for n, p in ours.named_parameters()}  # type: ignore[attr-defined]
    assert got_grads.keys() == want_grads.keys()
    # a gradient that is zero in exact arithmetic (the key bias under softmax) is rounding
    # noise: floor the scale at 1e-6 of the largest gradient
    floor = 1e-6 * max(float(g.abs().max()) for g in want_grads.values())
    worst = max(
        float((got_grads[n] - g).abs().max()) / max(float(g.abs().max()), floor)
        for n, g in want_grads.items()
    )
    assert worst <= RTOL, worst


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"vision_parallel": "bogus", "sequence_parallel": False}, "vision_parallel"),
        ({"vision_parallel": "tp", "sequence_parallel": True}, "sequence_parallel"),
    ],
)
def test_plan_refuses_unsupported_layouts(kwargs: dict[str, object], field: str) -> None:
    from lightning_mmpar.plans.qwen_vl import check_qwen_vl_layout

    model = qwen_vl_from_transformers(qc.hf_model("qwen2_vl"))
    with pytest.raises(ValueError, match=field):
        check_qwen_vl_layout(model, 2, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"LanguageConfig\.num_attention_heads \(4\)"):
        check_qwen_vl_layout(model, 8, vision_parallel="tp", sequence_parallel=False)


def test_collator_refuses_markers_that_do_not_match_the_grids() -> None:
    sample = qc.samples()[1]
    sample["image_grid_thw"] = torch.cat([sample["image_grid_thw"]] * 2)
    sample["pixel_values"] = torch.cat([sample["pixel_values"]] * 2)
    collator = QwenVLCollator(max_tokens=64, image_token_id=qc.IMG)
    with pytest.raises(ValueError, match="'s1' has 1 image marker"):
        collator([sample])


def test_collator_drops_or_refuses_oversize_samples() -> None:
    items = qc.samples()
    strict = QwenVLCollator(max_tokens=64, image_token_id=qc.IMG, max_patches_per_row=32)
    with pytest.raises(ValueError, match="64 patches > max_patches_per_row"):
        strict(items)
    lenient = QwenVLCollator(
        max_tokens=64, image_token_id=qc.IMG, max_patches_per_row=32, overflow="drop"
    )
    batch = lenient(items)
    assert lenient.stats["dropped"] == 1
    assert batch["image_mask"].sum().item() == 1
    # the batch carries its counts (truncated per row, dropped on row 0) for the training log
    rows = batch["input_ids"].shape[0]
    assert batch["overflow"].tolist() == [[0, 1]] + [[0, 0]] * (rows - 1)


@pytest.mark.parametrize("family", FAMILIES)
def test_directory_round_trip_is_lossless(family: str, tmp_path: Path) -> None:
    """save_pretrained -> from_hf -> save_hf -> from_pretrained (the package's dispatchers,
    through qwen_vl_from_hf / save_qwen_vl_hf): the same
    tensor names, shapes and bytes, and the same logits."""
    hf = qc.hf_model(family)
    hf.save_pretrained(tmp_path / "original")
    (tmp_path / "original" / "tokenizer_config.json").write_text("{}")
    ours = from_hf(tmp_path / "original").eval()
    assert isinstance(ours, QwenVLModel)
    batch = qc.collate(pack=False)
    keep = batch["sample_ids"] >= 0
    with torch.no_grad():
        assert qc.relative(ours(batch)[keep], qc.hf_logits(hf)[keep]) <= RTOL
    written = save_hf(ours, tmp_path / "original", tmp_path / "exported")
    back = type(hf).from_pretrained(tmp_path / "exported").eval()
    original, exported = hf.state_dict(), back.state_dict()
    assert {k: v.shape for k, v in exported.items()} == {k: v.shape for k, v in original.items()}
    assert sum(v.numel() * v.element_size() for v in written.values()) == sum(
        v.numel() * v.element_size() for v in original.values()
    )
    assert all(torch.equal(exported[k], original[k]) for k in original)
    assert (tmp_path / "exported" / "tokenizer_config.json").is_file()
    assert torch.equal(qc.hf_logits(back), qc.hf_logits(hf))


def test_a_directory_without_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"has no config\.json"):
        qwen_vl_from_hf(tmp_path)


def test_the_fusion_path_refuses_a_qwen_directory_by_name(tmp_path: Path) -> None:
    qc.hf_model("qwen2_vl").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="'qwen2_vl' is a Qwen-VL model"):
        hf_fusion_config(tmp_path)


def test_block_costs_grow_with_the_tokens_they_run_on() -> None:
    """The partitioner's per-block FLOPs: vision blocks scale with the image tokens, decoder
    layers and the head with the text, the bridge (a gather) costs nothing."""
    blocks = qwen_vl_from_transformers(qc.hf_model("qwen2_5_vl")).pipeline_blocks()
    kinds = [b.kind for b in blocks]
    assert kinds[0] == "vision" and kinds[-1] == "head" and "aligner" in kinds
    for block in blocks:
        base = block.cost(8, 16).flops
        more_images, more_text = block.cost(16, 16).flops, block.cost(8, 32).flops
        if block.kind == "vision":
            assert more_images > base > 0 and more_text == base
        elif block.kind == "aligner":
            assert base == more_images == more_text == 0
        else:
            assert more_text > base > 0 and more_images == base


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl_moe"])
def test_no_block_returns_a_view(family: str) -> None:
    """Every pipeline block's outputs own their storage (FSDP2 warns that a wrapped module
    returning a view can lose its pre-backward hook: it did for the patch merger), on a batch
    with text-only, one- and two-image samples."""
    from lightning_mmpar.models.hf.qwen3_convert import qwen3_moe_vl_from_transformers
    from tests.unit.models import qwen3_moe_cases as mc

    model = (
        qwen_vl_from_transformers(qc.hf_model(family))
        if family == "qwen2_vl"
        else qwen3_moe_vl_from_transformers(mc.hf_model())
    )
    state = model.pipeline_inputs(qc.collate(pack=True))
    with torch.no_grad():
        for block in model.pipeline_blocks():
            state = block(*state)
            state = state if isinstance(state, tuple) else (state,)
            views = [i for i, t in enumerate(state) if t._base is not None]
            assert not views, (type(block).__name__, views)
