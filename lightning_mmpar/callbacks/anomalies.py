"""Anomaly records shared by the stability callbacks.

Every anomaly becomes one JSON line in ``<log_dir>/anomalies.jsonl`` (each rank appends its
own lines with a single ``write``) and one WARNING log line naming rank, what happened and what
was done about it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("lightning_mmpar.stability")


@dataclass(kw_only=True)
class Anomaly:
    """One detected problem and the action taken."""

    kind: str
    """e.g. ``nonfinite_grad``, ``nonfinite_local_grad``, ``exploding_grad``,
    ``replica_drift``, ``fp8_overflow``, ``fp8_nonfinite``, ``fp8_fallback``, ``step_redone``."""
    step: int
    """``trainer.global_step`` when detected."""
    rank: int
    """Global rank that wrote the record."""
    group: str
    """Process group the check ran over (``world``, ``dp``, ``tp``, ``edp``, ``local``)."""
    action: str
    """What was done (``reported``, ``switched ... to bf16, restored ..., redid step``...)."""
    param: str | None = None
    """Parameter (or module) name."""
    shape: list[int] | None = None
    """Tensor shape of that parameter (local shard for DTensors)."""
    values: dict[str, Any] = field(default_factory=dict)
    """Measured values (norms, fingerprints, amax, ranks involved)."""


def _clean(v: Any) -> Any:
    """Make ``v`` strict JSON: non-finite floats become strings."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_clean(x) for x in v]
    return v


class AnomalyLog:
    """Append-only JSONL file plus an in-memory list of this rank's records."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path is not None else None
        self.records: list[Anomaly] = []
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def record(self, anomaly: Anomaly) -> None:
        """Store, append to the file and log loudly."""
        self.records.append(anomaly)
        where = f" {anomaly.param} {anomaly.shape}" if anomaly.param else ""
        log.warning(
            "[rank %d] step %d: %s%s (group %s) %s -> %s",
            anomaly.rank,
            anomaly.step,
            anomaly.kind,
            where,
            anomaly.group,
            json.dumps(_clean(anomaly.values)),
            anomaly.action,
        )
        if self.path is not None:
            line = json.dumps({"time": time.time(), **_clean(asdict(anomaly))}) + "\n"
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
