"""Workers shared by the distributed parity tests (importable by spawned processes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import DataLoader

from lightning_mmpar import MultimodalParallelStrategy
from lightning_mmpar.examples.toy_transformer import (
    Block,
    Embed,
    Head,
    ToyConfig,
    ToyTransformer,
    make_tokens,
)
from lightning_mmpar.parallel.tensor import full_gradients
from lightning_mmpar.plans.toy import block_plan

GLOBAL_BATCH = 8
STEPS = 10
EPOCH_STEPS = 5  # two epochs: resume starts from an end-of-epoch checkpoint
LAYOUTS = {"tp2pp2": (2, 2), "tp1pp1": (1, 1)}


class Recorder(Callback):
    """Logged loss per step and the full (unsharded) gradients of the first step."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grads: dict[str, Tensor] = {}

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: Any, optimizer: Any) -> None:
        if trainer.global_step == 0 and not self.grads:
            grads = full_gradients(pl_module)
            self.grads = {name: g.detach().clone() for name, g in grads.items()}

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def dataset(cfg: ToyConfig) -> Tensor:
    return make_tokens(EPOCH_STEPS * GLOBAL_BATCH, cfg)


class CollectiveProbe(Callback):
    """Exercise the strategy's collectives once the processes and mesh exist."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        s = trainer.strategy
        rank = float(trainer.global_rank)
        s.barrier("probe")
        self.seen = {
            "reduce_mean": float(s.reduce(torch.tensor(rank), reduce_op="mean")),
            "reduce_sum": float(s.reduce(torch.tensor(rank), reduce_op="sum")),
            "broadcast": s.broadcast({"from": trainer.global_rank}, src=0),
            "all_gather": s.all_gather(torch.tensor([rank])).flatten().tolist(),
            "sampler": s.distributed_sampler_kwargs,
            "coords": s.parallel_dims.rank_coords(trainer.global_rank),
        }


def global_batches(steps: int, cfg: ToyConfig) -> Tensor:
    """The data in the order Lightning's DistributedSampler(shuffle=True, seed=0) visits it: in
    epoch e the union of the dp ranks' k-th batches is slice k of randperm(seed=e)."""
    data = dataset(cfg)
    epochs = -(-steps // EPOCH_STEPS)
    orders = [
        torch.randperm(len(data), generator=torch.Generator().manual_seed(e)) for e in range(epochs)
    ]
    return torch.cat([data[o] for o in orders])


def reference(steps: int = STEPS, clip: float | None = None) -> dict[str, Any]:
    """Plain single-process torch loop (no Lightning, no strategy) over the same global batches."""
    cfg = ToyConfig()
    torch.manual_seed(0)
    model = ToyTransformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    data = global_batches(steps, cfg)
    with torch.no_grad():  # the initial model on the whole (validation) set
        rows = dataset(cfg)
        val_loss = model.pipeline_loss(model(rows[:, :-1]), rows[:, 1:]).item()
    losses, grads = [], {}
    for k in range(steps):
        batch = data[k * GLOBAL_BATCH : (k + 1) * GLOBAL_BATCH]
        loss = model.pipeline_loss(model(batch[:, :-1]), batch[:, 1:])
        opt.zero_grad()
        loss.backward()
        if k == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "grads": grads, "weights": weights, "val_loss": val_loss}


def full_weights(module: nn.Module) -> dict[str, Tensor]:
    sd = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in sd.items()}


def _trainer(
    strategy: Any, world: int, steps: int, callbacks: list[Any], clip: float | None = None
) -> Trainer:
    return Trainer(
        gradient_clip_val=clip,
        strategy=strategy,
        accelerator="cpu",
        devices=world,
        max_epochs=-(-steps // EPOCH_STEPS),
        logger=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        num_sanity_val_steps=0,
    )


def fit_layout(
    rank: int,
    world: int,
    dp: int,
    pp: int,
    tp: int,
    schedule: str = "1f1b",
    v: int = 1,
    data_parallel: str = "fsdp",
    steps: int = STEPS,
    clip: float | None = None,
) -> dict[str, Any]:
    """Validate the initial model, then train it, in one layout; return the validation loss,
    the training losses, the first-step gradients and the final weights."""
    cfg = ToyConfig()

    def run(fn: str, callbacks: list[Any]) -> tuple[ToyTransformer, Any]:
        torch.manual_seed(0)
        model = ToyTransformer(cfg)
        strategy = MultimodalParallelStrategy(
            tensor_parallel=tp,
            pipeline_parallel=pp,
            virtual_pipeline=v,
            schedule=schedule,
            micro_batches=2 * pp if pp > 1 else None,
            data_parallel=data_parallel,
        )
        trainer = _trainer(strategy, world, steps, callbacks, clip)
        loader = DataLoader(dataset(cfg), batch_size=GLOBAL_BATCH // dp)
        return model, getattr(trainer, fn)(model, loader)

    _, validated = run("validate", [])  # forward-only schedule
    rec = Recorder()
    model, _ = run("fit", [rec])
    return {
        "val_loss": validated[0]["val_loss"],
        "losses": rec.losses,
        "grads": rec.grads,
        "weights": full_weights(model),
    }


class PlainLM(LightningModule):
    """Written the ordinary Lightning way: no mm-specific code; TP in configure_model."""

    def __init__(self, cfg: ToyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Embed(cfg)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.head = Head(cfg)

    def configure_model(self) -> None:
        from torch.distributed.tensor.parallel import parallelize_module

        for block in self.layers:
            parallelize_module(block, self.device_mesh["tp"], block_plan())

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        for block in self.layers:
            x = block(x)
        return self.head(x)

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        logits = self(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.cfg.lr)


class LightningNamesLM(PlainLM):
    """Written for Lightning's own ``ModelParallelStrategy`` (its documented pattern): mesh
    dims ``"tensor_parallel"`` / ``"data_parallel"``, and the user's own ``fully_shard``."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import parallelize_module

        tp_mesh = self.device_mesh["tensor_parallel"]
        dp_mesh = self.device_mesh["data_parallel"]
        for block in self.layers:
            parallelize_module(block, tp_mesh, block_plan())
            fully_shard(block, mesh=dp_mesh)
        fully_shard(self.embed, mesh=dp_mesh)
        fully_shard(self.head, mesh=dp_mesh)


def fit_plain(
    rank: int, world: int, tp: int, data_parallel: str, lightning_names: bool = False
) -> dict[str, Any]:
    cfg = ToyConfig()
    torch.manual_seed(0)
    model = LightningNamesLM(cfg) if lightning_names else PlainLM(cfg)
    rec, probe = Recorder(), CollectiveProbe()
    strategy = MultimodalParallelStrategy(tensor_parallel=tp, data_parallel=data_parallel)
    trainer = _trainer(strategy, world, STEPS, [rec, probe])
    dp = world // tp
    trainer.fit(model, DataLoader(dataset(cfg), batch_size=GLOBAL_BATCH // dp))
    return {
        "losses": rec.losses,
        "grads": rec.grads,
        "weights": full_weights(model),
        "probe": probe.seen,
    }


def resume_and_reshard(rank: int, world: int, root: str) -> dict[str, Any]:
    """Save at step 5 in one layout, resume to step 10 in the same and in other layouts."""
    cfg = ToyConfig()
    out: dict[str, Any] = {}
    layouts = LAYOUTS
    for name, (tp, pp) in layouts.items():
        torch.manual_seed(0)
        model = ToyTransformer(cfg)
        strategy = MultimodalParallelStrategy(tensor_parallel=tp, pipeline_parallel=pp)
        trainer = _trainer(strategy, world, EPOCH_STEPS, [])
        dp = world // (tp * pp)
        trainer.fit(model, DataLoader(dataset(cfg), batch_size=GLOBAL_BATCH // dp))
        # saved after epoch 0 completed; resuming runs epoch 1 from its first batch
        trainer.save_checkpoint(Path(root) / name / "step=5.ckpt")
    for saved in layouts:
        for name, (tp, pp) in layouts.items():
            torch.manual_seed(1)  # different init: every weight must come from the checkpoint
            model = ToyTransformer(cfg)
            rec = Recorder()
            strategy = MultimodalParallelStrategy(tensor_parallel=tp, pipeline_parallel=pp)
            trainer = _trainer(strategy, world, STEPS, [rec])
            dp = world // (tp * pp)
            trainer.fit(
                model,
                DataLoader(dataset(cfg), batch_size=GLOBAL_BATCH // dp),
                ckpt_path=str(Path(root) / saved / "step=5.ckpt"),
            )
            out[f"{saved}->{name}"] = {"losses": rec.losses, "weights": full_weights(model)}
    return out


def pipeline_batch_sizes(rank: int, world: int) -> dict[str, Any]:
    """pp=2: validation with another batch size than training, then one that the micro-batches
    do not divide (its stages run in order: same loss)."""
    cfg = ToyConfig()
    out: dict[str, Any] = {}
    for batch_size in (4, 6):
        torch.manual_seed(0)
        model = ToyTransformer(cfg)
        strategy = MultimodalParallelStrategy(pipeline_parallel=2, micro_batches=4)
        trainer = _trainer(strategy, world, STEPS, [])
        try:
            out[batch_size] = trainer.validate(model, DataLoader(dataset(cfg), batch_size))
        except ValueError as err:
            out[batch_size] = str(err)
    # the same Trainer (and strategy) for fit, then validate: set-up runs once, not twice
    torch.manual_seed(0)
    model = ToyTransformer(cfg)
    strategy = MultimodalParallelStrategy(pipeline_parallel=2, tensor_parallel=world // 2)
    trainer = _trainer(strategy, world, STEPS, [])
    loader = DataLoader(dataset(cfg), batch_size=GLOBAL_BATCH)
    trainer.fit(model, loader)
    out["fit_then_validate"] = trainer.validate(model, loader)[0]["val_loss"]
    return out


def run_many(
    rank: int, world: int, jobs: list[tuple[str, str, tuple[Any, ...]]], root: str = ""
) -> dict[str, Any]:
    """Several fits in one world (process start-up dominates on small machines)."""
    fns = {
        "layout": fit_layout,
        "plain": fit_plain,
        "resume": resume_and_reshard,
        "batch_sizes": pipeline_batch_sizes,
    }
    out = {}
    for name, fn, args in jobs:
        extra = (root,) if fn == "resume" else ()
        out[name] = fns[fn](rank, world, *args, *extra)
    return out
