"""Export of a Qwen2-VL / Qwen2.5-VL / Qwen3-VL-MoE recipe checkpoint (``model.pretrained.hf``
a Qwen directory; :mod:`~lightning_mmpar.recipes.qwen_module`,
:mod:`~lightning_mmpar.recipes.qwen3_module`) to a transformers directory.

:func:`~lightning_mmpar.recipes.export.export_checkpoint` dispatches here. The sharded (DCP)
checkpoint of any layout (tensor, pipeline, data, expert parallel, FSDP2 shards) is read in one
process into a full :class:`~lightning_mmpar.models.hf.qwen2_vl.QwenVLModel` /
:class:`~lightning_mmpar.models.hf.qwen3_vl_moe.Qwen3MoeVLModel` (every tensor of the model must
be in the checkpoint, every expert of every MoE layer: one that is not is named and nothing is
written; a missing shard file is named with the tensors it held), then written by the family's
``save_*_hf`` (:func:`~lightning_mmpar.models.hf.qwen_convert.save_qwen_vl_hf`,
:func:`~lightning_mmpar.models.hf.qwen3_convert.save_qwen3_moe_vl_hf`: its completeness check)
into ``<out>/hf``: transformers' own ``save_pretrained`` (its tensor names; the ViT's q/k/v
fused back into ``qkv``, the patch embedding its Conv3d shape, the experts fused) with the
source directory's tokenizer, chat template and processor files. A tied source is written
untied (training separates ``lm_head`` from the embedding).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_mmpar.models.hf.checkpoint import hf_config
from lightning_mmpar.models.hf.qwen2_vl import QwenVLModel
from lightning_mmpar.models.hf.qwen3_convert import (
    QWEN3_MOE_FAMILIES,
    init_moe_buffers,
    qwen3_moe_vl_config,
    save_qwen3_moe_vl_hf,
)
from lightning_mmpar.models.hf.qwen3_vl_moe import Qwen3MoeVLModel
from lightning_mmpar.models.hf.qwen_convert import (
    QWEN_FAMILIES,
    qwen_vl_config,
    save_qwen_vl_hf,
)
from lightning_mmpar.parallel.checkpoint import inspect_checkpoint, resolve

__all__ = ["export_qwen_checkpoint", "load_qwen_model"]

STATE_PREFIX = "state_dict."
HF_DIR = "hf"
MANIFEST = "export.json"


def _empty_model(source: str | Path) -> QwenVLModel | Qwen3MoeVLModel:
    """The model of the Qwen directory ``source``'s config, on the CPU, uninitialised (the
    MoE layers' buffers at their initial values)."""
    config = hf_config(source)
    if config.model_type in QWEN3_MOE_FAMILIES:
        with torch.device("meta"):
            moe = Qwen3MoeVLModel(qwen3_moe_vl_config(config))
        return init_moe_buffers(moe.to_empty(device="cpu"))
    with torch.device("meta"):
        model = QwenVLModel(qwen_vl_config(config))
    return model.to_empty(device="cpu")


def _key_map(model: QwenVLModel | Qwen3MoeVLModel) -> dict[str, tuple[str, Tensor]]:
    """``{checkpoint key: (model key, tensor)}`` over the recipe's blocks (``blocks.N.*``)."""
    names = {id(t): k for k, t in model.state_dict(keep_vars=True).items()}
    blocks = nn.ModuleList(model.pipeline_blocks()).state_dict(prefix="blocks.", keep_vars=True)
    return {STATE_PREFIX + k: (names[id(t)], t) for k, t in blocks.items()}


def load_qwen_model(ckpt: str | Path, source: str | Path) -> QwenVLModel | Qwen3MoeVLModel:
    """The trained :class:`QwenVLModel` (a :class:`Qwen3MoeVLModel` for a Qwen3-VL-MoE
    ``source``) of the recipe checkpoint ``ckpt`` (any layout), built from the directory
    ``source``'s config, in one process, eval mode.

    Raises:
        FileNotFoundError, ValueError: an incomplete or damaged checkpoint directory (as
            :func:`~lightning_mmpar.parallel.checkpoint.inspect_checkpoint`, path named);
            ``ValueError``: tensors of the model the checkpoint lacks (named), or of another
            shape.
    """
    checked = inspect_checkpoint(resolve(Path(ckpt)))
    items = checked.dcp.state_dict_metadata
    model = _empty_model(source)
    keys = _key_map(model)
    missing = sorted(k.removeprefix(STATE_PREFIX) for k in keys if k not in items)
    if missing:
        raise ValueError(
            f"checkpoint {str(checked.path)!r} lacks {len(missing)} tensor(s) of the Qwen-VL "
            f"model, e.g. {missing[:8]}: copy the whole checkpoint directory; nothing exported."
        )
    state = {}
    for key, (_, tensor) in keys.items():
        meta = items[key]
        assert isinstance(meta, TensorStorageMetadata)
        if tuple(meta.size) != tuple(tensor.shape):
            raise ValueError(
                f"checkpoint {str(checked.path)!r}: {key} has shape {list(meta.size)}, the "
                f"model of {str(source)!r} {list(tensor.shape)}."
            )
        if tensor.dtype != meta.properties.dtype:
            tensor.data = torch.empty_like(tensor, dtype=meta.properties.dtype)
        state[key.removeprefix(STATE_PREFIX)] = tensor.detach()
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.load({"state_dict": state}, checkpoint_id=checked.path, no_dist=True)
    return model.eval()


def export_qwen_checkpoint(
    ckpt: str | Path, out: str | Path, source: str | Path, *, verify: bool = False
) -> tuple[list[str], dict[str, float]]:
    """Write ``<out>/hf`` (module docstring) and ``<out>/export.json``; returns the files
    written and, with ``verify``, ``{"hf": max abs difference}`` of what ``from_pretrained``
    loads to the written tensors (0 for a lossless export).

    Raises:
        FileNotFoundError, ValueError: as :func:`load_qwen_model`; nothing is written then.
    """
    model = load_qwen_model(ckpt, source)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save = save_qwen3_moe_vl_hf if isinstance(model, Qwen3MoeVLModel) else save_qwen_vl_hf
    written = save(model.state_dict(), source, out / HF_DIR)
    diffs: dict[str, float] = {}
    if verify:
        diffs["hf"] = _reload_diff(out / HF_DIR, source, written)
    files = [HF_DIR, MANIFEST]
    manifest: dict[str, Any] = {
        "checkpoint": str(ckpt),
        "source": str(source),
        "files": files,
        "tensors": len(written),
        "bytes": sum(t.numel() * t.element_size() for t in written.values()),
        "max_abs_diff": diffs,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return files, diffs


def _reload_diff(path: Path, source: str | Path, written: Mapping[str, Tensor]) -> float:
    import transformers

    cls = getattr(transformers, (QWEN_FAMILIES | QWEN3_MOE_FAMILIES)[hf_config(source).model_type])
    loaded = cls.from_pretrained(str(path), local_files_only=True).state_dict()
    return max(float((loaded[k] - v).abs().max()) for k, v in written.items() if v.numel())
