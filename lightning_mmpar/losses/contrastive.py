"""CLIP contrastive loss (InfoNCE) with features gathered over the data-parallel group only.

For L2-normalised image features ``u_i`` and text features ``v_j`` of the *global* batch
``i, j = 1..N`` (all dp ranks), scale ``s = exp(t)`` and optional bias ``b``::

    l_ij = s * <u_i, v_j> + b
    L    = 1/2 * ( 1/N sum_i CE(l_i., i) + 1/N sum_j CE(l_.j, j) )

which is open_clip's ``ClipLoss``. Only the data-parallel group is gathered: tensor- and
pipeline-parallel peers hold the *same* samples, so gathering over WORLD would repeat every
sample ``tp * pp`` times as a false negative of itself. With ``group=None`` (or a group of size 1)
the loss is the single-device formula.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_mmpar.losses.gather import gather_sizes, gather_with_grad, group_rank

CONTRASTIVE_KEY = "contrastive_loss"
"""Name of the term in the dict returned with ``output_dict=True`` (open_clip's name)."""


class LogitScale(nn.Module):
    """Learnable temperature ``s = exp(t)`` capped at ``max_scale`` (CLIP: 1/0.07, max 100).

    Stores ``t = log(init_scale)``; calling the module returns ``exp(t)``, which is what
    :class:`ContrastiveLoss` and :class:`~lightning_mmpar.losses.mml.MMLLoss` take. The cap is
    applied to the parameter, as CLIP and open_clip do: call :meth:`clamp_` after every
    optimizer step (``t <- clamp(t, 0, ln max_scale)``). Clamping the output instead would give
    ``t`` a zero gradient at the cap, and a scale that reached it could never come back down.

    Raises:
        ValueError: ``init_scale`` outside ``[1, max_scale]``.
    """

    def __init__(
        self, *, init_scale: float = 1 / 0.07, max_scale: float = 100.0, learnable: bool = True
    ) -> None:
        super().__init__()
        if not 1 <= init_scale <= max_scale:
            raise ValueError(
                f"init_scale ({init_scale}) must be in [1, max_scale={max_scale}]; CLIP uses "
                "1/0.07 with max_scale 100."
            )
        self.max_scale = max_scale
        self.log_scale = nn.Parameter(torch.tensor(math.log(init_scale)), requires_grad=learnable)

    def forward(self) -> torch.Tensor:
        """``exp(t)`` as a 0-d tensor."""
        return self.log_scale.exp()

    @torch.no_grad()
    def clamp_(self) -> LogitScale:
        """Clamp ``t`` in place to ``[0, ln max_scale]`` (after each optimizer step); returns
        ``self``."""
        self.log_scale.clamp_(0.0, math.log(self.max_scale))
        return self


def contrastive_logits(
    image_features: torch.Tensor,
    text_features: torch.Tensor,
    logit_scale: torch.Tensor | float,
    *,
    group: dist.ProcessGroup | None = None,
    local_loss: bool = False,
    logit_bias: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Image->text and text->image logits over the dp-gathered batch, plus target indices.

    Without ``local_loss`` both logit matrices are ``[N, N]`` over the global batch; with it
    the rows are this rank's ``n`` samples and the columns the global batch (``[n, N]``), the
    targets being offset by this rank's first global row.
    """
    sizes = gather_sizes(image_features.shape[0], image_features.device, group)
    all_images = gather_with_grad(image_features, group, sizes)
    all_texts = gather_with_grad(text_features, group, sizes)
    if local_loss:
        per_image = logit_scale * image_features @ all_texts.T
        per_text = logit_scale * text_features @ all_images.T
        start = sum(sizes[: group_rank(group)])
    else:
        per_image = logit_scale * all_images @ all_texts.T
        per_text = per_image.T
        start = 0
    if logit_bias is not None:
        per_image = per_image + logit_bias
        per_text = per_text + logit_bias
    targets = torch.arange(per_image.shape[0], device=per_image.device) + start
    return per_image, per_text, targets


class ContrastiveLoss(nn.Module):
    """CLIP InfoNCE over the data-parallel ``group`` with gradients through the gather.

    ``forward`` takes L2-normalised ``[n, d]`` image and text features of this rank's samples
    (row ``i`` of each is a pair) and the *exponentiated* ``logit_scale`` (a tensor from
    :class:`LogitScale` to learn it, or a float). Every rank returns the same global loss
    (``local_loss=False``) or the mean over its own rows (``local_loss=True``, less memory:
    ``[n, N]`` logits); either way the gradient on the local features is ``dp`` times that of
    the global loss, which dp gradient averaging cancels. Batches may differ in size per rank;
    with no pair on any rank the loss is 0 (on the features' graph), not the NaN of an empty
    cross-entropy.

    Args:
        group: data-parallel process group to gather over; None means no gathering. Never pass
            WORLD when tensor or pipeline parallelism is on.
        local_loss: compute only this rank's rows of the logit matrix.
    """

    def __init__(self, *, group: dist.ProcessGroup | None = None, local_loss: bool = False) -> None:
        super().__init__()
        self.group = group
        self.local_loss = local_loss

    def forward(
        self,
        image_features: torch.Tensor,
        text_features: torch.Tensor,
        logit_scale: torch.Tensor | float,
        logit_bias: torch.Tensor | float | None = None,
        output_dict: bool = False,
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """The loss, or ``{"contrastive_loss": loss}`` with ``output_dict=True``."""
        _check_pairs(image_features, text_features)
        per_image, per_text, targets = contrastive_logits(
            image_features,
            text_features,
            logit_scale,
            group=self.group,
            local_loss=self.local_loss,
            logit_bias=logit_bias,
        )
        if per_image.numel() == 0:  # no pair on any rank: zero, on the graph (not NaN)
            loss = (per_image.sum() + per_text.sum()) * 0.0
        else:
            loss = (F.cross_entropy(per_image, targets) + F.cross_entropy(per_text, targets)) / 2
        return {CONTRASTIVE_KEY: loss} if output_dict else loss


def _check_pairs(image_features: torch.Tensor, text_features: torch.Tensor) -> None:
    if image_features.ndim != 2 or image_features.shape != text_features.shape:
        raise ValueError(
            f"image_features {tuple(image_features.shape)} and text_features "
            f"{tuple(text_features.shape)} must both be [batch, dim] with equal shapes (one "
            "caption per image); pool and project the towers before the loss."
        )
