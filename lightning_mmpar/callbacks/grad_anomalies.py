"""Non-finite and exploding gradients per named module: part (c) of
:class:`~lightning_mmpar.callbacks.GradientDriftMonitor`.

A module (the first ``module_depth`` parts of its parameters' names, e.g. ``layers.3``) is
*exploding* when its gradient norm exceeds ``explode_factor`` times its EMA after
``warmup_steps``, or the absolute ``max_module_grad_norm``; a parameter is *non-finite* when its
synchronised gradient (``nonfinite_grad``) or this rank's own pre-sync gradient
(``nonfinite_local_grad``, which names the rank where a NaN started) is NaN or infinite. Each
becomes an :class:`~lightning_mmpar.callbacks.anomalies.Anomaly` with rank, name, shape and step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from torch import Tensor

from lightning_mmpar.callbacks.anomalies import Anomaly
from lightning_mmpar.callbacks.grad_stats import LocalGradCapture
from lightning_mmpar.callbacks.stability_config import DriftConfig
from lightning_mmpar.parallel import comm


class ModuleNorms:
    """Per-module gradient norms and their EMAs (kept across steps and in checkpoints)."""

    def __init__(self) -> None:
        self.ema: dict[str, float] = {}

    @staticmethod
    def squares(
        named: Sequence[tuple[str, Tensor]], norms: list[float], weights: list[float], depth: int
    ) -> dict[str, float]:
        """Weighted local squared norm per module (first ``depth`` name parts)."""
        sq: dict[str, float] = {}
        for (n, _), v, w in zip(named, norms, weights, strict=True):
            mod = ".".join(n.split(".")[:-1][:depth]) or "<root>"
            sq[mod] = sq.get(mod, 0.0) + w * v * v
        return sq

    def exploding(self, modules: dict[str, float], step: int, cfg: DriftConfig) -> list[str]:
        """Modules whose global norm in ``modules`` explodes at ``step``; the EMAs of the others
        move on (an exploding norm is kept out of its EMA)."""
        out = []
        for m, v in modules.items():
            if not math.isfinite(v):
                continue
            ema = self.ema.get(m)
            rel = ema is not None and step >= cfg.warmup_steps and v > cfg.explode_factor * ema
            if rel or (cfg.max_module_grad_norm is not None and v > cfg.max_module_grad_norm):
                out.append(m)
                continue
            self.ema[m] = v if ema is None else cfg.ema_beta * ema + (1 - cfg.ema_beta) * v
        return out


def nonfinite_local(
    capture: LocalGradCapture | None, local_sq: list[float]
) -> list[dict[str, Any]]:
    """This rank's parameters with a non-finite pre-sync gradient, as
    ``{rank, param, shape, norm}``."""
    if capture is None:
        return []
    me = comm.group_rank()
    return [
        {"rank": me, "param": n, "shape": s, "norm": math.sqrt(v) if v >= 0 else v}
        for n, s, v in zip(capture.names, capture.shapes, local_sq, strict=True)
        if not math.isfinite(v)
    ]


def grad_anomalies(
    *,
    step: int,
    action: str,
    named: Sequence[tuple[str, Tensor]],
    norms: list[float],
    local_bad: list[dict[str, Any]],
    nonfinite: list[str],
    origin: list[dict[str, Any]],
    modules: dict[str, float],
    exploding: list[str],
    module_ema: dict[str, float],
    explode_factor: float,
) -> list[Anomaly]:
    """This rank's records of one inspection: its non-finite local gradients (``local_bad``),
    its parameters with a non-finite synchronised gradient (``nonfinite``, with every rank's
    ``origin``) and its exploding modules, in that order."""
    me = comm.group_rank()
    shapes = {n: list(comm.to_local(p).shape) for n, p in named}
    norm_of = dict(zip([n for n, _ in named], norms, strict=True))
    local = [
        Anomaly(
            kind="nonfinite_local_grad",
            step=step,
            rank=me,
            group="local",
            param=o["param"],
            shape=o["shape"],
            values={"local_norm": o["norm"]},
            action=action,
        )
        for o in local_bad
    ]
    synced = [
        Anomaly(
            kind="nonfinite_grad",
            step=step,
            rank=me,
            group="world",
            param=n,
            shape=shapes[n],
            values={"norm": norm_of[n], "origin": origin},
            action=action,
        )
        for n in nonfinite
    ]
    values = {m: {"norm": modules[m], "ema": module_ema.get(m)} for m in exploding}
    exploded = [
        Anomaly(
            kind="exploding_grad",
            step=step,
            rank=me,
            group="local",
            param=m,
            values={**values[m], "explode_factor": explode_factor},
            action=action,
        )
        for m in exploding
    ]
    return local + synced + exploded
