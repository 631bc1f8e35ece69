"""Caption (language-model) cross-entropy, plain or vocab-parallel.

Position ``t`` of the logits predicts token ``t + 1`` of the caption::

    L = 1/|M| sum_{(b,t) in M} -log softmax(z_{b,t})[y_{b,t+1}],   M = {(b,t): y_{b,t+1} != ignore}

Under tensor parallelism the LM head may return logits as a ``DTensor`` sharded on the vocab
(last) dimension; ``loss_parallel=True`` then computes the same loss with the package's one
vocab-parallel cross-entropy
(:func:`lightning_mmpar.parallel.numerics.vocab_parallel_cross_entropy`), which never
materialises the full ``[B, T, V]`` logits on one rank and needs no context manager around the
backward.

Both return a :class:`~lightning_mmpar.parallel.token_loss.TokenMean`: the token mean, carrying
its summed loss and its count of target tokens, so ``mm_parallel`` normalises a module's loss
by the target tokens of the whole optimizer step (every micro-batch, accumulated batch and
data-parallel rank: Megatron-core's per-token loss) when ``pipeline_loss`` or ``training_step``
returns it unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lightning_mmpar.parallel import comm
from lightning_mmpar.parallel.numerics import vocab_parallel_cross_entropy
from lightning_mmpar.parallel.token_loss import TokenMean, token_mean

IGNORE_INDEX = -100
"""Target value that contributes nothing to the loss (torch's and Hugging Face's default)."""


def _shift(logits: Any, target_ids: torch.Tensor, shift: bool) -> tuple[Any, torch.Tensor]:
    if logits.ndim != 3 or tuple(logits.shape[:2]) != tuple(target_ids.shape):
        raise ValueError(
            f"logits {tuple(logits.shape)} must be [batch, seq, vocab] and target_ids "
            f"{tuple(target_ids.shape)} [batch, seq] with the same batch and seq sizes."
        )
    if not shift:
        return logits, target_ids
    return logits[:, :-1], target_ids[:, 1:]


def _with_tokens(
    mean: torch.Tensor, logits: Any, targets: torch.Tensor, ignore_index: int
) -> TokenMean:
    """``mean`` as a :class:`TokenMean`: sum ``mean * n`` over ``n`` scored targets; with no
    scored target the sum is a zero still on the graph (the mean itself is NaN there)."""
    if hasattr(targets, "full_tensor"):  # a DTensor target (vocab_parallel_cross_entropy's)
        targets = targets.full_tensor()
    n = (targets != ignore_index).sum()
    if int(n) == 0:
        total = comm.to_local(logits).float().sum() * 0.0
    else:
        total = mean * n.to(mean.dtype)
    return token_mean(total, n, mean=mean)


def plain_caption_loss(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    shift: bool = True,
) -> TokenMean:
    """Token-mean cross-entropy of ``[B, T, V]`` logits against ``[B, T]`` ids (float32 math).

    With ``shift`` (default) ``logits[:, t]`` is scored against ``target_ids[:, t + 1]``, so
    ``target_ids`` is the caption itself (bos ... eos) with padding, prompt, image-marker and
    image positions set to ``ignore_index``. Returns a 0-dim
    :class:`~lightning_mmpar.parallel.token_loss.TokenMean` (NaN mean, zero ``token_sum`` when
    no target is scored).
    """
    logits, targets = _shift(logits, target_ids, False)
    if shift:  # the targets move left (last position unscored): no copy of the logits
        targets = F.pad(target_ids[:, 1:], (0, 1), value=ignore_index)
    flat = logits.reshape(-1, logits.shape[-1]).float()
    mean = F.cross_entropy(flat, targets.reshape(-1), ignore_index=ignore_index)
    return _with_tokens(mean, logits, targets, ignore_index)


def _check_vocab_sharded(logits: Any) -> None:
    """``logits`` must be a DTensor with the vocab (last) dim sharded."""
    from torch.distributed.tensor import DTensor, Shard

    placements = list(getattr(logits, "placements", ()))
    vocab_dims = (-1, logits.ndim - 1)
    if not isinstance(logits, DTensor) or not any(
        isinstance(p, Shard) and p.dim in vocab_dims for p in placements
    ):
        raise ValueError(
            f"loss_parallel=True needs logits as a DTensor sharded on the vocab dim "
            f"(Shard({logits.ndim - 1})), got {placements or 'a plain torch.Tensor'}; "
            "use a colwise LM head with use_local_output=False, or pass loss_parallel=False."
        )


def caption_loss(
    logits: Any,
    target_ids: torch.Tensor,
    *,
    loss_parallel: bool = False,
    ignore_index: int = IGNORE_INDEX,
    shift: bool = True,
) -> TokenMean:
    """Caption cross-entropy; vocab-parallel when ``loss_parallel`` (logits a sharded DTensor).

    ``logits [B, T, V]``, ``target_ids [B, T]`` (this rank's batch, global token ids). With
    ``loss_parallel=True`` the logits must be a DTensor sharded on the vocab dim (``Shard(2)``)
    over one mesh dim and replicated over any other; the result is a plain 0-d tensor, the same
    on every rank of the vocab group, and its backward (inside or outside any context, Lightning's
    own ``backward`` included) gives each rank the gradient of its vocab shard. The result is a
    :class:`~lightning_mmpar.parallel.token_loss.TokenMean` (the mean, with ``token_sum`` and
    ``tokens``): returned from ``pipeline_loss`` or ``training_step`` under ``mm_parallel``, the
    step's loss is the mean over all its target tokens. Raises ``ValueError`` for mismatched
    shapes or, with ``loss_parallel=True``, other logits.
    """
    if not loss_parallel:
        return plain_caption_loss(logits, target_ids, ignore_index=ignore_index, shift=shift)
    _check_vocab_sharded(logits)
    logits, targets = _shift(logits, target_ids, shift)
    mean = vocab_parallel_cross_entropy(logits, targets, ignore_index=ignore_index)
    return _with_tokens(mean, logits, targets, ignore_index)
