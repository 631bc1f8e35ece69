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

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_mmpar.losses.contrastive import contrastive_logits
from lightning_mmpar.models.heads import MomentumHeads as MomentumHeads
from lightning_mmpar.models.heads import ema_update as ema_update
from lightning_mmpar.models.heads import momentum_copy as momentum_copy

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
        if per_image.numel() == 0:  # no pair on any rank: zero, on the graph (not NaN)
            loss = (per_image.sum() + per_text.sum()) * 0.0
        else:
            kl = (kl_to_targets(per_image, target_image) + kl_to_targets(per_text, target_text)) / 2
            loss = self.config.weight * kl
        return {MML_KEY: loss} if output_dict else loss
