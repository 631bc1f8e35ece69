"""Accumulation windows: a training loader read one optimizer step's batches at a time.

Under gradient accumulation (``A`` batches per optimizer step) a loss that is the mean over the
step's target tokens needs their count ``N`` before the step's first batch is back-propagated
whenever other loss terms share that backward (a caption term plus contrastive terms: dividing
the accumulated gradient by ``N`` afterwards, as :class:`~lightning_mmpar.parallel.token_loss.
TokenCount` does for a caption loss alone, would scale them too). As Hugging Face transformers'
``Trainer`` does (``get_batch_samples``: the window's batches are fetched first and their label
tokens counted into ``num_items_in_batch``), :class:`WindowLoader` fetches the ``A`` batches of
a window before it yields the first one and counts each batch's target tokens with the
module's own counter; the strategy sums the window's count over the data-parallel group once per
window and hands it to the module (``on_accumulation_window``) before the window's first batch.

Windows follow Lightning's optimizer steps: batches ``[kA, (k + 1)A)`` of an epoch, the last
window of an epoch holding what is left (``min(A, L - kA)`` of the epoch's ``L`` batches; fewer
when the loader runs out first). The loader never reads past the window it is in, so at an
optimizer step the wrapped loader has consumed exactly the batches trained: a checkpoint saved
then (Lightning saves after the step) resumes at the next window. A checkpoint saved inside a
window (validation every ``n`` batches, ``n`` not a multiple of ``A``) stores the wrapped
loader's state at the window's start and the number of batches already yielded; loading it
skips those again, so no batch is lost or repeated (the window's token count then covers the
batches still to train: the accumulated gradients of the others are not in a checkpoint).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

__all__ = ["WindowEntry", "WindowLoader", "window_loader"]

_STATE_KEY = "accumulation_window"


class WindowEntry(NamedTuple):
    """One yielded batch's window: its local target tokens, whether the batch opens it, and
    the window's batches (as the loader yielded them, before any transfer)."""

    tokens: int
    first: bool
    batches: tuple[Any, ...]


class WindowLoader:
    """A training loader whose iterator fetches one accumulation window at a time.

    Args:
        loader: the training loader (a ``DataLoader``, ``StatefulDataLoader`` or any iterable;
            ``len``, attributes such as ``sampler`` and ``worker_init_fn`` pass through).
        accumulate: batches per optimizer step (``>= 1``).
        count: the target tokens of one batch, as the module's loss counts them (an ``int``
            or a 0-dim tensor; called on the batch as the loader yields it, before any transfer).
        position: ``(batches of the epoch already trained, batches in the epoch)`` when an
            iterator fetches its first window (``math.inf`` when unknown); a position at or past
            the epoch's end starts a new epoch (0).

    :meth:`pop` gives, once per batch in the order yielded, ``(window tokens, first)``: the
    local target tokens of the batch's window and whether the batch opens it; :meth:`peek`
    the next one's :class:`WindowEntry` without taking it (non-colocated towers send a whole
    window's images at its first batch, :mod:`lightning_mmpar.parallel.towers`). Raises
    ``ValueError`` for ``accumulate < 1``.
    """

    loader: Any
    accumulate: int
    count: Callable[[Any], Any]
    position: Callable[[], tuple[int, float]]
    windows: deque[WindowEntry]
    skip: int  # batches to pass over after a checkpoint saved inside a window
    start_state: Any  # the wrapped loader's state at the current window's start
    pending: int  # batches of the current window
    yielded: int  # of which yielded

    def __init__(
        self,
        loader: Any,
        accumulate: int,
        count: Callable[[Any], Any],
        position: Callable[[], tuple[int, float]],
    ) -> None:
        if accumulate < 1:
            raise ValueError(f"accumulate={accumulate}: batches per optimizer step must be >= 1.")
        self.__dict__.update(loader=loader, accumulate=accumulate, count=count)
        self.__dict__.update(position=position, windows=deque(), skip=0, start_state=None)
        self.__dict__.update(pending=0, yielded=0)

    def __getattr__(self, name: str) -> Any:
        if "loader" not in self.__dict__:  # being copied or unpickled
            raise AttributeError(name)
        return getattr(self.__dict__["loader"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__dict__:  # the wrapper's own state
            self.__dict__[name] = value
        else:  # worker_init_fn and the like: the wrapped loader's
            setattr(self.loader, name, value)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        self.windows.clear()
        self.pending = self.yielded = 0
        return self._batches(iter(self.loader))

    def pop(self) -> tuple[int, bool]:
        """``(local target tokens of the window, first batch of the window)`` of the next
        batch handed to training. Raises ``RuntimeError`` when no batch was yielded for it."""
        entry = self.peek()
        self.windows.popleft()
        return entry.tokens, entry.first

    def peek(self) -> WindowEntry:
        """The next batch's :class:`WindowEntry`, left for :meth:`pop`. Raises
        ``RuntimeError`` when no batch was yielded for it."""
        if not self.windows:
            raise RuntimeError("WindowLoader.pop() without a batch yielded for it.")
        return self.windows[0]

    def _window_size(self, start: int, length: float) -> int:
        """Batches of the window that starts after ``start`` batches of an epoch of
        ``length``: to the next multiple of ``accumulate``, at most to the epoch's end."""
        size = self.accumulate - start % self.accumulate
        return size if math.isinf(length) else max(1, min(size, int(length) - start))

    def _batches(self, it: Iterator[Any]) -> Iterator[Any]:
        done, length = self.position()
        if done >= length:  # the epoch of the position has ended: a new one starts
            done = 0
        while True:
            if self.skip:  # a checkpoint saved inside a window: those batches were yielded
                for _ in range(self.skip):
                    next(it, None)
                self.skip = 0
            self.start_state = _state(self.loader)
            window = []
            for _ in range(self._window_size(done, length)):
                try:
                    window.append(next(it))
                except StopIteration:
                    break
            if not window:
                return
            tokens = sum(int(self.count(b)) for b in window)
            self.pending, self.yielded = len(window), 0
            batches = tuple(window)
            for i, batch in enumerate(window):
                self.windows.append(WindowEntry(tokens, i == 0, batches))
                self.yielded = i + 1
                yield batch
            done += len(window)


class _StatefulWindowLoader(WindowLoader):
    """A :class:`WindowLoader` over a loader with ``state_dict`` / ``load_state_dict``."""

    def state_dict(self) -> dict[str, Any]:
        """The wrapped loader's state; inside a window, its state at the window's start and
        the batches yielded since (module docstring)."""
        if self.yielded >= self.pending or self.start_state is None:
            return self.loader.state_dict()
        return {_STATE_KEY: {"start": self.start_state, "yielded": self.yielded}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s result (or a plain state of the wrapped loader)."""
        inside = state.get(_STATE_KEY) if isinstance(state, dict) else None
        if inside is None:
            self.loader.load_state_dict(state)
            return
        self.loader.load_state_dict(inside["start"])
        self.skip = int(inside["yielded"])


def _state(loader: Any) -> Any:
    fn = getattr(loader, "state_dict", None)
    return fn() if callable(fn) and callable(getattr(loader, "load_state_dict", None)) else None


def window_loader(
    loader: Any,
    accumulate: int,
    count: Callable[[Any], Any],
    position: Callable[[], tuple[int, float]],
) -> WindowLoader:
    """``loader`` as a :class:`WindowLoader` (arguments as there); one that Lightning
    checkpoints (``state_dict`` / ``load_state_dict``) when ``loader`` has both."""
    stateful = all(callable(getattr(loader, n, None)) for n in ("state_dict", "load_state_dict"))
    cls = _StatefulWindowLoader if stateful else WindowLoader
    return cls(loader, accumulate, count, position)
