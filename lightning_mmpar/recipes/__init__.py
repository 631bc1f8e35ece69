"""The CLIP-LLaMA recipe: its LightningModule, LightningCLI, metrics, run summary and captions.

``python -m lightning_mmpar.recipes.clip_llama fit --config recipes/clip_llama_cpu.yaml``
(this package does not import ``clip_llama`` itself, so ``-m`` runs it cleanly).
"""

from lightning_mmpar.recipes.captions import CaptionWriter
from lightning_mmpar.recipes.cli import ClipLlamaCLI, RecipeDigitsCaptions, main, run_cli
from lightning_mmpar.recipes.config import (
    FinetuneConfig,
    LossConfig,
    OptimConfig,
    TensorParallelOptions,
    check_image_size,
)
from lightning_mmpar.recipes.deepspeed import (
    apply_deepspeed_json,
    optim_from_deepspeed,
    strategy_from_deepspeed,
)
from lightning_mmpar.recipes.evaluation import RecipeMetrics
from lightning_mmpar.recipes.generation import greedy_decode
from lightning_mmpar.recipes.module import ClipLlamaModule
from lightning_mmpar.recipes.preflight import preflight
from lightning_mmpar.recipes.summary import RunSummary
from lightning_mmpar.recipes.throughput import ThroughputProgressBar

__all__ = [
    "CaptionWriter",
    "ClipLlamaCLI",
    "ClipLlamaModule",
    "FinetuneConfig",
    "LossConfig",
    "OptimConfig",
    "RecipeDigitsCaptions",
    "RecipeMetrics",
    "RunSummary",
    "TensorParallelOptions",
    "ThroughputProgressBar",
    "apply_deepspeed_json",
    "check_image_size",
    "greedy_decode",
    "main",
    "optim_from_deepspeed",
    "preflight",
    "run_cli",
    "strategy_from_deepspeed",
]
