"""Gradients kept aside between a pipeline schedule's backward and Lightning's ``backward()``.

A pipeline schedule runs forward and backward inside ``training_step``; Lightning then zeroes
gradients (``optimizer.zero_grad`` between ``training_step`` and ``backward`` under manual
closures) before it calls the strategy's ``backward``. :class:`GradientStash` takes the
schedule's gradients off the parameters right after the schedule and hands them back, divided by
the gradient-accumulation count, in ``backward()``: the same place and scale Lightning's own
backward would have given them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import Tensor, nn

__all__ = ["GradientStash"]


class GradientStash:
    """Run a function with fresh gradients and keep the gradients it produced.

    ``params`` is the module's parameter list (fixed for the life of the stash's use).
    """

    def __init__(self) -> None:
        self._grads: list[Tensor | None] | None = None

    @property
    def pending(self) -> bool:
        """Gradients are kept and not yet restored."""
        return self._grads is not None

    def capture(self, params: Sequence[nn.Parameter], fn: Callable[[], Tensor]) -> Tensor:
        """``fn()`` with every ``.grad`` cleared first; its gradients are kept, the previous
        ones (an accumulation in progress) put back. Returns ``fn()``'s result."""
        before = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            out = fn()
            self._grads = [p.grad for p in params]
        finally:
            for p, g in zip(params, before, strict=True):
                p.grad = g
        return out

    def restore(self, params: Sequence[nn.Parameter], scale: float = 1.0) -> None:
        """Add the kept gradients, times ``scale``, to ``params``' gradients; forget them.

        Raises:
            RuntimeError: nothing kept (no :meth:`capture` since the last restore).
        """
        if self._grads is None:
            raise RuntimeError("GradientStash.restore() without a capture() before it.")
        for p, g in zip(params, self._grads, strict=True):
            if g is None:
                continue
            g = g * scale if scale != 1.0 else g
            p.grad = g if p.grad is None else p.grad + g
        self._grads = None
