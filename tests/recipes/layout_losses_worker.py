"""The 2-process world of the layout-independent loss tests (importable by spawned processes).

Every run trains the recipe's tiny module (``recipe_faults_worker.tiny_module``: the CPU YAML's
loss weights, dropout 0) for 2 AdamW steps on the digits captions (variable lengths), then
validates one batch, and returns the logged losses, loss terms, first-step gradients and
validation values; the test compares them with one process.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

from lightning_mmpar import MultimodalParallelStrategy
from lightning_mmpar.recipes.losses import TERMS
from lightning_mmpar.testing import quiet_trainer
from tests.recipes import recipe_faults_worker as rw

STEPS = 2
ROWS = rw.BATCH


class LoggingModule(rw.SeededModule):
    """The seeded recipe module that also keeps every logged ``train/<term>`` per step.

    Its momentum heads start from other (seeded) weights than the live heads: the MML term is a
    KL between their similarity distributions, which for heads one EMA step apart is ~4e-4,
    a difference of nearly equal numbers whose relative rounding error exceeds 1e-5; from
    distinct heads it is a well-conditioned value."""

    def configure_model(self) -> None:
        if self.blocks is not None:
            return
        super().configure_model()
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in self.fusion_model.momentum_heads.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.train_terms: list[dict[str, float]] = []

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if name == f"train/{TERMS[0]}":
            self.train_terms.append({})
        if name.startswith("train/"):
            self.train_terms[-1][name] = float(value)
        super().log(name, value, *args, **kwargs)


def module(vocab_size: int, *, negatives: str = "global_batch") -> LoggingModule:
    """``rw.tiny_module``'s configuration in a :class:`LoggingModule`."""
    base = rw.tiny_module(vocab_size)
    base.loss_config.negatives = negatives  # type: ignore[assignment]
    return LoggingModule(
        fusion=base.fusion_config,
        finetune=base.finetune,
        loss=base.loss_config,
        optim=base.optim,
        plan=base.plan_options,
        vocab_size=vocab_size,
    )


def data_of(rank: int, dp: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``STEPS`` training batches and one validation batch; rank ``r`` of ``dp`` gets rows
    ``[r * B / dp, (r + 1) * B / dp)`` of each."""
    all_batches = rw.batches(rw.digits(), STEPS + 1)
    n = ROWS // dp
    mine = [{k: v[rank * n : (rank + 1) * n] for k, v in b.items()} for b in all_batches]
    return mine[:STEPS], mine[STEPS:]


def run(
    net: LoggingModule,
    strategy: Any,
    devices: int,
    rank: int = 0,
    dp: int = 1,
    val: bool = True,
) -> dict[str, Any]:
    """Fit ``STEPS`` steps (then validate one batch) and return what was logged."""
    train, valid = data_of(rank, dp)
    recorder = rw.Recorder()
    trainer = quiet_trainer(
        strategy=strategy,
        devices=devices,
        max_epochs=1,
        use_distributed_sampler=False,
        limit_val_batches=1 if val else 0,
        callbacks=[recorder],
    )
    val_loader = DataLoader(valid, batch_size=None) if val else None  # type: ignore[arg-type]
    trainer.fit(net, DataLoader(train, batch_size=None), val_loader)  # type: ignore[arg-type]
    values = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val")}
    return {
        "losses": recorder.losses,
        "terms": net.train_terms,
        "grads": recorder.grads,
        "val": values,
    }


def pp2(vocab: int, micro_batches: int, schedule: str, **kwargs: Any) -> dict[str, Any]:
    strategy = MultimodalParallelStrategy(
        pipeline_parallel=2, micro_batches=micro_batches, schedule=schedule
    )
    return run(module(vocab, **kwargs), strategy, 2)


def world(rank: int, world_size: int) -> dict[str, Any]:
    """Every distributed run of the test in one 2-process world (see the test's docstring)."""
    vocab = rw.digits().vocab_size
    out: dict[str, Any] = {"rank": rank}
    out["pp2_mb2"] = pp2(vocab, 2, "1f1b")
    out["pp2_mb4"] = pp2(vocab, 4, "gpipe")
    out["pp2_mb2_micro"] = pp2(vocab, 2, "1f1b", negatives="micro_batch")
    ddp = MultimodalParallelStrategy(data_parallel="ddp")
    out["dp2_mm"] = run(module(vocab), ddp, 2, rank, 2)
    out["dp2_lightning_ddp"] = run(module(vocab), "ddp", 2, rank, 2)
    return out
