"""Caption (language-model) cross-entropy, plain or vocab-parallel.

Position ``t`` of the logits predicts token ``t + 1`` of the caption::

    L = 1/|M| sum_{(b,t) in M} -log softmax(z_{b,t})[y_{b,t+1}],   M = {(b,t): y_{b,t+1} != ignore}

Under tensor parallelism the LM head may return logits as a ``DTensor`` sharded on the vocab
(last) dimension; ``loss_parallel=True`` then computes the same loss with torch's
``loss_parallel()`` context, which never materialises the full ``[B, T, V]`` logits on one rank.
See :func:`caption_loss` for where its backward runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
"""Target value that contributes nothing to the loss (torch's and Hugging Face's default)."""

_IN_SCOPE: ContextVar[bool] = ContextVar("lightning_mmpar_vocab_parallel_scope", default=False)


@contextlib.contextmanager
def vocab_parallel_scope() -> Iterator[None]:
    """torch's ``loss_parallel()`` context, made re-entrant for :func:`caption_loss`.

    torch's context cannot be nested (leaving the inner one uninstalls the outer one's ops), so
    wrap forward *and* backward in this scope instead of ``loss_parallel()`` to run the
    vocab-parallel backward ops too; :func:`caption_loss` then does not enter it again.
    """
    from torch.distributed.tensor.parallel import loss_parallel

    if _IN_SCOPE.get():
        yield
        return
    token = _IN_SCOPE.set(True)
    try:
        with loss_parallel():
            yield
    finally:
        _IN_SCOPE.reset(token)


def _shift(logits: Any, target_ids: torch.Tensor, shift: bool) -> tuple[Any, torch.Tensor]:
    if logits.ndim != 3 or tuple(logits.shape[:2]) != tuple(target_ids.shape):
        raise ValueError(
            f"logits {tuple(logits.shape)} must be [batch, seq, vocab] and target_ids "
            f"{tuple(target_ids.shape)} [batch, seq] with the same batch and seq sizes."
        )
    if not shift:
        return logits, target_ids
    return logits[:, :-1], target_ids[:, 1:]


def plain_caption_loss(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    shift: bool = True,
) -> torch.Tensor:
    """Token-mean cross-entropy of ``[B, T, V]`` logits against ``[B, T]`` ids (float32 math).

    With ``shift`` (default) ``logits[:, t]`` is scored against ``target_ids[:, t + 1]``, so
    ``target_ids`` is the caption itself (bos ... eos) with padding set to ``ignore_index``.
    """
    logits, targets = _shift(logits, target_ids, shift)
    flat = logits.reshape(-1, logits.shape[-1]).float()
    return F.cross_entropy(flat, targets.reshape(-1), ignore_index=ignore_index)


def _target_placements(logits: Any) -> list[Any]:
    """Placements of the targets: the vocab shard becomes Replicate, a batch shard stays."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    vocab_dims = (-1, logits.ndim - 1)
    placements = list(getattr(logits, "placements", ()))
    vocab = [isinstance(p, Shard) and p.dim in vocab_dims for p in placements]
    other = [p for p, v in zip(placements, vocab, strict=True) if not v]
    if isinstance(logits, DTensor) and any(vocab):
        if all(isinstance(p, Replicate) or p == Shard(0) for p in other):
            return [Replicate() if v else p for p, v in zip(placements, vocab, strict=True)]
    raise ValueError(
        f"loss_parallel=True needs logits as a DTensor sharded on the vocab dim "
        f"(Shard({logits.ndim - 1})), got {placements or 'a plain torch.Tensor'}; "
        "use a colwise LM head with use_local_output=False, or pass loss_parallel=False; "
        "other mesh dims may only be Replicate or Shard(0)."
    )


def caption_loss(
    logits: Any,
    target_ids: torch.Tensor,
    *,
    loss_parallel: bool = False,
    ignore_index: int = IGNORE_INDEX,
    shift: bool = True,
) -> torch.Tensor:
    """Caption cross-entropy; vocab-parallel when ``loss_parallel`` (logits a sharded DTensor).

    With ``loss_parallel=True`` the result is a replicated 0-d ``DTensor``. Its backward gives
    the right gradients outside any context too (tested), but torch documents that it belongs
    inside ``loss_parallel()``: wrap forward and backward in :func:`vocab_parallel_scope` (never
    in torch's ``loss_parallel()``, which is not re-entrant) for the vocab-parallel backward.
    A plain ``target_ids`` tensor holds this rank's batch (its local rows when the logits are
    also batch-sharded, Shard(0)) and is wrapped as a DTensor.
    """
    if not loss_parallel:
        return plain_caption_loss(logits, target_ids, ignore_index=ignore_index, shift=shift)
    from torch.distributed.tensor import DTensor

    placements = _target_placements(logits)
    logits, targets = _shift(logits, target_ids, shift)
    if not isinstance(targets, DTensor):
        # The local targets match the local batch of the logits (replicated over the TP dim).
        targets = DTensor.from_local(targets.contiguous(), logits.device_mesh, placements)
    with vocab_parallel_scope():
        flat = logits.flatten(0, 1).float()
        return F.cross_entropy(flat, targets.flatten(), ignore_index=ignore_index)
