"""Shared pieces of the resume tests (importable by spawned processes).

Each scenario trains the recipe's tiny module (``tests/recipes/recipe_faults_worker.py``) on
the digits datamodule three times: ``N`` steps uninterrupted, ``K`` steps with a checkpoint at
step ``K`` (mid-epoch), and a resume from it to ``N``. Every rank records the batches it trains
on per step (sample fingerprints), the logged loss per step (with adapter dropout, the masks
decide it), the base seed of the training loader's workers per step, its final weights (full
tensors), and the state of its callbacks when saved and when restored.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_mmpar import MultimodalParallelStrategy
from lightning_mmpar.callbacks import FP8FallbackCallback, GradientDriftMonitor
from lightning_mmpar.data.digits import DigitsCaptions
from lightning_mmpar.testing import quiet_trainer
from tests.recipes import recipe_faults_worker as rw

BATCH = 4
EPOCH = 2  # batches per epoch and dp replica (limit_train_batches)
SAVE_AT = 3  # optimizer steps before the checkpoint: after batch 0 of the second epoch
STEPS = 5  # optimizer steps of a whole run: the resumed run crosses into the third epoch
DROPOUT = 0.3  # adapter dropout of the distributed runs: their losses depend on the masks


def fingerprint(batch: dict[str, Tensor]) -> list[tuple[int, float]]:
    """Per sample: its label and the sum of its pixels (identifies a digit image)."""
    sums = batch["images"].flatten(1).sum(1)
    return [(int(y), round(float(s), 3)) for y, s in zip(batch["labels"], sums, strict=True)]


class RankState(Callback):
    """State that depends on the rank: batches seen here and the rank itself.

    Also records what the trainer's other callbacks hold when a checkpoint is written and right
    after one is restored (``on_train_start`` runs after Lightning restored callbacks).
    """

    def __init__(self, rank: int) -> None:
        self.rank, self.seen = rank, 0
        self.batches: list[tuple[int, list[tuple[int, float]]]] = []
        self.losses: list[float] = []
        self.worker_seeds: list[int | None] = []
        self.at_save: dict[str, Any] = {}
        self.at_start: dict[str, Any] = {}

    def _others(self, trainer: Trainer) -> dict[str, Any]:
        out: dict[str, Any] = {"rank_state": self.state_dict()}
        for cb in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(cb, GradientDriftMonitor | FP8FallbackCallback):
                out[type(cb).__name__] = cb.state_dict()
        return copy.deepcopy(out)  # state dicts may hold live references

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.at_start = self._others(trainer)

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, i: int) -> None:
        self.batches.append((trainer.global_step, fingerprint(batch)))
        self.seen += len(batch["labels"])
        self.worker_seeds.append(loader_base_seed(trainer))

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, *args: Any) -> None:
        loss = trainer.callback_metrics.get("train_loss")
        self.losses.append(float("nan") if loss is None else float(loss))
        if trainer.global_step == SAVE_AT - 1:  # a per-rank FP8 decision before the save
            for cb in trainer.callbacks:  # type: ignore[attr-defined]
                if isinstance(cb, FP8FallbackCallback):
                    cb.fallen = {f"stage_of_rank_{self.rank}"}

    def on_save_checkpoint(self, trainer: Trainer, pl_module: Any, checkpoint: Any) -> None:
        self.at_save = self._others(trainer)

    def state_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "seen": self.seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.rank, self.seen = state_dict["rank"], state_dict["seen"]


def loader_base_seed(trainer: Trainer) -> int | None:
    """The base seed of the training loader's current iterator (``DataLoader``'s
    ``_base_seed``: worker ``i`` is seeded ``base + i``); ``None`` without workers."""
    fetcher = trainer.fit_loop._data_fetcher
    combined = getattr(fetcher, "_combined_loader", None)
    iterators = getattr(getattr(combined, "_iterator", None), "iterators", [])
    seeds = [getattr(it, "_base_seed", None) for it in iterators]
    workers = [getattr(it, "_num_workers", 0) for it in iterators]
    return seeds[0] if seeds and workers[0] else None


def full_weights(module: Any) -> dict[str, Tensor]:
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in module.named_parameters()
    }


def train(
    root: Path,
    rank: int,
    *,
    steps: int,
    devices: int = 1,
    layout: dict[str, int] | None = None,
    num_workers: int = 0,
    ckpt_path: str | None = None,
    save: bool = False,
    fp8: bool = False,
    dropout: float = 0.0,
    accumulate: int = 1,
    epoch: int = EPOCH,
    save_every: int = SAVE_AT,
) -> dict[str, Any]:
    """One run (adapter ``dropout``; ``layout`` None: Lightning's own strategy, else
    ``mm_parallel`` with it, ``{}`` on one process); returns the recorder's batches, losses,
    worker seeds and callback states and the final weights."""
    seed_everything(0, workers=True)
    data = DigitsCaptions(
        image_size=16, batch_size=BATCH, max_length=rw.TEXT_LENGTH, num_workers=num_workers
    )
    module = rw.tiny_module(data.vocab_size, dropout=dropout)
    recorder = RankState(rank)
    callbacks: list[Callback] = [
        recorder,
        GradientDriftMonitor(log_dir=str(root), log_metrics=False),
    ]
    if fp8:
        callbacks.append(FP8FallbackCallback())
    if save:
        every = save_every
        callbacks.append(ModelCheckpoint(dirpath=root, filename="mid", every_n_train_steps=every))
    trainer = quiet_trainer(
        strategy=MultimodalParallelStrategy(**layout) if layout is not None else "auto",
        devices=devices,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        limit_train_batches=epoch,
        limit_val_batches=0,
        enable_checkpointing=save,
        default_root_dir=root,
        callbacks=callbacks,
    )
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    assert trainer.global_step == steps
    return {
        "batches": recorder.batches,
        "losses": recorder.losses,
        "worker_seeds": recorder.worker_seeds,
        "at_save": recorder.at_save,
        "at_start": recorder.at_start,
        "weights": full_weights(module),
    }


def resume_runs(root: Path, rank: int, **kwargs: Any) -> dict[str, Any]:
    """Uninterrupted ``STEPS``, then ``SAVE_AT`` + checkpoint, then resume to ``STEPS``."""
    full = train(root / "full", rank, steps=STEPS, **kwargs)
    part = train(root / "part", rank, steps=SAVE_AT, save=True, **kwargs)
    ckpt = str(root / "part" / "mid.ckpt")
    resumed = train(root / "resumed", rank, steps=STEPS, ckpt_path=ckpt, **kwargs)
    return {"full": full, "part": part, "resumed": resumed}


def accumulation_runs(root: Path) -> dict[str, Any]:
    """``mm_parallel`` on one process, ``accumulate_grad_batches=2``, 5 batches per epoch
    (accumulation windows of 2, 2 and 1 batches, each fetched whole before its first batch):
    4 steps uninterrupted, 2 steps and a checkpoint (mid-epoch, after batch 3), a resume to 4."""
    kwargs: dict[str, Any] = {"layout": {}, "accumulate": 2, "epoch": 5, "save_every": 2}
    full = train(root / "full", 0, steps=4, **kwargs)
    part = train(root / "part", 0, steps=2, save=True, **kwargs)
    saved = str(root / "part" / "mid.ckpt")
    resumed = train(root / "resumed", 0, steps=4, ckpt_path=saved, **kwargs)
    return {"full": full, "part": part, "resumed": resumed}


def world(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Both distributed layouts in one 2-process world, adapter dropout 0.3 (masks drawn from
    the model-parallel tracker's regions):

    * ``dp2``: FSDP2 data parallel, ``num_workers=0`` (ranks see different shards);
    * ``pp2``: pipeline parallel 2, ``num_workers=2`` (both stages see the same batches), with
      the FP8 fallback callback holding a different decision on each rank.
    """
    shared = Path(root)
    dp2 = resume_runs(
        shared / "dp2",
        rank,
        devices=world_size,
        layout={"data_parallel": "fsdp"},
        dropout=DROPOUT,
    )
    pp2 = resume_runs(
        shared / "pp2",
        rank,
        devices=world_size,
        layout={"pipeline_parallel": 2},
        num_workers=2,
        fp8=True,
        dropout=DROPOUT,
    )
    return {"dp2": dp2, "pp2": pp2}
