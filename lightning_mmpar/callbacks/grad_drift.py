"""GradientDriftMonitor: replica drift, gradient noise scale, non-finite/exploding gradients.

Comparing a gradient's norm before and after the data-parallel all-reduce against a fixed
threshold fires constantly: the average of ``n`` noisy gradients is legitimately shorter than
each of them. What such a check is meant to catch is split into three parts, one module each:

(a) **replica drift** (:mod:`.replicas`) - after every (``check_every_n_steps``-th) optimizer
    step, parameters that must be identical across a group are fingerprinted and compared;
(b) **local/global gradient-norm ratio** as a statistic (:mod:`.noise_scale`): it gives the
    gradient noise scale of McCandlish et al. 2018, "An Empirical Model of Large-Batch
    Training";
(c) **non-finite or exploding** gradient norms per named module (:mod:`.grad_anomalies`: norm
    > ``explode_factor`` times its EMA after ``warmup_steps``, or above
    ``max_module_grad_norm``).

This module is the Lightning callback that runs them, records their anomalies and logs
``stability/*``.

How the local (pre-sync) gradient is captured: a tensor hook on every parameter
(``param.register_hook``) runs before the gradient is accumulated into ``param.grad``; DDP's
reducer hooks run *after* accumulation, so the hook sees this rank's own gradient under DDP,
under ``mm_parallel`` with ``data_parallel="ddp"`` (its all-reduce runs after backward) and on
a single device. Under a pipeline schedule (pp > 1) the hook fires once per micro-batch with
that micro-batch's gradient. Under FSDP (Lightning's strategies, or FSDP2 on the ``dp`` mesh
of ``mm_parallel``) the local gradient of a sharded parameter is not observable this way; there
the noise scale is not computed (non-finite/exploding checks are unaffected, replica checks
skip what FSDP shards).

All norms are of the *global* gradient: TP/FSDP shards are combined and TP-replicated copies
counted once, pipeline stages add up (the numerics core,
:func:`lightning_mmpar.parallel.numerics.global_norm_from_local`: one world all-reduce), and
per-module norms are summed over the tp and dp ranks of the module's pipeline stage.
``stability/grad_norm`` is therefore the norm ``torch.nn.utils.clip_grad_norm_`` would report
on one device for the same batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from typing_extensions import override

from lightning_mmpar.callbacks import replicas
from lightning_mmpar.callbacks.anomalies import AnomalyLog
from lightning_mmpar.callbacks.grad_anomalies import ModuleNorms, grad_anomalies, nonfinite_local
from lightning_mmpar.callbacks.grad_stats import (
    LocalGradCapture,
    batch_size_of,
    lightning_fsdp,
    log_due,
    norm_weights,
    reduce_module_norms,
    safe_sqrt,
    stage_groups,
)
from lightning_mmpar.callbacks.noise_scale import NoiseScale, small_batch_sq
from lightning_mmpar.callbacks.stability_config import DriftConfig
from lightning_mmpar.parallel import comm, numerics


@dataclass(kw_only=True)
class GradReport:
    """Outcome of one gradient inspection (collective fields agree on every rank)."""

    step: int
    """``trainer.global_step``."""
    anomalous: bool
    """Any rank saw a non-finite or exploding gradient (collective)."""
    grad_norm: float
    """Global norm of the synchronised gradient (all shards, all pipeline stages; NaN if any
    rank holds a non-finite gradient), identical on every rank."""
    local_global_ratio: float | None = None
    """``sqrt(mean_dp |g_b|^2 / |g_B|^2)``: a data-parallel rank's own (pre-sync) gradient
    norm over the synchronised one (micro-batch gradients under a pipeline)."""
    noise_scale: float | None = None
    """``B_simple`` from the EMAs (``None`` until both EMAs are positive)."""
    nonfinite_params: list[str] = field(default_factory=list)
    """This rank's parameters with a non-finite synchronised gradient."""
    origin: list[dict[str, Any]] = field(default_factory=list)
    """All ranks' non-finite *local* gradients: ``{rank, param, shape, norm}``."""
    exploding_modules: list[str] = field(default_factory=list)
    """This rank's modules whose gradient norm exploded."""


class GradientDriftMonitor(Callback):
    """Detect replica drift and non-finite/exploding gradients; estimate the noise scale.

    Works in any Trainer. Anomalies go to ``<log_dir>/anomalies.jsonl`` and the log; metrics
    ``stability/grad_norm``, ``stability/local_global_ratio``, ``stability/noise_scale`` go to
    the LightningModule's logger. It only observes (``on_drift="resync"`` aside); pair it with
    :class:`FP8FallbackCallback` to act on anomalies.
    """

    def __init__(self, config: DriftConfig | None = None, **overrides: Any) -> None:
        self.config = config or DriftConfig(**overrides)
        self.anomalies = AnomalyLog(None)
        self.action = "reported"
        self.last_report: GradReport | None = None
        self.groups: list[replicas.ReplicaGroup] = []
        self.last_drift: list[replicas.Drift] = []
        self.drift_anywhere = False
        """Whether any rank found drift in the latest :meth:`check_replicas` (collective)."""
        self.capture: LocalGradCapture | None = None
        self._batch: int | None = None
        self._inspected_step = -1
        self._checked_step = -1
        self.module_norms = ModuleNorms()
        self.noise = NoiseScale(self.config.ema_beta)
        self._logged_report: GradReport | None = None
        self._logged_keys: set[str] = set()

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        log_dir = self.config.log_dir or trainer.log_dir or trainer.default_root_dir
        self.anomalies = AnomalyLog(Path(log_dir) / "anomalies.jsonl")

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from torch.distributed.fsdp import FSDPModule

        named = list(pl_module.named_parameters())
        self.groups = replicas.build_groups(trainer, pl_module, self.config.expert_patterns)
        fsdp = lightning_fsdp(trainer) or any(
            isinstance(m, FSDPModule) for m in pl_module.modules()
        )
        if self.capture is None and not fsdp:
            self.capture = LocalGradCapture([(n, p) for n, p in named if p.requires_grad])
        groups = [
            f"{g.name}: {len(g.params)}"
            + (f" ({g.skipped} sharded, not compared)" if g.skipped else "")
            for g in self.groups
        ]
        rank_zero_info(
            f"GradientDriftMonitor: replica groups [{', '.join(groups)}], local-gradient capture "
            f"{'on' if self.capture else 'off (FSDP)'}, anomalies -> {self.anomalies.path}"
        )

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.capture is not None:
            self.capture.remove()
            self.capture = None

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch = self.config.batch_size or batch_size_of(batch)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        self.inspect_gradients(trainer, pl_module)

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if trainer.global_step % self.config.check_every_n_steps == 0:
            self.check_replicas(trainer, pl_module)
        if self.config.log_metrics:
            self.log_metrics(pl_module)

    def inspect_gradients(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *, force: bool = False
    ) -> GradReport:
        """Collective: check this step's gradients (memoised per step unless ``force``).

        A forced inspection (a recovery's recomputed gradients, possibly after the optimizer
        step has advanced ``global_step``) replaces :attr:`last_report` but not the memo: the
        next step is inspected afresh.
        """
        step = trainer.global_step
        if self.last_report is not None and self._inspected_step == step and not force:
            return self.last_report
        if not force:
            self._inspected_step = step
        named = [(n, p) for n, p in pl_module.named_parameters() if p.grad is not None]
        local_norms = numerics.local_grad_norms([p for _, p in named])
        ws = norm_weights(trainer, [p for _, p in named])
        norms = local_norms.tolist()  # the one host sync of the local norms
        mod_sq = ModuleNorms.squares(named, norms, ws, self.config.module_depth)
        groups = stage_groups(trainer)
        # one stage spanning the world (DDP, dp-only layouts): module norms ride along in the
        # single all-reduce below; otherwise they are summed over the stage's groups first
        fold = len(groups) == 1 and comm.group_size(groups[0]) == comm.group_size()
        modules: dict[str, float] = {} if fold else reduce_module_norms(mod_sq, groups)
        exploding = [] if fold else self.module_norms.exploding(modules, step, self.config)
        nonfinite = [n for (n, _), v in zip(named, norms, strict=True) if not math.isfinite(v)]
        local_sq, count = self.capture.take() if self.capture else ([], 0)
        local_bad = nonfinite_local(self.capture, local_sq)
        small, bad_s = small_batch_sq(trainer, self.capture, local_sq, count)
        # the global norm (numerics.global_norm_from_local's weighted squares) and every count
        # in one all-reduce
        sq = sum(w * v * v for w, v in zip(ws, norms, strict=True))
        counts = [0.0 if bad_s else small, float(bad_s), len(nonfinite), len(local_bad)]
        folded = mod_sq.values() if fold else ()
        vec = torch.tensor([*counts, len(exploding), sq, *folded], dtype=torch.float64)
        tot = comm.all_reduce(vec).tolist()
        if fold:
            modules = {m: safe_sqrt(v) for m, v in zip(mod_sq, tot[6:], strict=True)}
            # same global norms on every rank
            exploding = self.module_norms.exploding(modules, step, self.config)
            tot[4] = len(exploding)
        total = safe_sqrt(tot[5])
        origin = [o for rk in comm.all_gather_objects(local_bad) for o in rk] if tot[3] > 0 else []
        finite = math.isfinite(total)
        report = GradReport(
            step=step,
            anomalous=tot[2] + tot[3] + tot[4] > 0,
            grad_norm=total if finite else math.nan,
            nonfinite_params=nonfinite,
            origin=origin,
            exploding_modules=exploding,
        )
        if tot[1] == 0 and finite:
            ratio, noise = self.noise.update(tot[0], total * total, trainer, self._batch)
            report.local_global_ratio, report.noise_scale = ratio, noise
        self._record(report, named, norms, modules, local_bad)
        self.last_report = report
        return report

    def _record(
        self,
        report: GradReport,
        named: Sequence[tuple[str, Tensor]],
        norms: list[float],
        modules: dict[str, float],
        local_bad: list[dict[str, Any]],
    ) -> None:
        """Record the anomalies of ``report`` (at most ``max_records_per_step``)."""
        records = grad_anomalies(
            step=report.step,
            action=self.action,
            named=named,
            norms=norms,
            local_bad=local_bad,
            nonfinite=report.nonfinite_params,
            origin=report.origin,
            modules=modules,
            exploding=report.exploding_modules,
            module_ema=self.module_norms.ema,
            explode_factor=self.config.explode_factor,
        )
        for a in records[: self.config.max_records_per_step]:
            self.anomalies.record(a)

    def log_metrics(self, pl_module: pl.LightningModule) -> None:
        """Log ``stability/*`` of the latest report, once per report, from the current hook.

        Called from ``on_train_batch_end`` only (by this callback and, after a recovery, by
        :class:`FP8FallbackCallback`): Lightning keys logged values by hook, so logging one name
        from two hooks would leave a stale entry that shadows the fresh one. Only on steps whose
        values reach the loggers (``Trainer(log_every_n_steps=...)``, :func:`.log_due`). A value
        not available at this step (a non-finite gradient norm, no noise-scale estimate) is
        logged as NaN once the name has been logged, never as the last finite value;
        ``stability/anomalies`` counts this rank's records.
        """
        report = self.last_report
        if report is None or report is self._logged_report or not log_due(pl_module.trainer):
            return
        self._logged_report = report
        vals = {
            "stability/grad_norm": report.grad_norm,
            "stability/local_global_ratio": report.local_global_ratio,
            "stability/noise_scale": report.noise_scale,
            "stability/anomalies": float(len(self.anomalies.records)),
        }
        for k, v in vals.items():
            if v is None and k not in self._logged_keys:
                continue  # never available in this run (e.g. the noise scale under FSDP)
            # NaN when not available this step (a non-finite gradient): the loggers would
            # otherwise repeat the last finite value next to a NaN loss
            pl_module.log(k, math.nan if v is None else v, on_step=True, on_epoch=False)
            self._logged_keys.add(k)

    def check_replicas(
        self, trainer: pl.Trainer, pl_module: nn.Module, *, force: bool = False
    ) -> list[replicas.Drift]:
        """Collective: compare replicated parameters (memoised per step unless ``force``);
        this rank's drifting parameters, :attr:`drift_anywhere` for all ranks."""
        if self._checked_step == trainer.global_step and not force:
            return self.last_drift
        self._checked_step = trainer.global_step
        found: list[replicas.Drift] = []
        for rg in self.groups:
            drift = replicas.check_group(
                rg, self.config.rtol, self.config.atol, self.config.max_full_compare
            )
            action = self.action
            if drift and self.config.on_drift == "resync":
                replicas.resync(rg, drift, getattr(trainer, "optimizers", []))
                action = f"resynced from reference rank ({self.action})"
            for d in drift[: self.config.max_records_per_step]:
                self.anomalies.record(replicas.drift_anomaly(d, trainer.global_step, rg, action))
            found += drift
        self.last_drift = found
        # a group's drift is known to its members only: one flag for every rank, so that
        # recoveries and ``raise`` happen on all ranks together (no rank left in a collective)
        # (no all-reduce when every group spans the world: all ranks saw the same tables)
        if all(comm.group_size(g.group) == comm.group_size() for g in self.groups):
            self.drift_anywhere = bool(found)
        else:
            flag = comm.all_reduce(torch.tensor([float(len(found))], dtype=torch.float64))
            self.drift_anywhere = bool(flag[0] > 0)
        if self.drift_anywhere and self.config.on_drift == "raise":
            raise RuntimeError(
                f"GradientDriftMonitor: replica drift at step {trainer.global_step} (this rank: "
                f"{sorted({d.name for d in found}) or 'none'}); see {self.anomalies.path}."
            )
        return found

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "module_ema": self.module_norms.ema,
            "ema_g2": self.noise.ema_g2,
            "ema_trace": self.noise.ema_trace,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.module_norms.ema = dict(state_dict.get("module_ema", {}))
        self.noise.ema_g2 = state_dict.get("ema_g2")
        self.noise.ema_trace = state_dict.get("ema_trace")
