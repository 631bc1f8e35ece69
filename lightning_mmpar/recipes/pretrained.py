"""Pretrained towers in the recipe's fusion model, each rank reading only its own shards.

``model.pretrained.vision`` (open_clip) and ``model.pretrained.language`` (transformers Llama)
name local checkpoints (:mod:`lightning_mmpar.recipes.pretrained_files`); the projector,
adapters, heads and logit scale start fresh, as in :func:`~lightning_mmpar.models.convert.
build_fusion_model` (same key mapping), but without a full model per rank. ``model.pretrained.
hf`` names a whole transformers vision-language checkpoint (LLaVA): its architecture replaces
``model.fusion`` (:func:`~lightning_mmpar.models.hf.hf_fusion_config`) and the ViT, projector
and decoder are read the same way through the family's key table (only the contrastive heads
start fresh):

1. **Config** (:func:`resolve_fusion_config`): a pretrained tower's sizes come from its file and
   *replace* the YAML's ``model.fusion.vision`` (every field) or ``model.fusion.language``
   (the ``LlamaConfig`` fields: vocabulary, widths, layers, heads, ``head_dim``, ``rms_norm_eps``,
   ``rope_theta``, biases); options a checkpoint does not hold (``joint_attention``,
   temperatures) stay the YAML's. A bare open_clip state-dict file has no config: the YAML's
   sizes stay and every tensor shape is checked against them. ``moe`` with a pretrained decoder
   is refused (a Llama checkpoint has dense FFNs).
2. **Meta build** (:func:`build_meta_fusion`): the pretrained towers on the meta device (no
   memory); the fresh parts built for real from the seeded RNG, so every rank and every layout
   starts from the same values. The tensor-parallel plan is then applied as usual (meta
   DTensors know their global shape and this rank's slice).
3. **Shard load** (:func:`load_towers`): each tower parameter becomes this rank's slice of the
   checkpoint tensor (``compute_local_shape_and_global_offset`` of its DTensor placements; the
   whole tensor when not sharded), read with ``safe_open().get_slice`` or from a memory-mapped
   ``torch.load``. Under pipeline parallelism, parameters of blocks another stage owns (the same
   stage plan the strategy then cuts by) get a zero-stride placeholder of the right shape (no
   memory, nothing read) that the strategy drops; :func:`check_stage_guess` refuses a run whose
   cut differs. Under FSDP (``mm_parallel``, ``data_parallel="fsdp"``, dp > 1) owned ones stay
   on the meta device; the strategy shards them (meta DTensors on ``(dp, tp)``), then its
   ``load_sharded_parameters`` hook runs :func:`load_deferred`: each rank reads and allocates
   only its FSDP shard of its TP slice (``1 / dp`` of the bytes: 51,200 of 102,400 at dp2 x tp2).

Vocabulary: the embedding and ``lm_head`` have ``max(tokenizer, checkpoint)`` rows padded to the
tensor-parallel multiple; rows past the checkpoint's start at zero (logit 0 for ids no tokenizer
emits). Without FSDP every dp replica reads the same bytes; under FSDP the dp ranks' shards
tile each tensor: either way the replicas' (gathered) weights are identical after loading.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from lightning_mmpar.models.fusion import FusionConfig, FusionModel
from lightning_mmpar.models.hf import hf_fusion_config
from lightning_mmpar.models.hf.qwen3_convert import is_qwen3_moe_vl_dir
from lightning_mmpar.models.hf.qwen_convert import is_qwen_vl_dir
from lightning_mmpar.parallel.deferred import assign
from lightning_mmpar.recipes.options import PretrainedConfig
from lightning_mmpar.recipes.pretrained_files import (
    IGNORED_KEYS,
    Index,
    TensorFile,
    open_clip_vision,
    transformers_llama,
    transformers_qwen_vl,
    transformers_vlm,
)
from lightning_mmpar.trainer_topology import TrainerTopology

__all__ = [
    "LoadReport",
    "build_meta_fusion",
    "check_stage_guess",
    "load_deferred",
    "load_towers",
    "meta_fusion",
    "resolve_fusion_config",
    "vocab_rows",
]

LLAMA_FILE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "attention_bias",
    "mlp_bias",
)
"""LanguageConfig fields a Llama checkpoint's config.json sets (the YAML's are replaced)."""
TOWERS = ("vision", "language")
_LAYER = re.compile(r"^(layers|transformer\.resblocks)\.\d+\.")


@dataclass
class LoadReport:
    """What :func:`load_towers` did on this rank (the tests check it)."""

    read: dict[str, tuple[tuple[int, ...], Index]] = field(default_factory=dict)
    """``{parameter: (global shape, slice read)}`` of every parameter filled from a file."""
    placeholders: list[str] = field(default_factory=list)
    """Parameters of other pipeline stages (nothing read, nothing allocated)."""
    fresh: list[str] = field(default_factory=list)
    """Tower parameters a checkpoint lacks (joint-attention extras), initialised fresh."""
    bytes_read: int = 0
    """Bytes copied out of the checkpoints."""
    stages: tuple[tuple[range, ...], tuple[int, ...]] | None = None
    """``(stage ranges, this rank's stages)`` assumed under pipeline parallelism."""
    deferred: list[str] = field(default_factory=list)
    """Parameters left on the meta device until FSDP sharded them (:func:`load_deferred`)."""
    pending: tuple[dict[str, Any], dict[str, Any]] | None = field(default=None, repr=False)
    """``(open files, {parameter: (key, meta parameter, [(module, name) registering it])})``."""


def _open(pretrained: PretrainedConfig, model: Any) -> dict[str, tuple[Any, TensorFile]]:
    if pretrained.hf and (is_qwen_vl_dir(pretrained.hf) or is_qwen3_moe_vl_dir(pretrained.hf)):
        return {p: (None, t) for p, t in transformers_qwen_vl(pretrained.hf).items()}
    if pretrained.hf:
        keys = [_vision_key(n) for n, _ in model.named_parameters()]
        return {p: (None, t) for p, t in transformers_vlm(pretrained.hf, keys).items()}
    out: dict[str, tuple[Any, TensorFile]] = {}
    if pretrained.vision:
        out["vision"] = open_clip_vision(pretrained.vision)
    if pretrained.language:
        out["language"] = transformers_llama(pretrained.language)
    return out


def resolve_fusion_config(fusion: FusionConfig, pretrained: PretrainedConfig) -> FusionConfig:
    """``fusion`` with the pretrained towers' sizes from their files (module docstring, 1.).

    Reads config files only. Raises ``ValueError`` for an unreadable path (naming the field)
    or ``model.fusion.language.moe`` set together with a pretrained decoder.
    """
    if pretrained.hf:
        if fusion.language.moe is not None:
            raise ValueError(
                "model.fusion.language.moe is set with model.pretrained.hf: the checkpoint's "
                "decoder has dense FFNs; set moe: null."
            )
        keep = {"contrastive_dim": fusion.contrastive_dim}
        return hf_fusion_config(pretrained.hf, **keep, logit_scale_init=fusion.logit_scale_init)
    vision, language = fusion.vision, fusion.language
    if pretrained.vision:
        vision = open_clip_vision(pretrained.vision)[0] or vision
    if pretrained.language:
        if language.moe is not None:
            raise ValueError(
                "model.fusion.language.moe is set with model.pretrained.language: a Llama "
                "checkpoint has dense FFNs; set moe: null (or train the decoder from scratch)."
            )
        cfg = transformers_llama(pretrained.language)[0]
        language = dataclasses.replace(language, **{f: getattr(cfg, f) for f in LLAMA_FILE_FIELDS})
    return dataclasses.replace(fusion, vision=vision, language=language)


def _shell_config(config: FusionConfig, pretrained: PretrainedConfig) -> FusionConfig:
    """``config`` with the pretrained towers shrunk to what the fresh parts need (their widths;
    one decoder layer for the joint-attention extras; an 8-token vocabulary)."""
    vision, language = config.vision, config.language
    if pretrained.vision or pretrained.hf:
        vision = dataclasses.replace(vision, layers=0)
    if pretrained.language or pretrained.hf:
        language = dataclasses.replace(language, num_hidden_layers=1, vocab_size=8)
    return dataclasses.replace(config, vision=vision, language=language)


def build_meta_fusion(
    config: FusionConfig, pretrained: PretrainedConfig, *, momentum: float
) -> tuple[FusionModel, dict[str, Tensor]]:
    """The fusion model with its pretrained towers on the meta device (module docstring, 2.).

    Returns the model and ``{tower parameter (layer index 0): fresh value}`` for tower
    parameters a checkpoint may lack (joint-attention extras; per-layer values taken from
    layer 0, whose initialisation is a constant).
    """
    shell = FusionModel(_shell_config(config, pretrained), momentum=momentum)
    with torch.device("meta"):
        model = FusionModel(config, momentum=momentum)
    for name, child in shell.named_children():
        if name not in pretrained.parts:
            setattr(model, name, child)
    for name, param in shell.named_parameters(recurse=False):
        setattr(model, name, param)
    model._momentum = shell._momentum  # EMA copies of the shell's (now the model's) heads
    fresh = {
        f"{part}.{n}": p.detach()
        for part in pretrained.parts
        for n, p in getattr(shell, part).named_parameters()
    }
    return model, fresh


def _vision_key(name: str) -> str:
    return name.replace("attn.in_proj.weight", "attn.in_proj_weight").replace(
        "attn.in_proj.bias", "attn.in_proj_bias"
    )


def _language_key(name: str, tensors: TensorFile) -> str:
    if name == "lm_head.weight" and name not in tensors.shapes:  # tied checkpoints omit it
        return "model.embed_tokens.weight"
    return name if name.startswith("lm_head.") else f"model.{name}"


def _key(part: str, name: str, tensors: TensorFile, hf: bool) -> str:
    """The checkpoint key of our parameter ``name`` of ``part`` (``hf``: our state-dict key,
    :func:`~lightning_mmpar.recipes.pretrained_files.transformers_vlm`)."""
    if hf or part == "vision":
        return _vision_key(name)
    return _language_key(name, tensors)


VOCAB_PARAMS = ("embed_tokens.weight", "lm_head.weight")
"""Endings of the parameters whose rows are the vocabulary: the only ones the loader pads with
zero rows past the checkpoint's (:func:`vocab_rows`); any other tensor with fewer rows than
the model's parameter is refused, not padded."""


def _read(tensors: TensorFile, key: str, shape: tuple[int, ...], index: Index, name: str) -> Tensor:
    """``checkpoint[key]`` viewed with our global ``shape``, sliced by ``index``: open_clip's
    fused ``[3 D, ...]`` rows as ``[3, D, ...]``, and, for a vocabulary parameter (``name``
    ends with one of :data:`VOCAB_PARAMS`), rows past the checkpoint's as zeros.

    Raises:
        ValueError: the checkpoint's shape fits none of these (a cut or mis-sized tensor)."""
    have = tensors.shapes[key]
    if have == shape:
        return tensors.read(key, index)
    if len(have) == len(shape) - 1 and have == (shape[0] * shape[1], *shape[2:]):  # fused qkv
        d, rows, rest = shape[1], index[1], index[2:]
        parts = [
            tensors.read(key, (slice(c * d + rows.start, c * d + rows.stop), *rest))
            for c in range(index[0].start, index[0].stop)
        ]
        return torch.stack(parts)
    padded = len(have) == len(shape) and have[1:] == shape[1:] and have[0] < shape[0]
    if padded and name.endswith(VOCAB_PARAMS):
        rows = index[0]
        top = min(rows.stop, have[0])
        out = torch.zeros(
            (rows.stop - rows.start, *[s.stop - s.start for s in index[1:]]),
            dtype=torch.float32,
        )
        if top > rows.start:
            out[: top - rows.start] = tensors.read(key, (slice(rows.start, top), *index[1:]))
        return out
    raise ValueError(
        f"{tensors.path}: {key!r} has shape {list(have)}, the model's parameter "
        f"{list(shape)}; the checkpoint does not fit the configured tower (set the tower's "
        "sizes in model.fusion to the checkpoint's, or pass its directory with a config)."
    )


def _local_index(param: Tensor) -> tuple[tuple[int, ...], Index]:
    """``(local shape, global slice)`` of this rank's part of ``param``."""
    if isinstance(param, DTensor):
        shape, offset = compute_local_shape_and_global_offset(
            param.shape, param.device_mesh, param.placements
        )
    else:
        shape, offset = tuple(param.shape), (0,) * param.ndim
    return tuple(shape), tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))


def _device(param: Tensor) -> torch.device:
    """Where this rank's part lives: the DTensor mesh's device, else the CPU (the strategy
    moves plain parameters with the rest of the module)."""
    kind = param.device_mesh.device_type if isinstance(param, DTensor) else "cpu"
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, torch.accelerator.current_device_index())


def _as_param(param: Tensor, local: Tensor, device: torch.device | None = None) -> nn.Parameter:
    if isinstance(param, DTensor):
        value: Tensor = DTensor.from_local(
            local.to(_device(param)),
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )
    else:
        value = local if device is None else local.to(device)
    return nn.Parameter(value, requires_grad=param.requires_grad)


def _marked(param: Tensor, value: nn.Parameter) -> nn.Parameter:
    """``value`` with the attributes the plan set on ``param`` (e.g. ``PARTIAL_OVER_TP`` of a
    data-parallel ViT: the strategy sums its gradients over tp)."""
    vars(value).update({k: v for k, v in vars(param).items() if k not in vars(value)})
    return value


def _defers(module: Any) -> bool:
    """Whether the reads wait for FSDP (``mm_parallel``, ``"fsdp"``, dp > 1; docstring, 3.)."""
    s: Any = getattr(getattr(module, "_trainer", None), "strategy", None)  # duck-typed
    mm = getattr(s, "strategy_name", None) == "mm_parallel" and s.config.data_parallel == "fsdp"
    return bool(mm and s.parallel_dims.dp > 1)


def owned_parameters(module: Any, blocks: list[nn.Module]) -> tuple[set[int], LoadReport]:
    """Ids of the parameters this rank keeps after the strategy's pipeline cut (all of them
    without pipeline parallelism), with the assumed stages recorded in a report."""
    report = LoadReport()
    strategy = getattr(getattr(module, "_trainer", None), "strategy", None)
    config = getattr(strategy, "config", None)
    if config is None or getattr(config, "pipeline_parallel", 1) == 1:
        return {id(p) for b in blocks for p in b.parameters()}, report
    from lightning_mmpar.parallel import comm
    from lightning_mmpar.parallel.pipeline.stages import stage_plan_for
    from lightning_mmpar.topology import ParallelDims

    plan = stage_plan_for(module, config)
    group = ParallelDims.of(module._trainer).get_mesh("pp").get_group()
    mine = tuple(s for s, r in enumerate(plan.ranks) if r == comm.group_rank(group))
    report.stages = (tuple(plan.ranges), mine)
    owned = [blocks[i] for s in mine for i in plan.ranges[s]]
    return {id(p) for b in owned for p in b.parameters()}, report


def load_towers(
    module: Any,
    model: nn.Module,
    pretrained: PretrainedConfig,
    fresh: dict[str, Tensor],
) -> LoadReport:
    """Fill ``model``'s meta tower parameters with this rank's slices, or defer (3., FSDP).

    Call after the tensor-parallel plan, freezing and the block cut (``module.blocks``).

    Raises:
        ValueError: a checkpoint lacks a tower parameter, has one of another shape, or holds
            tensors the tower has no parameter for (naming the keys and the file).
    """
    owned, report = owned_parameters(module, list(module.blocks))
    files = _open(pretrained, model)
    new: dict[int, nn.Parameter] = {}
    defer, later = _defers(module), {}  # deferred: {id: name}, their reads in `keys`
    keys: dict[str, tuple[str, Tensor, list[tuple[nn.Module, str]]]] = {}
    for tower, (_, tensors) in files.items():
        used: set[str] = set()
        for pname, param in getattr(model, tower).named_parameters():
            name = f"{tower}.{pname}"
            key = _key(tower, pname, tensors, bool(pretrained.hf))
            shape, index = _local_index(param)
            used.add(key)
            if id(param) not in owned:
                local = torch.zeros((), dtype=param.dtype, device=_device(param)).expand(shape)
                report.placeholders.append(name)
            elif key in tensors.shapes and defer:  # stays on meta until it is sharded
                keys[name], later[id(param)] = (key, param, []), name
                continue
            elif key in tensors.shapes:
                local = _read(tensors, key, tuple(param.shape), index, name).to(param.dtype)
                report.read[name] = (tuple(param.shape), index)
            else:
                value = fresh.get(f"{tower}.{_LAYER.sub(_layer0, pname)}")
                if value is None:
                    raise ValueError(
                        f"{tensors.path}: no tensor {key!r} for the {tower} tower's parameter "
                        f"{pname!r}; the checkpoint does not fit the configured tower."
                    )
                local = value[index].clone()
                report.fresh.append(name)
            new[id(param)] = _marked(param, _as_param(param, local))
        stray = [k for k in tensors.shapes if k not in used and not k.endswith(IGNORED_KEYS)]
        if stray:
            raise ValueError(
                f"{tensors.path}: tensors {stray[:8]} have no parameter in the {tower} tower; "
                "the checkpoint holds another architecture than the configured one."
            )
        report.bytes_read += tensors.bytes_read
    for sub in (*module.modules(), *model.modules()):  # blocks hold some parameters directly
        for pname, param in list(sub._parameters.items()):
            if param is not None and id(param) in new:
                sub._parameters[pname] = new[id(param)]
            elif id(param) in later:  # where FSDP may register its sharded replacement
                keys[later[id(param)]][2].append((sub, pname))
    meta = [
        n
        for n, t in (*module.named_parameters(), *module.named_buffers())
        if t.is_meta and id(t) not in later
    ]
    if meta:
        raise RuntimeError(f"tensors left on the meta device after loading: {meta[:8]}")
    if keys:
        report.deferred, report.pending = list(keys), (files, keys)
    return report


def load_deferred(module: Any, device: torch.device) -> None:
    """Fill the tower parameters :func:`load_towers` left on the meta device with this rank's
    shard of each once the strategy sharded them (its ``load_sharded_parameters`` hook): a meta
    ``DTensor`` on ``(dp, tp)`` (FSDP's ``_StridedShard`` included) gets its local block, one
    FSDP does not manage (0-dim) its TP slice, a plain tensor all of it on ``device``. Counted
    in ``module.load_report`` (``read``, ``bytes_read``); a no-op when none are pending.
    Raises ``ValueError`` when a checkpoint tensor does not fit (checked here under FSDP).
    """
    report: LoadReport | None = module.load_report
    if report is None or report.pending is None:
        return
    files, keys = report.pending
    start = sum(t.bytes_read for _, t in files.values())
    for name, (key, meta, spots) in keys.items():
        tensors = files[name.partition(".")[0]][1]
        held = [sub._parameters[attr] for sub, attr in spots]  # FSDP's replacement first
        param = next((p for p in held if p is not meta), meta)
        index = _local_index(param)[1]
        local = _read(tensors, key, tuple(param.shape), index, name).to(param.dtype)
        value = _marked(param, _as_param(param, local, device))
        assign(spots, value)
        report.read[name] = (tuple(param.shape), index)
    report.bytes_read += sum(t.bytes_read for _, t in files.values()) - start
    report.pending = None


def _layer0(match: re.Match[str]) -> str:
    return f"{match.group(1)}.0."


def check_stage_guess(module: Any, report: LoadReport | None) -> None:
    """Refuse a pipeline cut other than the one :func:`load_towers` assumed (its placeholders
    would be trained as weights). Call once the strategy has cut the stages.

    Raises:
        RuntimeError: the strategy's stage ranges or this rank's stages differ.
    """
    if report is None or report.stages is None:
        return
    engine = TrainerTopology.of(module.trainer).engine
    got = (tuple(engine.stage_ranges), tuple(engine.stage_ids)) if engine else None
    if got != report.stages:
        raise RuntimeError(
            f"pretrained towers were loaded for the pipeline stages {report.stages}, the "
            f"strategy cut {got}: use a partition that does not depend on the precision "
            "(e.g. partition: equal or explicit boundaries)."
        )


def vocab_rows(module: Any, tp: int) -> int:
    """Rows of the recipe ``module``'s embedding and LM head at tensor-parallel size ``tp``:
    the tokenizer's vocabulary (``module.vocab_size``), at least the pretrained checkpoint's,
    padded to ``lcm(plan.vocab_multiple, tp)``."""
    multiple = math.lcm(module.plan_options.vocab_multiple, tp)
    rows = module.vocab_size
    if module.pretrained.language or module.pretrained.hf:
        rows = max(rows, module.fusion_config.language.vocab_size)
    return -(-rows // multiple) * multiple


def meta_fusion(
    module: Any, config: FusionConfig, tp: int
) -> tuple[FusionModel, dict[str, Tensor]]:
    """:func:`build_meta_fusion` for the recipe ``module`` at tensor-parallel size ``tp``, with
    :func:`vocab_rows` vocabulary rows."""
    language = dataclasses.replace(config.language, vocab_size=vocab_rows(module, tp))
    config = dataclasses.replace(config, language=language)
    return build_meta_fusion(config, module.pretrained, momentum=module.loss_config.mml.momentum)
