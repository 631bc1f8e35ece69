"""Megatron-LM's launch flags on the recipe CLI, mapped onto the strategy, Trainer, data and model.

``torchrun --nproc_per_node 4 -m lightning_mmpar.recipes.clip_llama fit --config
recipes/clip_llama_cpu.yaml --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2``
runs as ``trainer.strategy.init_args.tensor_parallel=2 pipeline_parallel=2``; the mapping is
printed once (rank 0), one line per flag. The flags mean what they mean in Megatron-LM
(``megatron/training/arguments.py``):

* ``--tensor-model-parallel-size``, ``--pipeline-model-parallel-size``,
  ``--expert-model-parallel-size`` -> ``tensor_parallel``, ``pipeline_parallel``,
  ``expert_parallel``; ``--sequence-parallel`` -> ``model.plan.sequence_parallel``.
* ``--num-layers-per-virtual-pipeline-stage N`` -> ``virtual_pipeline = L / (pp * N)`` with
  ``L`` the decoder's layers (``model.fusion.language.num_hidden_layers``, or the pretrained
  decoder's ``config.json``), Megatron's ``virtual_pipeline_model_parallel_size``; a schedule
  that cannot run those stages becomes ``interleaved_1f1b`` (Megatron's interleaved 1F1B).
  ``L`` not divisible by ``pp``, or ``L / pp`` by ``N``, is refused.
* ``--micro-batch-size m`` is the samples of one micro-batch on one data-parallel rank and
  ``--global-batch-size g = m * dp * n`` with ``n`` micro-batches per optimizer step (``dp =
  world / (tp * pp)``): under pipeline parallelism ``n`` is the pipeline's micro-batches
  (``data.batch_size = m * n``, ``micro_batches = n``, no Trainer accumulation); without it, ``n``
  batches of ``m`` are accumulated (``data.batch_size = m``, ``accumulate_grad_batches = n``).
  One of the two alone keeps the configured ``n``. A ``g`` not divisible by ``m * dp`` is refused.
* ``--pipeline-model-parallel-size 1`` also resets ``micro_batches``, ``virtual_pipeline`` and
  ``schedule`` (nothing to act on without a pipeline).

The flags are applied after the YAML, before the classes are built (the saved ``config.yaml``
shows the result); a DeepSpeed JSON applied next must agree with them
(:func:`~lightning_mmpar.recipes.deepspeed_cli.apply_deepspeed_json`'s ``fixed``). A refusal is
a ``ValueError`` naming the flag, the value and the fix (the CLI: one line, exit status 2).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_mmpar.layout import ParallelLayout
from lightning_mmpar.layout.schedules import MULTI_STAGE_SCHEDULES, V_SCHEDULES
from lightning_mmpar.recipes.strategy_args import mm_parallel_args, strategy_layout, world_size

__all__ = [
    "FLAGS",
    "FlagMapping",
    "MegatronFlags",
    "add_megatron_flags",
    "apply_megatron_flags",
    "map_megatron_flags",
]


@dataclass(frozen=True, kw_only=True)
class MegatronFlags:
    """The Megatron-LM flags the recipe CLI accepts (``None`` / ``False``: not given)."""

    tensor_model_parallel_size: int | None = None
    pipeline_model_parallel_size: int | None = None
    num_layers_per_virtual_pipeline_stage: int | None = None
    expert_model_parallel_size: int | None = None
    sequence_parallel: bool = False
    micro_batch_size: int | None = None
    global_batch_size: int | None = None

    @classmethod
    def from_config(cls, cfg: Any) -> MegatronFlags:
        """The flags in a parsed config (the CLI stores them under their Python names)."""
        given: dict[str, Any] = {f.name: cfg.get(f.name) for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in given.items() if v is not None})

    @property
    def given(self) -> bool:
        """Whether any flag is set."""
        return any(getattr(self, f.name) for f in dataclasses.fields(self))


FLAGS: dict[str, tuple[str, str]] = {
    "tensor_model_parallel_size": ("tensor_parallel", "tensor-parallel degree"),
    "pipeline_model_parallel_size": ("pipeline_parallel", "pipeline-parallel degree"),
    "num_layers_per_virtual_pipeline_stage": (
        "virtual_pipeline",
        "decoder layers per virtual pipeline stage: virtual_pipeline = num_hidden_layers / "
        "(pp * this), interleaved 1F1B",
    ),
    "expert_model_parallel_size": ("expert_parallel", "expert-parallel degree"),
    "sequence_parallel": ("sequence_parallel", "shard the text stream along the sequence"),
    "micro_batch_size": ("batch_size", "samples per micro-batch and data-parallel rank"),
    "global_batch_size": (
        "batch_size",
        "samples per optimizer step = micro-batch size * dp * micro-batches (pipeline "
        "micro-batches, or accumulated batches without pipeline parallelism)",
    ),
}
"""Python name -> (the option it sets, the ``--help`` text)."""


NO_PIPELINE: dict[str, Any] = {"micro_batches": None, "virtual_pipeline": 1, "schedule": "1f1b"}
"""The pipeline options ``--pipeline-model-parallel-size 1`` resets (they cannot act without a
pipeline; Megatron-LM's micro-batches are then accumulated batches)."""


def flag(name: str) -> str:
    """``--tensor-model-parallel-size`` for ``tensor_model_parallel_size``."""
    return "--" + name.replace("_", "-")


def add_megatron_flags(parser: Any) -> None:
    """Add the flags of :data:`FLAGS` to a (jsonargparse) parser, in their own help group."""
    group = parser.add_argument_group(
        "Megatron-LM flags (mapped onto the options; docs/recipe_config.md)"
    )
    for name, (option, text) in FLAGS.items():
        if name == "sequence_parallel":
            group.add_argument(flag(name), action="store_true", help=f"-> model.plan.{option}")
            continue
        group.add_argument(flag(name), type=int | None, default=None, help=f"{text} -> {option}")


@dataclass(frozen=True)
class FlagMapping:
    """What one flag (or the two batch flags together) sets."""

    flag: str
    """The flag as given, e.g. ``--tensor-model-parallel-size 2``."""
    values: dict[str, Any]
    """Option -> value: strategy arguments (``tensor_parallel``, ``virtual_pipeline``,
    ``schedule``, ``micro_batches``...), ``batch_size`` (``data``), ``accumulate_grad_batches``
    (``trainer``), ``sequence_parallel`` (``model.plan``)."""
    how: str = ""
    """How the values were derived (empty for a plain copy)."""


def _positive(flags: MegatronFlags, name: str) -> int | None:
    value = getattr(flags, name)
    if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"{flag(name)} ({value!r}) must be a positive integer.")
    return value


def _virtual(n: int, layout: dict[str, Any], num_layers: int | None) -> FlagMapping:
    """``--num-layers-per-virtual-pipeline-stage n`` -> ``virtual_pipeline`` (and schedule)."""
    text, pp = f"{flag('num_layers_per_virtual_pipeline_stage')} {n}", layout["pipeline_parallel"]
    if pp == 1:
        raise ValueError(
            f"{text} needs pipeline parallelism (pipeline_parallel is 1): virtual stages "
            "interleave a pipeline; set --pipeline-model-parallel-size >= 2 or drop the flag."
        )
    if not num_layers:
        raise ValueError(f"{text}: the decoder's layer count is unknown; set the model's sizes.")
    if num_layers % pp or (num_layers // pp) % n:
        per = num_layers / pp
        fits = [d for d in range(1, num_layers // pp + 1) if (num_layers // pp) % d == 0]
        fix = f"use a divisor of {num_layers // pp}: {fits}" if num_layers % pp == 0 else ""
        raise ValueError(
            f"{text}: the decoder's {num_layers} layers (model.fusion.language."
            f"num_hidden_layers) over pipeline_parallel {pp} give {per:g} layers per pipeline "
            f"rank, not a multiple of {n} (Megatron-LM requires both to divide); "
            f"{fix or 'use a pipeline size that divides the layers'}."
        )
    v, schedule = num_layers // pp // n, layout.get("schedule", "1f1b")
    values: dict[str, Any] = {"virtual_pipeline": v}
    if v > 1 and (schedule not in MULTI_STAGE_SCHEDULES or (schedule in V_SCHEDULES and v != 2)):
        values["schedule"] = "interleaved_1f1b"
    elif v == 1 and schedule in MULTI_STAGE_SCHEDULES:
        values["schedule"] = "1f1b"
    return FlagMapping(text, values, f"{num_layers} decoder layers / (pp {pp} x {n})")


def _micro_batches(layout: dict[str, Any], accumulation: int) -> int:
    """Micro-batches per optimizer step now: the pipeline's, else the Trainer's accumulation."""
    if layout["pipeline_parallel"] == 1:
        return accumulation
    return ParallelLayout(
        pp=layout["pipeline_parallel"],
        virtual=layout.get("virtual_pipeline", 1),
        micro_batches=layout.get("micro_batches"),
        schedule=layout.get("schedule", "1f1b"),
    ).num_micro_batches


def _batch(
    flags: MegatronFlags, layout: dict[str, Any], world_size: int | None, accumulation: int
) -> FlagMapping | None:
    """``--micro-batch-size`` / ``--global-batch-size`` -> batch size and micro-batches."""
    m, g = _positive(flags, "micro_batch_size"), _positive(flags, "global_batch_size")
    if m is None and g is None:
        return None
    text = " ".join(
        f"{flag(k)} {v}" for k, v in (("micro_batch_size", m), ("global_batch_size", g)) if v
    )
    model = layout["tensor_parallel"] * layout["pipeline_parallel"]
    n, pipeline = _micro_batches(layout, accumulation), layout["pipeline_parallel"] > 1
    dp = world_size // model if world_size and world_size % model == 0 else None
    if g is not None:
        if dp is None:
            raise ValueError(
                f"{text}: the data-parallel size is unknown (world size {world_size}, tp x pp "
                f"{model}); set trainer.devices (and num_nodes) to a multiple of {model}."
            )
        if m is None:
            if g % (n * dp):
                raise ValueError(
                    f"{text}: not a multiple of {n} micro-batches x data-parallel size {dp}; "
                    f"give --micro-batch-size too, or a multiple of {n * dp}."
                )
            m = g // (n * dp)
        elif g % (m * dp):
            raise ValueError(
                f"--global-batch-size ({g}) must be a multiple of --micro-batch-size ({m}) x "
                f"data-parallel size ({dp}) = {m * dp} (Megatron-LM's rule); e.g. {m * dp * n}."
            )
        n = g // (m * dp)
    assert m is not None  # given, or derived from the global batch
    values: dict[str, Any] = {"batch_size": m * n if pipeline else m}
    if g is not None:
        values |= {"micro_batches": n, "accumulate_grad_batches": 1} if pipeline else {}
        values |= {} if pipeline else {"accumulate_grad_batches": n}
    per_step = f"{n} micro-batches of {m}" if pipeline else f"{n} accumulated batch(es) of {m}"
    where = f" per step on each data-parallel rank (dp {dp})" if dp else " per step"
    return FlagMapping(text, values, per_step + where)


def map_megatron_flags(
    flags: MegatronFlags,
    *,
    layout: dict[str, Any],
    world_size: int | None = None,
    num_layers: int | None = None,
    accumulation: int = 1,
) -> list[FlagMapping]:
    """What each given flag sets (see the module docstring), in the order tp, pp, ep, virtual
    stages, sequence parallelism, batch.

    Args:
        flags: the flags given.
        layout: the strategy's current arguments (``tensor_parallel``, ``pipeline_parallel``,
            ``micro_batches``, ``schedule``...; missing ones take the strategy's defaults).
        world_size: processes (``devices * num_nodes``); ``None``: unknown (a global batch size
            is then refused).
        num_layers: the decoder's layers (for the virtual stages).
        accumulation: the Trainer's ``accumulate_grad_batches``.

    Raises:
        ValueError: a non-positive size; virtual stages without pipeline parallelism or that do
            not divide the layers; a global batch not divisible by micro-batch size x dp.
    """
    layout = {"tensor_parallel": 1, "pipeline_parallel": 1, **layout}
    out = []
    sizes = ("tensor_model_parallel_size", "pipeline_model_parallel_size")
    for name in (*sizes, "expert_model_parallel_size"):
        value = _positive(flags, name)
        if value is not None:
            option = FLAGS[name][0]
            values = {option: value}
            if option == "pipeline_parallel" and value == 1:  # no pipeline: its options go
                values |= {k: v for k, v in NO_PIPELINE.items() if layout.get(k, v) != v}
            layout |= values
            out.append(FlagMapping(f"{flag(name)} {value}", values))
    n = _positive(flags, "num_layers_per_virtual_pipeline_stage")
    if n is not None:
        out.append(_virtual(n, layout, num_layers))
        layout |= out[-1].values
    if flags.sequence_parallel:
        out.append(FlagMapping(flag("sequence_parallel"), {"sequence_parallel": True}))
    batch = _batch(flags, layout, world_size, accumulation)
    return out if batch is None else [*out, batch]


STRATEGY_OPTIONS = frozenset(
    ("tensor_parallel", "pipeline_parallel", "expert_parallel", "virtual_pipeline", "schedule")
) | {"micro_batches"}


def _num_layers(cfg: Any) -> int | None:
    """The decoder's layers: the pretrained decoder's ``config.json`` (a transformers Llama
    directory), else the YAML's ``model.fusion.language.num_hidden_layers``."""
    path = cfg.get("model.pretrained.language")
    config = Path(path) / "config.json" if path else None
    if config is not None and config.is_file():  # else the model's own check names the path
        return json.loads(config.read_text()).get("num_hidden_layers")
    return cfg.get("model.fusion.language.num_hidden_layers")


def _key(cfg: Any, option: str) -> str:
    """The parsed-config key of a non-strategy option."""
    if option == "batch_size":  # a data module given by class_path keeps its init_args
        return (
            "data.init_args.batch_size"
            if cfg.get("data.init_args") is not None
            else "data.batch_size"
        )
    if option == "sequence_parallel":  # the deprecated model.tensor_parallel, when given
        plan = (
            "model.tensor_parallel"
            if cfg.get("model.tensor_parallel") is not None
            else "model.plan"
        )
        return f"{plan}.sequence_parallel"
    return f"trainer.{option}"


def apply_megatron_flags(cfg: Any) -> tuple[list[str], dict[str, str]]:
    """Apply the Megatron-LM flags in the CLI's parsed config ``cfg`` (a jsonargparse
    ``Namespace``) in place, before the classes are built: ``(lines, keys)``, one line per
    flag (``--tensor-model-parallel-size 2 -> trainer.strategy.init_args.tensor_parallel=2``,
    with the value it replaced and how it was derived) and the config key -> flag of every value
    set (a DeepSpeed JSON applied next must agree with them).

    Raises:
        ValueError: what :func:`map_megatron_flags` refuses; a size flag with a strategy other
            than ``mm_parallel``.
    """
    flags = MegatronFlags.from_config(cfg)
    if not flags.given:
        return [], {}
    trainer = cfg["trainer"]
    mappings = map_megatron_flags(
        flags,
        layout=strategy_layout(trainer.get("strategy")),
        world_size=world_size(trainer),
        num_layers=_num_layers(cfg),
        accumulation=trainer.get("accumulate_grad_batches") or 1,
    )
    lines, keys = [], {}
    for mapping in mappings:
        sets = []
        for option, value in mapping.values.items():
            if option in STRATEGY_OPTIONS:
                args, note = mm_parallel_args(cfg, mapping.flag)
                sets += [note] if note else []
                key, old = f"trainer.strategy.init_args.{option}", args.get(option)
                args[option] = value
            else:
                key = _key(cfg, option)
                old, cfg[key] = cfg.get(key), value
            was = f" (was {old!r})" if old is not None and old != value else ""
            sets.append(f"{key}={value!r}{was}")
            keys[key] = mapping.flag
        how = f" ({mapping.how})" if mapping.how else ""
        lines.append(f"{mapping.flag} -> {', '.join(sets)}{how}")
    return lines, keys
