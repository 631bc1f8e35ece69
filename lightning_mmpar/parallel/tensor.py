"""Tensor-parallel plans for the fusion model: one plan per tower (vision, adapter, language).

Megatron's two patterns on DTensor (``torch.distributed.tensor.parallel``):

* column parallel ``Y = X A``, ``A = [A_1 ... A_p]`` split along its second dim (output features);
  the input is replicated (copy forward, all-reduce of its gradient backward);
* row parallel ``Y = sum_r X_r A_r``, ``A`` split along its first dim (input features); the
  partial sums are all-reduced (or reduce-scattered along the sequence under sequence parallel).

Attention is column parallel on q/k/v (each rank owns whole heads: ``H / p`` query heads and
``H_kv / p`` key/value heads, so GQA groups stay on one rank) and row parallel on the output
projection; FFNs are column parallel on the up/gate projections and row parallel on the down
projection. The embedding is vocab-parallel (rows split, outputs all-reduced) and the LM head
column parallel, returning logits as a vocab-sharded DTensor for
:func:`lightning_mmpar.parallel.vocab_loss.vocab_parallel_cross_entropy`.

Every sharded parameter's global value is the unsharded model's (open_clip's fused ``in_proj`` is
held ``[3, D, D]`` and sharded on its head dim, not re-ordered), so ``get_model_state_dict`` of a
sharded model is the unsharded state dict, sharded, and DCP checkpoints reshard across TP sizes.

Sequence parallel (``sequence_parallel=True``) shards the text residual stream along the
sequence (norms, gates, dropout run on ``T / p`` tokens; all-gather before attention/FFN,
reduce-scatter after). It covers the language tower, the adapters and the text side of the head;
the vision tower is never sequence-parallel (open_clip's ``grid**2 + 1`` tokens do not divide by
4). Use after the model is built and before FSDP; cut pipeline blocks afterwards.
"""

from __future__ import annotations

from typing import Any, Literal

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lightning_mmpar.models.fusion import FusionConfig, FusionModel
from lightning_mmpar.models.language import LanguageModel
from lightning_mmpar.models.vision import VisionTower
from lightning_mmpar.parallel.vocab_loss import vocab_parallel_cross_entropy

__all__ = [
    "FusedQKVColwiseParallel",
    "HeadShardedReplicate",
    "adapter_plan",
    "apply_tensor_parallel",
    "full_state_dict",
    "language_plan",
    "validate_tensor_parallel",
    "vision_plan",
    "vocab_parallel_cross_entropy",
]

VisionParallel = Literal["tp", "replicate"]
VLCombine = Literal["all_reduce", "all_gather"]


class FusedQKVColwiseParallel(ParallelStyle):
    """Column parallel for open_clip's fused q/k/v projection (:class:`FusedQKV`), by whole heads.

    ``weight [3, D, D_in]`` and ``bias [3, D]`` become ``Shard(1)`` DTensors: rank ``r`` holds
    ``[W_q,r; W_k,r; W_v,r]`` (its ``H / p`` heads of each), while the DTensor's global value stays
    the canonical, TP-size-independent weight (``full_tensor().flatten(0, 1)`` is open_clip's
    ``in_proj_weight``), so DCP checkpoints reshard across TP sizes. The input is read as
    ``Replicate`` (its gradient, partial per rank, is all-reduced) and ``q, k, v`` come back as
    local ``[..., D / p]`` tensors for the attention's local heads.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        src = self.src_data_rank

        def partition(_name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, p in list(mod.named_parameters(recurse=False)):
                dt = distribute_tensor(p.detach(), mesh, [Shard(1)], src_data_rank=src)
                mod.register_parameter(pname, nn.Parameter(dt, requires_grad=p.requires_grad))

        def inputs(_mod: nn.Module, args: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
            x = args[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            return (x, *args[1:])

        def outputs(_mod: nn.Module, out: tuple[DTensor, ...], _mesh: DeviceMesh) -> Any:
            return tuple(t.to_local() for t in out)

        return distribute_module(module, device_mesh, partition, inputs, outputs)  # type: ignore[arg-type]


class HeadShardedReplicate(ParallelStyle):
    """A replicated parameter applied to a head-sharded tensor (the modality temperature).

    Parameters become ``Replicate`` DTensors and the first input (``[B, H/p, S, d]`` local) is
    read as ``Shard(1)``; the parameter's gradient, a sum over heads, comes out ``Partial`` and
    is all-reduced, so every rank holds the full-model gradient.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(_name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, p in list(mod.named_parameters(recurse=False)):
                dt = distribute_tensor(p.detach(), mesh, [Replicate()])
                mod.register_parameter(pname, nn.Parameter(dt, requires_grad=p.requires_grad))

        def inputs(_mod: nn.Module, args: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
            return (DTensor.from_local(args[0], mesh, [Shard(1)], run_check=False), *args[1:])

        def outputs(_mod: nn.Module, out: DTensor, _mesh: DeviceMesh) -> Tensor:
            return out.to_local()

        return distribute_module(module, device_mesh, partition, inputs, outputs)  # type: ignore[arg-type]


def _nearest(value: int, tp: int) -> str:
    low, high = value // tp * tp, (value // tp + 1) * tp
    return f"{low} or {high}" if low > 0 else f"{high}"


def validate_tensor_parallel(
    config: FusionConfig, tp: int, *, vision_parallel: VisionParallel = "tp"
) -> None:
    """Raise a ``ValueError`` naming module, field, value and the nearest valid sizes."""
    v, a, lang = config.vision, config.adapter, config.language
    checks: list[tuple[str, str, int]] = []
    if vision_parallel == "tp":
        checks += [
            ("vision.transformer.resblocks.*.attn", "VisionConfig.heads", v.heads),
            ("vision.transformer.resblocks.*.mlp", "VisionConfig.mlp_width", v.mlp_width),
        ]
    checks += [
        ("adapters.*.attn", "AdapterConfig.heads", a.heads),
        ("adapters.*.mlp", "AdapterConfig.ffn_width", a.ffn_width),
        (
            "language.layers.*.self_attn",
            "LanguageConfig.num_attention_heads",
            lang.num_attention_heads,
        ),
        (
            "language.layers.*.self_attn",
            "LanguageConfig.num_key_value_heads",
            lang.num_key_value_heads,
        ),
        ("language.layers.*.mlp", "LanguageConfig.intermediate_size", lang.intermediate_size),
        ("language.embed_tokens/lm_head", "LanguageConfig.vocab_size", lang.vocab_size),
    ]
    for module, name, value in checks:
        if value % tp != 0:
            raise ValueError(
                f"{module}: {name} ({value}) must be divisible by the tensor-parallel size ({tp}); "
                f"nearest valid sizes: {_nearest(value, tp)}."
            )


def vision_plan(vision: VisionTower) -> dict[str, ParallelStyle]:
    """Heads of every ViT block column/row parallel; embeddings, norms and ``proj`` replicated."""
    plan: dict[str, ParallelStyle] = {}
    for i in range(len(vision.transformer.resblocks)):
        p = f"transformer.resblocks.{i}"
        plan[f"{p}.attn.in_proj"] = FusedQKVColwiseParallel()
        plan[f"{p}.attn.out_proj"] = RowwiseParallel()
        plan[f"{p}.mlp.c_fc"] = ColwiseParallel()
        plan[f"{p}.mlp.c_proj"] = RowwiseParallel()
    return plan


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
    num_blocks: int, *, sequence_parallel: bool, vl_combine: VLCombine
) -> tuple[dict[str, ParallelStyle], dict[str, ParallelStyle]]:
    """``(plan on the vl mesh, plan on the tp mesh)`` for the adapter blocks.

    Cross-attention (q/k/v column parallel, combine per ``vl_combine``) runs on the dedicated
    vision-language group; the FFN (fc1 column, fc2 row parallel) on the tp group.
    """
    seq: Shard | Replicate = Shard(1) if sequence_parallel else Replicate()
    vl: dict[str, ParallelStyle] = {}
    tp: dict[str, ParallelStyle] = {}
    for i in range(num_blocks):
        p = f"{i}"
        for name in ("q_proj", "k_proj", "v_proj"):
            vl[f"{p}.attn.{name}"] = ColwiseParallel()
        vl[f"{p}.attn.o_proj"] = _combine_style(vl_combine, seq)
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


def _check_sequence(tp: int) -> Any:
    def hook(_module: nn.Module, args: tuple[Any, ...]) -> None:
        length = args[0].shape[1]
        if length % tp != 0:
            raise ValueError(
                f"sequence_parallel needs the text length ({length}) divisible by the "
                f"tensor-parallel size ({tp}); pad input_ids to {-(-length // tp) * tp} tokens."
            )

    return hook


def apply_tensor_parallel(
    model: FusionModel,
    tp_mesh: DeviceMesh,
    *,
    vision_parallel: VisionParallel = "tp",
    sequence_parallel: bool = False,
    vl_combine: VLCombine = "all_reduce",
    vl_group: dist.ProcessGroup | None = None,
) -> FusionModel:
    """Shard ``model`` in place over the 1-D ``tp_mesh``; returns it.

    ``vision_parallel``: ``tp`` shards the ViT by heads / FFN columns, ``replicate`` keeps a full
    copy on every tp rank (same numbers; no vision collectives). ``vl_combine``: ``all_reduce`` or
    ``all_gather`` combine of the cross-attention heads (TECHNIQUES 1.3), run on ``vl_group`` (same
    ranks as ``tp_mesh``, its own communicator; default: the tp group itself).
    """
    if vision_parallel not in ("tp", "replicate"):
        raise ValueError(f"vision_parallel ({vision_parallel!r}) must be 'tp' or 'replicate'.")
    if vl_combine not in ("all_reduce", "all_gather"):
        raise ValueError(f"vl_combine ({vl_combine!r}) must be 'all_reduce' or 'all_gather'.")
    if tp_mesh.ndim != 1:
        raise ValueError(f"tp_mesh must be 1-D (got {tp_mesh.ndim} dims); pass mesh['tp'].")
    tp = tp_mesh.size()
    validate_tensor_parallel(model.config, tp, vision_parallel=vision_parallel)
    vl_mesh = tp_mesh
    if vl_group is not None:
        if dist.get_process_group_ranks(vl_group) != tp_mesh.mesh.tolist():
            raise ValueError("vl_group must hold the same ranks, in the same order, as tp_mesh.")
        vl_mesh = DeviceMesh.from_group(vl_group, tp_mesh.device_type, mesh_dim_names=("vl",))
    if vision_parallel == "tp":
        parallelize_module(model.vision, tp_mesh, vision_plan(model.vision))
    vl_plan, tp_plan = adapter_plan(
        len(model.adapters), sequence_parallel=sequence_parallel, vl_combine=vl_combine
    )
    parallelize_module(model.adapters, vl_mesh, vl_plan)
    parallelize_module(model.adapters, tp_mesh, tp_plan)
    parallelize_module(
        model.language, tp_mesh, language_plan(model.language, sequence_parallel=sequence_parallel)
    )
    if sequence_parallel:
        model.language.embed_tokens.register_forward_pre_hook(_check_sequence(tp))
        text_in = PrepareModuleInput(
            input_layouts=(Shard(1), None),
            desired_input_layouts=(Replicate(), None),
            use_local_output=True,
        )
        parallelize_module(model.text_head, tp_mesh, text_in)
    return model


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """Unsharded state dict: ``model.state_dict()`` with every DTensor gathered (collective over
    its mesh). Equals the unsharded model's ``state_dict()`` at every TP size (the fused
    ``in_proj`` is sharded in its canonical layout); export with ``export_open_clip_visual`` /
    ``export_llama``.
    """
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach()
        for k, v in model.state_dict().items()
    }


def local_value(t: Tensor) -> Tensor:
    """``t.full_tensor()`` for a DTensor, else ``t`` (tests and logging; collective)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_gradients(model: nn.Module) -> dict[str, Tensor]:
    """Unsharded gradients by parameter name, shaped like the unsharded model's parameters
    (collective, like :func:`full_state_dict`); parameters without a gradient are left out."""
    grads: dict[str, Tensor] = {}
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        grad = local_value(param.grad)
        if isinstance(grad, DTensor):  # a Partial gradient's full_tensor() is already reduced
            grad = grad.full_tensor()
        grads[name] = grad
    return grads
