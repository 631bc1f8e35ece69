"""A model's parallel plan as data, applied to a bare model.

:class:`ParallelPlan` and the one parallelize path live in the mechanisms layer
(:mod:`lightning_mmpar.parallel.parallelize`: the strategy applies a LightningModule's plan
there, TP -> EP -> activation checkpointing / compile -> pipeline split -> FSDP2); they are
re-exported here with the model families' plans. A plan says, for one built model:

* ``tensor_parallel``: :class:`~lightning_mmpar.parallel.tensor.StyleGroup` s, DTensor styles per
  submodule on a named 1-D mesh (``tp``, or ``vl`` for the vision-language group);
* ``dropout_regions``: which ``nn.Dropout`` submodules become
  :class:`~lightning_mmpar.parallel.random.ParallelDropout` and in which RNG region
  (``replicated`` for TP-replicated activations, ``tensor-parallel`` for TP-sharded ones), so
  masks follow the activation's layout (Megatron's model-parallel RNG);
* ``expert_parallel``: the mixture-of-experts layers whose experts are sharded over the ``ep``
  mesh with all-to-all dispatch (:func:`~lightning_mmpar.parallel.experts.apply_expert_parallel`;
  experts are replicated over ``tp``);
* ``after_model_parallel``: the model's own steps after TP and EP (hooks that are not styles);
* ``layers``: the model's repeated layers, what the strategy's
  ``activation_checkpointing="layers"`` recomputes (:mod:`lightning_mmpar.parallel.activation`,
  the package's one checkpointing mechanism);
* ``pipeline_blocks``: the model's ordered blocks. They are also the FSDP units: the strategy
  cuts the blocks into pipeline stages and then applies FSDP2 ``fully_shard`` once per block of
  this rank's stages (:func:`lightning_mmpar.parallel.data.shard_blocks`), plus once on the root
  for what remains.

:func:`apply_plan` applies the model-parallel part of a plan to a bare model on given meshes
(tensor parallelism -> expert parallelism -> the plan's steps -> its own checkpointing choice),
for code that parallelizes a model itself (tests, benchmarks, a module's ``configure_model``
under another strategy).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_mmpar.parallel import activation
from lightning_mmpar.parallel.parallelize import (
    ParallelPlan,
    apply_model_parallel,
    checkpoint_and_compile,
    install_parallel_dropout,
    plan_meshes,
    tp_meshes,
)
from lightning_mmpar.topology import ParallelDims

__all__ = [
    "ParallelPlan",
    "apply_plan",
    "checkpoint_activations",
    "install_parallel_dropout",
    "plan_meshes",
    "tp_meshes",
]


def checkpoint_activations(root: nn.Module, paths: Sequence[str]) -> nn.Module:
    """Recompute each listed submodule's forward in backward instead of storing its activations.

    The package's one mechanism (:mod:`lightning_mmpar.parallel.activation`): non-reentrant
    ``torch.utils.checkpoint`` around the submodule's ``forward``, in place (module tree and
    parameter names unchanged), replaying the default generators and the model-parallel RNG
    tracker's regions, so dropout masks match. Once per module (a second call leaves it alone).
    Returns ``root``. Raises ``AttributeError`` for a path that does not exist.
    """
    units = [root.get_submodule(path) for path in paths]
    activation.wrap_blocks(units, set(range(len(units))), None)
    return root


def apply_plan(
    module: nn.Module,
    plan: ParallelPlan,
    meshes: Mapping[str, DeviceMesh],
    dims: ParallelDims | None = None,
) -> nn.Module:
    """Apply ``plan``'s model-parallel part to ``module`` in place: parallel dropout (when
    ``dims`` spans more than one process), TP styles on ``meshes`` (none given: no TP), expert
    parallelism on ``dims.get_mesh("ep")`` (when ``dims.ep > 1``), the plan's own steps (when
    ``dims`` is given), then the plan's own checkpointing choice (``plan.checkpointing``). The
    pipeline split and FSDP are the strategy's (:func:`~lightning_mmpar.parallel.parallelize.
    parallelize`). Returns ``module``."""
    if dims is None:
        dims = ParallelDims(world_size=1)
        plan = _without_steps(plan)
    apply_model_parallel(module, dims, plan, meshes)
    checkpoint_and_compile(module, plan)
    return module


def _without_steps(plan: ParallelPlan) -> ParallelPlan:
    """``plan`` without its dims-dependent steps (no layout to run them for)."""
    return replace(plan, after_model_parallel=())
