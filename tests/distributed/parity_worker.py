"""Workers shared by the distributed parity tests (importable by spawned processes)."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback, Trainer
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import DataLoader

from lightning_mmpar import MultimodalParallelStrategy
from lightning_mmpar.examples.toy_transformer import ToyConfig, ToyTransformer, make_tokens

GLOBAL_BATCH = 8
STEPS = 10


class LossRecorder(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def reference(steps: int = STEPS, cfg: ToyConfig | None = None) -> dict[str, Any]:
    """Plain single-process torch loop over the same global batches."""
    cfg = cfg or ToyConfig()
    torch.manual_seed(0)
    model = ToyTransformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    data = make_tokens(steps * GLOBAL_BATCH, cfg)
    # Lightning shards training data with DistributedSampler(shuffle=True, seed=0): the union
    # of the dp ranks' k-th batches is slice k of this permutation.
    data = data[torch.randperm(len(data), generator=torch.Generator().manual_seed(0))]
    losses = []
    for k in range(steps):
        batch = data[k * GLOBAL_BATCH : (k + 1) * GLOBAL_BATCH]
        loss = model.pipeline_loss(model(batch[:, :-1]), batch[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {
        "losses": losses,
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


def full_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    sd = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in sd.items()}


def fit_layout(
    rank: int,
    world: int,
    dp: int,
    pp: int,
    tp: int,
    schedule: str = "1f1b",
    v: int = 1,
    micro_batches: int | None = None,
    data_parallel: str = "fsdp",
    steps: int = STEPS,
) -> dict[str, Any]:
    cfg = ToyConfig()
    torch.manual_seed(0)
    model = ToyTransformer(cfg)
    data = make_tokens(steps * GLOBAL_BATCH, cfg)
    strategy = MultimodalParallelStrategy(
        tensor_parallel=tp,
        pipeline_parallel=pp,
        virtual_pipeline=v,
        schedule=schedule,
        micro_batches=micro_batches,
        data_parallel=data_parallel,
    )
    rec = LossRecorder()
    trainer = Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=world,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[rec],
    )
    trainer.fit(model, DataLoader(data, batch_size=GLOBAL_BATCH // dp))
    return {"losses": rec.losses, "weights": full_weights(model)}
