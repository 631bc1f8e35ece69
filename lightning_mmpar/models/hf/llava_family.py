"""transformers' ``LlavaForConditionalGeneration`` (CLIP ViT + MLP projector + Llama) as a
:class:`~lightning_mmpar.models.fusion.FusionModel` with spliced image tokens.

Math (transformers ``LlavaModel.get_image_features`` / ``forward``)::

    h_v = CLIP(pixels).hidden_states[vision_feature_layer]   # pre_layrnorm'd embeddings, layers
    h_v = h_v[:, 1:] ("default": class token dropped) or h_v ("full")
    img = linear_2(act(linear_1(h_v)))                         # multi_modal_projector
    h   = embed(ids) with the image-token rows replaced by img   # masked_scatter
    logits = lm_head(norm(llama_layers(h)))

Mapped onto the package's blocks: the ViT keeps only the layers up to ``vision_feature_layer``
(``-2`` of 24: 23 layers run; the rest are never used, :data:`HFFamily.unused_keys`), its token
output is un-normalised (``final_ln_after_pool``; ``post_layernorm`` is kept as ``ln_post`` for
the pooled feature only), the projector is ``mlp2x``, the fusion ``spliced`` with no adapter
blocks. The contrastive heads (``vision.proj``, ``image_head``, ``text_head``, ``logit_scale``)
have no LLaVA counterpart: fresh, never exported.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Literal, cast

from lightning_mmpar.models.adapter import AdapterConfig
from lightning_mmpar.models.convert import language_config_from_llama
from lightning_mmpar.models.fusion import FusionConfig
from lightning_mmpar.models.hf.family import HFFamily
from lightning_mmpar.models.projector import PROJECTOR_ACTS, ProjectorAct
from lightning_mmpar.models.vision import VisionConfig

__all__ = ["LLAVA", "llava_fusion_config", "llava_hf_keys"]

V = "model.vision_tower."
L = "model.language_model."
_PREFIXES: tuple[tuple[str, str], ...] = (
    ("vision.conv1.", f"{V}embeddings.patch_embedding."),
    ("vision.class_embedding", f"{V}embeddings.class_embedding"),
    ("vision.positional_embedding", f"{V}embeddings.position_embedding.weight"),
    ("vision.ln_pre.", f"{V}pre_layrnorm."),
    ("vision.ln_post.", f"{V}post_layernorm."),
    ("projector.", "model.multi_modal_projector."),
    ("language.lm_head.", "lm_head."),
    ("language.", L),
)
"""Our key prefix -> checkpoint key prefix (first match wins)."""
_LAYER = re.compile(r"^vision\.transformer\.resblocks\.(\d+)\.(.+)$")
_LAYER_PARTS: dict[str, tuple[str, ...]] = {
    "attn.in_proj_weight": tuple(f"self_attn.{c}_proj.weight" for c in "qkv"),
    "attn.in_proj_bias": tuple(f"self_attn.{c}_proj.bias" for c in "qkv"),
    "attn.out_proj.weight": ("self_attn.out_proj.weight",),
    "attn.out_proj.bias": ("self_attn.out_proj.bias",),
    "ln_1.weight": ("layer_norm1.weight",),
    "ln_1.bias": ("layer_norm1.bias",),
    "ln_2.weight": ("layer_norm2.weight",),
    "ln_2.bias": ("layer_norm2.bias",),
    "mlp.c_fc.weight": ("mlp.fc1.weight",),
    "mlp.c_fc.bias": ("mlp.fc1.bias",),
    "mlp.c_proj.weight": ("mlp.fc2.weight",),
    "mlp.c_proj.bias": ("mlp.fc2.bias",),
}
"""One ViT layer: our key (open_clip names) -> CLIP encoder layer keys (q, k, v stacked)."""
_LEGACY: tuple[tuple[str, str], ...] = (
    ("language_model.lm_head.", "lm_head."),
    ("language_model.model.", L),
    ("language_model.", L),
    (f"{V}vision_model.", V),
    ("vision_tower.vision_model.", V),
    ("vision_tower.", V),
    ("multi_modal_projector.", "model.multi_modal_projector."),
)
"""The file layout (the Hub's llava-hf files; transformers 5 still saves in it) -> the module
layout (transformers' ``conversion_mapping`` for ``llava``)."""


def llava_hf_keys(key: str) -> tuple[str, ...]:
    """Our state-dict key -> its ``LlavaForConditionalGeneration`` keys (module docstring)."""
    layer = _LAYER.match(key)
    if layer:
        parts = _LAYER_PARTS.get(layer.group(2), ())
        return tuple(f"{V}encoder.layers.{layer.group(1)}.{p}" for p in parts)
    for ours, theirs in _PREFIXES:
        if key.startswith(ours):
            return (theirs + key.removeprefix(ours),)
    return ()


def normalize_llava_key(key: str) -> str:
    """A checkpoint key of an older layout in the current layout (:data:`_LEGACY`)."""
    for old, new in _LEGACY:
        if key.startswith(old):
            return new + key.removeprefix(old)
    return key


def _refuse(field: str, value: Any, fix: str) -> ValueError:
    return ValueError(f"LLaVA config.json: {field} = {value!r} is not supported; {fix}.")


def feature_layers(config: Any) -> int:
    """ViT layers that run: ``vision_feature_layer`` indexes ``hidden_states`` (the embeddings,
    then one entry per layer), so ``-2`` of ``L`` layers is ``L - 1`` layers and ``k >= 0`` is
    ``k`` layers."""
    layer, total = config.vision_feature_layer, config.vision_config.num_hidden_layers
    if not isinstance(layer, int) or isinstance(layer, bool):
        raise _refuse(
            "vision_feature_layer", layer, "only one int (concatenated layer lists are not)"
        )
    kept = total + 1 + layer if layer < 0 else layer
    if not 0 <= kept <= total:
        raise _refuse("vision_feature_layer", layer, f"the ViT has {total} layers")
    return kept


def _vision(config: Any) -> VisionConfig:
    v = config.vision_config
    checks: tuple[tuple[str, Any, bool, str], ...] = (
        ("vision_config.model_type", v.model_type, v.model_type == "clip_vision_model", "CLIP"),
        ("vision_config.hidden_act", v.hidden_act, v.hidden_act in ("gelu", "quick_gelu"), ""),
        ("vision_config.layer_norm_eps", v.layer_norm_eps, v.layer_norm_eps == 1e-5, "1e-5"),
        ("vision_config.num_channels", v.num_channels, v.num_channels == 3, "3"),
        ("vision_config.attention_dropout", v.attention_dropout, not v.attention_dropout, "0"),
    )
    for field, value, ok, want in checks:
        if not ok:
            raise _refuse(field, value, f"supported: {want or 'gelu, quick_gelu'}")
    strategy = config.vision_feature_select_strategy
    if strategy not in ("default", "full"):
        raise _refuse("vision_feature_select_strategy", strategy, "use 'default' or 'full'")
    return VisionConfig(
        image_size=v.image_size,
        patch_size=v.patch_size,
        width=v.hidden_size,
        layers=feature_layers(config),
        heads=v.num_attention_heads,
        mlp_ratio=v.intermediate_size / v.hidden_size,
        output_dim=v.hidden_size,
        final_ln_after_pool=True,
        act=cast(Literal["gelu", "quick_gelu"], v.hidden_act),
        keep_class_token=strategy == "full",
    )


def _check_text(text: Any) -> None:
    """Refuse a text config this decoder cannot express, naming the field's full path."""
    if text.model_type != "llama":
        raise _refuse("text_config.model_type", text.model_type, "only 'llama'")
    if getattr(text, "attention_dropout", 0.0):
        raise _refuse("text_config.attention_dropout", text.attention_dropout, "set 0.0")
    rope = getattr(text, "rope_parameters", None) or {}
    kind = rope.get("rope_type", "default")
    if kind != "default":
        raise _refuse(
            "text_config.rope_parameters.rope_type (config.json: text_config.rope_scaling)",
            kind,
            "only 'default' (RoPE frequency scaling, e.g. Llama 3's 'llama3', is not "
            "implemented); use a checkpoint with default RoPE",
        )
    if text.hidden_act != "silu":
        raise _refuse("text_config.hidden_act", text.hidden_act, "only 'silu'")


def llava_fusion_config(config: Any) -> FusionConfig:
    """A transformers ``LlavaConfig`` as a :class:`FusionConfig` (module docstring).

    Raises:
        ValueError: a value that changes the math and is not implemented, naming the field:
            a vision tower other than CLIP, ``vision_feature_layer`` lists or out of range,
            other select strategies, layer-norm epsilons or activations, dropout, a text model
            other than Llama or its rope types (:func:`language_config_from_llama`).
    """
    text = config.text_config
    _check_text(text)
    if config.projector_hidden_act not in _ACTS:
        raise _refuse("projector_hidden_act", config.projector_hidden_act, f"one of {_ACTS}")
    vision = _vision(config)
    return FusionConfig(
        vision=vision,
        language=language_config_from_llama(text),
        adapter=AdapterConfig(num_blocks=0),
        contrastive_dim=vision.width,
        fusion="spliced",
        image_token_id=int(config.image_token_id),
        projector="mlp2x",
        projector_act=cast(ProjectorAct, _ACTS[config.projector_hidden_act]),
        projector_bias=bool(config.multimodal_projector_bias),
    )


_ACTS = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "quick_gelu": "quick_gelu"}
_ACTS |= {"silu": "silu", "relu": "relu"}
assert set(_ACTS.values()) == set(PROJECTOR_ACTS)


def unused_llava_keys(config: Any) -> Callable[[str], bool]:
    """Checkpoint keys of the ViT layers after ``vision_feature_layer`` (never run)."""
    kept = feature_layers(config)
    layer = re.compile(rf"^{re.escape(V)}encoder\.layers\.(\d+)\.")

    def unused(key: str) -> bool:
        match = layer.match(key)
        return match is not None and int(match.group(1)) >= kept

    return unused


LLAVA = HFFamily(
    model_class="LlavaForConditionalGeneration",
    fusion_config=llava_fusion_config,
    hf_keys=llava_hf_keys,
    unused_keys=unused_llava_keys,
    normalize_key=normalize_llava_key,
)
"""The ``llava`` family."""
