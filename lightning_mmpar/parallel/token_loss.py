"""Per-token loss normalisation: the mean over every target token of an optimizer step.

A loss that averages over its own (micro-)batch's tokens gives, under micro-batching, gradient
accumulation and data parallelism, the mean of (micro-)batch means: each micro-batch weighs the
same however many target tokens it holds. The mean over the step's target tokens is::

    L = sum_{k, m, r} S_kmr / N,    N = sum_{k, m, r} n_kmr

with ``S`` a micro-batch's summed token loss and ``n`` its target tokens, over accumulated
batches ``k``, pipeline micro-batches ``m`` and data-parallel ranks ``r``. ``N`` is known only
once the step's last micro-batch has been seen, so, as Megatron-core's per-token loss does
(``loss_func`` returning ``(loss, num_tokens, ...)`` with ``calculate_per_token_loss``, and
``finalize_model_grads`` dividing every gradient by the all-reduced ``num_tokens``), each
micro-batch back-propagates its sum ``S`` and the gradients are divided by ``N`` after the
step's last backward (:class:`TokenCount`).

A loss carries its sum and count as a :class:`TokenMean` (a 0-dim tensor holding the mean, what
:func:`lightning_mmpar.losses.caption_loss` returns) or as a ``(sum, count)`` pair
(:func:`as_token_mean` turns either into a :class:`TokenMean`); a plain scalar stays a
micro-batch mean.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_mmpar.parallel import comm

__all__ = ["TokenCount", "TokenMean", "as_token_mean", "token_mean"]


class TokenMean(Tensor):
    """A 0-dim loss tensor, the mean over target tokens, that also carries its sum and count.

    It is the mean itself (arithmetic, ``float()``, ``backward()`` and logging see the mean);
    ``token_sum`` is the summed token loss (0-dim, on the autograd graph; zero when there is no
    target token) and ``tokens`` the count of target tokens (0-dim int64). Any operation on it
    returns a plain tensor, so a loss the user transforms (``2 * loss``, ``loss + aux``) is a
    plain mean again. Build it with :func:`token_mean`.
    """

    token_sum: Tensor
    tokens: Tensor

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]


def token_mean(total: Tensor, tokens: Tensor | int, mean: Tensor | None = None) -> TokenMean:
    """A :class:`TokenMean` of summed loss ``total`` (0-dim) over ``tokens`` target tokens.

    ``mean`` is the value the result holds (default ``total / max(tokens, 1)``); a loss that
    computes its mean directly (``F.cross_entropy``'s) passes it, so the mean is bit for bit
    what it was. Raises ``ValueError`` for a non-scalar ``total`` or ``tokens``.
    """
    count = torch.as_tensor(tokens, device=total.device).long()
    if total.ndim != 0 or count.ndim != 0:
        raise ValueError(
            f"token loss: total {tuple(total.shape)} and tokens {tuple(count.shape)} must be "
            "0-dim (the summed loss of the micro-batch and its number of target tokens)."
        )
    value = total / count.clamp(min=1).to(total.dtype) if mean is None else mean
    out = value.as_subclass(TokenMean)
    out.token_sum = total
    out.tokens = count
    return out


def as_token_mean(loss: Any) -> Tensor:
    """``loss`` as a :class:`TokenMean` when it carries a token count, else unchanged.

    A ``(sum, count)`` pair (tuple or list) becomes :func:`token_mean`; a :class:`TokenMean` or
    a plain tensor is returned as is. Raises ``ValueError`` for a tuple of another length and
    ``TypeError`` for anything else.
    """
    if isinstance(loss, Tensor):
        return loss
    if isinstance(loss, tuple | list):
        if len(loss) != 2 or not isinstance(loss[0], Tensor):
            raise ValueError(
                f"a loss returned as a sequence must be the pair (sum, token_count), got "
                f"{len(loss)} items; return (loss_sum, num_tokens) or a scalar mean."
            )
        return token_mean(loss[0], loss[1])
    raise TypeError(
        f"a loss must be a tensor or a (sum, token_count) pair, got {type(loss).__name__}."
    )


class TokenCount:
    """The target tokens of one optimizer step, and the gradients' division by their total.

    :meth:`add` takes each loss of the step (every training batch, on every rank); :meth:`finish`
    after the step's last backward turns gradients of summed token losses into those of the
    step's token mean. A step either gives every loss as a :class:`TokenMean` (then normalised
    here) or none (plain means: left as they are); a mix raises ``ValueError``.
    """

    def __init__(self) -> None:
        self._tokens: Tensor | None = None
        self._plain = 0

    @property
    def pending(self) -> bool:
        """Some token loss was added since the last :meth:`finish`."""
        return self._tokens is not None

    def add(self, loss: Tensor) -> Tensor:
        """Record ``loss`` of one batch; returns what to back-propagate: a :class:`TokenMean`'s
        summed loss, a plain loss unchanged. Raises ``ValueError`` when a step mixes both."""
        if not isinstance(loss, TokenMean):
            self._plain += 1
            self._check_one_kind()
            return loss
        n = loss.tokens.detach()
        self._tokens = n.clone() if self._tokens is None else self._tokens + n.to(self._tokens)
        self._check_one_kind()
        return loss.token_sum

    def _check_one_kind(self) -> None:
        if self._plain and self._tokens is not None:
            raise ValueError(
                "one optimizer step got both a plain mean loss and a (sum, token count) loss; "
                "return the same kind from every training step (caption_loss or a (sum, count) "
                "pair everywhere, or plain means everywhere)."
            )

    def total(self, group: dist.ProcessGroup | None) -> int:
        """Target tokens of the step summed over ``group`` (the data-parallel ranks)."""
        assert self._tokens is not None
        n = self._tokens.detach().clone().double()
        return int(comm.all_reduce(n, "sum", group))

    @torch.no_grad()
    def finish(
        self, params: Iterable[Tensor], group: dist.ProcessGroup | None, scale: float
    ) -> int | None:
        """Multiply every gradient by ``scale / N`` (``N``: :meth:`total` over ``group``, at
        least 1); forget the step. ``scale`` undoes the averages already applied to the summed
        losses: Lightning's ``1 / accumulate_grad_batches``, the pipeline's
        ``1 / micro_batches``, the gradient reduction's ``1 / dp``. Returns ``N``, or ``None``
        (nothing scaled, no communication) for a step of plain losses. Collective over
        ``group`` when the step had token losses (every rank of the group has)."""
        if self._tokens is None:
            self._plain = 0
            return None
        total = self.total(group)
        factor = scale / max(total, 1)
        for p in params:
            if p.grad is not None:
                comm.to_local(p.grad).mul_(factor)
        self._tokens, self._plain = None, 0
        return total

    def reset(self) -> None:
        """Forget the step without touching gradients."""
        self._tokens, self._plain = None, 0
