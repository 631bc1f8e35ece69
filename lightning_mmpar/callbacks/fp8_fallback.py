"""FP8FallbackCallback: on an FP8 anomaly, fall back to BF16 and redo the step.

Mechanism (automatic optimization):

* ``on_train_batch_start`` keeps the batches of the current accumulation window (the batches
  since the last optimizer step; cleared after each step, so at most
  ``accumulate_grad_batches`` batches are held and a redo recomputes exactly the current step).
* ``on_before_optimizer_step`` (gradients are synchronised, the optimizer has not stepped):
  the :class:`GradientDriftMonitor` inspects the gradients (non-finite / exploding, collective)
  and this callback reads every :class:`Float8Linear`'s cast statistics (amax overflow,
  non-finite amax); one all-reduce makes the decision collective, so all ranks either redo
  or go on together and DDP cannot deadlock. On an anomaly: the offending modules (union over
  ranks; all FP8 modules from the second attempt on) switch to ``fallback_precision``, the
  last stable in-memory snapshot of weights, buffers and optimizer state is restored, gradients
  are zeroed and forward/backward of the same batches is re-run through
  ``trainer.strategy.training_step`` / ``trainer.strategy.backward`` (so DDP, ``mm_parallel`` and
  precision plugins behave as in the original step), gradients are inspected again and clipped
  to ``clip_grad_norm``. Lightning then performs the optimizer step on the recomputed gradients.
* ``on_train_batch_end`` (after the step): replica drift (from the monitor) triggers the same
  recovery plus the optimizer step itself; a clean step refreshes the snapshot.

At most ``max_retries`` attempts per step, then :class:`FP8FallbackError`. Nothing is skipped
silently: every redone step, every step lost to a rollback to an older snapshot and every
precision switch is counted, logged and written to ``anomalies.jsonl``.

Sources: the FP8 formats (E4M3 / E5M2) of Micikevicius et al. 2022, "FP8 Formats for Deep
Learning", with delayed scaling as in NVIDIA Transformer Engine
(:mod:`lightning_mmpar.precision.formats`); the fallback, the snapshot and the redo are this
package's policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from typing_extensions import override

from lightning_mmpar.callbacks.anomalies import Anomaly
from lightning_mmpar.callbacks.grad_drift import GradientDriftMonitor, GradReport
from lightning_mmpar.callbacks.grad_stats import log_due
from lightning_mmpar.callbacks.snapshot import Snapshot
from lightning_mmpar.callbacks.stability_config import FallbackConfig
from lightning_mmpar.parallel import comm
from lightning_mmpar.parallel.numerics import scale_grads_
from lightning_mmpar.precision.fp8 import Float8Linear, fp8_modules, set_precision


class FP8FallbackError(RuntimeError):
    """Raised when a step is still anomalous after ``max_retries`` recoveries."""


@dataclass(kw_only=True)
class Decision:
    """Collective outcome of one check."""

    anomalous: bool
    """All ranks agree a recovery is needed."""
    modules: list[str] = field(default_factory=list)
    """FP8 modules to blame (union over ranks)."""
    reasons: list[dict[str, Any]] = field(default_factory=list)
    """FP8 cast events of all ranks: ``{rank, module, site, kind, amax, shape}``."""


def _module_of(param: str) -> str:
    return param.rpartition(".")[0]


class FP8FallbackCallback(Callback):
    """Fall back from FP8 to BF16 on anomalies, restore a snapshot and redo the step.

    Uses the :class:`GradientDriftMonitor` found in ``trainer.callbacks`` (or ``monitor``);
    without one it creates and drives its own.
    """

    def __init__(
        self,
        config: FallbackConfig | None = None,
        monitor: GradientDriftMonitor | None = None,
        **overrides: Any,
    ) -> None:
        self.config = config or FallbackConfig(**overrides)
        self.monitor = monitor
        self._drive = False
        self.snapshot = Snapshot(device=self.config.snapshot_device)
        self.counters = {
            "redone_steps": 0,
            "rolled_back_steps": 0,
            "fallbacks": 0,
            "attempts": 0,
            "returns_to_fp8": 0,
        }
        self.fallen: set[str] = set()
        self._window: list[tuple[Any, int]] = []
        self._clean_steps = 0
        self._last_step = -1
        self._in_redo = False

    # ------------------------------------------------------------------ lifecycle
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.monitor is None:
            found = [c for c in trainer.callbacks if isinstance(c, GradientDriftMonitor)]  # type: ignore[attr-defined]
            self.monitor, self._drive = (
                (found[0], False) if found else (GradientDriftMonitor(), True)
            )
        self.monitor.action = "handed to FP8FallbackCallback"
        if self._drive:
            self.monitor.setup(trainer, pl_module, stage)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._drive:
            self.mon.on_fit_start(trainer, pl_module)
        mods = fp8_modules(pl_module)
        rank_zero_info(
            f"FP8FallbackCallback: {sum(m.precision == 'fp8' for m in mods.values())} of "
            f"{len(mods)} Float8Linear modules in fp8; fallback -> {self.config.fallback_precision}"
        )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """After a checkpoint is restored (Lightning restores callbacks and weights between
        ``on_fit_start`` and here): re-apply this rank's fallback decisions, whose precision
        the weights do not carry, and take the first snapshot of the restored state."""
        if self.fallen:
            set_precision(pl_module, self.config.fallback_precision, sorted(self.fallen))
        self.snapshot.take(trainer, pl_module)
        self._last_step = trainer.global_step
        self._window = []

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._drive:
            self.mon.teardown(trainer, pl_module, stage)

    @property
    def mon(self) -> GradientDriftMonitor:
        """The monitor in use (available after ``setup``)."""
        if self.monitor is None:
            raise RuntimeError("FP8FallbackCallback.monitor is set in setup(); call fit first.")
        return self.monitor

    # ------------------------------------------------------------------ hooks
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._drive:
            self.mon.on_train_batch_start(trainer, pl_module, batch, batch_idx)
        if not self._window:  # first batch of an accumulation window
            for m in fp8_modules(pl_module).values():
                m.reset_fp8_stats()
        self._window.append((batch, batch_idx))

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        report = self.mon.inspect_gradients(trainer, pl_module)
        decision = self._decide(pl_module, report)
        if decision.anomalous:
            self._recover(trainer, pl_module, optimizer, decision, report, after_step=False)

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self._drive:
            self.mon.on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if trainer.global_step == self._last_step:
            return  # accumulating: no optimizer step yet
        self._last_step = trainer.global_step
        checked = trainer.global_step % self.mon.config.check_every_n_steps == 0
        drift = self.mon.check_replicas(trainer, pl_module) if checked else []
        if checked and self.mon.drift_anywhere and self.config.check_drift:
            # drift is seen by its group only: the blamed modules are the union over ranks
            mine = sorted({_module_of(d.name) for d in drift})
            names = {m for rk in comm.all_gather_objects(mine) for m in rk}
            mods = sorted(n for n in names if n in fp8_modules(pl_module))
            reasons = [
                {
                    "kind": "replica_drift",
                    "param": d.name,
                    "shape": d.shape,
                    "drifting_ranks": d.drifting_ranks,
                }
                for d in drift
            ]
            decision = Decision(anomalous=True, modules=mods, reasons=reasons)
            self._recover(
                trainer, pl_module, trainer.optimizers[0], decision, None, after_step=True
            )
        else:
            self._on_clean_step(trainer, pl_module, checked)
        self._window = []  # the optimizer stepped: the next batch opens a new window
        if self.mon.config.log_metrics and log_due(trainer):
            self.mon.log_metrics(pl_module)  # once per step, the final (possibly redone) report
            for k, v in self.counters.items():
                pl_module.log(f"fp8_fallback/{k}", float(v), on_step=True, on_epoch=False)

    # ------------------------------------------------------------------ decisions
    def _decide(self, pl_module: pl.LightningModule, report: GradReport) -> Decision:
        """Collective: anomalous if the monitor says so or any rank saw an FP8 cast event."""
        me, fp8 = comm.group_rank(), fp8_modules(pl_module)
        events = self._fp8_events(fp8) if self.config.check_fp8_stats else []
        total = comm.all_reduce(torch.tensor([float(len(events))], dtype=torch.float64))
        if not report.anomalous and float(total[0]) == 0:
            return Decision(anomalous=False)
        events += [
            {"rank": me, "kind": "nonfinite_grad", "param": p, "module": _module_of(p)}
            for p in report.nonfinite_params
        ]
        events += [
            {"rank": me, "kind": "exploding_grad", "module": m} for m in report.exploding_modules
        ]
        reasons = [e for ev in comm.all_gather_objects(events) for e in ev]
        reasons += [
            {"kind": "nonfinite_local_grad", "module": _module_of(o["param"]), **o}
            for o in report.origin
        ]
        live = {n for n, m in fp8.items() if m.precision == "fp8"}
        mods = sorted({e["module"] for e in reasons} & live)
        return Decision(anomalous=True, modules=mods, reasons=reasons)

    @staticmethod
    def _fp8_events(fp8: dict[str, Float8Linear]) -> list[dict[str, Any]]:
        live = [
            (n, s, c) for n, m in fp8.items() if m.precision == "fp8" for s, c in m.meta.items()
        ]
        if not live:
            return []
        flags = torch.stack(
            [torch.stack([c.overflow.cpu(), c.nonfinite.cpu()]) for _, _, c in live]
        )
        out = []
        for (name, site, c), (ov, nf) in zip(live, flags.tolist(), strict=True):
            if ov or nf:
                out.append(
                    {
                        "rank": comm.group_rank(),
                        "module": name,
                        "site": site,
                        "kind": "fp8_nonfinite" if nf else "fp8_overflow",
                        "amax": float(c.amax),
                        "shape": c.shape,
                    }
                )
        return out

    # ------------------------------------------------------------------ recovery
    def _recover(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        optimizer: Any,
        decision: Decision,
        report: GradReport | None,
        *,
        after_step: bool,
    ) -> None:
        """Switch precision, restore, redo - until clean or ``max_retries`` is exhausted."""
        attempt = 0
        while decision.anomalous:
            attempt += 1
            self.counters["attempts"] += 1
            if attempt > self.config.max_retries:
                raise FP8FallbackError(
                    f"rank {comm.group_rank()}: step {trainer.global_step} still anomalous after "
                    f"{self.config.max_retries} recoveries (reasons: {decision.reasons[:4]}); "
                    f"raise FallbackConfig.max_retries or inspect {self.mon.anomalies.path}."
                )
            switched = self._switch(pl_module, decision, attempt)
            restored = self.snapshot.restore(trainer, pl_module)
            lost = max(0, trainer.global_step - (1 if after_step else 0) - restored)
            self.counters["rolled_back_steps"] += lost
            report = self._redo(trainer, pl_module, optimizer, step=after_step)
            self._record(trainer, pl_module, decision, report, switched, attempt, restored, lost)
            if after_step:
                self.mon.check_replicas(trainer, pl_module, force=True)
                decision = self._decide(pl_module, report)
                if self.mon.drift_anywhere and not decision.anomalous:
                    decision = Decision(anomalous=True, reasons=[{"kind": "replica_drift"}])
            else:
                decision = self._decide(pl_module, report)
        self.counters["redone_steps"] += 1
        self._clean_steps = 0
        if after_step:
            self.snapshot.take(trainer, pl_module)

    def _switch(self, pl_module: pl.LightningModule, decision: Decision, attempt: int) -> list[str]:
        # attempt 1: only the blamed modules (none if FP8 is not implicated); later: all
        names = decision.modules if attempt == 1 else None
        switched = set_precision(pl_module, self.config.fallback_precision, names)
        self.fallen |= set(switched)
        if switched:
            self.counters["fallbacks"] += len(switched)
        return switched

    def _redo(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any, *, step: bool
    ) -> GradReport:
        """Zero gradients, recompute them on the window's batches; optimizer step if ``step``."""
        self._recompute(trainer, pl_module, optimizer)
        report = self.mon.inspect_gradients(trainer, pl_module, force=True)
        if self.config.clip_grad_norm is not None and not report.anomalous:
            # the monitor's norm is the global one of the numerics core (tp/dp shards, pp
            # stages): scale with it directly, without a second all-reduce
            scale_grads_(pl_module.parameters(), self.config.clip_grad_norm, report.grad_norm)
        if step and not report.anomalous:  # recovery after Lightning's step: step ourselves
            for opt in trainer.optimizers:
                opt.step()
                opt.zero_grad(set_to_none=True)
        return report

    def _recompute(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        """Zero gradients and re-run forward/backward of the window's batches through the
        strategy (DDP sync, ``mm_parallel`` pipeline schedules and their gradient hand-off)."""
        for opt in trainer.optimizers:
            opt.zero_grad(set_to_none=True)
        for m in fp8_modules(pl_module).values():
            m.reset_fp8_stats()
        scale = 1.0 / trainer.accumulate_grad_batches
        previous_fx = pl_module._current_fx_name
        pl_module._current_fx_name = "training_step"  # re-logged values overwrite, not clash
        self._in_redo = True
        try:
            for batch, idx in self._window:
                out: Any = trainer.strategy.training_step(batch, idx)
                loss: Tensor = out["loss"] if isinstance(out, dict) else out
                trainer.strategy.backward(loss * scale, optimizer)
            # token-sum losses (caption_loss under mm_parallel): divide by the step's tokens
            if (
                normalise := getattr(trainer.strategy, "normalise_token_gradients", None)
            ) is not None:
                normalise(optimizer)
        finally:
            pl_module._current_fx_name = previous_fx
            self._in_redo = False

    def _record(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        decision: Decision,
        report: GradReport,
        switched: list[str],
        attempt: int,
        restored: int,
        lost: int,
    ) -> None:
        mods, me = fp8_modules(pl_module), comm.group_rank()
        action = (
            f"switched {switched or 'no module'} to {self.config.fallback_precision}, restored "
            f"snapshot of step {restored} ({lost} later steps rolled back), redid step "
            f"{trainer.global_step} (attempt {attempt}/{self.config.max_retries}), clipped grad "
            f"norm to {self.config.clip_grad_norm}; redone gradients "
            f"{'still anomalous' if report.anomalous else 'clean'}"
        )
        for name in switched or [None]:  # type: ignore[list-item]
            w = mods[name].weight if name in mods else None
            self.mon.anomalies.record(
                Anomaly(
                    kind="fp8_fallback",
                    step=trainer.global_step,
                    rank=me,
                    group="world",
                    param=name,
                    shape=None if w is None else list(comm.to_local(w).shape),
                    action=action,
                    values={
                        "attempt": attempt,
                        "reasons": decision.reasons[:16],
                        "grad_norm_after_redo": report.grad_norm,
                        "global_shape": None if w is None else list(w.shape),
                        "restored_step": restored,
                        "rolled_back_steps": lost,
                    },
                )
            )

    def _on_clean_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checked: bool
    ) -> None:
        self._clean_steps += 1
        if checked and trainer.global_step % self.config.snapshot_every_n_steps == 0:
            self.snapshot.take(trainer, pl_module)
        n = self.config.return_to_fp8_after
        if n is not None and self.fallen and self._clean_steps >= n:
            back = set_precision(pl_module, "fp8", sorted(self.fallen))
            self.fallen -= set(back)
            self.counters["returns_to_fp8"] += len(back)
            self.mon.anomalies.record(
                Anomaly(
                    kind="fp8_return",
                    step=trainer.global_step,
                    rank=comm.group_rank(),
                    group="world",
                    param=", ".join(back),
                    action=f"switched back to fp8 after {n} clean steps",
                )
            )

    @override
    def state_dict(self) -> dict[str, Any]:
        """This rank's counters and modules in fallback precision (saved per rank by
        ``mm_parallel``: each pipeline stage / tensor shard has its own)."""
        state = {
            "counters": dict(self.counters),
            "fallen": sorted(self.fallen),
            "clean_steps": self._clean_steps,
        }
        if self._drive and self.monitor is not None:  # not in trainer.callbacks: saved here
            state["monitor"] = self.monitor.state_dict()
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore; the modules in ``fallen`` go back to fallback precision in
        :meth:`on_train_start`."""
        self.counters.update(state_dict.get("counters", {}))
        self.fallen = set(state_dict.get("fallen", []))
        self._clean_steps = int(state_dict.get("clean_steps", 0))
        if "monitor" in state_dict and self._drive and self.monitor is not None:
            self.monitor.load_state_dict(state_dict["monitor"])
