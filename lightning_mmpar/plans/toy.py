"""The toy transformer's parallel plan (:mod:`lightning_mmpar.examples.toy_transformer`).

Per block, Megatron's attention and MLP pattern: q/k/v column parallel by heads, the output
projection row parallel; the MLP ``Y = GeLU(X A) B`` with ``A`` split by columns and ``B`` by rows,
so each block costs one all-reduce forward (two with attention) and the activations between the
two halves stay sharded. Embedding and head stay replicated. Layers (what the strategy's
``activation_checkpointing="layers"`` recomputes): the blocks. Pipeline blocks and FSDP units:
the model's ``pipeline_blocks()``.

The plan reads the model by attribute names only (``layers.N.q`` ...), so this module does not
import the example.
"""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from lightning_mmpar.parallel.activation import LAYERS
from lightning_mmpar.parallel.parallelize import (
    ParallelPlan,
    apply_model_parallel,
    checkpoint_and_compile,
)
from lightning_mmpar.parallel.tensor import StyleGroup
from lightning_mmpar.topology import ParallelDims

__all__ = ["block_plan", "parallelize_toy", "toy_plan"]


def block_plan() -> dict[str, ParallelStyle]:
    """Styles for one toy block, in ``parallelize_module`` form."""
    return {
        "q": ColwiseParallel(),
        "k": ColwiseParallel(),
        "v": ColwiseParallel(),
        "o": RowwiseParallel(),
        "up": ColwiseParallel(),
        "down": RowwiseParallel(),
    }


def toy_plan(
    model: Any, *, activation_checkpointing: bool = False, dims: ParallelDims | None = None
) -> ParallelPlan:
    """The plan of a model with ``layers`` (toy blocks) and ``pipeline_blocks()``; its
    ``layers`` (what ``activation_checkpointing="layers"`` recomputes) are the blocks. With
    ``dims``: the number of heads checked against ``dims.tp`` first. ``activation_checkpointing``
    is deprecated (the strategy's ``activation_checkpointing="layers"``).

    Raises ``ValueError`` when the number of heads does not divide by ``dims.tp``.
    """
    if activation_checkpointing:
        warnings.warn(
            "toy_plan(activation_checkpointing=True) is deprecated: use the strategy's "
            "activation_checkpointing='layers'.",
            DeprecationWarning,
            stacklevel=2,
        )
    if dims is not None:
        heads = int(model.cfg.heads)
        if heads % dims.tp:
            raise ValueError(
                f"ToyConfig.heads ({heads}) must be divisible by tensor_parallel ({dims.tp})."
            )
    layers: nn.ModuleList = model.layers
    paths = tuple(f"layers.{i}" for i in range(len(layers)))
    return ParallelPlan(
        tensor_parallel=tuple(StyleGroup(p, "tp", block_plan()) for p in paths),
        layers=paths,
        checkpointing=LAYERS if activation_checkpointing else None,
        pipeline_blocks=getattr(model, "pipeline_blocks", None),
    )


def parallelize_toy(
    model: nn.Module, dims: ParallelDims, *, activation_checkpointing: bool = False
) -> nn.Module:
    """Apply :func:`toy_plan`'s model-parallel part for ``dims`` in place (TP only when
    ``dims.tp > 1``; for code that parallelizes the model itself: under ``mm_parallel`` the
    toy's ``parallel_plan(dims)`` hands the plan to the strategy); returns it.

    Raises ``ValueError`` when the number of heads does not divide by ``dims.tp``.
    """
    plan = toy_plan(model, activation_checkpointing=activation_checkpointing, dims=dims)
    apply_model_parallel(model, dims, plan)
    checkpoint_and_compile(model, plan)
    return model
