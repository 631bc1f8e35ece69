"""Set-up refusals of the ``mm_parallel`` strategy: checked before any process starts where the
module allows it, and said once (by rank 0) where every rank finds them.

* :func:`check_module_before_launch`: what the LightningModule's class already tells before
  Lightning launches the processes (or, under ``torchrun`` / SLURM, before the process group
  exists): ``pipeline_parallel > 1`` needs the ``PipelineModule`` methods, and
  ``tensor_parallel`` / ``expert_parallel > 1`` need a module that can apply a plan (a
  ``parallel_plan`` method or its own ``configure_model``).
* :func:`refuse_once`: a refusal every rank reaches alike (a layout error under ``torchrun``,
  a degree the plan left without effect, :class:`~lightning_mmpar.parallel.parallelize.
  UnappliedDegreeError`) is raised on global rank 0 and stops the other ranks quietly, so the
  console shows one message instead of one traceback per rank (Lightning's
  ``rank_zero_only`` idea, applied to errors).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

from lightning.pytorch import LightningModule
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from typing_extensions import override

from lightning_mmpar.config import ParallelConfig
from lightning_mmpar.parallel.parallelize import (
    PLAN_HOOK,
    UnappliedDegreeError,
    check_pipeline_module,
    unapplied_tp_message,
)

__all__ = ["CheckedLauncher", "check_module_before_launch", "refuse_once"]


def refuse_once(error: BaseException, rank: int) -> NoReturn:
    """Raise ``error`` on global rank 0; on any other ``rank`` exit quietly with status 0
    (``SystemExit(0)``: no traceback, and Lightning's process observer does not kill rank 0
    before it prints). Every rank must reach the same refusal: the job's status is rank 0's."""
    if rank == 0:
        raise error
    raise SystemExit(0) from None


def _builds_own_model(module: Any) -> bool:
    """Whether ``module`` can shard itself: it defines ``parallel_plan`` or overrides
    Lightning's ``configure_model`` (where a module may apply ``parallelize_module``)."""
    if callable(getattr(module, PLAN_HOOK, None)):
        return True
    base = getattr(LightningModule, "configure_model", None)
    return getattr(type(module), "configure_model", base) is not base


def check_module_before_launch(module: Any, config: ParallelConfig) -> None:
    """Refuse a layout ``module``'s class cannot act on, before any process starts.

    Raises:
        TypeError: ``pipeline_parallel > 1`` and ``module`` lacks ``pipeline_blocks``,
            ``pipeline_inputs`` or ``pipeline_loss``.
        UnappliedDegreeError: ``tensor_parallel > 1`` or ``expert_parallel > 1`` for a module
            with neither a ``parallel_plan`` method nor its own ``configure_model``: nothing
            could shard its parameters. (A module that has one is checked after its plan ran,
            :func:`~lightning_mmpar.parallel.parallelize.check_degrees_applied`.)
    """
    check_pipeline_module(module, config)
    if _builds_own_model(module):
        return
    name = type(module).__name__
    if config.tensor_parallel > 1:
        why = "it has no parallel_plan(dims) method and no configure_model() of its own"
        raise UnappliedDegreeError(unapplied_tp_message(config.tensor_parallel, name, why))
    if config.expert_parallel > 1:
        raise UnappliedDegreeError(
            f"expert_parallel ({config.expert_parallel}) needs a model with expert-parallel "
            f"MoE layers, but {name} has no parallel_plan(dims) method (whose plan names its "
            "MoE layers) and no configure_model() of its own; add MoE layers and a plan "
            "(docs/experts.md) or set expert_parallel=1."
        )


class CheckedLauncher(_SubprocessScriptLauncher):
    """Lightning's launcher of the other local processes (the one ``ModelParallelStrategy``
    uses), running :attr:`before_launch` first: the module is known then (``Trainer.fit`` sets
    it before it launches), and no other process exists yet."""

    before_launch: Callable[[], None] | None = None
    """Called before the processes start; raises to refuse the run."""

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if self.before_launch is not None:
            self.before_launch()
        return super().launch(function, *args, trainer=trainer, **kwargs)
