"""The recipe's loss assembly: three terms, independent of the parallel layout.

::

    L = w_c * InfoNCE(u, v) + w_cap * CE_caption + MML(u, v; u', v')

* Caption: the mean over every valid target token of the whole step batch (all micro-batches and
  data-parallel ranks), whatever the padding: Megatron-LM's per-token loss. Each (micro-)batch
  contributes ``sum_CE_m / N * (M * dp)`` with ``N`` the batch's valid tokens summed over the dp
  group, ``M`` the micro-batches of the batch: the pipeline schedule averages micro-batch
  gradients (``1 / M``) and data parallelism averages over ``dp``, so the gradient and the mean of
  the logged terms are those of one process on the whole batch.
* Under gradient accumulation (``accumulate_grad_batches = A > 1``) the caption term of an
  optimizer step is the mean over the target tokens of all its batches: under ``mm_parallel``
  the strategy counts each accumulation window's tokens before its first batch (summed over the
  dp group: :mod:`lightning_mmpar.parallel.token_windows`, Hugging Face's
  ``num_items_in_batch``) and a batch contributes ``sum_CE_m / N_w * (M * dp * A)``, ``N_w``
  the window's tokens (Lightning divides every batch's loss by ``A``); the contrastive / MML
  terms stay each batch's own, averaged over the ``A`` batches by Lightning. Under another
  strategy the window's tokens are not known beforehand, the caption term is then the mean of
  the ``A`` batches' token means and :func:`accumulation_warning` says so once per fit.
* Contrastive and MML: negatives from the whole global batch (dp gather as in open_clip, and all
  micro-batches: the pipeline engine's gradient cache, Gao et al. 2021) with
  ``negatives="global_batch"``; per micro-batch with ``negatives="micro_batch"`` (no extra
  forward, a different loss when ``micro_batches > 1``).

The module hands :meth:`RecipeLoss.start_batch` every full local batch it splits
(``pipeline_inputs``: called by the pipeline engine, the strategy's pp = 1 path and the module's
own steps), and the loss terms their (micro-)batch outputs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_mmpar.losses.caption import IGNORE_INDEX, caption_loss
from lightning_mmpar.losses.contrastive import ContrastiveLoss
from lightning_mmpar.losses.gather import group_size
from lightning_mmpar.losses.mml import MMLLoss
from lightning_mmpar.models.blocks import FusionOutput
from lightning_mmpar.parallel import comm
from lightning_mmpar.recipes import parallel_env as penv
from lightning_mmpar.recipes.options import LossConfig

__all__ = ["TERMS", "RecipeLoss", "accumulation_warning", "caption_tokens"]

TERMS: tuple[str, ...] = ("contrastive", "caption", "mml")
"""Loss terms logged as ``train/<term>`` and ``val/<term>``."""


def caption_tokens(target_ids: Tensor) -> Tensor:
    """Valid (scored) target tokens of ``target_ids [B, T]``: position ``t`` predicts token
    ``t + 1``, padding is ``IGNORE_INDEX``. A 0-dim int64 tensor on ``target_ids``' device."""
    return (target_ids[:, 1:] != IGNORE_INDEX).sum()


def accumulation_warning(accumulate: int, config: LossConfig, windows: bool = False) -> str | None:
    """The warning for a run that accumulates ``accumulate`` batches per optimizer step with a
    caption term under a strategy that does not count accumulation windows (``windows``
    False: any strategy but ``mm_parallel``; module docstring), or ``None``."""
    if accumulate <= 1 or config.caption_weight == 0 or windows:
        return None
    return (
        f"accumulate_grad_batches={accumulate}: the recipe's caption loss of each optimizer "
        f"step is the mean of the {accumulate} batches' token means (each exact over its "
        "micro-batches and data-parallel ranks), not the token mean over all accumulated "
        "batches: a batch with few target tokens weighs as much as one with many. Train under "
        "strategy='mm_parallel' (it counts each accumulation window's tokens first), or raise "
        "data.batch_size instead of accumulating (docs/ragged.md, 'Loss under gradient "
        "accumulation')."
    )


class RecipeLoss:
    """The three terms of one step and their running sums for logging.

    Args:
        config: weights, MML settings and ``negatives``.
        group: the data-parallel group (None: one dp rank). Features are gathered over it and
            caption tokens counted over it.

    ``terms`` is ``[2, 3]``: per term (:data:`TERMS` order) the weighted sum of values and the
    weights. Caption: ``sum_CE`` and tokens (the token mean over everything accumulated);
    contrastive / MML: value times rows of the local batch and rows (a sample mean).
    """

    def __init__(self, config: LossConfig, group: dist.ProcessGroup | None) -> None:
        self.config = config
        self.group = group
        self.dp = group_size(group)
        self.contrastive = ContrastiveLoss(group=group)
        self.mml = MMLLoss(config=config.mml, group=group)
        self.terms = torch.zeros(2, len(TERMS), dtype=torch.float64)
        self._rows = 0
        self._local_tokens: Tensor | None = None
        self._tokens: float | None = None

    def start_batch(self, target_ids: Tensor, window: tuple[int, int] | None = None) -> None:
        """Remember the full local batch ``target_ids [B, T]`` (rows and valid tokens); the dp
        sum of the tokens is taken by the first caption term that needs it. ``window``:
        ``(N_w, A)`` for a training batch of an accumulation window of ``N_w`` target tokens
        (summed over the dp group) under ``accumulate_grad_batches = A``: the caption term is
        then the batch's share of the window's token mean, ``N_w / A`` standing for ``N``."""
        self._rows = target_ids.shape[0]
        self._local_tokens = caption_tokens(target_ids)
        self._tokens = None if window is None else window[0] / window[1]

    def _global_tokens(self, target_ids: Tensor) -> tuple[float, int]:
        """``(N, M)``: valid tokens of the whole step batch and micro-batches per batch."""
        if self._local_tokens is None:  # called without start_batch: this batch alone
            self.start_batch(target_ids)
        if self._tokens is None:
            assert self._local_tokens is not None
            total = self._local_tokens.clone()
            if self.dp > 1:  # comm's None group is the world, the losses' None is no group
                comm.all_reduce(total, "sum", self.group)
            self._tokens = float(total)
        micro = max(1, round(self._rows / max(1, target_ids.shape[0])))
        return self._tokens, micro

    def caption(self, logits: Any, target_ids: Tensor) -> Tensor:
        """This (micro-)batch's share of the global token-mean caption CE, unweighted:
        ``sum_CE / N * (M * dp)``, ``N`` the window's ``N_w / A`` for a batch started with a
        window (0-dim float32; vocab-parallel for DTensor logits)."""
        tokens, micro = self._global_tokens(target_ids)
        n = int(caption_tokens(target_ids))
        if n == 0:  # no scored token: zero, still on the graph (the stage back-propagates it)
            return comm.to_local(logits).float().sum() * 0.0
        parallel = isinstance(logits, DTensor)
        mean = comm.to_local(caption_loss(logits, target_ids, loss_parallel=parallel))
        self.terms[0, 1] += float(mean.detach()) * n
        self.terms[1, 1] += n
        return mean * (micro * self.dp * n / tokens)

    @staticmethod
    def features(out: FusionOutput) -> tuple[Tensor, ...]:
        """What the coupled terms need of one (micro-)batch: image / text features, momentum
        features (``[b, C]``) and the logit scale copies (``[b]``)."""
        return (
            out.image_features,
            out.text_features,
            out.momentum_image,
            out.momentum_text,
            out.logit_scale,
        )

    def coupled(self, features: tuple[Tensor, ...]) -> Tensor:
        """``w_c * InfoNCE + MML`` of the features' batch (gathered over the dp group); zero,
        on the features' graph and without a collective, when both weights are 0 (the same
        on every rank) or a one-rank batch has no image-caption pair."""
        image, text, momentum_image, momentum_text, scales = features
        scale = scales[0]
        unweighted = self.config.contrastive_weight == 0 and self.config.mml.weight == 0
        if unweighted or (image.shape[0] == 0 and self.dp == 1):  # nothing to compute
            return (image.sum() + text.sum() + scale) * 0.0  # (0 * a NaN would be NaN)
        con = self.contrastive(image, text, scale)
        mml = self.mml(image, text, momentum_image, momentum_text, scale)
        assert isinstance(con, Tensor) and isinstance(mml, Tensor)
        rows = image.shape[0]
        self.terms[0, 0] += float(con.detach()) * rows
        self.terms[0, 2] += float(mml.detach()) * rows
        self.terms[1, 0] += rows
        self.terms[1, 2] += rows
        return self.config.contrastive_weight * con + mml

    def pop_terms(self, trainer: Any, owner: bool) -> dict[str, float]:
        """Every term's mean over what was accumulated since the last call (the owner of the
        last pipeline stage's sums, summed over the dp group), then zero the sums."""
        sums = penv.from_last_stage(trainer, self.terms.clone(), owner)
        sums = penv.dp_sum(trainer, sums)
        self.terms.zero_()
        return {name: float(sums[0, i] / sums[1, i].clamp(min=1)) for i, name in enumerate(TERMS)}
