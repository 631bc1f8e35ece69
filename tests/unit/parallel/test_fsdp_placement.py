"""Which dim FSDP2 shards each parameter shape on (``parallel.data.shard_placement``), and that
0-dim parameters are kept out of FSDP. No process group needed; the dp-2 parity of every shape
against one process is ``tests/distributed/parallel/test_fsdp_shapes.py``."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard

from lightning_mmpar.parallel.data import shard_placement


@pytest.mark.parametrize(
    ("shape", "dp", "dim"),
    [
        ((3, 8, 8), 2, 1),  # fused q/k/v: 3 does not split over 2, D does (first on ties)
        ((3, 8), 2, 1),  # its bias
        ((3, 4, 8), 2, 2),  # the largest even dim
        ((3, 8, 8), 4, 1),
        ((8, 3), 2, 0),  # dim 0 even: torch's default, no interleave copies
        ((4, 64), 2, 0),  # dim 0 even wins over a larger dim 1
        ((1, 6), 2, 1),  # dim 0 smaller than dp
        ((1, 3), 2, 0),  # nothing even: padded Shard(0), rank 1 holds an empty shard
        ((1,), 2, 0),  # one element
        ((5,), 2, 0),
        ((6,), 3, 0),
        ((2, 9), 3, 1),
        ((7, 7), 1, 0),  # dp 1: everything divides
    ],
)
def test_placement(shape: tuple[int, ...], dp: int, dim: int) -> None:
    assert shard_placement(torch.nn.Parameter(torch.zeros(shape)), dp) == Shard(dim)


def test_even_dim_means_equal_shards() -> None:
    """The chosen dim splits into dp chunks of equal size whenever some dim can."""
    for shape in [(3, 8, 8), (1, 6), (5, 4, 3), (3, 2)]:
        d = shard_placement(torch.zeros(shape), 2).dim
        sizes = {c.numel() for c in torch.zeros(shape).chunk(2, dim=d)}
        assert sizes == {torch.zeros(shape).numel() // 2}, (shape, d)


def test_zero_dim_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"^param is 0-dim; .*ignored_params.*sync_gradients\.$"):
        shard_placement(torch.nn.Parameter(torch.tensor(1.0)), 2)


def test_dp_must_be_positive() -> None:
    with pytest.raises(
        ValueError,
        match=r"^dp \(0\) must be a positive integer; pass the data-parallel mesh size\.$",
    ):
        shard_placement(torch.zeros(4), 0)
