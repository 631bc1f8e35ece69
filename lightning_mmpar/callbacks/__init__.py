"""Stability callbacks that work in any Lightning Trainer (one device, DDP, FSDP,
``ModelParallelStrategy``, ``mm_parallel``): gradient drift and noise scale, FP8 fallback,
MoE expert load, the expert sparsity schedule, per-branch gradient clipping, the measured
pipeline bubble (:class:`PipelineTimeline`) and dynamic micro-batching.

They find their process groups through :meth:`lightning_mmpar.topology.ParallelDims.of` and
communicate through :mod:`lightning_mmpar.parallel.comm`.
"""

from lightning_mmpar.callbacks.anomalies import Anomaly, AnomalyLog
from lightning_mmpar.callbacks.branch_clipping import BranchGradientClipping
from lightning_mmpar.callbacks.expert_load import ExpertLoadMonitor
from lightning_mmpar.callbacks.expert_sparsity import ExpertSparsitySchedule
from lightning_mmpar.callbacks.fp8_fallback import FP8FallbackCallback, FP8FallbackError
from lightning_mmpar.callbacks.fp8_training import FP8Training
from lightning_mmpar.callbacks.grad_drift import GradientDriftMonitor, GradReport
from lightning_mmpar.callbacks.micro_batching import DynamicMicroBatching, brief_policy
from lightning_mmpar.callbacks.peak_memory import PeakMemory
from lightning_mmpar.callbacks.periodic_checkpoint import PeriodicCheckpoint
from lightning_mmpar.callbacks.pipeline_timeline import PipelineTimeline, formula_bubble
from lightning_mmpar.callbacks.preemption import Preemption
from lightning_mmpar.callbacks.replicas import Drift, ReplicaGroup
from lightning_mmpar.callbacks.snapshot import Snapshot
from lightning_mmpar.callbacks.stability_config import DriftConfig, FallbackConfig

__all__ = [
    "Anomaly",
    "AnomalyLog",
    "BranchGradientClipping",
    "Drift",
    "DriftConfig",
    "DynamicMicroBatching",
    "ExpertLoadMonitor",
    "ExpertSparsitySchedule",
    "FP8FallbackCallback",
    "FP8FallbackError",
    "FP8Training",
    "FallbackConfig",
    "GradReport",
    "GradientDriftMonitor",
    "PeakMemory",
    "PeriodicCheckpoint",
    "PipelineTimeline",
    "Preemption",
    "ReplicaGroup",
    "Snapshot",
    "brief_policy",
    "formula_bubble",
]
