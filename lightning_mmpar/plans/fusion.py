"""The fusion model's parallel plan (torchtitan's ``parallelize_<model>``): one plan per tower.

Megatron's column/row patterns (:mod:`lightning_mmpar.parallel.tensor`) per tower:

* **vision** (``model.vision``), per ``vision_parallel`` (:mod:`lightning_mmpar.plans.
  fusion_vision`): ``tp`` shards every ViT block by heads / FFN columns, ``replicate`` keeps a
  full ViT computing every image on each tp rank, ``dp`` a full ViT per tp rank encoding
  ``1 / tp`` of the images, gathered after the last block.
* **adapter** (``model.adapters``): cross-attention q/k/v column parallel and its combine
  (``vl_combine``: row-parallel ``o_proj`` with partial sums all-reduced, or the heads
  all-gathered and ``o_proj`` replicated) on the **vl** mesh (same ranks as tp, own
  communicator); the FFN (``fc1`` column, ``fc2`` row) on the tp mesh.
* **language** (``model.language``): vocab-parallel ``embed_tokens`` (rows split, outputs
  all-reduced), q/k/v column parallel (each rank owns ``H / p`` query and ``H_kv / p`` key/value
  heads, so GQA groups stay on one rank), ``o_proj`` row parallel, SwiGLU ``gate/up`` column and
  ``down`` row parallel; ``lm_head`` column parallel returning vocab-sharded DTensor logits for
  :func:`lightning_mmpar.parallel.numerics.vocab_parallel_cross_entropy`. Joint-attention
  temperatures use :class:`HeadShardedReplicate`.
* **sequence parallel** (``sequence_parallel=True``): the text residual stream ``[B, T, D]`` is
  sharded along ``T`` (norms, gates, dropout on ``T / p`` tokens; all-gather before attention and
  FFN, reduce-scatter after) in the language tower and the adapters. The head gathers the
  sequence before it indexes a stream: ``lm_head`` reads the fused stream as ``Shard(1)``
  (full-sequence logits), and ``text_head``, which picks each row's last token of the text-only
  and class-prompt streams, gathers its input to ``Replicate`` on entry (indexing a
  sequence-sharded DTensor with a plain index tensor raises ``aten.index.Tensor got mixed
  torch.Tensor and DTensor``).

Dropout (the adapters' ``dropout``, the model's only one) becomes a
:class:`~lightning_mmpar.parallel.random.ParallelDropout` whenever the layout spans more than one
process: region ``replicated`` when its input (the attention / FFN branch output) is replicated
over TP (no sequence parallel: equal masks on TP peers), ``tensor-parallel`` when it is a sequence
shard (independent masks per TP rank); dp replicas and pipeline stages always draw independent
masks. Activation checkpointing's recomputation replays the tracker
(:func:`lightning_mmpar.parallel.random.checkpoint_rng_contexts`), so the masks match.

Every sharded parameter's global value is the unsharded model's, so ``get_model_state_dict`` of
a sharded model is the unsharded state dict, sharded, and DCP checkpoints reshard across TP sizes.

The plan's ``layers`` (what the strategy's ``activation_checkpointing="layers"`` recomputes, and
what the planner's cost model counts as recomputed: ``layout.cost``): every ViT block, adapter
block and decoder layer, not the stem, pooler, bridge and head. Pipeline blocks and FSDP units:
``model.pipeline_blocks()``. The sharding options are :class:`FusionPlanOptions` (the recipe's
``model.plan:`` section; the degree is the strategy's ``tensor_parallel``). Order
(:func:`lightning_mmpar.parallel.parallelize.parallelize`): TP -> EP -> the plan's steps (the
vision tower's data-parallel hooks) -> activation checkpointing -> pipeline split -> FSDP per
block.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from functools import partial
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
)

from lightning_mmpar.layout import LayoutFacts, ParallelLayout, validate
from lightning_mmpar.models.fusion import FusionConfig, FusionModel
from lightning_mmpar.models.language import LanguageModel
from lightning_mmpar.parallel.activation import LAYERS
from lightning_mmpar.parallel.parallelize import apply_model_parallel, checkpoint_and_compile
from lightning_mmpar.parallel.random import REPLICATED, TENSOR_PARALLEL
from lightning_mmpar.parallel.tensor import HeadShardedReplicate, SequenceLengthCheck, StyleGroup
from lightning_mmpar.plans.fusion_vision import (
    VisionParallel,
    apply_vision_data_parallel,
    check_vision_parallel,
    parallelize_vision,
    vision_dropout_regions,
    vision_plan,
    vision_tp_sizes,
)
from lightning_mmpar.plans.plan import ParallelPlan, apply_plan, tp_meshes
from lightning_mmpar.topology import ParallelDims

__all__ = [
    "FusionPlanOptions",
    "TensorParallelOptions",
    "adapter_plan",
    "apply_tensor_parallel",
    "check_fusion_layout",
    "check_moe_layout",
    "checkpoint_units",
    "dropout_regions",
    "fusion_facts",
    "fusion_plan",
    "language_plan",
    "moe_layers",
    "parallelize_fusion",
    "validate_tensor_parallel",
    "vision_plan",
]

VLCombine = Literal["all_reduce", "all_gather"]


@dataclass(kw_only=True)
class FusionPlanOptions:
    """How the fusion plan shards the model (the degree is the layout's ``tensor_parallel``).

    Raises ``ValueError`` at construction for an unknown ``vision_parallel`` or ``vl_combine``.
    """

    vision_parallel: VisionParallel = "tp"
    """Shard the ViT by heads (``tp``), keep a full copy computing every image per tp rank
    (``replicate``), or a full copy per tp rank encoding ``1 / tp`` of each micro-batch's images
    (``dp``: the micro-batch must divide by tp; :mod:`lightning_mmpar.plans.fusion_vision`)."""
    sequence_parallel: bool = False
    """Shard the text residual stream along the sequence (text length must divide by tp)."""
    vl_combine: VLCombine = "all_reduce"
    """Combine of the cross-attention heads on the vision-language group: ``all_reduce`` of
    partial sums (Megatron-LM's row-parallel output, Shoeybi et al. 2019) or ``all_gather``."""
    vocab_multiple: int = 8
    """The LM vocabulary is padded to a multiple of this (and of tp) so it shards evenly."""
    activation_checkpointing: bool = False
    """Deprecated alias of the strategy's ``activation_checkpointing="layers"``: recompute every
    ViT block, adapter and decoder layer in backward (used when the strategy's option is
    unset)."""

    def __post_init__(self) -> None:
        check_vision_parallel(self.vision_parallel)
        if self.vl_combine not in ("all_reduce", "all_gather"):
            raise ValueError(
                f"vl_combine ({self.vl_combine!r}) must be 'all_reduce' or 'all_gather'."
            )
        if self.activation_checkpointing:
            warnings.warn(
                "model.plan.activation_checkpointing (formerly model.tensor_parallel."
                "activation_checkpointing) is deprecated: set the strategy's option, "
                "trainer.strategy.init_args.activation_checkpointing: layers (the same ViT "
                "blocks, adapters and decoder layers).",
                DeprecationWarning,
                stacklevel=3,
            )


@dataclass(kw_only=True)
class TensorParallelOptions(FusionPlanOptions):
    """Deprecated name of :class:`FusionPlanOptions` (``tensor_parallel`` is the degree)."""

    def __post_init__(self) -> None:
        warnings.warn(
            "TensorParallelOptions is deprecated: use FusionPlanOptions (lightning_mmpar.plans); "
            "'tensor_parallel' now means the degree only.",
            DeprecationWarning,
            stacklevel=3,
        )
        super().__post_init__()


def fusion_facts(config: FusionConfig, *, count_blocks: bool = False) -> LayoutFacts:
    """What the fusion model tells :func:`lightning_mmpar.layout.validate`: the sizes tensor
    parallelism splits (ViT heads and MLP width under ``vision_parallel='tp'``; adapter heads
    and FFN width; LLM query and key-value heads, intermediate size, vocabulary), the ViT's
    blocks, the experts of each MoE part, whether sequence parallelism is refused (spliced
    fusion); with ``count_blocks`` the pipeline blocks too (counted on a meta-device build).
    """
    v, a, lang = config.vision, config.adapter, config.language
    attn = "language.layers.*.self_attn"
    parts = {"language": lang.moe, "adapter": a.moe}
    adapter_sizes: tuple[tuple[str, str, int], ...] = ()
    if a.num_blocks:  # no adapter: nothing to split
        adapter_sizes = (
            ("adapters.*.attn", "AdapterConfig.heads", a.heads),
            ("adapters.*.mlp", "AdapterConfig.ffn_width", a.ffn_width),
        )
    blocks = None
    if count_blocks:
        with torch.device("meta"):
            blocks = len(FusionModel(config).pipeline_blocks())
    return LayoutFacts(
        vision_tp_sizes=vision_tp_sizes(v),
        tp_sizes=(
            *adapter_sizes,
            (attn, "LanguageConfig.num_attention_heads", lang.num_attention_heads),
            (attn, "LanguageConfig.num_key_value_heads", lang.num_key_value_heads),
            ("language.layers.*.mlp", "LanguageConfig.intermediate_size", lang.intermediate_size),
            ("language.embed_tokens/lm_head", "LanguageConfig.vocab_size", lang.vocab_size),
        ),
        vision_layers=v.layers,
        experts=tuple(
            (f"model.fusion.{part}.moe.num_experts", moe.num_experts)
            for part, moe in parts.items()
            if moe is not None
        ),
        no_experts=(
            "model.fusion.language.moe is null (adapter.moe too); configure MoE FFNs "
            "(recipes/clip_llama_moe_cpu.yaml)"
        ),
        pipeline_blocks=blocks,
        no_sequence_parallel=(
            "spliced image tokens (model.fusion.fusion='spliced', as in Hugging Face's LLaVA "
            "and Qwen-VL) replace embedding rows, and a sequence shard holds only its own"
            if config.fusion == "spliced"
            else None
        ),
    )


def validate_tensor_parallel(
    config: FusionConfig, tp: int, *, vision_parallel: VisionParallel = "tp"
) -> None:
    """Raise a ``ValueError`` naming module, field, value and the fix: the field's nearest
    multiples of ``tp``, or the smaller tensor-parallel sizes that divide it (the sizes rules of
    :func:`lightning_mmpar.layout.validate` with :func:`fusion_facts`)."""
    layout = ParallelLayout(tp=tp, dp=None, vision_parallel=vision_parallel)
    validate(layout, replace(fusion_facts(config), experts=None))


def _combine_style(vl_combine: VLCombine, seq: Shard | Replicate) -> ParallelStyle:
    """How head-sharded cross-attention context ``C_r`` becomes ``Y = C W_o^T + b``.

    ``all_reduce``: ``W_o`` row parallel, ``Y = sum_r C_r W_o,r^T`` (partial sums reduced).
    ``all_gather``: ``C = [C_0 ... C_p]`` gathered, ``W_o`` replicated, every rank computes ``Y``.
    """
    if vl_combine == "all_reduce":
        return RowwiseParallel(output_layouts=seq)
    return PrepareModuleInputOutput(
        input_layouts=(Shard(-1),),
        desired_input_layouts=(Replicate(),),
        use_local_input=True,
        output_layouts=(Replicate(),),
        desired_output_layouts=(seq,),
        use_local_output=True,
    )


def adapter_plan(
    num_blocks: int, *, sequence_parallel: bool, vl_combine: VLCombine, moe: bool = False
) -> tuple[dict[str, ParallelStyle], dict[str, ParallelStyle]]:
    """``(plan on the vl mesh, plan on the tp mesh)`` for the adapter blocks.

    Cross-attention (q/k/v column parallel, combine per ``vl_combine``) runs on the dedicated
    vision-language group; the FFN (fc1 column, fc2 row parallel) on the tp group, unless
    ``moe`` (mixture-of-experts FFNs stay whole on every tp rank).
    """
    seq: Shard | Replicate = Shard(1) if sequence_parallel else Replicate()
    vl: dict[str, ParallelStyle] = {}
    tp: dict[str, ParallelStyle] = {}
    for i in range(num_blocks):
        p = f"{i}"
        for name in ("q_proj", "k_proj", "v_proj"):
            vl[f"{p}.attn.{name}"] = ColwiseParallel()
        vl[f"{p}.attn.o_proj"] = _combine_style(vl_combine, seq)
        if not moe:
            tp[f"{p}.mlp.fc1"] = ColwiseParallel()
            tp[f"{p}.mlp.fc2"] = RowwiseParallel(output_layouts=seq)
        if sequence_parallel:
            vl[f"{p}.attn"] = PrepareModuleInput(
                input_layouts=(Shard(1), Replicate()), desired_input_layouts=(Replicate(),) * 2
            )
            tp[f"{p}.norm_q"] = SequenceParallel(use_local_output=True)
            tp[f"{p}.norm_ffn"] = SequenceParallel()
            tp[f"{p}.mlp"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
            tp[f"{p}.attn_gate"] = SequenceParallel(use_local_output=True)
            tp[f"{p}.ffn_gate"] = SequenceParallel(use_local_output=True)
    return vl, tp


def language_plan(language: LanguageModel, *, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Vocab-parallel embedding and LM head, column/row parallel attention (GQA) and SwiGLU."""
    seq: Shard | Replicate = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "lm_head": ColwiseParallel(
            input_layouts=seq, output_layouts=Shard(-1), use_local_output=False
        ),
    }
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    for i, layer in enumerate(language.layers):
        p = f"layers.{i}"
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"{p}.self_attn.{name}"] = ColwiseParallel()
        plan[f"{p}.self_attn.o_proj"] = RowwiseParallel(output_layouts=seq)
        if layer.moe is None:  # MoE FFNs stay whole on every tp rank (experts replicated)
            plan[f"{p}.mlp.gate_proj"] = ColwiseParallel()
            plan[f"{p}.mlp.up_proj"] = ColwiseParallel()
            plan[f"{p}.mlp.down_proj"] = RowwiseParallel(output_layouts=seq)
        joint = getattr(layer.self_attn, "temperature", None) is not None
        if joint:
            plan[f"{p}.self_attn.temperature"] = HeadShardedReplicate()
        if sequence_parallel:
            plan[f"{p}.input_layernorm"] = SequenceParallel()
            plan[f"{p}.post_attention_layernorm"] = SequenceParallel()
            n_in = 2 if joint else 1
            plan[f"{p}.self_attn"] = PrepareModuleInput(
                input_layouts=(Shard(1), Replicate())[:n_in],
                desired_input_layouts=(Replicate(),) * n_in,
            )
            plan[f"{p}.mlp"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
    return plan


def checkpoint_units(model: FusionModel) -> tuple[str, ...]:
    """The model's repeated layers (the plan's ``layers``, activation-checkpoint units): every
    ViT block, adapter block and decoder layer."""
    vision = [
        f"vision.transformer.resblocks.{i}" for i in range(len(model.vision.transformer.resblocks))
    ]
    adapters = [f"adapters.{i}" for i in range(len(model.adapters))]
    layers = [f"language.layers.{i}" for i in range(len(model.language.layers))]
    return (*vision, *adapters, *layers)


def dropout_regions(
    model: FusionModel, *, sequence_parallel: bool, vision_parallel: VisionParallel = "tp"
) -> tuple[tuple[str, str], ...]:
    """``(adapters.<i>.dropout, region)`` per adapter: ``tensor-parallel`` when the residual
    branches it drops are sequence shards (``sequence_parallel``), else ``replicated``; then
    any ViT dropout (:func:`~lightning_mmpar.plans.fusion_vision.vision_dropout_regions`)."""
    region = TENSOR_PARALLEL if sequence_parallel else REPLICATED
    adapters = tuple((f"adapters.{i}.dropout", region) for i in range(len(model.adapters)))
    return adapters + vision_dropout_regions(model.vision, vision_parallel)


def fusion_plan(
    model: FusionModel,
    options: FusionPlanOptions = FusionPlanOptions(),  # noqa: B008
    dims: ParallelDims | None = None,
) -> ParallelPlan:
    """The fusion model's plan as data (no process group needed to build or inspect it); paths
    from ``model`` (the plan's ``root``). Its steps after TP and EP set the MoE layers' routed
    sequence multiple to tp and install ``vision_parallel="dp"``'s hooks
    (:func:`~lightning_mmpar.plans.fusion_vision.parallelize_vision`). With ``dims``: checked
    against them first (:func:`check_fusion_layout`), raising its ``ValueError``."""
    if dims is not None:
        check_fusion_layout(model.config, dims, options)
    seq = options.sequence_parallel
    groups: list[StyleGroup] = []
    if options.vision_parallel == "tp":
        groups.append(StyleGroup("vision", "tp", vision_plan(model.vision)))
    moe = model.config.adapter.moe is not None
    vl, tp = adapter_plan(
        len(model.adapters), sequence_parallel=seq, vl_combine=options.vl_combine, moe=moe
    )
    groups += [
        StyleGroup("adapters", "vl", vl),
        StyleGroup("adapters", "tp", tp),
        StyleGroup("language", "tp", language_plan(model.language, sequence_parallel=seq)),
    ]
    if seq:
        # the pooler indexes h[rows, last]: gather the text-only / prompt streams first
        text_in = PrepareModuleInput(
            input_layouts=(Shard(1), None),
            desired_input_layouts=(Replicate(), None),
            use_local_output=True,
        )
        groups += [
            StyleGroup("language.embed_tokens", "tp", SequenceLengthCheck("input_ids")),
            StyleGroup("text_head", "tp", text_in),
        ]
    return ParallelPlan(
        tensor_parallel=tuple(groups),
        dropout_regions=dropout_regions(
            model, sequence_parallel=seq, vision_parallel=options.vision_parallel
        ),
        expert_parallel=moe_layers(model),
        after_model_parallel=(
            partial(_moe_sequence_multiple, model),
            partial(_vision_hooks, model, options.vision_parallel),
        ),
        layers=checkpoint_units(model),
        checkpointing=LAYERS if options.activation_checkpointing else None,
        pipeline_blocks=model.pipeline_blocks,
        root=model,
    )


def _moe_sequence_multiple(model: FusionModel, dims: ParallelDims) -> None:
    """MoE FFNs pad routed sequences to multiples of lcm(tp, experts) (:mod:`~lightning_mmpar.
    models.moe`): each tp rank then routes an equal share."""
    for path in moe_layers(model):
        setattr(model.get_submodule(path), "sequence_multiple", dims.tp)  # noqa: B010


def _vision_hooks(model: FusionModel, vision_parallel: VisionParallel, dims: ParallelDims) -> None:
    parallelize_vision(model.vision, dims, vision_parallel)


def check_moe_layout(config: FusionConfig, tp: int, ep: int, *, sequence_parallel: bool) -> None:
    """MoE FFNs against the layout, from the config alone (the CLI runs it before launch).
    ``ValueError`` naming field, value and fix: ``ep > 1`` without MoE layers, ``num_experts``
    not divisible by ``ep``, sequence parallelism (``tp > 1``) with MoE layers (the experts
    rules of :func:`lightning_mmpar.layout.validate` with :func:`fusion_facts`)."""
    facts = fusion_facts(config)
    layout = ParallelLayout(tp=tp, ep=ep, dp=None, sequence_parallel=sequence_parallel)
    validate(layout, LayoutFacts(experts=facts.experts, no_experts=facts.no_experts))


def check_fusion_layout(
    config: FusionConfig, dims: ParallelDims, options: FusionPlanOptions
) -> None:
    """What :func:`parallelize_fusion` checks first: the layout of ``dims`` with ``options``'
    vision mode and sequence parallelism, by :func:`lightning_mmpar.layout.validate` against
    :func:`fusion_facts` (sizes vs tp, experts vs ep). Raises ``ValueError`` (field, value,
    fix)."""
    layout = ParallelLayout(
        tp=dims.tp,
        ep=dims.ep,
        dp=None,
        vision_parallel=options.vision_parallel,
        sequence_parallel=options.sequence_parallel,
    )
    validate(layout, fusion_facts(config))


def moe_layers(model: FusionModel) -> tuple[str, ...]:
    """Paths of the MoE FFNs: ``adapters.<i>.mlp``, ``language.layers.<i>.mlp``."""
    adapters = [f"adapters.{i}.mlp" for i, a in enumerate(model.adapters) if a.moe is not None]
    layers = model.language.layers
    return (*adapters, *(f"language.layers.{i}.mlp" for i, x in enumerate(layers) if x.moe))


def parallelize_fusion(
    model: FusionModel,
    dims: ParallelDims,
    options: FusionPlanOptions = FusionPlanOptions(),  # noqa: B008
) -> FusionModel:
    """Apply the fusion plan's model-parallel part for ``dims`` to ``model`` in place (for code
    that parallelizes the model itself, e.g. a ``configure_model`` under another strategy; under
    ``mm_parallel`` a module returns :func:`fusion_plan` from ``parallel_plan(dims)`` and the
    strategy applies it); returns it.

    Parallel dropout (:func:`dropout_regions`) when ``dims`` spans more than one process, tensor
    parallelism on ``dims.get_mesh("tp")`` when ``dims.tp > 1`` (cross-attention on
    ``dims.vl_group`` when the dims built their own mesh, else on the tp group), expert
    parallelism when ``dims.ep > 1``, the vision tower's hooks, then activation checkpointing
    of the plan's layers when the deprecated ``options.activation_checkpointing`` asks; nothing
    but the checks on one process. Call it on the built model, before any pipeline split and
    FSDP. Raises ``ValueError`` when a size does not divide by ``dims.tp``;
    ``vision_parallel="dp"`` raises it for dims not built by ``mm_parallel``, and at forward
    time for a micro-batch not divisible by ``dims.tp``.
    """
    plan = fusion_plan(model, options, dims)
    apply_model_parallel(model, dims, plan)
    checkpoint_and_compile(model, plan)
    return model


def apply_tensor_parallel(
    model: FusionModel,
    tp_mesh: DeviceMesh,
    *,
    vision_parallel: VisionParallel = "tp",
    sequence_parallel: bool = False,
    vl_combine: VLCombine = "all_reduce",
    vl_group: dist.ProcessGroup | None = None,
) -> FusionModel:
    """Shard ``model`` in place over the 1-D ``tp_mesh``; returns it (no activation
    checkpointing, dropout left as torch's; :func:`parallelize_fusion` is the entry point given a
    layout).

    ``vision_parallel``: ``tp`` shards the ViT by heads / FFN columns, ``replicate`` keeps a full
    copy on every tp rank, ``dp`` a full copy encoding ``1 / tp`` of the images per rank (sum the
    gradients of :data:`~lightning_mmpar.parallel.data.PARTIAL_OVER_TP` parameters over tp after
    backward: the strategy does). ``vl_combine``: ``all_reduce`` (Megatron-LM's row-parallel
    output) or ``all_gather`` combine of the cross-attention heads, run on ``vl_group`` (same ranks
    as ``tp_mesh``, its own communicator; default: the tp group itself). Raises ``ValueError`` for
    unknown options, a mesh that is not 1-D, a ``vl_group`` of other ranks, or sizes that do not
    divide by tp.
    """
    options = FusionPlanOptions(
        vision_parallel=vision_parallel, sequence_parallel=sequence_parallel, vl_combine=vl_combine
    )
    meshes = tp_meshes(tp_mesh, vl_group)
    validate_tensor_parallel(model.config, tp_mesh.size(), vision_parallel=vision_parallel)
    apply_plan(model, fusion_plan(model, options), meshes)  # no dims: no steps
    if vision_parallel == "dp":
        apply_vision_data_parallel(model.vision, tp_mesh.get_group())
    return model
