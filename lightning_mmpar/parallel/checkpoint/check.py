"""Checks of a sharded checkpoint directory that name the bad file or the differing setting.

Without them a damaged or mismatched checkpoint fails deep inside ``torch.distributed.checkpoint``
(DCP): ``AssertionError: metadata is None`` for a missing ``.metadata``, a zip-reader error naming
no file for a truncated shard, an unpickler error advising ``weights_only=False`` for a
zero-filled one, ``Missing key ... logit_scale`` for a model with one layer fewer.

* :func:`inspect_checkpoint`, the core of
  :func:`~lightning_mmpar.parallel.checkpoint.validate_checkpoint` (no process group, no tensor
  reads: file sizes against DCP's ``.metadata``, and ``meta.pt``), for a CLI to call before the
  processes spawn and for :func:`~lightning_mmpar.parallel.checkpoint.load_sharded`;
* :func:`hparams_diff`: Lightning's ``hyper_parameters`` in ``meta.pt`` against this run's;
* :func:`check_state_keys`: the keys and global shapes a model (this rank's part) needs against
  the ones the checkpoint holds, before DCP reads anything;
* :func:`damaged_files`: after a failed read only, the shard files whose items are not intact
  ``torch.save`` archives (zip CRC check, nothing unpickled).

Layout of the directory: DCP's (``.metadata`` mapping every item to ``(file, offset, length)``,
``torch.distributed.checkpoint.FileSystemReader``) plus this package's ``meta.pt``.
"""

from __future__ import annotations

import dataclasses
import io
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

__all__ = [
    "CheckedCheckpoint",
    "check_state_keys",
    "damaged_files",
    "hparams_diff",
    "inspect_checkpoint",
    "root_error",
]

METADATA_FILE = "meta.pt"
DCP_METADATA = ".metadata"
HPARAMS_KEY = "hyper_parameters"  # LightningModule.CHECKPOINT_HYPER_PARAMS_KEY
SHOWN = 5  # keys listed per kind of mismatch; the rest are counted
HOW_TO_GET = (
    "mm_parallel checkpoints are directories (DCP shards, .metadata, meta.pt) written by "
    "ModelCheckpoint or trainer.save_checkpoint under strategy mm_parallel"
)


@dataclasses.dataclass(frozen=True)
class CheckedCheckpoint:
    """What :func:`inspect_checkpoint` read: the resolved path, DCP's metadata, ``meta.pt``."""

    path: Path
    dcp: Metadata
    meta: dict[str, Any]


def inspect_checkpoint(path: Path) -> CheckedCheckpoint:
    """The checks of :func:`~lightning_mmpar.parallel.checkpoint.validate_checkpoint` but the
    hyper-parameters, on a resolved ``path``; returns what it read (same errors)."""
    if path.is_file():
        raise ValueError(
            f"checkpoint {str(path)!r} is a single file (a Lightning or torch.save checkpoint); "
            f"{HOW_TO_GET}. Pass such a directory, or load this file's weights into the model "
            "yourself (torch.load + load_state_dict) and fit without ckpt_path."
        )
    dcp_file = path / DCP_METADATA
    if not dcp_file.exists():
        candidates = sorted(
            p.name for p in path.iterdir() if p.is_dir() and (p / DCP_METADATA).is_file()
        )
        if candidates:
            raise ValueError(
                f"{str(path)!r} is a folder of checkpoints, not one checkpoint: pass one of "
                f"{_few(candidates)} (e.g. {str(path / candidates[-1])!r})."
            )
        raise FileNotFoundError(
            f"{str(dcp_file)!r} is missing: {str(path)!r} is not a complete checkpoint (a save "
            f"was cut short or the directory was copied in part; {HOW_TO_GET}). Copy the whole "
            "directory or pass another checkpoint."
        )
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as e:  # any unpickling failure: the file is damaged
        raise ValueError(
            f"{str(dcp_file)!r} is unreadable ({_short(e)}): the checkpoint is damaged. Copy "
            "it again from its source or pass another checkpoint."
        ) from None
    _check_shard_sizes(path, metadata)
    meta_file = path / METADATA_FILE
    if not meta_file.exists():
        raise FileNotFoundError(
            f"{str(meta_file)!r} is missing (rank 0 writes it last): {str(path)!r} is not a "
            "complete checkpoint. Copy the whole directory or pass another checkpoint."
        )
    try:
        meta = torch.load(meta_file, weights_only=False, map_location="cpu")
    except Exception as e:
        raise ValueError(
            f"{str(meta_file)!r} is unreadable ({_short(e)}): the checkpoint is damaged. Copy "
            "it again from its source or pass another checkpoint."
        ) from None
    if not isinstance(meta, dict):
        raise ValueError(
            f"{str(meta_file)!r} holds a {type(meta).__name__}, not the checkpoint dict: the "
            "file was replaced. Copy the checkpoint again or pass another one."
        )
    return CheckedCheckpoint(path, metadata, meta)


def _check_shard_sizes(path: Path, metadata: Metadata) -> None:
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(end, needed.get(info.relative_path, 0))
    missing = sorted(name for name in needed if not (path / name).is_file())
    if missing:
        lost = sorted(  # the model's weights first, then the optimizer's state
            {i.fqn for i, info in metadata.storage_data.items() if info.relative_path in missing},
            key=lambda fqn: (not fqn.startswith("state_dict."), fqn),
        )
        raise FileNotFoundError(
            f"checkpoint {str(path)!r} lacks shard file(s) {_few(missing)} that its .metadata "
            f"references, holding (shards of) {len(lost)} tensor(s): {_few(lost)}; copy the "
            "whole checkpoint directory or pass another checkpoint."
        )
    short = [
        f"{str(path / name)!r} has {(path / name).stat().st_size} bytes, .metadata expects at "
        f"least {end}"
        for name, end in sorted(needed.items())
        if (path / name).stat().st_size < end
    ]
    if short:
        raise ValueError(
            f"truncated shard file(s): {_few(short, sep='; ')}. The checkpoint is damaged (a "
            "copy or a write was cut short): copy it again or pass another checkpoint."
        )


def hparams_diff(
    saved: Any, current: Mapping[str, Any] | None, ignore: Sequence[str] = ()
) -> list[str]:
    """``name: checkpoint X, this run Y`` for every differing hyper-parameter.

    Nested dataclasses and mappings are flattened to dotted names
    (``fusion.language.num_hidden_layers``); keys starting with ``_`` and names under a prefix
    in ``ignore`` are left out. Empty when either side is ``None``.
    """
    if saved is None or current is None:
        return []
    old, new = _flatten(saved, private=False), _flatten(current, private=False)
    out = []
    for name in sorted(old.keys() | new.keys()):
        if any(name == p or name.startswith(p + ".") for p in ignore):
            continue
        a, b = old.get(name, _ABSENT), new.get(name, _ABSENT)
        if not _same(a, b):
            out.append(f"{name}: checkpoint {_show(a)}, this run {_show(b)}")
    return out


def check_state_keys(metadata: Metadata, state: Mapping[str, Any], what: str) -> list[str]:
    """Problems loading ``state`` (nested dicts, DCP's dotted keys) from a checkpoint.

    Every key of ``state`` must be in ``metadata`` with the same global shape (a ``DTensor``'s
    ``shape`` is global, DCP's ``size`` too). Keys the checkpoint holds beyond ``state`` are no
    error (a pipeline rank holds a part of the model) but are named as context when something
    else is wrong. Returns readable lines, empty when ``state`` loads.
    """
    held = metadata.state_dict_metadata
    wanted = _flatten(state)
    missing, shapes = [], []
    for key, value in wanted.items():
        md = held.get(key)
        if md is None:
            if not any(k.startswith(key + ".") for k in held):
                missing.append(key)
        elif isinstance(value, torch.Tensor):
            if not isinstance(md, TensorStorageMetadata):
                shapes.append(f"{key} (checkpoint: not a tensor, this run {list(value.shape)})")
            elif tuple(md.size) != tuple(value.shape):
                shapes.append(f"{key} (checkpoint {list(md.size)}, this run {list(value.shape)})")
    if not missing and not shapes:
        return []
    roots = {k.split(".", 1)[0] for k in wanted}
    extra = sorted(k for k in held if k.split(".", 1)[0] in roots and k not in wanted)
    lines = []
    if missing:
        lines.append(f"{len(missing)} {what} key(s) missing from the checkpoint: {_few(missing)}")
    if shapes:
        lines.append(f"{len(shapes)} {what} shape mismatch(es): {_few(shapes)}")
    if extra:
        lines.append(f"{len(extra)} checkpoint {what} key(s) this model lacks: {_few(extra)}")
    return lines


def damaged_files(path: Path, metadata: Metadata) -> dict[str, list[str]]:
    """Shard files with items that are not intact ``torch.save`` archives -> those items' keys.

    Reads every item of every file (call it only after a failed load): each item DCP wrote is one
    ``torch.save`` zip archive, checked with :meth:`zipfile.ZipFile.testzip` (CRC32 of every
    member) without unpickling anything. Items with storage transforms (compression) are
    checked for length only.
    """
    bad: dict[str, list[str]] = {}
    by_file: dict[str, list[Any]] = {}
    for index, info in metadata.storage_data.items():
        by_file.setdefault(info.relative_path, []).append((index.fqn, info))
    for name, items in sorted(by_file.items()):
        file = path / name
        if not file.is_file():
            bad[name] = [fqn for fqn, _ in items]
            continue
        with open(file, "rb") as stream:
            for fqn, info in items:
                stream.seek(int(info.offset))
                data = stream.read(int(info.length))
                if not _intact(data, int(info.length), bool(info.transform_descriptors)):
                    bad.setdefault(name, []).append(fqn)
    return bad


def _intact(data: bytes, length: int, transformed: bool) -> bool:
    if len(data) < length:
        return False
    if transformed:
        return True
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            return archive.testzip() is None
    except (zipfile.BadZipFile, OSError, EOFError, ValueError):
        return False


_ABSENT = object()


def _flatten(value: Any, prefix: str = "", private: bool = True) -> dict[str, Any]:
    children: Mapping[str, Any] | None = None
    if isinstance(value, Mapping):
        children = {str(k): v for k, v in value.items() if private or not str(k).startswith("_")}
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        children = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if children is None:
        return {prefix: value}
    out: dict[str, Any] = {}
    for k, v in children.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else k, private))
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and bool(torch.equal(a, b))
        )
    try:
        return bool(a == b)
    except Exception:  # an object whose == raises or is ambiguous: compare the text
        return repr(a) == repr(b)


def _show(value: Any) -> str:
    text = "<absent>" if value is _ABSENT else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _few(items: Sequence[str], sep: str = ", ") -> str:
    shown = sep.join(items[:SHOWN])
    return shown + (f"{sep}... ({len(items) - SHOWN} more)" if len(items) > SHOWN else "")


def root_error(error: BaseException) -> str:
    """``Type: first line`` of ``error``, or of the first rank's failure inside DCP's
    ``CheckpointException``; lines advising ``weights_only`` are dropped (never suggest
    ``weights_only=False`` for a file that may be damaged or foreign)."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, Mapping) and failures:
        inner = next(iter(failures.values()))
        inner = inner[0] if isinstance(inner, tuple) else inner
        if isinstance(inner, BaseException):
            error = inner
    return _short(error)


def _short(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    line = next((t for t in text if "weights_only" not in t), "") if text else ""
    return f"{type(error).__name__}: {line}" if line else type(error).__name__
