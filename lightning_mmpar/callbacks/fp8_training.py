"""FP8Training: FP8 for a whole run from one configuration section (a recipe YAML's
``precision.fp8``), with the BF16 fallback and the gradient-drift monitor.

One callback in ``trainer.callbacks``::

    - class_path: lightning_mmpar.callbacks.FP8Training
      init_args:
        policy: {keep_high_precision: ["vision.*", "*head*"], backend: auto}   # FP8Policy
        fallback: {max_retries: 2, return_to_fp8_after: 200}                   # FallbackConfig
        drift: {check_every_n_steps: 10}                                       # DriftConfig

It wraps the LightningModule's ``configure_model`` (and its ``parallel_plan``, when the strategy
applies that: the conversion is then the plan's last step): after the module has built its model
and its tensor-parallel plan is applied, every ``nn.Linear`` becomes a
:class:`~lightning_mmpar.precision.fp8.Float8Linear` (:func:`convert_to_fp8`; parameters and
forward hooks, such as the plan's DTensor input/output hooks, are kept), those matching
``policy.keep_high_precision`` pinned to ``policy.high_precision``. It is an
:class:`~lightning_mmpar.callbacks.fp8_fallback.FP8FallbackCallback` configured by
``fallback``, driving its own :class:`GradientDriftMonitor` configured by ``drift`` (or the
monitor already in ``trainer.callbacks``). The strategy's sharding (FSDP2, pipeline stages)
comes after, so it shards the FP8 layers' parameters as any others.

On a machine without FP8 matmuls (CPU, GPUs before compute capability 8.9) ``backend: auto``
emulates FP8: operands are quantised to E4M3 / E5M2 with the same scales and multiplied in
FP32 (:func:`~lightning_mmpar.precision.formats.fp8_matmul`), so the numerics (and fallbacks)
are those of FP8, not its speed.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_mmpar.callbacks.fp8_fallback import FP8FallbackCallback
from lightning_mmpar.callbacks.grad_drift import GradientDriftMonitor
from lightning_mmpar.callbacks.stability_config import DriftConfig, FallbackConfig
from lightning_mmpar.parallel.parallelize import PLAN_HOOK, ParallelPlan, applies_plans
from lightning_mmpar.precision.formats import FP8Policy
from lightning_mmpar.precision.fp8 import convert_to_fp8

__all__ = ["FP8Training"]


class FP8Training(FP8FallbackCallback):
    """Convert the model to FP8 in ``configure_model``; fall back to BF16 on anomalies.

    Args:
        policy: which layers stay in high precision, scaling and backend (:class:`FP8Policy`).
        fallback: recovery options (:class:`FallbackConfig`).
        drift: options of the gradient-drift monitor this callback drives
            (:class:`DriftConfig`); ignored when ``trainer.callbacks`` has a
            :class:`GradientDriftMonitor`, which is then used (``ValueError`` if ``drift``
            is also given, as one of the two configurations would be silently unused).
    """

    def __init__(
        self,
        policy: FP8Policy | None = None,
        fallback: FallbackConfig | None = None,
        drift: DriftConfig | None = None,
    ) -> None:
        super().__init__(fallback or FallbackConfig())
        self.policy = policy or FP8Policy()
        self.drift = drift
        self.converted: list[str] = []
        """Names of the layers converted to (and running in) FP8."""

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        found = [c for c in trainer.callbacks if isinstance(c, GradientDriftMonitor)]  # type: ignore[attr-defined]
        if found and self.drift is not None:
            raise ValueError(
                "FP8Training(drift=...) with a GradientDriftMonitor in trainer.callbacks: give "
                "the drift options to one of them (remove FP8Training's drift, or the monitor)."
            )
        if self.monitor is None and not found:
            self.monitor, self._drive = GradientDriftMonitor(self.drift), True
        super().setup(trainer, pl_module, stage)
        self._wrap_configure_model(pl_module)

    def _wrap_configure_model(self, pl_module: pl.LightningModule) -> None:
        """Convert after ``configure_model``, or, when the strategy applies the module's plan
        (``parallel_plan(dims)``, :func:`~lightning_mmpar.parallel.parallelize.parallelize`), as
        the plan's last step after tensor parallelism: the order of a module that applies its
        plan in ``configure_model`` (TP, then FP8; the converted layers keep the TP hooks)."""
        if getattr(pl_module, "_mmpar_fp8_wrapped", False):
            return
        original = pl_module.configure_model
        plan_hook = getattr(pl_module, PLAN_HOOK, None)

        def strategy_plans() -> bool:
            return callable(plan_hook) and applies_plans(pl_module._trainer)

        def configure_model() -> None:
            original()
            if not strategy_plans():
                self._convert(pl_module)

        def parallel_plan(dims: Any) -> ParallelPlan | None:
            plan = plan_hook(dims)  # type: ignore[misc]
            if not strategy_plans():
                return plan
            if plan is None:
                self._convert(pl_module)
                return None
            step = (lambda _dims: self._convert(pl_module),)
            return replace(plan, after_model_parallel=(*plan.after_model_parallel, *step))

        pl_module.configure_model = configure_model  # type: ignore[method-assign]
        if callable(plan_hook):
            setattr(pl_module, PLAN_HOOK, parallel_plan)
        pl_module._mmpar_fp8_wrapped = True  # type: ignore[assignment]

    def _convert(self, pl_module: pl.LightningModule) -> None:
        names = convert_to_fp8(pl_module, self.policy)
        self.converted = sorted({*self.converted, *names})
        if names:
            rank_zero_info(f"FP8Training: {len(names)} linear layers in FP8")
