"""The CLIP-LLaMA recipe: its LightningModule, LightningCLI, metrics, run summary and captions.

``python -m lightning_mmpar.recipes.clip_llama fit --config recipes/clip_llama_cpu.yaml``
(this package does not import ``clip_llama`` itself, so ``-m`` runs it cleanly).
"""

from lightning_mmpar.recipes.caption_writer import CaptionWriter
from lightning_mmpar.recipes.cli import ClipLlamaCLI, RecipeDigitsCaptions, main, run_cli
from lightning_mmpar.recipes.deepspeed_cli import (
    apply_deepspeed_json,
    optim_from_deepspeed,
    strategy_from_deepspeed,
)
from lightning_mmpar.recipes.evaluation import RecipeMetrics
from lightning_mmpar.recipes.export import ExportResult, export_checkpoint
from lightning_mmpar.recipes.generation import cached_greedy_decode, greedy_decode
from lightning_mmpar.recipes.metrics import ClassRecall
from lightning_mmpar.recipes.module import ClipLlamaModule
from lightning_mmpar.recipes.options import (
    FinetuneConfig,
    FusionPlanOptions,
    LossConfig,
    OptimConfig,
    PretrainedConfig,
    TensorParallelOptions,
    check_image_size,
)
from lightning_mmpar.recipes.preflight import preflight
from lightning_mmpar.recipes.qwen3_module import Qwen3MoeVLRecipeModule
from lightning_mmpar.recipes.qwen_module import QwenVLRecipeModule
from lightning_mmpar.recipes.summary import RunSummary
from lightning_mmpar.recipes.throughput import RecipeThroughput, ThroughputProgressBar

__all__ = [
    "CaptionWriter",
    "ClassRecall",
    "ClipLlamaCLI",
    "ClipLlamaModule",
    "ExportResult",
    "FinetuneConfig",
    "FusionPlanOptions",
    "LossConfig",
    "OptimConfig",
    "PretrainedConfig",
    "Qwen3MoeVLRecipeModule",
    "QwenVLRecipeModule",
    "RecipeDigitsCaptions",
    "RecipeMetrics",
    "RecipeThroughput",
    "RunSummary",
    "TensorParallelOptions",
    "ThroughputProgressBar",
    "apply_deepspeed_json",
    "cached_greedy_decode",
    "check_image_size",
    "export_checkpoint",
    "greedy_decode",
    "main",
    "optim_from_deepspeed",
    "preflight",
    "run_cli",
    "strategy_from_deepspeed",
]
