"""Multimodal mixture-of-experts feed-forward layer, single-process math.

:class:`MoEFeedForward` is a drop-in for the decoder's SwiGLU FFN. Its forward is three
separable steps, so an expert-parallel dispatcher (all-to-all, in ``parallel/``) can replace the
middle one::

    plan = layer.route(x, modality, padding_mask)        # who goes where (RoutingPlan)
    out  = layer.compute_experts(x_flat[plan.token_index], plan.tokens_per_expert)
    y    = layer.combine(out, plan, x)                   # weighted sum back onto the tokens

Dual-channel gating: one shared router projection ``h = x W_r`` (``D -> router_dim``), then one
router head per modality (``logits = h G_m^T``, ``[T_m, E]``) over one shared pool of ``E``
SwiGLU experts (LLaMA FFN, stacked ``[E, ...]`` and run by ``torch._grouped_mm`` where it works,
else by a loop; same numbers). Expert parallelism plugs in from outside
(:func:`lightning_mmpar.parallel.experts.apply_expert_parallel`): it sets
:attr:`MoEFeedForward.expert_dispatch` and shards the expert weights; this module stays plain
torch (expert weights are read through :func:`local_block`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_mmpar.models.moe_density import GradientDensity
from lightning_mmpar.models.moe_experts import GroupedExperts
from lightning_mmpar.models.moe_routing import (
    MoEConfig,
    RouteDecision,
    align_sequence,
    load_balancing_loss,
    route_tokens,
    router_z_loss,
    updated_expert_bias,
)

ExpertCompute = Callable[[Tensor, Tensor], Tensor]
"""``(tokens [N, D] sorted by expert, tokens_per_expert [E']) -> [N, D]``."""
ExpertDispatch = Callable[[Tensor, Tensor, ExpertCompute], Tensor]
"""``(tokens [N, D] sorted by global expert, tokens_per_expert [E], compute) -> [N, D]``: runs
``compute`` on the experts wherever they live and returns the outputs in ``tokens``' order."""


class TokenDensity(Protocol):
    """Per-token expert count (density-driven), plugged into :attr:`MoEFeedForward.density`."""

    def observe(self, x: Tensor, modality: Tensor | None, padding_mask: Tensor | None) -> None:
        """See a training input ``x [B, S, D]`` (e.g. hook its gradient for the next step)."""

    def top_k(self, modality: int, index: Tensor, shape: torch.Size, top_k: int) -> Tensor | None:
        """Experts for each routed token of one modality: ``index [T]`` flat positions into
        ``shape [B, S]``; returns ``[T]`` long in ``[1, top_k]``, or ``None`` for ``top_k``."""


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``y`` whose backward also sends ``scale`` into ``aux`` (Megatron-core's
    ``MoEAuxLossAutoScaler``): the aux loss reaches the parameters wherever ``y`` is
    back-propagated, in any pipeline schedule, without travelling between stages."""

    @staticmethod
    def forward(ctx: Any, y: Tensor, aux: Tensor, scale: float) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:  # type: ignore[override]
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


@dataclass(frozen=True)
class RoutingPlan:
    """Kept routes of one forward, sorted by expert (``N`` = kept routes over all modalities)."""

    token_index: Tensor
    """``[N]`` long: flat token index (into ``x.view(-1, D)``) of each kept route."""
    gates: Tensor
    """``[N]``: combine weight of each route (differentiable)."""
    tokens_per_expert: Tensor
    """``[E]`` long: kept routes per expert (the grouped-matmul group sizes)."""
    decisions: dict[str, RouteDecision]
    """Per-modality routing decisions (modalities with no unpadded token are absent)."""


@dataclass(frozen=True)
class MoEStats:
    """Router statistics of one modality in one forward (detached 0-d tensors unless noted;
    padded tokens are excluded from every figure)."""

    tokens: Tensor
    """Unpadded tokens ``T_m`` routed by this modality's router (long)."""
    tokens_per_expert: Tensor
    """``[E]`` long: routes choosing each expert before capacity dropping (DeepSpeed's
    ``exp_counts``); sums to ``k T_m``."""
    kept_per_expert: Tensor
    """``[E]`` long: routes each expert computes after dropping."""
    dropped_fraction: Tensor
    """Dropped routes / ``k T_m`` (0 when dropless)."""
    experts_per_token: Tensor
    """Kept routes / ``T_m``: experts that actually process a token, on average."""
    top1_share: Tensor
    """Mean over tokens of the largest router probability (a fraction in [0, 1])."""
    routing_entropy_bits: Tensor
    """Mean over tokens of the router distribution's entropy ``-sum_e p_e log2 p_e`` (bits;
    at most ``log2 E``)."""
    load_balancing_loss: Tensor
    """Unweighted Switch loss of this modality (1.0 at perfect balance)."""
    z_loss: Tensor
    """Unweighted router z-loss of this modality."""


def _modality_stats(d: RouteDecision, num_experts: int) -> MoEStats:
    with torch.no_grad():
        tokens = d.experts.shape[0]
        requested = d.routes
        routes = max(int(requested.sum()), 1)
        demand = torch.bincount(d.experts[requested], minlength=num_experts)
        kept = torch.bincount(d.experts[d.kept], minlength=num_experts)
        probs = d.probs.detach().float()
        entropy = -(probs * torch.log2(probs.clamp_min(1e-30))).sum(-1)
        return MoEStats(
            tokens=torch.tensor(tokens),
            tokens_per_expert=demand,
            kept_per_expert=kept,
            dropped_fraction=(1.0 - kept.sum() / routes) if tokens else torch.tensor(0.0),
            experts_per_token=kept.sum() / max(tokens, 1),
            top1_share=probs.max(-1).values.mean() if tokens else torch.tensor(0.0),
            routing_entropy_bits=entropy.mean() if tokens else torch.tensor(0.0),
            load_balancing_loss=load_balancing_loss(probs, d.experts, num_experts, d.active),
            z_loss=router_z_loss(d.logits.detach().float()),
        )


class MoEFeedForward(nn.Module):
    """Dual-channel top-k MoE replacing a SwiGLU FFN: ``[B, S, D] -> [B, S, D]``.

    ``y_t = sum_{e in kept routes of t} g_{t,e} FFN_e(x_t) + sum_s FFN_shared_s(x_t)``, and
    ``y_t = 0`` for padded tokens. Parameters: ``router_proj`` (``D -> router_dim``, shared;
    an identity without parameters when ``router_dim`` is ``None``),
    ``router_gate [M, E, router_dim]`` (one head per modality), ``w_gate, w_up [E, D, F]``,
    ``w_down [E, F, D]``, optional ``shared`` SwiGLU of width ``num_shared_experts * F``. Buffers:
    ``expert_bias [M, E]`` (aux-loss-free selection bias, saved in checkpoints) and
    ``pending_load [M, E]`` (kept routes counted since the last :meth:`update_expert_bias`).

    After each forward: ``aux_loss`` (0-d, differentiable; add it to the training loss) and
    ``last_stats`` (modality name -> :class:`MoEStats`). Sources: Switch Transformer (Fedus et
    al. 2021), ST-MoE (Zoph et al. 2022), DeepSeek-V3 (aux-free bias), torchtitan's MoE split into
    router / experts / dispatcher, Megatron-core's and DeepSpeed's MoE knobs.
    """

    expert_bias: Tensor
    pending_load: Tensor
    expert_mask: Tensor
    locality_mask: Tensor

    def __init__(self, dim: int, config: MoEConfig, *, attach_aux_loss: bool = False) -> None:
        super().__init__()
        if dim < 1:
            raise ValueError(f"MoEFeedForward dim ({dim}) must be >= 1; pass the hidden size.")
        self.config = config
        n_mod, n_exp, width = len(config.modalities), config.num_experts, config.ffn_width
        router_dim = dim if config.router_dim is None else config.router_dim
        self.router_proj: nn.Module = (
            nn.Identity()
            if config.router_dim is None
            else nn.Linear(dim, config.router_dim, bias=False)
        )
        self.router_gate = nn.Parameter(torch.empty(n_mod, n_exp, router_dim))
        self.experts = GroupedExperts(n_exp, dim, width)
        self.shared: nn.ModuleDict | None = None
        if config.num_shared_experts:
            inner = config.num_shared_experts * width
            self.shared = nn.ModuleDict(
                {
                    "gate_proj": nn.Linear(dim, inner, bias=False),
                    "up_proj": nn.Linear(dim, inner, bias=False),
                    "down_proj": nn.Linear(inner, dim, bias=False),
                }
            )
        self.register_buffer("expert_bias", torch.zeros(n_mod, n_exp))
        self.register_buffer("pending_load", torch.zeros(n_mod, n_exp), persistent=False)
        self.register_buffer("expert_mask", torch.ones(n_exp, dtype=torch.bool))
        self.register_buffer("locality_mask", torch.ones(n_exp, dtype=torch.bool), persistent=False)
        self.expert_dispatch: ExpertDispatch | None = None
        """``None``: every expert is local. Set by ``parallel.experts.apply_expert_parallel``
        to move the routed tokens to the ranks that hold their experts and back."""
        self.density: TokenDensity | None = GradientDensity.from_config(config)
        """Optional per-token top-k (density-driven): ``observe`` sees each training input,
        ``top_k`` gives each routed token's number of experts."""
        self.attach_aux_loss = attach_aux_loss
        self.aux_loss_scale = 1.0
        """Factor of the aux-loss gradient injected when ``attach_aux_loss`` (the strategy sets
        ``1 / accumulate_grad_batches`` where Lightning divides the loss by it)."""
        self.sequence_multiple = 1
        """Pad the sequence to a multiple of ``lcm(sequence_multiple, E)`` before routing
        (the plan sets the tensor-parallel size); padding is never routed."""
        self.aux_loss: Tensor = torch.zeros(())
        self.last_stats: dict[str, MoEStats] = {}
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, ``init_std``) for every weight; zero selection bias."""
        for p in self.parameters():
            nn.init.normal_(p, std=self.config.init_std)
        self.expert_bias.zero_()
        self.expert_mask.fill_(True)

    def _check_inputs(self, x: Tensor, modality: Tensor | None, mask: Tensor | None) -> None:
        if x.dim() != 3:
            raise ValueError(f"MoEFeedForward x must be [B, S, D], got shape {tuple(x.shape)}.")
        for name, t in (("modality", modality), ("padding_mask", mask)):
            if t is not None and tuple(t.shape) != tuple(x.shape[:2]):
                raise ValueError(
                    f"MoEFeedForward {name} shape {tuple(t.shape)} must equal x's [B, S] = "
                    f"{tuple(x.shape[:2])}."
                )
        n_mod = len(self.config.modalities)
        if modality is None or not modality.numel():
            return
        low, high = (int(v) for v in torch.aminmax(modality))  # one host sync
        if low < 0:
            raise ValueError(f"MoEFeedForward modality ids must be in [0, {n_mod}).")
        if high >= n_mod:
            raise ValueError(
                f"MoEFeedForward modality id {high} has no router: "
                f"config.modalities is {self.config.modalities!r}; add the modality there."
            )

    def route(
        self,
        x: Tensor,
        modality: Tensor | None,
        padding_mask: Tensor | None,
        *,
        checked: bool = False,
    ) -> RoutingPlan:
        """Routing of ``x [B, S, D]``: modality ``m`` tokens use router ``m`` only; padded tokens
        (``padding_mask`` True) are never routed. Modality ``None`` = all modality 0.

        Only experts allowed by ``expert_mask & locality_mask`` (``[E]`` bool buffers: the
        sparsity schedule's pruning mask, expert-parallel group-limited routing) are chosen
        (their logits are ``-inf``); ``density`` gives per-token top-k when set. ``ValueError``:
        fewer than ``top_k`` allowed experts, or invalid inputs (unless ``checked`` by forward)."""
        if not checked:
            self._check_inputs(x, modality, padding_mask)
        cfg, flat = self.config, x.reshape(-1, x.shape[-1])
        valid = torch.ones(flat.shape[0], dtype=torch.bool, device=x.device)
        if padding_mask is not None:
            valid = ~padding_mask.reshape(-1).to(torch.bool)
        ids = (
            torch.zeros_like(valid, dtype=torch.long) if modality is None else modality.reshape(-1)
        )
        allowed = self.expert_mask & self.locality_mask
        if int(allowed.sum()) < cfg.top_k:
            raise ValueError(
                f"MoEFeedForward allows {int(allowed.sum())} experts (expert_mask & "
                f"locality_mask) but top_k is {cfg.top_k}; keep at least top_k experts routable "
                "(less sparsity, larger locality groups, or a smaller top_k)."
            )
        ids_shape = x.shape[:2]
        decisions: dict[str, RouteDecision] = {}
        tokens: list[Tensor] = []
        experts: list[Tensor] = []
        gates: list[Tensor] = []
        for m, name in enumerate(cfg.modalities):
            index = torch.nonzero(valid & (ids == m)).squeeze(1)
            if index.numel() == 0:
                continue
            logits = self.router_proj(flat[index]) @ self.router_gate[m].t()
            if not bool(allowed.all()):
                logits = logits.masked_fill(~allowed, float("-inf"))
            bias = self.expert_bias[m] if cfg.load_balancing == "aux_free" else None
            k = None if self.density is None else self.density.top_k(m, index, ids_shape, cfg.top_k)
            d = route_tokens(logits, cfg, bias=bias, top_k=k)
            decisions[name] = d
            kept = d.kept.t().reshape(-1)  # (choice, token) priority order
            tokens.append(index.repeat(cfg.top_k)[kept])
            experts.append(d.experts.t().reshape(-1)[kept])
            gates.append(d.gates.t().reshape(-1)[kept])
        if not tokens:
            empty = torch.zeros(0, dtype=torch.long, device=x.device)
            counts = torch.zeros(cfg.num_experts, dtype=torch.long, device=x.device)
            return RoutingPlan(empty, x.new_zeros(0), counts, decisions)
        expert = torch.cat(experts)
        order = torch.sort(expert, stable=True).indices
        return RoutingPlan(
            token_index=torch.cat(tokens)[order],
            gates=torch.cat(gates)[order],
            tokens_per_expert=torch.bincount(expert, minlength=cfg.num_experts),
            decisions=decisions,
        )

    def compute_experts(self, tokens: Tensor, tokens_per_expert: Tensor) -> Tensor:
        """SwiGLU experts on expert-sorted ``tokens [N, D]``, group sizes ``[E_local]``; ``[N, D]``.

        Runs this process's experts: all ``E`` of them, or its block of ``E / ep`` under expert
        parallelism (:class:`GroupedExperts`)."""
        out: Tensor = self.experts(tokens, tokens_per_expert)
        return out

    @property
    def grouped_mm(self) -> bool | None:
        """The experts' matmul choice (:attr:`GroupedExperts.grouped_mm`)."""
        return self.experts.grouped_mm

    @grouped_mm.setter
    def grouped_mm(self, value: bool | None) -> None:
        self.experts.grouped_mm = value

    def combine(self, expert_out: Tensor, plan: RoutingPlan, x: Tensor) -> Tensor:
        """``y[t] = sum_r gates[r] expert_out[r]`` over the routes ``r`` of token ``t``.

        ``expert_out [N, D]`` in ``plan`` order, ``x [B, S, D]`` (for the shape) -> ``[B, S, D]``.
        """
        flat = x.reshape(-1, x.shape[-1])
        weighted = expert_out * plan.gates.to(expert_out.dtype)[:, None]
        y = torch.zeros_like(flat).index_add(0, plan.token_index, weighted)
        return y.view_as(x)

    def _shared_out(self, x: Tensor, padding_mask: Tensor | None) -> Tensor:
        assert self.shared is not None
        s = self.shared
        out = s["down_proj"](F.silu(s["gate_proj"](x)) * s["up_proj"](x))
        return out if padding_mask is None else out.masked_fill(padding_mask[..., None], 0.0)

    def forward(
        self, x: Tensor, modality: Tensor | None = None, padding_mask: Tensor | None = None
    ) -> Tensor:
        """``x [B, S, D]`` -> ``[B, S, D]``; ``modality [B, S]`` long (index into
        ``config.modalities``; None = all modality 0), ``padding_mask [B, S]`` bool (True =
        padding; None = no padding).

        Sets ``aux_loss`` and ``last_stats``; in training with ``load_balancing == "aux_free"``
        adds the kept routes per expert to ``pending_load``. Raises ``ValueError`` on shapes
        that do not match or modality ids without a router.
        """
        self._check_inputs(x, modality, padding_mask)
        length = x.shape[1]
        multiple, experts = self.sequence_multiple, self.config.num_experts
        x, modality, padding_mask = align_sequence(x, modality, padding_mask, multiple, experts)
        if self.density is not None and self.training:
            self.density.observe(x, modality, padding_mask)
        plan = self.route(x, modality, padding_mask, checked=True)
        flat = x.reshape(-1, x.shape[-1])
        tokens = flat[plan.token_index]
        if self.expert_dispatch is None:
            out = self.compute_experts(tokens, plan.tokens_per_expert)
        else:
            out = self.expert_dispatch(tokens, plan.tokens_per_expert, self.compute_experts)
        y = self.combine(out, plan, x)
        if self.shared is not None:
            y = y + self._shared_out(x, padding_mask)
        self._record(plan)
        if self.attach_aux_loss and torch.is_grad_enabled() and self.aux_loss.requires_grad:
            y = _AttachAuxLoss.apply(y, self.aux_loss, self.aux_loss_scale)
            self.aux_loss = self.aux_loss.detach()
        return y[:, :length]

    def _record(self, plan: RoutingPlan) -> None:
        cfg = self.config
        stats, aux = {}, self.router_gate.new_zeros(())
        for m, name in enumerate(cfg.modalities):
            d = plan.decisions.get(name)
            if d is None:
                continue
            stats[name] = _modality_stats(d, cfg.num_experts)
            if cfg.load_balancing == "aux_loss" and cfg.aux_loss_weight:
                aux = aux + cfg.aux_loss_weight * load_balancing_loss(
                    d.probs, d.experts, cfg.num_experts, d.active
                )
            if cfg.z_loss_weight:
                aux = aux + cfg.z_loss_weight * router_z_loss(d.logits)
            if self.training and cfg.load_balancing == "aux_free":
                self.pending_load[m] += stats[name].kept_per_expert.to(self.pending_load)
        self.aux_loss, self.last_stats = aux, stats

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: Tensor | None = None) -> None:
        """Aux-loss-free step (DeepSeek-V3): ``expert_bias += rate * sign(mean - load)`` per
        modality, ``load [M, E]`` = ``tokens_per_expert`` or the accumulated ``pending_load``
        (sum it over data-parallel ranks first); then clears ``pending_load``. Call once per
        optimizer step; a no-op unless ``load_balancing == "aux_free"``."""
        if self.config.load_balancing != "aux_free":
            return
        load = self.pending_load if tokens_per_expert is None else tokens_per_expert
        rate = self.config.bias_update_rate
        active = load.sum(-1, keepdim=True) > 0  # a modality without tokens keeps its bias
        new = updated_expert_bias(self.expert_bias, load.to(self.expert_bias), rate)
        self.expert_bias.copy_(torch.where(active, new, self.expert_bias))
        self.pending_load.zero_()
