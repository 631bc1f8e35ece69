"""What the cost model knows of a layout and of a model, as plain numbers (pure Python).

:class:`LayoutSpec` is one candidate layout (degrees, schedule, engines, precision), validated at
construction. :class:`ModelSpec` is a model reduced to what communication and state memory
depend on: its pipeline blocks (:class:`~lightning_mmpar.layout.stages.BlockSpec`), every
parameter (:class:`ParamSpec`: global shape, block, tensor-parallel dim, trainable, expert), the
tensors crossing each block boundary (:class:`Boundary`), each block's activation collectives
per sample (:class:`Collective`) and the loss's (:class:`LossSpec`).
``lightning_mmpar.plans.fusion_cost.fusion_model_spec`` builds one from the fusion model (a meta
module works: no tensor is ever allocated); :func:`lightning_mmpar.layout.comm.comm_bytes` and
:func:`lightning_mmpar.layout.memory.state_bytes` read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_mmpar.layout.partition import parse_partition
from lightning_mmpar.layout.schedules import MULTI_STAGE_SCHEDULES, SCHEDULES
from lightning_mmpar.layout.stages import BlockSpec

__all__ = [
    "Boundary",
    "Collective",
    "LayoutSpec",
    "LossSpec",
    "ModelSpec",
    "ParamSpec",
]

PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "fp8")
VISION_PARALLEL = ("tp", "replicate", "dp")
DATA_PARALLEL = ("fsdp", "ddp", "none")


@dataclass(frozen=True)
class LayoutSpec:
    """One layout of the strategy (``MultimodalParallelStrategy`` arguments and the options of
    the run that change communication or memory).

    Raises:
        ValueError: a degree, count or size below 1 (or not an int), ``ep`` not dividing ``dp``,
            an unknown schedule / vision layout / data-parallel engine / precision, a partition
            :func:`~lightning_mmpar.layout.partition.parse_partition` refuses, ``virtual > 1``
            with ``1f1b`` / ``gpipe``, or ``data_parallel="none"`` with ``dp > 1``; the message
            names the field, the value and the fix.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    virtual: int = 1
    micro_batches: int = 1
    """Micro-batches per optimizer-step batch per dp rank (the pipeline's ``n_microbatches``)."""
    micro_batch_size: int = 1
    """Samples per micro-batch (a dp rank's batch is ``micro_batches * micro_batch_size``)."""
    accumulate: int = 1
    """Lightning's ``accumulate_grad_batches``: batches per optimizer step."""
    schedule: str = "1f1b"
    partition: str | tuple[int, ...] = "equal"
    vision_parallel: str = "tp"
    sequence_parallel: bool = False
    data_parallel: str = "fsdp"
    activation_checkpointing: bool = False
    precision: str = "32-true"
    clip: bool = False
    """Gradient clipping by the global norm (one float64 all-reduce per optimizer step)."""

    def __post_init__(self) -> None:
        for name in (
            "tp",
            "pp",
            "dp",
            "ep",
            "virtual",
            "micro_batches",
            "micro_batch_size",
            "accumulate",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"LayoutSpec.{name} ({value!r}) must be an int >= 1; use 1 to disable it."
                )
        if self.dp % self.ep:
            raise ValueError(
                f"LayoutSpec.ep ({self.ep}) must divide dp ({self.dp}): expert parallelism is "
                f"carved out of the data-parallel ranks; choose ep from "
                f"{[d for d in range(1, self.dp + 1) if self.dp % d == 0]}."
            )
        choices = {
            "schedule": SCHEDULES,
            "vision_parallel": VISION_PARALLEL,
            "data_parallel": DATA_PARALLEL,
            "precision": PRECISIONS,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"LayoutSpec.{name} ({getattr(self, name)!r}) is unknown; use one of "
                    f"{', '.join(allowed)}."
                )
        if self.virtual > 1 and self.schedule not in MULTI_STAGE_SCHEDULES:
            raise ValueError(
                f"LayoutSpec.virtual ({self.virtual}) needs a multi-stage schedule; "
                f"schedule {self.schedule!r} runs one stage per rank: use virtual=1 or "
                "schedule='interleaved_1f1b'."
            )
        if self.data_parallel == "none" and self.dp > 1:
            raise ValueError(
                f"LayoutSpec.data_parallel ('none') needs dp 1, got dp {self.dp}; use 'fsdp' "
                "or 'ddp'."
            )
        try:
            parse_partition(self.partition, self.pp * self.virtual)
        except ValueError as err:
            raise ValueError(f"LayoutSpec.partition: {err}") from None

    @property
    def world(self) -> int:
        """Ranks of the layout: ``tp * pp * dp``."""
        return self.tp * self.pp * self.dp

    @property
    def edp(self) -> int:
        """Data-parallel degree of expert weights: ``dp // ep``."""
        return self.dp // self.ep

    @property
    def local_batch(self) -> int:
        """Samples per batch on one dp rank: ``micro_batches * micro_batch_size``."""
        return self.micro_batches * self.micro_batch_size

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step: ``dp * micro_batches * micro_batch_size * accumulate``."""
        return self.dp * self.local_batch * self.accumulate

    def strategy_args(self) -> dict[str, Any]:
        """``MultimodalParallelStrategy`` ``init_args`` of this layout (a recipe YAML fragment);
        defaults left out."""
        out: dict[str, Any] = {}
        for key, value, default in (
            ("tensor_parallel", self.tp, 1),
            ("pipeline_parallel", self.pp, 1),
            ("expert_parallel", self.ep, 1),
            ("virtual_pipeline", self.virtual, 1),
            ("data_parallel", self.data_parallel, "fsdp"),
        ):
            if value != default:
                out[key] = value
        if self.pp > 1:
            out["micro_batches"] = self.micro_batches
            out["schedule"] = self.schedule
            if self.partition != "equal":
                part = self.partition
                out["partition"] = list(part) if isinstance(part, tuple) else part
        return out


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: global shape, pipeline block, the dim tensor parallelism shards (None:
    replicated over tp), whether it trains, whether it is an expert weight (sharded over
    ``ep`` on dim 0, FSDP over ``edp``), bytes per element."""

    name: str
    shape: tuple[int, ...]
    block: int
    tp_dim: int | None
    trainable: bool
    expert: bool = False
    element_size: int = 4
    full_grad: bool = False
    """The gradient's local piece is the whole tensor-parallel tensor (a vocab-parallel
    embedding's gradient comes back unsharded on every tp rank)."""
    partial_grad: bool = False
    """A tp-replicated parameter applied to head- or sequence-sharded activations (a per-head
    temperature, a sequence-parallel norm or gate): its gradient is ``Partial`` over tp,
    all-reduced in backward when FSDP2 shards the parameter, else when the global norm reads it
    (clipping)."""
    sum_over_tp: bool = False
    """Each tp rank computes the gradient from its own share of the batch (a tower run
    data-parallel inside the tp group, ``lightning_mmpar.parallel.data.PARTIAL_OVER_TP``): the
    strategy all-reduces (sums) it over tp after every backward."""

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Collective:
    """One activation collective a block runs per (micro-)batch, its bytes per sample
    (nccl-tests convention, see :mod:`lightning_mmpar.layout.comm`)."""

    dim: str
    """``tp`` or ``ep``."""
    kind: str
    """``all_reduce``, ``all_gather``, ``reduce_scatter`` or ``all_to_all``."""
    bytes_per_sample: int
    phase: str = "forward"
    """``forward`` (every forward pass, the gradient cache's forward-only one too), ``loss``
    (the schedule's forward only: the caption loss) or ``backward``."""
    bytes_per_call: int = 0
    """Bytes per (micro-)batch call whatever its size (the MoE per-expert counts)."""
    upper_per_sample: int | None = None
    """Data-dependent traffic (MoE token dispatch): ``bytes_per_sample`` is the expected value
    (uniform routing, no padding), this the upper bound; the lower bound is 0. ``None``: exact."""


@dataclass(frozen=True)
class Boundary:
    """A tensor leaving a block (the next block's input): bytes per sample and whether its
    gradient flows back (a pipeline stage then receives that gradient)."""

    bytes_per_sample: int
    requires_grad: bool


@dataclass(frozen=True)
class LossSpec:
    """The recipe loss's collectives (``lightning_mmpar.recipes.losses.RecipeLoss``)."""

    feature_bytes: int
    """Bytes per sample of one contrastive feature vector (``contrastive_dim * 4``)."""
    caption_positions: int
    """Scored positions per sample (``text_length - 1``): vocab-parallel CE reduces over them."""
    gathers: int = 3
    """dp gathers of (image, text) feature pairs per loss: InfoNCE, MML logits, MML momentum."""
    gathers_with_grad: int = 2
    """Of those, gathers whose backward all-reduces the gathered gradient (two tensors each)."""


@dataclass(frozen=True)
class ModelSpec:
    """A model for the cost model; tuples are per pipeline block (``len(blocks)``)."""

    blocks: tuple[BlockSpec, ...]
    params: tuple[ParamSpec, ...]
    boundaries: tuple[tuple[Boundary, ...], ...] = ()
    """Per block: the tensors it outputs (the pipeline's send buffers after that block)."""
    collectives: tuple[tuple[Collective, ...], ...] = ()
    """Per block: activation collectives per (micro-)batch, bytes per sample."""
    loss: LossSpec | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form facts for reports (model name, widths)."""

    def __post_init__(self) -> None:
        n = len(self.blocks)
        for name in ("boundaries", "collectives"):
            value = getattr(self, name)
            if value and len(value) != n:
                raise ValueError(
                    f"ModelSpec.{name} has {len(value)} entries for {n} blocks; give one per block."
                )
        bad = [p.name for p in self.params if not 0 <= p.block < n]
        if bad:
            raise ValueError(
                f"ModelSpec.params {bad[:3]} name a block outside 0..{n - 1}; set ParamSpec.block."
            )
