"""LightningCLI of the CLIP-LLaMA recipe, with a DeepSpeed-JSON option.

``--deepspeed ds_config.json`` replaces ``trainer.strategy`` by what
:func:`lightning_mmpar.parallel.deepspeed.strategy_from_deepspeed` maps the JSON to (DeepSpeed's
engine for ZeRO-1/2, ``mm_parallel`` with FSDP2 for ZeRO-3), keeping the sizes of an
``mm_parallel`` strategy given in the YAML.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from lightning_mmpar.data.digits import DigitsCaptions
from lightning_mmpar.recipes.clip_llama import ClipLlamaModule


class ClipLlamaCLI(LightningCLI):
    """LightningCLI with ``data.vocab_size -> model.vocab_size`` and ``--deepspeed``."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")
        parser.add_argument(
            "--deepspeed", type=str | None, default=None,
            help="DeepSpeed JSON: zero_optimization.stage 1/2 -> DeepSpeed engine, 3 -> FSDP2; "
            "tensor_parallel.tp_size -> tensor_parallel.",
        )

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        path = self._get(self.config, "deepspeed")
        if path:
            from lightning_mmpar.parallel.deepspeed import strategy_from_deepspeed

            current = self._get(self.config_init, "trainer", default={}).get("strategy")
            kwargs["strategy"] = strategy_from_deepspeed(
                json.loads(Path(path).read_text()), base=current
            )
        return super().instantiate_trainer(**kwargs)


def run_cli(args: list[str] | None = None) -> ClipLlamaCLI:
    """Parse ``args`` (default ``sys.argv``) and run the subcommand."""
    return ClipLlamaCLI(
        ClipLlamaModule, DigitsCaptions, args=args,
        save_config_kwargs={"overwrite": True},
    )
