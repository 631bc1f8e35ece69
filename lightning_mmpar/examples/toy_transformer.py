"""A small causal transformer LM written the way the strategy expects.

It implements :class:`~lightning_mmpar.parallel.pipeline.PipelineModule` (ordered blocks,
inputs, loss), takes its Lightning steps from
:class:`~lightning_mmpar.parallel.pipeline.PipelineSteps`, and describes its parallel plan
(:mod:`lightning_mmpar.plans.toy`) in ``parallel_plan(dims)``, which the strategy applies in
its ``setup`` (:func:`~lightning_mmpar.parallel.parallelize.parallelize`): attention q/k/v
column-parallel by heads, the output projection row-parallel; the MLP column- then row-parallel
("Y = GeLU(XA) B; A split by columns, B by rows": one all-reduce).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn

from lightning_mmpar.parallel.parallelize import ParallelPlan, applies_plans, apply_model_parallel
from lightning_mmpar.parallel.pipeline import PipelineSteps
from lightning_mmpar.plans.toy import toy_plan
from lightning_mmpar.topology import ParallelDims


@dataclass(kw_only=True)
class ToyConfig:
    """Sizes of the toy transformer."""

    vocab: int = 64
    """Vocabulary size."""
    dim: int = 32
    """Hidden size."""
    heads: int = 4
    """Attention heads (divisible by the tensor-parallel size)."""
    layers: int = 4
    """Transformer blocks."""
    seq: int = 8
    """Sequence length."""
    lr: float = 1e-2
    """AdamW learning rate."""


class Embed(nn.Module):
    def __init__(self, cfg: ToyConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Parameter(torch.randn(cfg.seq, cfg.dim) * 0.02)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.tok(tokens) + self.pos[: tokens.shape[1]]


class Block(nn.Module):
    def __init__(self, cfg: ToyConfig) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.heads
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.q = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.k = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.v = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.o = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.up = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.down = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        h = self.norm1(x)
        # head count comes from the local shard: under TP each rank holds heads/tp heads
        q, k, v = (
            p(h).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v)
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, -1))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Head(nn.Module):
    def __init__(self, cfg: ToyConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(cfg.dim)
        self.out = nn.Linear(cfg.dim, cfg.vocab)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.norm(x))


class ToyTransformer(PipelineSteps, LightningModule):
    """Embedding -> ``layers`` x Block -> Head; next-token cross-entropy."""

    def __init__(self, cfg: ToyConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg or ToyConfig()
        self.embed = Embed(self.cfg)
        self.layers = nn.ModuleList(Block(self.cfg) for _ in range(self.cfg.layers))
        self.head = Head(self.cfg)

    def parallel_plan(self, dims: ParallelDims) -> ParallelPlan:
        """The toy's plan (:func:`~lightning_mmpar.plans.toy.toy_plan`), which ``mm_parallel``
        applies in its ``setup``; raises ``ValueError`` when the heads do not divide by tp."""
        return toy_plan(self, dims=dims)

    def configure_model(self) -> None:
        """Under a strategy that applies no plans (Lightning's ``ModelParallelStrategy``):
        the plan's tensor parallelism here, on the run's tp mesh."""
        if self._trainer is None or applies_plans(self._trainer):
            return  # mm_parallel applies parallel_plan(dims) in its setup
        dims = ParallelDims.of(self._trainer)
        if dims.tp > 1:
            apply_model_parallel(self, dims, self.parallel_plan(dims))  # once per module

    # PipelineModule protocol
    def pipeline_blocks(self) -> list[nn.Module]:
        return [self.embed, *self.layers, self.head]

    def pipeline_inputs(self, batch: Tensor) -> tuple[tuple[Tensor, ...], Tensor]:
        return (batch[:, :-1],), batch[:, 1:]

    def pipeline_loss(self, logits: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        for block in self.layers:
            x = block(x)
        return self.head(x)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.cfg.lr)


def make_tokens(n: int, cfg: ToyConfig, seed: int = 0) -> Tensor:
    """``n`` sequences of ``seq + 1`` tokens following a learnable rule (next = 3*prev+1 mod V)."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, cfg.vocab, (n, 1), generator=g)
    steps = [start]
    for _ in range(cfg.seq):
        steps.append((steps[-1] * 3 + 1) % cfg.vocab)
    noise = torch.rand(n, cfg.seq + 1, generator=g) < 0.1
    seqs = torch.cat(steps, dim=1)
    return torch.where(noise, torch.randint(0, cfg.vocab, seqs.shape, generator=g), seqs)
