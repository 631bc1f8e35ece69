"""The toy transformer's parallel plan (:mod:`lightning_mmpar.examples.toy_transformer`).

Per block, Megatron's attention and MLP pattern: q/k/v column parallel by heads, the output
projection row parallel; the MLP ``Y = GeLU(X A) B`` with ``A`` split by columns and ``B`` by rows,
so each block costs one all-reduce forward (two with attention) and the activations between the
two halves stay sharded. Embedding and head stay replicated. Activation-checkpoint units: the
blocks. Pipeline blocks and FSDP units: the model's ``pipeline_blocks()``.

The plan reads the model by attribute names only (``layers.N.q`` ...), so this module does not
import the example.
"""

from __future__ import annotations

from typing import Any, cast

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from lightning_mmpar.parallel.tensor import StyleGroup
from lightning_mmpar.plans.plan import ParallelPlan, apply_plan, plan_meshes
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


def toy_plan(model: Any, *, activation_checkpointing: bool = False) -> ParallelPlan:
    """The plan of a model with ``layers`` (toy blocks) and ``pipeline_blocks()``."""
    layers: nn.ModuleList = model.layers
    paths = tuple(f"layers.{i}" for i in range(len(layers)))
    return ParallelPlan(
        tensor_parallel=tuple(StyleGroup(p, "tp", block_plan()) for p in paths),
        activation_checkpointing=paths if activation_checkpointing else (),
        pipeline_blocks=getattr(model, "pipeline_blocks", None),
    )


def parallelize_toy(
    model: nn.Module, dims: ParallelDims, *, activation_checkpointing: bool = False
) -> nn.Module:
    """Apply :func:`toy_plan` for ``dims`` in place (TP only when ``dims.tp > 1``); returns it.

    Raises ``ValueError`` when the number of heads does not divide by ``dims.tp``.
    """
    heads = int(cast(Any, model).cfg.heads)
    if heads % dims.tp:
        raise ValueError(
            f"ToyConfig.heads ({heads}) must be divisible by tensor_parallel ({dims.tp})."
        )
    plan = toy_plan(model, activation_checkpointing=activation_checkpointing)
    return apply_plan(model, plan, plan_meshes(dims))
