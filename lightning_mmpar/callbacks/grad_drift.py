"""GradientDriftMonitor: replica drift, gradient noise scale, non-finite/exploding gradients.

TECHNIQUES 1.6. Comparing a gradient's norm before and after the data-parallel all-reduce
against a fixed threshold fires constantly: the average of ``n`` noisy gradients is legitimately
shorter than each of them. What the check is meant to catch is split into three parts:

(a) **replica drift** - after every (``check_every_n_steps``-th) optimizer step, parameters
    that must be identical across a group are fingerprinted and compared (:mod:`.replicas`);
(b) **local/global gradient-norm ratio** as a statistic: with per-rank micro-batch size ``b``
    and global batch ``B = b * accumulate * dp``, ``E|g_b|^2 = |G|^2 + tr(S)/b``, so the two
    measured norms give unbiased estimates (McCandlish et al. 2018, App. A.1)::

        |G|^2 = (B |g_B|^2 - b |g_b|^2) / (B - b),   tr(S) = (|g_b|^2 - |g_B|^2) / (1/b - 1/B)

    and the *simple noise scale* ``B_simple = EMA(tr S) / EMA(|G|^2)`` is logged;
(c) **non-finite or exploding** gradient norms per named module (norm > ``explode_factor``
    times its EMA after ``warmup_steps``, or above ``max_module_grad_norm``).

How the local (pre-sync) gradient is captured: a tensor hook on every parameter
(``param.register_hook``) runs before the gradient is accumulated into ``param.grad``; DDP's
reducer hooks run *after* accumulation, so the hook sees this rank's own gradient under DDP,
under ``mm_parallel`` with ``data_parallel="ddp"`` (its all-reduce runs after backward) and on
a single device. Under a pipeline schedule (pp > 1) the hook fires once per micro-batch with
that micro-batch's gradient, so the small batch is ``b / micro_batches`` (and the noise scale is
available even at dp = 1). Under FSDP (Lightning's strategies, or FSDP2 on the ``dp`` mesh
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
from lightning_mmpar.callbacks.anomalies import Anomaly, AnomalyLog
from lightning_mmpar.callbacks.config import DriftConfig
from lightning_mmpar.callbacks.grad_stats import (
    LocalGradCapture,
    batch_size_of,
    lightning_fsdp,
    log_due,
    noise_scale_terms,
    norm_weights,
    pipeline_micro_batches,
    reduce_module_norms,
    safe_sqrt,
    stage_groups,
)
from lightning_mmpar.parallel import comm, numerics
from lightning_mmpar.topology import ParallelDims


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
        self._module_ema: dict[str, float] = {}
        self._ema_g2: float | None = None
        self._ema_trace: float | None = None
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
        mod_sq = self._module_sq(named, norms, ws)
        groups = stage_groups(trainer)
        # one stage spanning the world (DDP, dp-only layouts): module norms ride along in the
        # single all-reduce below; otherwise they are summed over the stage's groups first
        fold = len(groups) == 1 and comm.group_size(groups[0]) == comm.group_size()
        modules: dict[str, float] = {} if fold else reduce_module_norms(mod_sq, groups)
        exploding = [] if fold else self._exploding(modules, step)
        nonfinite = [n for (n, _), v in zip(named, norms, strict=True) if not math.isfinite(v)]
        local_sq, count = self.capture.take() if self.capture else ([], 0)
        me = comm.group_rank()
        local_bad = (
            [
                {"rank": me, "param": n, "shape": s, "norm": math.sqrt(v) if v >= 0 else v}
                for n, s, v in zip(self.capture.names, self.capture.shapes, local_sq, strict=True)
                if not math.isfinite(v)
            ]
            if self.capture
            else []
        )
        small = 0.0
        if self.capture is not None:
            cw = norm_weights(trainer, self.capture.params)
            # under a pipeline the hook sees unscaled micro-batch gradients, else loss/accumulate
            acc = 1 if pipeline_micro_batches(trainer) > 1 else trainer.accumulate_grad_batches
            small = sum(w * v for w, v in zip(cw, local_sq, strict=True)) * acc**2
            small /= max(count, 1)
        has = self.capture is not None and bool(self.capture.names)
        bad_s = not has or count == 0 or not math.isfinite(small)
        # the global norm (numerics.global_norm_from_local's weighted squares) and every count
        # in one all-reduce
        sq = sum(w * v * v for w, v in zip(ws, norms, strict=True))
        vec = torch.tensor(
            [
                0.0 if bad_s else small,
                float(bad_s),
                len(nonfinite),
                len(local_bad),
                len(exploding),
                sq,
                *(mod_sq.values() if fold else ()),
            ],
            dtype=torch.float64,
        )
        tot = comm.all_reduce(vec).tolist()
        if fold:
            modules = {m: safe_sqrt(v) for m, v in zip(mod_sq, tot[6:], strict=True)}
            exploding = self._exploding(modules, step)  # same global norms on every rank
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
            self._noise_scale(report, tot[0], total * total, trainer)
        self._record_grad_anomalies(report, named, norms, modules, local_bad)
        self.last_report = report
        return report

    def _module_sq(
        self, named: Sequence[tuple[str, Tensor]], norms: list[float], weights: list[float]
    ) -> dict[str, float]:
        """Weighted local squared norm per module (first ``module_depth`` name parts)."""
        sq: dict[str, float] = {}
        for (n, _), v, w in zip(named, norms, weights, strict=True):
            mod = ".".join(n.split(".")[:-1][: self.config.module_depth]) or "<root>"
            sq[mod] = sq.get(mod, 0.0) + w * v * v
        return sq

    def _exploding(self, modules: dict[str, float], step: int) -> list[str]:
        cfg, out = self.config, []
        for m, v in modules.items():
            if not math.isfinite(v):
                continue
            ema = self._module_ema.get(m)
            rel = ema is not None and step >= cfg.warmup_steps and v > cfg.explode_factor * ema
            if rel or (cfg.max_module_grad_norm is not None and v > cfg.max_module_grad_norm):
                out.append(m)
                continue
            self._module_ema[m] = v if ema is None else cfg.ema_beta * ema + (1 - cfg.ema_beta) * v
        return out

    def _noise_scale(
        self, report: GradReport, small: float, big: float, trainer: pl.Trainer
    ) -> None:
        report.local_global_ratio = math.sqrt(small / big) if big > 0 else None
        dp, b = ParallelDims.of(trainer).dp, self._batch
        if b is None:
            return
        b_small = b / pipeline_micro_batches(trainer)
        b_big = b * trainer.accumulate_grad_batches * dp
        if b_big <= b_small:
            return
        g2, trace = noise_scale_terms(small, big, b_small, b_big)
        beta = self.config.ema_beta
        self._ema_g2 = g2 if self._ema_g2 is None else beta * self._ema_g2 + (1 - beta) * g2
        self._ema_trace = (
            trace if self._ema_trace is None else beta * self._ema_trace + (1 - beta) * trace
        )
        if self._ema_g2 > 0 and self._ema_trace > 0:
            report.noise_scale = self._ema_trace / self._ema_g2

    def _record_grad_anomalies(
        self,
        report: GradReport,
        named: Sequence[tuple[str, Tensor]],
        norms: list[float],
        modules: dict[str, float],
        local_bad: list[dict[str, Any]],
    ) -> None:
        me, step, cap = comm.group_rank(), report.step, self.config.max_records_per_step
        shapes = {n: list(comm.to_local(p).shape) for n, p in named}
        norm_of = dict(zip([n for n, _ in named], norms, strict=True))
        recs = (
            [
                Anomaly(
                    kind="nonfinite_local_grad",
                    step=step,
                    rank=me,
                    group="local",
                    param=o["param"],
                    shape=o["shape"],
                    values={"local_norm": o["norm"]},
                    action=self.action,
                )
                for o in local_bad
            ]
            + [
                Anomaly(
                    kind="nonfinite_grad",
                    step=step,
                    rank=me,
                    group="world",
                    param=n,
                    shape=shapes[n],
                    values={"norm": norm_of[n], "origin": report.origin},
                    action=self.action,
                )
                for n in report.nonfinite_params
            ]
            + [
                Anomaly(
                    kind="exploding_grad",
                    step=step,
                    rank=me,
                    group="local",
                    param=m,
                    values={
                        "norm": modules[m],
                        "ema": self._module_ema.get(m),
                        "explode_factor": self.config.explode_factor,
                    },
                    action=self.action,
                )
                for m in report.exploding_modules
            ]
        )
        for a in recs[:cap]:
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
            me = comm.group_rank()
            for d in drift[: self.config.max_records_per_step]:
                self.anomalies.record(
                    Anomaly(
                        kind="replica_drift",
                        step=trainer.global_step,
                        rank=me,
                        group=rg.name,
                        param=d.name,
                        shape=d.shape,
                        action=action,
                        values={
                            "drifting_ranks": d.drifting_ranks,
                            "this_rank_drifts": me in d.drifting_ranks,
                            "reference_rank": d.reference_rank,
                            "fingerprints": d.fingerprints,
                            "max_abs_diff": d.max_abs_diff,
                            "worst_index": d.worst_index,
                            "ambiguous": d.ambiguous,
                        },
                    )
                )
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
            "module_ema": self._module_ema,
            "ema_g2": self._ema_g2,
            "ema_trace": self._ema_trace,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._module_ema = dict(state_dict.get("module_ema", {}))
        self._ema_g2 = state_dict.get("ema_g2")
        self._ema_trace = state_dict.get("ema_trace")
