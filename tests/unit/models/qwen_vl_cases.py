"""Tiny Qwen2-VL / Qwen2.5-VL models built offline from transformers' config classes, and one
batch mixing a text-only sample, a one-image sample and a sample with two images of different
resolutions: shared by the one-process parity tests and the 2-process layout worker."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_mmpar.data.qwen_packing import QwenVLCollator

IMG, START, END = 100, 101, 102
VOCAB = 128
MERGE = 2
PATCH, TEMPORAL = 4, 2
PATCH_DIM = 3 * TEMPORAL * PATCH * PATCH
GRIDS: tuple[tuple[tuple[int, int, int], ...], ...] = ((), ((1, 4, 6),), ((1, 4, 4), (1, 6, 8)))
"""Image grids (t, h, w) per sample: text only; one image; two images of different sizes."""
TEXT = (11, 7, 9)


def hf_config(family: str, **vision: Any) -> Any:
    """A tiny transformers config of ``family`` (``qwen2_vl`` or ``qwen2_5_vl``)."""
    text = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2, 3, 3],
        },
    }
    common = {"depth": 3, "num_heads": 4, "patch_size": PATCH, "temporal_patch_size": TEMPORAL}
    ids = {"image_token_id": IMG, "vision_start_token_id": START, "vision_end_token_id": END}
    if family == "qwen2_vl":
        from transformers import Qwen2VLConfig

        v = {"embed_dim": 32, "hidden_size": 64, "mlp_ratio": 2, **common, **vision}
        return Qwen2VLConfig(vision_config=v, text_config=text, video_token_id=103, **ids)
    from transformers import Qwen2_5_VLConfig

    v = {
        "hidden_size": 32,
        "intermediate_size": 48,
        "out_hidden_size": 64,
        "window_size": 16,  # 2 x 2 merged units: several windows per image
        "fullatt_block_indexes": [1],
        **common,
        **vision,
    }
    return Qwen2_5_VLConfig(vision_config=v, text_config=text, video_token_id=103, **ids)


def hf_model(family: str, seed: int = 0) -> Any:
    """The transformers model of :func:`hf_config`, random weights (seeded), fp32, eval."""
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration

    torch.manual_seed(seed)
    cls = (
        Qwen2VLForConditionalGeneration
        if family == "qwen2_vl"
        else Qwen2_5_VLForConditionalGeneration
    )
    config = hf_config(family)
    config._attn_implementation = "sdpa"
    model = cls(config).float().eval()
    with torch.no_grad():  # non-trivial norm weights and biases
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def samples(seed: int = 1) -> list[dict[str, Any]]:
    """Three samples (one marker per image, between vision start / end tokens)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k, (grids, length) in enumerate(zip(GRIDS, TEXT, strict=True)):
        text = torch.randint(3, IMG, (length,), generator=g).tolist()
        ids = text[:2]
        for n, _ in enumerate(grids):
            ids += [START, IMG, END, *text[2 + n : 3 + n]]
        ids += text[2 + len(grids) :]
        grid = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
        patches = int(grid.prod(-1).sum())
        pix = torch.randn(patches, PATCH_DIM, generator=g)
        ids_t = torch.tensor(ids)
        out.append(
            {
                "id": f"s{k}",
                "input_ids": ids_t,
                "labels": ids_t.clone(),
                "pixel_values": pix,
                "image_grid_thw": grid,
            }
        )
    return out


def collate(pack: bool, **kwargs: Any) -> dict[str, Tensor]:
    """The samples collated by :class:`QwenVLCollator` (``pack=False``: one per row)."""
    collator = QwenVLCollator(
        max_tokens=64, image_token_id=IMG, spatial_merge_size=MERGE, pack=pack, **kwargs
    )
    return collator(samples())


def hf_inputs() -> dict[str, Tensor]:
    """transformers' inputs for the same samples: expanded image tokens, right padding,
    the batch's patches flattened and ``image_grid_thw [N, 3]``."""
    batch = collate(pack=False)
    ids = batch["input_ids"]
    items = samples()
    return {
        "input_ids": ids,
        "attention_mask": (batch["sample_ids"] >= 0).long(),
        "mm_token_type_ids": (ids == IMG).int(),
        "pixel_values": torch.cat([s["pixel_values"] for s in items]),
        "image_grid_thw": torch.cat([s["image_grid_thw"] for s in items]),
    }


def hf_logits(model: Any) -> Tensor:
    """transformers' logits ``[B, T, V]`` on :func:`hf_inputs`."""
    with torch.no_grad():
        return model(**hf_inputs()).logits


def relative(a: Tensor, b: Tensor) -> float:
    """``max |a - b| / max |b|``."""
    return float((a - b).abs().max() / b.abs().max())
