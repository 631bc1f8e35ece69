"""The vision-to-language projector: one linear layer, or LLaVA-1.5's two-layer MLP.

``linear``: ``img = tok W^T + b`` (LLaVA-1, this package's default; state-dict keys
``projector.weight`` / ``projector.bias``). ``mlp2x``: ``img = act(tok W_1^T + b_1) W_2^T + b_2``
with transformers' ``LlavaMultiModalProjector`` names (``linear_1``, ``act``, ``linear_2``;
Liu et al. 2023, "Improved Baselines with Visual Instruction Tuning").
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Literal

import torch.nn.functional as F
from torch import Tensor, nn

from lightning_mmpar.models.vision import QuickGELU

__all__ = [
    "PROJECTOR_ACTS",
    "ProjectorAct",
    "ProjectorKind",
    "build_projector",
    "projector_linears",
]

ProjectorKind = Literal["linear", "mlp2x"]
ProjectorAct = Literal["gelu", "gelu_tanh", "quick_gelu", "silu", "relu"]


class _GeluTanh(nn.Module):
    """``gelu(x, approximate="tanh")`` (transformers' ``gelu_pytorch_tanh``)."""

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(x, approximate="tanh")


PROJECTOR_ACTS: dict[str, type[nn.Module]] = {
    "gelu": nn.GELU,
    "gelu_tanh": _GeluTanh,
    "quick_gelu": QuickGELU,
    "silu": nn.SiLU,
    "relu": nn.ReLU,
}
"""The MLP projector's activations (transformers' ``ACT2FN`` names ``gelu``,
``gelu_pytorch_tanh``, ``quick_gelu``, ``silu``, ``relu``)."""


def build_projector(
    vision_width: int, dim: int, kind: ProjectorKind, act: ProjectorAct, bias: bool
) -> nn.Module:
    """The projector ``[..., vision_width] -> [..., dim]``.

    Raises:
        ValueError: ``kind`` or ``act`` unknown (naming the value and the choices).
    """
    if kind == "linear":
        return nn.Linear(vision_width, dim, bias=bias)
    if kind != "mlp2x":
        raise ValueError(f"FusionConfig.projector ({kind!r}) must be 'linear' or 'mlp2x'.")
    if act not in PROJECTOR_ACTS:
        raise ValueError(
            f"FusionConfig.projector_act ({act!r}) must be one of {sorted(PROJECTOR_ACTS)}."
        )
    layers = [
        ("linear_1", nn.Linear(vision_width, dim, bias=bias)),
        ("act", PROJECTOR_ACTS[act]()),
        ("linear_2", nn.Linear(dim, dim, bias=bias)),
    ]
    return nn.Sequential(OrderedDict(layers))


def projector_linears(projector: nn.Module) -> list[nn.Linear]:
    """The projector's linear layers in order (for costs)."""
    if isinstance(projector, nn.Linear):
        return [projector]
    return [m for m in projector.children() if isinstance(m, nn.Linear)]
