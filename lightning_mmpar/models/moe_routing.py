"""Mixture-of-experts routing math: configuration, top-k routing with
capacity, load-balancing and z losses, the aux-loss-free expert bias and sequence alignment.

Plain torch on one process: which token goes to which expert slot is decided here; moving tokens
(expert parallelism, ``parallel/``) and computing experts (:mod:`lightning_mmpar.models.moe`) are
separate. Conventions versus DeepSpeed and Megatron-core are listed in ``docs/experts.md``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

LoadBalancing = Literal["aux_loss", "aux_free"]


def _positive_int(name: str, value: int, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"MoEConfig.{name} ({value!r}) must be a positive integer; {fix}.")


def _non_negative(name: str, value: float, fix: str) -> None:
    if not value >= 0.0:  # also rejects NaN
        raise ValueError(f"MoEConfig.{name} ({value!r}) must be >= 0; {fix}.")


@dataclass(kw_only=True)
class MoEConfig:
    """Shape, routing and balancing of one MoE feed-forward layer.

    One router per modality over a shared expert pool (this package's dual-channel gating), top-k
    routing with capacity as in GShard (Lepikhin et al. 2020) and Switch (Fedus et al. 2021).

    Raises ``ValueError`` (naming field, value and fix) on construction for any invalid value.
    """

    num_experts: int = 4
    """Routed experts ``E`` in the shared pool (one pool for every modality)."""
    top_k: int = 2
    """Experts per token ``k`` (``1 <= k <= E``)."""
    ffn_width: int = 256
    """SwiGLU inner width ``F`` of each expert (LLaMA's ``intermediate_size``)."""
    capacity_factor: float | None = 1.25
    """Expert capacity ``C = max(ceil(k * T_m / E * capacity_factor), min_capacity)`` per
    modality with ``T_m`` unpadded tokens (Switch / GShard / Megatron). ``None``: dropless."""
    min_capacity: int = 0
    """Lower bound of the capacity (DeepSpeed's ``min_capacity``; 0 disables it)."""
    temperature: float = 1.0
    """Router softmax temperature ``tau``: ``p = softmax(logits / tau)``; 1.0 is the plain
    softmax, below 1 sharpens and above 1 flattens the routing (any ``tau > 0`` is accepted)."""
    router_dim: int | None = 64
    """Width of the router's shared input projection ``x W_r`` (``D -> router_dim``);
    ``None``: no projection, each router head reads ``x`` itself (``G_m [E, D]``, the plain
    linear router of Mixtral / Qwen-MoE)."""
    modalities: tuple[str, ...] = ("text", "vision")
    """One router (channel) per modality; modality id ``i`` in the forward's ``modality``
    tensor selects channel ``i``. The default gives the dual-channel text/vision gate."""
    aux_loss_weight: float = 1e-2
    """Weight of the Switch load-balancing loss (summed over modalities); used when
    ``load_balancing == "aux_loss"``."""
    z_loss_weight: float = 1e-3
    """Weight of the ST-MoE router z-loss (summed over modalities; 0 disables it)."""
    load_balancing: LoadBalancing = "aux_loss"
    """``"aux_loss"`` (Switch loss in the training loss) or ``"aux_free"`` (DeepSeek-V3: a
    per-expert selection bias moved against the load, no balance loss added)."""
    bias_update_rate: float = 1e-3
    """Step ``u`` of the aux-free bias update ``b_i += u * sign(mean load - load_i)``."""
    num_shared_experts: int = 0
    """Always-active SwiGLU experts applied to every unpadded token (DeepSeek-MoE); 0: none."""
    init_std: float = 0.02
    """Std of the normal initialisation of router and expert weights."""
    density_threshold: float | None = None
    """Density-driven expert activation (this package's rule, :class:`GradientDensity`): tokens
    whose gradient-norm density, relative to their modality's densest position, is at least
    this value use ``top_k`` experts, the others ``density_min_top_k``. ``None``: fixed
    ``top_k``; else in ``(0, 1]``, e.g. 0.85."""
    density_min_top_k: int = 1
    """Experts of the tokens below ``density_threshold`` (``1 <= density_min_top_k <=
    top_k``)."""

    def __post_init__(self) -> None:
        _positive_int("num_experts", self.num_experts, "use at least one expert")
        _positive_int("top_k", self.top_k, "route every token to at least one expert")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"MoEConfig.top_k ({self.top_k}) must be <= num_experts ({self.num_experts}); "
                "lower top_k or add experts."
            )
        _positive_int("ffn_width", self.ffn_width, "give the experts an inner width")
        if self.router_dim is not None:
            _positive_int(
                "router_dim", self.router_dim, "give the router projection a width, or None"
            )
        if self.capacity_factor is not None and not self.capacity_factor > 0.0:
            raise ValueError(
                f"MoEConfig.capacity_factor ({self.capacity_factor!r}) must be > 0; use e.g. "
                "1.25, or None for dropless routing."
            )
        for name in ("min_capacity", "num_shared_experts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"MoEConfig.{name} ({value!r}) must be an integer >= 0; use 0 for none."
                )
        if not self.temperature > 0.0:
            raise ValueError(
                f"MoEConfig.temperature ({self.temperature!r}) must be > 0; use e.g. 1.0 (the "
                "plain softmax) or a value in 0.5-1.2."
            )
        for name in ("aux_loss_weight", "z_loss_weight", "bias_update_rate", "init_std"):
            _non_negative(name, getattr(self, name), "use 0 to disable the term")
        if self.load_balancing not in ("aux_loss", "aux_free"):
            raise ValueError(
                f"MoEConfig.load_balancing ({self.load_balancing!r}) must be 'aux_loss' or "
                "'aux_free'."
            )
        if self.density_threshold is not None and not 0.0 < self.density_threshold <= 1.0:
            raise ValueError(
                f"MoEConfig.density_threshold ({self.density_threshold!r}) must be in (0, 1]; "
                "use e.g. 0.85, or None for a fixed top_k."
            )
        _positive_int("density_min_top_k", self.density_min_top_k, "use at least 1 expert")
        if self.density_min_top_k > self.top_k:
            raise ValueError(
                f"MoEConfig.density_min_top_k ({self.density_min_top_k}) must be <= top_k "
                f"({self.top_k}); lower density_min_top_k or raise top_k."
            )
        if not self.modalities or len(set(self.modalities)) != len(self.modalities):
            raise ValueError(
                f"MoEConfig.modalities ({self.modalities!r}) must be non-empty and unique; "
                "e.g. ('text', 'vision')."
            )


def expert_capacity(num_tokens: int, num_experts: int, top_k: int, config: MoEConfig) -> int:
    """Slots per expert for ``num_tokens`` routed tokens; ``num_tokens * top_k`` when dropless.

    ``C = max(ceil(k * T / E * capacity_factor), min_capacity)``: Megatron-core's
    ``get_capacity(T * k, E, cf)`` and DeepSpeed's ``_capacity`` with ``cf * k``.
    """
    if config.capacity_factor is None:
        return num_tokens * top_k
    capacity = math.ceil(top_k * num_tokens / num_experts * config.capacity_factor)
    return max(capacity, config.min_capacity)


@dataclass(frozen=True)
class RouteDecision:
    """Routing of ``T`` tokens (one modality) to ``k`` of ``E`` experts.

    ``experts``, ``gates``, ``kept``, ``slots`` are ``[T, k]`` (column ``j`` is the ``j``-th
    choice); ``probs`` and ``logits`` are ``[T, E]``.
    """

    experts: Tensor
    """Chosen expert ids (long), by descending selection score."""
    gates: Tensor
    """Combine weights (differentiable): ``p_e`` when ``k == 1`` (Switch), else ``p_e`` divided
    by the sum over the ``k`` chosen experts (Mixtral / GShard); a dropped route keeps its weight
    here and is zeroed by ``kept``; the others are not renormalised."""
    kept: Tensor
    """Bool: the route fits in its expert's capacity."""
    slots: Tensor
    """Position of the route in its expert's buffer (long; ``>= capacity`` when dropped)."""
    probs: Tensor
    """Router probabilities ``softmax(logits)`` (differentiable)."""
    logits: Tensor
    """Tempered router logits ``logits / tau`` (differentiable; the z-loss input)."""
    capacity: int
    """Slots per expert used for dropping."""
    active: Tensor | None = None
    """Bool ``[T, k]``: the route is among the token's own ``top_k[t]`` choices (``None``: all
    ``k`` are)."""

    @property
    def routes(self) -> Tensor:
        """Bool ``[T, k]``: the routes the tokens asked for (kept or dropped)."""
        return torch.ones_like(self.kept) if self.active is None else self.active


def route_tokens(
    logits: Tensor, config: MoEConfig, *, bias: Tensor | None = None, top_k: Tensor | None = None
) -> RouteDecision:
    """Top-k softmax routing of ``logits [T, E]`` with temperature, capacity and optional bias.

    ``p = softmax(logits / tau)``; experts are chosen by ``topk(p + b)`` where the detached bias
    ``b [E]`` (aux-loss-free balancing, DeepSeek-V3 sec. 2.1.2) changes the selection only, never
    the gate values. Slots are assigned in priority order "all first choices in token order, then
    all second choices, ..." (GShard / DeepSpeed ``top2gating``); a route whose slot is
    ``>= capacity`` is dropped, so dropping is deterministic. Softmax runs in at least float32.

    ``top_k [T]`` (long, each in ``[1, config.top_k]``; the density-driven count)
    gives token ``t`` only its first ``top_k[t]`` choices: the others are not kept, take no slot
    and are left out of the gate normalisation. Raises ``ValueError`` on a ``top_k`` of the wrong
    shape or range.
    """
    num_tokens, num_experts = logits.shape
    k_max = config.top_k
    scaled = logits / config.temperature
    probs = torch.softmax(scaled.to(torch.promote_types(scaled.dtype, torch.float32)), dim=-1)
    score = probs.detach() if bias is None else probs.detach() + bias.to(probs.dtype)
    experts = torch.topk(score, k_max, dim=-1).indices
    active = torch.ones(num_tokens, k_max, dtype=torch.bool, device=logits.device)
    if top_k is not None:
        if tuple(top_k.shape) != (num_tokens,) or (
            num_tokens and not (1 <= int(top_k.min()) and int(top_k.max()) <= k_max)
        ):
            raise ValueError(
                f"top_k must be [T] = [{num_tokens}] with values in [1, {k_max}] "
                f"(MoEConfig.top_k), got shape {tuple(top_k.shape)}; clamp the per-token counts."
            )
        active = (
            torch.arange(k_max, device=logits.device)[None, :] < top_k.to(logits.device)[:, None]
        )
    gates = probs.gather(1, experts) * active
    if k_max > 1:
        gates = gates / gates.sum(-1, keepdim=True).clamp_min(torch.finfo(gates.dtype).eps)
    # priority order (choice, token): transpose so the cumulative count runs over first choices
    flat = experts.t().reshape(-1)
    one_hot = F.one_hot(flat, num_experts) * active.t().reshape(-1, 1)
    slots_flat = (one_hot.cumsum(0) - 1).gather(1, flat[:, None]).squeeze(1)
    slots = slots_flat.view(k_max, num_tokens).t()
    capacity = expert_capacity(num_tokens, num_experts, k_max, config)
    kept = (slots < capacity) & active
    return RouteDecision(
        experts, gates, kept, slots, probs, scaled, capacity, None if top_k is None else active
    )


def load_balancing_loss(
    probs: Tensor, experts: Tensor, num_experts: int, routes: Tensor | None = None
) -> Tensor:
    """Switch load-balancing loss ``E * sum_i f_i P_i`` (Fedus et al. 2021, eq. 4).

    ``probs [T, E]``, ``experts [T, k]`` (chosen before dropping); ``f_i`` = share of the
    requested routes choosing expert ``i`` (all ``k T`` of them, or those where ``routes [T, k]``
    is True under per-token top-k), ``P_i`` = mean router probability of ``i``. Equals
    Megatron-core's ``switch_load_balancing_loss_func`` and DeepSpeed's ``top1gating`` /
    ``topkgating`` ``l_aux``. Returns a 0-d tensor (0 for ``T == 0``), differentiable through
    ``probs`` only.
    """
    num_tokens = experts.shape[0]
    if num_tokens == 0:
        return probs.sum() * 0.0
    chosen = experts.reshape(-1) if routes is None else experts[routes]
    counts = torch.bincount(chosen, minlength=num_experts).to(probs.dtype)
    f = counts / max(chosen.numel(), 1)
    return num_experts * (f * probs.mean(0)).sum()


def router_z_loss(logits: Tensor) -> Tensor:
    """ST-MoE router z-loss ``mean_t (logsumexp_e logits[t, e])^2`` (Zoph et al. 2022, eq. 5).

    ``logits [T, E]`` -> 0-d tensor (0 for ``T == 0``); Megatron-core's ``z_loss_func``.
    """
    if logits.shape[0] == 0:
        return logits.sum() * 0.0
    return torch.logsumexp(logits, dim=-1).square().mean()


def updated_expert_bias(bias: Tensor, tokens_per_expert: Tensor, rate: float) -> Tensor:
    """Aux-loss-free bias step ``b_i + rate * sign(mean_j load_j - load_i)`` (DeepSeek-V3).

    ``bias``, ``tokens_per_expert``: ``[..., E]``; Megatron-core's ``get_updated_expert_bias``
    without its all-reduce (the caller sums ``tokens_per_expert`` over data-parallel ranks first).
    """
    load = tokens_per_expert.to(bias.dtype)
    return bias + rate * torch.sign(load.mean(-1, keepdim=True) - load)


def aligned_sequence_length(lengths: Sequence[int], tp_size: int, num_experts: int) -> int:
    """Smallest ``L >= max(lengths)`` divisible by ``lcm(tp_size, num_experts)``.

    This package's alignment rule: the tokens then split evenly over tp ranks and experts.
    Padding to ``lcm(lengths)`` instead would be far longer (``lcm(196, 512, 256) = 25088``);
    with ``tp = 2`` and 4 experts, lengths 196/512/256 align to 512. Raises ``ValueError`` on an
    empty or negative ``lengths`` or a non-positive ``tp_size``/``num_experts``.
    """
    if not lengths or min(lengths) < 0:
        raise ValueError(
            f"lengths ({list(lengths)!r}) must be a non-empty list of non-negative sequence "
            "lengths; pass one length per modality or sequence."
        )
    for name, value in (("tp_size", tp_size), ("num_experts", num_experts)):
        if value < 1:
            raise ValueError(f"{name} ({value}) must be >= 1; pass the actual degree.")
    multiple = math.lcm(tp_size, num_experts)
    return -(-max(lengths) // multiple) * multiple


def alignment_padding_mask(lengths: Sequence[int], tp_size: int, num_experts: int) -> Tensor:
    """Padding mask ``[len(lengths), L]`` (True = padding) for sequences right-padded to
    ``L = aligned_sequence_length(lengths, tp_size, num_experts)``; row ``i`` holds
    ``lengths[i]`` False entries then True. Feed it to ``MoEFeedForward(padding_mask=...)``.
    """
    length = aligned_sequence_length(lengths, tp_size, num_experts)
    positions = torch.arange(length)
    return positions[None, :] >= torch.tensor(list(lengths))[:, None]


def align_sequence(
    x: Tensor, modality: Tensor | None, mask: Tensor | None, tp_size: int, num_experts: int
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Right-pad ``x [B, S, D]`` (and ``modality [B, S]``) to
    :func:`aligned_sequence_length` ``([S], tp_size, num_experts)``, with ``mask [B, S]`` (True =
    padding; ``None``: none) True on the new positions; unchanged when aligned."""
    length = x.shape[1]
    pad = aligned_sequence_length([length], tp_size, num_experts) - length
    if pad == 0:
        return x, modality, mask
    if mask is None:
        mask = torch.zeros(x.shape[0], length, dtype=torch.bool, device=x.device)
    mask = F.pad(mask.to(torch.bool), (0, pad), value=True)
    modality = None if modality is None else F.pad(modality, (0, pad))
    return F.pad(x, (0, 0, 0, pad)), modality, mask
