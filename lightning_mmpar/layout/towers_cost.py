"""Predicted step of a non-colocated layout (``vision_ranks``, pure Python).

The vision tower (the model's leading blocks of kind ``vision``) runs on ``V`` ranks of its own,
data-parallel: ``vision_data_parallel="ddp"``, each a full copy (whole parameters, gradients and
AdamW moments, gradients all-reduced over the ``V`` ranks), or ``"fsdp"``, FSDP2 over the ``V``
ranks (each block one unit: its state sharded as :func:`~lightning_mmpar.layout.memory.
state_bytes` shards a colocated FSDP2 rank's at ``dp = V``; per batch each unit all-gathers
twice, forward and backward, and reduce-scatters its trainable parameters once; the 0-dim
ones all-reduced once per step: :func:`vision_comm_bytes`); the language ranks run the
remaining blocks with the layout's tp x pp x dp, priced by
:func:`lightning_mmpar.layout.cost.predict` on the language blocks alone (``predict`` combines
both sides; this module prices the vision side). Per optimizer step, with ``S`` samples per
step, ``F_v`` the vision blocks' forward + backward FLOPs per sample (they scale with the
images per sample)::

    vision compute  = F_v * S / V / (peak x efficiency)  (+ block overhead per batch)
                      forward 1/3, backward 2/3; a frozen tower: the forward only
    transfer        per vision rank: its samples' embeddings (the floating-point tensors
                      after the last vision block: image tokens x width x bytes, and the pooled
                      vector) to every tp rank of the replica's first stage, their gradient
                      back from tp rank 0 (a trained tower), the pixels from tp rank 0
                      (``ModelSpec.extra["pixel_bytes_per_sample"]``), point-to-point
    step, as run    the vision rank one batch ahead inside each accumulation window of
                      ``A`` batches (:func:`run_ahead_seconds`): batch ``k + 1``'s forward
                      while the language ranks run batch ``k``, batch ``k``'s backward while
                      they run ``k + 1``; ``A = 1``: vision forward + transfer + language step
                      + vision backward + vision gradient sync, one after the other
    pipelined bound = max(vision side, language step) + transfer          (overlap=True)

``overlap=False`` prices what :mod:`lightning_mmpar.parallel.towers` runs; ``overlap=True``
an encoder whose work hides entirely behind the language model's (or the other way) with the
transfer exposed (no pipeline fill or drain; the engine's run-ahead hides part of the
transfer). The idle seconds of each side are :attr:`Prediction.idle`. Model FLOPs for the MFU
count both towers on ``world + V`` ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from lightning_mmpar.layout.comm import comm_parts
from lightning_mmpar.layout.devices import collective_seconds
from lightning_mmpar.layout.memory import state_bytes
from lightning_mmpar.layout.model import ModelSpec
from lightning_mmpar.layout.stages import BlockSpec
from lightning_mmpar.layout.value import ParallelLayout

__all__ = [
    "TowerCost",
    "language_layout",
    "run_ahead_seconds",
    "split_towers",
    "tower_cost",
    "vision_comm_bytes",
    "vision_gradient_bytes",
    "vision_layout",
]

INLET = "tower.inlet"
"""The name of the language side's first block (:func:`split_towers`; the strategy's
``TowerInlet`` is ``tower.inlet`` in its stage plan)."""


def split_towers(model: ModelSpec) -> tuple[ModelSpec, ModelSpec]:
    """``(vision, language)``: the leading blocks of kind ``vision`` and the others, each a
    ``ModelSpec`` with its parameters (blocks renumbered), boundaries and collectives; the
    language one keeps the loss and ``extra`` and starts with a block (``INLET``) of no cost
    and no parameter whose output is the tower's (the language ranks' pipeline runs the
    strategy's ``TowerInlet`` as its block 0, and the partition counts it: ``pp`` stages cut
    the same blocks in the planner and in the engine).

    Raises:
        ValueError: the model does not start with a vision block, or has only vision blocks.
    """
    k = 0
    while k < len(model.blocks) and model.blocks[k].kind == "vision":
        k += 1
    if k == 0 or k == len(model.blocks):
        raise ValueError(
            f"vision_ranks needs a model whose first blocks, not all, are of kind 'vision' "
            f"(found {k} of {len(model.blocks)}); use such a model or vision_ranks=0."
        )

    def part(lo: int, hi: int, inlet: tuple[BlockSpec, ...] = (), **kw: Any) -> ModelSpec:
        shift, n = len(inlet) - lo, len(inlet)
        bounds, colls = model.boundaries, model.collectives
        return ModelSpec(
            blocks=inlet + model.blocks[lo:hi],
            params=tuple(
                replace(p, block=p.block + shift) for p in model.params if lo <= p.block < hi
            ),
            boundaries=(bounds[lo - n : lo] + bounds[lo:hi]) if bounds else (),
            collectives=(((),) * n + colls[lo:hi]) if colls else (),
            **kw,
        )

    inlet = (BlockSpec(INLET, "aligner", 0.0, 0.0, 0.0, 0.0),)
    return part(0, k), part(k, len(model.blocks), inlet, loss=model.loss, extra=model.extra)


@dataclass(frozen=True)
class TowerCost:
    """One vision rank's work per optimizer step (seconds, bytes); ``samples`` it encodes."""

    samples: float
    forward: float
    backward: float
    sync: float  # the gradient sync over the vision ranks (FSDP2: its gathers too)
    transfer: float  # the embeddings, their gradients and the pixels, on its links
    embedding_bytes: int  # sent: embeddings to every tp rank of its replicas' first stage
    gradient_bytes: int  # received: the embeddings' gradients (0: frozen tower)
    pixel_bytes: int  # received: the pixels
    state: tuple[int, int, int]  # parameters, gradients, optimizer bytes (vision rank 0's)
    activations: int  # kept activation bytes of one batch

    @property
    def busy(self) -> float:
        return self.forward + self.backward + self.sync


def tower_cost(
    model: ModelSpec,
    layout: ParallelLayout,
    rate: tuple[float, float],
    graph: Any,
    element_bytes: int = 4,
) -> TowerCost:
    """The vision side of ``layout`` (module doc): vision rank 0's compute, gradient sync,
    transfer on its links and memory. ``rate``: the device's ``(FLOP/s achieved, overhead
    seconds per block per batch)``; ``graph``: a ``DeviceGraph`` whose devices ``0 .. world -
    1`` are the language ranks (Megatron's order), ``world .. world + V - 1`` the vision ranks;
    ``element_bytes``: bytes per kept activation element (the specs count 4).

    Raises:
        ValueError: from :func:`split_towers`.
    """
    vision, _ = split_towers(model)
    v, world = layout.vision_ranks, layout.world
    samples = layout.global_batch / v
    batches = layout.accumulate
    trains = any(p.trainable for p in vision.params)
    flops = sum(b.flops for b in vision.blocks) * samples / rate[0]
    overhead = rate[1] * len(vision.blocks) * batches
    forward = flops / 3 + overhead / 3
    backward = (flops + overhead) * 2 / 3 if trains else 0.0
    state = state_bytes(vision, vision_layout(layout), {})
    ranks = [world + r for r in range(v)]
    sync = sum(
        collective_seconds(graph, key.split(".")[1], ranks, n)
        for key, n in vision_comm_bytes(model, layout).items()
    )
    per_sample = sum(x.bytes_per_sample for x in vision.boundaries[-1] if x.requires_grad)
    emb = round(per_sample * samples * layout.tp)
    back = round(per_sample * samples) if trains else 0
    pixel = float(model.extra.get("pixel_bytes_per_sample", 0))
    pixels = round(pixel * samples)
    transfer = _transfer_seconds(
        graph, layout, samples, (per_sample, per_sample if trains else 0.0, pixel)
    )
    scale = element_bytes / 4
    ahead = min(2, batches)  # a batch's activations and the one encoded ahead
    per_batch = sum(b.activation_bytes for b in vision.blocks) * samples / batches
    acts = round(per_batch * ahead * scale)
    kept = (state.parameters, state.gradients, state.optimizer)
    return TowerCost(samples, forward, backward, sync, transfer, emb, back, pixels, kept, acts)


def run_ahead_seconds(tower: TowerCost, language_step: float, batches: int) -> float:
    """The optimizer step of a non-colocated layout as the engine runs it: ``batches``
    (``A``) batches per accumulation window, each side's work split evenly over them, the
    vision rank encoding batch ``k + 1`` before it back-propagates batch ``k`` (an event
    simulation of :class:`~lightning_mmpar.parallel.towers.TowerExchange`'s order); the
    transfer rides with the embeddings; the vision ranks' gradient sync ends the step (under
    FSDP2 its gathers too, all counted there: an upper bound).
    ``A = 1`` gives the serial sum. Seconds."""
    f, b = tower.forward / batches, tower.backward / batches
    t, lang = tower.transfer / batches, language_step / batches
    vision = f
    ready = [vision + t]
    done = 0.0
    for k in range(batches):
        if k + 1 < batches:  # the next batch ahead
            vision += f
            ready.append(vision + t)
        done = max(done, ready[k]) + lang
        vision = max(vision, done) + b
    return max(vision + tower.sync, done)


def _transfer_seconds(
    graph: Any, layout: ParallelLayout, samples: float, per_sample: tuple[float, float, float]
) -> float:
    """Seconds vision rank 0 (device ``world``) spends on its links per optimizer step: to each
    of its replicas (fan-in: ``dp / V`` of them, the first ones; fan-out: a chunk of replica
    0) the embeddings to every tp rank of the first stage (devices ``r * tp + t``), the
    gradient and the pixels with tp rank 0; one message each per batch (``per_sample``:
    embedding, gradient and pixel bytes per sample)."""
    world, tp, batches = layout.world, layout.tp, layout.accumulate
    replicas = max(1, layout.dp_size // layout.vision_ranks)
    share = samples / replicas / batches
    total = 0.0
    for r in range(replicas):
        for t in range(tp):
            sizes = per_sample if t == 0 else per_sample[:1]
            total += sum(
                collective_seconds(graph, "send_recv", [world, r * tp + t], n * share)
                for n in sizes
                if n
            )
    return total * batches


def language_layout(layout: ParallelLayout) -> ParallelLayout:
    """The language ranks' layout: ``layout`` without its vision ranks (a colocated layout
    of the same tp x pp x dp, which :func:`~lightning_mmpar.layout.cost.predict` and the
    language side's counts price)."""
    return replace(layout, vision_ranks=0, vision_data_parallel="ddp")


def vision_layout(layout: ParallelLayout) -> ParallelLayout:
    """The vision ranks' own layout: ``dp = V`` under ``layout.vision_data_parallel``, no
    model parallelism, ``layout``'s accumulation and precision (what
    :func:`~lightning_mmpar.layout.memory.state_bytes` and
    :func:`~lightning_mmpar.layout.comm.comm_parts` price them with)."""
    return ParallelLayout(
        dp=max(layout.vision_ranks, 1),
        data_parallel=layout.vision_data_parallel,
        accumulate=layout.accumulate,
        precision=layout.precision,
    )


def vision_comm_bytes(model: ModelSpec, layout: ParallelLayout) -> dict[str, int]:
    """Bytes of one vision rank's collectives over the vision ranks per optimizer step, by
    ``vision.<kind>`` (nccl-tests' sizes, as :func:`~lightning_mmpar.layout.comm.comm_bytes`):
    ``ddp``: ``vision.all_reduce``, the trainable parameters (:func:`vision_gradient_bytes`);
    ``fsdp``: ``vision.all_gather`` and ``vision.reduce_scatter``, each block's FSDP2 unit as
    ``comm_parts`` counts a colocated unit at ``dp = V`` (padded shards; two gathers and one
    reduce-scatter per batch; a frozen tower: one gather, no reduce-scatter), and
    ``vision.all_reduce`` for the trainable 0-dim parameters (no unit holds them; once per
    step). Empty with one vision rank, 0-byte keys left out.

    Raises:
        ValueError: from :func:`split_towers`.
    """
    vision, _ = split_towers(model)
    if layout.vision_ranks < 2:
        return {}
    trained = [p for p in vision.params if p.trainable]
    if layout.vision_data_parallel == "ddp":
        out = {"vision.all_reduce": sum(p.numel * p.element_size for p in trained)}
    else:
        parts = comm_parts(vision, vision_layout(layout))
        out = {
            "vision." + key.split(".")[1]: why.get("fsdp", 0)
            for key, why in parts.items()
            if key.startswith("dp.")
        }
        if not trained:  # a frozen tower runs no backward: one gather per batch, not two
            out["vision.all_gather"] = out.get("vision.all_gather", 0) // 2
        out["vision.all_reduce"] = sum(p.numel * p.element_size for p in trained if not p.shape)
    return {k: n for k, n in out.items() if n}


def vision_gradient_bytes(model: ModelSpec) -> int:
    """Bytes of the trainable parameters of ``model``'s vision blocks (what the vision ranks
    all-reduce; 0: a frozen tower)."""
    vision, _ = split_towers(model)
    return sum(p.numel * p.element_size for p in vision.params if p.trainable)
