"""Local tower checkpoints read tensor by tensor, slice by slice (no full copy in memory).

* **open_clip** (``model.pretrained.vision``): a directory written for open_clip's
  ``local-dir:`` schema (``open_clip_config.json`` + ``open_clip_model.safetensors`` or
  ``open_clip_pytorch_model.bin``) or a state-dict file (``.safetensors``, or ``.pt`` / ``.pth``
  / ``.bin`` read with ``torch.load(mmap=True, weights_only=True)``) of a whole CLIP model
  (``visual.*`` keys, a ``state_dict`` wrapper and DDP's ``module.`` prefix allowed) or of its
  ``.visual`` alone. Only a directory carries the tower's config.
* **transformers vision-language model** (``model.pretrained.hf``): a ``save_pretrained``
  directory of a family of :mod:`lightning_mmpar.models.hf` (LLaVA), one view per part of
  ours through the family's key table (:func:`transformers_vlm`).
* **transformers Llama** (``model.pretrained.language``): a ``save_pretrained`` directory with
  ``config.json`` and ``model.safetensors`` (or sharded, with ``model.safetensors.index.json``),
  read with ``safetensors.safe_open(...).get_slice`` per key.

:class:`TensorFile` returns the requested slice only: a safetensors slice reads those bytes, a
memory-mapped ``torch.load`` tensor pages them in on copy. ``bytes_read`` counts what was copied.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_mmpar.models.convert import language_config_from_llama, vision_config_from_open_clip
from lightning_mmpar.models.language import LanguageConfig
from lightning_mmpar.models.vision import VisionConfig

__all__ = [
    "TensorFile",
    "open_clip_vision",
    "transformers_llama",
    "transformers_qwen_vl",
    "transformers_vlm",
]

OPEN_CLIP_CONFIG = "open_clip_config.json"
OPEN_CLIP_WEIGHTS = ("open_clip_model.safetensors", "open_clip_pytorch_model.bin")
LLAMA_INDEX = "model.safetensors.index.json"
LLAMA_WEIGHTS = "model.safetensors"
IGNORED_KEYS = ("rotary_emb.inv_freq",)
"""Checkpoint keys with no parameter (buffers some transformers versions saved)."""

Index = tuple[slice, ...]
Spot = tuple[str, Path]
"""A checkpoint tensor: ``(key in the file, safetensors file)``."""


class TensorFile:
    """Named tensors of one checkpoint: ``shapes`` (global), ``read(key, index)`` (a slice).

    Args:
        path: what the tensors came from (for error messages).
        shapes: ``{key: shape}`` of every tensor.
        fetch: ``(file key, index) -> tensor`` reading only the slice.
        rename: ``{our key: file key}`` where they differ (prefixes stripped).
    """

    def __init__(
        self,
        path: Path,
        shapes: dict[str, tuple[int, ...]],
        fetch: Callable[[str, Index], Tensor],
        rename: dict[str, str] | None = None,
    ) -> None:
        self.path = path
        self.shapes = shapes
        self._fetch = fetch
        self._rename = rename or {}
        self.bytes_read = 0
        """Bytes copied out of the file so far."""

    def read(self, key: str, index: Index) -> Tensor:
        """``tensor[index]`` of ``key`` (a copy, contiguous)."""
        out = self._fetch(self._rename.get(key, key), index).contiguous()
        self.bytes_read += out.numel() * out.element_size()
        return out

    @classmethod
    def safetensors(cls, path: Path, files: dict[str, Path], prefix: str = "") -> TensorFile:
        """Keys of the ``.safetensors`` ``files`` (``{key: file}``) that start with ``prefix``
        (stripped)."""
        from safetensors import safe_open

        shapes: dict[str, tuple[int, ...]] = {}
        rename: dict[str, str] = {}
        for file in sorted(set(files.values())):
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for key in handle.keys():
                    if files.get(key) == file and key.startswith(prefix):
                        ours = key.removeprefix(prefix)
                        shapes[ours] = tuple(handle.get_slice(key).get_shape())
                        rename[ours] = key

        def fetch(key: str, index: Index) -> Tensor:
            with safe_open(str(files[key]), framework="pt", device="cpu") as handle:
                return handle.get_slice(key)[index]

        return cls(path, shapes, fetch, rename)

    @classmethod
    def torch_file(cls, path: Path, prefix: str = "") -> TensorFile:
        """A ``torch.save`` state dict, memory-mapped; keys under ``prefix`` (stripped)."""
        try:
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as err:  # torch raises RuntimeError / UnpicklingError / EOFError
            raise ValueError(
                f"{path}: not a torch.save state dict readable with torch.load(mmap=True, "
                f"weights_only=True) ({err}); save it with torch.save(model.state_dict(), path)."
            ) from err
        if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
            state = state["state_dict"]
        if not isinstance(state, dict):
            raise ValueError(f"{path}: holds a {type(state).__name__}, not a state dict.")
        tensors = {k: v for k, v in state.items() if isinstance(v, Tensor)}
        tensors = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
        shapes = {k: tuple(v.shape) for k, v in tensors.items()}
        return cls(path, shapes, lambda key, index: tensors[key][index].clone())


def _strip_prefix(keys: list[str]) -> str:
    """The prefix in front of open_clip's ``visual`` keys (``""`` for a ``.visual`` dict)."""
    for prefix in ("module.visual.", "visual.", "module."):
        if any(k.startswith(prefix) for k in keys):
            return prefix
    return ""


def _vision_config(directory: Path) -> VisionConfig:
    """The ViT of ``open_clip_config.json``, built on the meta device by open_clip itself."""
    import open_clip

    try:
        model_cfg = json.loads((directory / OPEN_CLIP_CONFIG).read_text())["model_cfg"]
    except (json.JSONDecodeError, KeyError) as err:
        raise ValueError(
            f"{directory / OPEN_CLIP_CONFIG}: no 'model_cfg' ({err}); write it as open_clip's "
            "save_for_hf does ({'model_cfg': ..., 'preprocess_cfg': ...})."
        ) from err
    previous = logging.root.manager.disable  # open_clip warns "initialized randomly": on meta
    logging.disable(logging.WARNING)
    try:
        model = open_clip.create_model(f"local-dir:{directory}", load_weights=False, device="meta")
    finally:
        logging.disable(previous)
    visual: Any = getattr(model, "visual", model)
    first = visual.transformer.resblocks[0]
    if hasattr(first.ls_1, "gamma"):  # its init value, not a meta tensor's
        ls = float(model_cfg.get("vision_cfg", {}).get("ls_init_value") or 0.0)
        first.ls_1.gamma = nn.Parameter(torch.full((1,), ls))
    return vision_config_from_open_clip(visual)


def open_clip_vision(path: str | Path) -> tuple[VisionConfig | None, TensorFile]:
    """``(config, tensors)`` of an open_clip vision tower (keys of ``model.visual``).

    The config is ``None`` for a bare state-dict file (it has none: the recipe's sizes apply and
    every tensor shape is checked against them when loading).

    Raises:
        ValueError: the path does not exist, or a directory lacks the config or the weights.
    """
    path = Path(path)
    if path.is_dir():
        weights = [path / f for f in OPEN_CLIP_WEIGHTS if (path / f).is_file()]
        if not (path / OPEN_CLIP_CONFIG).is_file() or not weights:
            raise ValueError(
                f"model.pretrained.vision ({str(path)!r}): an open_clip directory needs "
                f"{OPEN_CLIP_CONFIG} and one of {list(OPEN_CLIP_WEIGHTS)}; or pass a state-dict "
                "file."
            )
        return _vision_config(path), _vision_file(weights[0])
    if not path.is_file():
        raise ValueError(
            f"model.pretrained.vision ({str(path)!r}) does not exist; pass an open_clip "
            "directory or state-dict file."
        )
    return None, _vision_file(path)


def _vision_file(file: Path) -> TensorFile:
    if file.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(file), framework="pt", device="cpu") as handle:
            keys = list(handle.keys())
        prefix = _strip_prefix(keys)
        return TensorFile.safetensors(file, dict.fromkeys(keys, file), prefix)
    probe = TensorFile.torch_file(file)
    return TensorFile.torch_file(file, _strip_prefix(list(probe.shapes)))


def transformers_llama(directory: str | Path) -> tuple[LanguageConfig, TensorFile]:
    """``(config, tensors)`` of a transformers Llama directory (keys as in ``LlamaForCausalLM``).

    Raises:
        ValueError: not a directory with a Llama ``config.json`` and safetensors weights, or a
            config this decoder cannot express (:func:`language_config_from_llama`).
    """
    path = Path(directory)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model.pretrained.language ({str(path)!r}) needs config.json: pass a directory "
            "written by LlamaForCausalLM.save_pretrained."
        )
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    if config.model_type != "llama":
        raise ValueError(
            f"model.pretrained.language ({str(path)!r}) is a {config.model_type!r} model; only "
            "'llama' (LlamaForCausalLM) is supported."
        )
    if (path / LLAMA_INDEX).is_file():
        weight_map = json.loads((path / LLAMA_INDEX).read_text())["weight_map"]
        files = {k: path / f for k, f in weight_map.items()}
    elif (path / LLAMA_WEIGHTS).is_file():
        from safetensors import safe_open

        with safe_open(str(path / LLAMA_WEIGHTS), framework="pt", device="cpu") as handle:
            files = dict.fromkeys(handle.keys(), path / LLAMA_WEIGHTS)
    else:
        raise ValueError(
            f"model.pretrained.language ({str(path)!r}) has no {LLAMA_WEIGHTS} (or "
            f"{LLAMA_INDEX}); re-save it with save_pretrained(..., safe_serialization=True)."
        )
    return language_config_from_llama(config), TensorFile.safetensors(path, files)


def transformers_vlm(directory: str | Path, keys: list[str]) -> dict[str, TensorFile]:
    """The parts of a transformers vision-language checkpoint (``model.pretrained.hf``) as one
    :class:`TensorFile` per part of our model (``vision``, ``projector``, ``language``), keyed
    by our state-dict keys within the part (``keys``: the model's full keys), through the
    family's key table (:func:`lightning_mmpar.models.hf.checkpoint.locate`). A key stacked
    from several checkpoint tensors (q/k/v into ``[3, D, D]``) reads each one's slice.

    Raises:
        ValueError: as :func:`~lightning_mmpar.models.hf.hf_fusion_config` and
            :func:`~lightning_mmpar.models.hf.checkpoint.locate` (naming the tensors).
    """
    from lightning_mmpar.models.hf import family_of
    from lightning_mmpar.models.hf.checkpoint import hf_config, locate

    path = Path(directory)
    by_part: dict[str, dict[str, tuple[Spot, ...]]] = {}
    for key, spots in locate(path, family_of(hf_config(path)), keys).items():
        part, _, local = key.partition(".")
        by_part.setdefault(part, {})[local] = spots
    return {part: _stacked_file(path, spots) for part, spots in by_part.items()}


def _stacked_file(path: Path, spots: dict[str, tuple[Spot, ...]]) -> TensorFile:
    """A :class:`TensorFile` whose key ``k`` is the checkpoint tensor ``spots[k][0]``, or the
    tensors ``spots[k]`` stacked on a new dim 0."""
    from safetensors import safe_open

    from lightning_mmpar.models.hf.checkpoint import read_slice

    shapes: dict[str, tuple[int, ...]] = {}
    for key, where in spots.items():
        with safe_open(str(where[0][1]), framework="pt", device="cpu") as handle:
            one = tuple(handle.get_slice(where[0][0]).get_shape())
        shapes[key] = one if len(where) == 1 else (len(where), *one)

    def fetch(key: str, index: Index) -> Tensor:
        where = spots[key]
        if len(where) == 1:
            return read_slice(where[0], index)
        return torch.stack([read_slice(where[c], index[1:]) for c in range(len(where))[index[0]]])

    return TensorFile(path, shapes, fetch)


def transformers_qwen_vl(directory: str | Path) -> dict[str, TensorFile]:
    """The towers of a Qwen2-VL / Qwen2.5-VL / Qwen3-VL-MoE directory (``model.pretrained.hf``)
    as one :class:`TensorFile` per part of the model (``vision``, ``language``), keyed by our
    names within the part, through the same key mapping as the family's import
    (:func:`~lightning_mmpar.models.hf.qwen_convert.qwen_checkpoint_key`,
    :func:`~lightning_mmpar.models.hf.qwen3_convert.qwen3_checkpoint_views`): each of our
    tensors is a :class:`~lightning_mmpar.models.hf.checkpoint.View` of one checkpoint tensor,
    so a rank's slice reads only its bytes (a third of the ViT's fused ``attn.qkv`` rows, an
    expert-parallel rank's experts of the fused ``gate_up_proj`` / ``down_proj``, transposed
    on the fly); the Conv3d patch embedding is read whole; a tied checkpoint's ``lm_head`` is
    the input embedding. Keys the mapping does not know stay under their own name (the loader
    then refuses them as stray).

    Raises:
        ValueError: no safetensors weights in the directory; an unsupported config value.
    """
    from safetensors import safe_open

    from lightning_mmpar.models.hf.checkpoint import checkpoint_files, read_view

    path = Path(directory)
    views = _qwen_views(path)
    shapes: dict[str, dict[str, tuple[int, ...]]] = {"vision": {}, "language": {}}
    fetch: dict[str, dict[str, Callable[[Index], Tensor]]] = {"vision": {}, "language": {}}
    for key, file in checkpoint_files(path).items():
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            shape = tuple(handle.get_slice(key).get_shape())
        for ours, view in views(key, shape).items():
            part, _, local = ours.partition(".")
            part = part if part in shapes else "language"
            shapes[part][local] = view.shape
            fetch[part][local] = partial(read_view, (key, file), view)
    if "lm_head.weight" not in shapes["language"] and "embed_tokens.weight" in shapes["language"]:
        shapes["language"]["lm_head.weight"] = shapes["language"]["embed_tokens.weight"]
        fetch["language"]["lm_head.weight"] = fetch["language"]["embed_tokens.weight"]
    return {
        part: TensorFile(path, shapes[part], partial(_dispatch, fetch[part]))
        for part in ("vision", "language")
    }


def _qwen_views(path: Path) -> Callable[[str, tuple[int, ...]], dict[str, Any]]:
    """``(checkpoint key, shape) -> {our key: View}`` of the Qwen directory ``path``'s family."""
    from lightning_mmpar.models.hf.checkpoint import View, hf_config
    from lightning_mmpar.models.hf.qwen3_convert import (
        QWEN3_MOE_FAMILIES,
        qwen3_checkpoint_views,
        qwen3_moe_vl_config,
    )
    from lightning_mmpar.models.hf.qwen_convert import qwen_checkpoint_key

    config = hf_config(path)
    if config.model_type in QWEN3_MOE_FAMILIES:
        return partial(qwen3_checkpoint_views, config=qwen3_moe_vl_config(config))

    def qwen2(key: str, shape: tuple[int, ...]) -> dict[str, Any]:
        out = {}
        for ours, (offset, rows, flat) in qwen_checkpoint_key(key, shape).items():
            if flat:
                out[ours] = View((shape[0], math.prod(shape[1:])), flat=True)
            else:
                out[ours] = View((rows, *shape[1:]), (offset, *(0,) * (len(shape) - 1)))
        return out

    return qwen2


def _dispatch(table: dict[str, Callable[[Index], Tensor]], key: str, index: Index) -> Tensor:
    return table[key](index)
