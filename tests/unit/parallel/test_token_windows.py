"""WindowLoader: one accumulation window fetched and counted before its first batch, windows
on Lightning's step boundaries, and a resumable position (at a step and inside a window)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_mmpar.parallel.token_windows import WindowLoader, window_loader


class _Counted(list[int]):
    """A loader of ints (the batch is its own token count) that records each fetch."""

    def __init__(self, n: int) -> None:
        super().__init__(range(1, n + 1))
        self.fetched: list[int] = []

    def __iter__(self) -> Any:
        for x in super().__iter__():
            self.fetched.append(x)
            yield x


def _drain(loader: WindowLoader) -> list[tuple[int, int, bool, int]]:
    """Per batch: the batch, its window's tokens, first of its window, batches fetched."""
    out = []
    for batch in loader:
        tokens, first = loader.pop()
        out.append((batch, tokens, first, len(loader.loader.fetched)))
    return out


def test_windows_are_fetched_whole_and_counted_before_their_first_batch() -> None:
    inner = _Counted(7)
    loader = window_loader(inner, 3, lambda b: b, lambda: (0, 7))
    assert type(loader) is WindowLoader and len(loader) == 7
    got = _drain(loader)
    # windows [1 2 3] [4 5 6] [7]: the last one shorter; never a batch past the window
    assert [g[1] for g in got] == [6, 6, 6, 15, 15, 15, 7]
    assert [g[2] for g in got] == [True, False, False, True, False, False, True]
    assert [g[3] for g in got] == [3, 3, 3, 6, 6, 6, 7]
    # Lightning's limit_train_batches=5: the epoch ends after 5, the last window holds 2
    limited = window_loader(_Counted(7), 3, lambda b: b, lambda: (0, 5))
    assert [g[1] for g in _drain(limited)][3:5] == [9, 9]
    # resumed after 4 trained batches of the epoch: a window of 2 up to the step boundary
    resumed = window_loader(_Counted(3), 3, lambda b: b, lambda: (4, 7))
    assert [g[1] for g in _drain(resumed)] == [3, 3, 3]
    with pytest.raises(RuntimeError, match="without a batch"):
        loader.pop()
    with pytest.raises(ValueError, match="accumulate=0"):
        window_loader(inner, 0, lambda b: b, lambda: (0, 7))


def _stateful() -> StatefulDataLoader:
    return StatefulDataLoader(torch.arange(1, 9), batch_size=1)


def test_a_checkpoint_at_a_step_or_inside_a_window_resumes_at_the_next_batch() -> None:
    loader = window_loader(_stateful(), 2, lambda b: int(b.sum()), lambda: (0, 8))
    it = iter(loader)
    seen = [int(next(it)) for _ in range(4)]  # two windows: an optimizer step
    at_step = loader.state_dict()
    assert "accumulation_window" not in at_step  # the wrapped loader's own state
    seen.append(int(next(it)))  # inside the third window
    inside = loader.state_dict()
    assert inside["accumulation_window"]["yielded"] == 1
    rest = [int(b) for b in it]
    assert seen + rest == list(range(1, 9))
    for state, done, want in ((at_step, 4, [5, 6, 7, 8]), (inside, 5, [6, 7, 8])):
        again = window_loader(_stateful(), 2, lambda b: int(b.sum()), lambda d=done: (d, 8))
        again.load_state_dict(state)
        got = [(int(b), again.pop()) for b in again]
        assert [b for b, _ in got] == want
        assert got[0][1][0] == (6 if done == 5 else 11)  # the window's batches still to train


def test_attributes_pass_through_to_the_wrapped_loader() -> None:
    inner = _stateful()
    loader = window_loader(inner, 2, lambda b: 1, lambda: (0, 8))
    loader.worker_init_fn = print
    assert inner.worker_init_fn is print and loader.sampler is inner.sampler
