"""Export a recipe checkpoint to the formats its parts come from.

``python -m lightning_mmpar.recipes.clip_llama export --ckpt <dir> --out <dir> [--verify]``

Reads a sharded (DCP) checkpoint directory that ``ModelCheckpoint`` wrote under ``mm_parallel``
in any layout (tensor, pipeline, data parallel, FSDP2 shards), in one process without a process
group (``torch.distributed.checkpoint.load(..., no_dist=True)`` reads every shard into full
tensors), and writes into ``--out``:

===========================================  =================================================
``llama/``                                   ``LlamaForCausalLM.save_pretrained`` of the
                                             decoder (true vocabulary: the ``vocab_multiple``
                                             padding rows are stripped; joint attention's text
                                             temperature folded into ``k_proj``)
``open_clip/open_clip_config.json``          open_clip ``model_cfg`` of the ViT
                                             (``create_model("local-dir:...",
                                             load_weights=False)``)
``open_clip_visual.safetensors``             open_clip ``visual`` state dict (fused q/k/v
                                             back to ``[3 D, D]``)
``adapter.safetensors``                      projector, cross-modal adapters, joint-attention
                                             image norms and temperatures (fusion-model keys)
``heads.safetensors``                        contrastive heads, logit scale and the EMA copies
                                             (``momentum_heads.*``)
``tokenizer/``                               the checkpoint's word tokenizer
                                             (``WordTokenizer.save``), or ``--tokenizer``'s
                                             (a word tokenizer or a transformers tokenizer dir)
``hf/``                                      a run from ``model.pretrained.hf``: the
                                             transformers directory of its architecture
                                             (``save_pretrained``, weights bit-exact, the
                                             source's tokenizer / processor files); a
                                             Qwen-VL run writes ``hf/`` and ``export.json``
                                             only (:mod:`~lightning_mmpar.recipes.
                                             export_qwen`)
``export.json``                              hparams summary, files, vocabulary, notes and,
                                             with ``--verify``, the round-trip differences
===========================================  =================================================

A decoder with mixture-of-experts FFNs has no ``LlamaForCausalLM`` form: its tower goes to
``language.safetensors`` (fusion-model keys) and ``export.json`` says why.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast, get_args, get_type_hints

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_mmpar.data.hf_tokenizer import HFTokenizer, tokenizer_from_dict
from lightning_mmpar.data.tokenizer import TOKENIZER_FILE, WordTokenizer
from lightning_mmpar.models.convert import (
    JOINT_ONLY_KEYS,
    export_open_clip_visual,
    open_clip_model_config,
    save_llama_pretrained,
)
from lightning_mmpar.models.fusion import FusionConfig, FusionModel
from lightning_mmpar.models.hf import family_of, save_hf
from lightning_mmpar.models.hf.checkpoint import hf_config
from lightning_mmpar.models.hf.qwen3_convert import is_qwen3_moe_vl_dir
from lightning_mmpar.models.hf.qwen_convert import is_qwen_vl_dir
from lightning_mmpar.parallel.checkpoint import (
    HPARAMS_KEY,
    complete_checkpoints,
    inspect_checkpoint,
    resolve,
)
from lightning_mmpar.recipes import module as _module  # noqa: F401 - allow-lists the hparams
from lightning_mmpar.recipes.export_qwen import export_qwen_checkpoint
from lightning_mmpar.recipes.export_verify import verify_export
from lightning_mmpar.recipes.options import PretrainedConfig

__all__ = ["ExportResult", "export_checkpoint", "load_fusion_model", "main"]

LLAMA_DIR = "llama"
HF_DIR = "hf"
OPEN_CLIP_DIR = "open_clip"
VISUAL_FILE = "open_clip_visual.safetensors"
ADAPTER_FILE = "adapter.safetensors"
HEADS_FILE = "heads.safetensors"
LANGUAGE_FILE = "language.safetensors"
TOKENIZER_DIR = "tokenizer"
MANIFEST = "export.json"
STATE_PREFIX = "state_dict."
"""Prefix of the model's keys in the DCP checkpoint (``save_sharded``'s ``state_dict``)."""
MOMENTUM_PREFIX = "momentum_heads."
HEAD_PREFIXES = ("image_head.", "text_head.", "logit_scale", MOMENTUM_PREFIX)
ADAPTER_PREFIXES = ("projector.", "adapters.")
T = TypeVar("T")


@dataclasses.dataclass
class ExportResult:
    """What :func:`export_checkpoint` wrote."""

    out: Path
    """The output directory."""
    files: list[str]
    """Files and directories written, relative to :attr:`out`."""
    vocab_size: int
    """The tokenizer's vocabulary (rows of the exported embedding and LM head)."""
    padded_vocab_size: int
    """Rows in the checkpoint (``vocab_multiple`` padding included)."""
    notes: list[str]
    """What was not written, and why."""
    diffs: dict[str, float]
    """With ``verify``: max abs difference per format (see :func:`verify_export`)."""


def _dataclass(cls: type[T], value: Any) -> T:
    """``value`` as a ``cls`` instance: LightningCLI saves the parsed config (nested dicts) as
    hyper-parameters, a module built in Python its dataclasses."""
    if isinstance(value, cls) or not isinstance(value, Mapping):
        return cast(T, value)
    hints = get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if not f.init or f.name not in value:
            continue
        item, hint = value[f.name], hints[f.name]
        nested = [a for a in (get_args(hint) or (hint,)) if dataclasses.is_dataclass(a)]
        kwargs[f.name] = _dataclass(nested[0], item) if nested else item  # type: ignore[arg-type]
    return cls(**kwargs)


def _hparams(meta: Mapping[str, Any], path: Path) -> dict[str, Any]:
    hparams = meta.get(HPARAMS_KEY)
    fusion = hparams.get("fusion") if isinstance(hparams, Mapping) else None
    if not isinstance(fusion, FusionConfig | Mapping):
        raise ValueError(
            f"checkpoint {str(path)!r}: meta.pt has no ClipLlamaModule hyper-parameters "
            "(hyper_parameters.fusion); export reads checkpoints the clip_llama recipe wrote."
        )
    return {**hparams, "fusion": _dataclass(FusionConfig, fusion)}  # type: ignore[dict-item]


def _key_map(model: FusionModel) -> dict[str, tuple[str, Tensor]]:
    """``{checkpoint key: (fusion key, tensor)}`` over the recipe's blocks (``blocks.N.*``);
    the momentum heads get ``momentum_heads.*`` keys. One entry per tensor."""
    names = {id(t): k for k, t in model.state_dict(keep_vars=True).items()}
    momentum = model.momentum_heads.state_dict(keep_vars=True).items()
    names |= {id(t): MOMENTUM_PREFIX + k for k, t in momentum}
    blocks = nn.ModuleList(model.pipeline_blocks()).state_dict(prefix="blocks.", keep_vars=True)
    out: dict[str, tuple[str, Tensor]] = {}
    for key, tensor in blocks.items():
        out[STATE_PREFIX + key] = (names[id(tensor)], tensor)
    return out


def load_fusion_model(ckpt: str | Path) -> tuple[FusionModel, dict[str, Any], dict[str, Any]]:
    """``(model, hparams, meta)``: the recipe's fusion model in one process, weights and EMA
    heads from the checkpoint, in the checkpoint's dtype, eval mode.

    The vocabulary rows are the checkpoint's (padded). No process group is needed.

    Raises:
        FileNotFoundError, ValueError: an incomplete or damaged checkpoint directory, as
            :func:`~lightning_mmpar.parallel.checkpoint.validate_checkpoint` (path named);
            ``ValueError``: not a recipe checkpoint, or its keys do not cover the model.
    """
    checked = inspect_checkpoint(resolve(Path(ckpt)))
    path, hparams = checked.path, _hparams(checked.meta, checked.path)
    items = checked.dcp.state_dict_metadata
    embed = [k for k in items if k.startswith(STATE_PREFIX) and k.endswith("embed_tokens.weight")]
    if not embed or not isinstance(items[embed[0]], TensorStorageMetadata):
        raise ValueError(
            f"checkpoint {str(path)!r} holds no language embedding (blocks.N.embed_tokens."
            "weight): it is not a checkpoint of the clip_llama recipe's model."
        )
    padded = int(items[embed[0]].size[0])  # type: ignore[union-attr]
    fusion: FusionConfig = hparams["fusion"]
    language = dataclasses.replace(fusion.language, vocab_size=padded)
    with torch.device("meta"):
        model = FusionModel(dataclasses.replace(fusion, language=language))
    model.to_empty(device="cpu")
    keys = _key_map(model)
    missing = sorted(k.removeprefix(STATE_PREFIX) for k in keys if k not in items)
    if missing:
        raise ValueError(
            f"checkpoint {str(path)!r} lacks {len(missing)} tensor(s) of the model its "
            f"hyper-parameters describe, e.g. {missing[:5]}: copy the whole checkpoint directory."
        )
    state = {}
    for key, (_, tensor) in keys.items():
        meta = items[key]
        assert isinstance(meta, TensorStorageMetadata)
        if tensor.dtype != meta.properties.dtype:
            tensor.data = torch.empty_like(tensor, dtype=meta.properties.dtype)
        state[key.removeprefix(STATE_PREFIX)] = tensor.detach()
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.load({"state_dict": state}, checkpoint_id=path, no_dist=True)
    return model.eval(), hparams, checked.meta


def _fusion_state(model: FusionModel) -> dict[str, Tensor]:
    state = {k: v.detach() for k, v in model.state_dict().items()}
    momentum = model.momentum_heads.state_dict().items()
    return state | {MOMENTUM_PREFIX + k: v.detach() for k, v in momentum}


def _save(path: Path, state: Mapping[str, Tensor]) -> None:
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))


def _tokenizer(meta: Mapping[str, Any], source: str | Path | None, vocab: int) -> Any:
    """The tokenizer to write (``WordTokenizer`` or a transformers tokenizer): ``source``'s,
    else the one the data module saved in ``meta.pt``; ``None`` when there is neither.

    Raises:
        ValueError: ``source`` holds no tokenizer, or the tokenizer's size is not ``vocab``.
    """
    tokenizer: Any = None
    if source is not None:
        src = Path(source)
        if (src / "tokenizer_config.json").is_file():
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(src), local_files_only=True)
        elif (src / TOKENIZER_FILE).is_file():
            tokenizer = WordTokenizer.load(src)
        else:
            raise ValueError(
                f"--tokenizer {str(src)!r} holds neither {TOKENIZER_FILE} (WordTokenizer.save) "
                "nor tokenizer_config.json (transformers save_pretrained); pass such a directory."
            )
    else:
        states = [
            v["tokenizer"] for v in meta.values() if isinstance(v, Mapping) and "tokenizer" in v
        ]
        if states and states[0] is not None:
            tokenizer = tokenizer_from_dict(states[0], source="checkpoint")
            if isinstance(tokenizer, HFTokenizer):  # the transformers one it wraps
                tokenizer = tokenizer.tokenizer
    size = tokenizer.vocab_size if isinstance(tokenizer, WordTokenizer) else len(tokenizer or ())
    if tokenizer is not None and size != vocab:
        raise ValueError(
            f"tokenizer {str(source or 'of the checkpoint')!r} has {size} tokens, the model's "
            f"vocabulary (hyper_parameters.vocab_size) is {vocab}; pass the tokenizer the model "
            "was trained with."
        )
    return tokenizer


def export_checkpoint(
    ckpt: str | Path,
    out: str | Path,
    *,
    tokenizer: str | Path | None = None,
    verify: bool = False,
    hf: str | Path | None = None,
) -> ExportResult:
    """Write the user formats of checkpoint ``ckpt`` into ``out`` (module docstring).

    Args:
        ckpt: a checkpoint directory of the recipe (any layout).
        out: the output directory (created; files of the same names are replaced).
        tokenizer: a tokenizer directory to copy instead of the checkpoint's own.
        hf: the transformers directory the run started from, for the ``hf/`` directory
            (default: the checkpoint's ``model.pretrained.hf``; none: no ``hf/``).
        verify: reload every written format with its own library and record the max abs
            differences to this model (:func:`~lightning_mmpar.recipes.export_verify.verify_export`)
            in the result and ``export.json``.

    Raises:
        FileNotFoundError, ValueError: as :func:`load_fusion_model`; ``ValueError`` for a
            ``tokenizer`` directory without a tokenizer, or a tokenizer whose size is not the
            model's vocabulary (``hyper_parameters.vocab_size``); nothing is written then.
    """
    qwen = _qwen_source(ckpt, hf)
    if qwen is not None:  # a QwenVLModel: hf/ alone (lightning_mmpar.recipes.export_qwen)
        files, diffs = export_qwen_checkpoint(ckpt, out, qwen, verify=verify)
        return ExportResult(Path(out), files, hf_config(qwen).text_config.vocab_size, 0, [], diffs)
    model, hparams, meta = load_fusion_model(ckpt)
    fusion: FusionConfig = hparams["fusion"]
    vocab = int(hparams.get("vocab_size", fusion.language.vocab_size))
    token_source = _tokenizer(meta, tokenizer, vocab)  # checked before anything is written
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    padded = model.language.embed_tokens.weight.shape[0]
    state = _fusion_state(model)
    notes: list[str] = []
    files = [VISUAL_FILE, f"{OPEN_CLIP_DIR}/open_clip_config.json", ADAPTER_FILE, HEADS_FILE]
    _save(out / VISUAL_FILE, export_open_clip_visual(state))
    (out / OPEN_CLIP_DIR).mkdir(exist_ok=True)
    config = {"model_cfg": open_clip_model_config(fusion.vision)}
    (out / OPEN_CLIP_DIR / "open_clip_config.json").write_text(json.dumps(config, indent=1))
    joint = [k for k in state if k.startswith("language.") and any(t in k for t in JOINT_ONLY_KEYS)]
    _save(out / ADAPTER_FILE, {k: state[k] for k in [*_prefixed(state, ADAPTER_PREFIXES), *joint]})
    _save(out / HEADS_FILE, {k: state[k] for k in _prefixed(state, HEAD_PREFIXES)})
    if fusion.language.moe is None:
        language = dataclasses.replace(fusion.language, vocab_size=vocab)
        save_llama_pretrained(state, language, out / LLAMA_DIR, fold_text_temperature=True)
        files.append(LLAMA_DIR)
    else:
        _save(out / LANGUAGE_FILE, {k: v for k, v in state.items() if k.startswith("language.")})
        files.append(LANGUAGE_FILE)
        notes.append(
            "llama: not written: the decoder has mixture-of-experts FFNs (fusion.language.moe), "
            f"which LlamaForCausalLM cannot hold; its weights are in {LANGUAGE_FILE}."
        )
    if isinstance(token_source, WordTokenizer):
        token_source.save(out / TOKENIZER_DIR)
    elif token_source is not None:
        token_source.save_pretrained(str(out / TOKENIZER_DIR))
    else:
        notes.append("tokenizer: the checkpoint's data module saved none; pass --tokenizer <dir>.")
    files += [TOKENIZER_DIR] if token_source is not None else []
    result = ExportResult(out, files, vocab, padded, notes, {})
    if verify:
        result.diffs = verify_export(model, out, vocab)
    pretrained = _dataclass(PretrainedConfig, hparams.get("pretrained"))
    _export_hf(result, state, hf or getattr(pretrained, "hf", None), verify)
    _write_manifest(result, model.config, ckpt)
    return result


def _qwen_source(ckpt: str | Path, hf: str | Path | None) -> str | Path | None:
    """The Qwen-VL directory of a checkpoint (``hf``, else its ``model.pretrained.hf``), or
    ``None`` for a fusion-model checkpoint. Raises as :func:`inspect_checkpoint`."""
    if hf is not None:
        return hf if _is_qwen(hf) else None
    hparams = inspect_checkpoint(resolve(Path(ckpt))).meta.get(HPARAMS_KEY)
    pretrained = hparams.get("pretrained") if isinstance(hparams, Mapping) else None
    source = _dataclass(PretrainedConfig, pretrained).hf if pretrained is not None else None
    return source if _is_qwen(source) else None


def _is_qwen(path: str | Path | None) -> bool:
    return is_qwen_vl_dir(path) or is_qwen3_moe_vl_dir(path)


def _export_hf(
    result: ExportResult, state: Mapping[str, Tensor], source: str | Path | None, verify: bool
) -> None:
    """``hf/``: :func:`~lightning_mmpar.models.hf.save_hf` of ``state`` for the architecture
    of ``source`` (nothing without one); ``verify``: the max abs difference of what
    ``from_pretrained`` loads to the written tensors (``diffs["hf"]``, 0 for a lossless
    export)."""
    if not source:
        return
    written = save_hf(state, source, result.out / HF_DIR)
    result.files.append(HF_DIR)
    if verify:
        import transformers

        cls = getattr(transformers, family_of(hf_config(source)).model_class)
        loaded = cls.from_pretrained(str(result.out / HF_DIR), local_files_only=True).state_dict()
        diffs = [float((loaded[k] - v).abs().max()) for k, v in written.items() if v.numel()]
        result.diffs["hf"] = max(diffs)


def _prefixed(state: Mapping[str, Tensor], prefixes: tuple[str, ...]) -> list[str]:
    return [k for k in state if k.startswith(prefixes)]


def _write_manifest(result: ExportResult, fusion: FusionConfig, ckpt: str | Path) -> None:
    manifest = {
        "checkpoint": str(ckpt),
        "files": result.files,
        "vocab_size": result.vocab_size,
        "padded_vocab_size": result.padded_vocab_size,
        "fusion": dataclasses.asdict(fusion),  # language.vocab_size: the padded one
        "notes": result.notes,
        "max_abs_diff": result.diffs,
    }
    (result.out / MANIFEST).write_text(json.dumps(manifest, indent=1, default=str))
    result.files.append(MANIFEST)


def main(args: Sequence[str] | None = None) -> ExportResult:
    """``export`` subcommand: parse ``args`` and run :func:`export_checkpoint`.

    A missing, incomplete or foreign checkpoint directory exits with status 2 and a message
    naming the path (``argparse``'s usage error)."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_mmpar.recipes.clip_llama export",
        description="Write a recipe checkpoint as a transformers Llama directory, an open_clip "
        "visual state dict + model config, adapter / heads safetensors and the tokenizer.",
    )
    parser.add_argument("--ckpt", required=True, help="checkpoint directory (e.g. last.ckpt)")
    parser.add_argument("--out", required=True, help="output directory (created)")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer directory to copy instead of the checkpoint's (WordTokenizer or "
        "transformers)",
    )
    parser.add_argument(
        "--hf",
        default=None,
        help="transformers directory the run started from (default: the checkpoint's "
        "model.pretrained.hf): writes hf/ in its architecture",
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="reload each format (transformers, open_clip, safetensors) and record the max abs "
        "differences in export.json",
    )
    ns = parser.parse_args(args)
    try:
        result = export_checkpoint(
            ns.ckpt, ns.out, tokenizer=ns.tokenizer, verify=ns.verify, hf=ns.hf
        )
    except (FileNotFoundError, ValueError) as err:
        below = [p for *_, p in complete_checkpoints(ns.ckpt) if p != Path(ns.ckpt)]
        if below:  # a run directory, not a checkpoint: name the checkpoints in it
            newest = "\n  ".join(str(p) for p in below[::-1][:5])
            parser.error(f"{ns.ckpt} is not a checkpoint; it holds (newest first):\n  {newest}")
        parser.error(str(err))
    print(f"exported {ns.ckpt} -> {result.out}: {', '.join(result.files)}")
    for note in result.notes:
        print(f"note: {note}")
    for name, diff in result.diffs.items():
        print(f"round trip {name}: max abs diff {diff:.3g}")
    return result
