"""Non-colocated towers (issue 30): the vision tower on ranks of its own against one process,
on the ragged batches of :mod:`ragged_parity_worker` (text-only, one- and three-image samples;
a first-stage rank with no image in a micro-batch), one spawned world per size."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch.distributed as dist
from lightning.pytorch import Callback, Trainer
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_mmpar import MultimodalParallelStrategy
from lightning_mmpar.parallel.comm import to_local
from lightning_mmpar.parallel.comm_count import CommCounter
from lightning_mmpar.parallel.tensor import full_gradients, full_state_dict
from lightning_mmpar.parallel.towers import TowerExchange
from lightning_mmpar.recipes.faults import is_collective_failure
from lightning_mmpar.recipes.options import FinetuneConfig
from lightning_mmpar.topology import ParallelDims
from tests.recipes import parity_matrix_worker as pm
from tests.recipes import ragged_parity_worker as rp
from tests.recipes import recipe_faults_worker as rw


class Recorder(rw.Recorder):
    """Losses where a rank logs them (the language ranks), first-step gradients everywhere."""

    def __init__(self) -> None:
        super().__init__()
        self.stepped: dict[str, Tensor] = {}
        """Gradients as the first optimizer step used them (clipped)."""
        self.comm: dict[str, int] = {}
        """Bytes of step 2's collectives (:class:`StepComm`)."""
        self.trainable = 0
        """Bytes of this rank's trainable parameters (local tensors)."""
        self.state: dict[str, Tensor] = {}
        """This rank's full module state after the fit (a case that saves a checkpoint)."""

        self.val_losses: list[float] = []
        """``val_loss`` after each validation (validation inside accumulation windows)."""
        self.validated: dict[str, float] = {}
        """What ``trainer.validate`` returned after the fit (a case that validates)."""

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, *args: Any) -> None:
        if "train_loss" in trainer.callback_metrics:
            self.losses.append(float(trainer.callback_metrics["train_loss"]))
        if not self.stepped and trainer.global_step == 1:  # the first optimizer step's batch
            grads = full_gradients(pl_module)
            self.stepped = {name: g.detach().clone() for name, g in grads.items()}

    def on_validation_end(self, trainer: Trainer, pl_module: Any) -> None:
        fitting = trainer.state.fn == "fit"  # not the trainer.validate after the fit
        if fitting and not trainer.sanity_checking and "val_loss" in trainer.callback_metrics:
            self.val_losses.append(float(trainer.callback_metrics["val_loss"]))


class StopAt(Callback):
    """``trainer.should_stop`` after batch ``index`` (inside an accumulation window)."""

    def __init__(self, index: int) -> None:
        self.index = index

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, *args: Any) -> None:
        if args[-1] == self.index:
            trainer.should_stop = True


class StepComm(Callback):
    """Every collective of optimizer step 2 on this rank (from the end of batch 0 to the end
    of batch 1: one batch per step), by ``"<dim>.<kind>"`` (``CommCounter``; the vision
    ranks' own group, no mesh dimension, counts as ``other``)."""

    def __init__(self) -> None:
        self.counter: CommCounter | None = None
        self.bytes: dict[str, int] = {}

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, *args: Any) -> None:
        dims = getattr(trainer.strategy, "parallel_dims", None)
        if dims is None:  # the one-process reference: nothing to count
            return
        if args[-1] == 0:
            self.counter = CommCounter(dims).__enter__()
        elif args[-1] == 1 and self.counter is not None:
            self.on_train_end(trainer, pl_module)

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        """Close the count (a fit stopped before batch 1 counts what ran)."""
        if self.counter is not None:
            self.counter.__exit__(None, None, None)
            self.bytes, self.counter = dict(self.counter.bytes), None


@dataclass(frozen=True)
class Case:
    """One run: strategy arguments and training options."""

    name: str
    world: int
    strategy: dict[str, Any] = field(default_factory=dict)
    clip: float | None = None
    frozen: bool = False
    """The vision tower frozen (``finetune.train_vision=False``)."""
    vision_parallel: str = "tp"
    accumulate: int = 1
    """``accumulate_grad_batches``: the vision ranks encode one batch ahead inside a window."""
    validate: bool = False
    """A validation batch after every training batch (inside the accumulation windows)."""
    stop_after: int | None = None
    """Stop the fit after this batch (inside a window): the case checks the next ones run."""
    checkpoint: bool = False
    """Save a DCP checkpoint after the fit (under the world's directory) and return the
    module's full state (:func:`run`)."""

    @property
    def vision_ranks(self) -> int:
        return int(self.strategy.get("vision_ranks", 0))

    @property
    def reference(self) -> tuple[float | None, bool, int, bool]:
        """The one-process run it is compared with: ``(clip, frozen, accumulate, validate)``."""
        return self.clip, self.frozen, self.accumulate, self.validate


PP2 = pm._pp("1f1b", 2, 2, 1)
CASES: tuple[Case, ...] = (
    Case("1 vision + tp2", 3, {"vision_ranks": 1, "tensor_parallel": 2}),
    Case("2 vision (dp) + pp2", 4, {"vision_ranks": 2, **PP2}),
    Case("2 vision (dp) + pp2, clip 0.5", 4, {"vision_ranks": 2, **PP2}, clip=0.5),
    Case("2 vision (dp) + pp2, frozen tower", 4, {"vision_ranks": 2, **PP2}, frozen=True),
    Case(
        "2 vision FSDP + pp2, frozen tower",
        4,
        {"vision_ranks": 2, "vision_data_parallel": "fsdp", **PP2},
        frozen=True,
    ),
    Case("2 vision + dp2 (text-only replica)", 4, {"vision_ranks": 2}),
    Case(
        "2 vision FSDP + dp2 (text-only replica), clip 0.5",
        4,
        {"vision_ranks": 2, "vision_data_parallel": "fsdp"},
        clip=0.5,
        checkpoint=True,
    ),
    Case(
        "1 vision + tp2 x pp2", 5, {"vision_ranks": 1, **pm._pp("1f1b", 2, 2, 1, tensor_parallel=2)}
    ),
    # the tower one batch ahead inside accumulation windows (2 windows of 2 batches)
    Case(
        "1 vision + 1 language, stopped inside a window",
        2,
        {"vision_ranks": 1},
        accumulate=2,
        stop_after=0,
    ),
    Case(
        "1 vision + 1 language, accumulate 2, validation inside windows",
        2,
        {"vision_ranks": 1},
        accumulate=2,
        validate=True,
    ),
    Case(
        "1 vision + tp2, accumulate 2", 3, {"vision_ranks": 1, "tensor_parallel": 2}, accumulate=2
    ),
    Case("1 vision + dp2 (fan-in), accumulate 2", 3, {"vision_ranks": 1}, accumulate=2),
    Case("2 vision (dp) + pp2, accumulate 2", 4, {"vision_ranks": 2, **PP2}, accumulate=2),
    Case(  # vision rank 2 gets no image in the batch it encodes ahead: it joins the reduce
        "2 vision FSDP + dp2, accumulate 2",
        4,
        {"vision_ranks": 2, "vision_data_parallel": "fsdp"},
        accumulate=2,
    ),
    Case(
        "2 vision + dp2, accumulate 2, frozen tower",
        4,
        {"vision_ranks": 2},
        frozen=True,
        accumulate=2,
    ),
)
COLOCATED = Case(
    "colocated tp2, vision replicate", 2, {"tensor_parallel": 2}, vision_parallel="replicate"
)
"""The colocated layout whose arithmetic ``1 vision + tp2`` repeats on the language ranks."""


def fit(strategy: Any, world: int, case: Case, save: str | None = None) -> Recorder:
    """Two steps on the ragged batches (every rank the whole batch: one language replica; four
    batches in two windows when accumulating); ``save``: a checkpoint saved there afterwards,
    the full state in ``Recorder.state``."""
    module = pm.build(rp.VOCAB, None, vision_parallel=case.vision_parallel)
    module.text_length = rp.TOKENS
    if case.frozen:
        module.finetune = FinetuneConfig(train_decoder_layers=-1, train_embeddings=True)
    recorder = Recorder()
    counted = StepComm()
    stop = [] if case.stop_after is None else [StopAt(case.stop_after)]
    trainer = rw.quiet_trainer(
        strategy=strategy,
        devices=world,
        max_epochs=1,
        gradient_clip_val=case.clip,
        accumulate_grad_batches=case.accumulate,
        use_distributed_sampler=False,
        limit_val_batches=1 if case.validate else 0,
        val_check_interval=1 if case.validate else None,
        num_sanity_val_steps=0,
        callbacks=[recorder, counted, *stop],
    )
    data = _local(_batches(case.accumulate), case)
    val = DataLoader(data[:1], batch_size=None) if case.validate else None  # type: ignore[arg-type]
    trainer.fit(module, DataLoader(data, batch_size=None), val)  # type: ignore[arg-type]
    if val is not None and world > 1:  # every rank returns the language side's metrics
        (validated,) = trainer.validate(module, val, verbose=False)
        recorder.validated = {k: float(v) for k, v in validated.items()}
    if save is not None:
        trainer.save_checkpoint(save)
        recorder.state = full_state_dict(module)
    recorder.comm = counted.bytes
    local = [to_local(p) for p in module.parameters() if p.requires_grad]  # FSDP2: shards
    recorder.trainable = sum(t.numel() * t.element_size() for t in local)
    return recorder


def _batches(accumulate: int) -> list[dict[str, Any]]:
    """The ragged batches; accumulating, four (two windows) with every second batch's targets
    cut after token 12 (:func:`ragged_parity_worker.accumulation_batches`' reason)."""
    if accumulate == 1:
        return rp.batches()
    out = rp.batches(4)
    for b in out[1::2]:
        b["labels"][:, 12:] = -100
    return out


def _local(batches: list[dict[str, Any]], case: Case) -> list[dict[str, Any]]:
    """A language rank's dp slice (rows 0-1 / 2-3: step 1's second replica is text-only, so
    its vision rank encodes no image); a vision rank's loader only counts steps."""
    if case.world == 1:
        return batches
    s = case.strategy
    dims = ParallelDims(
        world_size=case.world - case.vision_ranks,
        tp=s.get("tensor_parallel", 1),
        pp=s.get("pipeline_parallel", 1),
    )
    rank = dist.get_rank()
    if rank >= dims.world_size:
        return batches
    return [pm.dp_slice(b, dims.dp, dims.rank_coords(rank)["dp"]) for b in batches]


def reference(clip: float | None, frozen: bool, accumulate: int, validate: bool) -> Recorder:
    """One process, the same batches and options (accumulating: under ``mm_parallel``, which
    counts each accumulation window's tokens first)."""
    case = Case("one process", 1, clip=clip, frozen=frozen, accumulate=accumulate)
    case = replace(case, validate=validate)
    return fit(MultimodalParallelStrategy() if accumulate > 1 else "auto", 1, case)


def run(case: Case, root: str) -> dict[str, Any]:
    start = time.perf_counter()
    save = os.path.join(root, f"world{case.world}.ckpt") if case.checkpoint else None
    strategy = MultimodalParallelStrategy(**case.strategy)
    rec = fit(strategy, case.world, case, save)
    exchange = strategy._exchange
    return {
        "checkpoint": save,
        "state": rec.state,
        "encoded_ahead": exchange.encoded_ahead if exchange is not None else 0,
        "losses": rec.losses,
        "val_losses": rec.val_losses,
        "validated": rec.validated,
        "grads": rec.grads,
        "stepped": rec.stepped,
        "comm": rec.comm,
        "trainable": rec.trainable,
        "seconds": time.perf_counter() - start,
    }


def world(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """The cases of this size on this rank: ``{case name: result}`` (checkpoints under
    ``root``)."""
    cases = [*CASES, COLOCATED]
    return {c.name: pm.named(c.name, rank, run, c, root) for c in cases if c.world == world_size}


def state_after(strategy: Any, world: int, resume: str | None, save: str | None) -> dict:
    """Fit (or resume from ``resume`` at the end of its epoch: no further step) and save at
    ``save``; this rank's module state."""
    module = pm.build(rp.VOCAB, None)
    module.text_length = rp.TOKENS
    trainer = rw.quiet_trainer(
        strategy=strategy,
        devices=world,
        max_epochs=1,
        use_distributed_sampler=False,
        limit_val_batches=0,
    )
    data = DataLoader(rp.batches(), batch_size=None)  # type: ignore[arg-type]
    trainer.fit(module, data, ckpt_path=resume)
    if save is not None:
        trainer.save_checkpoint(save)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def checkpoints(rank: int, world_size: int, colocated: str, noncolocated: str) -> dict:
    """1 vision + 1 language rank: resume the colocated checkpoint, then train afresh and save
    a non-colocated one; this rank's states."""
    return {
        "resumed": state_after(MultimodalParallelStrategy(vision_ranks=1), 2, colocated, None),
        "saved": state_after(MultimodalParallelStrategy(vision_ranks=1), 2, None, noncolocated),
    }


class _Died(Exception):
    """The vision rank's simulated death."""


def dead_vision_rank(rank: int, world_size: int) -> dict[str, Any]:
    """1 vision + 1 language rank; the vision rank dies at its second step (it raises before
    receiving the pixels and closes its connections, as a killed process's close). Returns the
    vision rank's time of death, or the language rank's error, whether the fault report counts
    it as a failed collective, and its time."""
    strategy = MultimodalParallelStrategy(vision_ranks=1)
    if rank == 1:
        encode, calls = TowerExchange.encode, []

        def dying(self: TowerExchange, tower: Any, *args: Any) -> Any:
            calls.append(1)
            if len(calls) == 2:
                raise _Died
            return encode(self, tower, *args)

        TowerExchange.encode = dying  # type: ignore[method-assign]
        try:
            fit(strategy, 2, Case("dead vision rank", 2, strategy={"vision_ranks": 1}))
        except _Died:
            died = time.time()
            dist.destroy_process_group()
            return {"died": died}
        return {"died": None}
    try:
        fit(strategy, 2, Case("dead vision rank", 2, strategy={"vision_ranks": 1}))
    except Exception as err:
        return {
            "error": repr(err)[:300],
            "collective": is_collective_failure(err),
            "at": time.time(),
        }
    return {"error": None}
