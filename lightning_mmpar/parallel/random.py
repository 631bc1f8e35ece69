"""Model-parallel random number generation: dropout masks that follow the activation's layout.

Megatron-LM's tracker (``megatron/core/tensor_parallel/random.py``: ``CudaRNGStatesTracker``,
``model_parallel_cuda_manual_seed``), on CPU and CUDA: named generator states, and
:meth:`RNGStatesTracker.fork`, which swaps one of them into the default generator of a device
and back out, so random ops in the forked region draw from their own stream and the default
stream (weight init, data order, anything outside a region) is left exactly where it was.

Two regions, seeded from a base seed ``s`` and this rank's coordinates in
:class:`~lightning_mmpar.topology.ParallelDims` (``pp``, ``dp``, ``tp`` ranks of sizes ``PP``,
``DP``, ``TP``; ``R = PP * DP``, ``i = pp * DP + dp``)::

    "replicated"      (TP-replicated activations)   s + 2718 + i               (mod 2**64)
    "tensor-parallel" (TP-sharded activations)      s + 2718 + R + i * TP + tp (mod 2**64)

so a replicated activation gets the same mask on every TP peer (they hold the same values and
must stay equal) but an independent one on every dp replica and pipeline stage, and a sharded
activation (e.g. the sequence-parallel residual stream) gets an independent mask on every rank.
Megatron draws replicated dropout from the default stream, equal across dp unless
``--data-parallel-random-init``; here dp replicas always differ. ``2718`` is Megatron's offset.

The base seed is an explicit one (:func:`model_parallel_manual_seed`) or else
``torch.initial_seed()`` (``lightning.seed_everything`` sets it equal on all ranks), read when a
plan installs :class:`ParallelDropout` (:func:`seed_regions`) and at first use; a later
``torch.manual_seed`` with another value reseeds the regions at their next use. In both cases the
tensor-parallel group adopts its rank 0's base seed (one object all-gather per seeding, through
:mod:`lightning_mmpar.parallel.comm`), so TP peers agree even when the ranks were seeded
differently.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_mmpar.parallel import comm
from lightning_mmpar.topology import ParallelDims

__all__ = [
    "REGIONS",
    "ParallelDropout",
    "RNGStatesTracker",
    "checkpoint_rng_contexts",
    "get_rng_tracker",
    "model_parallel_manual_seed",
    "region_seeds",
    "seed_regions",
]

REPLICATED = "replicated"
TENSOR_PARALLEL = "tensor-parallel"
REGIONS: tuple[str, ...] = (REPLICATED, TENSOR_PARALLEL)
"""The regions :func:`model_parallel_manual_seed` adds (see the module docstring)."""
OFFSET = 2718
"""Megatron's offset between the default seed and the model-parallel seeds."""
_SEED_END = 2**64


def _check_seed(seed: Any, field: str = "seed") -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < _SEED_END:
        raise ValueError(
            f"{field} ({seed!r}) must be an integer in [0, 2**64); pass the run's seed, e.g. "
            "the value given to lightning.seed_everything."
        )
    return seed


def _default_generator(device: torch.device) -> torch.Generator:
    """The default generator of ``device`` (the one ``torch.rand(..., device=device)`` uses)."""
    if device.type == "cpu":
        return torch.default_generator
    module = getattr(torch, device.type, None)
    generators = getattr(module, "default_generators", None)
    if not generators:
        raise ValueError(
            f"device ({device}) has no default generators torch exposes; run the forked region "
            "on CPU or CUDA tensors."
        )
    index = device.index if device.index is not None else module.current_device()  # type: ignore[union-attr]
    return generators[index]  # type: ignore[no-any-return]


def _device_key(device: torch.device | str | None) -> torch.device:
    device = torch.device("cpu" if device is None else device)
    if device.type != "cpu" and device.index is None:
        module = getattr(torch, device.type, None)
        if module is not None and hasattr(module, "current_device"):
            device = torch.device(device.type, module.current_device())
    return device


class RNGStatesTracker:
    """Named generator states, forked into a device's default generator (Megatron's
    ``CudaRNGStatesTracker``, for any device with default generators: CPU, CUDA).

    A region's state on a device starts from the region's seed the first time it is forked
    there and advances with every draw made inside :meth:`fork`. Errors: ``ValueError`` for a bad
    seed, a name or seed added twice, or an unknown name; ``RuntimeError`` for a nested fork of
    a region already forked on that device (it would replay the same numbers).
    """

    def __init__(self) -> None:
        self._seeds: dict[str, int] = {}
        self._states: dict[str, dict[str, Tensor]] = {}
        self._active: set[tuple[str, str]] = set()
        self.seeded_from: tuple[Any, ...] | None = None
        """What :func:`model_parallel_manual_seed` seeded the regions from: ``("explicit",
        seed)``, ``("initial_seed", torch.initial_seed(), coordinates)``, or ``None``."""
        self._agreed: dict[tuple[Any, ...], int] = {}

    @property
    def seeds(self) -> dict[str, int]:
        """Seed of every region, by name (a copy)."""
        return dict(self._seeds)

    def reset(self) -> None:
        """Forget every region (Megatron's ``reset``)."""
        self._seeds.clear()
        self._states.clear()
        self.seeded_from = None
        self._agreed.clear()

    def add(self, name: str, seed: int) -> None:
        """Add region ``name`` whose streams start from ``seed`` (in ``[0, 2**64)``)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"name ({name!r}) must be a non-empty string.")
        _check_seed(seed)
        if name in self._seeds:
            raise ValueError(f"RNG region {name!r} is already added; call reset() first.")
        for other, used in self._seeds.items():
            if used == seed:
                raise ValueError(
                    f"seed ({seed}) is already the seed of RNG region {other!r}; give {name!r} "
                    "another seed (equal seeds give equal masks)."
                )
        self._seeds[name] = seed

    @contextlib.contextmanager
    def fork(self, name: str, device: torch.device | str | None = None) -> Iterator[None]:
        """Draw from region ``name``'s stream on ``device`` (default CPU) inside the block.

        Swaps the region's state into ``device``'s default generator, and on exit stores the
        advanced state and puts the default generator's own state back (even on error).
        """
        if name not in self._seeds:
            raise ValueError(
                f"RNG region {name!r} is not in the tracker (regions: {sorted(self._seeds)}); "
                "add it with add(name, seed) or call model_parallel_manual_seed(seed, dims)."
            )
        dev = _device_key(device)
        key = (name, str(dev))
        if key in self._active:
            raise RuntimeError(f"RNG region {name!r} is already forked on {dev}.")
        generator = _default_generator(dev)
        states = self._states.setdefault(name, {})
        if str(dev) not in states:
            fresh = torch.Generator(device=dev).manual_seed(self._seeds[name])
            states[str(dev)] = fresh.get_state()
        original = generator.get_state()
        generator.set_state(states[str(dev)])
        self._active.add(key)
        try:
            yield
        finally:
            self._active.discard(key)
            states[str(dev)] = generator.get_state()
            generator.set_state(original)

    def state_dict(self) -> dict[str, Any]:
        """Seeds, per-device states (copies) and provenance: Megatron's ``get_states``."""
        return {
            "seeds": dict(self._seeds),
            "states": {n: {d: s.clone() for d, s in v.items()} for n, v in self._states.items()},
            "seeded_from": self.seeded_from,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (Megatron's ``set_states``).

        Raises ``ValueError`` when ``state`` lacks ``seeds``, ``states`` or ``seeded_from``.
        """
        missing = {"seeds", "states", "seeded_from"} - set(state)
        if missing:
            raise ValueError(
                f"state lacks {sorted(missing)}; pass what RNGStatesTracker.state_dict() returned."
            )
        self._seeds = dict(state["seeds"])
        self._states = {n: {d: s.clone() for d, s in v.items()} for n, v in state["states"].items()}
        self.seeded_from = state["seeded_from"]


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process's tracker (Megatron's ``get_cuda_rng_tracker``), used by
    :class:`ParallelDropout` unless it is given another."""
    return _TRACKER


def _coords(dims: ParallelDims) -> tuple[int, ...]:
    """``(pp, dp, tp, PP, DP, TP)``: this rank's coordinates and the sizes."""
    return (*(dims.local_rank(d) for d in ("pp", "dp", "tp")), dims.pp, dims.dp, dims.tp)


def region_seeds(seed: int, dims: ParallelDims, rank: int | None = None) -> dict[str, int]:
    """The seed of each region on global ``rank`` (default: this process) for base ``seed``.

    Pure (no process group needed with ``rank`` given). Raises ``ValueError`` for a seed outside
    ``[0, 2**64)`` or a rank outside ``[0, dims.world_size)``.
    """
    _check_seed(seed)
    if rank is None:
        pp, dp, tp = _coords(dims)[:3]
    else:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < dims.world_size:
            raise ValueError(f"rank ({rank!r}) must be in [0, world_size {dims.world_size}).")
        coords = dims.rank_coords(rank)
        pp, dp, tp = coords["pp"], coords["dp"], coords["tp"]
    replica = pp * dims.dp + dp
    return {
        REPLICATED: (seed + OFFSET + replica) % _SEED_END,
        TENSOR_PARALLEL: (seed + OFFSET + dims.pp * dims.dp + replica * dims.tp + tp) % _SEED_END,
    }


def _tp_agreed(seed: int, dims: ParallelDims) -> int:
    """Tensor-parallel rank 0's ``seed`` (an object all-gather over the tp group)."""
    if dims.tp == 1 or not comm.is_distributed():
        return seed
    return int(comm.all_gather_objects(seed, dims.get_group("tp"))[0])


def model_parallel_manual_seed(
    seed: int | None, dims: ParallelDims, *, tracker: RNGStatesTracker | None = None
) -> RNGStatesTracker:
    """Reset ``tracker`` (default: :func:`get_rng_tracker`) and add the :data:`REGIONS` seeded
    by :func:`region_seeds` (Megatron's ``model_parallel_cuda_manual_seed``); returns it.

    ``seed=None`` seeds from ``torch.initial_seed()`` (what :class:`ParallelDropout` does at
    first use). Collective over the tensor-parallel group when ``dims.tp > 1``: every TP peer
    calls it. Raises ``ValueError`` for a seed outside ``[0, 2**64)``. The default generator is
    left untouched (Megatron also reseeds it; here that stays the caller's ``seed_everything``).
    """
    tracker = get_rng_tracker() if tracker is None else tracker
    base = torch.initial_seed() if seed is None else _check_seed(seed)
    origin = ("explicit", base) if seed is not None else ("initial_seed", base, _coords(dims))
    key = (*origin, dims.placement)  # the tp peers of a coordinate change with the placement
    agreed = tracker._agreed.get(key)  # so every peer gathers, or none does
    if agreed is None:
        agreed = _tp_agreed(base, dims)
    tracker.reset()
    tracker._agreed[key] = agreed
    for name, region_seed in region_seeds(agreed, dims).items():
        tracker.add(name, region_seed)
    tracker.seeded_from = origin
    return tracker


def seed_regions(dims: ParallelDims, *, tracker: RNGStatesTracker | None = None) -> None:
    """(Re)seed the regions from ``torch.initial_seed()`` unless they were seeded explicitly
    (the plans call it when they install :class:`ParallelDropout`, so each new parallelized
    model starts its regions afresh). Collective over the tensor-parallel group."""
    tracker = get_rng_tracker() if tracker is None else tracker
    if tracker.seeded_from is None or tracker.seeded_from[0] != "explicit":
        model_parallel_manual_seed(None, dims, tracker=tracker)


def _ensure_seeded(tracker: RNGStatesTracker, dims: ParallelDims) -> None:
    origin = tracker.seeded_from
    if origin is not None and origin[0] == "explicit":
        return
    if origin != ("initial_seed", torch.initial_seed(), _coords(dims)):
        model_parallel_manual_seed(None, dims, tracker=tracker)


class _Shared:
    """Holds process state (the layout and its groups) that copies of a module share."""

    def __init__(self, dims: ParallelDims) -> None:
        self.dims = dims

    def __deepcopy__(self, memo: dict[int, Any]) -> _Shared:
        return self


class ParallelDropout(nn.Dropout):
    """``nn.Dropout`` whose mask is drawn in one tracker region (``"replicated"`` or
    ``"tensor-parallel"``), on the device of its input.

    Input and output: any shape (a plain tensor, e.g. a ``[B, T, D]`` activation or its
    ``[B, T / tp, D]`` sequence shard). ``p``, ``inplace`` and train/eval behave as in
    ``nn.Dropout``; in eval mode or with ``p == 0`` nothing is drawn. Seeds the tracker at first
    use (:func:`model_parallel_manual_seed` with ``seed=None``) unless it was seeded explicitly.
    Raises ``ValueError`` for an unknown region, ``TypeError`` for a DTensor input (DTensor's
    own RNG would decide the mask: pass the local tensor).
    """

    def __init__(
        self,
        p: float = 0.5,
        inplace: bool = False,
        *,
        region: str,
        dims: ParallelDims | None = None,
        tracker: RNGStatesTracker | None = None,
    ) -> None:
        super().__init__(p, inplace)
        if region not in REGIONS:
            raise ValueError(f"region ({region!r}) must be one of {REGIONS}.")
        self.region = region
        self._layout = _Shared(ParallelDims(world_size=1) if dims is None else dims)
        self._tracker = tracker

    @classmethod
    def from_dropout(
        cls, dropout: nn.Dropout, *, region: str, dims: ParallelDims | None = None
    ) -> ParallelDropout:
        """The parallel-aware replacement of ``dropout`` (same ``p``, ``inplace``, mode)."""
        out = cls(dropout.p, dropout.inplace, region=region, dims=dims)
        return out.train(dropout.training)

    def forward(self, input: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return input
        if type(input).__name__ == "DTensor":
            raise TypeError(
                "ParallelDropout takes plain tensors; give the layer's local tensor "
                "(use_local_output=True in its parallel style)."
            )
        tracker = get_rng_tracker() if self._tracker is None else self._tracker
        _ensure_seeded(tracker, self._layout.dims)
        with tracker.fork(self.region, input.device):
            return F.dropout(input, self.p, True, self.inplace)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, region={self.region}"


def checkpoint_rng_contexts(
    tracker: RNGStatesTracker | None = None,
) -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
    """``context_fn`` for activation checkpointing (``torch.utils.checkpoint`` with
    ``use_reentrant=False``, or the composable ``checkpoint``): the recomputation draws the
    forward's masks.

    Called as the checkpointed forward starts, it snapshots the tracker; the second context
    (around the recomputation in backward) loads that snapshot and afterwards puts the
    tracker's current state back, as Megatron's ``CheckpointFunction`` does with
    ``get_states``/``set_states``. torch itself only replays the default generators.
    """
    tracker = get_rng_tracker() if tracker is None else tracker
    snapshot = tracker.state_dict()

    @contextlib.contextmanager
    def recompute() -> Iterator[None]:
        current = tracker.state_dict()
        tracker.load_state_dict(snapshot)
        try:
            yield
        finally:
            tracker.load_state_dict(current)

    return nullcontext(), recompute()
