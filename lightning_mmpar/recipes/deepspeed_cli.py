"""``--deepspeed ds_config.json``: what a DeepSpeed JSON maps to, for the recipe's CLI.

The mapping itself (:func:`lightning_mmpar.parallel.deepspeed_mapping.map_deepspeed_config`) is
a pure function in ``parallel/``; applying it to the recipe's parsed configuration (Trainer, data,
``model.optim``) and building a strategy needs the recipe and the strategy class, which only the
recipe layer may import. A value set both in the YAML and in the JSON takes the JSON's (given
explicitly), with an info line naming both values; every unknown or unmapped key is named in a
warning, or in one ``ValueError`` with ``strict``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_mmpar.parallel.deepspeed_mapping import (
    MM_PARALLEL_KEYS,
    DeepSpeedPlan,
    map_deepspeed_config,
)
from lightning_mmpar.parallel.deepspeed_strategy import CPUCapableDeepSpeedStrategy
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


def _layout(strategy: Any) -> dict[str, Any]:
    """``mm_parallel`` arguments of a strategy given as an instance or a parsed config."""
    if isinstance(strategy, MultimodalParallelStrategy):
        c = strategy.config
        return {k: getattr(c, k) for k in (*MM_PARALLEL_KEYS, "data_parallel")}
    path = getattr(strategy, "class_path", None) or (
        strategy.get("class_path") if isinstance(strategy, dict) else None
    )
    if path and path.endswith("MultimodalParallelStrategy"):
        args = strategy["init_args"]
        return dict(args.as_dict() if hasattr(args, "as_dict") else args)
    return {"data_parallel": "fsdp"} if strategy == "mm_parallel" else {}  # its default


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
    if not isinstance(plan, DeepSpeedPlan):
        plan = map_deepspeed_config(plan, layout=_layout(base))
    if plan.note:
        rank_zero_info(f"[lightning_mmpar] {plan.note}")
    if plan.engine == "deepspeed":
        if not torch.cuda.is_available():  # DeepSpeed reads it when first imported
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        return CPUCapableDeepSpeedStrategy(**plan.strategy_kwargs)
    return MultimodalParallelStrategy(**plan.strategy_kwargs)


def _world_size(trainer: Any) -> int | None:
    """``devices * num_nodes`` of a parsed Trainer config (``None``: ``auto`` / -1 on GPU)."""
    devices, nodes = trainer.get("devices", "auto"), trainer.get("num_nodes", 1) or 1
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        devices = int(devices)
    if isinstance(devices, list | tuple):
        devices = len(devices)
    if devices in ("auto", -1) and trainer.get("accelerator") == "cpu":
        devices = 1
    return devices * nodes if isinstance(devices, int) and devices > 0 else None


def _set(cfg: Any, key: str, value: Any, source: str) -> None:
    old = cfg.get(key)
    if old is not None and old != value:
        rank_zero_info(
            f"[lightning_mmpar] DeepSpeed JSON {source} ({value!r}) replaces {key} ({old!r})"
        )
    cfg[key] = value


def apply_deepspeed_json(
    cfg: Any, config: dict[str, Any], *, strict: bool = False
) -> DeepSpeedPlan:
    """Apply a DeepSpeed JSON to the CLI's parsed config ``cfg`` (a jsonargparse ``Namespace``
    with ``trainer``, ``data``, ``model``) in place, before the classes are instantiated (so the
    saved ``config.yaml`` shows the values that run); returns the plan whose strategy
    :func:`strategy_from_deepspeed` builds.

    Raises:
        ValueError: what :func:`map_deepspeed_config` refuses, and with ``strict`` every unknown
            or unmapped key (all named, with the closest known key).
    """
    trainer = cfg["trainer"]
    plan = map_deepspeed_config(
        config,
        layout=_layout(trainer.get("strategy")),
        world_size=_world_size(trainer),
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
    for note in notes:
        end = "" if note.endswith("?") else "."
        rank_zero_warn(f"[lightning_mmpar] DeepSpeed JSON: {note}{end}")
    names = {
        "accumulate_grad_batches": "gradient_accumulation_steps",
        "gradient_clip_val": "gradient_clipping",
        "precision": "fp16/bf16",
    }
    for key, value in plan.trainer_kwargs.items():
        _set(cfg, f"trainer.{key}", value, names[key])
    if plan.batch_size is not None:
        data = "data.init_args" if cfg.get("data.init_args") is not None else "data"  # subclass
        _set(cfg, f"{data}.batch_size", plan.batch_size, "train_micro_batch_size_per_gpu")
    for key, value in optim.items():
        _set(cfg, f"model.optim.{key}", value, f"optimizer/scheduler {key}")
    return plan
