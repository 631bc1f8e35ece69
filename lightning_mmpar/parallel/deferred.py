"""Deferred parameters: a module that fills its meta parameters only after they are sharded.

A LightningModule that defines ``load_sharded_parameters(device)`` (:data:`HOOK`) owns every
meta-device parameter and buffer it holds: the strategy neither materialises them (Lightning's
``to_empty`` + ``reset_parameters``) nor moves them, shards the model as usual (FSDP2's
``fully_shard`` turns a meta parameter into a meta ``DTensor`` sharded on ``dp``; a TP-sharded
one into a 2-D ``(dp, tp)`` one), then calls the hook (:func:`load_deferred`) before replicated
parameters are broadcast and the optimizer is built. The hook replaces each meta parameter with
a real one holding this rank's shard (``compute_local_shape_and_global_offset`` of its
placements), so a rank allocates and reads only its own FSDP shard of its TP slice. FSDP picks
up the new parameter when it is assigned with ``load_state_dict(..., assign=True)`` on the
module that registers it (:func:`assign`), FSDP2's own path for replacing sharded parameters.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["HOOK", "assign", "defers", "load_deferred", "move"]

HOOK = "load_sharded_parameters"
"""Name of the optional LightningModule method ``(device: torch.device) -> None``."""


def defers(module: Any) -> bool:
    """Whether ``module`` fills its own meta parameters after sharding (defines :data:`HOOK`)."""
    return callable(getattr(module, HOOK, None))


def move(module: nn.Module, device: torch.device) -> None:
    """``module.to(device)`` leaving meta tensors (deferred parameters) on the meta device
    (where ``.to()`` raises ``NotImplementedError``); a LightningModule's ``device`` follows."""
    if not any(t.is_meta for t in (*module.parameters(), *module.buffers())):
        module.to(device)
        return
    module._apply(lambda t: t if t.is_meta else t.to(device))
    if hasattr(module, "_device"):  # Lightning's DeviceDtypeModuleMixin, updated by .to()
        setattr(module, "_device", device)  # noqa: B010 - a plain attribute, not a tensor


def load_deferred(module: Any, device: torch.device) -> None:
    """Call ``module``'s :data:`HOOK` (when it has one) with ``device`` (where unsharded
    parameters belong).

    Raises:
        RuntimeError: parameters or buffers are still on the meta device afterwards.
    """
    if not defers(module):
        return
    getattr(module, HOOK)(device)
    meta = [n for n, t in (*module.named_parameters(), *module.named_buffers()) if t.is_meta]
    if meta:
        raise RuntimeError(
            f"{type(module).__name__}.{HOOK}() left tensors on the meta device: {meta[:8]}"
        )


def assign(spots: list[tuple[nn.Module, str]], new: nn.Parameter) -> None:
    """Register ``new`` as parameter ``name`` of each ``(module, name)`` in ``spots`` (every
    place that registered the meta parameter it replaces, shared ones included) through
    ``load_state_dict(assign=True)``, so an FSDP2 unit that manages the parameter there
    re-points its sharded storage to ``new`` (its post-load hook)."""
    names: dict[int, tuple[nn.Module, list[str]]] = {}
    for sub, name in spots:
        entry = names.setdefault(id(sub), (sub, []))
        if name not in entry[1]:
            entry[1].append(name)
    for sub, attrs in names.values():
        sub.load_state_dict(dict.fromkeys(attrs, new), strict=False, assign=True)
