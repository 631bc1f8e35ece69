"""The loss of a step is the mean over its target tokens, for a user's own modules.

One 2-rank gloo world runs every check against a single-process reference computed here (the
mean over every target token of the step, labels ``-100`` elsewhere): the logged loss and every
gradient within 1e-5 relative.

* pp 2, 1F1B, 2 micro-batches of 10 and 3 target tokens: a ``pipeline_loss`` returning
  :func:`~lightning_mmpar.losses.caption_loss` gets the token mean; a plain scalar mean stays
  the mean of micro-batch means (documented; the check can tell the two apart);
* pp 2 with a micro-batch of no target token;
* dp 2 DDP, ``accumulate_grad_batches=2``: a ``pipeline_loss`` returning ``(sum, count)``,
  batches of 9, 0 (rank 0) and 1, 10 (rank 1) target tokens;
* dp 2 FSDP2, ``accumulate_grad_batches=2``: a module's own ``training_step`` returning
  ``caption_loss``, the same batches.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn

from lightning_mmpar import MultimodalParallelStrategy
from lightning_mmpar.losses import IGNORE_INDEX, caption_loss
from lightning_mmpar.parallel.pipeline import PipelineSteps
from lightning_mmpar.testing import quiet_trainer, spawn

pytestmark = pytest.mark.distributed

VOCAB, DIM, SEQ = 16, 8, 6
PP_ROWS = [5, 5, 1, 2]  # target tokens per row: micro-batches of 10 and 3 tokens
PP_ZERO_ROWS = [4, 3, 0, 0]  # second micro-batch: no target token
DP_BATCHES = [[[5, 4], [0, 0]], [[1, 0], [5, 5]]]  # [rank][batch][row]


def make_batch(tokens_per_row: list[int], seed: int) -> dict[str, Tensor]:
    """Rows of ``SEQ`` ids; ``labels`` keep ``tokens_per_row[i]`` scored targets (positions
    1.. after the shift), chosen at random, and ``-100`` elsewhere."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (len(tokens_per_row), SEQ), generator=g)
    labels = torch.full_like(ids, IGNORE_INDEX)
    for row, n in enumerate(tokens_per_row):
        keep = 1 + torch.randperm(SEQ - 1, generator=g)[:n]
        labels[row, keep] = ids[row, keep]
    return {"ids": ids, "labels": labels}


class Mix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.lin(x)) + x


class Net(LightningModule):
    """Embedding, two mixing blocks, LM head; records its gradients before each step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Mix(), Mix()])
        self.head = nn.Linear(DIM, VOCAB)
        self.grads: dict[str, Tensor] = {}

    def forward(self, ids: Tensor) -> Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        for name, p in self.named_parameters():
            if p.grad is not None:
                g = p.grad
                self.grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).clone()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class OwnStep(Net):
    """A module's own training step returning the package's caption loss."""

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return caption_loss(self(batch["ids"]), batch["labels"])


class Pipelined(PipelineSteps, Net):
    """A PipelineModule; ``kind``: ``caption`` (caption_loss), ``pair`` ((sum, count)) or
    ``plain`` (a plain scalar mean)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def pipeline_blocks(self) -> list[nn.Module]:
        return [self.embed, *self.layers, self.head]

    def pipeline_inputs(self, batch: dict[str, Tensor]) -> tuple[tuple[Tensor, ...], Tensor]:
        return (batch["ids"],), batch["labels"]

    def pipeline_loss(self, logits: Tensor, labels: Tensor) -> Any:
        if self.kind == "caption":
            return caption_loss(logits, labels)
        flat, target = logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1)
        if self.kind == "pair":
            total = F.cross_entropy(flat, target, reduction="sum")
            return total, (target != IGNORE_INDEX).sum()
        return F.cross_entropy(flat, target)


def reference(batches: list[dict[str, Tensor]]) -> tuple[float, dict[str, Tensor]]:
    """Token mean over every batch on one process, and its gradients."""
    net = Net()
    total = sum(
        (
            F.cross_entropy(
                net(b["ids"])[:, :-1].reshape(-1, VOCAB),
                b["labels"][:, 1:].reshape(-1),
                reduction="sum",
            )
            for b in batches
        ),
        torch.zeros(()),
    )
    count = sum(int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in batches)
    loss = total / count
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in net.named_parameters()}


def fit(module: Net, batches: list[dict[str, Tensor]], accumulate: int, **layout: Any) -> Any:
    strategy = MultimodalParallelStrategy(**layout)
    trainer = quiet_trainer(
        strategy=strategy,
        devices=2,
        max_steps=1,
        accumulate_grad_batches=accumulate,
        use_distributed_sampler=False,
    )
    loader = torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)
    trainer.fit(module, loader)
    logged = trainer.callback_metrics.get("train_loss")
    return {"loss": None if logged is None else float(logged), "grads": module.grads}


def checks(rank: int, world: int) -> dict[str, Any]:
    pp = {"pipeline_parallel": 2, "micro_batches": 2, "schedule": "1f1b"}
    dp_batches = [make_batch(rows, seed=10 * rank + i) for i, rows in enumerate(DP_BATCHES[rank])]
    return {
        "pp_caption": fit(Pipelined("caption"), [make_batch(PP_ROWS, 1)], 1, **pp),
        "pp_plain": fit(Pipelined("plain"), [make_batch(PP_ROWS, 1)], 1, **pp),
        "pp_zero": fit(Pipelined("caption"), [make_batch(PP_ZERO_ROWS, 2)], 1, **pp),
        "ddp_pair": fit(Pipelined("pair"), dp_batches, 2, data_parallel="ddp"),
        "fsdp_own": fit(OwnStep(), dp_batches, 2, data_parallel="fsdp"),
    }


def _close(name: str, grads: dict[str, Tensor], ref: dict[str, Tensor]) -> None:
    assert grads.keys() == ref.keys(), f"{name}: gradients of {sorted(grads)}"
    for key, g in grads.items():
        scale = float(ref[key].abs().max())
        torch.testing.assert_close(
            g, ref[key], rtol=1e-5, atol=1e-5 * scale, msg=lambda m, k=key: f"{name} {k}: {m}"
        )


def _micro_means(batch: dict[str, Tensor]) -> float:
    net = Net()
    with torch.no_grad():
        means = [
            float(caption_loss(net(batch["ids"][i : i + 2]), batch["labels"][i : i + 2]))
            for i in (0, 2)
        ]
    return sum(means) / 2


def test_loss_is_the_mean_over_the_steps_target_tokens() -> None:
    pp_batch, zero_batch = make_batch(PP_ROWS, 1), make_batch(PP_ZERO_ROWS, 2)
    dp_all = [
        make_batch(rows, seed=10 * r + i) for r in (0, 1) for i, rows in enumerate(DP_BATCHES[r])
    ]
    results = spawn(checks, 2, timeout=300)
    # pp 2: stage 0's parameters on rank 0, stage 1's on rank 1; the loss on both
    ref_loss, ref_grads = reference([pp_batch])
    before = _micro_means(pp_batch)
    assert abs(before - ref_loss) / ref_loss > 1e-3  # the check tells the two means apart
    for kind in ("pp_caption", "pp_plain"):
        want = ref_loss if kind == "pp_caption" else before
        for r in results:
            assert abs(r[kind]["loss"] - want) / want < 1e-5, f"{kind}: {r[kind]['loss']} vs {want}"
    _close(
        "pp_caption",
        {**results[0]["pp_caption"]["grads"], **results[1]["pp_caption"]["grads"]},
        ref_grads,
    )
    zero_loss, zero_grads = reference([zero_batch])
    assert all(abs(r["pp_zero"]["loss"] - zero_loss) / zero_loss < 1e-5 for r in results)
    _close(
        "pp_zero", {**results[0]["pp_zero"]["grads"], **results[1]["pp_zero"]["grads"]}, zero_grads
    )
    # dp 2, accumulate 2: every rank holds the gradient of the token mean over all 4 batches
    _, dp_grads = reference(dp_all)
    last = reference([dp_all[1], dp_all[3]])[0]  # logged: the last batch's token mean over dp
    for r in results:
        _close("ddp_pair", r["ddp_pair"]["grads"], dp_grads)
        _close("fsdp_own", r["fsdp_own"]["grads"], dp_grads)
        assert abs(r["ddp_pair"]["loss"] - last) / last < 1e-5, (r["ddp_pair"]["loss"], last)
