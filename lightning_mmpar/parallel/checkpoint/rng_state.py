"""Each rank's random number generator states in a checkpoint, and where a resume puts them back.

Megatron-LM saves, per rank, the states of Python's ``random``, NumPy, torch's CPU and
accelerator generators and its model-parallel tracker (``megatron/training/checkpointing.py``:
``get_rng_state``); so does this: :func:`capture_rng_state` (written into the rank's own file,
:mod:`.rank_state`) and :func:`apply_rng_state`. With them, the dropout masks of a resumed run,
drawn from the tracker's regions (:mod:`lightning_mmpar.parallel.random`) or from the default
generators, are the uninterrupted run's.

Where a resume applies them (:func:`resume_points`), so that the generators are where the
uninterrupted run had them at the first resumed batch:

* resumed at an epoch start or end (the checkpoint was written after the epoch's last batch):
  before the new epoch's loader iterator is created (Lightning's ``on_train_start``), so that
  iterator draws the same base seed for its workers (``DataLoader``'s ``_base_seed``) and the
  sampler the same shuffle as in the uninterrupted run;
* resumed mid-epoch: again right before the first resumed batch (``on_train_batch_start``): the
  resumed loader's iterator drew a base seed the uninterrupted run did not draw there (a
  torchdata ``StatefulDataLoader`` then restores the saved ``_base_seed``, so its workers get
  the uninterrupted run's seeds).

A checkpoint written in another layout restores no generator state (the tracker's streams are
per mesh coordinate): the masks after such a resume are new ones, said in a warning.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_mmpar.parallel.checkpoint.rank_state import layout_key, rank_file
from lightning_mmpar.parallel.random import get_rng_tracker

__all__ = [
    "RNG_KEY",
    "apply_rng_state",
    "capture_rng_state",
    "resume_points",
    "saved_rng_state",
]

RNG_KEY = "rng"
"""Key of the generator states in a rank's own file (:func:`~.rank_state.write_rank_state`)."""


def capture_rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """This process's generator states: ``python`` (``random.getstate()``), ``numpy``,
    ``torch`` (CPU ``ByteTensor``), ``accelerator`` (``device``'s default generator, only for a
    non-CPU ``device`` whose torch module exposes ``get_rng_state``) and ``tracker``
    (:meth:`~lightning_mmpar.parallel.random.RNGStatesTracker.state_dict`)."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": get_rng_tracker().state_dict(),
    }
    module = _accelerator_module(device)
    if module is not None:
        state["accelerator"] = (str(device), module.get_rng_state(device))
    return state


def apply_rng_state(state: dict[str, Any], device: torch.device | None = None) -> None:
    """Restore what :func:`capture_rng_state` returned (the accelerator's state only when it
    was saved for the same device type).

    Raises:
        ValueError: ``state`` lacks one of ``python``, ``numpy``, ``torch``, ``tracker``.
    """
    missing = sorted({"python", "numpy", "torch", "tracker"} - set(state))
    if missing:
        raise ValueError(
            f"RNG state lacks {missing}; pass what capture_rng_state() returned (a checkpoint's "
            f"ranks/rank_<r>.pt '{RNG_KEY}' entry)."
        )
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    get_rng_tracker().load_state_dict(state["tracker"])
    module = _accelerator_module(device)
    saved = state.get("accelerator")
    if module is not None and saved is not None and torch.device(saved[0]).type == device.type:  # type: ignore[union-attr]
        module.set_rng_state(saved[1], device)


def _accelerator_module(device: torch.device | None) -> Any:
    if device is None or device.type == "cpu":
        return None
    module = getattr(torch, device.type, None)
    return module if hasattr(module, "get_rng_state") else None


def resume_points(restarted_mid_epoch: bool) -> tuple[str, ...]:
    """The Lightning hooks at which a resume applies the saved states (module docstring):
    ``("on_train_start",)`` or, mid-epoch, ``("on_train_start", "on_train_batch_start")``."""
    return (
        ("on_train_start", "on_train_batch_start") if restarted_mid_epoch else ("on_train_start",)
    )


def saved_rng_state(path: Path, layout: dict[str, Any]) -> dict[str, Any] | None:
    """This rank's generator states in checkpoint ``path`` when it was written in ``layout``
    (:func:`~.rank_state.rank_layout`: same world size, tp, pp, ep, virtual stages); ``None``
    otherwise, or when the checkpoint holds none (written before they were saved)."""
    file = rank_file(path, int(layout["rank"]))
    if not file.exists():
        return None
    saved: dict[str, Any] = torch.load(file, weights_only=False)
    if layout_key(saved["layout"]) != layout_key(layout):
        return None
    return saved.get(RNG_KEY)
