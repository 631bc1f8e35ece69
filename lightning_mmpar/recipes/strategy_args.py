"""The parsed ``trainer.strategy`` of the recipe's CLI as ``mm_parallel`` arguments.

Options that translate another convention into the strategy's arguments (Megatron-LM's flags,
:mod:`lightning_mmpar.recipes.megatron_cli`; a DeepSpeed JSON,
:mod:`lightning_mmpar.recipes.deepspeed_cli`) write them into the parsed configuration before
the classes are built, so the strategy keeps every other argument the YAML gives (``timeout``,
``partition``, the memory options) and the saved ``config.yaml`` shows what ran.
"""

from __future__ import annotations

from typing import Any

from jsonargparse import Namespace

__all__ = [
    "MM_PARALLEL_CLASS",
    "is_mm_parallel",
    "mm_parallel_args",
    "strategy_layout",
    "world_size",
]

MM_PARALLEL_CLASS = "lightning_mmpar.strategy.MultimodalParallelStrategy"
"""``class_path`` of the strategy in a recipe YAML."""
LAYOUT_KEYS = (
    "tensor_parallel",
    "pipeline_parallel",
    "expert_parallel",
    "virtual_pipeline",
    "micro_batches",
    "schedule",
    "data_parallel",
)
"""The layout arguments of ``mm_parallel`` the CLI's translations read and write."""
PLAIN = (None, "auto", "mm_parallel")
"""Strategy values that become ``mm_parallel`` arguments: the registered name, and no strategy
(Lightning's ``auto``)."""


def _class_path(strategy: Any) -> str | None:
    if isinstance(strategy, Namespace | dict):
        return strategy.get("class_path")
    return getattr(strategy, "class_path", None)


def is_mm_parallel(strategy: Any) -> bool:
    """Whether a parsed ``trainer.strategy`` is ``mm_parallel`` (its name or its class)."""
    path = _class_path(strategy)
    return strategy == "mm_parallel" or bool(path and path.endswith("MultimodalParallelStrategy"))


def strategy_layout(strategy: Any) -> dict[str, Any]:
    """The ``mm_parallel`` arguments given in a parsed ``trainer.strategy`` (an instance, a
    ``class_path`` section or the name ``mm_parallel``, whose ``data_parallel`` default is
    ``fsdp``); ``{}`` for any other strategy."""
    config = getattr(strategy, "config", None)
    if config is not None and type(strategy).__name__ == "MultimodalParallelStrategy":
        return {k: getattr(config, k) for k in LAYOUT_KEYS}
    if _class_path(strategy) and is_mm_parallel(strategy):
        args = strategy["init_args"] or {}
        return {"data_parallel": "fsdp"} | dict(
            args.as_dict() if hasattr(args, "as_dict") else args
        )
    return {"data_parallel": "fsdp"} if strategy == "mm_parallel" else {}


def mm_parallel_args(
    cfg: Any, option: str, *, replace: bool = False
) -> tuple[Namespace, str | None]:
    """``(init_args, note)``: the ``init_args`` of ``cfg``'s ``trainer.strategy`` to write
    ``mm_parallel`` arguments into. The name ``mm_parallel``, no strategy or (``replace``) any
    other strategy becomes a ``class_path`` section (``note`` says so; ``None`` when it already
    was one).

    Raises:
        ValueError: another strategy (``ddp``, a class of its own...) without ``replace``:
            ``option`` (the flag or key that asked for ``mm_parallel`` arguments) is named with
            the fix.
    """
    strategy = cfg.get("trainer.strategy")
    if _class_path(strategy) and is_mm_parallel(strategy):
        if strategy.get("init_args") is None:
            strategy["init_args"] = Namespace()
        return strategy["init_args"], None
    name = _class_path(strategy) or strategy
    if strategy not in PLAIN and not replace:
        raise ValueError(
            f"{option} sets arguments of the mm_parallel strategy, but trainer.strategy is "
            f"{name!r}; use trainer.strategy: mm_parallel (class_path: {MM_PARALLEL_CLASS}) or "
            "drop the option."
        )
    args = Namespace()
    cfg["trainer.strategy"] = Namespace(class_path=MM_PARALLEL_CLASS, init_args=args)
    return args, f"trainer.strategy ({name!r}) -> {MM_PARALLEL_CLASS}"


def world_size(trainer: Any) -> int | None:
    """``devices * num_nodes`` of a parsed Trainer config (``None``: ``auto`` / -1 on GPU)."""
    devices, nodes = trainer.get("devices", "auto"), trainer.get("num_nodes", 1) or 1
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        devices = int(devices)
    if isinstance(devices, list | tuple):
        devices = len(devices)
    if devices in ("auto", -1) and trainer.get("accelerator") == "cpu":
        devices = 1
    return devices * nodes if isinstance(devices, int) and devices > 0 else None
