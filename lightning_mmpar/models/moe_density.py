"""Density-driven expert activation: per-token top-k from gradient norms.

A token's "semantic density" is ``rho(t) = ||d loss / d x_t||``, the norm of the loss gradient
at the MoE layer input. Computing it for the current tokens would need a second backward, so
:class:`GradientDensity` reads it from the backward the trainer runs anyway (a tensor hook on the
layer input, as ``torch.Tensor.register_hook``) and keeps a per-(modality, sequence position)
estimate that the next forwards use: dense positions get ``top_k`` experts, the others
``min_top_k``. Plain torch: no collectives (each data-parallel rank keeps its own estimate).
The rule (density from gradient norms, a threshold relative to the densest position) is this
package's own.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor, nn

from lightning_mmpar.models.moe_routing import MoEConfig


class _GradHook:
    """Tensor hook of one observed input: adds its per-token gradient norms to the pending sums.

    Held only by the autograd graph (and weakly by :attr:`GradientDensity._outstanding`), so a
    forward whose backward never runs stops counting as outstanding once its graph is freed.
    """

    def __init__(self, owner: GradientDensity, keys: Tensor, valid: Tensor) -> None:
        self.owner, self.keys, self.valid = owner, keys, valid

    def __call__(self, grad: Tensor) -> None:
        owner = self.owner
        with torch.no_grad():
            norms = grad.detach().float().norm(dim=-1).reshape(-1)[self.valid]
            owner._pending_sum.view(-1).index_add_(0, self.keys, norms.to(owner._pending_sum))
            ones = torch.ones_like(self.keys, dtype=owner._pending_count.dtype)
            owner._pending_count.view(-1).index_add_(0, self.keys, ones)
        owner._outstanding.discard(self)
        owner._maybe_fold()


class GradientDensity(nn.Module):
    """Per-token expert count from last backward's input-gradient norms.

    Implements :class:`lightning_mmpar.models.moe.TokenDensity`; installed by
    :class:`~lightning_mmpar.models.moe.MoEFeedForward` when ``MoEConfig.density_threshold`` is
    set. Math, per modality ``m`` and sequence position ``s``:

    * measurement: ``rho_bar[m, s]`` = mean over the unpadded modality-``m`` tokens at position
      ``s`` (batch rows, and every backward since the last update) of ``||d loss / d x[b, s]||``
      (``x [B, S, D]`` the layer input, float32 norms);
    * estimate ``[M, max_positions]``: ``est = momentum * est + (1 - momentum) * rho_bar`` on
      positions that were measured (the first measurement of a position is taken as is);
      ``momentum = 0`` (default) keeps the last step's value;
    * top-k: ``r = est[m, s] / max_{s' seen} est[m, s']`` in ``[0, 1]``; ``k = top_k`` where
      ``r >= threshold``, else ``min_top_k``.

    Every token gets ``top_k`` while nothing is known: before the first backward, at positions
    of modality ``m`` not measured yet, and when all of ``m``'s estimates are 0. Positions
    ``>= max_positions`` share the last bucket (``max_positions - 1``).

    Update timing: the hook of each training forward adds its measurement to a pending sum;
    the pending sums are folded into the estimate once no training forward awaits its backward
    (after the last micro-batch's backward of a pipeline schedule, after each backward
    otherwise), so the routing of a forward and of its activation-checkpoint recompute use the
    same estimate. A forward stops awaiting when its hook fires or its graph is freed (a step
    skipped without backward; the layer's ``aux_loss`` holds the graph until the next forward).
    Activation checkpointing: exactly one hook per forward fires, so nothing is counted twice
    (``use_reentrant=False``: the original input's, the recompute's is freed with the recompute
    graph; ``use_reentrant=True``: the forward runs without grad, only the recompute's fires).
    Not covered: reentrant checkpointing under a schedule with several micro-batches in flight
    (their no-grad forwards do not count as awaiting; use ``use_reentrant=False`` there).

    Buffers ``estimate`` and ``seen`` are persistent: a resumed run routes exactly as the
    uninterrupted one would (the pending sums are empty between optimizer steps). Raises
    ``ValueError`` on invalid arguments.
    """

    estimate: Tensor
    seen: Tensor
    _pending_sum: Tensor
    _pending_count: Tensor

    def __init__(
        self,
        num_modalities: int,
        *,
        threshold: float = 0.85,
        min_top_k: int = 1,
        momentum: float = 0.0,
        max_positions: int = 8192,
    ) -> None:
        super().__init__()
        for name, value in (
            ("num_modalities", num_modalities),
            ("min_top_k", min_top_k),
            ("max_positions", max_positions),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"GradientDensity {name} ({value!r}) must be a positive integer; e.g. "
                    "len(config.modalities), 1 and the longest sequence length."
                )
        if not 0.0 < threshold <= 1.0:
            raise ValueError(
                f"GradientDensity threshold ({threshold!r}) must be in (0, 1]; use e.g. 0.85."
            )
        if not 0.0 <= momentum < 1.0:
            raise ValueError(
                f"GradientDensity momentum ({momentum!r}) must be in [0, 1); use 0 to keep only "
                "the last step's value."
            )
        self.threshold, self.min_top_k, self.momentum = threshold, min_top_k, momentum
        shape = (num_modalities, max_positions)
        self.register_buffer("estimate", torch.zeros(shape))
        self.register_buffer("seen", torch.zeros(shape, dtype=torch.bool))
        self.register_buffer("_pending_sum", torch.zeros(shape), persistent=False)
        self.register_buffer("_pending_count", torch.zeros(shape), persistent=False)
        self._outstanding: weakref.WeakSet[_GradHook] = weakref.WeakSet()

    @classmethod
    def from_config(cls, config: MoEConfig) -> GradientDensity | None:
        """The density of a layer built from ``config``; ``None`` when
        ``config.density_threshold`` is ``None`` (fixed ``top_k``)."""
        if config.density_threshold is None:
            return None
        return cls(
            len(config.modalities),
            threshold=config.density_threshold,
            min_top_k=config.density_min_top_k,
        )

    @property
    def max_positions(self) -> int:
        """Positions tracked per modality (the last bucket holds every later position)."""
        return int(self.estimate.shape[1])

    def observe(self, x: Tensor, modality: Tensor | None, padding_mask: Tensor | None) -> None:
        """Hook the gradient of a training input ``x [B, S, D]`` (``modality [B, S]`` long or
        None = modality 0, ``padding_mask [B, S]`` bool, True = padding, never measured).

        No-op when ``x`` does not require grad or grad is disabled (nothing to measure)."""
        self._maybe_fold()
        if not (torch.is_grad_enabled() and x.requires_grad):
            return
        batch, length = x.shape[:2]
        device = self.estimate.device
        valid = torch.ones(batch * length, dtype=torch.bool, device=device)
        if padding_mask is not None:
            valid = ~padding_mask.reshape(-1).to(device=device, dtype=torch.bool)
        ids = torch.zeros(batch * length, dtype=torch.long, device=device)
        if modality is not None:
            ids = modality.reshape(-1).to(device=device, dtype=torch.long)
        positions = torch.arange(length, device=device).clamp_max(self.max_positions - 1)
        keys = (ids * self.max_positions + positions.repeat(batch))[valid]
        hook = _GradHook(self, keys, valid.to(x.device))
        x.register_hook(hook)
        self._outstanding.add(hook)

    @torch.no_grad()
    def _maybe_fold(self) -> None:
        """Fold the pending measurement into ``estimate`` unless a forward awaits its backward."""
        if len(self._outstanding) or not bool((self._pending_count > 0).any()):
            return
        measured = self._pending_count > 0
        mean = self._pending_sum / self._pending_count.clamp_min(1.0)
        blended = self.momentum * self.estimate + (1.0 - self.momentum) * mean
        new = torch.where(self.seen, blended, mean)
        self.estimate.copy_(torch.where(measured, new, self.estimate))
        self.seen.logical_or_(measured)
        self._pending_sum.zero_()
        self._pending_count.zero_()

    def top_k(self, modality: int, index: Tensor, shape: torch.Size, top_k: int) -> Tensor | None:
        """Experts for the tokens ``index [T]`` (flat positions into ``shape = [B, S]``) of
        ``modality``: ``[T]`` long, ``top_k`` where ``r >= threshold`` else ``min(min_top_k,
        top_k)``; ``None`` (all ``top_k``) before this modality's first measurement."""
        seen = self.seen[modality]
        if not bool(seen.any()):
            return None
        est = self.estimate[modality]
        peak = est[seen].max()
        positions = (index.to(est.device) % shape[1]).clamp_max(self.max_positions - 1)
        ratio = est[positions] / peak if bool(peak > 0) else torch.ones_like(est[positions])
        dense = (ratio >= self.threshold) | ~seen[positions]
        low = torch.full_like(positions, min(self.min_top_k, top_k))
        return torch.where(dense, torch.full_like(positions, top_k), low).to(index.device)

    def extra_repr(self) -> str:
        return (
            f"modalities={self.estimate.shape[0]}, max_positions={self.max_positions}, "
            f"threshold={self.threshold}, min_top_k={self.min_top_k}, momentum={self.momentum}"
        )

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_outstanding"] = None  # weak references cannot be pickled or deep-copied
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._outstanding = weakref.WeakSet()
