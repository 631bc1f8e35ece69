"""Per-sample training cost of a pipeline block, counted from its shapes (no profiling).

A pipeline planner balances stages by these numbers, so they follow one simple, documented model
rather than any kernel's exact behaviour:

* **FLOPs** (forward + backward): each matrix product ``[M, K] x [K, N]`` costs ``2 M K N`` in
  forward, the same again for the gradient of its input, and the same again for the gradient of
  its weight when that weight is trainable: about ``3x`` the forward for trainable weights, ``2x``
  for frozen ones (Kaplan et al. 2020, "Scaling Laws for Neural Language Models", ``C ~ 6 N`` per
  token). The attention products ``q k^T`` and ``p v`` have activations on both sides and always
  cost ``3x``; causal masks are not discounted. Element-wise work (norms, activations,
  residuals, softmax) is not counted.
* **activation bytes**: the tensors a block keeps for its backward: the input of every product
  whose weight is trainable, the input of every norm and activation function, and attention's
  ``q``, ``k``, ``v`` and output (flash / memory-efficient kernels; the math kernel also keeps the
  ``[H, T, S]`` probabilities, not counted). Frozen products keep nothing (their input gradient
  needs only the weight). Sizes are elements times ``bytes_per_element`` (4: fp32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

__all__ = ["BlockCost", "CostTally"]


@dataclass(frozen=True)
class BlockCost:
    """Training cost of one block for one sample."""

    flops: float
    """Forward + backward floating-point operations."""
    activation_bytes: float
    """Bytes of activations kept from forward to backward."""

    def __add__(self, other: BlockCost) -> BlockCost:
        return BlockCost(
            flops=self.flops + other.flops,
            activation_bytes=self.activation_bytes + other.activation_bytes,
        )


def linear_weight(layer: nn.Module) -> Tensor:
    """The ``[out, in]`` weight of an ``nn.Linear`` (a DTensor's shape is the global one).

    Raises:
        TypeError: ``layer`` is not an ``nn.Linear``.
    """
    if not isinstance(layer, nn.Linear):
        raise TypeError(f"expected an nn.Linear, got {type(layer).__name__}.")
    return layer.weight


class CostTally:
    """Accumulates FLOPs and kept elements for one block; :meth:`result` converts to bytes."""

    def __init__(self) -> None:
        self.flops = 0.0
        self.elements = 0.0

    def matmul(self, rows: int, d_in: int, d_out: int, *, train: bool, grad: bool = True) -> None:
        """``y = x W`` for ``x [rows, d_in]``: ``2 rows d_in d_out`` forward, ``x 2`` with an
        input gradient, ``x 3`` with a weight gradient (``train``), which also keeps ``x``.
        ``grad=False``: forward only (no-grad heads)."""
        forward = 2.0 * rows * d_in * d_out
        if not grad:
            self.flops += forward
            return
        self.flops += forward * (3 if train else 2)
        if train:
            self.elements += rows * d_in

    def linear(self, rows: int, layer: nn.Module, *, grad: bool = True) -> None:
        """:meth:`matmul` for an ``nn.Linear`` (global shapes, also for tensor-parallel shards)."""
        weight = linear_weight(layer)
        self.matmul(rows, weight.shape[1], weight.shape[0], train=weight.requires_grad, grad=grad)

    def attention(self, queries: int, keys: int, width: int) -> None:
        """``softmax(q k^T / sqrt(d)) v`` over all heads (``width = heads * head_dim``, keys and
        values already repeated for GQA): two products of ``2 queries keys width`` each, ``x 3``;
        keeps ``q``, ``k``, ``v`` and the output."""
        self.flops += 3 * 2 * (2.0 * queries * keys * width)
        self.elements += (2 * queries + 2 * keys) * width

    def moe(self, routed: int, dim: int, config: Any, *, train: bool) -> None:
        """A mixture-of-experts FFN (``config``: an ``MoEConfig``) on ``routed`` tokens: the
        router (``dim -> router_dim -> E``; ``dim -> E`` without a projection), then ``top_k``
        routed plus the shared SwiGLU experts per token (``train``: the experts take weight
        gradients)."""
        router_dim = dim if config.router_dim is None else config.router_dim
        if config.router_dim is not None:
            self.matmul(routed, dim, router_dim, train=True)
        self.matmul(routed, router_dim, config.num_experts, train=True)
        width = config.ffn_width * (config.top_k + config.num_shared_experts)
        for d_in, d_out in ((dim, width), (dim, width), (width, dim)):
            self.matmul(routed, d_in, d_out, train=train)
        self.keep(2 * routed * width)  # SiLU input, up-projection

    def keep(self, elements: float) -> None:
        """An element-wise op (norm, activation function) that keeps its input."""
        self.elements += elements

    def result(self, bytes_per_element: int) -> BlockCost:
        """The tally as a :class:`BlockCost`."""
        return BlockCost(flops=self.flops, activation_bytes=self.elements * bytes_per_element)
