"""Pipeline stage plans of a recipe YAML, without training:
``python -m lightning_mmpar.recipes.partition --config recipes/clip_llama_cpu.yaml --pp 4``.

Builds the YAML's ``model:`` (and ``data:``, for the vocabulary and caption length) as
``ClipLlamaCLI`` would, on the meta device (no memory, no process group), costs its pipeline
blocks (``ClipLlamaModule.pipeline_block_specs``) and prints the chosen partition per stage
(blocks, kinds, cost share, parameters, activation memory) and the imbalance of every mode side
by side (:func:`lightning_mmpar.layout.compare_modes`). ``--pp`` / ``--virtual`` default to the
YAML strategy's ``pipeline_parallel`` / ``virtual_pipeline``, ``--micro-batch-size`` to
``data.batch_size // micro_batches``. Invalid arguments exit with status 2 and the reason.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import yaml
from lightning.pytorch import LightningDataModule
from lightning.pytorch.cli import LightningArgumentParser

from lightning_mmpar.config import ParallelConfig
from lightning_mmpar.layout import (
    BlockSpec,
    compare_modes,
    in_flight,
    parse_partition,
    plan_stages,
    side_by_side,
    stage_ranks,
)
from lightning_mmpar.layout.schedules import MULTI_STAGE_SCHEDULES
from lightning_mmpar.recipes.cli import RecipeDigitsCaptions
from lightning_mmpar.recipes.hf_plan import with_checkpoint
from lightning_mmpar.recipes.module import ClipLlamaModule

__all__ = ["build_module", "build_specs", "data_args", "load_recipe", "main"]


def _strategy_args(config: dict[str, Any]) -> dict[str, Any]:
    strategy = (config.get("trainer") or {}).get("strategy")
    args = strategy.get("init_args") if isinstance(strategy, dict) else None
    return args if isinstance(args, dict) else {}


def load_recipe(path_text: str) -> dict[str, Any]:
    """The recipe YAML at ``path_text`` (the ``--config`` of the planner and partition CLIs).

    Raises:
        ValueError: no such file, not YAML, no ``model:`` section, or a ``trainer`` / ``model``
            / ``data`` section that is not a mapping (the message names ``--config``).
    """
    path = Path(path_text)
    if not path.is_file():
        raise ValueError(f"--config {str(path)!r}: no such file; pass a recipe YAML.")
    try:
        config = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        why = " ".join(str(err).split())
        raise ValueError(f"--config {str(path)!r} is not valid YAML: {why}") from None
    if not isinstance(config, dict) or "model" not in config:
        raise ValueError(f"--config {str(path)!r} has no model: section; pass a recipe YAML.")
    for key in ("trainer", "model", "data"):
        if not isinstance(config.get(key) or {}, dict):
            raise ValueError(f"--config {str(path)!r}: {key} ({config[key]!r}) must be a mapping.")
    return config


def build_module(config: dict[str, Any], meta: bool = True) -> tuple[ClipLlamaModule, Any]:
    """The YAML's ``model:`` and ``data:`` sections instantiated as the recipe CLI does
    (``data.vocab_size -> model.vocab_size``); ``meta``: the model built on the meta device
    (else unbuilt: a Trainer's ``configure_model`` builds it, as in ``fit``).

    Raises:
        ValueError: the sections do not build (jsonargparse's reason included).
    """
    parser = LightningArgumentParser(exit_on_error=False)
    parser.add_lightning_class_args(ClipLlamaModule, "model", subclass_mode=False)
    parser.add_lightning_class_args(LightningDataModule, "data", subclass_mode=True)
    default = f"{RecipeDigitsCaptions.__module__}.{RecipeDigitsCaptions.__name__}"
    parser.set_defaults({"data": {"class_path": default}})
    parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")
    sections = {"model": config.get("model") or {}, "data": data_args(config, nested=True)}
    try:
        instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
        init = instantiate(parser.parse_object(sections))
    except Exception as err:  # jsonargparse reports bad fields with its own types
        raise ValueError(f"the YAML's model/data sections do not build: {err}") from None
    module, data = init["model"], init["data"]
    if meta:
        module.read_checkpoints = False  # shapes only: pretrained towers stay on meta
        with torch.device("meta"):
            module.configure_model()
    return module, data


def data_args(config: dict[str, Any], nested: bool = False) -> dict[str, Any]:
    """The YAML's data arguments, whether ``data:`` holds them or ``class_path`` + ``init_args``
    (any data module, as ``ClipLlamaCLI`` takes); ``nested``: the section with arguments given
    beside ``class_path`` (a merged layout fragment's ``batch_size``) moved into ``init_args``."""
    data = dict(config.get("data") or {})
    if "class_path" not in data:
        return data
    beside = {k: v for k, v in data.items() if k not in ("class_path", "init_args")}
    args = {**(data.get("init_args") or {}), **beside}
    return {"class_path": data["class_path"], "init_args": args} if nested else args


def build_specs(config: dict[str, Any], text_length: int | None = None) -> list[BlockSpec]:
    """The block specs of :func:`build_module`'s model at ``text_length`` (default: the
    data's ``max_length``)."""
    module, data = build_module(config)
    return module.pipeline_block_specs(text_length or data.max_length)


def _schedule(schedule: str, virtual: int) -> str:
    """The YAML's schedule, or ``interleaved_1f1b`` when ``--virtual`` asks for several stages
    per rank and the YAML's schedule runs one (a preview of another layout, not a refusal)."""
    return "interleaved_1f1b" if virtual > 1 and schedule not in MULTI_STAGE_SCHEDULES else schedule


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m lightning_mmpar.recipes.partition",
        description="Pipeline stage plans of a recipe YAML: per stage blocks, kinds, cost "
        "share, parameters and activation memory; every mode's imbalance side by side.",
    )
    p.add_argument("--config", required=True, help="recipe YAML (the LightningCLI config)")
    p.add_argument(
        "--hf-config",
        help="a transformers checkpoint's config.json (or its directory): the model partitioned "
        "(model.pretrained.hf; no weights, tokenizer or data read)",
    )
    p.add_argument("--pp", type=int, help="pipeline_parallel (default: the YAML's)")
    p.add_argument("--virtual", type=int, help="virtual_pipeline (default: the YAML's or 1)")
    p.add_argument(
        "--schedule",
        help="pipeline schedule (default: the YAML's; interleaved_1f1b if --virtual > 1 and the "
        "YAML's runs one stage per rank)",
    )
    p.add_argument(
        "--micro-batches", type=int, help="default: the YAML's (the schedule's with --pp)"
    )
    p.add_argument("--micro-batch-size", type=int, help="default: batch_size // micro_batches")
    p.add_argument("--memory-limit-gib", type=float, help="per-stage memory limit (GiB)")
    p.add_argument("--text-length", type=int, help="caption length T (default: the data's)")
    p.add_argument(
        "--partition",
        help="equal | balanced | memory | ratio:V:A:D | b1,b2,... (default: the YAML's or equal)",
    )
    return p


def _parallel_config(args: argparse.Namespace, strategy: dict[str, Any]) -> ParallelConfig:
    """The previewed layout, as the strategy checks it: the YAML's, with the command line's
    ``--pp`` / ``--virtual`` / ``--schedule`` / ``--micro-batches`` / ``--partition``."""
    pp = args.pp if args.pp is not None else int(strategy.get("pipeline_parallel", 1))
    v = args.virtual if args.virtual is not None else int(strategy.get("virtual_pipeline", 1))
    schedule: Any = args.schedule or _schedule(strategy.get("schedule", "1f1b"), v)
    return ParallelConfig(
        pipeline_parallel=pp,
        virtual_pipeline=v,
        schedule=schedule,
        # another --pp than the YAML's: the schedule's default count, not the YAML's
        micro_batches=args.micro_batches
        or (strategy.get("micro_batches") if args.pp is None else None),
        partition=args.partition or strategy.get("partition") or "equal",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Print the plans; 0 on success. Invalid arguments: ``SystemExit(2)`` with the reason."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        path, config = args.config, with_checkpoint(load_recipe(args.config), args.hf_config)
        strategy = _strategy_args(config)
        parallel = _parallel_config(args, strategy)
        pp, v = parallel.pipeline_parallel, parallel.virtual_pipeline
        m = parallel.num_micro_batches
        batch = int(data_args(config).get("batch_size", 1))
        if args.micro_batch_size is not None and args.micro_batch_size < 1:
            raise ValueError(f"--micro-batch-size ({args.micro_batch_size}) must be >= 1.")
        mbs = args.micro_batch_size or max(1, batch // m)
        chosen = parse_partition(parallel.partition, pp * v)
        place = {
            "stage_ranks": stage_ranks(parallel.schedule, pp, v),
            "in_flight": in_flight(parallel.schedule, pp, v, m),
        }
        limit = args.memory_limit_gib
        if limit is not None and limit <= 0:
            raise ValueError(f"--memory-limit-gib ({limit}) must be > 0 (GiB per stage).")
        blocks = build_specs(config, args.text_length)
        plan = plan_stages(
            blocks,
            pp,
            v,
            chosen,
            micro_batch_size=mbs,
            memory_limit_bytes=None if limit is None else limit * 2**30,
            **place,
        )
        plans = compare_modes(blocks, pp, v, chosen, micro_batch_size=mbs, **place)
    except ValueError as err:
        parser.error(str(err))
    print(
        f"{path}: {len(blocks)} blocks, pp {pp} x v {v} = {pp * v} stages, {parallel.schedule}, "
        f"{m} micro-batches of {mbs}"
        + ("" if limit is None else f", memory limit {limit} GiB per stage")
    )
    print(plan.table())
    print("\nevery mode (imbalance = max / mean stage FLOPs):")
    print(side_by_side(plans))
    return 0


if __name__ == "__main__":
    sys.exit(main())
