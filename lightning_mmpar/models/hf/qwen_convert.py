"""Qwen2-VL / Qwen2.5-VL configs and weights from and to transformers.

Config: :func:`qwen_vl_config` reads a transformers ``Qwen2VLConfig`` / ``Qwen2_5_VLConfig``
and refuses (``ValueError`` naming the field) every value that would change the math this
package computes: a RoPE scaling type (``rope_parameters.rope_type`` other than ``default`` /
``mrope``) or any other ``rope_parameters`` key (:data:`ROPE_KEYS`), sliding-window
attention, attention dropout, a text activation other than SiLU, a vision activation it does
not compute, a vision RoPE other than ``axial``.

Weights: transformers 5 names (``model.visual.*``, ``model.language_model.*``, ``lm_head``) and
the Hub checkpoints' names (``visual.*``, ``model.*``, ``lm_head``) are both read. The ViT's
fused ``attn.qkv`` is split into ``q_proj / k_proj / v_proj`` (thirds of the output rows) and
the Conv3d patch embedding flattened to a linear weight; the language keys are the same as
:class:`~lightning_mmpar.models.language.LanguageModel`'s. A tied ``lm_head`` (absent from the
state dict) is a copy of ``embed_tokens`` (ties do not survive vocab-parallel sharding).
:func:`export_qwen_vl_state` inverts the mapping (transformers 5 names).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_mmpar.models.hf.qwen2_vl import QwenVLConfig, QwenVLModel
from lightning_mmpar.models.hf.qwen_vision import ACTIVATIONS, QwenVisionConfig
from lightning_mmpar.models.language import LanguageConfig

__all__ = [
    "QWEN_FAMILIES",
    "export_qwen_vl_state",
    "import_qwen_vl_state",
    "is_qwen_vl_dir",
    "qwen_checkpoint_key",
    "qwen_vl_config",
    "qwen_vl_from_hf",
    "qwen_vl_from_transformers",
    "save_qwen_vl_hf",
]


ROPE_KEYS = frozenset({"rope_type", "type", "rope_theta", "mrope_section"})
"""The text ``rope_parameters`` keys this package computes; any other is refused."""


def _rope(text: Any, known: frozenset[str] = ROPE_KEYS) -> dict[str, Any]:
    """``rope_parameters`` of the text config; refuses a RoPE scaling type or a key outside
    ``known``."""
    rope = dict(getattr(text, "rope_parameters", None) or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "mrope"):
        raise ValueError(
            f"text_config.rope_parameters.rope_type {kind!r} is not supported (RoPE scaling "
            "changes the positions' math); only 'default' / 'mrope' are."
        )
    if extra := sorted(rope.keys() - known):
        raise ValueError(
            f"text_config.rope_parameters {extra} are not supported (only {sorted(known)} are "
            "computed); remove them or use transformers' model."
        )
    return rope


def _side(name: str, value: Any) -> int:
    """A patch size given as an int or as equal sides."""
    sides = {int(v) for v in value} if isinstance(value, list | tuple) else {int(value)}
    if len(sides) != 1:
        raise ValueError(f"vision_config.{name} {value!r} must have equal sides.")
    return sides.pop()


def _check_text(text: Any) -> None:
    if getattr(text, "hidden_act", "silu") != "silu":
        raise ValueError(
            f"text_config.hidden_act {text.hidden_act!r} is not supported; the decoder's "
            "SwiGLU computes 'silu'."
        )
    if getattr(text, "use_sliding_window", False) or any(
        kind != "full_attention" for kind in (getattr(text, "layer_types", None) or ())
    ):
        raise ValueError(
            "text_config.use_sliding_window / layer_types: sliding-window attention is not "
            "supported; set use_sliding_window=False (full attention in every layer)."
        )
    if float(getattr(text, "attention_dropout", 0.0) or 0.0) != 0.0:
        raise ValueError(
            f"text_config.attention_dropout ({text.attention_dropout}) is not supported; "
            "set it to 0.0."
        )


def _language(
    text: Any,
    *,
    check: Callable[[Any], None] | None = _check_text,
    known: frozenset[str] = ROPE_KEYS,
    theta: float = 1000000.0,
    section: tuple[int, int, int] = (16, 24, 24),
    **fields: Any,
) -> tuple[LanguageConfig, tuple[int, int, int]]:
    """The decoder config and M-RoPE sections of a Qwen text config (``check`` validates it,
    ``None``: already checked; ``known`` rope keys, ``theta`` / ``section`` defaults, other
    ``LanguageConfig`` ``fields``; the defaults are Qwen2's)."""
    if check is not None:
        check(text)
    rope = _rope(text, known)
    language = LanguageConfig(
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        num_hidden_layers=text.num_hidden_layers,
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=text.num_key_value_heads or text.num_attention_heads,
        rms_norm_eps=text.rms_norm_eps,
        rope_theta=float(rope.get("rope_theta", theta)),
        **{"attention_bias": True, **fields},
    )
    got = tuple(rope.get("mrope_section", section))
    if len(got) != 3:
        raise ValueError(
            f"text_config.rope_parameters.mrope_section {list(got)} must have 3 entries."
        )
    return language, (int(got[0]), int(got[1]), int(got[2]))


def _vision_fields(vision: Any) -> dict[str, Any]:
    """The ViT config fields Qwen2-VL, Qwen2.5-VL and Qwen3-VL read alike (refusing a vision
    RoPE other than ``axial`` and an activation the ViT does not compute)."""
    rope = dict(getattr(vision, "rope_parameters", None) or {})
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(
            f"vision_config.rope_parameters.rope_type {rope['rope_type']!r} is not supported; "
            "only 'axial' (2-D RoPE) is."
        )
    act = vision.hidden_act
    if act not in ACTIVATIONS:
        raise ValueError(
            f"vision_config.hidden_act {act!r} is not supported; use one of {list(ACTIVATIONS)}."
        )
    return {
        "depth": vision.depth,
        "heads": vision.num_heads,
        "in_channels": vision.in_channels,
        "patch_size": _side("patch_size", vision.patch_size),
        "temporal_patch_size": _side("temporal_patch_size", vision.temporal_patch_size),
        "spatial_merge_size": vision.spatial_merge_size,
        "rope_theta": float(rope.get("rope_theta", 10000.0)),
        "hidden_act": act,
    }


def _vision(vision: Any, qwen25: bool) -> QwenVisionConfig:
    common = _vision_fields(vision)
    if qwen25:
        return QwenVisionConfig(
            width=vision.hidden_size,
            mlp_width=vision.intermediate_size,
            out_width=vision.out_hidden_size,
            norm="rmsnorm",
            mlp="swiglu",
            window_size=vision.window_size,
            fullatt_block_indexes=tuple(vision.fullatt_block_indexes),
            **common,
        )
    return QwenVisionConfig(
        width=vision.embed_dim,
        mlp_width=int(vision.embed_dim * vision.mlp_ratio),
        out_width=vision.hidden_size,
        **common,
    )


def _model_type(config: Any, families: Mapping[str, str], name: str) -> str:
    """``config.model_type``, refused unless one of ``families`` (the ``name`` family)."""
    kind = getattr(config, "model_type", None)
    if kind not in families:
        raise ValueError(
            f"config.model_type {kind!r} is not a {name} family; expected one of "
            f"{sorted(families)}."
        )
    return str(kind)


def qwen_vl_config(config: Any) -> QwenVLConfig:
    """:class:`QwenVLConfig` of a transformers ``Qwen2VLConfig`` (``model_type`` ``qwen2_vl``)
    or ``Qwen2_5_VLConfig`` (``qwen2_5_vl``).

    Raises:
        ValueError: another model type, or a field whose value changes the math (module
            docstring), naming the field.
    """
    kind = _model_type(config, QWEN_FAMILIES, "Qwen-VL")
    language, section = _language(config.text_config)
    return QwenVLConfig(
        vision=_vision(config.vision_config, kind == "qwen2_5_vl"),
        language=language,
        mrope_section=section,
        image_token_id=config.image_token_id,
    )


def _split_key(key: str) -> tuple[str, str] | None:
    """``(tower, rest)`` of a transformers 5 or Hub key (``None``: not a model weight)."""
    for prefix, tower in (
        ("model.visual.", "vision"),
        ("visual.", "vision"),
        ("model.language_model.", "language"),
        ("model.", "language"),
    ):
        if key.startswith(prefix):
            return tower, key[len(prefix) :]
    if key == "lm_head.weight":
        return "language", "lm_head.weight"
    return None


def _vision_entries(
    rest: str, value: Tensor, rename: Callable[[str], str] | None = None
) -> dict[str, Tensor]:
    """Our ViT tensors of transformers' ``visual.<rest>``: the patch embedding flattened, the
    fused ``qkv`` split in thirds, any other key ``rename`` d (``".<rest>"`` -> ours)."""
    if rest == "patch_embed.proj.weight":
        return {"vision.patch_embed.proj.weight": value.reshape(value.shape[0], -1)}
    if ".attn.qkv." in rest:
        q, k, v = value.chunk(3, dim=0)
        head = rest.replace(".qkv.", ".{}.")
        return {
            f"vision.{head.format(n)}": t
            for n, t in zip(("q_proj", "k_proj", "v_proj"), (q, k, v), strict=True)
        }
    return {f"vision{rename(rest) if rename else '.' + rest}": value}


def qwen_checkpoint_key(key: str, shape: tuple[int, ...]) -> dict[str, tuple[int, int, bool]]:
    """Where the checkpoint tensor ``key`` of ``shape`` goes in :class:`QwenVLModel`, without
    reading it (the recipe's per-rank loader): ``{our key: (first row, rows, flat)}``, the
    rows of the tensor that are ours (the fused ``attn.qkv`` is three keys of a third of the
    rows each), ``flat``: the Conv3d patch embedding flattened to ``[D, C T p p]``. A key that
    is no model weight keeps its own name (the loader refuses it as unexpected); the same
    mapping as :func:`import_qwen_vl_state`."""
    split = _split_key(key)
    if split is None:
        return {key: (0, shape[0] if shape else 0, False)}
    tower, rest = split
    if tower == "language":
        return {f"language.{rest}": (0, shape[0] if shape else 0, False)}
    if rest == "patch_embed.proj.weight":
        return {"vision.patch_embed.proj.weight": (0, shape[0], True)}
    if ".attn.qkv." in rest:
        third = shape[0] // 3
        head = rest.replace(".qkv.", ".{}.")
        return {
            f"vision.{head.format(n)}": (c * third, third, False)
            for c, n in enumerate(("q_proj", "k_proj", "v_proj"))
        }
    return {f"vision.{rest}": (0, shape[0], False)}


def import_qwen_vl_state(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """This package's :class:`QwenVLModel` state dict from a transformers one
    (``Qwen2VLForConditionalGeneration.state_dict()`` or a Hub checkpoint's tensors)."""
    out: dict[str, Tensor] = {}
    for key, value in state.items():
        split = _split_key(key)
        if split is None:
            continue
        tower, rest = split
        if tower == "vision":
            out.update(_vision_entries(rest, value))
        else:
            out[f"language.{rest}"] = value
    if "language.lm_head.weight" not in out and "language.embed_tokens.weight" in out:
        out["language.lm_head.weight"] = out["language.embed_tokens.weight"].clone()
    return out


def export_qwen_vl_state(state: Mapping[str, Tensor], config: QwenVLConfig) -> dict[str, Tensor]:
    """transformers 5 names of a full :class:`QwenVLModel` state dict (q/k/v fused back into
    ``qkv``, the patch embedding reshaped to its Conv3d weight)."""
    out: dict[str, Tensor] = {}
    for key, value in state.items():
        if key == "language.lm_head.weight":
            out["lm_head.weight"] = value
        elif key.startswith("language."):
            out["model.language_model." + key[len("language.") :]] = value
        else:
            out.update(_export_vision(key, value, state, config))
    return out


def _export_vision(
    key: str,
    value: Tensor,
    state: Mapping[str, Tensor],
    config: Any,
    rename: Callable[[str], str] | None = None,
) -> dict[str, Tensor]:
    """transformers' ViT tensors of our ``vision.<rest>`` (:func:`_vision_entries` inverted:
    ``rename`` maps ``".<rest>"`` to theirs): the patch embedding as its Conv3d weight, q/k/v
    fused back into ``qkv`` (at ``q_proj``; ``k_proj`` / ``v_proj`` give nothing)."""
    rest = key[len("vision.") :]
    if rest == "patch_embed.proj.weight":
        v = config.vision
        shape = (v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
        return {"model.visual.patch_embed.proj.weight": value.reshape(value.shape[0], *shape)}
    if ".attn.k_proj." in rest or ".attn.v_proj." in rest:
        return {}
    if ".attn.q_proj." in rest:
        parts = [state[key.replace(".q_proj.", f".{n}.")] for n in ("q_proj", "k_proj", "v_proj")]
        return {"model.visual." + rest.replace(".q_proj.", ".qkv."): torch.cat(parts)}
    return {"model.visual" + (rename(rest) if rename else "." + rest): value}


def qwen_vl_from_transformers(model: Any) -> QwenVLModel:
    """A :class:`QwenVLModel` with the weights of a transformers
    ``Qwen2VLForConditionalGeneration`` / ``Qwen2_5_VLForConditionalGeneration`` (its dtype).

    Raises:
        ValueError: an unsupported config value (:func:`qwen_vl_config`), or state-dict keys
            that do not match.
    """
    config = qwen_vl_config(model.config)
    dtype = next(model.parameters()).dtype
    with torch.device("meta"):
        ours = QwenVLModel(config)
    ours.load_state_dict(import_qwen_vl_state(model.state_dict()), strict=True, assign=True)
    return ours.to(dtype)


def _hf_config(path: Path) -> Any:
    if not (path / "config.json").is_file():
        raise ValueError(
            f"{str(path)!r} has no config.json: pass a directory written by transformers' "
            "save_pretrained."
        )
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path), local_files_only=True)


def _read_tensors(path: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"{str(path)!r} has no *.safetensors; re-save it with save_pretrained(..., "
            "safe_serialization=True)."
        )
    state: dict[str, Tensor] = {}
    for file in files:
        state.update(load_file(str(file), device="cpu"))
    return state


def qwen_vl_from_hf(path: str | Path) -> QwenVLModel:
    """A :class:`QwenVLModel` of the local transformers directory ``path`` (``config.json`` +
    safetensors, never the network), on the CPU in the checkpoint's dtype.

    Raises:
        ValueError: no config.json / safetensors, an unsupported config value (naming the
            field, :func:`qwen_vl_config`), or tensors that do not fit the model (naming them).
    """
    path = Path(path)
    config = qwen_vl_config(_hf_config(path))
    state = import_qwen_vl_state(_read_tensors(path))
    with torch.device("meta"):
        model = QwenVLModel(config)
    _load_fitting(path, model, state)
    return model


def _load_fitting(path: Path, model: torch.nn.Module, state: Mapping[str, Tensor]) -> None:
    """Load ``state`` into ``model`` (``assign``) if its keys and shapes are the model's.

    Raises:
        ValueError: naming the missing, unexpected and other-shape tensors of ``path``.
    """
    ours = model.state_dict()
    missing, stray = sorted(ours.keys() - state.keys()), sorted(state.keys() - ours.keys())
    bad = sorted(k for k in ours.keys() & state.keys() if ours[k].shape != state[k].shape)
    if missing or stray or bad:
        raise ValueError(
            f"{path}: the checkpoint does not fit the model: missing {missing[:8]}, "
            f"unexpected {stray[:8]}, other shapes {bad[:8]}."
        )
    model.load_state_dict(state, strict=True, assign=True)


def _copy_side_files(original: Path, path: Path) -> None:
    """Copy ``original``'s tokenizer / processor files (all but the config and weights)."""
    for file in original.iterdir():
        keep = file.is_file() and not file.name.endswith(".safetensors")
        if keep and file.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(file, path / file.name)


def save_qwen_vl_hf(
    source: QwenVLModel | Mapping[str, Tensor], original: str | Path, path: str | Path
) -> dict[str, Tensor]:
    """Write a full state dict of ours (or the model) as a transformers directory at ``path``
    for the architecture of the directory ``original`` (its config; its tokenizer / processor
    files copied), through transformers' own ``save_pretrained``; returns the written tensors.
    A tied source is written untied (our ``lm_head`` is a separate parameter).

    Raises:
        ValueError: a tensor of the architecture without a value (nothing written).
    """
    import transformers

    original, path = Path(original), Path(path)
    config = _hf_config(original)
    state = source.state_dict() if isinstance(source, torch.nn.Module) else source
    tensors = export_qwen_vl_state(state, qwen_vl_config(config))
    config.tie_word_embeddings = config.get_text_config().tie_word_embeddings = False
    with torch.device("meta"):
        model = getattr(transformers, QWEN_FAMILIES[config.model_type])(config)
    if missing := sorted(model.state_dict().keys() - tensors.keys()):
        raise ValueError(f"export to {path}: no value for {missing[:8]}; nothing written.")
    model.load_state_dict(tensors, strict=True, assign=True)
    model.save_pretrained(str(path))
    _copy_side_files(original, path)
    return tensors


QWEN_FAMILIES: dict[str, str] = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
}
"""``config.model_type`` -> the transformers class this package matches (for ``from_hf``'s
``FAMILIES``)."""


def is_qwen_vl_dir(path: str | Path | None, families: Mapping[str, str] = QWEN_FAMILIES) -> bool:
    """Whether ``path`` is a directory whose ``config.json`` ``model_type`` is one of
    ``families`` (default the Qwen-VL ones, :data:`QWEN_FAMILIES`); reads that file only
    (``False`` without one)."""
    import json

    if not path or not (Path(path) / "config.json").is_file():
        return False
    try:
        kind = json.loads((Path(path) / "config.json").read_text()).get("model_type")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return False
    return kind in families
