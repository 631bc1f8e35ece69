"""Read and write transformers checkpoint directories (``config.json`` + safetensors).

Local directories only (``local_files_only=True``), never the network. Reading follows a
family's key table (:class:`~lightning_mmpar.models.hf.family.HFFamily`); writing inverts it
and lets transformers' own ``save_pretrained`` lay the directory out.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_mmpar.models.hf.family import HFFamily

__all__ = [
    "Spot",
    "View",
    "checkpoint_files",
    "hf_config",
    "locate",
    "model_type_of",
    "read_slice",
    "read_state",
    "read_view",
    "to_hf_state",
    "write_hf",
]

INDEX = "model.safetensors.index.json"
WEIGHTS = "model.safetensors"
_OURS = ("config.json", "generation_config.json", INDEX)
"""Files ``write_hf`` writes itself (the rest of the source directory is copied)."""


def _config_file(path: str | Path) -> Path:
    """``path/config.json``.

    Raises:
        ValueError: it is missing (a path to the file itself: its directory named).
    """
    file = Path(path) / "config.json"
    if not file.is_file():
        given = Path(path)
        hint = (
            f"pass its directory, {str(given.parent)!r}"
            if given.is_file()
            else "pass a directory written by transformers' save_pretrained"
        )
        raise ValueError(f"{str(path)!r} has no config.json: {hint}.")
    return file


def hf_config(path: str | Path) -> Any:
    """The transformers config object of a local directory (``AutoConfig``).

    Raises:
        ValueError: no ``config.json`` in ``path``.
    """
    _config_file(path)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(Path(path)), local_files_only=True)


def model_type_of(path: str | Path) -> str:
    """``config.json``'s ``model_type`` in the directory ``path``, read as JSON (transformers
    is not asked, so a caller can refuse an unsupported type with its own message first).

    Raises:
        ValueError: no ``config.json`` in ``path``, one that is not a JSON object, or one
            without a ``model_type`` string (naming the path).
    """
    file = _config_file(path)
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{str(file)!r} is not valid JSON ({err}).") from err
    if not isinstance(config, dict):
        raise ValueError(
            f"{str(file)!r} holds a JSON {type(config).__name__}, not an object: pass a "
            "directory written by transformers' save_pretrained."
        )
    kind = config.get("model_type")
    if not isinstance(kind, str):
        found = "no 'model_type' key" if kind is None else f"'model_type' {kind!r}"
        raise ValueError(
            f"{str(file)!r} has {found}; a string such as 'llava' or 'qwen2_vl' is needed: "
            "pass a directory written by transformers' save_pretrained."
        )
    return kind


def checkpoint_files(path: str | Path) -> dict[str, Path]:
    """``{checkpoint key: safetensors file}`` of a directory (one file or an index).

    Raises:
        ValueError: neither ``model.safetensors`` nor ``model.safetensors.index.json``.
    """
    path = Path(path)
    if (path / INDEX).is_file():
        weight_map = json.loads((path / INDEX).read_text())["weight_map"]
        return {k: path / f for k, f in weight_map.items()}
    if not (path / WEIGHTS).is_file():
        raise ValueError(
            f"{str(path)!r} has no {WEIGHTS} (or {INDEX}); re-save it with "
            "save_pretrained(..., safe_serialization=True)."
        )
    from safetensors import safe_open

    with safe_open(str(path / WEIGHTS), framework="pt", device="cpu") as handle:
        return dict.fromkeys(handle.keys(), path / WEIGHTS)


Spot = tuple[str, Path]
"""Where a checkpoint tensor lies: ``(key in the file, safetensors file)``."""


def locate(path: str | Path, family: HFFamily, keys: list[str]) -> dict[str, tuple[Spot, ...]]:
    """``{our key: checkpoint tensors}`` for ``keys`` (ours) that have a counterpart, through
    the family's table (several: stacked on a new dim 0). A tied checkpoint's missing
    ``lm_head.weight`` is the input embedding.

    Raises:
        ValueError: a checkpoint tensor the table needs is missing, or one neither mapped nor
            unused by the family (naming them).
    """
    config = hf_config(path)
    files = {family.normalize_key(k): (k, f) for k, f in checkpoint_files(path).items()}
    if getattr(config, "tie_word_embeddings", False) and "lm_head.weight" not in files:
        files["lm_head.weight"] = files["model.language_model.embed_tokens.weight"]
    table = family.table(keys)
    wanted = {hf for hfs in table.values() for hf in hfs}
    missing = sorted(wanted - files.keys())
    unused = family.unused_keys(config)
    stray = sorted(k for k in files.keys() - wanted if not unused(k))
    if missing or stray:
        raise ValueError(
            f"{path}: the checkpoint does not fit the model: missing {missing[:8]}, "
            f"unexpected {stray[:8]}."
        )
    return {k: tuple(files[h] for h in hfs) for k, hfs in table.items()}


def read_slice(spot: Spot, index: tuple[slice, ...] = ()) -> Tensor:
    """``tensor[index]`` of one checkpoint tensor, reading only those bytes."""
    from safetensors import safe_open

    with safe_open(str(spot[1]), framework="pt", device="cpu") as handle:
        return handle.get_slice(spot[0])[index] if index else handle.get_tensor(spot[0])


@dataclass(frozen=True)
class View:
    """How one tensor of ours lies in one checkpoint tensor, so that a rank reads only the
    bytes of its slice: ours ``= ckpt[start + ...]``, then ``transpose(-2, -1)`` when
    ``transposed``, then a new leading dim of 1 when ``unsqueezed``; ``flat``: ours is the
    whole checkpoint tensor reshaped (read whole: a small replicated tensor)."""

    shape: tuple[int, ...]
    """Our tensor's (global) shape."""
    start: tuple[int, ...] = ()
    """Offset of ours in each checkpoint dim (empty: 0 everywhere)."""
    transposed: bool = False
    unsqueezed: bool = False
    flat: bool = False


def read_view(spot: Spot, view: View, index: tuple[slice, ...]) -> Tensor:
    """``ours[index]`` of the checkpoint tensor at ``spot`` seen through ``view``, reading only
    those bytes (``index``: one slice with explicit bounds per dim of ``view.shape``)."""
    if view.flat:
        return read_slice(spot).reshape(view.shape)[index]
    where = list(index[1:] if view.unsqueezed else index)
    if view.transposed:
        where[-2], where[-1] = where[-1], where[-2]
    start = view.start or (0,) * len(where)
    out = read_slice(
        spot, tuple(slice(s.start + o, s.stop + o) for s, o in zip(where, start, strict=True))
    )
    if view.transposed:
        out = out.transpose(-2, -1)
    return out[None] if view.unsqueezed else out


def read_state(path: str | Path, family: HFFamily, keys: list[str]) -> dict[str, Tensor]:
    """Our state dict for ``keys`` from the checkpoint in ``path`` (whole tensors; the recipe
    reads per-rank slices instead, :mod:`lightning_mmpar.recipes.pretrained`).

    Raises:
        ValueError: as :func:`locate`.
    """
    return {
        k: _join([read_slice(s) for s in spots]) for k, spots in locate(path, family, keys).items()
    }


def _join(parts: list[Tensor]) -> Tensor:
    return parts[0] if len(parts) == 1 else torch.stack(parts)


def to_hf_state(family: HFFamily, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A full state dict of ours as checkpoint tensors (the key table inverted: stacked
    tensors split on dim 0); keys without a counterpart are left out."""
    out: dict[str, Tensor] = {}
    for key, hfs in family.table(list(state)).items():
        value = state[key]
        parts = [value] if len(hfs) == 1 else list(value.unbind(0))
        out.update({h: p.detach().contiguous() for h, p in zip(hfs, parts, strict=True)})
    return out


def write_hf(
    family: HFFamily, state: Mapping[str, Tensor], source: str | Path, path: str | Path
) -> dict[str, Tensor]:
    """Write ``state`` (a full state dict of ours) as a ``save_pretrained`` directory at
    ``path`` for the architecture of ``source`` (its config; the checkpoint tensors the model
    does not hold copied from it; its tokenizer / processor files copied). Returns the
    written tensors (the module layout of transformers).

    Vocabulary rows past the config's ``vocab_size`` (tensor-parallel padding) are dropped. A
    tied source whose ``lm_head`` no longer equals the input embedding (our language model
    keeps them apart, so training separates them) is written untied
    (``tie_word_embeddings=False``), keeping both exactly.

    Raises:
        ValueError: a tensor of the architecture missing, or of another shape (naming them);
            nothing is written then.
    """
    import transformers

    config = hf_config(source)
    tensors = to_hf_state(family, state) | _unused_tensors(family, config, source)
    with torch.device("meta"):
        model = getattr(transformers, family.model_class)(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    tensors = _fit_rows(tensors, expected, path)
    embed = tensors.get("model.language_model.embed_tokens.weight")
    head = tensors.get("lm_head.weight", embed)
    if _tied(config) and embed is not None and head is not None and not torch.equal(head, embed):
        config.tie_word_embeddings = config.get_text_config().tie_word_embeddings = False
        with torch.device("meta"):
            model = getattr(transformers, family.model_class)(config)
    if _tied(config):
        tensors.pop("lm_head.weight", None)
        expected.pop("lm_head.weight", None)
    if missing := sorted(expected.keys() - tensors.keys()):
        raise ValueError(f"export to {path}: no value for {missing[:8]}; nothing written.")
    model.load_state_dict(tensors, strict=False, assign=True)
    model.tie_weights()
    model.save_pretrained(str(path))
    _copy_side_files(Path(source), Path(path))
    return tensors


def _fit_rows(
    tensors: dict[str, Tensor], expected: Mapping[str, tuple[int, ...]], path: str | Path
) -> dict[str, Tensor]:
    """``tensors`` with padding rows (dim 0 beyond the architecture's) dropped.

    Raises:
        ValueError: a tensor the architecture lacks, or with another shape (naming them).
    """
    out, wrong = {}, []
    for key, value in tensors.items():
        want = expected.get(key)
        if want is not None and value.ndim and value.shape[1:] == want[1:]:
            value = value[: want[0]] if value.shape[0] > want[0] else value
        if want is None or tuple(value.shape) != want:
            wrong.append(f"{key}: {list(value.shape)} vs {list(want or ())}")
        out[key] = value
    if wrong:
        raise ValueError(f"export to {path}: tensors do not fit the architecture: {wrong[:8]}.")
    return out


def _tied(config: Any) -> bool:
    return bool(getattr(config, "tie_word_embeddings", False))


def _unused_tensors(family: HFFamily, config: Any, source: str | Path) -> dict[str, Tensor]:
    from safetensors import safe_open

    unused = family.unused_keys(config)
    out = {}
    for key, file in checkpoint_files(source).items():
        name = family.normalize_key(key)
        if unused(name):
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                out[name] = handle.get_tensor(key)
    return out


def _copy_side_files(source: Path, path: Path) -> None:
    """Tokenizer, processor and chat-template files of ``source`` into ``path``."""
    for file in source.iterdir():
        if file.is_file() and file.name not in _OURS and not file.name.endswith(".safetensors"):
            shutil.copy2(file, path / file.name)
