"""Per-block activation checkpointing and ``torch.compile``, applied before sharding.

Both replace a block's ``forward`` by a wrapper of the original, in place, so parameter names,
state-dict keys and checkpoints do not change (unlike ``checkpoint_wrapper``, which inserts a
``_checkpoint_wrapped_module`` level), and both compose with tensor-parallel plans (applied
before, by :func:`~lightning_mmpar.parallel.parallelize.parallelize`), pipeline stages and
``fully_shard`` (applied after: its hooks run around the wrapped ``forward``). A block both
compiled and checkpointed is checkpointed around its compiled ``forward`` (torch refuses a
custom ``context_fn``, which replays the model-parallel dropout streams, inside a compiled
region), so the recomputation runs the compiled graph again; for the same reason a module
checkpointed *inside* a compiled block (a plan's ``layers`` that are not blocks themselves) is
refused.

Activation checkpointing (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost";
Megatron's ``--recompute-granularity full``) keeps only a block's inputs from forward to
backward and recomputes the block in backward: ``torch.utils.checkpoint.checkpoint`` with
``use_reentrant=False``, whose recomputation replays the default generators, with
:func:`~lightning_mmpar.parallel.random.checkpoint_rng_contexts` replaying the model-parallel
dropout streams too, so results equal a run without checkpointing exactly (fp32: bit for bit).

Which blocks (:func:`select_blocks`): ``"all"``; ``"layers"``: the model's repeated layers as
its parallel plan names them (:attr:`~lightning_mmpar.parallel.parallelize.ParallelPlan.layers`:
the fusion model's ViT blocks, adapters and decoder layers, not its stem, pooler, bridge and
head; torchtitan's full checkpointing of every ``TransformerBlock``, Megatron's
``--recompute-granularity full``), every block for a model whose plan names none; an ``int``
``k``: every ``k``-th block, the ``k``-th, ``2k``-th, ... counted from 1 over the model's blocks
(torchtitan's selective layer checkpointing, ``ac_freq``); or block kinds (``"vision"``,
``"aligner"``, ``"language"``, ``"head"``: the ``kind`` of
:class:`~lightning_mmpar.layout.BlockSpec`, one or a list).

This is the package's one activation-checkpointing mechanism: the strategy's
``activation_checkpointing`` option, the plans' ``layers`` and the deprecated model-side option
(``model.plan.activation_checkpointing``, formerly ``model.tensor_parallel.``) all end here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_mmpar.parallel.random import checkpoint_rng_contexts

KINDS: tuple[str, ...] = ("vision", "aligner", "language", "head")
"""Block kinds that ``activation_checkpointing`` may name (``BlockSpec.kind``)."""

LAYERS = "layers"
"""The selection of a model's repeated layers (module docstring)."""

Checkpointing = str | int | Sequence[str] | None
"""``None`` (off), ``"all"``, ``"layers"``, every ``k``-th block (``int``), or kinds (a name or
a list)."""


def check_checkpointing(spec: Checkpointing) -> str | int | tuple[str, ...] | None:
    """``spec`` normalised (kinds as a tuple); raises ``ValueError`` naming the field, the value
    and the accepted forms when it is none of them."""
    if spec is None or spec in ("all", LAYERS):
        return spec
    if isinstance(spec, bool) or (isinstance(spec, int) and spec < 1):
        raise ValueError(
            f"activation_checkpointing ({spec!r}) as a number must be a positive integer k "
            "(every k-th block); use 1 or 'all' for every block, None for none."
        )
    if isinstance(spec, int):
        return spec
    kinds = (spec,) if isinstance(spec, str) else tuple(spec)
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(
            f"activation_checkpointing ({spec!r}): unknown block kind(s) {unknown}; use 'all', "
            f"'layers', a positive integer k (every k-th block) or kinds from {list(KINDS)}."
        )
    return kinds


def select_blocks(blocks: Sequence[nn.Module], spec: Checkpointing) -> list[int]:
    """Indices of the ``blocks`` that ``spec`` selects (module docstring; ``"layers"`` selects
    every one of ``blocks``: pass the plan's layers to select them).

    Raises ``ValueError`` when ``spec`` is invalid (:func:`check_checkpointing`) or names kinds
    that none of ``blocks`` has (a block's kind is its ``kind`` attribute)."""
    spec = check_checkpointing(spec)
    if spec is None:
        return []
    if spec in ("all", LAYERS):
        return list(range(len(blocks)))
    if isinstance(spec, int):
        return [i for i in range(len(blocks)) if (i + 1) % spec == 0]
    chosen = [i for i, b in enumerate(blocks) if getattr(b, "kind", None) in spec]
    if not chosen:
        have = sorted({str(getattr(b, "kind", None)) for b in blocks})
        raise ValueError(
            f"activation_checkpointing ({list(spec)}) matches no block: the model's block kinds "
            f"are {have}; name one of those, or use 'all' or a positive integer k."
        )
    return chosen


def check_backend(backend: bool | str | None) -> str | None:
    """The ``torch.compile`` backend for ``compile_blocks`` (``True``: ``"inductor"``;
    ``False``/``None``: off). Raises ``ValueError`` for a backend torch does not know."""
    if backend is None or backend is False:
        return None
    name = "inductor" if backend is True else backend
    known = torch._dynamo.list_backends(exclude_tags=())
    if not isinstance(name, str) or name not in known:
        raise ValueError(
            f"compile_blocks ({backend!r}) is not a torch.compile backend; use True "
            f"('inductor'), one of {sorted(known)}, or False."
        )
    return name


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(
            forward, *args, use_reentrant=False, context_fn=checkpoint_rng_contexts, **kwargs
        )

    return run


def apply_block_options(
    blocks: Sequence[nn.Module], checkpointing: Checkpointing = None, backend: str | None = None
) -> list[int]:
    """Checkpoint the selected ``blocks`` and ``torch.compile`` every block's ``forward`` with
    ``backend`` (``None``: no compilation), in place; once per block (a second call leaves a
    block alone). Returns the indices of the checkpointed blocks.

    Raises ``ValueError`` as :func:`select_blocks`."""
    chosen = set(select_blocks(blocks, checkpointing))
    wrap_blocks(blocks, chosen, backend)
    return sorted(chosen)


def wrap_blocks(blocks: Sequence[nn.Module], chosen: set[int], backend: str | None) -> None:
    """Checkpoint the ``blocks`` at the indices ``chosen`` and compile every block's
    ``forward`` with ``backend`` (``None``: none), in place, once per block."""
    for i, block in enumerate(blocks):
        if getattr(block, "_mmpar_block_options", False):
            continue
        if i not in chosen and backend is None:
            continue
        forward = block.forward
        if backend is not None:
            forward = torch.compile(forward, backend=backend)
        if i in chosen:  # outside the compiled region: the model-parallel RNG replay runs eagerly
            forward = _checkpointed(forward)
        block.forward = forward  # type: ignore[method-assign]
        block._mmpar_block_options = True  # type: ignore[assignment]


def model_blocks(module: nn.Module) -> list[nn.Module]:
    """A model's blocks in order: ``pipeline_blocks()`` when it has them, else every child of
    every ``nn.ModuleList`` (its transformer layers, as :func:`~.data.apply_fsdp` shards)."""
    blocks = getattr(module, "pipeline_blocks", None)
    if callable(blocks):
        return list(blocks())
    return [layer for m in module.modules() if isinstance(m, nn.ModuleList) for layer in m]


__all__ = [
    "KINDS",
    "LAYERS",
    "Checkpointing",
    "apply_block_options",
    "check_backend",
    "check_checkpointing",
    "model_blocks",
    "select_blocks",
    "wrap_blocks",
]
