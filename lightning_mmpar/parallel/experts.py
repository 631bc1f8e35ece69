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

Expert locality: ``placement=`` maps any expert to any rank (the layer's experts
are permuted first, :func:`permute_experts`, so each rank still holds a contiguous block of
*physical* experts); ``locality_groups=G`` restricts every token's routing to the experts of
its rank's group of ``ep / G`` ranks (DeepSeek-V3's node-limited routing in its strictest form).
The dispatcher counts the bytes it sends outside the group (``bytes_across_groups``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from lightning_mmpar.parallel import comm

__all__ = [
    "AllToAllDispatcher",
    "apply_expert_parallel",
    "expert_parallel_block",
    "expert_placement",
    "locality_group_ranks",
    "permute_experts",
    "placement_order",
]

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


def expert_placement(num_experts: int, ep_size: int) -> list[int]:
    """The ep rank of each expert under the default placement: contiguous blocks of ``E / ep``
    (expert ``e`` on rank ``e // (E / ep)``; Megatron-core's and DeepSpeed's). ``[E]`` ints.

    Raises ``ValueError`` when ``num_experts`` is not a multiple of ``ep_size``.
    """
    local = len(expert_parallel_block(num_experts, ep_size, 0))
    return [e // local for e in range(num_experts)]


def placement_order(placement: Sequence[int], ep_size: int) -> list[int]:
    """The expert order realising ``placement`` (``[E]``: ep rank of each logical expert) with
    contiguous blocks: physical slot ``p`` holds logical expert ``order[p]``; rank ``r``'s block
    holds its experts in increasing id order. The default placement gives ``range(E)``.

    Raises ``ValueError`` when an entry is outside ``[0, ep_size)`` or a rank does not get
    exactly ``E / ep_size`` experts.
    """
    num = len(placement)
    local = len(expert_parallel_block(num, ep_size, 0)) if num else 0
    counts = [sum(1 for r in placement if r == rank) for rank in range(ep_size)]
    if not num or any(not 0 <= int(r) < ep_size for r in placement) or set(counts) != {local}:
        raise ValueError(
            f"placement ({list(placement)}) must give each of the ep = {ep_size} ranks exactly "
            f"num_experts / ep = {local} experts (rank per expert, in [0, {ep_size})); got "
            f"{counts} experts per rank; list an ep rank for every expert."
        )
    return sorted(range(num), key=lambda e: (int(placement[e]), e))


ROUTER_BUFFERS = ("expert_bias", "pending_load", "expert_mask", "locality_mask")
"""Per-expert ``[..., E]`` buffers of an MoE layer (last dim = expert), permuted with it."""


def _expert_weights(
    module: nn.Module, weights: Sequence[str], field: str, fix: str
) -> tuple[nn.Module, dict[str, nn.Parameter]]:
    """``module.experts`` (or ``module``) and its unsharded stacked expert weights by name;
    ``ValueError`` naming ``field``, the entry and ``fix`` for a missing or sharded one."""
    experts = getattr(module, "experts", None)
    holder: nn.Module = experts if isinstance(experts, nn.Module) else module
    params = {}
    for name in weights:
        p = getattr(holder, name, None)
        if not isinstance(p, nn.Parameter) or isinstance(p.data, DTensor):
            raise ValueError(
                f"{field} entry {name!r} of {type(holder).__name__} is not an unsharded "
                f"parameter; {fix}."
            )
        params[name] = p
    return holder, params


@torch.no_grad()
def permute_experts(
    module: nn.Module, order: Sequence[int], *, weights: Sequence[str] = EXPERT_WEIGHTS
) -> nn.Module:
    """Reorder ``module``'s experts in place so that new expert ``p`` is old expert ``order[p]``.

    Permutes dim 0 of each stacked weight in ``weights`` (``[E, ...]``, on ``module.experts``
    when that is a submodule, else on ``module``), dim 1 of ``router_gate [M, E, R]`` and the
    last dim of the buffers in :data:`ROUTER_BUFFERS` where present (and gradients already
    there). The ``Parameter`` objects stay (build the optimizer afterwards: its state is not
    permuted). The layer computes the same function (outputs, aux loss, input gradients equal
    up to float summation order); per-expert figures (``last_stats``, ``expert_bias``, the
    state dict) are in the new order. Plain torch, no communication. Returns ``module``.

    Raises ``ValueError`` when ``order`` is not a permutation of ``range(E)``, a weight is
    missing or already sharded (permute before :func:`apply_expert_parallel`), or a tensor
    disagrees on ``E``.
    """
    fix = "permute the full experts before apply_expert_parallel"
    _, found = _expert_weights(module, weights, "permute_experts weights", fix)
    tensors: list[tuple[Tensor, int]] = [(p, 0) for p in found.values()]
    for name in ("router_gate", *ROUTER_BUFFERS):
        if isinstance(t := getattr(module, name, None), Tensor):
            tensors.append((t, 1 if name == "router_gate" else t.dim() - 1))
    num = tensors[0][0].shape[0] if tensors else 0
    ids = [int(i) for i in order]
    if sorted(ids) != list(range(num)):
        raise ValueError(
            f"permute_experts order ({list(order)}) must be a permutation of range({num}) "
            f"(num_experts = {num}); list every expert id exactly once."
        )
    for t, dim in tensors:
        if t.shape[dim] != num:
            raise ValueError(
                f"permute_experts: a tensor of shape {tuple(t.shape)} has {t.shape[dim]} experts "
                f"in dim {dim}, not num_experts ({num}); build the layer from one config."
            )
    index = torch.tensor(ids, dtype=torch.long)
    for t, dim in tensors:
        for x in (t, t.grad):
            if x is not None:
                x.copy_(x.index_select(dim, index.to(x.device)))
    return module


class AllToAllDispatcher:
    """Moves expert-sorted tokens to the ranks that hold their experts and the outputs back.

    Call it as ``dispatcher(tokens [N, D], tokens_per_expert [E], compute) -> [N, D]``:
    ``tokens`` are this rank's routed tokens sorted by *global* (physical) expert id,
    ``tokens_per_expert`` their group sizes; ``compute(local_tokens [M, D], local_counts [E_l])
    -> [M, D]`` runs this rank's ``E_l = E / ep`` experts on the tokens every rank routed to them.
    The result holds, row for row, the expert output of each input token, so ``combine`` runs
    unchanged. Differentiable in ``tokens`` and through ``compute`` (the backward pass runs the
    reverse all-to-alls). Every rank of the ``ep`` group must call it once per forward and, in
    training, backpropagate through its output once (both directions are collectives).

    ``placement`` (``[E]``, ep rank of each *logical* expert; default :func:`expert_placement`)
    is recorded with :attr:`logical_ids` (logical id of each physical expert, see
    :func:`placement_order`); ``locality_groups`` ``G`` splits the ep ranks into ``G``
    contiguous groups for :attr:`bytes_across_groups` (``None``: each rank is its own group).

    Raises ``ValueError`` when ``tokens_per_expert`` does not hold ``num_experts`` counts summing
    to the rows of ``tokens``, or on an invalid ``placement`` / ``locality_groups``. Peers:
    Megatron-core ``MoEAlltoAllTokenDispatcher`` (counts exchange, ``sort_chunks_by_idxs``),
    DeepSpeed ``MOELayer`` (``_AllToAll``).
    """

    def __init__(
        self,
        num_experts: int,
        group: Any,
        *,
        placement: Sequence[int] | None = None,
        locality_groups: int | None = None,
    ) -> None:
        self.group = group
        self.ep_size = size = comm.group_size(group)
        self.ep_rank = rank = comm.group_rank(group)
        self.block = expert_parallel_block(num_experts, size, rank)
        self.num_experts = num_experts
        default = expert_placement(num_experts, size)
        self.placement: list[int] = default if placement is None else [int(r) for r in placement]
        """``[E]``: ep rank of each logical expert."""
        self.logical_ids: list[int] = placement_order(self.placement, size)
        """``[E]``: logical id of each physical expert (``range(E)`` for the default)."""
        self.locality_groups = locality_groups
        self.group_ranks = locality_group_ranks(size, rank, locality_groups)
        """The ep ranks of this rank's locality group (itself alone when no groups are set)."""
        self.last_received: Tensor | None = None
        """``[ep, E_l]`` long: tokens each source rank sent to each local expert, last forward."""
        self.bytes_sent = 0
        """Bytes of token rows this rank's dispatch all-to-all sent to other ranks, summed over
        calls (the combine sends as many back; a recomputed forward counts again)."""
        self.bytes_across_groups = 0
        """The part of :attr:`bytes_sent` that went to ranks outside :attr:`group_ranks`: 0 under
        group-limited routing; without groups it equals :attr:`bytes_sent` (what G = ep saves)."""

    def __deepcopy__(self, memo: dict[int, Any]) -> AllToAllDispatcher:
        return self  # holds a process group: a copied layer shares its dispatcher

    def to_logical(self, values: Tensor) -> Tensor:
        """Per-expert figures ``[..., E]`` in physical order (``last_stats``) -> logical order."""
        out = torch.empty_like(values)
        out[..., torch.tensor(self.logical_ids, device=values.device)] = values
        return out

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
        rows = sent.sum(1).tolist()  # rows to each destination rank
        row_bytes = tokens.shape[1:].numel() * tokens.element_size()
        self.bytes_sent += (sum(rows) - rows[self.ep_rank]) * row_bytes
        outside = sum(n for r, n in enumerate(rows) if r not in self.group_ranks)
        self.bytes_across_groups += outside * row_bytes
        received = comm.all_to_all_counts(sent, self.group).view(ep, local)
        self.last_received = received
        in_splits, out_splits = rows, received.sum(1).tolist()
        gathered = comm.all_to_all_single(tokens, out_splits, in_splits, self.group)
        order = _chunk_order(received).to(tokens.device)
        out = compute(gathered[order], received.sum(0))
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        return comm.all_to_all_single(out[back], in_splits, out_splits, self.group)


def locality_group_ranks(ep_size: int, ep_rank: int, groups: int | None) -> range:
    """The ep ranks of ``ep_rank``'s locality group: ``ep_size`` split into ``groups`` contiguous
    groups of ``ep_size / groups`` ranks (e.g. one per node); ``None``: the rank alone.

    Raises ``ValueError`` when ``groups`` is not a positive divisor of ``ep_size``.
    """
    if groups is None:
        return range(ep_rank, ep_rank + 1)
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or ep_size % groups:
        raise ValueError(
            f"locality_groups ({groups!r}) must be a positive divisor of the ep size "
            f"({ep_size}); pass e.g. the number of nodes the ep group spans, or None."
        )
    width = ep_size // groups
    start = ep_rank // width * width
    return range(start, start + width)


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


def _checked_experts(
    module: nn.Module, mesh: DeviceMesh, ep_size: int | None, weights: Sequence[str]
) -> tuple[nn.Module, dict[str, nn.Parameter], int]:
    """The checks of :func:`apply_expert_parallel` on its mesh and module: returns the module
    holding the expert weights, the weights by name and ``E``; raises its ``ValueError``s."""
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
    fix = "apply expert parallelism once, to a module with full experts"
    holder, params = _expert_weights(module, weights, "weights", fix)
    counts = {name: p.shape[0] for name, p in params.items()}
    if len(set(counts.values())) != 1:
        raise ValueError(
            f"expert weights disagree on the number of experts (dim 0): {counts}; stack "
            "every expert weight as [E, ...]."
        )
    return holder, params, next(iter(counts.values()))


def apply_expert_parallel(
    module: nn.Module,
    mesh: DeviceMesh,
    *,
    ep_size: int | None = None,
    weights: Sequence[str] = EXPERT_WEIGHTS,
    placement: Sequence[int] | None = None,
    locality_groups: int | None = None,
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

    ``placement`` (``[E]``: ep rank of each expert, ``E / ep`` per rank; default
    :func:`expert_placement`) first reorders the experts (:func:`permute_experts` with
    :func:`placement_order`): the function is unchanged, but expert ids in the state dict,
    ``expert_bias``, ``last_stats`` and ExpertLoadMonitor are *physical* afterwards
    (``dispatcher.logical_ids`` / ``dispatcher.to_logical`` map them back). ``locality_groups``
    ``G`` (a divisor of ep) sets ``module.locality_mask`` to the experts of this rank's group of
    ``ep / G`` contiguous ranks (:func:`locality_group_ranks`): tokens are routed and dispatched
    only inside the group. This changes the function (a token sees only its group's experts;
    with ``G = ep`` each token stays on its rank, with ``G = 1`` nothing changes).

    Raises ``ValueError`` (naming the field, value and fix) when ``mesh`` is not 1-D,
    ``ep_size`` is given and differs from the mesh size, ``E`` is not divisible by the mesh
    size, the weights disagree on ``E``, a weight is missing or already sharded, ``module`` has
    no ``expert_dispatch`` hook (or no ``locality_mask`` for ``locality_groups``), or
    ``placement`` / ``locality_groups`` is invalid (:func:`placement_order`,
    :func:`locality_group_ranks`).
    """
    holder, params, num_experts = _checked_experts(module, mesh, ep_size, weights)
    size, rank = mesh.size(), mesh.get_local_rank()
    block = expert_parallel_block(num_experts, size, rank)
    if placement is not None and len(placement) != num_experts:
        raise ValueError(
            f"placement ({list(placement)}) has {len(placement)} entries but the layer has "
            f"num_experts = {num_experts}; give the ep rank of every expert."
        )
    order = placement_order(placement or expert_placement(num_experts, size), size)
    group_ranks = locality_group_ranks(size, rank, locality_groups)
    mask = getattr(module, "locality_mask", None)
    if locality_groups is not None and not isinstance(mask, Tensor):
        raise ValueError(
            f"locality_groups ({locality_groups}) needs a locality_mask [E] buffer on "
            f"{type(module).__name__}; use MoEFeedForward or pass locality_groups=None."
        )
    if order != list(range(num_experts)):
        permute_experts(module, order, weights=weights)
    if isinstance(mask, Tensor) and locality_groups is not None:
        owner = torch.arange(num_experts, device=mask.device) // len(block)  # physical -> rank
        mask.copy_((owner >= group_ranks.start) & (owner < group_ranks.stop))
    for name, p in params.items():
        local = p.detach()[block.start : block.stop].clone()
        shard = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride()
        )
        setattr(holder, name, nn.Parameter(shard, requires_grad=p.requires_grad))
    dispatcher = AllToAllDispatcher(
        num_experts, mesh.get_group(), placement=placement, locality_groups=locality_groups
    )
    setattr(module, "expert_dispatch", dispatcher)  # noqa: B010
    return module
