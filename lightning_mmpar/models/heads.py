"""Projection heads of the fusion model: the text pooler and the EMA (momentum) head copies.

ALBEF's momentum distillation (Li et al., 2021, "Align before Fuse") compares the current
image-text similarities with those of a slowly moving copy of the model. Here only the two
projection heads are copied; after every optimizer step each copy tracks its live head::

    theta' <- m * theta' + (1 - m) * theta

Plain torch (no process group): the MML loss (:mod:`lightning_mmpar.losses.mml`) consumes the
features these heads produce.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["MomentumHeads", "TextPooler", "ema_update", "momentum_copy"]


class TextPooler(nn.Module):
    """``e_b = h[b, last_b]`` (each row's last text token) and ``f = e W^T``.

    ``forward(h [B, T, D], last [B]) -> (e [B, D], f [B, C])``; the momentum text head needs the
    pooled ``e`` too. Under sequence parallelism the plan gathers ``h`` on entry.
    """

    def __init__(self, dim: int, out_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, out_dim, bias=False)

    def forward(self, h: Tensor, last_index: Tensor) -> tuple[Tensor, Tensor]:
        """``last_index [B]``, or ``[B, I]`` (a ragged batch: one token per image slot) giving
        ``e [B, I, D]`` and ``f [B, I, C]``."""
        rows = torch.arange(h.shape[0], device=last_index.device)
        rows = rows.view(-1, *([1] * (last_index.ndim - 1)))
        pooled = h[rows, last_index]
        return pooled, self.proj(pooled)


@torch.no_grad()
def ema_update(target: nn.Module, source: nn.Module, momentum: float) -> None:
    """``target <- momentum * target + (1 - momentum) * source`` for every parameter.

    Floating-point buffers are averaged the same way, other buffers copied. The two modules
    must have the same parameter names and shapes (``target`` is a copy of ``source``).

    Raises:
        ValueError: ``momentum`` outside ``[0, 1]``, or parameters that differ in name or shape.
    """
    if not 0.0 <= momentum <= 1.0:
        raise ValueError(f"momentum ({momentum}) must be in [0, 1].")
    src = dict(source.named_parameters())
    tgt = dict(target.named_parameters())
    if src.keys() != tgt.keys():
        raise ValueError(
            f"target and source differ in parameters: only in target "
            f"{sorted(tgt.keys() - src.keys())}, only in source {sorted(src.keys() - tgt.keys())};"
            " build the target with momentum_copy(source)."
        )
    for name, t in tgt.items():
        if t.shape != src[name].shape:
            raise ValueError(
                f"parameter {name!r}: target shape {tuple(t.shape)} != source shape "
                f"{tuple(src[name].shape)}; build the target with momentum_copy(source)."
            )
        t.lerp_(src[name].detach(), 1.0 - momentum)
    src_buffers = dict(source.named_buffers())
    for name, b in target.named_buffers():
        if name in src_buffers:
            if b.is_floating_point():
                b.lerp_(src_buffers[name], 1.0 - momentum)
            else:
                b.copy_(src_buffers[name])


def momentum_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` with gradients switched off, to be tracked by ema_update."""
    clone = copy.deepcopy(module)
    clone.requires_grad_(False)
    return clone


class MomentumHeads(nn.Module):
    """EMA copies of the image and text projection heads.

    Holds only the copies (the live heads stay in the model and are passed to :meth:`update`),
    so no parameter is registered twice. Build it before any parallelisation of the heads, or
    apply the same sharding plan to it, so shapes and placements match.

    Raises:
        ValueError: ``momentum`` outside ``[0, 1]``.
    """

    def __init__(self, *, image_head: nn.Module, text_head: nn.Module, momentum: float) -> None:
        super().__init__()
        if not 0.0 <= momentum <= 1.0:
            raise ValueError(f"momentum ({momentum}) must be in [0, 1]; ALBEF uses 0.995.")
        self.momentum = momentum
        self.image_head = momentum_copy(image_head)
        self.text_head = momentum_copy(text_head)

    @torch.no_grad()
    def forward(self, image_embeds: Tensor, text_embeds: Tensor) -> tuple[Tensor, Tensor]:
        """L2-normalised momentum features ``[B, C]`` of the pooled tower outputs ``[B, E]`` /
        ``[B, D]`` (no gradient)."""
        image = F.normalize(self.image_head(image_embeds), dim=-1)
        text = F.normalize(self.text_head(text_embeds), dim=-1)
        return image, text

    def update(self, image_head: nn.Module, text_head: nn.Module) -> None:
        """One EMA step towards the live heads; call after every optimizer step."""
        ema_update(self.image_head, image_head, self.momentum)
        ema_update(self.text_head, text_head, self.momentum)
