"""The recipe's parity matrix (issue 9): every shipped layout against one process.

Each layout trains the recipe's own module (:func:`recipe_faults_worker.tiny_module`: the
CLIP-ViT + adapter + LLaMA fusion model with its contrastive + caption + MML losses, the CPU
YAML's weights, dropout 0) on the same global batches as one process: a dp rank takes its
contiguous slice of every global batch (as a distributed sampler over a fixed batch order
would), TP and PP peers of a replica the same slice. A layout records the logged loss of every
step and the full first-step gradient of every parameter it holds (pipeline stages hold
their own blocks; the test takes the union).

Layouts run grouped by world size, so imports are paid once per world: :func:`world` runs
every layout of its size in order, then the other checks of that world and the shipped YAMLs of
that size, and returns each result under its name; an error names the layout or check that
raised it (:func:`named`), and the test asserts every layout on its own.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.pytorch import Callback
from torch import Tensor

from lightning_mmpar import MultimodalParallelStrategy
from lightning_mmpar.models.moe_routing import MoEConfig
from lightning_mmpar.parallel.comm_count import CommCounter, state_bytes_of
from lightning_mmpar.topology import ParallelDims
from tests.recipes import pipeline_callbacks_worker, yaml_runs_worker
from tests.recipes import recipe_faults_worker as rw
from tests.recipes.schedules_worker import engine_checks

STEPS = 3  # AdamW steps per layout (accumulation: 2 batches per step)
CLIP = 0.05  # a global norm below the first steps' gradient norm (~0.5): clipping bites
MOE = {
    # per-token math (dropless, no aux terms): every layout equals the full-batch one process
    "moe": MoEConfig(
        num_experts=4,
        top_k=2,
        ffn_width=32,
        router_dim=8,
        capacity_factor=None,
        aux_loss_weight=0.0,
        z_loss_weight=0.0,
    ),
    # aux losses alone (every other loss weight 0), with capacity dropping: the gradient is the
    # mean over (dp rank, micro-batch) chunks of each chunk's aux gradient
    "aux": MoEConfig(
        num_experts=4,
        top_k=2,
        ffn_width=32,
        router_dim=8,
        capacity_factor=1.0,
        aux_loss_weight=1.0,
        z_loss_weight=0.1,
    ),
}


@dataclass(frozen=True)
class Layout:
    """One row of the matrix: strategy arguments and the training options of the run."""

    name: str
    world: int
    strategy: dict[str, Any] = field(default_factory=dict)
    sequence_parallel: bool = False
    accumulate: int = 1
    clip: float | None = None
    moe: str | None = None
    """``None``: dense FFNs; a key of :data:`MOE`: mixture-of-experts decoder FFNs."""
    vision_parallel: str = "tp"
    """The vision tower's layout under tensor parallelism: ``tp``, ``replicate`` or ``dp``."""

    @property
    def dims(self) -> ParallelDims:
        s = self.strategy
        return ParallelDims(
            world_size=self.world,
            tp=s.get("tensor_parallel", 1),
            pp=s.get("pipeline_parallel", 1),
            ep=s.get("expert_parallel", 1),
            placement=s.get("placement"),
        )

    @property
    def chunks(self) -> int:
        """Routing groups per global batch: one per (dp rank, micro-batch)."""
        pp = self.strategy.get("pipeline_parallel", 1)
        return self.dims.dp * (self.strategy.get("micro_batches") or pp if pp > 1 else 1)

    @property
    def reference(self) -> tuple[int, float | None, str | None, int]:
        """The one-process run this layout is compared with: (accumulate, clip, moe, chunks);
        chunks matter for the aux-only runs only."""
        return self.accumulate, self.clip, self.moe, self.chunks if self.moe == "aux" else 1

    @property
    def steps(self) -> int:
        return 1 if self.moe == "aux" else STEPS


LAYOUTS: tuple[Layout, ...] = (
    Layout("dp2 fsdp", 2, {"data_parallel": "fsdp"}),
    Layout("dp2 ddp", 2, {"data_parallel": "ddp"}),
    Layout(  # every rank holds the reduced gradients: the local norm, no collective
        "dp2 ddp, clip 0.05", 2, {"data_parallel": "ddp"}, clip=CLIP
    ),
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


MOE_LAYOUTS: tuple[Layout, ...] = (
    Layout("ep2 dp2 fsdp (moe)", 2, {"expert_parallel": 2}, moe="moe"),
    Layout(  # clipping by the global norm: every expert shard counted once
        "ep2 x tp2 fsdp, clip 0.05 (moe)",
        4,
        {"expert_parallel": 2, "tensor_parallel": 2},
        clip=CLIP,
        moe="moe",
    ),
    Layout(  # dp 4 = edp 2 x ep 2: expert weights FSDP-sharded over edp, 2-D (edp, ep) DTensors
        "ep2 x dp4 fsdp, experts sharded over edp 2, clip 0.05 (moe)",
        4,
        {"expert_parallel": 2},
        clip=CLIP,
        moe="moe",
    ),
    Layout("ep4 ddp (moe)", 4, {"expert_parallel": 4, "data_parallel": "ddp"}, moe="moe"),
    Layout(
        "ep2 x pp2 1f1b (moe)",
        4,
        {"expert_parallel": 2, "pipeline_parallel": 2, "micro_batches": 2, "schedule": "1f1b"},
        moe="moe",
    ),
    Layout(
        "ep2 x pp2 gpipe, aux losses only",
        4,
        {"expert_parallel": 2, "pipeline_parallel": 2, "micro_batches": 2, "schedule": "gpipe"},
        moe="aux",
    ),
    Layout(  # the aux-loss gradient under the interleaved schedule (a known bug elsewhere)
        "ep2 x pp2 x v2 interleaved, aux losses only",
        4,
        {
            "expert_parallel": 2,
            "pipeline_parallel": 2,
            "virtual_pipeline": 2,
            "micro_batches": 2,
            "schedule": "interleaved_1f1b",
        },
        moe="aux",
    ),
    Layout(  # aux gradients follow Lightning's loss division by the accumulation
        "ep2 x tp2, accumulate 2, aux losses only",
        4,
        {"expert_parallel": 2, "tensor_parallel": 2},
        accumulate=2,
        moe="aux",
    ),
)
LAYOUTS += MOE_LAYOUTS


def _pp(schedule: str, pp: int, micro: int, v: int = 2, **more: int) -> dict[str, Any]:
    return {
        "pipeline_parallel": pp,
        "virtual_pipeline": v,
        "micro_batches": micro,
        "schedule": schedule,
        **more,
    }


SCHEDULE_LAYOUTS: tuple[Layout, ...] = (  # issue 11: torch's other schedules, 3 steps each
    Layout("pp2 x v2 looped bfs", 2, _pp("looped_bfs", 2, 2)),
    Layout("pp2 x v2 zero bubble", 2, _pp("interleaved_zero_bubble", 2, 2)),
    Layout("pp2 zbv zero bubble", 2, _pp("zbv_zero_bubble", 2, 2)),
    Layout("pp2 dualpipev", 2, _pp("dualpipev", 2, 4)),
    Layout("pp4 gpipe", 4, _pp("gpipe", 4, 4, 1)),
    Layout("pp4 x v2 interleaved (8 stages)", 4, _pp("interleaved_1f1b", 4, 4)),
    Layout("pp4 x v2 looped bfs (8 stages)", 4, _pp("looped_bfs", 4, 4)),
    Layout("pp4 x v2 zero bubble (8 stages)", 4, _pp("interleaved_zero_bubble", 4, 4)),
    Layout("pp4 zbv zero bubble (8 stages)", 4, _pp("zbv_zero_bubble", 4, 4)),
    Layout("pp4 dualpipev (8 stages)", 4, _pp("dualpipev", 4, 8)),
    Layout("pp2 zbv x dp2 ddp", 4, _pp("zbv_zero_bubble", 2, 2, data_parallel="ddp")),
)
VISION_LAYOUTS: tuple[Layout, ...] = (  # issue 11: the vision tower's layouts under tp
    Layout("tp2 vision replicate", 2, {"tensor_parallel": 2}, vision_parallel="replicate"),
    Layout("tp2 vision dp", 2, {"tensor_parallel": 2}, vision_parallel="dp"),
    Layout("tp2 x dp2 vision dp", 4, {"tensor_parallel": 2}, vision_parallel="dp"),
    Layout("tp2 x pp2 vision dp", 4, _pp("1f1b", 2, 2, 1, tensor_parallel=2), vision_parallel="dp"),
)
PARTITION_LAYOUTS: tuple[Layout, ...] = (  # issue 11: stages cut by cost, ratio, boundaries
    Layout("pp2 balanced", 2, {**_pp("1f1b", 2, 2, 1), "partition": "balanced"}),
    Layout(
        "pp2 x v2 boundaries [1, 2, 5]",
        2,
        {**_pp("interleaved_1f1b", 2, 2), "partition": [1, 2, 5]},
    ),
    Layout("pp4 ratio:2:1:1", 4, {**_pp("1f1b", 4, 4, 1), "partition": "ratio:2:1:1"}),
)
PLANS = {
    "pp2 balanced": [6],
    "pp2 x v2 boundaries [1, 2, 5]": [1, 2, 5],
    "pp4 ratio:2:1:1": [2, 3, 5],
}
"""The stage boundaries each partition layout must run with (not the equal split)."""
PLACEMENT_LAYOUTS: tuple[Layout, ...] = (  # issue 12: a rank permutation changes no numerics
    Layout(
        "tp2 x pp2, placement [3, 1, 0, 2]",
        4,
        {**_pp("1f1b", 2, 2, 1, tensor_parallel=2), "placement": [3, 1, 0, 2]},
    ),
    Layout(
        "tp2 x dp2 fsdp, placement [3, 0, 2, 1]",
        4,
        {"tensor_parallel": 2, "placement": [3, 0, 2, 1]},
    ),
)
MEMORY_LAYOUTS: tuple[Layout, ...] = (  # issue 13: memory options change no fp32 numerics
    Layout(
        "pp2 1f1b, activation checkpointing every 2nd block",
        2,
        {**_pp("1f1b", 2, 2, 1), "activation_checkpointing": 2},
    ),
    Layout(
        "tp2 x dp2 fsdp, activation checkpointing + optimizer offload",
        4,
        {"tensor_parallel": 2, "activation_checkpointing": "all", "offload_optimizer": True},
    ),
)
LAYOUTS += SCHEDULE_LAYOUTS + VISION_LAYOUTS + PARTITION_LAYOUTS + PLACEMENT_LAYOUTS
LAYOUTS += MEMORY_LAYOUTS


MEASURED = frozenset(x.name for x in VISION_LAYOUTS + PLACEMENT_LAYOUTS) | frozenset(
    (
        "dp2 fsdp",
        "ep2 x dp4 fsdp, experts sharded over edp 2, clip 0.05 (moe)",
        "tp2 x dp2 fsdp, clip 0.05",
        "tp2 x pp2 x dp2 (sp, v2 interleaved, fsdp)",
        "ep2 x tp2 fsdp, clip 0.05 (moe)",
        "pp2 1f1b",
        "tp2 + sequence parallel",
        "pp2 x dp2, accumulate 2",
        "tp2 x pp2, clip 0.05",
        "ep4 ddp (moe)",
        "pp2 x v2 interleaved",
        "pp2 x v2 zero bubble",
        "pp2 x v2 looped bfs",
        "pp2 zbv zero bubble",
        "ep2 dp2 fsdp (moe)",
        "pp4 ratio:2:1:1",
        "pp2 dualpipev",
        "dp2 ddp",
        "tp2",
        "pp2 gpipe",
        "pp2 balanced",
        "pp2 x v2 boundaries [1, 2, 5]",
        "pp2 zbv x dp2 ddp",
        "ep2 x pp2 1f1b (moe)",
        "pp4 gpipe",
    )
)
"""Layouts whose communication per optimizer step and state bytes are measured (issue 12)."""


class Meter(Callback):
    """Bytes by ``"<dim>.<kind>"`` of every collective of optimizer step 3, a steady-state step
    (from the end of step 2's last batch to the end of step 3's: Lightning's per-batch SIGTERM
    broadcasts, the optimizer step, clipping and logging included; step 2 also holds torch
    DDP's one-off bucket rebuild, a ``dp`` broadcast of its bucket indices), and the state
    bytes after training."""

    def __init__(self, accumulate: int) -> None:
        self.ends, self.counter = (2 * accumulate - 1, 3 * accumulate - 1), None
        self.bytes: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self.state: tuple[int, ...] = ()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        if args[-1] == self.ends[0]:
            self.counter = CommCounter(trainer.strategy.parallel_dims).__enter__()
        elif args[-1] == self.ends[1] and self.counter is not None:
            self.counter.__exit__(None, None, None)
            self.bytes = {k: v for k, v in self.counter.bytes.items() if k != "self"}
            self.calls = {k: v for k, v in self.counter.calls.items() if k != "self"}

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.state = state_bytes_of(pl_module, trainer.optimizers[0])


class AuxScale(Callback):
    """Set every MoE layer's aux-loss gradient factor (the one-process reference of chunked
    aux-only runs: ``1 / accumulated chunks``)."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        for m in pl_module.modules():
            if hasattr(m, "aux_loss_scale"):
                m.aux_loss_scale = self.scale


def build(
    vocab_size: int,
    layout_moe: str | None,
    sequence_parallel: bool = False,
    vision_parallel: str = "tp",
) -> Any:
    """The recipe module of a layout (aux-only: every other loss weight 0)."""
    if layout_moe == "aux":
        return rw.tiny_module(
            vocab_size, contrastive_weight=0.0, caption_weight=0.0, mml_weight=0.0, moe=MOE["aux"]
        )
    moe = MOE[layout_moe] if layout_moe else None
    return rw.tiny_module(
        vocab_size, sequence_parallel=sequence_parallel, moe=moe, vision_parallel=vision_parallel
    )


def reference(key: tuple[int, float | None, str | None, int], digits: Any) -> rw.Recorder:
    """The one-process run of :attr:`Layout.reference`; aux-only runs accumulate over every
    (dp rank, micro-batch) chunk of the first step's batches, aux gradient scaled by 1/chunks.
    An accumulating run trains under ``mm_parallel`` (one process), whose caption term is the
    token mean of each accumulation window (the layouts' too), not of each batch."""
    accumulate, clip, moe, chunks = key
    module = build(digits.vocab_size, moe)
    if moe != "aux":
        strategy = MultimodalParallelStrategy() if accumulate > 1 else "auto"
        data = rw.batches(digits, STEPS * accumulate)
        return rw.fit(module, data, strategy=strategy, accumulate=accumulate, clip=clip)
    data = [dp_slice(b, chunks, c) for b in rw.batches(digits, accumulate) for c in range(chunks)]
    n = accumulate * chunks
    return rw.fit(module, data, accumulate=n, clip=clip, callbacks=[AuxScale(1.0 / n)])


def density_run(rank: int, digits: Any) -> dict[str, Any]:
    """ep 2 (dp 2) with density-driven top-k, 2 steps: every rank's estimates afterwards (the
    recipe averages them over dp after each optimizer step) and the experts per token seen."""
    from dataclasses import replace

    from lightning_mmpar.models import GradientDensity, MoEFeedForward

    moe = replace(MOE["moe"], density_threshold=0.85)
    module = rw.tiny_module(digits.vocab_size, moe=moe)
    local = [dp_slice(b, 2, rank) for b in rw.batches(digits, 2)]
    rw.fit(module, local, strategy=MultimodalParallelStrategy(expert_parallel=2), devices=2)
    found = [m for m in module.modules() if isinstance(m, GradientDensity)]
    moes = [m for m in module.modules() if isinstance(m, MoEFeedForward)]
    return {
        "estimates": [m.estimate.clone() for m in found],
        "seen": [int(m.seen.sum()) for m in found],
        "experts_per_token": [
            float(s.experts_per_token) for m in moes for s in m.last_stats.values()
        ],
    }


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
    """Train ``layout`` on this rank; the losses and this rank's first-step gradients; for
    :data:`MEASURED` layouts also step 2's communication and the final state bytes."""
    start = time.perf_counter()
    dims = layout.dims
    coords = dims.rank_coords(rank)
    local = [dp_slice(b, dims.dp, coords["dp"]) for b in data]
    module = build(vocab_size, layout.moe, layout.sequence_parallel, layout.vision_parallel)
    module.text_length = int(data[0]["input_ids"].shape[1])  # block costs (partition) need it
    strategy = MultimodalParallelStrategy(**layout.strategy)
    meter = [Meter(layout.accumulate)] if layout.name in MEASURED else []
    rec = rw.fit(
        module,
        local,
        strategy=strategy,
        devices=layout.world,
        accumulate=layout.accumulate,
        clip=layout.clip,
        callbacks=meter,
    )
    plan = strategy.stage_plan
    return {
        "losses": rec.losses,
        "grads": rec.grads,
        "seconds": time.perf_counter() - start,
        "boundaries": None if plan is None else list(plan.boundaries),
        "checkpointed": sum(getattr(m, "_mmpar_block_options", 0) for m in module.modules()),
        **(
            {"comm": meter[0].bytes, "calls": meter[0].calls, "state": meter[0].state}
            if meter
            else {}
        ),
    }


def only() -> list[str]:
    """``MMPAR_PARITY_ONLY`` (layout names separated by ``;``): a local run of those layouts
    alone, without the YAML, density and reshard runs (unset in CI: everything runs)."""
    return [x for x in os.environ.get("MMPAR_PARITY_ONLY", "").split(";") if x]


def selected(world_size: int) -> list[Layout]:
    """The layouts of this world size (narrowed by :func:`only`)."""
    names = only()
    return [x for x in LAYOUTS if x.world == world_size and (not names or x.name in names)]


def named(name: str, rank: int, run: Callable[..., Any], *args: Any) -> Any:
    """``run(*args)``, its error re-raised as one naming the layout or check (``name``) and
    the rank: the world's traceback then says which of its many runs failed."""
    try:
        return run(*args)
    except Exception as err:
        raise RuntimeError(f"{name!r} failed on rank {rank}") from err


def world(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Every layout of this world size, in :data:`LAYOUTS` order, on this rank, then the
    other checks of this world and the shipped YAMLs of this size (:mod:`yaml_runs_worker`,
    run directories under ``root``). Returns ``{"parity": {layout or check name: result},
    "yaml": {YAML name: result}}``."""
    digits = rw.digits()
    out: dict[str, Any] = {}
    if world_size == 2:  # first: on the spawned world's group, before any Trainer
        out["engine"] = named("engine", rank, engine_checks, dist.group.WORLD)
    for layout in selected(world_size):
        data = rw.batches(digits, layout.steps * layout.accumulate)
        out[layout.name] = named(
            layout.name, rank, run_layout, layout, rank, digits.vocab_size, data
        )
    if only():
        return {"parity": out, "yaml": {}}
    if world_size == 2:
        out["moe density"] = named("moe density", rank, density_run, rank, digits)
        callbacks_root = Path(root) / "pipeline_callbacks"
        callbacks_root.mkdir(parents=True, exist_ok=True)
        callbacks = pipeline_callbacks_worker.world
        out["pipeline callbacks"] = named(
            "pipeline callbacks", rank, callbacks, rank, 2, str(callbacks_root)
        )
    if world_size == 4:
        from tests.recipes import moe_reshard_worker

        reshard = moe_reshard_worker.world
        out["moe reshard"] = named("moe reshard", rank, reshard, rank, world_size, root, digits)
    yaml = {
        name: named(f"YAML {name}", rank, yaml_runs_worker.run, name, Path(root) / name)
        for name in yaml_runs_worker.names(world_size)
    }
    return {"parity": out, "yaml": yaml}
