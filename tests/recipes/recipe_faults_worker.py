"""Shared pieces of the recipe-fault tests (importable by spawned processes).

A tiny fusion model in the recipe's :class:`ClipLlamaModule`, fixed batches of the digits data
(no sampler, so every layout sees the same global batches in the same order), a recorder of
logged losses and first-step gradients, and the 2-process world of the distributed checks.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_mmpar import MultimodalParallelStrategy
from lightning_mmpar.data.digits import DigitsCaptions
from lightning_mmpar.losses.mml import MMLConfig
from lightning_mmpar.models.fusion import FusionConfig
from lightning_mmpar.models.moe_routing import MoEConfig
from lightning_mmpar.parallel.tensor import full_gradients
from lightning_mmpar.recipes.module import ClipLlamaModule
from lightning_mmpar.recipes.options import (
    FinetuneConfig,
    FusionPlanOptions,
    LossConfig,
    OptimConfig,
)
from lightning_mmpar.testing import quiet_trainer
from tests.builders import tiny_fusion_config

BATCH = 8
TEXT_LENGTH = 12  # divisible by tp 2: sequence parallel shards the text along it
HEAD_WEIGHTS = ("image_head.weight", "text_head.proj.weight")


class SeededModule(ClipLlamaModule):
    """The recipe module with a seeded model build (same weights in every layout) and, with
    ``zero_momentum``, momentum heads started at zero (so each EMA step is visible)."""

    def __init__(self, *, zero_momentum: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.zero_momentum = zero_momentum

    def configure_model(self) -> None:
        if self.blocks is not None:
            return
        torch.manual_seed(0)
        super().configure_model()
        if self.zero_momentum:
            with torch.no_grad():
                for p in self.fusion_model.momentum_heads.parameters():
                    p.zero_()


def tiny_module(
    vocab_size: int,
    *,
    sequence_parallel: bool = False,
    lr: float = 1e-3,
    momentum: float = 0.995,
    logit_scale_init: float = 1 / 0.07,
    caption_weight: float = 3.0,
    mml_weight: float = 0.4,
    zero_momentum: bool = False,
    contrastive_weight: float = 1.0,
    moe: MoEConfig | None = None,
    vision_parallel: str = "tp",
    dropout: float = 0.0,
) -> SeededModule:
    """Every part trainable, adapter ``dropout`` (default 0), the CPU YAML's loss weights
    unless given; ``moe``: mixture-of-experts FFNs in the adapter and both decoder layers;
    ``vision_parallel``: the vision tower's layout under tensor parallelism (``tp``,
    ``replicate`` or ``dp``)."""
    return SeededModule(
        zero_momentum=zero_momentum,
        fusion=tiny_fusion(logit_scale_init=logit_scale_init, moe=moe, dropout=dropout),
        finetune=FinetuneConfig(train_vision=True, train_decoder_layers=-1, train_embeddings=True),
        loss=LossConfig(
            contrastive_weight=contrastive_weight,
            caption_weight=caption_weight,
            mml=MMLConfig(weight=mml_weight, momentum=momentum),
        ),
        optim=OptimConfig(lr=lr, weight_decay=0.01, warmup_steps=1, min_lr_ratio=1.0),
        plan=FusionPlanOptions(
            sequence_parallel=sequence_parallel,
            vision_parallel=vision_parallel,  # type: ignore[arg-type]
        ),
        vocab_size=vocab_size,
    )


def tiny_fusion(
    logit_scale_init: float = 1 / 0.07, moe: MoEConfig | None = None, dropout: float = 0.0
) -> FusionConfig:
    """The tiny fusion model of the recipe tests (the ``recipe`` preset of
    :func:`tests.builders.tiny_fusion_config`): 16 px images, 1 ViT layer, 2 joint-attention
    decoder layers, adapter ``dropout`` (default 0; 8 pipeline blocks); ``moe`` in the adapter
    and decoder."""
    return tiny_fusion_config(
        logit_scale_init=logit_scale_init,
        language__moe=moe,
        adapter__moe=moe,
        adapter__dropout=dropout,
    )


def digits() -> DigitsCaptions:
    data = DigitsCaptions(image_size=16, batch_size=BATCH, max_length=TEXT_LENGTH)
    data.setup()
    return data


def batches(data: DigitsCaptions, n: int, *, shuffle_pairs: bool = False) -> list[dict[str, Any]]:
    """The first ``n`` validation batches; ``shuffle_pairs`` pairs each image with another
    image's caption (seeded): nothing to align, so the data favours a small logit scale."""
    out = []
    g = torch.Generator().manual_seed(0)
    for batch, _ in zip(data.val_dataloader(), range(n), strict=False):
        if shuffle_pairs:
            perm = torch.randperm(BATCH, generator=g)
            for key in ("input_ids", "attention_mask", "target_ids"):
                batch[key] = batch[key][perm]
        out.append(batch)
    return out


class Recorder(Callback):
    """Logged ``train_loss`` per step, full first-step gradients, logit scale per step."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.terms: list[dict[str, float]] = []
        self.grads: dict[str, Tensor] = {}
        self.scales: list[float] = []

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: Any, optimizer: Any) -> None:
        if trainer.global_step == 0 and not self.grads:
            grads = full_gradients(pl_module)
            self.grads = {name: g.detach().clone() for name, g in grads.items()}

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, *args: Any) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))
        metrics = trainer.callback_metrics.items()
        self.terms.append({k[6:]: float(v) for k, v in metrics if k.startswith("train/")})
        if pl_module.head is not None:
            self.scales.append(float(pl_module.head.logit_scale.detach().exp()))


def fit(
    module: ClipLlamaModule,
    data: list[dict[str, Any]],
    *,
    strategy: Any = "auto",
    devices: int = 1,
    accumulate: int = 1,
    clip: float | None = None,
    callbacks: list[Callback] = (),  # type: ignore[assignment]
) -> Recorder:
    """Train on ``data`` (one epoch, in order; gradients clipped to a global norm ``clip``)
    and return the recorder."""
    recorder = Recorder()
    trainer = quiet_trainer(
        strategy=strategy,
        devices=devices,
        max_epochs=1,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
        use_distributed_sampler=False,
        limit_val_batches=0,
        callbacks=[recorder, *callbacks],
    )
    trainer.fit(module, DataLoader(data, batch_size=None))  # type: ignore[arg-type]
    assert trainer.global_step == len(data) // accumulate
    return recorder


def worst_gradient(got: dict[str, Tensor], want: dict[str, Tensor]) -> tuple[str, float]:
    """The parameter with the largest ``|a - b| / |b|`` (Frobenius norms) and that ratio.

    ``|b|`` is floored at 1e-6 of the largest gradient norm: gradients that are zero in exact
    arithmetic (a key bias under softmax: ~1e-13 here) are summation-order noise, not a
    signal.
    """
    floor = 1e-6 * max(float(g.norm()) for g in want.values())
    ratios = {n: float((got[n] - b).norm()) / max(float(b.norm()), floor) for n, b in want.items()}
    name = max(ratios, key=ratios.__getitem__)
    return name, ratios[name]


def check_parity(
    tag: str, name: str, results: list[dict[str, Any]], ref: Any, rtol: float = 1e-5
) -> None:
    """Assert a layout's per-rank ``results`` (``losses``, ``grads``, ``seconds``) equal the
    one-process ``ref`` (``losses``, ``grads``: every step's loss, the union of the ranks'
    gradients, relative ``rtol``); print the figures as ``tag | name | ...``."""
    grads: dict[str, Any] = {}
    loss_diff = 0.0
    for got in results:
        assert len(got["losses"]) == len(ref.losses), name
        for a, b in zip(got["losses"], ref.losses, strict=True):
            loss_diff = max(loss_diff, abs(a - b) / abs(b))
        grads.update(got["grads"])
    assert grads.keys() == ref.grads.keys(), (name, grads.keys() ^ ref.grads.keys())
    worst, ratio = worst_gradient(grads, ref.grads)
    took = max(r["seconds"] for r in results)
    print(f"{tag} | {name} | loss {loss_diff:.1e} | gradient {ratio:.1e} ({worst}) | {took:.1f} s")
    assert loss_diff <= rtol and ratio <= rtol, (name, loss_diff, worst, ratio)


def head_state(module: ClipLlamaModule) -> dict[str, Tensor]:
    """Live and momentum head weights and the log scale, from the rank owning the head."""
    head = module.head
    assert head is not None
    momentum = head.momentum.state_dict()
    return {
        "image_head": head.image_head.weight.detach().clone(),
        "text_head": head.text_head.proj.weight.detach().clone(),
        "momentum_image": momentum["image_head.weight"].clone(),
        "momentum_text": momentum["text_head.weight"].clone(),
        "log_scale": head.logit_scale.detach().clone(),
    }


def eval_outputs(module: ClipLlamaModule, batch: dict[str, Any]) -> dict[str, Tensor]:
    """Every :class:`FusionOutput` field of ``module`` in eval mode (the class-prompt stream
    included), full tensors."""
    module.eval()
    with torch.no_grad():
        out = module(batch)
    return {
        name: (t.full_tensor() if isinstance(t, DTensor) else t).clone()
        for name, t in out._asdict().items()
    }


def reference_eval(data: DigitsCaptions, batch: dict[str, Any]) -> dict[str, Tensor]:
    """:func:`eval_outputs` of the untrained tiny module on one process (no Trainer)."""
    module = tiny_module(data.vocab_size)
    module._trainer = SimpleNamespace(datamodule=data)  # type: ignore[assignment]
    module.configure_model()
    module.setup("validate")
    return eval_outputs(module, batch)


class Weights(Callback):
    """This rank's parameters and buffers (local shards) after every training batch, taken
    when the next batch starts (or training ends): after the module's own batch-end hook,
    which runs after the callbacks' and takes the EMA step of the momentum heads."""

    def __init__(self) -> None:
        self.after: list[dict[str, Tensor]] = []

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, idx: int) -> None:
        if idx > 0:
            self.after.append(trainable(pl_module, everything=True))

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        self.after.append(trainable(pl_module, everything=True))


def trainable(module: Any, everything: bool = False) -> dict[str, Tensor]:
    """Trainable parameters (``everything``: all parameters and buffers, the EMA heads too),
    local shards."""
    return {
        n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in [*module.named_parameters(), *module.named_buffers()]
        if everything or p.requires_grad
    }


def nan_pixel(data: DigitsCaptions, n: int, bad: int, on_rank: bool) -> list[dict[str, Any]]:
    """``batches(data, n)`` with one NaN pixel in batch ``bad`` when ``on_rank``."""
    out = batches(data, n)
    if on_rank:
        out[bad] = {**out[bad], "images": out[bad]["images"].clone()}
        out[bad]["images"][1, 0, 3, 5] = float("nan")
    return out


def nonfinite(rank: int, world_size: int, data: DigitsCaptions, root: str) -> dict[str, Any]:
    """Issue 15 item 5 at pp 2 (the loss on the last stage only), one NaN pixel in batch 1 on
    rank 0 (the first stage, which reads the images):

    * ``"raise"`` (the default): ``last.ckpt`` written after each step; the run stops at batch 1
      with the error message, weights as after step 1; then a NaN weight on rank 1: saving over
      ``last.ckpt`` is refused, and ``last.ckpt`` loads back the weights of step 1;
    * ``"skip"``: the weights after batch 1 (the EMA heads too) equal those after batch 0;
      batch 2 trains again.
    """
    out: dict[str, Any] = {}
    module = tiny_module(data.vocab_size)
    last = Path(root) / "last.ckpt"
    trainer = quiet_trainer(
        strategy=MultimodalParallelStrategy(pipeline_parallel=2, micro_batches=2),
        devices=world_size,
        max_epochs=1,
        use_distributed_sampler=False,
        limit_val_batches=0,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(root, save_last=True, save_top_k=0, every_n_train_steps=1)],
    )
    try:
        trainer.fit(module, DataLoader(nan_pixel(data, 2, 1, rank == 0), batch_size=None))  # type: ignore[arg-type]
    except RuntimeError as err:
        out["raised"] = str(err)
    out["step"] = trainer.global_step
    before = trainable(module)
    out["finite_before"] = all(bool(t.isfinite().all()) for t in before.values())
    name = next(iter(before))
    if rank == 1:
        with torch.no_grad():
            dict(module.named_parameters())[name].view(-1)[0] = float("nan")
    try:
        trainer.save_checkpoint(last)
    except RuntimeError as err:
        out["refused"] = str(err)
    out["nan_name"] = name
    out["ckpt_step"] = trainer.strategy.load_checkpoint(last)["global_step"]
    out["restored"] = all(torch.equal(before[n], t) for n, t in trainable(module).items())
    out["leftovers"] = sorted(p.name for p in Path(root).iterdir())
    module = tiny_module(data.vocab_size)
    weights, rec = Weights(), Recorder()
    trainer = quiet_trainer(
        strategy=MultimodalParallelStrategy(
            pipeline_parallel=2, micro_batches=2, on_nonfinite="skip"
        ),
        devices=world_size,
        max_epochs=1,
        use_distributed_sampler=False,
        limit_val_batches=0,
        callbacks=[weights, rec],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader(nan_pixel(data, 3, 1, rank == 0), batch_size=None))  # type: ignore[arg-type]
    w = weights.after
    out["skip"] = {
        "losses": rec.losses,
        "kept": all(torch.equal(w[0][n], t) for n, t in w[1].items()),
        "moved_after": any(not torch.equal(w[1][n], t) for n, t in w[2].items()),
        "finite": all(bool(t.isfinite().all()) for t in w[2].values()),
        "logged": float(trainer.callback_metrics["nonfinite_skipped_steps"]),
        "skipped": trainer.strategy.nonfinite.skipped,  # type: ignore[attr-defined]
        "warnings": [str(c.message) for c in caught if "Skipped the optimizer" in str(c.message)],
    }
    return out


class PoisonGradient(Callback):
    """Writes a NaN into one gradient at global step 1 when ``on_rank``, after backward (and
    after DDP's reduce), as a rank-local hook or a hardware fault would."""

    def __init__(self, on_rank: bool) -> None:
        self.on_rank = on_rank
        self.name = ""
        self.bucket_views = False

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: Any, optimizer: Any) -> None:
        if self.on_rank and trainer.global_step == 1:
            grads = [(n, p.grad) for n, p in pl_module.named_parameters() if p.grad is not None]
            # gradient_as_bucket_view: every gradient a view of one of DDP's flat buckets
            self.bucket_views = all(g._base is not None for _, g in grads)
            self.name, grad = grads[0]
            grad.view(-1)[0] = float("nan")


def _ddp_fit_error(
    world_size: int, loader: list[dict[str, Any]], data: DigitsCaptions, callbacks: Any = ()
) -> tuple[str | None, int]:
    """A fresh tiny module fitted on ``loader`` under ``data_parallel="ddp"`` (the guard's
    default ``"raise"``): its ``RuntimeError`` message (``None``: none) and the step reached."""
    module = tiny_module(data.vocab_size)
    trainer = quiet_trainer(
        strategy=MultimodalParallelStrategy(data_parallel="ddp"),
        devices=world_size,
        max_epochs=1,
        use_distributed_sampler=False,
        limit_val_batches=0,
        callbacks=list(callbacks),
    )
    try:
        trainer.fit(module, DataLoader(loader, batch_size=None))  # type: ignore[arg-type]
    except RuntimeError as err:
        return str(err), trainer.global_step
    return None, trainer.global_step


def nonfinite_ddp(rank: int, world_size: int, data: DigitsCaptions) -> dict[str, Any]:
    """The guard under ``data_parallel="ddp"`` at dp 2 (torch's DDP reduces the gradients, so
    every rank holds the NaN ones), one NaN pixel on rank 1 only:

    * ``"raise"``, 3 batches, NaN in batch 1: the error names rank 1's inputs, both ranks'
      losses (the contrastive term gathers rank 1's features) and both ranks' gradients;
    * a gradient made NaN on rank 1 only after DDP reduced it (:class:`PoisonGradient`): both
      ranks stop naming rank 1 and that parameter (a check that trusted DDP's reduced gradients
      to be the same on every rank left rank 0 stepping on while rank 1 waited on it); the
      gradients are views of DDP's buckets, which the guard's fast check reads;
    * ``"skip"``, ``accumulate_grad_batches=2``, 4 batches, NaN in batch 2 (the first of the
      second window: DDP's ``no_sync`` batch): step 1 skipped on both ranks, its report naming
      batch 2 on rank 1.
    """
    out: dict[str, Any] = {}
    out["raised"], out["step"] = _ddp_fit_error(world_size, nan_pixel(data, 3, 1, rank == 1), data)
    poison = [PoisonGradient(rank == 1)]
    out["poisoned"], _ = _ddp_fit_error(world_size, batches(data, 2), data, poison)
    out["poisoned_name"], out["bucket_views"] = poison[0].name, poison[0].bucket_views
    module = tiny_module(data.vocab_size)
    strategy = MultimodalParallelStrategy(data_parallel="ddp", on_nonfinite="skip")
    trainer = quiet_trainer(
        strategy=strategy,
        devices=world_size,
        max_epochs=1,
        use_distributed_sampler=False,
        limit_val_batches=0,
        accumulate_grad_batches=2,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader(nan_pixel(data, 4, 2, rank == 1), batch_size=None))  # type: ignore[arg-type]
    out["skipped"] = strategy.nonfinite.skipped  # type: ignore[union-attr]
    out["global_step"] = trainer.global_step
    out["warnings"] = [str(c.message) for c in caught if "Skipped the optimizer" in str(c.message)]
    return out


def world(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """The distributed checks in one 2-process world (``root``: a shared folder).

    * ``tp2_sp_eval``: the untrained recipe at tensor parallel 2 with sequence parallel,
      validated (class prompts from the data), then every output in eval mode: the fused,
      text-only and class-prompt streams;
    * ``tp2_sp``: the same layout trained 2 steps (losses and first-step gradients, compared
      with one process by the test);
    * ``pp2``: pipeline parallel 2, ``accumulate_grad_batches=2``, 4 batches, ``lr = 0`` (the
      live heads stay put), EMA momentum 0.5 from zero momentum heads, logit scale initialised
      at 200 (above the cap): the last stage must have clamped it and taken 2 EMA steps;
    * ``nonfinite``: :func:`nonfinite`; ``nonfinite_ddp``: :func:`nonfinite_ddp`.
    """
    data = digits()
    out: dict[str, Any] = {"rank": rank}
    module = tiny_module(data.vocab_size, sequence_parallel=True)
    trainer = quiet_trainer(
        strategy=MultimodalParallelStrategy(tensor_parallel=2),
        devices=world_size,
        limit_val_batches=1,
        use_distributed_sampler=False,
    )
    trainer.validate(module, datamodule=data)
    out["tp2_sp_eval"] = eval_outputs(module, batches(data, 1)[0])
    module = tiny_module(data.vocab_size, sequence_parallel=True)
    strategy = MultimodalParallelStrategy(tensor_parallel=2)
    rec = fit(module, batches(data, 2), strategy=strategy, devices=world_size)
    out["tp2_sp"] = {"losses": rec.losses, "grads": rec.grads}
    module = tiny_module(
        data.vocab_size, lr=0.0, momentum=0.5, logit_scale_init=200.0, zero_momentum=True
    )
    strategy = MultimodalParallelStrategy(pipeline_parallel=2, micro_batches=2)
    fit(module, batches(data, 4), strategy=strategy, devices=world_size, accumulate=2)
    out["pp2"] = head_state(module) if module.head is not None else None
    out["nonfinite"] = nonfinite(rank, world_size, data, root)
    out["nonfinite_ddp"] = nonfinite_ddp(rank, world_size, data)
    return out


MAX_LOG_SCALE = math.log(100.0)
