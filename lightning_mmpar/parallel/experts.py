"""Expert parallelism for one mixture-of-experts layer: all-to-all dispatch over an ``ep`` mesh.

Model-agnostic: it works on any module with stacked expert weights ``[E, ...]`` (dim 0 = expert)
and an ``expert_dispatch`` hook, such as :class:`lightning_mmpar.models.MoEFeedForward`.
:func:`apply_expert_parallel` keeps this rank's contiguous block of ``E / ep`` experts, as
DTensors ``Shard(0)`` over the 1-D ``ep`` mesh (so DCP reshards them between ep sizes and
``full_state_dict`` gathers them), and installs an :class:`AllToAllDispatcher`. Data flow of one
forward on ep rank ``r`` of ``P``, ``E_l = E / P`` local experts (Megatron-core's
``MoEAlltoAllTokenDispatcher``, DeepSpeed's ``MOELayer``)::

    route locally (full router, own tokens)  -> tokens [N, D] sorted by global expert, counts [E]
    all-to-all of counts.view(P, E_l)        -> recv [P, E_l] (row s: from rank s, per local expert)
    all_to_all_single(tokens, splits)        -> [M, D] ordered (source rank, local expert)
    sort chunks to (local expert, source)    -> compute(local experts, recv.sum(0) [E_l])
    unsort, reverse all_to_all_single        -> [N, D] in the routed order -> combine (local)

Routing, capacity, aux losses and statistics stay per rank (computed on this rank's tokens, like
DeepSpeed's ``l_aux`` and Megatron's per-rank capacity); nothing about them is communicated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from lightning_mmpar.parallel import comm

__all__ = ["AllToAllDispatcher", "apply_expert_parallel", "expert_parallel_block"]

ExpertCompute = Callable[[Tensor, Tensor], Tensor]
"""``(tokens [M, D] sorted by local expert, tokens_per_local_expert [E_l]) -> [M, D]``."""

EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")
"""Parameter names of :class:`~lightning_mmpar.models.MoEFeedForward`'s stacked experts."""


def expert_parallel_block(num_experts: int, ep_size: int, ep_rank: int) -> range:
    """Global ids of the experts ep rank ``ep_rank`` holds: the contiguous block
    ``[ep_rank * E / ep, (ep_rank + 1) * E / ep)`` (Megatron-core's and DeepSpeed's placement).

    Raises ``ValueError`` when ``num_experts`` is not a multiple of ``ep_size`` or the rank is
    outside ``[0, ep_size)``.
    """
    if ep_size < 1 or num_experts % ep_size:
        raise ValueError(
            f"num_experts ({num_experts}) must be divisible by the expert-parallel size "
            f"(ep = {ep_size}); choose ep among the divisors of num_experts or change "
            "num_experts."
        )
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank ({ep_rank}) must be in [0, {ep_size}); pass the ep-group rank.")
    local = num_experts // ep_size
    return range(ep_rank * local, (ep_rank + 1) * local)


class AllToAllDispatcher:
    """Moves expert-sorted tokens to the ranks that hold their experts and the outputs back.

    Call it as ``dispatcher(tokens [N, D], tokens_per_expert [E], compute) -> [N, D]``:
    ``tokens`` are this rank's routed tokens sorted by *global* expert id, ``tokens_per_expert``
    their group sizes; ``compute(local_tokens [M, D], local_counts [E_l]) -> [M, D]`` runs this
    rank's ``E_l = E / ep`` experts on the tokens every rank routed to them. The result holds,
    row for row, the expert output of each input token, so ``combine`` runs unchanged.
    Differentiable in ``tokens`` and through ``compute`` (the backward pass runs the reverse
    all-to-alls). Every rank of the ``ep`` group must call it once per forward and, in training,
    backpropagate through its output once (both directions are collectives).

    Raises ``ValueError`` when ``tokens_per_expert`` does not hold ``num_experts`` counts summing
    to the rows of ``tokens``. Peers: Megatron-core ``MoEAlltoAllTokenDispatcher`` (counts
    exchange, ``sort_chunks_by_idxs``), DeepSpeed ``MOELayer`` (``_AllToAll``).
    """

    def __init__(self, num_experts: int, group: Any) -> None:
        self.group = group
        self.ep_size = comm.group_size(group)
        self.block = expert_parallel_block(num_experts, self.ep_size, comm.group_rank(group))
        self.num_experts = num_experts
        self.last_received: Tensor | None = None
        """``[ep, E_l]`` long: tokens each source rank sent to each local expert, last forward."""

    def __deepcopy__(self, memo: dict[int, Any]) -> AllToAllDispatcher:
        return self  # holds a process group: a copied layer shares its dispatcher

    def _check(self, tokens: Tensor, tokens_per_expert: Tensor) -> None:
        if tokens_per_expert.numel() != self.num_experts:
            raise ValueError(
                f"tokens_per_expert has {tokens_per_expert.numel()} counts but the dispatcher "
                f"was built for num_experts = {self.num_experts}; build both from one config."
            )
        if int(tokens_per_expert.sum()) != tokens.shape[0]:
            raise ValueError(
                f"tokens_per_expert sums to {int(tokens_per_expert.sum())} but tokens has "
                f"{tokens.shape[0]} rows; pass the counts of the expert-sorted tokens."
            )

    def __call__(self, tokens: Tensor, tokens_per_expert: Tensor, compute: ExpertCompute) -> Tensor:
        self._check(tokens, tokens_per_expert)
        if torch.is_grad_enabled() and not tokens.requires_grad:
            # the backward pass runs the reverse all-to-all on every rank, even one whose tokens
            # need no gradient (frozen input or no token at all): a peer waits for it
            tokens = tokens.detach().requires_grad_()
        ep, local = self.ep_size, len(self.block)
        sent = tokens_per_expert.detach().to(torch.long).cpu().view(ep, local)
        received = comm.all_to_all_counts(sent, self.group).view(ep, local)
        self.last_received = received
        in_splits, out_splits = sent.sum(1).tolist(), received.sum(1).tolist()
        gathered = comm.all_to_all_single(tokens, out_splits, in_splits, self.group)
        order = _chunk_order(received).to(tokens.device)
        out = compute(gathered[order], received.sum(0))
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        return comm.all_to_all_single(out[back], in_splits, out_splits, self.group)


def _chunk_order(received: Tensor) -> Tensor:
    """Row order turning ``(source, local expert)``-ordered rows into ``(local expert, source)``
    order (Megatron's ``sort_chunks_by_idxs``); ``received [P, E_l]`` are the chunk sizes."""
    ep, local = received.shape
    source = torch.arange(ep)[:, None]
    expert = torch.arange(local)[None, :]
    position = (expert * ep + source).reshape(-1)  # chunk (s, e) goes to place e * P + s
    rows = torch.repeat_interleave(position, received.reshape(-1))
    return torch.sort(rows, stable=True).indices


def _mesh_1d(mesh: DeviceMesh) -> None:
    if mesh.ndim != 1:
        raise ValueError(
            f"mesh must be the 1-D expert-parallel mesh, got {mesh.ndim} dims "
            f"({mesh.mesh_dim_names}); pass mesh['ep']."
        )


def apply_expert_parallel(
    module: nn.Module,
    mesh: DeviceMesh,
    *,
    ep_size: int | None = None,
    weights: Sequence[str] = EXPERT_WEIGHTS,
) -> nn.Module:
    """Shard ``module``'s experts over the 1-D ``ep`` mesh and dispatch its tokens all-to-all.

    ``module`` holds all ``E`` experts' weights ``[E, ...]`` (the names in ``weights``, on
    ``module.experts`` when it has such a submodule, else on ``module`` itself; the same values
    on every rank: same seed or loaded afterwards with DCP) and an ``expert_dispatch``
    attribute. Each weight becomes a ``DTensor`` of global shape ``[E, ...]``, placement
    ``Shard(0)`` over ``mesh``, whose local tensor is this rank's contiguous block
    ``[E / ep, ...]`` (:func:`expert_parallel_block`); state-dict names do not change, and the
    gradient of each weight is the gradient of that block from every rank's tokens.
    ``module.expert_dispatch`` becomes an :class:`AllToAllDispatcher`. Returns ``module``
    (changed in place). The gradient of dense parameters (the router) is this rank's own; the
    reduction over data-parallel and expert-data-parallel replicas is not done here.

    Raises ``ValueError`` (naming the field, value and fix) when ``mesh`` is not 1-D,
    ``ep_size`` is given and differs from the mesh size, ``E`` is not divisible by the mesh
    size, the weights disagree on ``E``, a weight is missing or already sharded, or ``module``
    has no ``expert_dispatch`` hook.
    """
    _mesh_1d(mesh)
    size = mesh.size()
    if ep_size is not None and ep_size != size:
        raise ValueError(
            f"ep_size ({ep_size}) differs from the ep mesh's size ({size}); pass the mesh of "
            "the expert-parallel group or the matching ep_size."
        )
    if not hasattr(module, "expert_dispatch"):
        raise ValueError(
            f"module ({type(module).__name__}) has no expert_dispatch hook; pass an MoE layer "
            "such as lightning_mmpar.models.MoEFeedForward."
        )
    holder = module.experts if isinstance(getattr(module, "experts", None), nn.Module) else module
    params = {}
    for name in weights:
        p = getattr(holder, name, None)
        if not isinstance(p, nn.Parameter) or isinstance(p.data, DTensor):
            raise ValueError(
                f"weights entry {name!r} of {type(holder).__name__} is not an unsharded "
                "parameter; apply expert parallelism once, to a module with full experts."
            )
        params[name] = p
    counts = {name: p.shape[0] for name, p in params.items()}
    if len(set(counts.values())) != 1:
        raise ValueError(
            f"expert weights disagree on the number of experts (dim 0): {counts}; stack "
            "every expert weight as [E, ...]."
        )
    num_experts = next(iter(counts.values()))
    group = mesh.get_group()
    block = expert_parallel_block(num_experts, size, mesh.get_local_rank())
    for name, p in params.items():
        local = p.detach()[block.start : block.stop].clone()
        shard = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride()
        )
        setattr(holder, name, nn.Parameter(shard, requires_grad=p.requires_grad))
    setattr(module, "expert_dispatch", AllToAllDispatcher(num_experts, group))  # noqa: B010
    return module
