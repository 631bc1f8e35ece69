"""Configuration of the stability callbacks: what :class:`GradientDriftMonitor` checks and
how :class:`FP8FallbackCallback` recovers. Every field is validated at construction; errors
name the field, its value and the constraint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True)
class DriftConfig:
    """Configuration of :class:`GradientDriftMonitor`."""

    log_dir: str | None = None
    """Directory of ``anomalies.jsonl``; default ``trainer.log_dir``."""
    check_every_n_steps: int = 1
    """Replica check frequency in optimizer steps."""
    rtol: float = 1e-6
    """Drift tolerance relative to ``sum(|p|)`` of a parameter."""
    atol: float = 0.0
    """Absolute drift tolerance on the fingerprints."""
    on_drift: Literal["report", "resync", "raise"] = "report"
    """``resync`` broadcasts drifting parameters from the reference rank."""
    max_full_compare: int = 8
    """At most this many drifting parameters are gathered in full per group and step."""
    module_depth: int = 2
    """Name components that define a module for per-module norms (``layers.3``)."""
    explode_factor: float = 10.0
    """A module norm above this multiple of its EMA is exploding."""
    max_module_grad_norm: float | None = None
    """Absolute per-module gradient-norm limit (``None``: only the relative test)."""
    warmup_steps: int = 5
    """Steps before the relative explosion test is armed."""
    ema_beta: float = 0.9
    """EMA coefficient of module norms and of the noise-scale terms."""
    batch_size: int | None = None
    """Per-rank micro-batch size; default: first dimension of the first tensor in the batch."""
    expert_patterns: tuple[str, ...] = ("*experts*",)
    """Parameter-name patterns of expert weights (replicated over ``edp``, not ``dp``)."""
    max_records_per_step: int = 32
    """Cap on JSON records one rank writes per step and check."""
    log_metrics: bool = True
    """Log ``stability/*`` metrics through the LightningModule's logger."""

    def __post_init__(self) -> None:
        positive = (
            "check_every_n_steps",
            "max_full_compare",
            "module_depth",
            "max_records_per_step",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} ({getattr(self, name)}) must be >= 1.")
        if self.on_drift not in ("report", "resync", "raise"):
            raise ValueError(f"on_drift ({self.on_drift!r}) must be 'report', 'resync' or 'raise'.")
        if self.explode_factor <= 1.0:
            raise ValueError(f"explode_factor ({self.explode_factor}) must be > 1, e.g. 10.0.")
        if not 0.0 <= self.ema_beta < 1.0:
            raise ValueError(f"ema_beta ({self.ema_beta}) must be in [0, 1), e.g. 0.9.")
        if self.rtol < 0 or self.atol < 0:
            raise ValueError(f"rtol ({self.rtol}) and atol ({self.atol}) must be >= 0.")


@dataclass(kw_only=True)
class FallbackConfig:
    """Configuration of :class:`FP8FallbackCallback`."""

    max_retries: int = 2
    """Recoveries per step before :class:`FP8FallbackError`."""
    clip_grad_norm: float | None = 1.0
    """Clip the recomputed gradients to this total norm (``None``: no clipping)."""
    fallback_precision: Literal["bf16", "fp32"] = "bf16"
    """Precision offending modules are switched to."""
    return_to_fp8_after: int | None = None
    """Switch fallen-back modules to FP8 again after this many clean steps (``None``: never)."""
    snapshot_every_n_steps: int = 1
    """Refresh the in-memory snapshot every N clean, drift-checked steps."""
    snapshot_device: Literal["same", "cpu"] = "same"
    """Where snapshot tensors live (``cpu`` saves accelerator memory, costs copies)."""
    check_fp8_stats: bool = True
    """Treat FP8 amax overflow / non-finite amax as anomalies."""
    check_drift: bool = True
    """Treat replica drift reported by the monitor as an anomaly."""

    def __post_init__(self) -> None:
        if self.max_retries < 1:
            raise ValueError(f"max_retries ({self.max_retries}) must be >= 1, e.g. 2.")
        if self.clip_grad_norm is not None and self.clip_grad_norm <= 0:
            raise ValueError(f"clip_grad_norm ({self.clip_grad_norm}) must be > 0 or None.")
        if self.fallback_precision not in ("bf16", "fp32"):
            raise ValueError(
                f"fallback_precision ({self.fallback_precision!r}) must be 'bf16' or 'fp32'."
            )
        if self.return_to_fp8_after is not None and self.return_to_fp8_after < 1:
            raise ValueError(f"return_to_fp8_after ({self.return_to_fp8_after}) must be >= 1.")
        if self.snapshot_every_n_steps < 1:
            raise ValueError(
                f"snapshot_every_n_steps ({self.snapshot_every_n_steps}) must be >= 1."
            )
        if self.snapshot_device not in ("same", "cpu"):
            raise ValueError(f"snapshot_device ({self.snapshot_device!r}) must be 'same' or 'cpu'.")
