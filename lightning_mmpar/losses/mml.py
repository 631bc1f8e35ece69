"""MML: momentum distillation of the image-text similarity distribution (ALBEF style).

A momentum (EMA) copy of the projection heads produces targets. With current features ``u, v``
and momentum features ``u', v'`` (all L2-normalised, gathered over the dp group), scale ``s``::

    p_i  = softmax_j(s <u_i, v_j>)        q_i  = softmax_j(s <u'_i, v'_j>)   (image -> text)
    L_i2t = 1/N sum_i KL(q_i || p_i)       and L_t2i likewise over columns,
    L_mml = weight * (L_i2t + L_t2i) / 2

The targets ``q`` carry no gradient (momentum features and ``s`` are detached), so the gradient
equals that of the soft-target cross-entropy ``-sum q log p`` (KL differs by ``H(q)``, a
constant). After every optimizer step the heads are tracked by :func:`ema_update`::

    theta' <- m * theta' + (1 - m) * theta
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_mmpar.losses.contrastive import contrastive_logits

MML_KEY = "mml_loss"
"""Name of the term in the dict returned with ``output_dict=True``."""


@dataclass(kw_only=True)
class MMLConfig:
    """Weight and momentum of the momentum-distillation term."""

    weight: float = 0.4
    """Multiplier of the KL term in the total loss (ALBEF's distillation alpha is 0.4)."""
    momentum: float = 0.995
    """EMA momentum ``m`` of the momentum heads (ALBEF: 0.995); 0 copies, 1 freezes."""
    local_loss: bool = False
    """Compute only this rank's rows of the similarity matrices (as in ContrastiveLoss)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.momentum <= 1.0:
            raise ValueError(f"momentum ({self.momentum}) must be in [0, 1]; ALBEF uses 0.995.")
        if self.weight < 0:
            raise ValueError(f"weight ({self.weight}) must be >= 0; use 0 to disable MML.")


@torch.no_grad()
def ema_update(target: nn.Module, source: nn.Module, momentum: float) -> None:
    """``target <- momentum * target + (1 - momentum) * source`` for every parameter.

    Floating-point buffers are averaged the same way, other buffers copied. The two modules
    must have the same parameter names and shapes (``target`` is a copy of ``source``).
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
    """

    def __init__(self, *, image_head: nn.Module, text_head: nn.Module, momentum: float) -> None:
        super().__init__()
        if not 0.0 <= momentum <= 1.0:
            raise ValueError(f"momentum ({momentum}) must be in [0, 1]; ALBEF uses 0.995.")
        self.momentum = momentum
        self.image_head = momentum_copy(image_head)
        self.text_head = momentum_copy(text_head)

    @torch.no_grad()
    def forward(
        self, image_embeds: torch.Tensor, text_embeds: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """L2-normalised momentum features of the pooled tower outputs (no gradient)."""
        image = F.normalize(self.image_head(image_embeds), dim=-1)
        text = F.normalize(self.text_head(text_embeds), dim=-1)
        return image, text

    def update(self, image_head: nn.Module, text_head: nn.Module) -> None:
        """One EMA step towards the live heads; call after every optimizer step."""
        ema_update(self.image_head, image_head, self.momentum)
        ema_update(self.text_head, text_head, self.momentum)


def kl_to_targets(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Row-mean ``KL(softmax(target_logits) || softmax(logits))``; targets are detached."""
    target_log_p = F.log_softmax(target_logits.detach(), dim=-1)
    log_p = F.log_softmax(logits, dim=-1)
    return F.kl_div(log_p, target_log_p, reduction="batchmean", log_target=True)


class MMLLoss(nn.Module):
    """Momentum-distillation KL between momentum and current similarity distributions.

    Args:
        config: weight, momentum (used by :meth:`make_heads`) and local_loss.
        group: data-parallel process group to gather features over (None: no gathering).
    """

    def __init__(
        self, *, config: MMLConfig | None = None, group: dist.ProcessGroup | None = None
    ) -> None:
        super().__init__()
        self.config = config or MMLConfig()
        self.group = group

    def make_heads(self, image_head: nn.Module, text_head: nn.Module) -> MomentumHeads:
        """Momentum copies of the heads with this loss's momentum."""
        return MomentumHeads(
            image_head=image_head, text_head=text_head, momentum=self.config.momentum
        )

    def forward(
        self,
        image_features: torch.Tensor,
        text_features: torch.Tensor,
        momentum_image_features: torch.Tensor,
        momentum_text_features: torch.Tensor,
        logit_scale: torch.Tensor | float,
        output_dict: bool = False,
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """``weight * (KL_i2t + KL_t2i) / 2``, or ``{"mml_loss": ...}`` with ``output_dict``."""
        group, local = self.group, self.config.local_loss
        per_image, per_text, _ = contrastive_logits(
            image_features, text_features, logit_scale, group=group, local_loss=local
        )
        scale = logit_scale.detach() if isinstance(logit_scale, torch.Tensor) else logit_scale
        with torch.no_grad():
            target_image, target_text, _ = contrastive_logits(
                momentum_image_features,
                momentum_text_features,
                scale,
                group=group,
                local_loss=local,
            )
        kl = (kl_to_targets(per_image, target_image) + kl_to_targets(per_text, target_text)) / 2
        loss = self.config.weight * kl
        return {MML_KEY: loss} if output_dict else loss
