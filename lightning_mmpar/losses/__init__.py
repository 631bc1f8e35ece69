"""Training losses: contrastive (gathered over a data-parallel group), MML, caption CE.

The caption CE returns a :class:`TokenMean` (the token mean carrying its sum and token count),
which ``mm_parallel`` normalises over the target tokens of the whole optimizer step.

Each loss takes a process group, not a strategy, and reduces to its single-device formula when
the group is ``None`` or has one rank.
"""

from lightning_mmpar.losses.caption import IGNORE_INDEX, caption_loss, plain_caption_loss
from lightning_mmpar.losses.contrastive import (
    CONTRASTIVE_KEY,
    ContrastiveLoss,
    LogitScale,
    contrastive_logits,
)
from lightning_mmpar.losses.gather import gather_no_grad, gather_sizes, gather_with_grad
from lightning_mmpar.losses.mml import MML_KEY, MMLConfig, MMLLoss, kl_to_targets
from lightning_mmpar.parallel.token_loss import TokenMean, token_mean

__all__ = [
    "CONTRASTIVE_KEY",
    "IGNORE_INDEX",
    "MML_KEY",
    "ContrastiveLoss",
    "LogitScale",
    "MMLConfig",
    "MMLLoss",
    "TokenMean",
    "caption_loss",
    "contrastive_logits",
    "gather_no_grad",
    "gather_sizes",
    "gather_with_grad",
    "kl_to_targets",
    "plain_caption_loss",
    "token_mean",
]
