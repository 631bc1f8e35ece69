"""transformers vision-language checkpoints as :class:`FusionModel` s, and back.

:func:`from_hf` reads a local ``save_pretrained`` directory (``config.json`` + safetensors),
dispatching on ``config.json``'s ``model_type`` through :data:`FAMILIES`; :func:`save_hf` writes
one back. A family (:class:`HFFamily`) maps the architecture onto the package's own pipeline
blocks, so every per-tower plan (TP, PP, DP, FSDP2) applies unchanged (Megatron-Bridge's
``AutoBridge.from_hf_pretrained`` and torchtitan's ``state_dict_adapter`` do the same for
their model classes). The recipe reads the same checkpoints per rank, slice by slice
(``model.pretrained.hf``, :mod:`lightning_mmpar.recipes.pretrained`).

Qwen2-VL / Qwen2.5-VL (``model_type`` in :data:`~lightning_mmpar.models.hf.qwen_convert.
QWEN_FAMILIES`) are their own model, :class:`~lightning_mmpar.models.hf.qwen2_vl.QwenVLModel`
(a dynamic-resolution ViT and M-RoPE do not fit :class:`FusionModel`): :func:`from_hf` and
:func:`save_hf` dispatch them to :mod:`~lightning_mmpar.models.hf.qwen_convert`; the fusion
path (:func:`family_of`, :func:`hf_fusion_config`) refuses them, and the recipe's
``model.pretrained.hf`` trains them as their own model (``lightning_mmpar.recipes.qwen_module``).
Qwen3-VL-MoE (``model_type`` in :data:`~lightning_mmpar.models.hf.qwen3_convert.
QWEN3_MOE_FAMILIES`) likewise is :class:`~lightning_mmpar.models.hf.qwen3_vl_moe.
Qwen3MoeVLModel`, dispatched to :mod:`~lightning_mmpar.models.hf.qwen3_convert` (the recipe:
``lightning_mmpar.recipes.qwen3_module``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from lightning_mmpar.models.fusion import FusionConfig, FusionModel
from lightning_mmpar.models.hf.checkpoint import hf_config, model_type_of, read_state, write_hf
from lightning_mmpar.models.hf.family import HFFamily
from lightning_mmpar.models.hf.llava_family import LLAVA
from lightning_mmpar.models.hf.qwen2_vl import QwenVLModel
from lightning_mmpar.models.hf.qwen3_convert import (
    QWEN3_MOE_FAMILIES,
    qwen3_moe_vl_from_hf,
    save_qwen3_moe_vl_hf,
)
from lightning_mmpar.models.hf.qwen3_vl_moe import Qwen3MoeVLModel
from lightning_mmpar.models.hf.qwen_convert import QWEN_FAMILIES, qwen_vl_from_hf, save_qwen_vl_hf

__all__ = [
    "FAMILIES",
    "HFFamily",
    "check_model_type",
    "family_of",
    "from_hf",
    "hf_data_args",
    "hf_fusion_config",
    "save_hf",
]

FAMILIES: dict[str, HFFamily] = {"llava": LLAVA}
"""``model_type`` (``config.json``) -> its family. Register a family by adding it here."""


def _supported_model_types() -> list[str]:
    """Every ``config.json`` ``model_type`` :func:`from_hf` loads (sorted): :data:`FAMILIES`,
    ``QWEN_FAMILIES`` and ``QWEN3_MOE_FAMILIES``."""
    return sorted(FAMILIES.keys() | QWEN_FAMILIES.keys() | QWEN3_MOE_FAMILIES.keys())


def check_model_type(path: str | Path) -> str:
    """The ``model_type`` of the checkpoint directory ``path``'s ``config.json``, read as JSON,
    once it is one this package loads (transformers is not asked, so an unknown type -
    ``idefics2``, ``bert``, a typo - is refused here rather than by transformers'
    ``AutoConfig`` or by a later, unrelated check).

    Raises:
        ValueError: no config.json or no ``model_type`` string in it; an unsupported
            ``model_type``, naming ``path``, the type found and the supported ones.
    """
    kind = model_type_of(path)
    if kind not in _supported_model_types():
        raise ValueError(
            f"{str(path)!r}: config.json model_type {kind!r} is not supported; supported: "
            f"{_supported_model_types()}."
        )
    return kind


def _checked_hf_config(path: str | Path) -> Any:
    """The transformers config of the directory ``path`` (:func:`~lightning_mmpar.models.hf.
    checkpoint.hf_config`) once :func:`check_model_type` accepts it.

    Raises:
        ValueError: as :func:`check_model_type`.
    """
    check_model_type(path)
    return hf_config(path)


def family_of(config: Any) -> HFFamily:
    """The family of a transformers config object.

    Raises:
        ValueError: its ``model_type`` has no family, naming it and the supported ones.
    """
    family = FAMILIES.get(config.model_type)
    if config.model_type in QWEN_FAMILIES or config.model_type in QWEN3_MOE_FAMILIES:
        raise ValueError(
            f"config.json model_type {config.model_type!r} is a Qwen-VL model (QwenVLModel / "
            "Qwen3MoeVLModel), not a FusionModel: load it with lightning_mmpar.models.from_hf "
            "(the recipe's model.pretrained.hf trains Qwen2-VL / Qwen2.5-VL as a "
            "QwenVLRecipeModule, Qwen3-VL-MoE as a Qwen3MoeVLRecipeModule)."
        )
    if family is None:
        raise ValueError(
            f"config.json model_type {config.model_type!r} is not supported; supported: "
            f"{sorted(FAMILIES)}."
        )
    return family


def hf_fusion_config(path: str | Path, **overrides: Any) -> FusionConfig:
    """The :class:`FusionConfig` of the checkpoint directory ``path``, with ``overrides``
    (:class:`FusionConfig` fields, e.g. ``contrastive_dim``) replaced. Reads config.json only.

    Raises:
        ValueError: no config.json, an unsupported ``model_type`` or config value (naming it),
            an unknown override.
    """
    config = _checked_hf_config(path)
    fusion = family_of(config).fusion_config(config)
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(FusionConfig)})
    if unknown:
        raise ValueError(f"from_hf overrides {unknown} are not FusionConfig fields.")
    return dataclasses.replace(fusion, **overrides)


def hf_data_args(path: str | Path) -> dict[str, Any]:
    """The data module arguments the checkpoint directory ``path`` fixes: ``tokenizer`` (the
    directory: its tokenizer and chat template), ``image_size`` (the ViT's input side) and
    ``image_seq_length`` (tokens one image occupies in the decoder's sequence: the ViT's
    ``vision.tokens``, 576 for LLaVA-1.5 at 336 px), unless the family's
    :attr:`HFFamily.data_args` says otherwise. Reads config.json only.

    Raises:
        ValueError: as :func:`hf_fusion_config`.
    """
    config = _checked_hf_config(path)
    family = family_of(config)
    fusion = family.fusion_config(config)
    args: dict[str, Any] = {
        "tokenizer": str(path),
        "image_size": fusion.vision.image_size,
        "image_seq_length": fusion.vision.tokens,
    }
    if family.data_args is not None:
        args |= family.data_args(config, fusion)
    return args


def from_hf(path: str | Path, **overrides: Any) -> FusionModel | QwenVLModel | Qwen3MoeVLModel:
    """A :class:`FusionModel` holding the weights of the transformers checkpoint directory
    ``path`` (``config.json`` + ``model.safetensors`` or an index), on the CPU; a
    :class:`QwenVLModel` for a Qwen2-VL / Qwen2.5-VL directory
    (:func:`~lightning_mmpar.models.hf.qwen_convert.qwen_vl_from_hf`, no overrides); a
    :class:`Qwen3MoeVLModel` for a Qwen3-VL-MoE directory
    (:func:`~lightning_mmpar.models.hf.qwen3_convert.qwen3_moe_vl_from_hf`, no overrides).

    Parts the checkpoint lacks (the contrastive heads) start fresh from the current RNG;
    ``overrides`` as in :func:`hf_fusion_config`. Logits on a ragged batch
    (:meth:`FusionModel.forward_ragged`) equal transformers' forward (docs/hf_models.md).

    Raises:
        ValueError: as :func:`hf_fusion_config` (an unsupported ``model_type`` before
            transformers is asked, :func:`_checked_hf_config`); a checkpoint whose tensors do
            not fit.
    """
    config = _checked_hf_config(path)
    if config.model_type in QWEN_FAMILIES:
        if overrides:
            raise ValueError(f"from_hf overrides {sorted(overrides)} are not for Qwen-VL.")
        return qwen_vl_from_hf(path)
    if config.model_type in QWEN3_MOE_FAMILIES:
        if overrides:
            raise ValueError(f"from_hf overrides {sorted(overrides)} are not for Qwen3-VL-MoE.")
        return qwen3_moe_vl_from_hf(path)
    family = family_of(config)
    model = FusionModel(hf_fusion_config(path, **overrides))
    ours = model.state_dict()
    state = read_state(path, family, list(ours))
    for key, value in state.items():
        if value.shape != ours[key].shape:
            raise ValueError(
                f"{path}: {key} has shape {list(value.shape)}, the model {list(ours[key].shape)}."
            )
    model.load_state_dict(state, strict=False)
    model.reset_momentum()
    return model


def save_hf(
    source: FusionModel | QwenVLModel | Qwen3MoeVLModel | Mapping[str, Tensor],
    original: str | Path,
    path: str | Path,
) -> dict[str, Tensor]:
    """Write a full state dict of ours (or a model) as a transformers directory at ``path``
    that ``from_pretrained`` loads, for the architecture of the checkpoint directory
    ``original`` (:func:`~lightning_mmpar.models.hf.checkpoint.write_hf`). Returns the
    written tensors.

    Raises:
        ValueError: an unsupported ``model_type``; a tensor missing (nothing written).
    """
    state = source.state_dict() if isinstance(source, nn.Module) else source
    config = _checked_hf_config(original)
    if config.model_type in QWEN_FAMILIES:
        return save_qwen_vl_hf(state, original, path)
    if config.model_type in QWEN3_MOE_FAMILIES:
        return save_qwen3_moe_vl_hf(state, original, path)
    return write_hf(family_of(config), state, original, path)
