"""The recipe's parity matrix (issue 9): every shipped layout against one process.

Each layout trains the recipe's own module (:func:`recipe_faults_worker.tiny_module`: the
CLIP-ViT + adapter + LLaMA fusion model with its contrastive + caption + MML losses, the CPU
YAML's weights, dropout 0) on the same global batches as one process: a dp rank takes its
contiguous slice of every global batch (as a distributed sampler over a fixed batch order
would), TP and PP peers of a replica the same slice. A layout records the logged loss of every
step and the full first-step gradient of every parameter it holds (pipeline stages hold
their own blocks; the test takes the union).

Layouts run grouped by world size, so imports are paid once per world: :func:`world` runs
every layout of its size in order, then the shipped YAMLs of that size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import recipe_faults_worker as rw
import yaml_runs_worker
from torch import Tensor

from lightning_mmpar import MultimodalParallelStrategy
from lightning_mmpar.topology import ParallelDims

STEPS = 5  # AdamW steps per layout (accumulation: 2 batches per step)
CLIP = 0.05  # a global norm below the first steps' gradient norm (~0.5): clipping bites


@dataclass(frozen=True)
class Layout:
    """One row of the matrix: strategy arguments and the training options of the run."""

    name: str
    world: int
    strategy: dict[str, Any] = field(default_factory=dict)
    sequence_parallel: bool = False
    accumulate: int = 1
    clip: float | None = None

    @property
    def dims(self) -> ParallelDims:
        s = self.strategy
        return ParallelDims(
            world_size=self.world, tp=s.get("tensor_parallel", 1), pp=s.get("pipeline_parallel", 1)
        )

    @property
    def reference(self) -> tuple[int, float | None]:
        """The one-process run this layout is compared with: (accumulate, clip)."""
        return self.accumulate, self.clip


LAYOUTS: tuple[Layout, ...] = (
    Layout("dp2 fsdp", 2, {"data_parallel": "fsdp"}),
    Layout("dp2 ddp", 2, {"data_parallel": "ddp"}),
    Layout("tp2", 2, {"tensor_parallel": 2}),
    Layout("tp2 + sequence parallel", 2, {"tensor_parallel": 2}, sequence_parallel=True),
    Layout("pp2 gpipe", 2, {"pipeline_parallel": 2, "micro_batches": 2, "schedule": "gpipe"}),
    Layout("pp2 1f1b", 2, {"pipeline_parallel": 2, "micro_batches": 4, "schedule": "1f1b"}),
    Layout(
        "pp2 x v2 interleaved",
        2,
        {
            "pipeline_parallel": 2,
            "virtual_pipeline": 2,
            "micro_batches": 2,
            "schedule": "interleaved_1f1b",
        },
    ),
    Layout(  # clipping by the global norm over TP shards that FSDP2 shards again on dp
        "tp2 x dp2 fsdp, clip 0.05", 4, {"tensor_parallel": 2, "data_parallel": "fsdp"}, clip=CLIP
    ),
    Layout(
        "pp2 x dp2, accumulate 2",
        4,
        {"pipeline_parallel": 2, "micro_batches": 2, "schedule": "1f1b"},
        accumulate=2,
    ),
    Layout(
        "tp2 x pp2, clip 0.05",
        4,
        {"tensor_parallel": 2, "pipeline_parallel": 2, "micro_batches": 2, "schedule": "1f1b"},
        clip=CLIP,
    ),
    Layout(
        "tp2 x pp2 x dp2 (sp, v2 interleaved, fsdp)",
        8,
        {
            "tensor_parallel": 2,
            "pipeline_parallel": 2,
            "virtual_pipeline": 2,
            "micro_batches": 2,
            "schedule": "interleaved_1f1b",
            "data_parallel": "fsdp",
        },
        sequence_parallel=True,
    ),
)


def dp_slice(batch: dict[str, Any], dp: int, dp_rank: int) -> dict[str, Any]:
    """Rows ``[r * B / dp, (r + 1) * B / dp)`` of every tensor of ``batch``."""
    out = {}
    for key, value in batch.items():
        if isinstance(value, Tensor):
            n = value.shape[0] // dp
            value = value[dp_rank * n : (dp_rank + 1) * n]
        out[key] = value
    return out


def run_layout(layout: Layout, rank: int, vocab_size: int, data: list[dict[str, Any]]) -> dict:
    """Train ``layout`` on this rank; the losses and this rank's first-step gradients."""
    dims = layout.dims
    coords = dims.rank_coords(rank)
    local = [dp_slice(b, dims.dp, coords["dp"]) for b in data]
    module = rw.tiny_module(vocab_size, sequence_parallel=layout.sequence_parallel)
    rec = rw.fit(
        module,
        local,
        strategy=MultimodalParallelStrategy(**layout.strategy),
        devices=layout.world,
        accumulate=layout.accumulate,
        clip=layout.clip,
    )
    return {"losses": rec.losses, "grads": rec.grads}


def world(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Every layout of this world size, in :data:`LAYOUTS` order, on this rank, then the
    shipped YAMLs of this size (:mod:`yaml_runs_worker`, run directories under ``root``)."""
    digits = rw.digits()
    out: dict[str, Any] = {}
    for layout in LAYOUTS:
        if layout.world != world_size:
            continue
        data = rw.batches(digits, STEPS * layout.accumulate)
        out[layout.name] = run_layout(layout, rank, digits.vocab_size, data)
    return {"parity": out, "yaml": yaml_runs_worker.world(rank, world_size, root)}
