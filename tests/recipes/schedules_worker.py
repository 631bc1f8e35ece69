"""The pipeline engine under every schedule on a toy model, in an existing spawned world
(:func:`engine_checks`, run by :mod:`parity_matrix_worker` at world size 2; issue 11)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn

from lightning_mmpar import ParallelConfig
from lightning_mmpar.layout.schedules import MULTI_STAGE_SCHEDULES, SCHEDULES, min_micro_batches
from lightning_mmpar.parallel.pipeline import PipelineChunk, PipelineEngine


class ToyBlock(nn.Module):
    """``(h, z) -> (tanh(W h) + z, z)`` (``z``: token ids, ignored, or their embedding); the
    embedding block returns ``(tanh(W h), E[z])``, the last block ``h`` alone."""

    def __init__(self, embed: bool, last: bool) -> None:
        super().__init__()
        self.lin, self.last = nn.Linear(4, 4), last
        self.embed = nn.Embedding(10, 4) if embed else None

    def forward(self, h: Tensor, z: Tensor) -> Any:
        if self.embed is not None:  # E reaches the output through no gradient-carrying input
            return torch.tanh(self.lin(h)), self.embed(z)
        h = torch.tanh(self.lin(h)) + (z if z.is_floating_point() else 0)
        return h if self.last else (h, z)


class ToyBlocks(nn.Module):
    """``n`` :class:`ToyBlock` with a mean-squared loss (a :class:`PipelineModule`); block 2
    embeds the token ids (a parameter no gradient-carrying stage input reaches)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([ToyBlock(i == 2, i == n - 1) for i in range(n)])

    def pipeline_blocks(self) -> list[nn.Module]:
        return list(self.blocks)

    def pipeline_inputs(self, batch: Any) -> tuple[tuple[Tensor, ...], Tensor]:
        return (batch[0], batch[1]), batch[2]

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return ((output - target) ** 2).mean()


def engine_checks(group: Any) -> dict[str, dict[str, Any]]:
    """The pipeline engine at pp 2 under every schedule, on :class:`ToyBlocks` split by explicit
    uneven ``stage_ranges`` (2 blocks, 1 per middle stage, 2; the embedding on stage 1): worst
    relative loss / gradient error
    of a training step against autograd on one process, at the schedule's fewest micro-batches
    and after ``set_micro_batches(4)``; the eval loss's; the observed stage actions; the stages
    whose inputs arrive packed."""
    out = {}
    x, y = torch.randn(8, 4, generator=torch.Generator().manual_seed(1)), torch.ones(8, 4) / 3
    ids = torch.arange(8) % 10
    for name in SCHEDULES:
        v = 2 if name in MULTI_STAGE_SCHEDULES else 1
        torch.manual_seed(0)
        toy = ToyBlocks(2 * v + 2)
        ref = copy.deepcopy(toy)
        want = ref.pipeline_loss(PipelineChunk(ref.pipeline_blocks())(x, ids), y)
        want.backward()
        want = want.detach()
        n = max(1, min_micro_batches(name, 2, v))
        config = ParallelConfig(
            pipeline_parallel=2, virtual_pipeline=v, schedule=name, micro_batches=n
        )
        ranges = [range(0, 2), *(range(s + 1, s + 2) for s in range(1, 2 * v - 1))]
        ranges.append(range(2 * v, 2 * v + 2))
        engine = PipelineEngine(toy, config, group, torch.device("cpu"), stage_ranges=ranges)
        events: list[tuple[Any, ...]] = []
        engine.observers.append(lambda *e, seen=events: seen.append(e))
        errs = {"loss": 0.0, "grad": 0.0, "eval": 0.0}
        for micro in (n, 4):
            engine.set_micro_batches(micro)
            toy.zero_grad()
            loss = engine.train_step((x, ids, y))
            errs["loss"] = max(errs["loss"], abs(float(loss - want)) / float(want))
            for key, p in toy.named_parameters():  # no gradient at all: error 1
                b = dict(ref.named_parameters())[key].grad
                got = p.grad if p.grad is not None else torch.zeros_like(b)
                errs["grad"] = max(errs["grad"], float((got - b).norm() / b.norm()))
        errs["eval"] = abs(float(engine.eval_step((x, ids, y)) - want)) / float(want)
        lean_steps, lean_diff = _lean_against_torch(engine, toy, (x, ids, y))
        seen = {
            key: sorted({e[i] for e in events})
            for i, key in enumerate(("stages", "actions", "micro"))
        }
        out[name] = {**errs, **seen, "owned": engine.stage_ids, "last_rank": engine.last_rank}
        out[name]["packed"] = _packed_stages(engine)
        out[name]["kept_outputs"] = _kept_outputs(engine)
        out[name]["lean_steps"], out[name]["lean_vs_torch"] = lean_steps, lean_diff
    return out


def _lean_against_torch(engine: PipelineEngine, toy: nn.Module, batch: Any) -> tuple[int, float]:
    """Steps :class:`~lightning_mmpar.parallel.pipeline.executor.LeanRuntime` has run in
    ``engine``'s schedules (after one more training step under it), and the largest difference
    of that step's loss and gradients against the same step under torch's own loop
    (``PipelineEngine.lean_runtime = False``): 0 when both make the same calls in the same
    order."""
    runs = []
    for lean in (True, False):
        engine.lean_runtime = lean
        toy.zero_grad()
        loss = float(engine.train_step(batch))
        grads = {k: p.grad.clone() for k, p in toy.named_parameters() if p.grad is not None}
        runs.append((loss, grads))
    engine.lean_runtime = True
    (loss, grads), (theirs, their_grads) = runs
    diffs = [abs(loss - theirs)] + [
        float((g - their_grads[k]).abs().max()) for k, g in grads.items()
    ]
    steps = sum(
        getattr(getattr(s, "lean_runtime", None), "steps_run", 0)
        for s in engine._schedules.values()
    )
    return steps, max(diffs)


def _kept_outputs(engine: PipelineEngine) -> int:
    """Output chunks the stages of ``engine``'s schedules still hold after the last step (an
    eval step: its outputs are read by the loss, never merged, so none are kept)."""
    return sum(len(st.output_chunks) for st in _stages(engine))


def _stages(engine: PipelineEngine) -> list[Any]:
    return [
        st
        for schedule in engine._schedules.values()
        for st in getattr(schedule, "_stages", [getattr(schedule, "_stage", None)])
    ]


def _packed_stages(engine: PipelineEngine) -> list[int]:
    """The stages of ``engine``'s schedules whose inputs arrive packed (one buffer per dtype,
    :class:`~lightning_mmpar.parallel.pipeline.boundary.PackedStage`)."""
    return sorted({st.stage_index for st in _stages(engine) if getattr(st, "input_layout", None)})
