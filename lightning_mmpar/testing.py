"""Run a function in a real multi-process gloo world (tests and benchmarks).

Process start-up costs seconds on small machines, so callers run many checks in one world:
``spawn(fn, 8, ...)`` calls ``fn(rank, world_size, *args)`` in 8 fresh processes with the
default process group initialised, and returns every rank's return value.
:func:`quiet_trainer` is the CPU ``Trainer`` of such checks.

Ranks are forked from a ``forkserver`` that imported :data:`PRELOAD` once (torch, Lightning,
this package and its recipe CLI: about 14 CPU-seconds per fresh interpreter), instead of each
rank importing them again; a rank still starts in a fresh process with the caller's
environment, ``sys.path`` and working directory at the time of the call, and its own children
(DataLoader workers) start by the platform's default method, as under ``torchrun``.
``MMPAR_START_METHOD=spawn`` starts every rank as a fresh interpreter instead (the behaviour
before: slower, nothing shared with a server).
"""

from __future__ import annotations

import io
import multiprocessing
import os
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PRELOAD: tuple[str, ...] = (
    "lightning_mmpar",
    "lightning_mmpar.strategy",
    "lightning.pytorch",
    "lightning_mmpar.recipes.cli",
)
"""Modules the forkserver imports once, before it forks any rank (fork-safe: imports only). The
recipe CLI brings open_clip, timm and jsonargparse (about 1.2 CPU-seconds a rank, paid by every
rank of a recipe world when it is not preloaded)."""


def _context() -> Any:
    method = os.environ.get("MMPAR_START_METHOD", "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"MMPAR_START_METHOD={method!r}: use 'forkserver' or 'spawn'.")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(PRELOAD))  # no effect once the server runs
    return ctx


def free_port() -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    port: int,
    out: Any,
    args: tuple[Any, ...],
    env: dict[str, str],
) -> None:
    for key in set(os.environ) - set(env):  # the caller's environment now, not the server's
        del os.environ[key]
    # a rank's own children (DataLoader workers) start as under torchrun, by the platform's
    # default method: the forkserver's, inherited here, starts an interpreter per rank and
    # re-imports each worker (about 40x slower for a 2-worker loader)
    multiprocessing.set_start_method(None, force=True)
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        try:
            dist.init_process_group("gloo", rank=rank, world_size=world)
        except dist.DistNetworkError as err:
            if "EADDRINUSE" not in str(err):
                raise
            out.put((rank, None, str(err)))  # the port was taken meanwhile: spawn retries
            return
        result = fn(rank, world, *args)
        buf = io.BytesIO()  # plain bytes: shared-memory tensors die with this process
        torch.save(result, buf)
        out.put((rank, True, buf.getvalue()))
    except BaseException:
        out.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 900) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return their results.

    ``fn`` must be importable (module level). A failure on any rank raises ``RuntimeError``
    carrying that rank's traceback. When another process takes the rendezvous port between
    :func:`free_port` and the bind (before ``fn`` runs), the world is started again on a new
    port, up to three times.
    """
    for _ in range(2):
        try:
            return _spawn_once(fn, world_size, args, timeout)
        except _PortTaken:
            continue
    return _spawn_once(fn, world_size, args, timeout)


class _PortTaken(RuntimeError):
    pass


def _spawn_once(
    fn: Callable[..., Any], world_size: int, args: tuple[Any, ...], timeout: float
) -> list[Any]:
    ctx = _context()
    out = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, port, out, args, env), daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    port_taken = False
    try:
        while len(results) + len(errors) < world_size:
            try:
                rank, ok, value = out.get(timeout=timeout)
            except queue.Empty:
                errors.append(f"timed out after {timeout}s")  # join briefly, then kill
                raise RuntimeError(f"world of {world_size} timed out after {timeout}s") from None
            if ok is None:
                errors.append(f"rank {rank}: {value}")
                port_taken = True
                break
            if ok:
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors.append(f"rank {rank}:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()
    if port_taken:
        raise _PortTaken(errors[0])
    if errors:
        raise RuntimeError("a rank failed\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]


def quiet_trainer(**kwargs: Any) -> Any:
    """A CPU ``lightning.pytorch.Trainer`` for tests and benchmarks: no logger, progress bar,
    model summary, sanity validation or checkpointing unless ``kwargs`` say otherwise (any
    ``Trainer`` argument overrides these defaults)."""
    from lightning.pytorch import Trainer

    defaults: dict[str, Any] = {
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    return Trainer(**{**defaults, **kwargs})
