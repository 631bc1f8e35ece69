"""Replica-consistency check: parameters that must be identical across a group.

After an optimizer step, DP replicas (and TP-replicated parameters such as norms) must hold the
same values. Each rank computes a cheap fingerprint per parameter, ``(sum(p), sum(|p|))`` in
float64, and all-gathers the ``[P, 2]`` table over the group. Parameter ``p`` of rank ``r``
*drifts* when its fingerprint differs from the reference by more than
``rtol * max_r sum(|p_r|) + atol``; the reference is the rank that agrees with most others
(ties: the lowest rank). Only drifting parameters are then all-gathered in full to report the
largest element-wise difference and where it is. With two ranks in a group (or any tie) the
majority cannot tell which side drifted: the record then says ``ambiguous``.

Groups (:func:`build_groups`, from ``ParallelDims.of(trainer)`` under ``mm_parallel`` or
Lightning's ``ModelParallelStrategy``; the world group, labelled ``world``, under DDP and other
data-parallel strategies), each compared over local shards, which hold the same coordinates on
every member of the group:

* ``tp``: parameters not sharded over the tp mesh dimension (plain tensors and DTensors whose
  ``tp`` placement is ``Replicate``, e.g. LayerNorm weights, also when FSDP shards them on dp:
  the tp peers hold the same dp shard);
* ``dp``: dense parameters not sharded over dp (``data_parallel="ddp"``, or parameters FSDP does
  not manage). FSDP-sharded parameters have no replica over dp: they are skipped, and
  :attr:`ReplicaGroup.skipped` counts them;
* ``edp``: expert parameters (``expert_patterns``) when ``ep > 1``;
* never across pipeline ranks: they hold different parameters (the tp/dp/edp groups lie inside
  one pipeline stage).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_mmpar.callbacks.grad_stats import lightning_fsdp
from lightning_mmpar.parallel import comm
from lightning_mmpar.topology import LIGHTNING_ALIASES, ParallelDims

if TYPE_CHECKING:
    import lightning.pytorch as pl


@dataclass(kw_only=True)
class ReplicaGroup:
    """Parameters that must agree across one process group."""

    name: str
    """Label in records (``world``, ``dp``, ``edp``, ``tp``)."""
    group: dist.ProcessGroup
    """The process group."""
    params: Sequence[tuple[str, Tensor]]
    """``(name, parameter)`` pairs checked over this group, in the same order on every rank."""
    skipped: int = 0
    """Parameters not compared over this group because they are sharded over it."""


@dataclass(kw_only=True)
class Drift:
    """One drifting parameter."""

    name: str
    """Parameter name."""
    shape: list[int]
    """Local shape."""
    drifting_ranks: list[int]
    """Global ranks whose values differ from the reference."""
    reference_rank: int
    """Global rank used as reference."""
    fingerprints: dict[int, list[float]]
    """``{rank: [sum, abs_sum]}``."""
    max_abs_diff: dict[int, float]
    """``{rank: max |p_rank - p_reference|}`` (full comparison)."""
    worst_index: dict[int, int]
    """``{rank: flat index of that maximum}``."""
    ambiguous: bool = False
    """No strict majority agreed with the reference (e.g. a 2-rank group): which side
    drifted is a guess (the lowest rank is taken as reference)."""


def _dim_names(p: Tensor) -> list[str]:
    """Mesh dim names of a DTensor, Lightning's (``tensor_parallel``...) mapped to ours."""
    names = p.device_mesh.mesh_dim_names or ()  # type: ignore[attr-defined]
    return [LIGHTNING_ALIASES.get(n, n) for n in names]


def _sharded_over(p: Tensor, dims: tuple[str, ...]) -> bool:
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return False
    return any(
        n in dims and not pm.is_replicate()
        for n, pm in zip(_dim_names(p), p.placements, strict=False)
    )


def _replicated_over_tp(p: Tensor) -> bool:
    """Same values on every tp rank: a plain tensor, or a DTensor not sharded over ``tp``
    (a mesh without dimension names counts as tp when it is 1-D and fully replicated)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return True
    if "tp" in _dim_names(p):
        return not _sharded_over(p, ("tp",))
    return all(pm.is_replicate() for pm in p.placements)


def build_groups(
    trainer: pl.Trainer, module: nn.Module, expert_patterns: tuple[str, ...]
) -> list[ReplicaGroup]:
    """Replica groups: dp/tp(/edp) of the run's :class:`ParallelDims`, labelled ``world`` when
    the group is the default world group (DDP and other data-parallel strategies).

    Under Lightning's FSDP strategies parameters are sharded, so no replica groups exist.
    """
    import fnmatch

    if comm.group_size() == 1 or lightning_fsdp(trainer):
        return []
    dims = ParallelDims.of(trainer)
    named = list(module.named_parameters())

    def expert(n: str) -> bool:
        return dims.ep > 1 and any(fnmatch.fnmatchcase(n, p) for p in expert_patterns)

    shard_dims = ("dp", "edp", "ep")
    dense = [(n, p) for n, p in named if not expert(n)]
    dp_params = [(n, p) for n, p in dense if not _sharded_over(p, shard_dims)]
    experts = [(n, p) for n, p in named if expert(n)]
    edp_params = [(n, p) for n, p in experts if not _sharded_over(p, ("dp", "edp"))]
    tp_params = [(n, p) for n, p in named if _replicated_over_tp(p)]
    out = []
    for name, params, total in (
        ("dp", dp_params, len(dense)),
        ("edp", edp_params, len(experts)),
        ("tp", tp_params, len(named)),
    ):
        if dims.size(name) > 1 and (params or total):
            group = dims.get_group(name) or dist.group.WORLD
            out.append(ReplicaGroup(
                name="world" if group is dist.group.WORLD else name, group=group,  # type: ignore[arg-type]
                params=params, skipped=total - len(params),
            ))  # fmt: skip
    return out


def fingerprints(params: Sequence[tuple[str, Tensor]], device: torch.device) -> Tensor:
    """``[P, 2]`` float64 table of ``(sum, abs_sum)`` per parameter."""
    rows = [
        torch.stack([t.double().sum(), t.double().abs().sum()])
        for t in (comm.to_local(p).detach() for _, p in params)
    ]
    return torch.stack(rows).to(device) if rows else torch.zeros(0, 2, dtype=torch.float64)


def find_drift(table: Tensor, rtol: float, atol: float) -> tuple[Tensor, Tensor]:
    """From a ``[G, P, 2]`` table: ``(drifting [G, P] bool, reference group-rank [P])``."""
    diff = (table[:, None] - table[None, :]).abs().amax(-1)  # [G, G, P]
    tol = rtol * table[..., 1].abs().amax(0) + atol  # [P]
    close = diff <= tol
    ref = close.sum(1).argmax(0)  # first maximum -> lowest rank on ties
    drifting = ~close[ref, :, torch.arange(table.shape[1])].T  # [G, P]
    return drifting, ref


def ambiguous(table: Tensor, rtol: float, atol: float) -> Tensor:
    """``[P]`` bool: the reference of each parameter has no strict majority in its group."""
    diff = (table[:, None] - table[None, :]).abs().amax(-1)
    tol = rtol * table[..., 1].abs().amax(0) + atol
    agree = (diff <= tol).sum(1).amax(0)  # [P], the reference's supporters (itself included)
    return 2 * agree <= table.shape[0]


def check_group(rg: ReplicaGroup, rtol: float, atol: float, max_full: int) -> list[Drift]:
    """Collective over ``rg.group``: fingerprints, then full comparison of drifting params."""
    if not rg.params:  # same list on every member: nobody calls the collectives
        return []
    dev = comm.group_device(rg.group)
    ranks = dist.get_process_group_ranks(rg.group)
    local = fingerprints(rg.params, dev)
    table = torch.stack(comm.all_gather(local, rg.group))  # [G, P, 2]
    drifting, ref = find_drift(table.cpu(), rtol, atol)
    tie = ambiguous(table.cpu(), rtol, atol)
    bad = drifting.any(0).nonzero().flatten().tolist()[:max_full]
    out = []
    for i in bad:  # identical list on every rank: the table is the same everywhere
        name, p = rg.params[i]
        full = comm.to_local(p).detach().reshape(-1)
        gathered = comm.all_gather(full, rg.group)
        r0 = int(ref[i])
        diffs = [(g.double() - gathered[r0].double()).abs() for g in gathered]
        out.append(Drift(
            name=name, shape=list(comm.to_local(p).shape),
            drifting_ranks=[ranks[g] for g in range(len(ranks)) if drifting[g, i]],
            reference_rank=ranks[r0],
            fingerprints={ranks[g]: table[g, i].tolist() for g in range(len(ranks))},
            max_abs_diff={ranks[g]: float(d.max()) for g, d in enumerate(diffs)},
            worst_index={ranks[g]: int(d.argmax()) for g, d in enumerate(diffs)},
            ambiguous=bool(tie[i]),
        ))  # fmt: skip
    return out


def resync(rg: ReplicaGroup, drift: list[Drift]) -> None:
    """Collective: overwrite drifting parameters with the reference rank's values."""
    params = dict(rg.params)
    for d in drift:
        src = dist.get_group_rank(rg.group, d.reference_rank)
        comm.broadcast(comm.to_local(params[d.name]).detach(), src=src, group=rg.group)
