"""Replica-consistency check: parameters that must be identical across a group.

After an optimizer step, DP replicas (and TP-replicated parameters such as norms) must hold the
same values. Each rank computes a cheap fingerprint per parameter, ``(sum(p), sum(|p|))`` in
float64, and all-gathers the ``[P, 2]`` table over the group. Parameter ``p`` of rank ``r``
*drifts* when its fingerprint differs from the reference by more than
``rtol * max_r sum(|p_r|) + atol``; the reference is the rank that agrees with most others
(ties: the lowest rank). Only drifting parameters are then all-gathered in full to report the
largest element-wise difference and where it is. With two ranks in a group (or any tie) the
majority cannot tell which side drifted: the record then says ``ambiguous``.

Groups (:func:`build_groups`, from ``TrainerTopology.of(trainer).dims`` under ``mm_parallel`` or
Lightning's ``ModelParallelStrategy``; the world group, labelled ``world``, under DDP and other
data-parallel strategies), each compared over local shards. Which parameters a group compares is
decided from the parameters' placements and meshes, never from mesh dimension names
(:func:`shard_key`): a parameter is compared over a group only when every member holds the same
shard of it (torch DTensor semantics: equal coordinates on every non-``Replicate`` mesh dim).

* ``tp``: parameters not sharded over tp (plain tensors, DTensors ``Replicate`` over tp, e.g.
  LayerNorm weights, also when FSDP shards them on dp: the tp peers hold the same dp shard);
* ``dp``: dense parameters not sharded over dp (``data_parallel="ddp"``, DDP, parameters FSDP
  does not manage). FSDP-sharded parameters have no replica over dp: they are skipped, and
  :attr:`ReplicaGroup.skipped` counts them;
* ``edp``: expert parameters (``expert_patterns``) when ``ep > 1``;
* never across pipeline ranks: they hold different parameters (the tp/dp/edp groups lie inside
  one pipeline stage).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_mmpar.callbacks.anomalies import Anomaly
from lightning_mmpar.parallel import comm
from lightning_mmpar.trainer_topology import TrainerTopology

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


def shard_key(p: Tensor) -> tuple[Any, ...]:
    """Which part of a parameter this rank holds, from its placements and mesh (not names).

    A plain tensor is a whole, replicated copy: ``("full", shape)``. A DTensor holds the shard
    given by its mesh coordinates on the dims whose placement is not ``Replicate`` (``Shard``,
    ``Partial``): ``("dtensor", shape, ((dim, placement, coordinate, size), ...))``. Two ranks
    hold the same values exactly when their keys are equal: inside one mesh, the ranks whose
    coordinates agree on every non-``Replicate`` dim (torch DTensor semantics); across meshes
    (a TP submesh per dp replica, as torch's ``parallelize_module`` under DDP), ranks at the
    same shard position, replicated over the dims outside the mesh like a plain tensor.
    A rank outside the parameter's mesh gets a key of its own.
    """
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return ("full", tuple(p.shape))
    mesh = p.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        return ("absent", comm.group_rank())
    sharded = tuple(
        (d, str(pm), coord[d], mesh.size(d))
        for d, pm in enumerate(p.placements)
        if not pm.is_replicate()
    )
    return ("dtensor", tuple(p.shape), sharded)


def build_groups(
    trainer: pl.Trainer, module: nn.Module, expert_patterns: tuple[str, ...]
) -> list[ReplicaGroup]:
    """Replica groups: dp/tp(/edp) of the run's :class:`~lightning_mmpar.topology.ParallelDims`,
    labelled ``world`` when the group is the default world group (DDP and other data-parallel
    strategies).

    Collective over the world (once, at fit start): every rank's :func:`shard_key` per
    parameter is gathered, and a parameter is compared over a group only when every member
    holds it with the same key - whatever the strategy and the mesh's dimension names (a
    user's ``fully_shard`` on an unnamed mesh included). Sharded parameters are never compared
    across shards; they count in :attr:`ReplicaGroup.skipped`. Under Lightning's FSDP strategies
    (flat shards, plain tensors) no replica groups exist.
    """
    import fnmatch

    topology = TrainerTopology.of(trainer)
    if comm.group_size() == 1 or topology.lightning_fsdp:
        return []
    dims = topology.dims
    named = list(module.named_parameters())
    keys = comm.all_gather_objects({n: shard_key(p) for n, p in named})

    def expert(n: str) -> bool:
        return dims.ep > 1 and any(fnmatch.fnmatchcase(n, p) for p in expert_patterns)

    def same(group: dist.ProcessGroup, params: list[tuple[str, Tensor]]) -> list[Any]:
        ranks = dist.get_process_group_ranks(group)
        return [(n, p) for n, p in params if len({repr(keys[r].get(n)) for r in ranks}) == 1]

    dense = [(n, p) for n, p in named if not expert(n)]
    experts = [(n, p) for n, p in named if expert(n)]
    out = []
    for name, params in (("dp", dense), ("edp", experts), ("tp", named)):
        if dims.size(name) > 1 and params:
            group = dims.get_group(name) or dist.group.WORLD
            kept = same(group, params)  # type: ignore[arg-type]
            out.append(
                ReplicaGroup(
                    name="world" if group is dist.group.WORLD else name,
                    group=group,  # type: ignore[arg-type]
                    params=kept,
                    skipped=len(params) - len(kept),
                )
            )
    return out


def fingerprints(params: Sequence[tuple[str, Tensor]], device: torch.device) -> Tensor:
    """``[P, 2]`` float64 table of ``(sum, abs_sum)`` per parameter."""
    rows = [
        torch.stack([t.double().sum(), t.double().abs().sum()])
        for t in (comm.to_local(p).detach() for _, p in params)
    ]
    return torch.stack(rows).to(device) if rows else torch.zeros(0, 2, dtype=torch.float64)


def _close(table: Tensor, rtol: float, atol: float) -> Tensor:
    """``[G, G, P]`` bool: fingerprints of two ranks agree within tolerance. Equal values,
    non-finite ones included (NaN on both ranks), agree: identical copies are not drift, even
    when non-finite (the gradient checks report those)."""
    a, b = table[:, None], table[None, :]
    tol = rtol * torch.nan_to_num(table[..., 1].abs(), nan=0.0, posinf=0.0).amax(0) + atol
    same = (a == b) | (a.isnan() & b.isnan())
    return (((a - b).abs() <= tol[..., None]) | same).all(-1)


def find_drift(table: Tensor, rtol: float, atol: float) -> tuple[Tensor, Tensor]:
    """From a ``[G, P, 2]`` table: ``(drifting [G, P] bool, reference group-rank [P])``."""
    close = _close(table, rtol, atol)  # [G, G, P]
    ref = close.sum(1).argmax(0)  # first maximum -> lowest rank on ties
    drifting = ~close[ref, :, torch.arange(table.shape[1])].T  # [G, P]
    return drifting, ref


def ambiguous(table: Tensor, rtol: float, atol: float) -> Tensor:
    """``[P]`` bool: the reference of each parameter has no strict majority in its group."""
    agree = _close(table, rtol, atol).sum(1).amax(0)  # [P], the reference's supporters
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
        out.append(
            Drift(
                name=name,
                shape=list(comm.to_local(p).shape),
                drifting_ranks=[ranks[g] for g in range(len(ranks)) if drifting[g, i]],
                reference_rank=ranks[r0],
                fingerprints={ranks[g]: table[g, i].tolist() for g in range(len(ranks))},
                max_abs_diff={ranks[g]: float(d.max()) for g, d in enumerate(diffs)},
                worst_index={ranks[g]: int(d.argmax()) for g, d in enumerate(diffs)},
                ambiguous=bool(tie[i]),
            )
        )
    return out


def resync(rg: ReplicaGroup, drift: list[Drift], optimizers: Sequence[Any] = ()) -> None:
    """Collective: overwrite drifting parameters, and their optimizer state (Adam's moments:
    otherwise the replicas drift apart again at the next step), with the reference rank's."""
    params = dict(rg.params)
    for d in drift:
        src = dist.get_group_rank(rg.group, d.reference_rank)
        p = params[d.name]
        comm.broadcast(comm.to_local(p).detach(), src=src, group=rg.group)
        for opt in optimizers:
            state = opt.state.get(p, {})
            for key in sorted(k for k, v in state.items() if isinstance(v, Tensor)):
                comm.broadcast(comm.to_local(state[key]), src=src, group=rg.group)


def drift_anomaly(d: Drift, step: int, rg: ReplicaGroup, action: str) -> Anomaly:
    """The ``replica_drift`` record of drifting parameter ``d`` of group ``rg`` at ``step``, as
    this rank writes it (``this_rank_drifts``: whether this rank is one of the drifting ones)."""
    me = comm.group_rank()
    return Anomaly(
        kind="replica_drift",
        step=step,
        rank=me,
        group=rg.name,
        param=d.name,
        shape=d.shape,
        action=action,
        values={
            "drifting_ranks": d.drifting_ranks,
            "this_rank_drifts": me in d.drifting_ranks,
            "reference_rank": d.reference_rank,
            "fingerprints": d.fingerprints,
            "max_abs_diff": d.max_abs_diff,
            "worst_index": d.worst_index,
            "ambiguous": d.ambiguous,
        },
    )
