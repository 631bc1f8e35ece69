"""What the cost model knows of a model, as plain numbers (pure Python).

The layout it is costed in is a :class:`~lightning_mmpar.layout.value.ParallelLayout`.
:class:`ModelSpec` is a model reduced to what communication and state memory
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

from lightning_mmpar.layout.stages import BlockSpec

__all__ = [
    "Boundary",
    "Collective",
    "LossSpec",
    "ModelSpec",
    "ParamSpec",
]


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


def __getattr__(name: str) -> Any:
    """``LayoutSpec``: the deprecated name of :class:`~lightning_mmpar.layout.value.
    ParallelLayout` (constructing one warns)."""
    if name == "LayoutSpec":
        from lightning_mmpar.layout.value import LayoutSpec

        return LayoutSpec
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
