"""transformers' LLaVA trained through the recipe (issue 29 item 3): the module reads a tiny
``LlavaForConditionalGeneration`` directory (``model.pretrained.hf``, each rank its own
slices) and trains on packed ragged batches mixing text-only, one-image and two-image
samples in tp2, pp2, tp2 x pp2 and dp2 FSDP2; each layout's first-step logits, losses and
first-step gradients equal one process (whose logits equal transformers', the test checks).

The layouts run inside the ragged-parity worlds (:mod:`ragged_parity_worker`), one spawned
world per process count.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_mmpar import MultimodalParallelStrategy
from lightning_mmpar.data.packing import MultimodalCollator
from lightning_mmpar.losses.mml import MMLConfig
from lightning_mmpar.recipes.options import (
    FinetuneConfig,
    FusionPlanOptions,
    LossConfig,
    OptimConfig,
    PretrainedConfig,
)
from tests.builders import LLAVA_IMAGE_TOKEN, llava_samples, tiny_llava_dir
from tests.recipes import parity_matrix_worker as pm
from tests.recipes import recipe_faults_worker as rw

TOKENS, SLOTS, ROWS = 48, 2, 4
IMAGES = ((1, 0), (2,), (0, 1), (0, 0, 0))  # images of each row's packed samples
"""Rows of a global batch: dp2 gives rank 1 a text-only row beside a one-image row."""
SAVED = ("llava tp2", "llava dp2 fsdp")
"""Layouts that write ``last.ckpt`` after training (the export test reads them)."""
LAYOUTS: tuple[pm.Layout, ...] = (
    pm.Layout("llava tp2", 2, {"tensor_parallel": 2}),
    pm.Layout("llava pp2 1f1b", 2, pm._pp("1f1b", 2, 2, 1)),
    pm.Layout("llava dp2 fsdp", 2, {"data_parallel": "fsdp"}),
    pm.Layout("llava tp2 x pp2", 4, pm._pp("1f1b", 2, 2, 1, tensor_parallel=2)),
)


def checkpoint() -> Path:
    """The tiny LLaVA directory, written by (global) rank 0 (transformers' ``save_pretrained``
    writes on rank 0 only once a process group exists) and shared."""
    return _shared(lambda: tiny_llava_dir(Path(tempfile.mkdtemp(prefix="llava"))))


def _shared(make: Callable[[], Path]) -> Path:
    """``make()`` on (global) rank 0, its result on every rank."""
    if not dist.is_initialized():
        return make()
    where = [make() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(where, src=0)
    assert where[0] is not None
    return where[0]


class SaveAtEnd(Callback):
    """``trainer.save_checkpoint(path)`` (a sharded DCP directory under ``mm_parallel``) once
    training ends."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        trainer.save_checkpoint(self.path)


def batches(steps: int = 2) -> list[dict[str, Tensor]]:
    """``steps`` global batches of :data:`ROWS` rows, fixed shapes (pipeline-ready)."""
    collate = MultimodalCollator(
        max_tokens=TOKENS,
        image_token_id=LLAVA_IMAGE_TOKEN,
        image_seq_length=16,
        max_images_per_row=SLOTS,
        pad_to_max_tokens=True,
    )
    out = []
    for step in range(steps):
        rows = []
        for r, images in enumerate(IMAGES):
            row = collate(llava_samples(images, seed=10 * step + r, length=4))
            assert row["input_ids"].shape[0] == 1
            rows.append(row)
        out.append({k: torch.cat([row[k] for row in rows]) for k in rows[0]})
    return out


class LlavaModule(rw.SeededModule):
    """The recipe module on the LLaVA checkpoint; records the logits of the first step's
    (micro-)batches on the rank that computes them (full tensors, vocabulary gathered)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.first_logits: list[Tensor] = []

    def pipeline_micro_loss(self, output: tuple[Tensor, ...], target: Tensor) -> Tensor:
        if self.training and self.trainer.global_step == 0:
            logits = output[0]
            full = logits.full_tensor() if isinstance(logits, DTensor) else logits
            self.first_logits.append(full.detach().clone())
        return super().pipeline_micro_loss(output, target)


def module(path: Path) -> LlavaModule:
    """Every part trainable, the caption loss alone (LLaVA's objective)."""
    return LlavaModule(
        pretrained=PretrainedConfig(hf=str(path)),
        finetune=FinetuneConfig(train_vision=True, train_decoder_layers=-1, train_embeddings=True),
        loss=LossConfig(
            contrastive_weight=0.0,
            caption_weight=1.0,
            mml=MMLConfig(weight=0.0),
            negatives="micro_batch",
        ),
        optim=OptimConfig(lr=1e-3, weight_decay=0.01, warmup_steps=1, min_lr_ratio=1.0),
        plan=FusionPlanOptions(),
        vocab_size=64,
    )


def run(layout: pm.Layout | None, rank: int = 0) -> dict[str, Any]:
    """Train ``layout`` (``None``: one process) on this rank: losses, first-step gradients,
    the first step's logits (this rank's rows, where computed), the checkpoint bytes this rank
    read, the seconds taken and, for :data:`SAVED` layouts, ``(last.ckpt, the LLaVA
    directory)``."""
    start = time.perf_counter()
    data = batches()
    strategy: Any = "auto"
    devices = 1
    if layout is not None:
        dp = layout.dims.dp
        data = [pm.dp_slice(b, dp, layout.dims.rank_coords(rank)["dp"]) for b in data]
        strategy, devices = MultimodalParallelStrategy(**layout.strategy), layout.world
    source = checkpoint()
    m = module(source)
    m.text_length = TOKENS
    saved = layout is not None and layout.name in SAVED
    ckpt = _shared(lambda: Path(tempfile.mkdtemp(prefix="llava-run")) / "last.ckpt")
    callbacks = [SaveAtEnd(ckpt)] if saved else []
    rec = rw.fit(m, data, strategy=strategy, devices=devices, callbacks=callbacks)
    logits = torch.cat(m.first_logits) if m.first_logits else None
    took = time.perf_counter() - start
    read = m.load_report.bytes_read if m.load_report else 0
    return {
        "losses": rec.losses,
        "grads": rec.grads,
        "logits": logits,
        "seconds": took,
        "bytes_read": read,
        "checkpoint": (ckpt, source) if saved else None,
    }


def world(rank: int, world_size: int) -> dict[str, Any]:
    """Every LLaVA layout of this world size: ``{layout name: result}``."""
    names = pm.only()
    chosen = [x for x in LAYOUTS if x.world == world_size and (not names or x.name in names)]
    return {x.name: pm.named(x.name, rank, run, x, rank) for x in chosen}
