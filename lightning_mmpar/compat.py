"""Every private or version-dependent torch / Lightning API the package touches, in one place."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def init_mesh(
    device_type: str,
    shape: tuple[int, ...],
    names: tuple[str, ...],
    flattened: dict[str, tuple[str, ...]],
) -> DeviceMesh:
    """Build a named mesh and register flattened dimensions (``DeviceMesh._flatten``)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    for flat_name, dims in flattened.items():
        mesh[dims]._flatten(flat_name)
    return mesh


def own_communicator(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """A 1-D mesh over the same ranks as ``mesh``, with its own communicator, derived from the
    same root mesh (``DeviceMesh._unflatten``), so FSDP2 can combine it with the dp mesh."""
    return mesh._unflatten(0, (mesh.size(),), (name,))


def checkpoint_module(module: Any, context_fn: Any = None) -> None:
    """Activation checkpointing of one module in place (torch's private composable
    ``checkpoint``: forward hooks, so the module tree and parameter names stay as they are).
    ``context_fn`` (torch's checkpoint argument) returns the forward's and the recomputation's
    context managers: e.g. the RNG tracker's replay, so dropout masks match."""
    from torch.distributed._composable import checkpoint

    if context_fn is None:
        checkpoint(module)
    else:
        checkpoint(module, context_fn=context_fn)


def deepspeed_broadcast_zero_dim() -> None:
    """Let DeepSpeed's engine broadcast 0-dim parameters (CLIP's logit scale, say).

    DeepSpeed (0.19) broadcasts every parameter as ``p.data.view(torch.uint8)``, which raises
    for 0-dim tensors. While ``_broadcast_model`` runs, such parameters hold a 1-element view of
    their own storage; the broadcast values land in that storage, then the 0-dim tensor is put
    back. Idempotent.
    """
    from deepspeed.runtime.engine import DeepSpeedEngine

    original = DeepSpeedEngine._broadcast_model
    if getattr(original, "_zero_dim_safe", False):
        return

    def _broadcast_model(self: DeepSpeedEngine) -> None:
        zero_dim = [p for p in self.module.parameters() if p.dim() == 0]
        kept = [p.data for p in zero_dim]
        for p in zero_dim:
            p.data = p.data.reshape(1)
        try:
            original(self)
        finally:
            for p, data in zip(zero_dim, kept, strict=True):
                p.data = data

    _broadcast_model._zero_dim_safe = True  # type: ignore[attr-defined]
    DeepSpeedEngine._broadcast_model = _broadcast_model  # type: ignore[method-assign]
