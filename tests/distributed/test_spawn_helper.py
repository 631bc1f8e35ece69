"""``lightning_mmpar.testing.spawn`` survives a rendezvous port taken by another process."""

from __future__ import annotations

import socket
from typing import Any

import pytest
import torch.distributed as dist

from lightning_mmpar import testing

pytestmark = pytest.mark.distributed


def world_info(rank: int, world: int) -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def test_spawn_retries_on_a_taken_port(monkeypatch: pytest.MonkeyPatch) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    real = testing.free_port

    def first_taken() -> int:
        return next(ports, None) or real()

    monkeypatch.setattr(testing, "free_port", first_taken)
    calls: list[Any] = []
    original = testing._spawn_once

    def counted(*args: Any) -> Any:
        calls.append(args)
        return original(*args)

    monkeypatch.setattr(testing, "_spawn_once", counted)
    try:
        assert testing.spawn(world_info, 2) == [(0, 2), (1, 2)]
    finally:
        taken.close()
    assert len(calls) == 2  # the first world found its port taken and was started again
