"""Rank the layouts of a recipe YAML on ``N`` devices by predicted step time:
``python -m lightning_mmpar.recipes.planner --config recipes/clip_llama_16gpu.yaml --gpus 16``.

Builds the YAML's model on the meta device (:func:`lightning_mmpar.recipes.partition.
build_module`), turns it into a ``ModelSpec`` (:func:`lightning_mmpar.plans.fusion_cost.
fusion_model_spec`), enumerates tp / pp / v / dp / ep / micro-batches / sequence parallelism /
FSDP or DDP / activation checkpointing at the YAML's global batch
(:func:`lightning_mmpar.layout.planner.candidate_layouts`), refuses the layouts the strategy
and the recipe's pre-launch check refuse (:func:`lightning_mmpar.layout.validate` with the
model's facts, :func:`layout_facts`: the same check, the same message), predicts the rest
(:func:`lightning_mmpar.layout.cost.predict`) and prints the
best, the rejected ones with their reasons, and the YAML fragment of the best
(``--write-yaml``). The workload is the YAML's (text length, ViT grid, one image per sample, or
the data module's ``images_per_sample``) unless ``--text-length``, ``--image-tokens`` or
``--images-per-sample`` say otherwise; ``--samples-per-row S`` prices packed data by the row
(each row carries its ``S`` samples' images, a step's samples fill ``S`` times fewer rows).
``--topo`` (``nvidia-smi topo -m`` text or a YAML description) places the ranks
(:func:`lightning_mmpar.layout.placement.place`) and prints the predicted communication time
of that order next to Megatron's. Invalid arguments exit with
status 2 and the reason.
"""

from __future__ import annotations

import argparse
import inspect
import math
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from lightning_mmpar.layout import LayoutFacts, ParallelLayout
from lightning_mmpar.layout.cost import DEVICES, GIB, DeviceSpec, Prediction, default_graph, predict
from lightning_mmpar.layout.planner import (
    Rejected,
    _predict,
    candidate_layouts,
    describe,
    plan,
    ranking_key,
    refusal,
)
from lightning_mmpar.parallel.activation import LAYERS
from lightning_mmpar.plans.fusion import fusion_facts
from lightning_mmpar.plans.fusion_cost import fusion_model_spec
from lightning_mmpar.recipes.hf_plan import with_checkpoint
from lightning_mmpar.recipes.module import ClipLlamaModule
from lightning_mmpar.recipes.partition import _strategy_args, build_module, data_args, load_recipe
from lightning_mmpar.recipes.preflight import packs, vision_ranks_refusal
from lightning_mmpar.recipes.yaml_layout import report, yaml_layout
from lightning_mmpar.strategy import MultimodalParallelStrategy

__all__ = [
    "accept_layout",
    "base_layout",
    "fragment",
    "layout_facts",
    "main",
    "spec_cache",
    "vision_counts",
]

_STRATEGY = "lightning_mmpar.strategy.MultimodalParallelStrategy"


def layout_facts(module: ClipLlamaModule, text_length: int) -> Callable[[Any], LayoutFacts]:
    """``layout -> LayoutFacts``: what the recipe's pre-launch check
    (:func:`lightning_mmpar.recipes.preflight.layout_and_facts`) checks a layout against, for
    a run of this layout: the model's facts at its tp (the vocabulary is padded per tp;
    :func:`~lightning_mmpar.plans.fusion.fusion_facts`), its pipeline blocks, the text length
    (``data.max_length``) and the layout's batch per dp rank (``data.batch_size``)."""
    blocks = fusion_facts(module.fusion_config, count_blocks=True).pipeline_blocks
    cache: dict[int, LayoutFacts] = {}

    def facts(layout: ParallelLayout) -> LayoutFacts:
        if layout.tp not in cache:
            cache[layout.tp] = replace(
                fusion_facts(module._resolved_config(layout.tp)),
                pipeline_blocks=blocks,
                sequence_length=text_length,
            )
        return replace(cache[layout.tp], batch_size=layout.local_batch)

    return facts


def accept_layout(module: ClipLlamaModule, text_length: int, tp_sizes: Sequence[int] = ()) -> Any:
    """A ``layout -> reason | None`` filter: :func:`~lightning_mmpar.layout.planner.refusal`
    with :func:`layout_facts` (what :func:`~lightning_mmpar.layout.planner.plan` runs given
    ``facts=layout_facts(...)``). ``tp_sizes`` is deprecated and unused: the message names the
    smaller tensor-parallel sizes that divide the field."""
    if tp_sizes:
        warnings.warn(
            "accept_layout(tp_sizes=...) is deprecated and unused.",
            DeprecationWarning,
            stacklevel=2,
        )
    facts = layout_facts(module, text_length)
    return lambda layout: refusal(layout, facts)


def spec_cache(module: ClipLlamaModule, text_length: int, images_per_sample: float = 1.0) -> Any:
    """``layout -> ModelSpec`` of ``module`` (:func:`fusion_model_spec` at
    ``images_per_sample``), one per distinct tp, ep, sequence parallelism and vision mode (what
    the spec depends on) and, below one image per sample, micro-batch size (a micro-batch
    without an image encodes one dummy: :func:`~lightning_mmpar.plans.fusion_cost.
    vision_images`)."""
    cache: dict[tuple[Any, ...], Any] = {}

    def spec(layout: ParallelLayout) -> Any:
        mbs = layout.micro_batch_size if images_per_sample < 1 else 0
        key = (layout.tp, layout.ep, layout.sequence_parallel, layout.vision_parallel, mbs)
        if key not in cache:
            cache[key] = fusion_model_spec(
                module, layout, text_length, images_per_sample=images_per_sample
            )
        return cache[key]

    return spec


def base_layout(config: dict[str, Any], module: ClipLlamaModule, precision: str) -> ParallelLayout:
    """The defaults every layout of the YAML is priced with: ``precision``, the YAML strategy's
    ``partition`` (a list becomes boundaries) and the model's ``plan.vision_parallel``; the
    YAML's own layout is this base with its degrees
    (:func:`~lightning_mmpar.recipes.yaml_layout.yaml_layout`)."""
    part = _strategy_args(config).get("partition", "equal")
    return ParallelLayout(
        precision=precision,
        partition=tuple(part) if isinstance(part, list) else part,
        vision_parallel=module.plan_options.vision_parallel,
    )


def fragment(
    layout: ParallelLayout,
    placement: Sequence[int] | None = None,
    nodes: int = 1,
    samples_per_row: float = 1.0,
    *,
    global_batch: int | None = None,
    packs: bool = False,
) -> dict[str, Any]:
    """The YAML the recipe accepts for ``layout``: ``trainer.strategy`` (class and every layout
    init arg, defaults included, so that merged over a recipe YAML none of the recipe's own
    values survive; ``micro_batches: null`` without a pipeline; ``activation_checkpointing:
    layers`` or null), ``trainer.devices`` and ``trainer.num_nodes`` (the layout's processes,
    vision ranks included, over ``nodes`` nodes: the recipe's own process count would launch
    another world; left out for a layout whose ``dp`` is not known yet),
    ``trainer.accumulate_grad_batches``, ``model.plan`` (sequence
    parallelism, vision mode) and ``data.batch_size`` (per data-parallel rank; for a layout
    priced in packed rows of ``samples_per_row`` samples, the samples of ``global_batch``,
    the YAML's samples per step, per dp rank and accumulated batch: :func:`_batch_samples`);
    with ``packs`` (the data packs several samples per row, so a batch's row count varies)
    also ``data.rows_multiple``, the rows every batch is padded to a multiple of: the
    layout's micro-batches under a pipeline, times ``tp`` under ``vision_parallel='dp'``
    (:func:`_rows_multiple`); ``placement``: the device order when it is not Megatron's (and
    the strategy takes one), else null.

    Raises:
        ValueError: ``nodes`` does not divide the layout's processes; ``global_batch`` not
            divisible by the layout's dp x accumulate.
    """
    processes = None if layout.dp is None else layout.world + layout.vision_ranks
    if processes is not None and (nodes < 1 or processes % nodes):
        raise ValueError(
            f"nodes ({nodes}) must divide the layout's {processes} processes "
            f"({describe(layout)}); plan on a multiple of the nodes, or give nodes=1."
        )
    part = layout.partition
    args: dict[str, Any] = {
        "tensor_parallel": layout.tp,
        "pipeline_parallel": layout.pp,
        "virtual_pipeline": layout.virtual,
        "expert_parallel": layout.ep,
        "micro_batches": layout.num_micro_batches if layout.pp > 1 else None,
        "schedule": layout.schedule,
        "data_parallel": layout.data_parallel,
        "partition": list(part) if isinstance(part, tuple) else part,
        "vision_ranks": layout.vision_ranks,
        "vision_data_parallel": layout.vision_data_parallel,
    }
    if "placement" in inspect.signature(MultimodalParallelStrategy.__init__).parameters:
        moved = placement is not None and tuple(placement) != tuple(range(len(placement)))
        args["placement"] = list(placement) if moved and placement is not None else None
    args["activation_checkpointing"] = LAYERS if layout.activation_checkpointing else None
    plan_options = {
        "sequence_parallel": layout.sequence_parallel,
        "vision_parallel": layout.vision_parallel,
    }
    trainer: dict[str, Any] = {}
    if processes is not None:  # a layout whose dp is not known yet leaves the recipe's own
        trainer = {"devices": processes // nodes, "num_nodes": nodes}
    return {
        "trainer": {
            **trainer,
            "strategy": {"class_path": _STRATEGY, "init_args": args},
            "accumulate_grad_batches": layout.accumulate,
        },
        "model": {"plan": plan_options},
        "data": _data_fragment(layout, samples_per_row, global_batch, packs),
    }


def _data_fragment(
    layout: ParallelLayout, samples_per_row: float, global_batch: int | None, packs: bool
) -> dict[str, Any]:
    """The fragment's ``data`` section (:func:`fragment`)."""
    data: dict[str, Any] = {"batch_size": _batch_samples(layout, samples_per_row, global_batch)}
    if packs or samples_per_row != 1:
        data["rows_multiple"] = _rows_multiple(layout)
    return data


def _rows_multiple(layout: ParallelLayout) -> int:
    """``data.rows_multiple`` for packed data under ``layout``: every batch's rows a multiple
    of what the strategy splits them into, the micro-batches under a pipeline (torch's
    pipeline stages take equal micro-batches), times ``tp`` under colocated
    ``vision_parallel='dp'`` (each micro-batch's images split over the tensor-parallel ranks:
    :func:`~lightning_mmpar.layout.value.check_vision_batch`); 1 otherwise. A packed batch's
    row count varies, so ``data.batch_size`` cannot guarantee it; the collator pads with empty
    rows (:class:`~lightning_mmpar.data.conversations.RowsCollator`)."""
    step = layout.num_micro_batches if layout.pp > 1 else 1
    if layout.vision_parallel == "dp" and layout.tp > 1 and not layout.vision_ranks:
        step *= layout.tp
    return step


def _batch_samples(
    layout: ParallelLayout, samples_per_row: float, global_batch: int | None = None
) -> int:
    """``data.batch_size`` (samples per dp rank and batch) of ``layout``: the layout's own
    batch at one sample per row; in packed rows, ``global_batch`` (samples per optimizer
    step) over dp x accumulate, so the step keeps its samples, else (no ``global_batch``) the
    samples of its rows, rounded.

    Raises:
        ValueError: ``global_batch`` not divisible by dp x accumulate.
    """
    if samples_per_row == 1:
        return layout.local_batch
    if global_batch is None:
        return max(1, round(layout.local_batch * samples_per_row))
    ranks = layout.dp_size * layout.accumulate
    if global_batch % ranks:
        raise ValueError(
            f"the global batch ({global_batch} samples) is not divisible by the layout's dp x "
            f"accumulate ({ranks}: {describe(layout)}); give --global-batch a multiple of {ranks}."
        )
    return global_batch // ranks


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merge(out[key], value) if both else value
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m lightning_mmpar.recipes.planner",
        description="Rank a recipe's layouts on N devices by predicted step time (memory per "
        "rank, communication, bubble, MFU); list the rejected ones with reasons.",
    )
    p.add_argument("--config", required=True, help="recipe YAML (the LightningCLI config)")
    p.add_argument("--gpus", type=int, required=True, help="devices of the job (world size)")
    p.add_argument(
        "--hf-config",
        help="a transformers checkpoint's config.json (or its directory): the model priced "
        "(model.pretrained.hf; no weights, tokenizer or data read)",
    )
    p.add_argument("--topo", help="nvidia-smi topo -m output or a topology YAML (placement)")
    p.add_argument("--memory-gib", type=float, help="memory per device (default: the device's)")
    p.add_argument("--device", default="h100", help=f"one of {', '.join(DEVICES)}")
    p.add_argument("--precision", help="default: the YAML's trainer.precision or 32-true")
    p.add_argument(
        "--global-batch",
        type=int,
        help="samples per optimizer step (default: data.batch_size x the YAML's dp)",
    )
    p.add_argument(
        "--text-length",
        type=int,
        help="text tokens per sample the layouts are priced on (default: the YAML's "
        "data.max_length, or a ragged YAML's data.max_tokens, a packed row's budget: an upper "
        "bound; give your data's mean length for a real run)",
    )
    p.add_argument(
        "--image-tokens",
        type=int,
        help="image tokens per image in the language model (a square number; default: the "
        "YAML's ViT, (image_size / patch_size / spatial_merge)^2; a Qwen-VL --hf-config: "
        "256); the ViT's image_size is set to match (dynamic resolution: your images' mean)",
    )
    p.add_argument(
        "--images-per-sample",
        type=float,
        help="images per sample, a mean (fractions allowed; 0: text only); default: the YAML's "
        "data module's images_per_sample when it has one (DigitsVQA: max_images / 2), else 1",
    )
    p.add_argument(
        "--samples-per-row",
        type=float,
        help="samples a packed row holds, a mean (>= 1; data.pack: true): each priced row "
        "carries their images (images per sample x this) and a step's samples fill this many "
        "times fewer rows; default: the YAML data module's samples_per_row when it has one, else 1",
    )
    _tower_arguments(p)
    p.add_argument("--max-tp", type=int, default=8, help="largest tensor-parallel size")
    p.add_argument("--top", type=int, default=10, help="layouts shown")
    p.add_argument("--write-yaml", help="write the best layout's YAML fragment here")
    return p


def _tower_arguments(p: argparse.ArgumentParser) -> None:
    """The non-colocated candidates' options (``vision_ranks``, ``vision_data_parallel``)."""
    p.add_argument(
        "--vision-ranks",
        type=int,
        help="only layouts with the vision tower on this many ranks of its own (0: colocated "
        "only); default: colocated and 1 .. gpus / 2 vision ranks (non-colocated)",
    )
    p.add_argument("--no-noncolocated", action="store_true", help="= --vision-ranks 0")
    p.add_argument(
        "--vision-fsdp",
        action="store_true",
        help="also rank non-colocated layouts with the vision tower sharded over 2 or more "
        "vision ranks (vision_data_parallel: fsdp) beside its full copies (ddp); enumerates "
        "2 vision ranks even where that is more than gpus / 2 (3 devices: 1 language + 2 vision)",
    )
    p.add_argument(
        "--tower-overlap",
        action="store_true",
        help="price non-colocated layouts at the bound max(vision side, language step) + transfer "
        "(the transfer exposed, no fill or drain); default: as run (serial at accumulate 1, "
        "else the vision rank one batch ahead inside each accumulation window)",
    )


def _global_batch(config: dict[str, Any], args: argparse.Namespace) -> int:
    if args.global_batch is not None:
        return int(args.global_batch)
    trainer, strategy = config.get("trainer") or {}, _strategy_args(config)
    world = int(trainer.get("devices", 1) or 1) * int(trainer.get("num_nodes", 1) or 1)
    dp = max(
        1,
        world
        // (int(strategy.get("tensor_parallel", 1)) * int(strategy.get("pipeline_parallel", 1))),
    )
    return int(data_args(config).get("batch_size", 1)) * dp


def _table(ranked: Sequence[Prediction], own: str | None = None) -> str:
    """The ranking, one row per layout; the YAML's own layout (``own``, its
    :func:`describe`) marked ``(the YAML's)``."""
    rows = [
        (
            "#",
            "layout (tp pp v dp ep mb acc dp-mode sp ckpt)",
            "mem/rank GiB",
            "comm GB/step",
            "bubble",
            "step s",
            "MFU",
        )
    ]
    for i, p in enumerate(ranked, 1):
        rows.append(
            (
                str(i),
                describe(p.layout) + (" (the YAML's)" if describe(p.layout) == own else ""),
                f"{p.memory.total / GIB:.2f}",
                f"{p.comm_total_bytes / 1e9:.3f}",
                f"{p.bubble:.3f}",
                f"{p.step_seconds:.4g}",
                f"{100 * p.mfu:.1f}%",
            )
        )
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return "\n".join(
        "  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def _rejected(rejected: Sequence[Rejected], shown: int) -> list[str]:
    """One line per distinct reason (the first ``shown``): an example layout (for memory, the
    one closest to fitting), the count."""
    groups: dict[str, list[Rejected]] = {}
    for r in rejected:
        groups.setdefault("memory" if r.prediction is not None else r.reason, []).append(r)
    lines = [f"rejected: {_plural(len(rejected), 'layout')}, {_plural(len(groups), 'reason')}"]
    for key, items in list(groups.items())[:shown]:
        least = min(items, key=lambda r: r.prediction.memory.total if r.prediction else 0)
        first = least if key == "memory" else items[0]
        more = f" (and {len(items) - 1} more)" if len(items) > 1 else ""
        lines.append(f"  {describe(first.layout)}{more}: {first.reason}")
    return lines


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _check_numbers(args: argparse.Namespace) -> None:
    for flag, value in (
        ("--gpus", args.gpus),
        ("--max-tp", args.max_tp),
        ("--top", args.top),
        ("--global-batch", args.global_batch),
        ("--text-length", args.text_length),
        ("--image-tokens", args.image_tokens),
    ):
        if value is not None and value < 1:
            raise ValueError(f"{flag} ({value}) must be >= 1.")
    images = args.images_per_sample
    if images is not None and not 0 <= images < float("inf"):  # nan too
        raise ValueError(
            f"--images-per-sample ({images}) must be a finite number >= 0 (a mean over the "
            "samples; 0: text only)."
        )
    rows = args.samples_per_row
    if rows is not None and not 1 <= rows < float("inf"):  # nan too
        raise ValueError(
            f"--samples-per-row ({rows}) must be a finite number >= 1 (the mean samples a "
            "packed row holds; 1: one sample per row)."
        )
    if args.memory_gib is not None and not 0 < args.memory_gib < float("inf"):  # nan too
        raise ValueError(f"--memory-gib ({args.memory_gib}) must be a finite number > 0.")
    if args.device not in DEVICES:
        raise ValueError(f"--device {args.device!r} is unknown; choose one of {list(DEVICES)}.")


@dataclass(frozen=True)
class _Planning:
    """What one planner run reads once: the YAML, its model, the device and the topology."""

    config: dict[str, Any]
    module: ClipLlamaModule
    device: DeviceSpec
    precision: str
    base: ParallelLayout
    model: Callable[[Any], Any]
    facts: Callable[[Any], LayoutFacts]
    graph: Any
    place: Any
    topo: str
    workload: str
    towers_refused: str | None
    """Why the data cannot feed non-colocated towers (:func:`~lightning_mmpar.recipes.preflight.
    vision_ranks_refusal`): no ``+ V vision`` candidate is ranked."""
    samples_per_row: float = 1.0
    """Samples one priced row holds (``--samples-per-row``): the layouts' batches are rows."""
    packs: bool = False
    """The data packs several samples per row (``data.pack: true``): a batch's rows vary, the
    fragment sets ``data.rows_multiple``."""


def _prepare(args: argparse.Namespace) -> _Planning:
    """Read ``--config`` and ``--topo``; build the model on the meta device."""
    _check_numbers(args)
    recipe = load_recipe(args.config)
    pretrained = (recipe.get("model") or {}).get("pretrained") or {}
    reads = bool(args.hf_config) or any(pretrained.values())  # a Qwen plan drops it: ask first
    config = with_checkpoint(recipe, args.hf_config)
    device = DEVICES[args.device]
    precision = args.precision or str((config.get("trainer") or {}).get("precision", "32-true"))
    device.peak(precision)
    config, image_note = _with_image_tokens(config, args.image_tokens)
    module, data = build_module(config)
    refused = vision_ranks_refusal(data, pretrained=reads)  # no + V vision candidate then
    if args.vision_ranks and refused is not None:  # as the recipe's preflight refuses it
        raise ValueError(vision_ranks_refusal(data, args.vision_ranks, pretrained=reads))
    text_length, text_note = _text_length(args, data)
    vision = module.fusion_config.vision
    merged = f", the ViT's {vision.grid**2} patches merged" if vision.spatial_merge > 1 else ""
    images, images_note = _images_per_sample(args, data)
    rows, rows_note = _samples_per_row(args, data, images)
    workload = (
        f"workload: {text_length} {text_note}, {vision.merged_patches} image tokens "
        f"per image ({image_note}{merged}), {images:g} image{'' if images == 1 else 's'} per "
        f"sample ({images_note}){rows_note}"
    )
    base = base_layout(config, module, precision)
    graph, place = None, None
    topo = f"{_graph_text(default_graph(args.gpus))} (assumed; pass --topo)"
    if args.topo:
        graph, place, topo = _topology(args.topo, args.gpus)
    model = spec_cache(module, text_length, images * rows)  # a priced unit is a row
    facts = layout_facts(module, text_length)
    return _Planning(
        config,
        module,
        device,
        precision,
        base,
        model,
        facts,
        graph,
        place,
        topo,
        workload,
        refused,
        rows,
        packs(data),
    )


def _text_length(args: argparse.Namespace, data: Any) -> tuple[int, str]:
    """Text tokens the layouts are priced on and what they are: ``--text-length``; a ragged
    data module's ``max_tokens`` (its ``max_length``: a packed row's budget, an upper bound of
    the work, since real samples are often far shorter); else the YAML's ``data.max_length``
    (a caption module: every sample padded to it)."""
    if args.text_length:
        return int(args.text_length), "text tokens per sample (--text-length)"
    collate = getattr(data, "collate_args", None)
    if isinstance(collate, dict) and "max_tokens" in collate:
        return int(data.max_length), (
            "tokens per row (the YAML's data.max_tokens: a packed row's budget, an upper bound "
            "of the work; pass --text-length for your samples' mean)"
        )
    return int(data.max_length), "text tokens per sample (the YAML's data.max_length)"


def _images_per_sample(args: argparse.Namespace, data: Any) -> tuple[float, str]:
    """Images per sample the layouts are priced on, and where the figure comes from:
    ``--images-per-sample``, else the data module's ``images_per_sample`` (a ragged module that
    knows its mean, e.g. :class:`~lightning_mmpar.data.DigitsVQA`), else 1 (a caption data
    module: one image per sample)."""
    if args.images_per_sample is not None:
        return float(args.images_per_sample), "--images-per-sample"
    known = getattr(data, "images_per_sample", None)
    if known is not None:
        return float(known), f"the YAML's {type(data).__name__}.images_per_sample"
    return 1.0, "the default"


def _samples_per_row(args: argparse.Namespace, data: Any, images: float) -> tuple[float, str]:
    """Samples one priced row holds, and the workload line's words for it with the row's
    images (``images`` per sample; empty for data that puts one sample per row):
    ``--samples-per-row``, else the data module's ``samples_per_row`` when it declares one,
    else 1 (a packing module does not know its rows' mean without reading the data: the line
    asks for it). Each priced row then carries ``S x images_per_sample``
    images (the vision work, its activations and the image stream scale with them) and a
    step's samples fill ``1 / S`` as many rows (:func:`_in_rows`).

    Raises:
        ValueError: ``--samples-per-row`` above 1 for data that does not pack.
    """
    given = args.samples_per_row
    if given is not None and given > 1 and not packs(data):
        raise ValueError(
            f"--samples-per-row ({given:g}) prices packed rows; the YAML's data "
            f"({type(data).__name__}) puts one sample per row: give data.pack: true or leave "
            "the option out."
        )
    known = getattr(data, "samples_per_row", None)
    if given is not None:
        rows, source = float(given), "--samples-per-row"
    elif known is not None:
        rows, source = float(known), f"the YAML's {type(data).__name__}.samples_per_row"
    elif packs(data):
        rows, source = 1.0, "the default; pass --samples-per-row, your rows' mean"
    else:
        return 1.0, ""
    _check_row_limits(rows, source, images, data, args.text_length)
    return rows, (
        f", {rows:g} sample{'' if rows == 1 else 's'} per packed row ({source}): "
        f"{images * rows:g} image{'' if images * rows == 1 else 's'} per row"
    )


def _check_row_limits(
    rows: float, source: str, images: float, data: Any, text_length: int | None
) -> None:
    """``rows`` samples (from ``source``) fit one packed row of ``data``: their ``images`` per
    sample in its ``max_images_per_row`` image slots, at least one token each (their
    ``text_length`` tokens each when given) in its ``max_tokens``.

    Raises:
        ValueError: a limit exceeded, naming the option, the value and the limit.
    """
    collate = getattr(data, "collate_args", None) or {}
    slots, budget = collate.get("max_images_per_row"), collate.get("max_tokens")
    where = f"{source} ({rows:g} samples per row)"
    if slots is not None and images * rows > slots:
        most = f"{slots / images:g}" if images else "any"
        raise ValueError(
            f"{where} at {images:g} images per sample puts {images * rows:g} images in a row; "
            f"the YAML's data.max_images_per_row is {slots}: give --samples-per-row <= {most}, "
            "or raise data.max_images_per_row."
        )
    tokens = text_length or 1
    if budget is not None and tokens * rows > budget:
        each = f"{tokens} tokens each (--text-length)" if text_length else "one token each"
        raise ValueError(
            f"{where} at {each} needs {tokens * rows:g} tokens; the YAML's data.max_tokens "
            f"is {budget}: give --samples-per-row <= {budget / tokens:g}, or raise "
            "data.max_tokens."
        )


def _with_image_tokens(config: dict[str, Any], tokens: int | None) -> tuple[dict[str, Any], str]:
    """``config`` with the ViT's (and the data's) ``image_size`` giving ``tokens`` patches, and
    where the count comes from. Raises ``ValueError`` when ``tokens`` is not a square."""
    if tokens is None:
        return config, "the YAML's ViT"
    side = math.isqrt(tokens)
    if side * side != tokens:
        raise ValueError(
            f"--image-tokens ({tokens}) must be a square number of patches (a ViT's grid), "
            f"e.g. {side * side} or {(side + 1) ** 2}."
        )
    model = dict(config.get("model") or {})
    fusion = dict(model.get("fusion") or {})
    vision = dict(fusion.get("vision") or {})
    size = side * int(vision.get("patch_size", 16)) * int(vision.get("spatial_merge", 1))
    vision["image_size"] = size
    fusion["vision"], model["fusion"] = vision, fusion
    data = dict(config.get("data") or {})
    target = data.setdefault("init_args", {}) if "class_path" in data else data
    if "image_size" in target or target is data:
        target["image_size"] = size
    return {**config, "model": model, "data": data}, f"--image-tokens: image_size {size}"


def _rank(args: argparse.Namespace, run: _Planning) -> tuple[list[Prediction], list[Rejected]]:
    """:func:`~lightning_mmpar.layout.planner.plan` over the YAML's global batch."""
    fusion = run.module.fusion_config
    moe = fusion.language.moe or fusion.adapter.moe
    enumerate_args: dict[str, Any] = {
        "global_batch": _global_batch(run.config, args),
        "max_tp": args.max_tp,
        "experts": moe.num_experts if moe is not None else 0,
        "base": run.base,
        "vision_ranks": vision_counts(
            args.gpus,
            args.vision_ranks,
            args.no_noncolocated or run.towers_refused is not None,
            fsdp=args.vision_fsdp,
        ),
        "vision_data_parallel": ("ddp", "fsdp") if args.vision_fsdp else ("ddp",),
    }
    candidates = None
    if run.samples_per_row != 1:  # dp and accumulation divide the samples, the rest is rows
        blocks = len(run.model(run.base).blocks)
        whole = candidate_layouts(
            args.gpus, blocks, micro_batch_counts=lambda pp, n: [1], **enumerate_args
        )
        candidates = [x for c in whole for x in _in_rows(c, run.samples_per_row)]
        enumerate_args = {}
    return plan(
        run.model,
        args.gpus,
        run.device,
        run.graph,
        args.memory_gib,
        candidates=candidates,
        facts=run.facts,
        placement=run.place,
        tower_overlap=args.tower_overlap,
        **enumerate_args,
    )


def _in_rows(layout: ParallelLayout, samples_per_row: float) -> list[ParallelLayout]:
    """``layout`` (a whole batch of ``local_batch`` samples per dp rank, one micro-batch) in
    packed rows of ``samples_per_row`` samples: its ``local_batch / samples_per_row`` rows
    (a mean) split into ``m`` micro-batches, ``m`` one without a pipeline, else ``pp``,
    ``2 pp``, ``4 pp`` and one row each (those up to the rows), each micro-batch's rows
    rounded up to a whole row (to a multiple of ``tp`` under colocated
    ``vision_parallel='dp'``): the empty rows ``data.rows_multiple`` pads a batch with are
    priced too."""
    rows = layout.local_batch / samples_per_row
    counts = [1]
    if layout.pp > 1:
        pp, most = layout.pp, max(layout.pp, math.ceil(rows))
        counts = sorted({m for m in (pp, 2 * pp, 4 * pp, most) if m <= most})
    return [_row_micro_batch(layout, rows, m) for m in counts]


def _row_micro_batch(layout: ParallelLayout, rows: float, micro_batches: int) -> ParallelLayout:
    """``layout`` with ``rows`` (a mean) per dp rank and batch in ``micro_batches``, each of
    the whole rows ``data.rows_multiple`` pads them to (:func:`_in_rows`)."""
    unit = _rows_multiple(replace(layout, pp=1))
    size = max(1, math.ceil(rows / micro_batches / unit)) * unit
    return replace(layout, micro_batches=micro_batches, micro_batch_size=size)


def vision_counts(
    gpus: int, forced: int | None = None, colocated: bool = False, fsdp: bool = False
) -> list[int]:
    """The ``vision_ranks`` the planner enumerates on ``gpus`` devices: ``[forced]`` when
    given, ``[0]`` with ``colocated``, else ``0`` (colocated) and ``1 .. gpus // 2`` (up to
    half the devices on the vision tower), with ``fsdp`` (``--vision-fsdp``) at least
    ``1 .. 2`` when ``gpus >= 3`` (FSDP2 of the tower needs two vision ranks: on 3 devices
    1 language + 2 vision ranks); the validation then refuses those whose vision ranks and
    language replicas do not divide one another.

    Raises:
        ValueError: ``forced`` outside ``0 .. gpus - 1``.
    """
    if forced is not None:
        if not 0 <= forced < gpus:
            raise ValueError(
                f"--vision-ranks ({forced}) must be in 0 .. {gpus - 1} (--gpus {gpus} leaves "
                "the language model at least one rank)."
            )
        return [forced]
    if colocated or gpus < 2:
        return [0]
    top = max(gpus // 2, min(2, gpus - 1)) if fsdp else gpus // 2
    return list(range(0, top + 1))


def main(argv: Sequence[str] | None = None) -> int:
    """Print the ranking; 0 on success, 1 when no layout fits. Invalid arguments (and an
    unreadable ``--config`` or ``--topo``): ``SystemExit(2)`` with the reason."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        run = _prepare(args)
        ranked, rejected = _rank(args, run)
    except (ValueError, OSError) as err:
        parser.error(str(err))
    limit = run.device.memory_gib if args.memory_gib is None else args.memory_gib
    own_lines, own = _own_layout(args, run, ranked)  # may join the ranking
    samples = _global_batch(run.config, args)
    rows = samples / run.samples_per_row
    in_rows = f" in {rows:.3g} packed rows" if run.samples_per_row != 1 else ""
    print(
        f"{args.config}: {len(run.model(run.base).blocks)} blocks, {args.gpus} x {args.device} "
        f"({run.precision}, {limit:g} GiB), {samples} samples per step{in_rows}, "
        f"{len(ranked)} layouts fit, best first:"
    )
    print(f"topology: {run.topo}")
    print(run.workload)
    if run.towers_refused is not None and args.vision_ranks is None and not args.no_noncolocated:
        print(f"no non-colocated layout (+ V vision): {run.towers_refused}")
    print(_table(ranked[: args.top], own) if ranked else "no layout fits")
    print("\n".join(own_lines))
    print("\n".join(_rejected(rejected, 8)))
    if not ranked:
        if args.write_yaml:
            print(f"--write-yaml {args.write_yaml}: not written (no layout fits).")
        return 1
    nodes = int((run.config.get("trainer") or {}).get("num_nodes", 1) or 1)
    nodes = nodes if args.gpus % nodes == 0 else 1  # the YAML's nodes, when they divide --gpus
    out = fragment(
        ranked[0].layout,
        _placement(args, run, ranked[0]),
        nodes,
        run.samples_per_row,
        global_batch=samples,
        packs=run.packs,
    )
    build_module(_merge(run.config, {"model": out["model"], "data": out["data"]}))  # it parses
    text = yaml.safe_dump(out, sort_keys=False)
    print(f"\nYAML fragment of the best layout:\n{text}", end="")
    if args.write_yaml:
        Path(args.write_yaml).write_text(text)
    return 0


def _own_layout(
    args: argparse.Namespace, run: _Planning, ranked: list[Prediction]
) -> tuple[list[str], str | None]:
    """Where the YAML's own layout ranks and why (:mod:`lightning_mmpar.recipes.yaml_layout`)
    and its :func:`describe` (``None``: not priced), at the candidates' global batch (samples
    per step: ``--global-batch``, else the YAML's ``data.batch_size`` x its dp; its micro-batch
    size scaled to it, in rows for packed data). One that the candidates miss (a micro-batch
    count or an accumulation they do not enumerate) and that runs and fits joins ``ranked``
    (``ranked`` is changed): the table holds every layout the planner prices."""
    own = yaml_layout(run.config, run.base, args.gpus)
    if not isinstance(own, str):
        samples, rows = _global_batch(run.config, args), run.samples_per_row
        ranks = own.dp_size * own.accumulate * (own.num_micro_batches if rows == 1 else 1)
        if samples % ranks:
            what = "dp x accumulation" + (" x micro-batches" if rows == 1 else "")
            return [
                f"the YAML's layout ({describe(own)}): not priced at the planner's {samples} "
                f"samples per step, which its {what} ({ranks}) on {args.gpus} devices does not "
                f"divide; give --global-batch a multiple of {ranks} to compare it"
            ], None
        per_rank = samples // (own.dp_size * own.accumulate)
        m = own.num_micro_batches
        own = (
            replace(own, micro_batch_size=per_rank // m)
            if rows == 1
            else _row_micro_batch(own, per_rank / rows, m)
        )

    def price(layout: ParallelLayout) -> Prediction:
        spec = run.model(layout)
        graph, overlap = run.graph, args.tower_overlap
        return _predict(spec, layout, run.device, graph, args.memory_gib, run.place, overlap)

    if isinstance(own, str):
        return report(own, ranked, price, run.facts, args.gpus), None
    name = describe(own)
    if refusal(own, run.facts, args.gpus) is None and all(
        describe(p.layout) != name for p in ranked
    ):
        try:
            mine: Prediction | None = price(own)
        except ValueError:
            mine = None
        if mine is not None and mine.fits:  # not enumerated: ranked with the candidates
            ranked.append(mine)
            ranked.sort(key=ranking_key)
    return report(own, ranked, price, run.facts, args.gpus), name


def _placement(args: argparse.Namespace, run: _Planning, best: Prediction) -> Any:
    """The best layout's device order (``None``: Megatron's), with a line comparing it."""
    if run.place is None:
        return None
    lay = best.layout
    megatron = predict(run.model(lay), lay, run.device, run.graph, None, memory_gib=args.memory_gib)
    if best.placement is None:  # the placed order was predicted slower for this layout
        print(
            f"placement: Megatron's order kept (comm {_seconds(megatron)}; placed predicted slower)"
        )
        return None
    order = tuple(best.placement.devices)
    print(f"placement {list(order)}: comm {_seconds(best)} vs Megatron order {_seconds(megatron)}")
    return order


def _seconds(p: Prediction) -> str:
    return ", ".join(f"{d} {s * 1e3:.2f} ms" for d, s in sorted(p.comm_seconds.items()))


def _graph_text(graph: Any) -> str:
    """``2 nodes x 8 GPUs, NVSWITCH / NET``: the link classes fastest first."""
    links = sorted(
        {
            graph.links[i][j]
            for i in range(graph.num_devices)
            for j in range(graph.num_devices)
            if i != j
        },
        key=lambda c: -graph.classes[c].bandwidth,
    )
    per = graph.num_devices // graph.nodes
    return (
        f"{_plural(graph.nodes, 'node')} x {_plural(per, 'GPU')}, "
        f"{' / '.join(links) or 'one device'}"
    )


def _topology(path: str, gpus: int) -> tuple[Any, Any, str]:
    """The graph of ``path`` (a one-node file repeated over nodes), a placement function
    (:func:`~lightning_mmpar.layout.placement.place`, default traffic weights) and the line
    describing the graph."""
    from lightning_mmpar.layout.devices import load_topology
    from lightning_mmpar.layout.placement import place

    graph = load_topology(path)
    n, nodes, note = graph.num_devices, graph.nodes, ""
    if n < gpus and gpus % n == 0 and nodes == 1:
        graph = graph.replicate(gpus // n)
        note = (
            f"\nnote: --topo {path} describes one node of {n} devices; the planner repeats "
            f"it over {gpus // n} nodes (joined by NET). The strategy's placement=<file> "
            f"needs the whole job's {gpus} devices: use the printed list."
        )
    if graph.num_devices != gpus:
        raise ValueError(
            f"--topo {path!r} describes {_plural(n, 'device')} in {_plural(nodes, 'node')}, "
            f"--gpus is {gpus}; give a one-node description (repeated over nodes) or a "
            f"description of all {gpus} devices."
        )
    cache: dict[tuple[int, ...], Any] = {}  # a placement depends on the degrees only

    def placement(lay: ParallelLayout) -> Any:
        key = (lay.pp, lay.dp_size, lay.ep, lay.tp)
        if key not in cache:
            cache[key] = place(graph, pp=lay.pp, dp=lay.dp_size, ep=lay.ep, tp=lay.tp)
        return cache[key]

    return graph, placement, f"{path}: {_graph_text(graph)}{note}"


if __name__ == "__main__":
    sys.exit(main())
