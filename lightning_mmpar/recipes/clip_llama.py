"""CLIP-ViT + adapter + LLaMA fine-tuning recipe: the entry point.

``python -m lightning_mmpar.recipes.clip_llama fit --config recipes/clip_llama_cpu.yaml``

The LightningModule lives in :mod:`lightning_mmpar.recipes.module`, the LightningCLI in
:mod:`lightning_mmpar.recipes.cli`; this module re-exports both and runs the CLI.
"""

from __future__ import annotations

from lightning_mmpar.recipes.cli import main
from lightning_mmpar.recipes.module import ClipLlamaModule

__all__ = ["ClipLlamaModule", "main"]

if __name__ == "__main__":
    main()
