"""``--deepspeed ds_config.json``: what a DeepSpeed JSON maps to, for the recipe's CLI.

The mapping itself (:func:`lightning_mmpar.parallel.deepspeed_mapping.map_deepspeed_config`) is
a pure function in ``parallel/``; applying it to the recipe's parsed configuration (Trainer, data,
``model.optim``) and building a strategy needs the recipe and the strategy class, which only the
recipe layer may import. A value set both in the YAML and in the JSON takes the JSON's (given
explicitly), with an info line naming both values; every unknown or unmapped key is named in a
warning, or in one ``ValueError`` with ``strict``.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_mmpar.parallel.deepspeed_mapping import (
    DeepSpeedPlan,
    map_deepspeed_config,
)
from lightning_mmpar.parallel.deepspeed_strategy import CPUCapableDeepSpeedStrategy
from lightning_mmpar.recipes.strategy_args import mm_parallel_args, strategy_layout, world_size
from lightning_mmpar.strategy import MultimodalParallelStrategy

__all__ = ["apply_deepspeed_json", "optim_from_deepspeed", "strategy_from_deepspeed"]

OPTIMIZERS = ("adam", "adamw")
"""DeepSpeed optimizer types the recipe's AdamW stands for (DeepSpeed's ``Adam`` is AdamW unless
``adam_w_mode`` is false)."""
TORCH_ADAM = {"betas": [0.9, 0.999], "eps": 1e-8}
"""torch AdamW defaults, the recipe's: a JSON giving these values maps, other values do not."""


def optim_from_deepspeed(config: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``(model.optim fields, unmapped messages)`` from the JSON's ``optimizer`` and ``scheduler``.

    ``optimizer`` of type Adam/AdamW: ``params.lr`` -> ``lr``, ``params.weight_decay`` ->
    ``weight_decay``; ``scheduler`` of type ``WarmupCosineLR``: ``warmup_num_steps`` ->
    ``warmup_steps``, ``cos_min_ratio`` -> ``min_lr_ratio`` (the recipe's schedule: linear
    warm-up, cosine decay over the run). Anything else is named as unmapped.
    """
    optim: dict[str, Any] = {}
    notes: list[str] = []
    opt = config.get("optimizer")
    if isinstance(opt, dict):
        kind, params = str(opt.get("type", "")).lower(), dict(opt.get("params") or {})
        if kind not in OPTIMIZERS or params.pop("adam_w_mode", True) is not True:
            notes.append(f"optimizer {opt.get('type')!r}: the recipe trains with AdamW only")
        else:
            optim |= {k: params.pop(k) for k in ("lr", "weight_decay") if k in params}
            for key, value in params.items():
                if TORCH_ADAM.get(key) != value:
                    notes.append(f"'optimizer.params.{key}' ({value!r}) has no counterpart")
    elif opt is not None:
        notes.append(f"optimizer ({opt!r}) must be an object with 'type' and 'params'")
    sched = config.get("scheduler")
    if isinstance(sched, dict) and sched.get("type") == "WarmupCosineLR":
        params = dict(sched.get("params") or {})
        names = {"warmup_num_steps": "warmup_steps", "cos_min_ratio": "min_lr_ratio"}
        optim |= {names[k]: params.pop(k) for k in list(params) if k in names}
        if params.pop("warmup_type", "linear") != "linear":
            notes.append("'scheduler.params.warmup_type': the recipe warms up linearly")
        notes += [
            f"'scheduler.params.{k}' has no counterpart (the recipe's schedule spans "
            "the run's steps)"
            for k in params
        ]
    elif sched is not None:
        name = sched.get("type") if isinstance(sched, dict) else sched
        notes.append(f"scheduler {name!r}: the recipe's schedule is WarmupCosineLR only")
    return optim, notes


def strategy_from_deepspeed(
    config: dict[str, Any] | DeepSpeedPlan, *, base: Any = None
) -> Strategy:
    """Build the strategy a DeepSpeed JSON (or its plan) maps to; ``base`` is the recipe's
    current strategy (an ``mm_parallel`` instance, whose layout is kept, or anything else).

    ZeRO-1/2 give :class:`CPUCapableDeepSpeedStrategy` (``DS_ACCELERATOR=cpu`` set without a
    GPU, before DeepSpeed is first imported); other stages give ``MultimodalParallelStrategy``.

    Raises:
        ValueError: what :func:`map_deepspeed_config` refuses (unknown stage, ZeRO-3 offload,
            ZeRO-1/2 with model parallelism, a contradicting ``tp_size``).
    """
    plan = config
    if not isinstance(plan, DeepSpeedPlan):  # mapped here: its note and info lines said here
        plan = map_deepspeed_config(plan, layout=strategy_layout(base))
        for line in [plan.note] if plan.note else []:
            rank_zero_info(f"[lightning_mmpar] {line}")
        for line in plan.info:
            rank_zero_info(f"[lightning_mmpar] {line}")
    if plan.engine == "deepspeed":
        if not torch.cuda.is_available():  # DeepSpeed reads it when first imported
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        return CPUCapableDeepSpeedStrategy(**plan.strategy_kwargs)
    return MultimodalParallelStrategy(**plan.strategy_kwargs)


TRAINER_SOURCES = {
    "accumulate_grad_batches": "gradient_accumulation_steps",
    "gradient_clip_val": "gradient_clipping",
    "precision": "fp16/bf16",
}
"""Trainer argument -> the DeepSpeed key it comes from (in the info lines)."""
STRATEGY_DEFAULTS = {
    name: p.default
    for name, p in inspect.signature(MultimodalParallelStrategy.__init__).parameters.items()
    if p.default is not inspect.Parameter.empty
}


def _changes(
    cfg: Any, plan: DeepSpeedPlan, config: dict[str, Any], optim: dict[str, Any]
) -> list[tuple[str, Any, str]]:
    """``(config key, value, JSON key)`` of every non-strategy value the JSON sets."""
    out = [(f"trainer.{k}", v, TRAINER_SOURCES[k]) for k, v in plan.trainer_kwargs.items()]
    steps = config.get("gradient_accumulation_steps")
    if steps is not None and plan.trainer_kwargs.get("accumulate_grad_batches") == 1 != steps:
        key = "trainer.accumulate_grad_batches"
        out[0] = (key, 1, f"gradient_accumulation_steps {steps} = the pipeline's micro-batches")
        # (under pipeline parallelism nothing is accumulated on top of the micro-batches)
    if plan.batch_size is not None:
        data = "data.init_args" if cfg.get("data.init_args") is not None else "data"  # subclass
        source = "train_micro_batch_size_per_gpu"
        if source not in config:  # derived from train_batch_size
            source = "train_batch_size / (gradient_accumulation_steps x data-parallel size)"
        elif plan.batch_size != config[source]:  # pipeline: micro x micro-batches
            source += " x the micro-batches per step"
        out.append((f"{data}.batch_size", plan.batch_size, source))
    out += [(f"model.optim.{k}", v, f"optimizer/scheduler {k}") for k, v in optim.items()]
    return out


def _strategy_sources(plan: DeepSpeedPlan) -> dict[str, str]:
    stage = plan.zero_stage
    return {
        "tensor_parallel": "tensor_parallel.tp_size",
        "data_parallel": "no zero_optimization.stage"
        if stage is None
        else f"zero_optimization.stage {stage}",
        "micro_batches": "gradient_accumulation_steps",
    }


def _check_agrees(
    cfg: Any, plan: DeepSpeedPlan, changes: list[tuple[str, Any, str]], fixed: Mapping[str, str]
) -> None:
    """Refuse a JSON value that contradicts one a command-line flag set (``fixed``: config key
    -> flag)."""
    sources = _strategy_sources(plan)
    strategy = [
        (f"trainer.strategy.init_args.{k}", v, sources.get(k, k))
        for k, v in plan.strategy_kwargs.items()
        if plan.engine == "mm_parallel"
    ]
    for key, value, source in [*strategy, *changes]:
        if key in fixed and cfg.get(key) != value:
            raise ValueError(
                f"{fixed[key]} sets {key}={cfg.get(key)!r} but the DeepSpeed JSON's {source} "
                f"gives {value!r}; make them agree or drop one."
            )


def _apply_strategy(cfg: Any, plan: DeepSpeedPlan) -> list[str]:
    """Write the plan's strategy into ``cfg`` (``mm_parallel``: its arguments, every other one
    the YAML gives kept); info lines for each value it replaces."""
    stage = f"zero_optimization.stage {plan.zero_stage}"
    if plan.engine == "deepspeed":
        old = cfg.get("trainer.strategy")
        name = getattr(old, "class_path", None) or old
        return [
            f"DeepSpeed JSON {stage} replaces trainer.strategy ({name!r}) by DeepSpeed's "
            "engine (CPUCapableDeepSpeedStrategy)"
        ]
    args, converted = mm_parallel_args(cfg, "--deepspeed", replace=True)
    lines = [f"DeepSpeed JSON: {converted}"] if converted else []
    sources = _strategy_sources(plan)
    for key, value in plan.strategy_kwargs.items():
        old = args.get(key, STRATEGY_DEFAULTS.get(key))
        if old != value:
            lines.append(
                f"DeepSpeed JSON {sources.get(key, key)} ({value!r}) replaces "
                f"trainer.strategy.init_args.{key} ({old!r})"
            )
        args[key] = value
    return lines


def apply_deepspeed_json(
    cfg: Any,
    config: dict[str, Any],
    *,
    strict: bool = False,
    fixed: Mapping[str, str] | None = None,
    info: list[str] | None = None,
) -> DeepSpeedPlan:
    """Apply a DeepSpeed JSON to the CLI's parsed config ``cfg`` (a jsonargparse ``Namespace``
    with ``trainer``, ``data``, ``model``) in place, before the classes are instantiated (so the
    saved ``config.yaml`` shows the values that run); returns the plan. An ``mm_parallel``
    plan's arguments are written into ``trainer.strategy`` (the YAML's other arguments kept;
    the name ``mm_parallel``, no strategy or another strategy becomes its ``class_path``
    section); DeepSpeed's engine is built by :func:`strategy_from_deepspeed` from the plan.

    Every value the JSON replaces is said in an info line (``DeepSpeed JSON <key> (<new>)
    replaces <option> (<old>)``), as are the plan's ``note`` and ``info``; lines go to ``info``
    when a list is given, else to ``rank_zero_info``. Unknown or unmapped keys are warned about.

    Raises:
        ValueError: what :func:`map_deepspeed_config` refuses; with ``strict`` every unknown
            or unmapped key (all named, with the closest known key); a value that contradicts
            one a command-line flag set (``fixed``: config key -> flag, e.g. Megatron-LM's
            ``--micro-batch-size``). Nothing is changed or printed then.
    """
    trainer = cfg["trainer"]
    plan = map_deepspeed_config(
        config,
        layout=strategy_layout(trainer.get("strategy")),
        world_size=world_size(trainer),
        accumulation=trainer.get("accumulate_grad_batches") or 1,
        handled=frozenset(("optimizer", "scheduler")),
    )
    optim, notes = optim_from_deepspeed(config) if plan.engine == "mm_parallel" else ({}, [])
    notes = plan.unmapped + notes
    if notes and strict:
        raise ValueError(
            "DeepSpeed JSON keys this run would not honour (--deepspeed_strict): "
            + "; ".join(notes)
            + ". Remove or fix them, or drop --deepspeed_strict to warn only."
        )
    changes = _changes(cfg, plan, config, optim)
    _check_agrees(cfg, plan, changes, fixed or {})
    for note in notes:
        end = "" if note.endswith("?") else "."
        rank_zero_warn(f"[lightning_mmpar] DeepSpeed JSON: {note}{end}")
    lines = _apply_strategy(cfg, plan)
    for key, value, source in changes:
        old = cfg.get(key)
        if old is not None and old != value:
            lines.append(f"DeepSpeed JSON {source} ({value!r}) replaces {key} ({old!r})")
        cfg[key] = value
    lines += [plan.note] if plan.note else []
    lines += plan.info
    if info is not None:
        info += lines
    for line in lines if info is None else ():
        rank_zero_info(f"[lightning_mmpar] {line}")
    return plan
