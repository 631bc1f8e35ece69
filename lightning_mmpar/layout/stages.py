"""A pipeline's blocks (:class:`BlockSpec`) and a cut of them into stages (:class:`StagePlan`):
per-stage FLOPs, parameters, activations and memory, and their tables.

Stage bytes (the ``memory`` partition and :attr:`StagePlan.stage_bytes`)::

    parameters + 3 * trainable + activations * micro_batch_size * (pp - rank)

``3 * trainable``: fp32 AdamW keeps a gradient (4 bytes) and two moments (8 bytes) per 4-byte
trainable parameter. ``pp - rank``: micro-batches in flight on a rank under 1F1B (rank 0 holds
``pp`` forwards before its first backward; Narayanan et al. 2021, PipeDream-Flush / Megatron-LM),
applied to every virtual stage of that rank. Bytes are whole-stage figures, summed over the
stage's tensor-parallel shards (divide by ``tp`` for a per-device estimate of sharded blocks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["BlockSpec", "StagePlan", "gib", "measure_blocks", "parameter_bytes", "side_by_side"]


@dataclass(frozen=True)
class BlockSpec:
    """One pipeline block's cost per sample (see ``lightning_mmpar.models.block_cost``)."""

    name: str
    kind: str
    """``vision``, ``aligner``, ``language`` or ``head`` (any other kind: not in ``ratio``)."""
    flops: float
    """Forward + backward FLOPs per sample."""
    activation_bytes: float
    """Activation bytes kept from forward to backward per sample."""
    parameter_bytes: float
    """Bytes of all of the block's parameters (global shapes)."""
    trainable_bytes: float
    """Bytes of its trainable parameters (gradient and two AdamW moments apply)."""
    seconds: float | None = None
    """Measured forward + backward seconds of one micro-batch (the last block's with the
    loss); ``None``: not measured. The cost of ``partition="measured"``."""


def parameter_bytes(block: Any) -> tuple[float, float]:
    """``(all, trainable)`` parameter bytes of ``block`` (``numel() * element_size()``: a
    DTensor's global size; meta tensors work; trainable: ``requires_grad``)."""
    sizes = [(p.numel() * p.element_size(), p.requires_grad) for p in block.parameters()]
    return float(sum(n for n, _ in sizes)), float(sum(n for n, grad in sizes if grad))


def measure_blocks(
    blocks: Sequence[Any],
    image_tokens: int,
    text_length: int,
    names: Sequence[str],
    *,
    images_per_sample: float = 1.0,
    vision_images: float | None = None,
    vision_tokens: int | None = None,
) -> list[BlockSpec]:
    """A :class:`BlockSpec` per block from its ``kind``, ``cost(image_tokens, text_length)``
    (``.flops``, ``.activation_bytes``; e.g. ``lightning_mmpar.models.blocks.FusionBlock``)
    and ``parameters()`` (``numel() * element_size()``: a DTensor's global size; meta tensors
    work; trainable: ``requires_grad``). Duck-typed: this package imports no model.

    ``images_per_sample`` (``K >= 0``, a mean: fractions allowed) scales the image work per
    sample: a ``vision`` block costs ``vision_images`` (default ``K``) times one image's cost
    (the tower encodes each image on its own); every other block is priced at ``K *
    image_tokens`` image tokens, interpolated linearly between ``cost(0, T)`` and
    ``cost(image_tokens, T)`` (their image work, projections and attention keys, is linear in
    the image tokens). ``K = 1`` gives ``cost(image_tokens, T)`` exactly. ``vision_tokens``:
    the patch tokens a ``vision`` block runs on when they differ from the image tokens the
    language model sees (a ViT whose merger folds ``m x m`` patches into one token:
    ``m^2 * image_tokens``); default ``image_tokens``.

    Raises:
        ValueError: ``image_tokens`` or ``text_length`` < 1, ``images_per_sample`` or
            ``vision_images`` negative or not finite, or ``names`` not one per block.
    """
    if not isinstance(text_length, int) or text_length < 1 or image_tokens < 1:
        raise ValueError(
            f"text_length ({text_length!r}) and image_tokens ({image_tokens!r}) must be >= 1; "
            "pass text_length, the caption length T (data.max_length), e.g. 32."
        )
    vision = images_per_sample if vision_images is None else vision_images
    for field, value in (("images_per_sample", images_per_sample), ("vision_images", vision)):
        if not 0.0 <= value < float("inf"):  # NaN fails too
            raise ValueError(
                f"{field} ({value!r}) must be a finite number >= 0 (images per sample; 0: "
                "text only)."
            )
    if len(names) != len(blocks):
        raise ValueError(f"{len(names)} names for {len(blocks)} blocks; give one per block.")
    specs = []
    for name, block in zip(names, blocks, strict=True):
        n = vision_tokens if block.kind == "vision" and vision_tokens else image_tokens
        flops, kept = _image_scaled(block, n, text_length, images_per_sample, vision)
        total, trainable = parameter_bytes(block)
        specs.append(BlockSpec(name, block.kind, flops, kept, float(total), float(trainable)))
    return specs


def _image_scaled(
    block: Any, image_tokens: int, text_length: int, images: float, vision: float
) -> tuple[float, float]:
    """``(flops, activation_bytes)`` per sample of ``block`` at ``images`` images per sample
    (``vision`` for a ``vision`` block; :func:`measure_blocks`)."""
    one = block.cost(image_tokens, text_length)
    if block.kind == "vision":
        return float(one.flops) * vision, float(one.activation_bytes) * vision
    if images == 1.0:
        return float(one.flops), float(one.activation_bytes)
    none = block.cost(0, text_length)  # the text's part: image work is linear in the tokens
    flops = none.flops + images * (one.flops - none.flops)
    kept = none.activation_bytes + images * (one.activation_bytes - none.activation_bytes)
    return float(flops), float(kept)


@dataclass(frozen=True)
class StagePlan:
    """Stages of a pipeline: block ranges and per-stage cost; stage ``s`` runs on
    ``stage_ranks[s]`` (default the loop layout ``s % pp``) with ``in_flight[s]`` micro-batches'
    activations held at its peak (default 1F1B's ``pp - rank``)."""

    mode: str
    """The partition that made it (``str(Partition)``)."""
    pipeline_parallel: int
    virtual_pipeline: int
    ranges: list[range]
    """Block indices of each of the ``pp * v`` stages."""
    blocks: tuple[BlockSpec, ...]
    micro_batch_size: int = 1
    stage_ranks: tuple[int, ...] = ()
    """Pipeline rank of each stage (empty: ``s % pp``; the V schedules differ)."""
    in_flight: tuple[int, ...] = ()
    """Micro-batches whose activations each stage holds at once (empty: ``pp - rank``)."""

    @property
    def num_stages(self) -> int:
        return len(self.ranges)

    @property
    def ranks(self) -> list[int]:
        """Pipeline rank of each stage."""
        pp = self.pipeline_parallel
        return list(self.stage_ranks) or [s % pp for s in range(self.num_stages)]

    @property
    def in_flight_micro_batches(self) -> list[int]:
        """Micro-batches in flight on each stage (activation memory multiplier)."""
        pp = self.pipeline_parallel
        return list(self.in_flight) or [pp - r for r in self.ranks]

    @property
    def boundaries(self) -> list[int]:
        """First block index of stages ``1 .. S-1`` (an explicit partition giving this plan)."""
        return [r.start for r in self.ranges[1:]]

    def _sum(self, field: str) -> list[float]:
        return [float(sum(getattr(self.blocks[i], field) for i in r)) for r in self.ranges]

    @property
    def stage_flops(self) -> list[float]:
        """Forward + backward FLOPs per sample of each stage."""
        return self._sum("flops")

    @property
    def stage_parameter_bytes(self) -> list[float]:
        return self._sum("parameter_bytes")

    @property
    def stage_activation_bytes(self) -> list[float]:
        """Activation bytes held at the stage's peak: per sample * micro_batch_size *
        :attr:`in_flight_micro_batches`."""
        per_sample, mbs = self._sum("activation_bytes"), self.micro_batch_size
        return [a * mbs * k for a, k in zip(per_sample, self.in_flight_micro_batches, strict=True)]

    @property
    def stage_bytes(self) -> list[float]:
        """Parameters + 3 * trainable (fp32 AdamW grad + moments) + in-flight activations."""
        extra = zip(self._sum("trainable_bytes"), self.stage_activation_bytes, strict=True)
        return [p + 3 * t + a for p, (t, a) in zip(self.stage_parameter_bytes, extra, strict=True)]

    @property
    def stage_kinds(self) -> list[tuple[str, ...]]:
        """Distinct kinds of each stage, in block order."""
        return [tuple(dict.fromkeys(self.blocks[i].kind for i in r)) for r in self.ranges]

    @property
    def stage_seconds(self) -> list[float] | None:
        """Measured forward + backward seconds of one micro-batch per stage (``None`` unless
        every block has :attr:`BlockSpec.seconds`)."""
        if any(b.seconds is None for b in self.blocks):
            return None
        return self._sum("seconds")

    @property
    def stage_cost(self) -> list[float]:
        """What the plan balanced: :attr:`stage_seconds` under ``partition="measured"``, else
        :attr:`stage_flops`."""
        seconds = self.stage_seconds
        return seconds if self.mode == "measured" and seconds is not None else self.stage_flops

    @property
    def imbalance(self) -> float:
        """``max / mean`` of :attr:`stage_cost` (FLOPs, measured seconds under ``measured``;
        1.0 = perfectly balanced; the pipeline runs at the max)."""
        return _ratio(self.stage_cost)

    @property
    def measured_imbalance(self) -> float | None:
        """``max / mean`` of :attr:`stage_seconds` (``None`` when the blocks were not timed)."""
        seconds = self.stage_seconds
        return None if seconds is None else _ratio(seconds)

    @property
    def memory_imbalance(self) -> float:
        """``max / mean`` of :attr:`stage_bytes`."""
        return _ratio(self.stage_bytes)

    def describe(self) -> str:
        """One line for logs: mode, boundaries, imbalance, largest stage bytes."""
        return (
            f"partition {self.mode}: {self.num_stages} stages (pp {self.pipeline_parallel} x v "
            f"{self.virtual_pipeline}), boundaries {self.boundaries}, imbalance "
            f"{self.imbalance:.3f}, max stage memory {gib(max(self.stage_bytes))}"
        )

    def table(self) -> str:
        """Per stage: rank, blocks, kinds, cost share, parameters, activations, total bytes."""
        total, flops, kinds = sum(self.stage_cost) or 1.0, self.stage_cost, self.stage_kinds
        params, acts, mem = (
            self.stage_parameter_bytes,
            self.stage_activation_bytes,
            self.stage_bytes,
        )
        rows = [("stage", "rank", "blocks", "kinds", "cost %", "params", "activ.", "memory")]
        for s, (r, rank) in enumerate(zip(self.ranges, self.ranks, strict=True)):
            last = f" .. {self.blocks[r.stop - 1].name}" if len(r) > 1 else ""
            names = f"{r.start}-{r.stop - 1} ({self.blocks[r.start].name}{last})"
            share = f"{100 * flops[s] / total:.1f}"
            rows.append(
                (
                    str(s),
                    str(rank),
                    names,
                    "+".join(kinds[s]),
                    share,
                    gib(params[s]),
                    gib(acts[s]),
                    gib(mem[s]),
                )
            )
        widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
        lines = ["  ".join(x.ljust(w) for x, w in zip(row, widths, strict=True)) for row in rows]
        return "\n".join([*(line.rstrip() for line in lines), self.describe()])


def _ratio(values: Sequence[float]) -> float:
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else 1.0


def gib(n: float) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**27 else f"{n / 2**20:.2f} MiB"


def side_by_side(plans: Sequence[StagePlan]) -> str:
    """One row per plan: mode, boundaries, imbalance (FLOPs), largest stage memory."""
    width = max(len(p.mode) for p in plans)
    rows = [f"{'mode'.ljust(width)}  imbalance  max memory  boundaries"]
    rows += [
        f"{p.mode.ljust(width)}  {p.imbalance:9.3f}  {gib(max(p.stage_bytes)):>10}  {p.boundaries}"
        for p in plans
    ]
    return "\n".join(rows)
