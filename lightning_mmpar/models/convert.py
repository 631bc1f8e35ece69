"""Import from / export to open_clip and transformers formats (bit-exact round trip).

Sources are objects or local directories, never the network: an open_clip model (or its
``.visual``) or a directory written by open_clip's ``save_for_hf`` (``open_clip_config.json``),
and a ``LlamaForCausalLM`` or a directory written by ``save_pretrained``.

Key mapping: the vision tower's state dict has open_clip's ``visual`` keys (prefix ``vision.`` in
the fusion model; the fused ``attn.in_proj_*`` carry a leading q/k/v dim of 3, folded back on
export); the language tower's keys are ``LlamaForCausalLM``'s with
``model.`` dropped (``model.layers.0.mlp.up_proj.weight`` <->
``language.layers.0.mlp.up_proj.weight``; ``lm_head.weight`` <-> ``language.lm_head.weight``).

Export functions take a *full* fusion state dict: ``model.state_dict()`` of an unsharded model,
or :func:`lightning_mmpar.parallel.tensor.full_state_dict` of a tensor-parallel one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_mmpar.models.adapter import AdapterConfig
from lightning_mmpar.models.fusion import FusionConfig, FusionModel
from lightning_mmpar.models.language import LanguageConfig
from lightning_mmpar.models.vision import VisionConfig, open_clip_shape

JOINT_ONLY_KEYS = ("image_norm.", "self_attn.temperature.")
"""Language parameters with no LLaMA counterpart (joint attention); dropped on export."""


def vision_config_from_open_clip(visual: Any) -> VisionConfig:
    """Read a :class:`VisionConfig` off an open_clip ``VisionTransformer`` instance."""
    if getattr(visual, "attn_pool", None) is not None:
        raise ValueError("open_clip attentional pooling is not supported by VisionTower.")
    blocks = visual.transformer.resblocks
    first = blocks[0]
    if not isinstance(first.attn, nn.MultiheadAttention):
        raise ValueError(
            "open_clip 'custom' blocks (qk_norm, scaled cosine attention) are not supported; "
            "use block_type='default'."
        )
    width = visual.conv1.out_channels
    ls = first.ls_1.gamma.flatten()[0].item() if hasattr(first.ls_1, "gamma") else None
    act: Literal["gelu", "quick_gelu"] = (
        "gelu" if isinstance(first.mlp.gelu, nn.GELU) else "quick_gelu"
    )
    return VisionConfig(
        image_size=visual.image_size[0],
        patch_size=visual.patch_size[0],
        width=width,
        layers=len(blocks),
        heads=first.attn.num_heads,
        mlp_ratio=first.mlp.c_fc.out_features / width,
        output_dim=visual.proj.shape[1],
        pool_type=visual.pool_type,
        final_ln_after_pool=bool(visual.final_ln_after_pool),
        no_ln_pre=isinstance(visual.ln_pre, nn.Identity),
        ls_init_value=ls,
        act=act,
    )


def import_open_clip_visual(
    source: nn.Module | str | Path,
) -> tuple[VisionConfig, dict[str, Tensor]]:
    """``(config, visual state dict)`` from an open_clip model/``.visual`` or a local directory."""
    model: Any = source
    if isinstance(source, str | Path):
        import open_clip

        model = open_clip.create_model(f"local-dir:{source}", load_weights=True)
    visual = getattr(model, "visual", model)
    return vision_config_from_open_clip(visual), dict(visual.state_dict())


_LLAMA_SHARED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "rms_norm_eps",
    "attention_bias",
    "mlp_bias",
)
"""Fields named alike in transformers' ``LlamaConfig`` and :class:`LanguageConfig`."""


def language_config_from_llama(config: Any) -> LanguageConfig:
    """Translate a transformers ``LlamaConfig`` (default RoPE only)."""
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope_type {rope['rope_type']!r} is not supported; only 'default'.")
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act {config.hidden_act!r} is not supported; only 'silu'.")
    return LanguageConfig(
        **{name: getattr(config, name) for name in _LLAMA_SHARED_FIELDS},
        head_dim=getattr(config, "head_dim", None),
        rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
    )


def llama_config(config: LanguageConfig) -> Any:
    """The ``LlamaConfig`` describing a :class:`LanguageConfig` (untied embeddings).

    Raises ``ValueError`` for a decoder with mixture-of-experts layers (``LlamaConfig`` has
    dense FFNs only)."""
    from transformers import LlamaConfig

    if config.moe is not None:
        raise ValueError(
            "LanguageConfig.moe is set: a decoder with mixture-of-experts FFNs has no "
            "LlamaForCausalLM equivalent; export a dense decoder (moe: null)."
        )

    return LlamaConfig(
        **{name: getattr(config, name) for name in _LLAMA_SHARED_FIELDS},
        head_dim=config.dim_per_head,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        tie_word_embeddings=False,
    )


def import_llama(source: nn.Module | str | Path) -> tuple[LanguageConfig, dict[str, Tensor]]:
    """``(config, language-tower state dict)`` from a ``LlamaForCausalLM`` or local directory."""
    model: Any = source
    if isinstance(source, str | Path):
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM.from_pretrained(str(source), local_files_only=True)
    state = {k.removeprefix("model."): v for k, v in model.state_dict().items()}
    if "lm_head.weight" not in state:  # tied checkpoints may omit it
        state["lm_head.weight"] = state["embed_tokens.weight"]
    return language_config_from_llama(model.config), state


def build_fusion_model(
    visual: nn.Module | str | Path,
    llama: nn.Module | str | Path,
    *,
    adapter: AdapterConfig | None = None,
    contrastive_dim: int = 512,
    **language_options: Any,
) -> FusionModel:
    """A :class:`FusionModel` with pretrained towers; projector, adapters and heads start fresh.

    ``language_options`` override :class:`LanguageConfig` fields (e.g. ``joint_attention=True``).
    """
    vision_cfg, vision_state = import_open_clip_visual(visual)
    language_cfg, language_state = import_llama(llama)
    language_cfg = dataclasses.replace(language_cfg, **language_options)
    config = FusionConfig(
        vision=vision_cfg,
        language=language_cfg,
        adapter=adapter or AdapterConfig(),
        contrastive_dim=contrastive_dim,
    )
    model = FusionModel(config)
    model.vision.load_state_dict(vision_state, strict=True)
    missing, unexpected = model.language.load_state_dict(language_state, strict=False)
    stray = [k for k in missing if not any(t in k for t in JOINT_ONLY_KEYS)]
    if stray or unexpected:
        raise ValueError(f"LLaMA weights do not fit: missing {stray}, unexpected {unexpected}.")
    return model


def _state(source: FusionModel | Mapping[str, Tensor]) -> Mapping[str, Tensor]:
    return source.state_dict() if isinstance(source, nn.Module) else source


def export_open_clip_visual(source: FusionModel | Mapping[str, Tensor]) -> dict[str, Tensor]:
    """open_clip ``visual`` state dict (load with ``visual.load_state_dict(sd, strict=True)``).

    The fused ``attn.in_proj_weight`` / ``_bias`` go from ``[3, D, D]`` / ``[3, D]`` back to
    open_clip's ``[3 D, D]`` / ``[3 D]`` (same values, row order ``[W_q; W_k; W_v]``).
    """
    return {
        k.removeprefix("vision."): open_clip_shape(k, v)
        for k, v in _state(source).items()
        if k.startswith("vision.")
    }


def export_llama(
    source: FusionModel | Mapping[str, Tensor],
    *,
    fold_text_temperature: bool = False,
    vocab_size: int | None = None,
) -> dict[str, Tensor]:
    """``LlamaForCausalLM`` state dict (joint-attention extras dropped).

    Args:
        source: a full fusion state dict (or model).
        fold_text_temperature: with joint attention, multiply each layer's ``k_proj`` weight
            ``[H_kv d, D]`` (and bias) by its text temperature ``t_txt``
            (``self_attn.temperature.temperature[1]``). Our text-only stream scales the
            RoPE-rotated keys by ``t_txt``; RoPE is linear, so ``rope(t k) = t rope(k)`` and the
            folded ``LlamaForCausalLM`` computes the same logits (to float rounding). Without it
            the weights are copied bit-exactly and the text-only logits differ unless
            ``t_txt == 1``.
        vocab_size: keep the first ``vocab_size`` rows of ``embed_tokens`` / ``lm_head``
            (strips the rows ``vocab_multiple`` padding added); ``None`` keeps them all.

    Raises:
        ValueError: ``vocab_size`` exceeds the rows the state holds.
    """
    state = _state(source)
    out = {}
    for key, value in state.items():
        if not key.startswith("language.") or any(t in key for t in JOINT_ONLY_KEYS):
            continue
        if vocab_size is not None and key.endswith(("embed_tokens.weight", "lm_head.weight")):
            if vocab_size > value.shape[0]:
                raise ValueError(
                    f"vocab_size {vocab_size} exceeds the {value.shape[0]} rows of {key}; pass "
                    "the tokenizer's vocabulary size (at most the padded one)."
                )
            value = value[:vocab_size]
        if fold_text_temperature and ".self_attn.k_proj." in key:
            temperature = state.get(key.split(".k_proj.")[0] + ".temperature.temperature")
            if temperature is not None:
                value = value * temperature[1].to(value.dtype)
        key = key.removeprefix("language.")
        out[key if key.startswith("lm_head.") else f"model.{key}"] = value
    return out


def save_llama_pretrained(
    source: FusionModel | Mapping[str, Tensor],
    config: LanguageConfig,
    path: str | Path,
    *,
    fold_text_temperature: bool = False,
) -> None:
    """Write a ``save_pretrained`` directory loadable by ``LlamaForCausalLM.from_pretrained``.

    ``config.vocab_size`` rows of the embedding and LM head are written (fewer than the state
    holds strips vocabulary padding); ``fold_text_temperature`` as in :func:`export_llama`.
    """
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(config))
    state = export_llama(
        source, fold_text_temperature=fold_text_temperature, vocab_size=config.vocab_size
    )
    model.load_state_dict(state, strict=True, assign=True)
    model.save_pretrained(str(path))


def open_clip_model_config(vision: VisionConfig, *, context_length: int = 8) -> dict[str, Any]:
    """open_clip's ``model_cfg`` (``embed_dim``, ``quick_gelu``, ``vision_cfg``, ``text_cfg``) for
    a CLIP whose ``visual`` is our :class:`VisionTower` of ``vision`` (inverse of
    :func:`vision_config_from_open_clip`).

    open_clip builds a text tower with every CLIP; ``text_cfg`` is the smallest one (1 layer,
    width 64, ``context_length`` tokens, vocabulary 8) and holds no exported weights: load only
    ``model.visual``.
    """
    heads = vision.heads
    cfg: dict[str, Any] = {
        "image_size": vision.image_size,
        "patch_size": vision.patch_size,
        "width": vision.width,
        "layers": vision.layers,
        "head_width": vision.width // heads,
        "mlp_ratio": vision.mlp_ratio,
        "pool_type": vision.pool_type,
        "final_ln_after_pool": vision.final_ln_after_pool,
        "no_ln_pre": vision.no_ln_pre,
    }
    if vision.ls_init_value is not None:
        cfg["ls_init_value"] = vision.ls_init_value
    text = {"context_length": context_length, "vocab_size": 8, "width": 64, "heads": 1}
    return {
        "embed_dim": vision.output_dim,
        "quick_gelu": vision.act == "quick_gelu",
        "vision_cfg": cfg,
        "text_cfg": {**text, "layers": 1},
    }
