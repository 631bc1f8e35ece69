"""CLIP-ViT + adapter + LLaMA fine-tuning recipe: the entry point.

``python -m lightning_mmpar.recipes.clip_llama fit --config recipes/clip_llama_cpu.yaml``

``fit``, ``validate``, ``test`` and ``predict`` run the LightningCLI
(:mod:`lightning_mmpar.recipes.cli`; the LightningModule is
:mod:`lightning_mmpar.recipes.module`); ``export --ckpt <dir> --out <dir>`` writes a checkpoint
as transformers / open_clip / safetensors files (:mod:`lightning_mmpar.recipes.export`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from torch.distributed.elastic.multiprocessing.errors import record

from lightning_mmpar.recipes import export
from lightning_mmpar.recipes.cli import main as cli_main
from lightning_mmpar.recipes.module import ClipLlamaModule

__all__ = ["ClipLlamaModule", "main"]


def main(args: Sequence[str] | None = None) -> None:
    """``export ...`` -> :func:`lightning_mmpar.recipes.export.main` (argparse); anything else
    -> the LightningCLI (``fit``, ``validate``, ``test``, ``predict``).

    Run as ``python -m`` (or under torchrun), it is wrapped in torch elastic's ``record``: an
    error raised here goes to the rank's error file, so torchrun's failure summary shows that
    rank's exception (else ``<N/A>``); a failed collective is reported by
    :mod:`lightning_mmpar.recipes.faults` and exits 1 instead.
    """
    argv = list(sys.argv[1:] if args is None else args)
    if argv[:1] == ["export"]:
        export.main(argv[1:])
        return
    cli_main(None if args is None else argv)


if __name__ == "__main__":
    record(main)()
