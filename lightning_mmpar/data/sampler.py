"""A shuffling sampler that a resumed run replays exactly (epoch and position in its state).

torchdata's ``StatefulDataLoader`` saves the state of a sampler implementing ``state_dict`` /
``load_state_dict``; Lightning (2.6) stores that in checkpoints. This sampler subclasses
``torch.utils.data.RandomSampler`` so that Lightning still swaps it for its own
``DistributedSampler`` under a distributed strategy (torchdata's own ``RandomSampler`` is not a
subclass: Lightning would wrap it in a ``DistributedSamplerWrapper`` whose shuffle depends on the
global RNG, which a resumed run does not share). The permutation of each epoch depends only on
``seed + epoch``, as in ``DistributedSampler``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import RandomSampler


class ResumableRandomSampler(RandomSampler):
    """Shuffle ``range(len(data_source))`` with ``torch.randperm`` seeded by ``seed + epoch``.

    ``set_epoch`` (called by Lightning at each epoch) selects the permutation; ``state_dict``
    holds the epoch and the number of indices yielded, and after ``load_state_dict`` the next
    iteration starts there (Lightning creates the iterator of a resumed epoch before it calls
    ``set_epoch``, so the epoch must travel in the state).

    Raises:
        ValueError: a negative ``seed``.
    """

    def __init__(self, data_source: Sized, *, seed: int = 0) -> None:
        if seed < 0:
            raise ValueError(f"seed ({seed}) must be >= 0.")
        super().__init__(data_source)
        self.seed, self.epoch, self.yielded = seed, 0, 0
        self._start = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the permutation of ``epoch``."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.data_source), generator=generator).tolist()
        start, self._start = self._start, 0
        self.yielded = start
        for index in order[start:]:
            self.yielded += 1
            yield index

    def __len__(self) -> int:
        return len(self.data_source)

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "yielded"}``: where the current iteration stands."""
        return {"epoch": self.epoch, "yielded": self.yielded}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The next iteration replays ``state_dict``'s epoch from its position."""
        self.epoch, self._start = int(state_dict["epoch"]), int(state_dict["yielded"])
