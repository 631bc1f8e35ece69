"""Test isolation for in-process Trainer runs.

A ``Trainer`` run inside the pytest process (the recipe CLI's ``fit`` in
``tests/recipes/test_cli_data.py``, the one-process callback tests) sets ``MASTER_ADDR`` /
``MASTER_PORT`` / ``WORLD_SIZE`` / ``RANK`` in ``os.environ`` and may leave a default process
group whose store listens on that port. A later test that launches the recipe as a subprocess
inherited the variables and failed with ``EADDRINUSE`` on the still-bound port. Each test gets
back the environment it started with, and a process group it left is destroyed.

The recipe CLI also sets torch's intra-op thread count for a CPU world (``cores // devices``);
left at 1, a later test's one-process reference reduced in another order than the usual 2
threads (a non-colocated parity case then missed its 1e-5 bar by 1.6%), so it is restored too.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _isolated_process_environment() -> Iterator[None]:
    before = dict(os.environ)
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for key in set(os.environ) - set(before):
        del os.environ[key]
    for key, value in before.items():
        if os.environ.get(key) != value:
            os.environ[key] = value
