"""The tests' tiny fusion models, built in one place.

Every test that needs a CLIP-ViT + adapter + LLaMA fusion model small enough for CPU builds it
here, from one of three presets, changing what it needs with ``<part>__<field>=value``
(``part``: ``vision``, ``language`` or ``adapter``; a plain name changes a
:class:`~lightning_mmpar.models.fusion.FusionConfig` field):

* ``"recipe"``: the recipe tests' model (16 px images, 1 ViT layer, 2 joint-attention decoder
  layers, adapter dropout 0: 8 pipeline blocks), the one the parity matrix, the fault, resume,
  export and generation tests train (through :func:`tests.recipes.recipe_faults_worker.
  tiny_module`) and the communication model's byte counts are pinned to;
* ``"tp"``: head counts that split over tensor-parallel degrees 2 and 4 (8 query / 4 key-value
  heads, 4 ViT and adapter heads), for the plan and RNG tests;
* ``"hand"``: the smallest one (8 px images, width 8) whose block costs are counted by hand.

    tiny_fusion_config("recipe", language__num_hidden_layers=1)
    tiny_fusion_model("tp", adapter__num_blocks=2, adapter__dropout=0.5)
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_mmpar.examples.tiny_chat import word_level_tokenizer
from lightning_mmpar.examples.tiny_qwen import CHAT_TEMPLATE as QWEN_CHAT_TEMPLATE
from lightning_mmpar.models.adapter import AdapterConfig
from lightning_mmpar.models.fusion import FusionConfig, FusionModel
from lightning_mmpar.models.language import LanguageConfig
from lightning_mmpar.models.vision import VisionConfig

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "recipe": {
        "vision": {
            "image_size": 16,
            "patch_size": 8,
            "width": 32,
            "layers": 1,
            "heads": 2,
            "output_dim": 16,
        },
        "language": {
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "joint_attention": True,
        },
        "adapter": {"heads": 2, "width": 32, "ffn_width": 48, "dropout": 0.0},
        "fusion": {"contrastive_dim": 16},
    },
    "tp": {
        "vision": {"image_size": 16, "patch_size": 4, "width": 32, "heads": 4, "mlp_ratio": 2.0},
        "language": {
            "vocab_size": 64,
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 1,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
        },
        "adapter": {"heads": 4, "width": 16, "ffn_width": 24},
        "fusion": {},
    },
    "hand": {
        "vision": {
            "image_size": 8,
            "patch_size": 4,
            "width": 8,
            "layers": 1,
            "heads": 2,
            "mlp_ratio": 2.0,
            "output_dim": 6,
        },
        "language": {
            "vocab_size": 16,
            "hidden_size": 8,
            "intermediate_size": 12,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "joint_attention": True,
        },
        "adapter": {"heads": 2, "width": 8, "ffn_width": 12, "dropout": 0.0},
        "fusion": {"contrastive_dim": 4},
    },
}
"""Preset name -> keyword arguments of each part's config (``fusion``: of FusionConfig)."""

PARTS = {"vision": VisionConfig, "language": LanguageConfig, "adapter": AdapterConfig}


def tiny_fusion_config(preset: str = "recipe", **changes: Any) -> FusionConfig:
    """The ``preset``'s :class:`FusionConfig` with ``changes`` applied.

    Raises:
        ValueError: an unknown preset, or a change naming no part (``<part>__<field>``).
    """
    if preset not in PRESETS:
        raise ValueError(f"preset={preset!r}: choose one of {sorted(PRESETS)}.")
    kwargs = {part: dict(fields) for part, fields in PRESETS[preset].items()}
    for key, value in changes.items():
        part, _, name = key.rpartition("__")
        if part and part not in PARTS:
            raise ValueError(f"{key}=: the part before '__' must be one of {sorted(PARTS)}.")
        kwargs[part or "fusion"][name] = value
    parts = {part: cls(**kwargs[part]) for part, cls in PARTS.items()}
    return FusionConfig(**parts, **kwargs["fusion"])


def tiny_fusion_model(preset: str = "recipe", *, seed: int = 0, **changes: Any) -> FusionModel:
    """A :class:`FusionModel` of :func:`tiny_fusion_config`, initialised after
    ``torch.manual_seed(seed)``."""
    config = tiny_fusion_config(preset, **changes)
    torch.manual_seed(seed)
    return FusionModel(config)


def column_parallel_plan(*paths: str) -> Any:
    """A :class:`~lightning_mmpar.parallel.parallelize.ParallelPlan` sharding each ``nn.Linear``
    at ``paths`` column-wise over the ``tp`` mesh: the least tensor parallelism a test module
    needs to run at ``tensor_parallel > 1`` (a module without a plan is refused there)."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    from lightning_mmpar.parallel.parallelize import ParallelPlan
    from lightning_mmpar.parallel.tensor import StyleGroup

    styles = tuple(StyleGroup(path, "tp", ColwiseParallel()) for path in paths)
    return ParallelPlan(tensor_parallel=styles)


def fake_trainer(root: Any, **fields: Any) -> Any:
    """A stand-in ``Trainer`` for callbacks' end-of-fit code (``RunSummary`` and the like): one
    process, rank 0, step 3, no logger, checkpoint callback or data module, logging into
    ``root``; ``fields`` replace or add attributes."""
    from types import SimpleNamespace

    base = {
        "datamodule": None,
        "checkpoint_callback": None,
        "logger": None,
        "default_root_dir": str(root),
        "global_step": 3,
        "world_size": 1,
        "is_global_zero": True,
        "strategy": SimpleNamespace(),
    }
    return SimpleNamespace(**{**base, **fields})


LLAVA_IMAGE_TOKEN = 63
"""The tiny LLaVA's image token (the last id of its 64-token vocabulary)."""


def tiny_llava_dir(path: Any, *, seed: int = 0, **changes: Any) -> Any:
    """A transformers ``LlavaForConditionalGeneration`` directory written offline at ``path``
    (``save_pretrained``: config.json + model.safetensors, a ``CLIPImageProcessor``): a CLIP
    ViT of 16 px images in 4 px patches (16 patch tokens), 3 layers of width 32, quick_gelu;
    a Llama of 2 layers, 4 query / 2 key-value heads, rope_theta 5000, 64 tokens. ``changes``
    set ``LlavaConfig`` fields; ``vision__<field>`` / ``text__<field>`` the sub-configs'."""
    from pathlib import Path

    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    sub: dict[str, dict[str, Any]] = {"vision": {}, "text": {}}
    for key in [k for k in changes if "__" in k]:
        part, name = key.split("__")
        sub[part][name] = changes.pop(key)
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3}
    vision |= {"num_attention_heads": 4, "image_size": 16, "patch_size": 4}
    text = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64}
    text |= {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    text |= {"rope_theta": 5000.0}
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(**(vision | sub["vision"])),
        text_config=LlamaConfig(**(text | sub["text"])),
        image_token_index=LLAVA_IMAGE_TOKEN,
        **({"image_seq_length": 16} | changes),
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():  # transformers' init zeroes biases and sets norms to 1: vary them
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    path = Path(path)
    model.save_pretrained(str(path))
    CLIPImageProcessor(size={"shortest_edge": 16}, crop_size=16).save_pretrained(str(path))
    return path


def llava_samples(images: tuple[int, ...], *, seed: int = 0, length: int = 6) -> list[Any]:
    """One ragged sample (one marker per image, each after two text tokens) per entry of
    ``images`` (its image count), text ids in ``[4, 63)``, 16 px images."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(images):
        text = torch.randint(4, LLAVA_IMAGE_TOKEN, (length + i,), generator=g)
        marker = torch.tensor([LLAVA_IMAGE_TOKEN])
        parts = [text[:2]] + [torch.cat([marker, text[2 + 2 * j : 4 + 2 * j]]) for j in range(n)]
        ids = torch.cat([*parts, text[2 + 2 * n :]])
        pix = torch.randn(n, 3, 16, 16, generator=g)
        out.append({"id": f"s{i}", "input_ids": ids, "labels": ids.clone(), "pixel_values": pix})
    return out


def tiny_qwen_vl_dir(path: Any, words: list[str], family: str = "qwen2_vl", seed: int = 0) -> Any:
    """A transformers Qwen2-VL (or ``family="qwen2_5_vl"``, ``"qwen3_vl_moe"``: the model of
    :func:`tests.unit.models.qwen3_moe_cases.hf_model`) directory written offline at
    ``path``: the tiny model of :func:`tests.unit.models.qwen_vl_cases.hf_model` (128 tokens,
    4 px patches, merge 2), a word-level tokenizer whose ids 100 / 101 / 102 are
    ``<|image_pad|>`` / ``<|vision_start|>`` / ``<|vision_end|>`` (the config's), with
    ``words`` and a chat template, and a ``Qwen2VLImageProcessor`` of 4 px patches (images
    between 8 x 8 and 32 x 32 pixels after its resize)."""
    from pathlib import Path

    from transformers import Qwen2VLImageProcessor

    from tests.unit.models import qwen3_moe_cases as mc
    from tests.unit.models import qwen_vl_cases as qc

    path = Path(path)
    moe = family == "qwen3_vl_moe"
    (mc.hf_model(seed) if moe else qc.hf_model(family, seed=seed)).save_pretrained(str(path))
    special = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = [*special, *words]
    vocab += [f"w{i}" for i in range(qc.IMG - len(vocab))]
    vocab += ["<|image_pad|>", "<|vision_start|>", "<|vision_end|>"]
    assert vocab.index("<|image_pad|>") == qc.IMG and len(vocab) <= qc.VOCAB
    word_level_tokenizer(path, vocab, [*special[4:], *vocab[qc.IMG :]], QWEN_CHAT_TEMPLATE)
    Qwen2VLImageProcessor(
        patch_size=qc.PATCH,
        temporal_patch_size=qc.TEMPORAL,
        merge_size=qc.MERGE,
        min_pixels=8 * 8,
        max_pixels=32 * 32,
    ).save_pretrained(str(path))
    return path
