"""Where a rank's training state exceeds the ideal ``full / ranks``, byte by byte (pure Python).

A rank holds :func:`~lightning_mmpar.layout.memory.state_bytes` (parameters, gradients, AdamW
moments and ``step``); the *naive ideal* is ``full / (tp * pp * shard)``, ``full`` the same
bytes of the whole model on one process and ``shard`` the ranks FSDP2 shards over (``dp``
under ``data_parallel="fsdp"``, 1 under ``ddp``: DDP replicates by design). What a rank holds
above it splits exactly (in :class:`fractions.Fraction` bytes) into these causes:

* ``stage imbalance``: the rank's pipeline stages hold ``stage_full`` of ``full``, not
  ``full / pp`` (pipeline blocks are indivisible): ``(stage_full - full / pp) / (tp * shard)``;
* ``replicated over tp: <kind>``: parameters tensor parallelism leaves whole (``tp_dim`` None;
  Megatron-LM replicates norms, row-parallel biases and small projections the same way), of
  which FSDP2 holds ``1 / shard`` instead of ``1 / (tp * shard)``; ``<kind>``:
  :func:`replicated_kind`;
* ``0-dim (whole on every rank)``: scalars (temperatures, gate scalars) FSDP2 does not shard;
* ``experts (split by ep, not tp)``: expert weights are split by ``ep`` and ``edp``, not ``tp``;
* ``AdamW step``: one 4-byte ``step`` per trainable parameter on every rank;
* ``vocab-parallel gradient whole``: a vocab-parallel embedding's gradient comes back unsharded
  over tp when FSDP2 does not shard it (``ParamSpec.full_grad``);
* ``FSDP uneven shards``: ``torch.chunk``'s last pieces are shorter (sums to 0 over a dp group).

The *honest ideal* keeps what the layout replicates by design: the naive ideal plus the stage
imbalance, the tp-replicated parameters and the 0-dim ones; what is left above it (steps, the
whole vocab gradient, uneven shards) is what the strategy could still remove.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from lightning_mmpar.layout.memory import (
    STEP_BYTES,
    fsdp_group,
    local_shape,
    stage_blocks,
    state_bytes,
    tp_local_shape,
)
from lightning_mmpar.layout.model import ModelSpec, ParamSpec
from lightning_mmpar.layout.value import ParallelLayout

__all__ = ["DESIGN_CAUSES", "MemoryExcess", "memory_excess", "replicated_kind"]

DESIGN_CAUSES = ("stage imbalance", "replicated over tp", "0-dim (whole on every rank)")
"""Causes (prefixes) the honest ideal includes: what the layout replicates by design."""

_KINDS = (
    ("router", lambda part: "router" in part),
    ("MoE experts", lambda part: part.startswith("expert")),
    ("gates", lambda part: part.endswith("gate") or part == "alpha"),
    ("norms", lambda part: "norm" in part or part.startswith("ln_")),
    ("vision stem", lambda part: part in ("conv1", "class_embedding", "positional_embedding")),
    ("embeddings", lambda part: "embed" in part),
)


@dataclass(frozen=True)
class MemoryExcess:
    """One rank's state bytes against the ideals; ``held - ideal == sum(causes.values())``."""

    held: int
    """:func:`~lightning_mmpar.layout.memory.state_bytes` total of the rank (bytes)."""
    ideal: Fraction
    """``full / (tp * pp * shard)`` (bytes)."""
    causes: dict[str, Fraction]
    """Bytes above the ideal by cause (module docstring); negative: below it."""

    @property
    def honest_ideal(self) -> Fraction:
        """The ideal plus the causes of :data:`DESIGN_CAUSES` (bytes)."""
        design = (v for k, v in self.causes.items() if k.startswith(DESIGN_CAUSES))
        return self.ideal + sum(design, Fraction(0))


def replicated_kind(param: ParamSpec) -> str:
    """Why a tp-replicated parameter is whole, from its name's parts: ``frozen`` (not
    trainable), ``attention output (vl_combine all_gather)`` (an ``o_proj.weight`` left
    whole: the heads are gathered, not row-parallel), ``router``, ``MoE experts`` (an MoE FFN
    stays whole on every tp rank), ``gates``, ``norms``, ``vision stem``, ``embeddings``,
    ``biases`` or ``projections and heads`` (the first that matches, in that order)."""
    if not param.trainable:
        return "frozen"
    parts = param.name.split(".")[1:]
    if parts[-2:] == ["o_proj", "weight"]:
        return "attention output (vl_combine all_gather)"
    for kind, match in _KINDS:
        if any(match(part) for part in parts):
            return kind
    return "biases" if param.name.endswith("bias") else "projections and heads"


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _full_bytes(param: ParamSpec) -> int:
    """Bytes of ``param``'s whole state on one process: parameter (+ gradient, 2 moments,
    ``step`` when trainable)."""
    size = param.numel * param.element_size
    return size * 4 + STEP_BYTES if param.trainable else size


def _structural(param: ParamSpec) -> str:
    if not param.shape:
        return "0-dim (whole on every rank)"
    if param.expert:
        return "experts (split by ep, not tp)"
    return f"replicated over tp: {replicated_kind(param)}"


def _param_causes(
    param: ParamSpec, layout: ParallelLayout, coords: dict[str, int], share: int
) -> dict[str, Fraction]:
    """``param``'s bytes on the rank minus ``full / share`` (``share = tp * shard``), by cause."""
    copies = 4 if param.trainable else 1
    unit = param.element_size * copies
    ideal = Fraction(param.numel, share)
    even = Fraction(_numel(tp_local_shape(param, layout)), fsdp_group(param, layout))
    out = {
        _structural(param): (even - ideal) * unit,
        "FSDP uneven shards": (_numel(local_shape(param, layout, coords)) - even) * unit,
    }
    if param.trainable:
        out["AdamW step"] = STEP_BYTES - Fraction(STEP_BYTES, share)
        if param.full_grad and layout.tp > 1 and fsdp_group(param, layout) == 1:
            local = _numel(local_shape(param, layout, coords)) * param.element_size
            out["vocab-parallel gradient whole"] = Fraction(local * (layout.tp - 1))
    return out


def memory_excess(model: ModelSpec, layout: ParallelLayout, coords: dict[str, int]) -> MemoryExcess:
    """The rank at ``coords`` (keys ``pp``, ``dp``, ``edp``; missing ones 0): its
    :func:`~lightning_mmpar.layout.memory.state_bytes` total, the naive ideal and the bytes
    above it by cause (module docstring); causes that are exactly 0 are left out.

    Raises:
        ValueError: ``coords["pp"]`` outside the pipeline (see
            :func:`~lightning_mmpar.layout.memory.stage_blocks`).
    """
    shard = layout.dp_size if layout.data_parallel == "fsdp" else 1
    share = layout.tp * shard
    full = sum(_full_bytes(p) for p in model.params)
    blocks = set(stage_blocks(model, layout, coords.get("pp", 0)))
    mine = [p for p in model.params if p.block in blocks]
    stage_full = sum(_full_bytes(p) for p in mine)
    causes: dict[str, Fraction] = {
        "stage imbalance": Fraction(stage_full, share) - Fraction(full, share * layout.pp)
    }
    for p in mine:
        for cause, value in _param_causes(p, layout, coords, share).items():
            causes[cause] = causes.get(cause, Fraction(0)) + value
    return MemoryExcess(
        held=state_bytes(model, layout, coords).total,
        ideal=Fraction(full, share * layout.pp),
        causes={k: v for k, v in causes.items() if v != 0},
    )
