"""Replica-consistency check: parameters that must be identical across a group.

After an optimizer step, DP replicas (and TP-replicated parameters such as norms) must hold the
same values. Each rank computes a cheap fingerprint per parameter, ``(sum(p), sum(|p|))`` in
float64, and all-gathers the ``[P, 2]`` table over the group. Parameter ``p`` of rank ``r``
*drifts* when its fingerprint differs from the reference by more than
``rtol * max_r sum(|p_r|) + atol``; the reference is the rank that agrees with most others
(ties: the lowest rank). Only drifting parameters are then all-gathered in full to report the
largest element-wise difference and where it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_mmpar.callbacks.anomalies import comm_device

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


def _local(p: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p


def _sharded_over(p: Tensor, dims: tuple[str, ...]) -> bool:
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return False
    names = p.device_mesh.mesh_dim_names or ()
    return any(
        n in dims and not pm.is_replicate() for n, pm in zip(names, p.placements, strict=False)
    )


def _replicated_over_tp(p: Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return not isinstance(p, DTensor) or all(pm.is_replicate() for pm in p.placements)


def build_groups(
    trainer: pl.Trainer, module: nn.Module, expert_patterns: tuple[str, ...]
) -> list[ReplicaGroup]:
    """Replica groups: dp/tp(/edp) under ``mm_parallel``, the world group otherwise.

    Under Lightning's FSDP strategies parameters are sharded, so no replica groups exist.
    """
    import fnmatch

    from lightning.pytorch.strategies import FSDPStrategy

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return []
    if isinstance(trainer.strategy, FSDPStrategy):
        return []
    named = list(module.named_parameters())
    dims: Any = getattr(trainer.strategy, "parallel_dims", None)
    if dims is None or not hasattr(dims, "get_mesh"):
        return [ReplicaGroup(name="world", group=dist.group.WORLD, params=named)]  # type: ignore[arg-type]

    def expert(n: str) -> bool:
        return dims.ep > 1 and any(fnmatch.fnmatchcase(n, p) for p in expert_patterns)

    shard_dims = ("dp", "edp", "ep")
    dense = [(n, p) for n, p in named if not expert(n) and not _sharded_over(p, shard_dims)]
    out = []
    for name, size, params in (
        ("dp", dims.dp, dense),
        ("edp", dims.edp, [(n, p) for n, p in named if expert(n)]),
        ("tp", dims.tp, [(n, p) for n, p in named if _replicated_over_tp(p)]),
    ):
        if size > 1 and params:
            out.append(
                ReplicaGroup(name=name, group=dims.get_mesh(name).get_group(), params=params)
            )
    return out


def fingerprints(params: Sequence[tuple[str, Tensor]], device: torch.device) -> Tensor:
    """``[P, 2]`` float64 table of ``(sum, abs_sum)`` per parameter."""
    rows = [
        torch.stack([_local(p).detach().double().sum(), _local(p).detach().double().abs().sum()])
        for _, p in params
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


def check_group(rg: ReplicaGroup, rtol: float, atol: float, max_full: int) -> list[Drift]:
    """Collective over ``rg.group``: fingerprints, then full comparison of drifting params."""
    dev = comm_device(rg.group)
    ranks = dist.get_process_group_ranks(rg.group)
    local = fingerprints(rg.params, dev)
    flat = torch.empty(len(ranks) * local.shape[0], 2, dtype=local.dtype, device=dev)
    dist.all_gather_into_tensor(flat, local, group=rg.group)  # gloo wants the [G*P, 2] form
    table = flat.reshape(len(ranks), *local.shape)
    drifting, ref = find_drift(table.cpu(), rtol, atol)
    bad = drifting.any(0).nonzero().flatten().tolist()[:max_full]
    out = []
    for i in bad:  # identical list on every rank: the table is the same everywhere
        name, p = rg.params[i]
        full = _local(p).detach().reshape(-1).to(dev)
        gathered = [torch.empty_like(full) for _ in ranks]
        dist.all_gather(gathered, full, group=rg.group)
        r0 = int(ref[i])
        diffs = [(g.double() - gathered[r0].double()).abs() for g in gathered]
        out.append(Drift(
            name=name, shape=list(_local(p).shape),
            drifting_ranks=[ranks[g] for g in range(len(ranks)) if drifting[g, i]],
            reference_rank=ranks[r0],
            fingerprints={ranks[g]: table[g, i].tolist() for g in range(len(ranks))},
            max_abs_diff={ranks[g]: float(d.max()) for g, d in enumerate(diffs)},
            worst_index={ranks[g]: int(d.argmax()) for g, d in enumerate(diffs)},
        ))  # fmt: skip
    return out


def resync(rg: ReplicaGroup, drift: list[Drift]) -> None:
    """Collective: overwrite drifting parameters with the reference rank's values."""
    params = dict(rg.params)
    for d in drift:
        t = _local(params[d.name]).detach()
        buf = t.to(comm_device(rg.group))
        dist.broadcast(buf, src=d.reference_rank, group=rg.group)
        t.copy_(buf)
