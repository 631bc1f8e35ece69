"""The numerics core: one global gradient norm and clip, one vocab-parallel cross-entropy.

**Global gradient norm.** A rank holding the local piece ``g_r`` of a parameter's gradient adds
``w * |g_r|^2`` to one float64 sum, with ``w = S * pp / world``: ``S`` is the number of distinct
shards of the parameter (product of the mesh sizes of a DTensor's ``Shard`` placements, 1 for a
plain tensor), ``pp`` the pipeline degree and ``world`` the size of the reducing group. The
parameter lives on the ``world / pp`` ranks of one pipeline stage, each shard on
``world / (pp * S)`` of them, so ONE all-reduce of the sums over the world gives exactly
``|g|^2 = sum_pp sum_p |g_p|^2``: pipeline stages add up, replicated copies (TP-replicated
norms, data-parallel replicas) count once. The per-parameter norms come from one fused
``torch._foreach_norm`` and never reach the host. Under Lightning's FSDP (flat shards that
partition each parameter) pass ``weights`` of 1. A gradient with a ``Partial`` placement is
reduced to ``Replicate`` first (a DTensor collective per such gradient; rare).

Clipping scales every gradient by ``min(1, max_norm / (|g| + 1e-6))``, the rule of
``torch.nn.utils.clip_grad_norm_``; a NaN norm leaves the gradients as they are (torch would
turn every gradient into NaN). Used by ``Trainer(gradient_clip_val=...)`` under ``mm_parallel``
and by the stability callbacks.

**Vocab-parallel cross-entropy** (Megatron-LM's ``vocab_parallel_cross_entropy``, Shoeybi et al.
2019, section 3). Rank ``r`` holds logits ``z[:, V_r]`` of its vocabulary slice ``V_r``::

    m   = max_r max_{v in V_r} z_v                  (all-reduce MAX)
    S   = sum_r sum_{v in V_r} exp(z_v - m)         (all-reduce SUM, together with z_y)
    z_y = sum_r [y in V_r] z_y
    loss = mean over non-ignored tokens of log S + m - z_y

The backward needs no communication: ``d loss / d z_v = (softmax_v - [v == y]) / n`` locally.
Unlike ``torch.distributed.tensor.parallel.loss_parallel`` it needs no context manager around
the backward, so Lightning's own ``backward`` call works, and it returns a plain tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lightning_mmpar.parallel import comm

__all__ = [
    "clip_grad_norm_",
    "global_grad_norm",
    "global_norm_from_local",
    "grad_norm_weights",
    "local_grad_norms",
    "scale_grads_",
    "shard_count",
    "vocab_parallel_cross_entropy",
]


# ------------------------------------------------------------------------------- grad norm
def shard_count(t: Tensor) -> int:
    """Number of distinct shards of a DTensor (product of the mesh sizes of its sharded
    placements: ``Shard`` and FSDP2's ``_StridedShard`` over a tensor-parallel shard, for which
    ``is_shard()`` is false); 1 for a plain tensor or a fully replicated DTensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return 1
    n = 1
    for i, placement in enumerate(t.placements):
        if not (placement.is_replicate() or placement.is_partial()):  # Shard, _StridedShard
            n *= t.device_mesh.size(i)
    return n


def grad_norm_weights(
    params: Iterable[Tensor], *, pp: int = 1, group: dist.ProcessGroup | None = None
) -> list[float]:
    """``w = S * pp / world`` for every parameter of ``params`` (module docstring)."""
    world = comm.group_size(group)
    return [shard_count(p) * pp / world for p in params]


def _local_grad(p: Tensor) -> Tensor:
    """This rank's piece of ``p.grad``; a ``Partial`` gradient is reduced first."""
    from torch.distributed.tensor import DTensor, Replicate

    grad = p.grad
    assert grad is not None
    if isinstance(grad, DTensor) and any(pl.is_partial() for pl in grad.placements):
        placements = [Replicate() if pl.is_partial() else pl for pl in grad.placements]
        grad = grad.redistribute(grad.device_mesh, placements)
    return comm.to_local(grad)


def local_grad_norms(params: Sequence[Tensor]) -> Tensor:
    """``[P]`` float64 norms of the local gradient pieces of ``params`` (all must have a
    gradient), from one fused ``torch._foreach_norm``, on the first gradient's device.

    The norms accumulate in each gradient's dtype, as in ``torch.nn.utils.clip_grad_norm_``.
    """
    grads = [_local_grad(p) for p in params]
    if not grads:
        return torch.zeros(0, dtype=torch.float64)
    device = grads[0].device
    return torch.stack([n.to(device) for n in torch._foreach_norm(grads)]).double()


def _with_grads(
    params: Iterable[Tensor], weights: Sequence[float] | None
) -> tuple[list[Tensor], list[float] | None]:
    params = list(params)
    if weights is not None and len(weights) != len(params):
        raise ValueError(
            f"weights has {len(weights)} entries for {len(params)} parameters; pass one weight "
            "per parameter (or None for S * pp / world)."
        )
    keep = [i for i, p in enumerate(params) if p.grad is not None]
    kept_weights = None if weights is None else [float(weights[i]) for i in keep]
    return [params[i] for i in keep], kept_weights


def global_grad_norm(
    params: Iterable[Tensor],
    *,
    pp: int = 1,
    group: dist.ProcessGroup | None = None,
    weights: Sequence[float] | None = None,
) -> Tensor:
    """L2 norm of the gradients of the whole model, identical on every rank of ``group``.

    ``params``: this rank's parameters (plain tensors or DTensors); those without a gradient
    are skipped. ``pp``: pipeline degree. ``group``: the group spanning every rank (``None``:
    the default world group). ``weights``: one per parameter, overriding ``S * pp / world``.
    Returns a 0-dim float64 tensor on the gradients' device (CPU without gradients).
    Collective over ``group``: every rank must call it. Raises ``ValueError`` when ``weights``
    does not have one entry per parameter.
    """
    params, weights = _with_grads(params, weights)
    if weights is None:
        weights = grad_norm_weights(params, pp=pp, group=group)
    return global_norm_from_local(local_grad_norms(params), weights, group=group)


def global_norm_from_local(
    local_norms: Tensor, weights: Sequence[float], *, group: dist.ProcessGroup | None = None
) -> Tensor:
    """``sqrt(sum_ranks sum_p w_p |g_p|^2)`` from this rank's ``[P]`` local norms
    (:func:`local_grad_norms`) and their weights (:func:`grad_norm_weights`): one all-reduce
    over ``group``, no host sync. For callers that also need the per-parameter norms.
    Collective over ``group``; returns a 0-dim float64 tensor, NaN or inf on every rank when
    any rank holds a non-finite gradient.
    """
    w = torch.tensor(list(weights), dtype=torch.float64, device=local_norms.device)
    sq = (local_norms.double().square() * w).sum()
    return comm.all_reduce(sq, "sum", group).sqrt()


@torch.no_grad()
def scale_grads_(params: Iterable[Tensor], max_norm: float, total_norm: Tensor | float) -> Tensor:
    """Scale every gradient in place by ``min(1, max_norm / (total_norm + 1e-6))`` (``1`` when
    ``total_norm`` is NaN), grouped by device and dtype, without a host sync.

    ``total_norm`` is the *global* norm (:func:`global_grad_norm`), so that every rank applies
    the same coefficient. Returns the coefficient (0-dim float64).
    """
    total = torch.as_tensor(total_norm, dtype=torch.float64)
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0).nan_to_num(nan=1.0)
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for p in params:
        if p.grad is not None:
            g = comm.to_local(p.grad)
            groups.setdefault((g.device, g.dtype), []).append(g)
    for (device, dtype), grads in groups.items():
        torch._foreach_mul_(grads, coef.to(device=device, dtype=dtype))
    return coef


def clip_grad_norm_(
    params: Iterable[Tensor],
    max_norm: float,
    *,
    pp: int = 1,
    group: dist.ProcessGroup | None = None,
    weights: Sequence[float] | None = None,
    local: bool = False,
) -> Tensor:
    """Clip the gradients so that their global norm is at most ``max_norm``.

    Arguments as in :func:`global_grad_norm`; returns the norm before clipping (0-dim float64).
    On one process this is ``torch.nn.utils.clip_grad_norm_``. Collective over ``group``, except
    with ``local=True``: the norm of this rank's gradients alone (every parameter weighted 1),
    for gradients every rank holds in full and alike (torch's DDP over the world).
    Raises ``ValueError`` for a negative ``max_norm``.
    """
    if max_norm < 0:
        raise ValueError(f"max_norm ({max_norm}) must be >= 0.")
    params = list(params)
    if local:
        norms = local_grad_norms([p for p in params if p.grad is not None])
        total = norms.square().sum().sqrt()
    else:
        total = global_grad_norm(params, pp=pp, group=group, weights=weights)
    scale_grads_(params, max_norm, total)
    return total


# -------------------------------------------------------------------- vocab-parallel CE
class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logits: Tensor, target: Tensor, start: int, ignore_index: int, group: Any
    ) -> Tensor:
        z = logits.float()
        m = comm.all_reduce(z.max(dim=-1).values, "max", group)
        z = z - m.unsqueeze(-1)
        local = target - start
        inside = (local >= 0) & (local < z.shape[-1]) & (target != ignore_index)
        local = torch.where(inside, local, torch.zeros_like(local))
        picked = z.gather(-1, local.unsqueeze(-1)).squeeze(-1) * inside
        exp = z.exp()
        sums = comm.all_reduce(torch.stack([picked, exp.sum(dim=-1)]), "sum", group)
        picked, total = sums[0], sums[1]
        valid = target != ignore_index
        count = valid.sum().clamp(min=1)
        loss = ((total.log() - picked) * valid).sum() / count
        ctx.save_for_backward(exp / total.unsqueeze(-1), local, inside, valid, count)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        softmax, local, inside, valid, count = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, local.unsqueeze(-1), -inside.to(g.dtype).unsqueeze(-1))
        g = g * (valid.to(g.dtype) / count * grad).unsqueeze(-1)
        return g.to(ctx.dtype), None, None, None, None


def _vocab_mesh_dim(logits: Any) -> int:
    """The mesh dim that shards the vocab (last) dim; every other mesh dim must replicate."""
    from torch.distributed.tensor import Shard

    last = (-1, logits.ndim - 1)
    vocab = [i for i, p in enumerate(logits.placements) if isinstance(p, Shard) and p.dim in last]
    others = [p for i, p in enumerate(logits.placements) if i not in vocab]
    if len(vocab) != 1 or not all(p.is_replicate() for p in others):
        raise ValueError(
            f"vocab-parallel cross-entropy needs logits sharded on the vocab dim "
            f"(Shard({logits.ndim - 1})) over one mesh dim and replicated over the others, got "
            f"{list(logits.placements)}; use a colwise LM head with use_local_output=False."
        )
    return vocab[0]


def vocab_parallel_cross_entropy(
    logits: Tensor, target: Tensor, *, ignore_index: int = -100
) -> Tensor:
    """Mean token cross-entropy of ``logits [..., V]`` against global ids ``target [...]``.

    ``logits`` is a plain tensor (``F.cross_entropy`` in float32) or a DTensor sharded on the
    vocab dim (``Shard(-1)``, as a colwise LM head returns under tensor parallelism; uneven
    shards as ``torch.chunk`` splits them). Tokens equal to ``ignore_index`` do not count. Returns
    a plain 0-dim float32 tensor, equal on every rank of the vocab group, whose backward gives
    each rank the gradient of its own shard (no context manager needed). Raises ``ValueError``
    for DTensor logits with other placements.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(target, DTensor):
        target = target.full_tensor()
    if not isinstance(logits, DTensor):
        flat = logits.reshape(-1, logits.shape[-1]).float()
        return F.cross_entropy(flat, target.reshape(-1), ignore_index=ignore_index)
    dim = _vocab_mesh_dim(logits)
    mesh = logits.device_mesh
    chunk = -(-logits.shape[-1] // mesh.size(dim))
    start = min(mesh.get_local_rank(dim) * chunk, logits.shape[-1])
    local = comm.to_local(logits)
    out = _VocabParallelCrossEntropy.apply(
        local.reshape(-1, local.shape[-1]),
        target.reshape(-1),
        start,
        ignore_index,
        mesh.get_group(dim),
    )
    assert isinstance(out, Tensor)
    return out
