"""DynamicMicroBatching: re-choose the pipeline micro-batch size from memory and latency.

Every ``every_n_steps`` optimizer steps the micro-batch size is chosen again from the peak
memory headroom and the measured cross-attention latency. The default policy
(:func:`brief_policy`) is this package's own, a heuristic (no paper): smaller micro-batches when
memory is short or the cross-attention slow::

    mbs = max(2, int(8 * max(0.3, 1 - peak_mem / limit) * max(0.4, 1 - min(lat_ms, 80) / 80)))

* memory: on CUDA ``torch.cuda.max_memory_allocated`` since the last decision against
  ``memory_limit_bytes`` (default: the device's total memory); on CPU the process resident set
  (psutil, else ``/proc/self/statm``, else ``resource``'s peak) against ``memory_limit_bytes``
  (default: the machine's physical memory);
* latency: mean wall time (ms) of one forward of the watched modules (default: the outermost
  modules whose class name contains ``"Adapter"``, i.e. the fusion model's cross-attention
  adapters; or ``latency_modules``, ``fnmatch`` patterns of module names), timed by forward
  pre/post hooks during the batch before each decision (CUDA synchronised around each call).

Every rank contributes: the memory fraction and latency are maxed over the world (one
all-reduce through :mod:`lightning_mmpar.parallel.comm`), so all ranks take the same decision.
The size is rounded to the nearest valid one: ``n = batch / mbs`` micro-batches must divide the
per-rank batch and be accepted by the engine (``engine.set_micro_batches`` raises
``ValueError`` below the schedule's minimum; the neighbours are tried, nearest first, smaller
size on ties). Hysteresis (:class:`Hysteresis`): a new size is applied only once the same size
was chosen ``patience`` decisions in a row, so sizes change at most every
``patience * every_n_steps`` steps and alternating inputs never make them oscillate.

The global batch never changes, only its split into micro-batches: the engine scales gradients
by ``1 / n``, so losses and gradients equal the static run's up to summation order. Logged every
step: ``micro_batch_size`` and ``num_micro_batches`` (of the step just run). Without a pipeline
(another strategy, ``pipeline_parallel=1``) the callback warns once and does nothing.
"""

from __future__ import annotations

import fnmatch
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_mmpar.callbacks.pipeline_timeline import no_pipeline
from lightning_mmpar.parallel import comm
from lightning_mmpar.trainer_topology import TrainerTopology

Policy = Callable[[float, float], int]
"""``(peak_mem / limit, latency_ms) -> micro-batch size``."""
MemorySource = Callable[[], tuple[float, float]]
"""``() -> (peak bytes since the last call, limit bytes)``."""


def brief_policy(memory_fraction: float, latency_ms: float) -> int:
    """This package's default micro-batch size (a heuristic): ``max(2, int(8 * max(0.3, 1 -
    memory_fraction) * max(0.4, 1 - min(latency_ms, 80) / 80)))``; between 2 and 8."""
    memory = max(0.3, 1.0 - memory_fraction)
    latency = max(0.4, 1.0 - min(latency_ms, 80.0) / 80.0)
    return max(2, int(8 * memory * latency))


def rss_bytes() -> int:
    """This process's resident set size (bytes): psutil, else ``/proc/self/statm``, else the
    peak resident set from ``resource`` (Linux reports KiB)."""
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        pass
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def physical_memory_bytes() -> int:
    """The machine's physical memory (bytes)."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


class DeviceMemory:
    """Default :data:`MemorySource` for ``device``: CUDA peak allocated bytes since the last call
    (the peak is reset after each reading), else the process resident set; against ``limit``
    (``None``: the device's total memory, or the machine's physical memory on CPU)."""

    def __init__(self, device: torch.device, limit: int | None = None) -> None:
        self.device = device
        self.limit = limit

    def __call__(self) -> tuple[float, float]:
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            total = torch.cuda.get_device_properties(self.device).total_memory
            return float(peak), float(self.limit or total)
        return float(rss_bytes()), float(self.limit or physical_memory_bytes())


def watched_modules(root: nn.Module, patterns: Sequence[str] | None) -> dict[str, nn.Module]:
    """Modules of ``root`` to time: names matching any ``fnmatch`` pattern, or (``None``) the
    outermost modules whose class name contains ``"Adapter"``."""
    found: dict[str, nn.Module] = {}
    for name, module in root.named_modules():
        if patterns is not None:
            hit = any(fnmatch.fnmatchcase(name, p) for p in patterns)
        else:
            hit = "Adapter" in type(module).__name__
            hit = hit and not any(name.startswith(f"{outer}.") for outer in found)
        if hit:
            found[name] = module
    return found


class LatencyMeter:
    """Forward pre/post hooks on ``modules`` timing each call with ``clock`` (seconds) while
    :attr:`active`; ``synchronize`` (CUDA) runs before each reading."""

    def __init__(
        self,
        modules: Sequence[nn.Module],
        clock: Callable[[], float] = time.perf_counter,
        synchronize: Callable[[], None] | None = None,
    ) -> None:
        self.clock = clock
        self.synchronize = synchronize
        self.active = False
        self._starts: list[float] = []
        self._total = 0.0
        self._calls = 0
        self._handles = [
            h
            for m in modules
            for h in (m.register_forward_pre_hook(self._pre), m.register_forward_hook(self._post))
        ]

    def _now(self) -> float:
        if self.synchronize is not None:
            self.synchronize()
        return self.clock()

    def _pre(self, module: nn.Module, args: Any) -> None:
        if self.active:
            self._starts.append(self._now())

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.active and self._starts:
            self._total += self._now() - self._starts.pop()
            self._calls += 1

    def take(self) -> float | None:
        """Mean milliseconds per timed call since the last take (``None``: no call); resets."""
        mean = None if self._calls == 0 else 1e3 * self._total / self._calls
        self._starts, self._total, self._calls = [], 0.0, 0
        return mean

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class Hysteresis:
    """Apply a new value only after it was proposed ``patience`` times in a row."""

    def __init__(self, patience: int) -> None:
        self.patience = patience
        self._candidate: int | None = None
        self._count = 0

    def propose(self, value: int, current: int) -> int | None:
        """``value`` when it differs from ``current`` and was proposed ``patience`` times in a
        row (the streak then restarts), else ``None``."""
        if value == current:
            self._candidate, self._count = None, 0
            return None
        self._count = self._count + 1 if value == self._candidate else 1
        self._candidate = value
        if self._count < self.patience:
            return None
        self._candidate, self._count = None, 0
        return value


def nearest_valid(
    target: int, batch: int, accepts: Callable[[int], bool], multiple: int = 1
) -> int | None:
    """The micro-batch size nearest ``target`` that divides ``batch``, is a multiple of
    ``multiple`` and whose count ``batch // size`` is accepted (``accepts(n)``); smaller size
    first on ties; ``None`` when none is."""
    sizes = sorted(
        (s for s in range(multiple, batch + 1, multiple) if batch % s == 0),
        key=lambda s: (abs(s - target), s),
    )
    return next((s for s in sizes if accepts(batch // s)), None)


def _check_int(name: str, value: Any, minimum: int, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(
            f"DynamicMicroBatching {name} ({value!r}) must be an integer >= {minimum}; {fix}."
        )


class DynamicMicroBatching(Callback):
    """Re-choose the pipeline micro-batch size every ``every_n_steps`` steps.

    Args:
        every_n_steps: optimizer steps between decisions.
        patience: decisions in a row that must choose the same new size before it is applied.
        policy: :data:`Policy` (default :func:`brief_policy`).
        memory_limit_bytes: the memory limit of the headroom (``None``: see :class:`DeviceMemory`).
        memory_source: :data:`MemorySource` replacing :class:`DeviceMemory` (tests: a fake).
        latency_modules: ``fnmatch`` patterns of module names to time (``None``: the adapters).
        clock: seconds clock of the latency hooks (tests: a fake).
        size_multiple: every chosen size is a multiple of this (the tensor-parallel size under
            ``vision_parallel="dp"``, whose ranks split each micro-batch's images).

    Attributes: :attr:`decisions` (one dict per decision: ``step``, ``memory_fraction``,
    ``latency_ms``, ``policy_size``, ``chosen_size``, ``applied``), :attr:`modules` (the timed
    modules by name). Raises ``ValueError`` (naming the argument, its value and a fix) on invalid
    arguments or a policy result that is not a positive integer.
    Collective: one all-reduce over the world on decision steps.
    """

    def __init__(
        self,
        every_n_steps: int = 10,
        patience: int = 2,
        policy: Policy = brief_policy,
        memory_limit_bytes: int | None = None,
        memory_source: MemorySource | None = None,
        latency_modules: Sequence[str] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        size_multiple: int = 1,
    ) -> None:
        _check_int("every_n_steps", every_n_steps, 1, "use e.g. 10")
        _check_int("size_multiple", size_multiple, 1, "use the tensor-parallel size or 1")
        _check_int("patience", patience, 1, "use 1 to apply every new choice at once")
        if memory_limit_bytes is not None:
            _check_int(
                "memory_limit_bytes", memory_limit_bytes, 1, "use None for the device's memory"
            )
        if isinstance(latency_modules, str):
            raise ValueError(
                f"DynamicMicroBatching latency_modules ({latency_modules!r}) must be a sequence of "
                "patterns, not one string; use [" + repr(latency_modules) + "]."
            )
        self.every_n_steps = every_n_steps
        self.policy = policy
        self.memory_limit_bytes = memory_limit_bytes
        self.memory_source = memory_source
        self.latency_modules = None if latency_modules is None else list(latency_modules)
        self.clock = clock
        self.size_multiple = size_multiple
        self.hysteresis = Hysteresis(patience)
        self.decisions: list[dict[str, Any]] = []
        self.modules: dict[str, nn.Module] = {}
        self._engine: Any = None
        self._meter: LatencyMeter | None = None
        self._warned = False
        self._batch = 0
        self._n = 0
        self._decided = -1
        self._configured: int | None = None  # the count the run started with (evaluation)
        self._chosen: int | None = None

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        engine = TrainerTopology.of(trainer).engine_with("set_micro_batches")
        if engine is None:
            if not self._warned:
                effect = "the micro-batch size stays as it is"
                rank_zero_warn(no_pipeline("DynamicMicroBatching", trainer, effect))
                self._warned = True
            return
        self._engine = engine
        self._configured = int(engine.num_micro_batches)
        device = trainer.strategy.root_device
        if self.memory_source is None:
            self.memory_source = DeviceMemory(device, self.memory_limit_bytes)
        self.modules = watched_modules(pl_module, self.latency_modules)
        if not self.modules:
            rank_zero_warn(
                "DynamicMicroBatching: no module to time (latency_modules="
                f"{self.latency_modules!r}); the latency factor stays 1."
            )
        sync = torch.cuda.synchronize if device.type == "cuda" else None
        self._meter = LatencyMeter(list(self.modules.values()), self.clock, sync)

    def _use(self, n: int | None) -> None:
        if self._engine is not None and n and n != self._engine.num_micro_batches:
            self._engine.set_micro_batches(n)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # evaluation (a last batch smaller than the training batch, greedy decoding) runs with
        # the configured count, which the strategy checked against the data; training resumes
        # with the chosen one
        self._chosen = None if self._engine is None else self._engine.num_micro_batches
        self._use(self._configured)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._use(self._chosen)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._use(self._configured)  # before any callback's on_fit_end evaluates or decodes

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._meter is not None:
            self._meter.remove()
        self._engine = self._meter = None

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._engine is None or self._meter is None:
            return
        inputs, _ = pl_module.pipeline_inputs(batch)  # type: ignore[operator]
        self._batch, self._n = int(inputs[0].shape[0]), int(self._engine.num_micro_batches)
        self._meter.active = (trainer.global_step + 1) % self.every_n_steps == 0

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self._engine is None or self._meter is None:
            return
        pl_module.log(
            "micro_batch_size", float(self._batch // self._n), on_step=True, on_epoch=False
        )
        pl_module.log("num_micro_batches", float(self._n), on_step=True, on_epoch=False)
        step = trainer.global_step
        if step == 0 or step % self.every_n_steps != 0 or step == self._decided:
            return
        self._decided = step
        self._meter.active = False
        self.decide(step)

    def decide(self, step: int) -> dict[str, Any]:
        """One decision (collective): measure, apply the policy, round, apply with hysteresis."""
        assert self.memory_source is not None and self._meter is not None
        peak, limit = self.memory_source()
        latency = self._meter.take()
        values = torch.tensor(
            [peak / limit, -1.0 if latency is None else latency], dtype=torch.float64
        )
        comm.all_reduce(values, "max")  # every rank decides alike
        fraction, lat_ms = float(values[0]), max(0.0, float(values[1]))
        target = self.policy(fraction, lat_ms)
        if isinstance(target, bool) or not isinstance(target, int) or target < 1:
            raise ValueError(
                f"DynamicMicroBatching policy returned {target!r} for memory fraction "
                f"{fraction:.3f} and latency {lat_ms:.2f} ms; a policy must return a positive int."
            )
        current = self._batch // self._n
        chosen = nearest_valid(target, self._batch, self._accepts, self.size_multiple) or current
        applied = self.hysteresis.propose(chosen, current)
        if applied is not None:
            self._engine.set_micro_batches(self._batch // applied)
            rank_zero_info(
                f"DynamicMicroBatching: step {step}: micro-batch size {current} -> {applied} "
                f"({self._batch // applied} micro-batches; memory {fraction:.1%} of the limit, "
                f"cross-attention {lat_ms:.2f} ms)."
            )
        record = {
            "step": step,
            "memory_fraction": fraction,
            "latency_ms": lat_ms,
            "policy_size": target,
            "chosen_size": chosen,
            "applied": applied,
        }
        self.decisions.append(record)
        return record

    def _accepts(self, n: int) -> bool:
        """Whether the engine takes ``n`` micro-batches (probed, then the current count set
        back: ``set_micro_batches`` acts from the next step on)."""
        if n == self._n:
            return True
        try:
            self._engine.set_micro_batches(n)
        except ValueError:
            return False
        self._engine.set_micro_batches(self._n)
        return True
