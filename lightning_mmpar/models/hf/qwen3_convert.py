"""Qwen3-VL-MoE configs and weights from and to transformers, and the export completeness check.

Config: :func:`qwen3_moe_vl_config` reads a transformers ``Qwen3VLMoeConfig`` and refuses
(``ValueError`` naming the field) every value that would change the math this package
computes: a RoPE scaling type, sliding-window attention, attention dropout, a text activation
other than SiLU, ``output_router_logits=True`` (transformers then adds its own load-balancing
loss to the training loss), ``norm_topk_prob=False``, no experts, a vision activation or RoPE it
does not compute.

Weights: transformers 5 names. The ViT's fused ``attn.qkv`` is split into ``q_proj / k_proj /
v_proj``, ``mlp.linear_fc1 / linear_fc2`` become ``mlp.fc1 / fc2``, a merger's ``norm /
linear_fc1 / linear_fc2`` become ``ln_q / mlp.0 / mlp.2``, the Conv3d patch embedding a linear
weight; ``pos_embed`` moves under ``patch_embed``. Each MoE layer's router ``mlp.gate.weight
[E, D]`` becomes ``mlp.router_gate [1, E, D]`` and the fused experts (``experts.gate_up_proj``,
``experts.down_proj``) become ``experts.w_gate, w_up [E, D, F]`` and ``w_down [E, F, D]``. The
experts are read in either stored layout, as transformers' own loader does: the in-memory one
(``gate_up_proj [E, 2F, D]``, ``down_proj [E, D, F]``, what ``save_pretrained`` writes) when
the shape equals it, else the Hub checkpoints' transposed one. :func:`export_qwen3_moe_vl_state`
inverts the mapping.

Export check (:func:`check_export`): every tensor of the architecture present with its full
shape, so every expert of every layer; the total bytes equal the architecture's. An expert-
parallel rank's local block (``[E / ep, ...]``), a missing layer or a short file is refused with
the names, before anything is written (the failure Megatron-Bridge issues #1716 / #2300 report:
an EP export that silently kept one shard of the experts).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_mmpar.models.hf.checkpoint import View
from lightning_mmpar.models.hf.qwen3_vision import Qwen3VisionConfig
from lightning_mmpar.models.hf.qwen3_vl_moe import Qwen3MoeVLConfig, Qwen3MoeVLModel
from lightning_mmpar.models.hf.qwen_convert import (
    ROPE_KEYS,
    _check_text,
    _copy_side_files,
    _export_vision,
    _hf_config,
    _language,
    _load_fitting,
    _model_type,
    _read_tensors,
    _vision_entries,
    _vision_fields,
    is_qwen_vl_dir,
)
from lightning_mmpar.models.language import LanguageConfig
from lightning_mmpar.models.moe import MoEFeedForward
from lightning_mmpar.models.moe_routing import MoEConfig

__all__ = [
    "QWEN3_MOE_FAMILIES",
    "check_export",
    "export_qwen3_moe_vl_state",
    "import_qwen3_moe_vl_state",
    "init_moe_buffers",
    "is_qwen3_moe_vl_dir",
    "qwen3_checkpoint_views",
    "qwen3_moe_vl_config",
    "qwen3_moe_vl_from_hf",
    "qwen3_moe_vl_from_transformers",
    "save_qwen3_moe_vl_hf",
]

QWEN3_MOE_FAMILIES: dict[str, str] = {"qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration"}
"""``config.model_type`` -> the transformers class this package matches (for ``from_hf``'s
``FAMILIES``)."""


ROPE3_KEYS = ROPE_KEYS | {"mrope_interleaved"}
"""The text ``rope_parameters`` keys read; ``mrope_interleaved`` is accepted with any value
(transformers' Qwen3-VL always interleaves, as this model does)."""


def _check_moe_text(text: Any) -> None:
    _check_text(text)
    if getattr(text, "output_router_logits", False):
        raise ValueError(
            "text_config.output_router_logits=True is not supported: transformers then adds "
            "its load-balancing loss to the loss; set it to False (the package's own balance "
            "loss is MoEConfig.aux_loss_weight)."
        )
    if not getattr(text, "norm_topk_prob", True):
        raise ValueError(
            "text_config.norm_topk_prob=False is not supported: the MoE layer renormalises "
            "the top-k gates; set it to True."
        )
    if int(getattr(text, "num_experts", 0) or 0) < 1:
        raise ValueError(
            f"text_config.num_experts ({getattr(text, 'num_experts', None)}) must be >= 1; a "
            "dense Qwen3-VL is not this family."
        )


def _dense_layers(text: Any) -> tuple[int, ...]:
    only = set(getattr(text, "mlp_only_layers", None) or ())
    step = int(getattr(text, "decoder_sparse_step", 1) or 1)
    return tuple(i for i in range(text.num_hidden_layers) if i in only or (i + 1) % step)


def _moe_language(text: Any) -> tuple[LanguageConfig, tuple[int, int, int]]:
    _check_moe_text(text)
    moe = MoEConfig(
        num_experts=text.num_experts,
        top_k=text.num_experts_per_tok,
        ffn_width=text.moe_intermediate_size,
        capacity_factor=None,
        router_dim=None,
        modalities=("text",),
        aux_loss_weight=0.0,
        z_loss_weight=0.0,
    )
    return _language(
        text,
        check=None,  # _check_moe_text did
        known=ROPE3_KEYS,
        theta=500000.0,
        section=(24, 20, 20),
        head_dim=getattr(text, "head_dim", None),
        attention_bias=bool(getattr(text, "attention_bias", False)),
        moe=moe,
    )


def _vision(vision: Any) -> Qwen3VisionConfig:
    return Qwen3VisionConfig(
        width=vision.hidden_size,
        mlp_width=vision.intermediate_size,
        out_width=vision.out_hidden_size,
        num_position_embeddings=vision.num_position_embeddings,
        deepstack_indexes=tuple(vision.deepstack_visual_indexes),
        **_vision_fields(vision),
    )


def qwen3_moe_vl_config(config: Any) -> Qwen3MoeVLConfig:
    """:class:`Qwen3MoeVLConfig` of a transformers ``Qwen3VLMoeConfig`` (``model_type``
    ``qwen3_vl_moe``).

    Raises:
        ValueError: another model type, or a field whose value changes the math (module
            docstring), naming the field.
    """
    _model_type(config, QWEN3_MOE_FAMILIES, "Qwen3-VL-MoE")
    language, section = _moe_language(config.text_config)
    return Qwen3MoeVLConfig(
        vision=_vision(config.vision_config),
        language=language,
        mrope_section=section,
        image_token_id=config.image_token_id,
        dense_layers=_dense_layers(config.text_config),
    )


_BLOCK_NAMES = ((".mlp.linear_fc1.", ".mlp.fc1."), (".mlp.linear_fc2.", ".mlp.fc2."))
_MERGER_NAMES = ((".norm.", ".ln_q."), (".linear_fc1.", ".mlp.0."), (".linear_fc2.", ".mlp.2."))
"""transformers' -> our ViT module names in a block, in a merger (final or DeepStack)."""


def _rename(rest: str, reverse: bool) -> str:
    """Our ViT name of transformers' ``rest`` (``reverse``: theirs of ours)."""
    pairs = _BLOCK_NAMES if rest.startswith("blocks.") else _MERGER_NAMES
    rest = "." + rest
    for theirs, ours in pairs:
        rest = rest.replace(ours, theirs) if reverse else rest.replace(theirs, ours)
    return rest


def _vision3_entries(rest: str, value: Tensor) -> dict[str, Tensor]:
    if rest == "pos_embed.weight":
        return {"vision.patch_embed.pos_embed.weight": value}
    return _vision_entries(rest, value, lambda name: _rename(name, reverse=False))


def _expert_layouts(name: str, config: Qwen3MoeVLConfig) -> tuple[tuple[int, ...], ...]:
    """The shapes the checkpoint expert tensor ``name`` (``gate_up_proj`` / ``down_proj``) may
    have, from the config (``E`` = ``num_experts``, ``D`` = ``hidden_size``, ``F`` =
    ``moe_intermediate_size``): transformers' in-memory layout first (``[E, 2F, D]`` /
    ``[E, D, F]``, what ``save_pretrained`` writes), then the Hub's transposed one
    (``[E, D, 2F]`` / ``[E, F, D]``), as transformers' own loader accepts them."""
    moe = config.language.moe
    assert moe is not None
    e, d, f = moe.num_experts, config.language.hidden_size, moe.ffn_width
    if name == "gate_up_proj":
        return (e, 2 * f, d), (e, d, 2 * f)
    return (e, d, f), (e, f, d)


def _check_expert_shape(key: str, shape: tuple[int, ...], config: Qwen3MoeVLConfig) -> bool:
    """Whether the checkpoint expert tensor ``key`` of ``shape`` is in transformers' in-memory
    layout (else the Hub's transposed one), checked before it is split or read.

    Raises:
        ValueError: ``shape`` is neither layout of :func:`_expert_layouts` (a truncated tensor,
            or one expert-parallel rank's experts), naming ``key``, its shape and the shapes the
            config expects.
    """
    memory, hub = _expert_layouts(key.rsplit(".", 1)[-1], config)
    if tuple(shape) not in (memory, hub):
        moe = config.language.moe
        assert moe is not None
        raise ValueError(
            f"{key} has shape {list(shape)}; the config (num_experts {moe.num_experts}, "
            f"hidden_size {config.language.hidden_size}, moe_intermediate_size {moe.ffn_width}) "
            f"expects {list(memory)} (or the transposed {list(hub)}): a cut or mis-sized expert "
            "tensor, or one expert-parallel rank's experts; write every expert of it."
        )
    return tuple(shape) == memory


def _expert_entries(key: str, value: Tensor, config: Qwen3MoeVLConfig) -> dict[str, Tensor]:
    """``w_gate, w_up`` from ``gate_up_proj`` or ``w_down`` from ``down_proj`` (either layout:
    :func:`_check_expert_shape`; ``key``: the checkpoint's ``...mlp.experts.<name>``)."""
    moe = config.language.moe
    assert moe is not None
    f, prefix = moe.ffn_width, "language." + key[len("model.language_model.") :].rsplit(".", 1)[0]
    if _check_expert_shape(key, tuple(value.shape), config):  # transformers' in-memory layout
        value = value.transpose(1, 2)
    if key.endswith("gate_up_proj"):
        return {
            f"{prefix}.w_gate": value[..., :f].contiguous(),
            f"{prefix}.w_up": value[..., f:].contiguous(),
        }
    return {f"{prefix}.w_down": value.contiguous()}


def _language_entries(rest: str, value: Tensor, config: Qwen3MoeVLConfig) -> dict[str, Tensor]:
    if rest.endswith(".mlp.gate.weight"):
        return {f"language.{rest[: -len('gate.weight')]}router_gate": value[None]}
    if rest.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
        return _expert_entries(f"model.language_model.{rest}", value, config)
    return {f"language.{rest}": value}


def _expert_views(key: str, shape: tuple[int, ...], config: Qwen3MoeVLConfig) -> dict[str, View]:
    """:func:`_expert_entries` as views (either stored layout, :func:`_check_expert_shape`):
    ``w_gate`` / ``w_up`` halves of ``gate_up_proj``, ``w_down`` of ``down_proj``, every one
    ``[E, ...]`` on dim 0."""
    moe = config.language.moe
    assert moe is not None
    e, d, f = moe.num_experts, config.language.hidden_size, moe.ffn_width
    prefix = "language." + key[len("model.language_model.") :].rsplit(".", 1)[0]
    memory = _check_expert_shape(key, shape, config)  # transformers' in-memory layout: transposed
    if key.endswith("gate_up_proj"):
        up = (0, f, 0) if memory else (0, 0, f)
        return {
            f"{prefix}.w_gate": View((e, d, f), transposed=memory),
            f"{prefix}.w_up": View((e, d, f), up, transposed=memory),
        }
    return {f"{prefix}.w_down": View((e, f, d), transposed=memory)}


def qwen3_checkpoint_views(
    key: str, shape: tuple[int, ...], config: Qwen3MoeVLConfig
) -> dict[str, View]:
    """Where the checkpoint tensor ``key`` of ``shape`` goes in :class:`Qwen3MoeVLModel`,
    without reading it (the recipe's per-rank loader): ``{our key: View}``, the mapping of
    :func:`import_qwen3_moe_vl_state` (the ViT's q / k / v thirds of ``attn.qkv``; the router
    ``[E, D]`` as ``[1, E, D]``; the fused experts' halves, transposed: an expert-parallel
    rank's slice reads its experts only). A key that is no model weight keeps its own name
    (the loader refuses it as unexpected)."""
    if key.startswith("model.visual."):
        rest = key[len("model.visual.") :]
        if rest == "pos_embed.weight":
            return {"vision.patch_embed.pos_embed.weight": View(shape)}
        if rest == "patch_embed.proj.weight":
            return {
                "vision.patch_embed.proj.weight": View((shape[0], math.prod(shape[1:])), flat=True)
            }
        if ".attn.qkv." in rest:
            third, head = shape[0] // 3, rest.replace(".qkv.", ".{}.")
            return {
                f"vision.{head.format(n)}": View(
                    (third, *shape[1:]), (c * third,) + (0,) * (len(shape) - 1)
                )
                for c, n in enumerate(("q_proj", "k_proj", "v_proj"))
            }
        return {f"vision{_rename(rest, reverse=False)}": View(shape)}
    if key == "lm_head.weight":
        return {"language.lm_head.weight": View(shape)}
    if not key.startswith("model.language_model."):
        return {key: View(shape)}
    rest = key[len("model.language_model.") :]
    if rest.endswith(".mlp.gate.weight"):
        return {
            f"language.{rest[: -len('gate.weight')]}router_gate": View((1, *shape), unsqueezed=True)
        }
    if rest.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
        return _expert_views(key, shape, config)
    return {f"language.{rest}": View(shape)}


def _buffers(config: Qwen3MoeVLConfig) -> dict[str, Tensor]:
    """The MoE layers' persistent buffers transformers has no value for (no selection bias,
    every expert routable)."""
    moe, out = config.language.moe, {}
    assert moe is not None
    for i in range(config.language.num_hidden_layers):
        if i not in config.dense_layers:
            out[f"language.layers.{i}.mlp.expert_bias"] = torch.zeros(1, moe.num_experts)
            out[f"language.layers.{i}.mlp.expert_mask"] = torch.ones(
                moe.num_experts, dtype=torch.bool
            )
    return out


def import_qwen3_moe_vl_state(
    state: Mapping[str, Tensor], config: Qwen3MoeVLConfig
) -> dict[str, Tensor]:
    """This package's :class:`Qwen3MoeVLModel` state dict from a transformers one
    (``Qwen3VLMoeForConditionalGeneration.state_dict()`` or a checkpoint's tensors)."""
    out = _buffers(config)
    for key, value in state.items():
        if key.startswith("model.visual."):
            out.update(_vision3_entries(key[len("model.visual.") :], value))
        elif key.startswith("model.language_model."):
            rest = key[len("model.language_model.") :]
            out.update(_language_entries(rest, value, config))
        elif key == "lm_head.weight":
            out["language.lm_head.weight"] = value
    if "language.lm_head.weight" not in out and "language.embed_tokens.weight" in out:
        out["language.lm_head.weight"] = out["language.embed_tokens.weight"].clone()
    return out


def _export_vision3(
    key: str, value: Tensor, state: Mapping[str, Tensor], config: Any
) -> dict[str, Tensor]:
    if key == "vision.patch_embed.pos_embed.weight":
        return {"model.visual.pos_embed.weight": value}
    return _export_vision(key, value, state, config, lambda name: _rename(name, reverse=True))


def _check_fusable(key: str, gate: Tensor, up: Tensor, config: Qwen3MoeVLConfig) -> None:
    """Refuse ``w_gate`` / ``w_up`` of different shapes (one of them cut) before they are fused
    into ``gate_up_proj``; equal shapes go on to :func:`check_export` (which names a short
    fused tensor with the byte totals).

    Raises:
        ValueError: naming both tensors, their shapes and the config's ``[E, D, F]``.
    """
    if gate.shape != up.shape:
        moe = config.language.moe
        assert moe is not None
        want = [moe.num_experts, config.language.hidden_size, moe.ffn_width]
        raise ValueError(
            f"export refused: {key} has shape {list(gate.shape)}, "
            f"{key[: -len('w_gate')]}w_up {list(up.shape)} (expected {want} each, from the "
            "config); they fuse into one gate_up_proj: gather every expert shard "
            "(full_state_dict on every rank) before exporting."
        )


def _export_language(
    key: str, value: Tensor, state: Mapping[str, Tensor], config: Qwen3MoeVLConfig
) -> dict[str, Tensor]:
    rest = key[len("language.") :]
    if rest == "lm_head.weight":
        return {"lm_head.weight": value}
    base = "model.language_model." + rest
    if rest.endswith(".mlp.router_gate"):
        return {base[: -len("router_gate")] + "gate.weight": value[0]}
    if rest.endswith(".experts.w_gate"):
        up = state[key[: -len("w_gate")] + "w_up"]
        _check_fusable(key, value, up, config)
        fused = torch.cat([value, up], dim=-1).transpose(1, 2).contiguous()  # [E, 2F, D]
        return {base[: -len("w_gate")] + "gate_up_proj": fused}
    if rest.endswith(".experts.w_down"):
        return {base[: -len("w_down")] + "down_proj": value.transpose(1, 2).contiguous()}
    if rest.endswith((".experts.w_up", ".mlp.expert_bias", ".mlp.expert_mask")):
        return {}
    return {base: value}


def export_qwen3_moe_vl_state(
    state: Mapping[str, Tensor], config: Qwen3MoeVLConfig
) -> dict[str, Tensor]:
    """transformers 5 names (in-memory layout) of a full :class:`Qwen3MoeVLModel` state dict.

    Raises:
        ValueError: a value is a sharded ``DTensor`` (gather it first:
            :func:`lightning_mmpar.parallel.tensor.full_state_dict`, on every rank); an MoE
            layer's ``w_gate`` and ``w_up`` of different shapes (naming them and the config's).
    """
    sharded = sorted(k for k, v in state.items() if hasattr(v, "to_local"))
    if sharded:
        raise ValueError(
            f"export: {len(sharded)} tensors are sharded DTensors ({sharded[:4]} ...); gather "
            "them on every rank first with lightning_mmpar.parallel.tensor.full_state_dict."
        )
    out: dict[str, Tensor] = {}
    for key, value in state.items():
        if key.startswith("vision."):
            out.update(_export_vision3(key, value, state, config))
        elif key.startswith("language."):
            out.update(_export_language(key, value, state, config))
    return out


def init_moe_buffers(model: Qwen3MoeVLModel) -> Qwen3MoeVLModel:
    """Give the MoE layers' buffers (left on the meta device by a meta build or a state-dict
    load with ``assign``) their initial values on the CPU: no selection bias, every expert
    routable, no pending load (transformers has no value for them)."""
    for module in model.modules():
        if isinstance(module, MoEFeedForward):
            for name in ("expert_bias", "pending_load"):
                setattr(module, name, torch.zeros_like(getattr(module, name), device="cpu"))
            for name in ("expert_mask", "locality_mask"):
                setattr(module, name, torch.ones_like(getattr(module, name), device="cpu"))
    return model


def is_qwen3_moe_vl_dir(path: str | Path | None) -> bool:
    """Whether ``path`` is a directory whose ``config.json`` ``model_type`` is a Qwen3-VL-MoE
    family (:data:`QWEN3_MOE_FAMILIES`); reads that file only (``False`` without one)."""
    return is_qwen_vl_dir(path, QWEN3_MOE_FAMILIES)


def _architecture(config: Any) -> tuple[Any, dict[str, tuple[torch.Size, torch.dtype]]]:
    """The transformers model of ``config`` on the meta device and its tensors' shapes and
    dtypes (untied ``lm_head``)."""
    import transformers

    config.tie_word_embeddings = config.get_text_config().tie_word_embeddings = False
    with torch.device("meta"):
        model = getattr(transformers, QWEN3_MOE_FAMILIES[config.model_type])(config)
    return model, {k: (v.shape, v.dtype) for k, v in model.state_dict().items()}


def check_export(
    tensors: Mapping[str, Tensor], expected: Mapping[str, tuple[torch.Size, torch.dtype]]
) -> int:
    """Raise unless ``tensors`` hold exactly the ``expected`` names with their full shapes
    (every expert of every MoE layer) and the same total bytes; returns the bytes.

    Raises:
        ValueError: naming the missing / unexpected tensors, the short ones (an expert tensor
            with fewer experts than the architecture: an expert-parallel rank's local block)
            and the byte totals.
    """
    missing = sorted(expected.keys() - tensors.keys())
    stray = sorted(tensors.keys() - expected.keys())
    short = sorted(
        f"{k} {list(tensors[k].shape)} (expected {list(expected[k][0])})"
        for k in expected.keys() & tensors.keys()
        if tuple(tensors[k].shape) != tuple(expected[k][0])
    )
    size = {k: t.element_size() for k, t in tensors.items()}  # the dtype written
    want = sum(
        s.numel() * size.get(k, torch.empty((), dtype=d).element_size())
        for k, (s, d) in expected.items()
    )
    got = sum(t.numel() * t.element_size() for t in tensors.values())
    if missing or stray or short or got != want:
        raise ValueError(
            f"export refused: {got} of {want} bytes; missing {missing[:8]} "
            f"({len(missing)}), unexpected {stray[:8]}, wrong shape (short experts?) "
            f"{short[:8]} ({len(short)}); gather every expert shard (full_state_dict on every "
            "rank) before exporting."
        )
    return got


def qwen3_moe_vl_from_transformers(model: Any) -> Qwen3MoeVLModel:
    """A :class:`Qwen3MoeVLModel` with the weights of a transformers
    ``Qwen3VLMoeForConditionalGeneration`` (its dtype).

    Raises:
        ValueError: an unsupported config value (:func:`qwen3_moe_vl_config`), or state-dict
            keys that do not match.
    """
    config = qwen3_moe_vl_config(model.config)
    dtype = next(model.parameters()).dtype
    with torch.device("meta"):
        ours = Qwen3MoeVLModel(config)
    state = import_qwen3_moe_vl_state(model.state_dict(), config)
    ours.load_state_dict(state, strict=True, assign=True)
    return init_moe_buffers(ours).to(dtype)


def qwen3_moe_vl_from_hf(path: str | Path) -> Qwen3MoeVLModel:
    """A :class:`Qwen3MoeVLModel` of the local transformers directory ``path`` (``config.json``
    + safetensors, never the network), on the CPU in the checkpoint's dtype.

    Raises:
        ValueError: no config.json / safetensors, an unsupported config value (naming the
            field), or tensors that do not fit the model (naming them).
    """
    path = Path(path)
    config = qwen3_moe_vl_config(_hf_config(path))
    state = import_qwen3_moe_vl_state(_read_tensors(path), config)
    with torch.device("meta"):
        model = Qwen3MoeVLModel(config)
    _load_fitting(path, model, state)
    return init_moe_buffers(model)


def save_qwen3_moe_vl_hf(
    source: Qwen3MoeVLModel | Mapping[str, Tensor], original: str | Path, path: str | Path
) -> dict[str, Tensor]:
    """Write a full state dict of ours (or the model) as a transformers directory at ``path``
    for the architecture of the directory ``original`` (its config; its tokenizer / processor
    files copied), through transformers' ``save_pretrained``; then read the written files back
    and check them (:func:`check_export`). Returns the tensors written. A tied source is
    written untied. Under ``torch.distributed`` every rank may call it with the gathered state
    (:func:`lightning_mmpar.parallel.tensor.full_state_dict`): global rank 0 writes and checks
    (transformers' rule), the others check the state only; barrier before reading it back.

    Raises:
        ValueError: a sharded ``DTensor`` in ``source``; tensors missing or short (experts of
            one ep rank only) against the architecture, naming them (nothing written); the
            written files not matching (naming the tensors).
    """
    original, path = Path(original), Path(path)
    config = _hf_config(original)
    state = source.state_dict() if isinstance(source, torch.nn.Module) else source
    tensors = export_qwen3_moe_vl_state(state, qwen3_moe_vl_config(config))
    model, expected = _architecture(config)
    check_export(tensors, expected)
    model.load_state_dict(tensors, strict=True, assign=True)
    model.save_pretrained(str(path))
    if not getattr(model, "should_save_on_this_rank", lambda main: main)(True):
        return tensors  # transformers writes on global rank 0 only
    _copy_side_files(original, path)
    check_export(_read_tensors(path), expected)
    return tensors
