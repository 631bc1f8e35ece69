"""The recipe's CLI inside a spawned world: no interpreter started per command.

A command run through ``python -m lightning_mmpar.recipes.clip_llama`` on 2 or 4 processes
starts 2-4 fresh interpreters (about 14 CPU-seconds of imports each); the tests that check what
a command does (not how it is launched: tests/distributed/test_launchers.py and
tests/distributed/test_preemption.py launch it for real) run it with :func:`run` on every rank
of a :func:`lightning_mmpar.testing.spawn` world instead, several commands per world
(:func:`world`). What rank 0 printed through Lightning's ``rank_zero_info`` (the run summary,
the DeepSpeed notes) is kept.
"""

from __future__ import annotations

import io
import logging
from typing import Any

from lightning_utilities.core import rank_zero

from lightning_mmpar.recipes.cli import run_cli


def run(args: list[str]) -> tuple[Any, str]:
    """Run the recipe CLI with ``args`` in this process; the CLI and what it printed."""
    printed = io.StringIO()
    handler = logging.StreamHandler(printed)
    log = rank_zero.log  # what Lightning's rank_zero_info logs to (Lightning rebinds it)
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        cli = run_cli(args)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    cli.trainer.strategy.barrier()
    return cli, printed.getvalue()


def world(rank: int, world_size: int, commands: dict[str, list[str]]) -> dict[str, Any]:
    """Every command, in order, on this rank: ``{name: {"printed", "steps", "strategy"}}``."""
    out: dict[str, Any] = {}
    for name, args in commands.items():
        cli, printed = run(args)
        out[name] = {
            "printed": printed,
            "steps": cli.trainer.global_step,
            "strategy": type(cli.trainer.strategy).__name__,
        }
    return out
