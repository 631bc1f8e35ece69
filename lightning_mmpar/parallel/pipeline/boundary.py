"""Stage boundaries between pipeline ranks packed into one buffer per dtype.

torch's ``PipelineStage`` posts one point-to-point send and one receive per boundary tensor,
each way: a boundary of 5 float and 2 integer tensors (the fusion model's text hidden states,
image tokens, masks and positions) costs 7 forward and 5 gradient transfers per micro-batch,
and on gloo most of each transfer's time is host work (posting, matching, waiting). A
:class:`BoundaryLayout` carries the same tensors as one flat buffer per dtype (one float32 and
one int64 buffer there: 2 + 1 transfers), and :class:`PackedStage` packs its outputs and
unpacks its inputs around the stage's module, so torch's stage metadata, sends, receives and
gradients see only the buffers. Autograd runs through the packing: the received float buffer
is the stage input whose gradient goes back, split into each tensor's part by ``cat``'s
backward on the sending stage. Values, dtypes and gradients are unchanged (a copy, no cast:
bf16 and float32 tensors under autocast travel in two buffers).

Peers: Megatron-LM passes one ``[s, b, h]`` tensor between stages (its ``p2p_communication``
sends one tensor per direction; masks and positions are read from the data on every stage);
DeepSpeed's pipeline engine sends a boundary tuple's metadata once, then each tensor on its own.
Here any tuple of shapes and dtypes travels as one buffer per dtype, its layout fixed per
schedule (one per input signature, like torch's stage metadata).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed.pipelining import PipelineStage

__all__ = ["BoundaryLayout", "PackedStage"]


@dataclasses.dataclass(frozen=True)
class BoundaryLayout:
    """How one stage boundary's tensors travel: ``groups[k]`` are the indices (into the
    boundary tuple) of the tensors packed, flattened and in order, into wire buffer ``k`` (one
    per dtype, in order of first appearance); ``shapes[i]`` is tensor ``i``'s shape. A group of
    one tensor travels as that tensor (no copy)."""

    shapes: tuple[tuple[int, ...], ...]
    groups: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, tensors: Sequence[Any]) -> BoundaryLayout | None:
        """The layout of ``tensors`` (one boundary's tuple), or ``None`` when packing would
        merge nothing (every dtype appears once) or a tensor is no plain tensor (a DTensor:
        torch's stage keeps its placements)."""
        from torch.distributed.tensor import DTensor

        if any(not isinstance(t, Tensor) or isinstance(t, DTensor) for t in tensors):
            return None
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(tensors):
            by_dtype.setdefault(t.dtype, []).append(i)
        if len(by_dtype) == len(tensors):
            return None
        shapes = tuple(tuple(int(d) for d in t.shape) for t in tensors)
        return cls(shapes, tuple(tuple(g) for g in by_dtype.values()))

    def pack(self, tensors: Sequence[Tensor]) -> tuple[Tensor, ...]:
        """The wire buffers of ``tensors`` (``torch.cat`` of the flattened tensors per group;
        differentiable).

        Raises:
            ValueError: ``tensors`` do not match the layout (count or shapes).
        """
        self._check(tensors, "pack")
        return tuple(
            tensors[g[0]] if len(g) == 1 else torch.cat([tensors[i].reshape(-1) for i in g])
            for g in self.groups
        )

    def unpack(self, buffers: Sequence[Tensor]) -> tuple[Tensor, ...]:
        """The boundary's tensors from its wire buffers: views of the buffers, in the
        boundary's order (inverse of :meth:`pack`; differentiable).

        Raises:
            ValueError: not one buffer per group.
        """
        if len(buffers) != len(self.groups):
            raise ValueError(
                f"BoundaryLayout.unpack: {len(buffers)} buffers for {len(self.groups)} groups; "
                "both stages of a boundary must use the same layout (the sender's)."
            )
        out: list[Tensor | None] = [None] * len(self.shapes)
        for group, buffer in zip(self.groups, buffers, strict=True):
            if len(group) == 1:
                out[group[0]] = buffer
                continue
            sizes = [math.prod(self.shapes[i]) for i in group]
            for i, piece in zip(group, buffer.split(sizes), strict=True):
                out[i] = piece.view(self.shapes[i])
        return tuple(t for t in out if t is not None)

    def _check(self, tensors: Sequence[Tensor], what: str) -> None:
        # per micro-batch: compare torch.Size to the stored tuples (C), format only on a mismatch
        n = len(self.shapes)
        if len(tensors) == n and all(
            t.shape == s for t, s in zip(tensors, self.shapes, strict=True)
        ):
            return
        shapes = tuple(tuple(int(d) for d in t.shape) for t in tensors)
        if shapes != self.shapes:
            raise ValueError(
                f"BoundaryLayout.{what}: a stage boundary of shapes {shapes}, the schedule was "
                f"built for {self.shapes}; a stage must return the same shapes for every "
                "micro-batch of a step."
            )


class PackedStage(PipelineStage):
    """A ``torch.distributed.pipelining.PipelineStage`` whose boundaries with other ranks travel
    packed (:class:`BoundaryLayout`): ``inputs`` unpacks what it receives before its module
    runs, ``outputs`` packs what the module returns before it is sent; ``None`` leaves that
    side as torch has it (the first stage's inputs, the last stage's outputs, a boundary with a
    stage of the same rank: the V layout's in-memory turn). The stage's static metadata
    (``input_args``, ``output_args`` and their gradients) must be the packed buffers."""

    def __init__(
        self,
        *args: Any,
        inputs: BoundaryLayout | None = None,
        outputs: BoundaryLayout | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.input_layout = inputs
        self.output_layout = outputs

    def forward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
        if self.input_layout is not None:
            args = self.input_layout.unpack(args)
        out = super().forward_maybe_with_nosync(*args, **kwargs)
        if self.output_layout is not None:
            out = self.output_layout.pack(out if isinstance(out, tuple) else (out,))
        return out
