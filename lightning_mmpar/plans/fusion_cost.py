"""The fusion model as a :class:`~lightning_mmpar.layout.model.ModelSpec` (issue 12's cost model).

:func:`fusion_model_spec` reads a recipe module (``ClipLlamaModule``, built or not) and a
:class:`~lightning_mmpar.layout.ParallelLayout` and returns, without a process group and
without allocating a tensor (the model is rebuilt on the meta device, so a 70B config costs
nothing):

* every parameter (:class:`~lightning_mmpar.layout.model.ParamSpec`): global shape, pipeline
  block (``FusionModel.pipeline_blocks``, FSDP units too), trainable per the module's finetune
  policy, expert weights (the plan's MoE layers), and the dim tensor parallelism shards, read off
  the plan's styles (:func:`lightning_mmpar.plans.fusion.fusion_plan`): ``ColwiseParallel`` /
  ``FusedQKVColwiseParallel`` shard a Linear's weight and bias on dim 0 (an Embedding's on dim
  1), ``RowwiseParallel`` a Linear's weight on dim 1 (bias replicated) and an Embedding's on
  dim 0 (vocab parallel); every other style replicates;
* the tensors crossing each block boundary (per sample bytes and whether a gradient flows
  back): one meta forward of the blocks on a one-sample batch;
* the activation collectives of tensor parallelism per block, from Megatron's patterns as this
  plan applies them (module docstring of :mod:`lightning_mmpar.plans.fusion`; training mode,
  two text streams: fused ``h`` and text-only ``ht``; ``b`` samples, ``T`` text length, ``D``
  hidden size, ``N`` image tokens, ``V`` ViT tokens of width ``W``; 4-byte activations):

  ============  ==================================  ========================================
  block         forward                             backward (when the input needs a grad)
  ============  ==================================  ========================================
  ViT layer     2 all-reduce ``b V W``              2 all-reduce ``b V W``
  bridge        vocab embedding: 1 AR ``b T D``      -- (SP: 1 AG ``b T D``)
  adapter       combine + fc2: 2 AR ``b T D``         q, fc1: 2 AR ``b T D``; k, v: 2 AR
                                                    ``b N D``
  decoder       o, down per stream: 4 AR ``b T D``    q, k, v, gate, up per stream: 10 AR
                                                    ``b T D``; joint k, v on the image tokens:
                                                    2 AR ``b N D``
  head          vocab-parallel CE: AR ``b (T-1)``     lm_head input: 1 AR ``b T D``
                (max) + AR ``2 b (T-1)`` (sums),
                in the schedule's forward only
  ============  ==================================  ========================================

  ``vision_parallel``: the ViT rows above are ``tp``'s; ``replicate`` has no ViT collective;
  ``dp`` one all-gather of ``b V W`` after the last ViT block (forward only: its backward takes
  the local rows), the stem's and blocks' parameters ``sum_over_tp`` and the outputs of the
  stem and every ViT block but the last ``1 / tp`` of the images.

  An MoE FFN stays whole on every tp rank: an MoE adapter drops fc1 / fc2's all-reduces (1
  forward, 1 backward), an MoE decoder layer down / gate / up's (1 forward, 2 backward per
  stream); MoE layers refuse sequence parallelism.

  With sequence parallelism every text all-reduce of the forward becomes a reduce-scatter,
  each text layer's input an all-gather (adapter 2, decoder 2 per stream, the head 2: lm_head
  and the text pooler), backward mirrors them (the all-gathers' reduce-scatters except the
  pooler's, whose gradient is a row pick; each reduce-scatter's all-gather), and the image
  tokens' k/v gradients are reduced once per attention module (their ``PrepareModuleInput``).
  The fused and text-only streams cross pipeline stage boundaries sequence-sharded (``1 / tp``),
  and the norms and gates of the sharded stream (``SequenceParallel``) get ``Partial``
  gradients, as the joint-attention temperatures (:class:`HeadShardedReplicate`) do.

Activation bytes are 4 per element for ``32-true`` (checked exactly, tests/recipes), 2 for the
bf16 precisions and fp8 (activations stay bf16 between layers); ``bf16-true`` also halves the
parameters and the floating-point pipeline boundaries (not measured: CPU parity runs fp32).
The layout must be one the strategy accepts for this model (:func:`lightning_mmpar.layout.
validate` with :func:`~lightning_mmpar.plans.fusion.fusion_facts`), else ``ValueError``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_mmpar.layout import ParallelLayout, validate
from lightning_mmpar.layout.model import Boundary, Collective, LossSpec, ModelSpec
from lightning_mmpar.layout.model import ParamSpec as Param
from lightning_mmpar.layout.stages import measure_blocks
from lightning_mmpar.models.blocks import Streams
from lightning_mmpar.models.fusion import FusionModel
from lightning_mmpar.parallel.tensor import FusedQKVColwiseParallel, HeadShardedReplicate
from lightning_mmpar.plans.fusion import FusionPlanOptions, fusion_facts, fusion_plan

__all__ = ["fusion_model_spec", "vision_images"]

_VISION_DP = (
    "vision.conv1.",
    "vision.ln_pre.",
    "vision.transformer.resblocks.",
    "vision.class_embedding",
    "vision.positional_embedding",
)
"""Parameters ``vision_parallel="dp"`` marks ``PARTIAL_OVER_TP`` (the stem and the ViT blocks:
``lightning_mmpar.plans.fusion_vision.apply_vision_data_parallel``)."""

_IMAGE_STREAM = (Streams._fields.index("img"), Streams._fields.index("pooled"))
"""Outputs of the bridge, adapter and decoder blocks that carry the image stream (the head's
outputs are never sent)."""


def _meta_model(module: Any, layout: ParallelLayout) -> FusionModel:
    with torch.device("meta"):
        model = FusionModel(
            module._resolved_config(layout.tp), momentum=module.loss_config.mml.momentum
        )
    module._freeze(model)
    return model


def _tp_dims(model: FusionModel, options: FusionPlanOptions) -> dict[int, int]:
    """``id(parameter) -> sharded dim`` for every parameter the plan shards over tp / vl
    (``-1``: a vocab-parallel embedding, dim 0, whose gradient comes back whole; ``-2``: a
    :class:`HeadShardedReplicate` or ``SequenceParallel`` parameter, replicated, its gradient
    ``Partial``)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    out: dict[int, int] = {}
    for group in fusion_plan(model, options).tensor_parallel:
        styles = group.styles if isinstance(group.styles, dict) else {"": group.styles}
        for rel, style in styles.items():
            path = ".".join(x for x in (group.path, rel) if x)
            mod = model.get_submodule(path)
            embed = isinstance(mod, nn.Embedding) or "Embedding" in type(mod).__name__
            for name, p in mod.named_parameters(recurse=False):
                if isinstance(style, HeadShardedReplicate | SequenceParallel):
                    out[id(p)] = -2  # applied to head / sequence shards: Partial gradient
                elif isinstance(style, FusedQKVColwiseParallel):  # [3, D, D] / [3, D]: heads
                    out[id(p)] = 1
                elif isinstance(style, ColwiseParallel):
                    out[id(p)] = 1 if embed else 0
                elif isinstance(style, RowwiseParallel) and (embed or name == "weight"):
                    out[id(p)] = -1 if embed else 1
    return out


def _boundaries(
    model: FusionModel, text_length: int, prompts: Any, images: float = 1.0
) -> list[tuple[Boundary, ...]]:
    """One meta forward of a one-sample batch; MoE FFNs swapped for dense ones (routing reads
    values, which meta tensors lack; block outputs keep their shapes). The image stream (every
    floating-point output of a vision block, ``Streams.img`` and ``Streams.pooled`` after it)
    is scaled by ``images`` per sample (:func:`fusion_model_spec`)."""
    config = model.config
    if config.adapter.moe is not None or config.language.moe is not None:
        language = type(config.language)(**{**vars(config.language), "moe": None})
        adapter = type(config.adapter)(**{**vars(config.adapter), "moe": None})
        config = type(config)(**{**vars(config), "language": language, "adapter": adapter})
        with torch.device("meta"):
            model = FusionModel(config)
    cfg = config.vision
    with torch.device("meta"):
        images_in = torch.empty(1, 3, cfg.image_size, cfg.image_size)
        ids = torch.zeros(1, text_length, dtype=torch.long)
        p_ids = None if prompts is None else torch.zeros(*prompts, dtype=torch.long)
        state = FusionModel.pipeline_inputs(images_in, ids, None, p_ids, None)
        out = []
        for block in model.pipeline_blocks():
            block.training = True
            state = block(*state)
            floats = [i for i, t in enumerate(state) if t.is_floating_point()]
            kind = block.kind
            image = floats if kind == "vision" else () if kind == "head" else _IMAGE_STREAM
            out.append(
                tuple(
                    Boundary(
                        round(t.numel() * t.element_size() * (images if i in image else 1.0)),
                        t.is_floating_point(),
                    )
                    for i, t in enumerate(state)
                )
            )
    return out


def _local_rows(
    found: list[tuple[Boundary, ...]], names: list[str], layout: ParallelLayout
) -> list[tuple[Boundary, ...]]:
    """Block outputs a tp rank holds ``1 / tp`` of: under ``vision_parallel="dp"`` every
    output of the stem and of the ViT blocks but the last (its images; the gather follows the
    last block); under sequence parallelism the fused and text-only streams (``Streams.h``,
    ``ht``: positions 2, 3) after the bridge, adapters and decoder layers. ``bf16-true``
    halves every floating-point output first."""
    tp = layout.tp
    if layout.precision == "bf16-true":  # every floating-point activation in bf16
        found = [
            tuple(
                Boundary(
                    x.bytes_per_sample // 2 if x.requires_grad else x.bytes_per_sample,
                    x.requires_grad,
                )
                for x in block
            )
            for block in found
        ]
    if tp == 1:
        return found
    vit = [i for i, n in enumerate(names) if n.startswith("vision.layer")]
    text = ("bridge", "adapter", "decoder")
    out = []
    for i, block in enumerate(found):
        if layout.vision_parallel == "dp" and names[i].startswith("vision.") and i < max(vit):
            block = tuple(Boundary(x.bytes_per_sample // tp, x.requires_grad) for x in block)
        elif layout.sequence_parallel and names[i].startswith(text):
            block = tuple(
                Boundary(x.bytes_per_sample // tp, x.requires_grad) if j in (2, 3) else x
                for j, x in enumerate(block)
            )
        out.append(block)
    return out


def _ep_collectives(
    model: FusionModel,
    layout: ParallelLayout,
    names: list[str],
    text_length: int,
    images: float = 1.0,
) -> list[tuple[Collective, ...]]:
    """Per MoE layer call (``ep > 1``): the per-expert counts (``8 E`` bytes, equal splits) and
    the token dispatch and return (``all_to_all_v``, two calls), forward and backward. A layer
    routes ``N`` tokens per sample (an adapter the fused stream: ``T``; a decoder layer both text
    streams in one call: ``2 T``, plus the ``images`` x image tokens under joint attention with
    a ``vision`` router: ``models.language.moe_streams``), each to ``k`` experts: a rank sends
    ``S <= N k`` rows (padding is not routed) and receives ``R`` (what its peers route to its
    experts, ``<= ep N k``); each direction moves ``S + R`` rows of ``D`` values, the dispatch's
    input ``S`` and the return's ``R``. Expected (uniform routing, no padding): ``R = S = N k``;
    bounds ``[0, N k]`` and ``[0, ep N k]`` rows per phase (``[0, (1 + ep) N k]`` in all)."""
    out: list[tuple[Collective, ...]] = [() for _ in names]
    if layout.ep == 1:
        return out
    e, d = 4 if layout.precision == "32-true" else 2, model.config.language.hidden_size
    cfg = model.config
    layers = {f"adapter{i}": cfg.adapter.moe for i, a in enumerate(model.adapters) if a.moe}
    layers |= {
        f"decoder{i}": cfg.language.moe for i, x in enumerate(model.language.layers) if x.moe
    }
    for i, name in enumerate(names):
        moe = layers.get(name)
        if moe is None:
            continue
        tokens = text_length * (2 if name.startswith("decoder") else 1)
        layer = model.language.layers[int(name[7:])] if name.startswith("decoder") else None
        if layer is not None and layer.image_norm is not None and "vision" in moe.modalities:
            tokens += round(images * cfg.vision.merged_patches)
        n = tokens * moe.top_k
        row = d * e
        found = [Collective("ep", "all_to_all", 0, "forward", bytes_per_call=8 * moe.num_experts)]
        for phase in ("forward", "backward"):  # two calls each: the dispatch (its input: the
            # S <= N k rows this rank routes) and the return (the R <= ep N k rows it got)
            found.append(Collective("ep", "all_to_all_v", n * row, phase, upper_per_sample=n * row))
            found.append(
                Collective(
                    "ep", "all_to_all_v", n * row, phase, upper_per_sample=layout.ep * n * row
                )
            )
        out[i] = tuple(found)
    return out


def _row_bytes(
    model: FusionModel, layout: ParallelLayout, text_length: int, images: tuple[float, float]
) -> tuple[int, int, int]:
    """Bytes per sample of the tensor-parallel collectives' rows: the ViT's ``V W`` (times the
    images it encodes, ``images[0]``), the text's ``T D`` and the image tokens' ``N D`` (times
    ``images[1]``); 4 bytes per element in ``32-true``, else 2."""
    cfg = model.config
    e = 4 if layout.precision == "32-true" else 2
    d = cfg.language.hidden_size
    n_img = cfg.vision.merged_patches  # the ViT's patches after its spatial merge
    vit = round((cfg.vision.grid**2 + 1) * cfg.vision.width * e * images[0])
    return vit, text_length * d * e, round(n_img * d * e * images[1])


def _tp_collectives(
    model: FusionModel,
    layout: ParallelLayout,
    names: list[str],
    text_length: int,
    grads: list[bool],
    images: tuple[float, float] = (1.0, 1.0),
) -> list[tuple[Collective, ...]]:
    """Per block: tensor parallelism's activation collectives (module docstring's table);
    ``grads[i]``: block ``i`` or one before it trains (its backward runs); ``images``: the
    images per sample the ViT encodes and the image tokens' multiple (:func:`fusion_model_spec`:
    the ViT rows scale with the first, the ``b N D`` rows with the second)."""
    if layout.tp == 1:
        return [() for _ in names]
    vit, text, img = _row_bytes(model, layout, text_length, images)
    t, sp = text_length, layout.sequence_parallel
    joint = [getattr(x.self_attn, "temperature", None) is not None for x in model.language.layers]
    last_vit = f"vision.layer{len(model.vision.transformer.resblocks) - 1}"
    ar, ag, rs = "all_reduce", "all_gather", "reduce_scatter"

    def c(kind: str, size: int, n: int, phase: str = "forward") -> list[Collective]:
        return [Collective("tp", kind, size, phase)] * n

    out: list[tuple[Collective, ...]] = []
    layer = 0
    for i, name in enumerate(names):
        back = "backward" if grads[i] else None
        found: list[Collective] = []
        if name.startswith("vision.layer") and layout.vision_parallel == "tp":
            found = c(ar, vit, 2) + (c(ar, vit, 2, "backward") if back else [])
        elif name == last_vit and layout.vision_parallel == "dp":  # the images' gather
            found = c(ag, vit, 1)
        elif name == "bridge":  # vocab-parallel embedding (SP: its backward gathers)
            found = (
                c(rs, text, 1) + (c(ag, text, 1, back) if back else []) if sp else c(ar, text, 1)
            )
        elif name.startswith("adapter"):  # MoE FFN: whole on every tp rank (no SP with MoE)
            ffn = 0 if model.adapters[int(name[7:])].moe else 1
            found = c(rs, text, 2) + c(ag, text, 2) if sp else c(ar, text, 1 + ffn)
            if back:
                found += (
                    c(ag, text, 2, back) + c(rs, text, 2, back) + c(ar, img, 1, back)
                    if sp
                    else c(ar, text, 1 + ffn, back) + c(ar, img, 2, back)
                )
        elif name.startswith("decoder"):
            streams, j = 2, joint[layer]
            ffn = 0 if model.language.layers[layer].moe else 1
            layer += 1
            found = (
                c(rs, text, 2 * streams) + c(ag, text, 2 * streams)
                if sp
                else c(ar, text, (1 + ffn) * streams)
            )
            if back:
                found += (
                    c(ag, text, 2 * streams, back) + c(rs, text, 2 * streams, back)
                    if sp
                    else c(ar, text, (3 + 2 * ffn) * streams, back)
                )
                found += c(ar, img, (1 if sp else 2) * j, back)
        elif name == "head":
            rows = (t - 1) * 4
            found = c(ar, rows, 1, "loss") + c(ar, 2 * rows, 1, "loss")
            found += c(ag, text, 2) if sp else []
            if back:
                found += c(rs, text, 1, back) if sp else c(ar, text, 1, back)
        out.append(tuple(found))
    return out


def _loss_spec(module: Any, contrastive_dim: int, text_length: int) -> LossSpec:
    """The recipe loss's collectives: InfoNCE and MML gather features over dp unless both
    weights are 0 (``RecipeLoss.coupled`` then computes neither)."""
    weights = module.loss_config.contrastive_weight, module.loss_config.mml.weight
    coupled = 3 if any(weights) else 0
    return LossSpec(
        feature_bytes=contrastive_dim * 4,
        caption_positions=text_length - 1,
        gathers=coupled,
        gathers_with_grad=2 * coupled // 3,
    )


def vision_images(images_per_sample: float, micro_batch_size: int) -> float:
    """Images the vision tower encodes per sample: ``K`` (``images_per_sample``), or, for a
    micro-batch of ``b`` samples without any image, one: the tower then runs on a zero dummy
    image (:func:`lightning_mmpar.models.ragged.occupied`, so that its collectives fire on every
    rank), ``1 / b`` per sample. ``max(K, 1 / b)``: exact at ``K = 0`` and whenever every
    micro-batch holds an image; a fractional ``K`` whose micro-batches are sometimes empty
    costs a little more than this."""
    return max(float(images_per_sample), 1.0 / max(1, micro_batch_size))


def _params(
    model: FusionModel, blocks: list[Any], layout: ParallelLayout, options: FusionPlanOptions
) -> tuple[list[Param], list[bool]]:
    """Every parameter once (:class:`ParamSpec`) and, per block, whether it or a block before
    it trains (its backward runs)."""
    tp_dims = _tp_dims(model, options) if layout.tp > 1 else {}
    experts = tuple(f"{p}.experts" for p in fusion_plan(model, options).expert_parallel)
    model_names = {id(p): n for n, p in model.named_parameters()}  # the plan's paths
    vision_dp = layout.vision_parallel == "dp" and layout.tp > 1
    size = 2 if layout.precision == "bf16-true" else 0  # bf16-true: parameters cast to bf16
    seen: set[int] = set()
    params, trainable_before, upstream = [], [], False
    for b, block in enumerate(blocks):
        for name, p in block.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            full = model_names.get(id(p), "")
            expert = layout.ep > 1 and any(full.startswith(x + ".") for x in experts)
            dim = tp_dims.get(id(p))
            params.append(
                Param(
                    f"blocks.{b}.{name}",
                    tuple(p.shape),
                    b,
                    None if dim in (None, -2) else max(dim, 0),
                    p.requires_grad,
                    expert,
                    size or p.element_size(),
                    full_grad=dim == -1,
                    partial_grad=dim == -2,
                    sum_over_tp=vision_dp and full.startswith(_VISION_DP),
                )
            )
        upstream = upstream or any(p.requires_grad for p in block.parameters())
        trainable_before.append(upstream)
    return params, trainable_before


def fusion_model_spec(
    module: Any,
    layout: ParallelLayout,
    text_length: int,
    prompts: tuple[int, int] | None = None,
    images_per_sample: float = 1.0,
) -> ModelSpec:
    """The :class:`ModelSpec` of ``module`` (a ``ClipLlamaModule``, built or not: its configs
    are read and the model rebuilt on the meta device) under ``layout``.

    ``text_length``: caption tokens per sample (the data's ``max_length``). ``prompts``: the
    class prompts' ``(K, T_p)`` the data module hands the model (None: none, the first caption
    stands in, ``K = 1``).

    ``images_per_sample`` (``K``, a mean: fractions allowed; 0: text only) prices ragged
    batches (:class:`~lightning_mmpar.data.MultimodalCollator`) as the model runs them: the
    vision blocks' FLOPs and kept activations, and the ViT rows of the tensor-parallel
    collectives, scale with the images the tower encodes per sample, :func:`vision_images`
    (``K``; a micro-batch with no image still encodes one zero dummy, so ``K = 0`` costs one
    image per micro-batch); the image tokens' work in the bridge, adapters and decoder (joint
    attention), their ``b N D`` collectives, the MoE routing of image tokens and the image
    stream crossing pipeline boundaries scale with ``K`` (0 at ``K = 0``: a batch without
    images has no image slot). Priced at the mean: a batch pads its rows to its most images
    (``max_images_per_row``: a fixed slot count), whose empty slots cross the boundaries as
    zeros and are not counted.

    Raises:
        ValueError: ``text_length`` < 2, ``images_per_sample`` negative or not finite, or a
            layout the strategy refuses for this model
            (:func:`lightning_mmpar.layout.validate` with
            :func:`~lightning_mmpar.plans.fusion.fusion_facts`: sizes not divisible by ``tp``,
            ``ep`` without MoE layers or not dividing the experts, sequence parallelism with
            MoE).
    """
    if not isinstance(text_length, int) or text_length < 2:
        raise ValueError(f"text_length ({text_length!r}) must be an int >= 2 (caption tokens).")
    if not 0.0 <= images_per_sample < float("inf"):
        raise ValueError(
            f"images_per_sample ({images_per_sample!r}) must be a finite number >= 0 (0: text "
            "only)."
        )
    model = _meta_model(module, layout)
    validate(layout, fusion_facts(model.config))  # the strategy's own check
    blocks = model.pipeline_blocks()
    vl, de = len(model.vision.transformer.resblocks), len(model.language.layers)
    names = ["vision.stem", *(f"vision.layer{i}" for i in range(vl)), "vision.pool", "bridge"]
    names += [*(f"adapter{i}" for i in range(len(model.adapters)))]
    names += [*(f"decoder{i}" for i in range(de)), "head"]
    v, k = model.config.vision, float(images_per_sample)
    images = (vision_images(k, layout.micro_batch_size), k)
    specs = measure_blocks(
        blocks,
        v.merged_patches,
        text_length,
        names,
        images_per_sample=k,
        vision_images=images[0],
        vision_tokens=v.grid**2,
    )
    options = FusionPlanOptions(
        sequence_parallel=layout.sequence_parallel,
        vision_parallel=layout.vision_parallel,  # type: ignore[arg-type]
        vl_combine=module.plan_options.vl_combine,
    )
    params, trainable_before = _params(model, blocks, layout, options)
    loss = _loss_spec(module, model.config.contrastive_dim, text_length)
    boundaries = _local_rows(_boundaries(model, text_length, prompts, k), names, layout)
    tp = _tp_collectives(model, layout, names, text_length, trainable_before, images)
    ep = _ep_collectives(model, layout, names, text_length, k)
    return ModelSpec(
        blocks=tuple(specs),
        params=tuple(params),
        boundaries=tuple(boundaries),
        collectives=tuple(a + b for a, b in zip(tp, ep, strict=True)),
        loss=loss,
        extra={
            "text_length": text_length,
            "images_per_sample": k,
            "pixel_bytes_per_sample": round(3 * v.image_size**2 * 4 * k),  # fp32 pixels
        },
    )
