"""Stacked SwiGLU experts of a mixture-of-experts layer and their grouped matmul (plain torch).

``torch._grouped_mm`` multiplies each expert's rows by its own weight in one call where the
build, device and dtype support it (probed once); a loop over experts gives the same numbers
elsewhere. Expert parallelism shards the stacked weights as DTensors; :func:`local_block` reads
this process's block without communication.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["GroupedExperts", "grouped_mm_supported", "local_block", "swiglu_experts"]


@functools.cache
def _grouped_mm_probe(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs (forward and backward) for this device type and dtype."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        x = torch.ones(4, 8, device=device_type, dtype=dtype, requires_grad=True)
        w = torch.ones(2, 8, 8, device=device_type, dtype=dtype, requires_grad=True)
        offs = torch.tensor([1, 4], device=device_type, dtype=torch.int32)
        torch._grouped_mm(x, w, offs=offs).backward(
            torch.ones(4, 8, device=device_type, dtype=dtype)
        )
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def grouped_mm_supported(x: Tensor, *weights: Tensor) -> bool:
    """Whether ``torch._grouped_mm`` can multiply ``x [N, K]`` by each ``[E, K, M]`` weight.

    Needs the op in this build, a device/dtype it supports (probed once: CPU and CUDA accept
    float32/bfloat16 in torch 2.14, never float64) and rows aligned to 16 bytes.
    """
    dims = [x.shape[-1]] + [d for w in weights for d in w.shape[-2:]]
    aligned = all(d * x.element_size() % 16 == 0 for d in dims)
    return aligned and _grouped_mm_probe(x.device.type, x.dtype)


def local_block(weight: Tensor) -> Tensor:
    """This process's block of an expert weight: a sharded weight (a DTensor, set up by
    ``parallel.experts``) gives its local shard (differentiable, no communication); a plain
    tensor is returned as is."""
    to_local = getattr(weight, "to_local", None)
    return weight if to_local is None else to_local()


def _expert_matmul(x: Tensor, weight: Tensor, counts: Tensor, grouped: bool) -> Tensor:
    """Rows of ``x [N, K]`` grouped by expert (``counts [E]``) times ``weight [E, K, M]``."""
    if grouped:
        offsets = counts.cumsum(0).to(torch.int32)
        return torch._grouped_mm(x, weight, offs=offsets)
    chunks = x.split(counts.tolist())
    return torch.cat([chunk @ weight[e] for e, chunk in enumerate(chunks)])


def swiglu_experts(
    x: Tensor,
    tokens_per_expert: Tensor,
    w_gate: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    *,
    grouped: bool | None = None,
) -> Tensor:
    """Per-expert LLaMA FFN ``(silu(x W_g[e]) * (x W_u[e])) W_d[e]`` on expert-sorted tokens.

    ``x [N, D]`` holds ``tokens_per_expert[e]`` rows for expert ``e``, in expert order;
    ``w_gate, w_up [E, D, F]``, ``w_down [E, F, D]``; returns ``[N, D]``. ``grouped=None`` uses
    ``torch._grouped_mm`` when :func:`grouped_mm_supported`, ``False`` forces the loop,
    ``True`` forces the grouped op (its errors propagate).
    """
    if grouped is None:
        grouped = grouped_mm_supported(x, w_gate, w_down)
    counts = tokens_per_expert.to(device=x.device, dtype=torch.long)
    gate = _expert_matmul(x, w_gate, counts, grouped)
    up = _expert_matmul(x, w_up, counts, grouped)
    return _expert_matmul(F.silu(gate) * up, w_down, counts, grouped)


class _ScaleGradient(torch.autograd.Function):
    """Identity whose backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, scale: float) -> Tensor:  # type: ignore[override]
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad * ctx.scale, None


class GroupedExperts(nn.Module):
    """Stacked SwiGLU experts of one MoE layer: ``w_gate, w_up [E, D, F]``, ``w_down [E, F, D]``.

    A module of its own so data parallelism can treat expert weights apart from the dense ones
    (FSDP2 shards them over the expert-data-parallel group, Megatron's ``expert_data_parallel``;
    torchtitan's ``GroupedExperts``). ``forward(tokens [N, D], tokens_per_expert [E_l]) ->
    [N, D]`` runs this process's experts: all ``E``, or its block of ``E / ep`` when the weights
    are sharded (:func:`local_block`).
    """

    def __init__(self, num_experts: int, dim: int, width: int) -> None:
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(num_experts, dim, width))
        self.w_up = nn.Parameter(torch.empty(num_experts, dim, width))
        self.w_down = nn.Parameter(torch.empty(num_experts, width, dim))
        self.grouped_mm: bool | None = None
        """``None``: grouped matmul when supported; ``False``: loop; ``True``: force grouped."""
        self.gradient_scale = 1.0
        """Factor on the weights' gradient only (forward unchanged). The strategy sets ``1 / ep``
        under expert parallelism: the all-to-all backward sums the gradients of every ep rank's
        tokens, and the mean over ranks is what a data-parallel gradient is."""

    def forward(self, tokens: Tensor, tokens_per_expert: Tensor) -> Tensor:
        weights = [local_block(w) for w in (self.w_gate, self.w_up, self.w_down)]
        if self.gradient_scale != 1.0:
            weights = [_ScaleGradient.apply(w, self.gradient_scale) for w in weights]
        w_gate, w_up, w_down = weights
        return swiglu_experts(
            tokens, tokens_per_expert, w_gate, w_up, w_down, grouped=self.grouped_mm
        )
