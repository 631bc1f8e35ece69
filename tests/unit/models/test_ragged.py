"""The fusion model on ragged (packed, 0..N images per sample) batches at one process (issue 28
items 1-3): the one-image batch in the new form equals the one-image path, packed equals
unpacked per sample, packed samples are isolated, text-only batches still train every tower."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_mmpar.data.packing import MultimodalCollator
from lightning_mmpar.models.fusion import FusionModel
from lightning_mmpar.models.moe_routing import MoEConfig
from lightning_mmpar.models.ragged import block_causal_mask, image_cross_mask
from tests.builders import tiny_fusion_model

IMG = 7  # marker / image token id
PATCHES = 4  # (16 / 8) ** 2 patch tokens per image in the recipe preset
DROPLESS = MoEConfig(
    num_experts=4,
    top_k=2,
    ffn_width=32,
    router_dim=8,
    capacity_factor=None,
    aux_loss_weight=0.0,
    z_loss_weight=0.0,
)


def _samples(seed: int = 0, images: tuple[int, ...] = (1, 0, 3, 1)) -> list[dict[str, Any]]:
    """Samples with ``images[k]`` images: text, markers after the first token, text."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k, n in enumerate(images):
        head = torch.randint(10, 90, (1,), generator=g).tolist()
        tail = torch.randint(10, 90, (3 + k,), generator=g).tolist()
        ids = torch.tensor(head + [IMG] * n + tail)
        pix = torch.randn(n, 3, 16, 16, generator=g)
        out.append({"id": f"s{k}", "input_ids": ids, "labels": ids.clone(), "pixel_values": pix})
    return out


def _model(fusion: str = "cross_attention", moe: MoEConfig | None = None) -> FusionModel:
    token = IMG if fusion == "spliced" else None
    model = tiny_fusion_model(
        fusion=fusion, image_token_id=token, language__moe=moe, adapter__moe=moe
    )
    return model.train()


def _collate(samples: list[dict[str, Any]], fusion: str, pack: bool) -> dict[str, Tensor]:
    seq = PATCHES if fusion == "spliced" else 0
    c = MultimodalCollator(max_tokens=128, image_token_id=IMG, image_seq_length=seq, pack=pack)
    return c(samples)


def _per_sample(logits: Tensor, batch: dict[str, Tensor], row: int, sample: int) -> Tensor:
    """Per-token CE of one packed sample (shifted: position t predicts t + 1)."""
    keep = batch["sample_ids"][row] == sample
    z, y = logits[row][keep], batch["labels"][row][keep]
    return F.cross_entropy(z[:-1], y[1:], ignore_index=-100, reduction="none")


def test_one_image_batch_in_ragged_form_equals_the_one_image_path() -> None:
    model = _model()
    g = torch.Generator().manual_seed(1)
    ids, img = torch.randint(4, 90, (3, 6), generator=g), torch.randn(3, 3, 16, 16, generator=g)
    legacy = model(img, ids)
    batch = {
        "pixel_values": img[:, None],
        "image_mask": torch.ones(3, 1, dtype=torch.bool),
        "input_ids": ids,
        "position_ids": torch.arange(6).expand(3, 6),
        "sample_ids": torch.zeros(3, 6, dtype=torch.long),
        "image_sample": torch.zeros(3, 1, dtype=torch.long),
        "image_position": torch.zeros(3, 1, dtype=torch.long),
    }
    ragged = model.forward_ragged(batch)
    torch.testing.assert_close(ragged.logits, legacy.logits, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ragged.text_features[:, 0], legacy.text_features)
    torch.testing.assert_close(ragged.image_features[:, 0], legacy.image_features)
    torch.testing.assert_close(ragged.momentum_text[:, 0], legacy.momentum_text)


@pytest.mark.parametrize(
    ("fusion", "moe"),
    [("cross_attention", None), ("spliced", None), ("cross_attention", DROPLESS)],
    ids=["cross-attention", "spliced", "cross-attention moe"],
)
def test_packed_equals_unpacked_per_sample(fusion: str, moe: MoEConfig | None) -> None:
    model, samples = _model(fusion, moe), _samples()
    packed, unpacked = _collate(samples, fusion, True), _collate(samples, fusion, False)
    assert packed["input_ids"].shape[0] == 1 and unpacked["input_ids"].shape[0] == 4
    out_p, out_u = model.forward_ragged(packed), model.forward_ragged(unpacked)
    for k in range(4):
        torch.testing.assert_close(
            _per_sample(out_p.logits, packed, 0, k),
            _per_sample(out_u.logits, unpacked, k, 0),
            rtol=1e-5,
            atol=1e-5,
        )
    # the one-image samples' features (slots 0 and 4 of the packed row; slot 0 of rows 0, 3)
    torch.testing.assert_close(out_p.text_features[0, [0, 4]], out_u.text_features[[0, 3], 0])
    torch.testing.assert_close(out_p.image_features[0, [0, 4]], out_u.image_features[[0, 3], 0])


@pytest.mark.parametrize("fusion", ["cross_attention", "spliced"])
def test_a_packed_sample_sees_nothing_of_its_neighbours(fusion: str) -> None:
    model = _model(fusion)
    samples = _samples(images=(1, 3))
    base = model.forward_ragged(_collate(samples, fusion, True)).logits
    other = _samples(seed=5, images=(1, 2))  # new tokens, images and image count for sample 1
    changed = model.forward_ragged(_collate([samples[0], other[1]], fusion, True)).logits
    n = int((_collate(samples, fusion, True)["sample_ids"][0] == 0).sum())
    torch.testing.assert_close(changed[0, :n], base[0, :n], rtol=1e-6, atol=1e-6)
    assert (changed[0, n : n + 2] - base[0, n : n + 2]).abs().max() > 1e-3  # sample 1 moved


def test_text_only_batch_runs_every_tower_with_zero_gradients() -> None:
    model = _model()
    batch = _collate(_samples(images=(0, 0)), "cross_attention", True)
    assert batch["pixel_values"].shape[1] == 0
    out = model.forward_ragged(batch)
    (out.logits.sum() + out.image_features.sum() + out.text_features.sum()).backward()
    for name in ("vision.conv1.weight", "projector.weight", "adapters.0.attn.k_proj.weight"):
        grad = model.get_parameter(name).grad
        assert grad is not None and grad.abs().max() == 0, name
    assert model.get_parameter("language.embed_tokens.weight").grad.abs().max() > 0


def test_masks_follow_samples_and_image_positions() -> None:
    sid = torch.tensor([[0, 0, 1, 1, -1]])
    mask = block_causal_mask(sid)[0, 0]
    assert mask.tolist() == [
        [True, False, False, False, False],
        [True, True, False, False, False],
        [False, False, True, False, False],
        [False, False, True, True, False],
        [False, False, False, False, True],
    ]
    cross = image_cross_mask(
        sid,
        torch.tensor([[True, True, False]]),
        torch.tensor([[0, 1, -1]]),
        torch.tensor([[1, 2, -1]]),
        tokens_per_image=1,
    )[0, 0]
    assert cross.tolist() == [
        [False, False, False],
        [True, False, False],
        [False, True, False],
        [False, True, False],
        [False, False, False],
    ]


def test_spliced_token_count_mismatch_is_a_clear_error() -> None:
    model = _model("spliced")
    c = MultimodalCollator(max_tokens=64, image_token_id=IMG, image_seq_length=3)
    with pytest.raises(ValueError, match=r"set the collator's image_seq_length to 4"):
        model.forward_ragged(c(_samples(images=(1,))))


def test_spliced_needs_the_image_token_id() -> None:
    with pytest.raises(ValueError, match="image_token_id"):
        tiny_fusion_model(fusion="spliced")
