"""Qwen2-VL / Qwen2.5-VL through this package's blocks against transformers' own forward: tiny
models built offline from the config classes; a batch with a text-only sample, a one-image
sample and a sample with two images of different resolutions; unpacked (one sample per row)
and packed rows; logits within 1e-5 relative."""

from __future__ import annotations

import pytest
import torch

from lightning_mmpar.data.qwen_packing import mrope_positions
from lightning_mmpar.models.hf.qwen_convert import (
    export_qwen_vl_state,
    qwen_vl_config,
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
