"""ExpertSparsitySchedule: the expert pruning mask with a cosine sparsity ramp.

The sparsity after ``t`` optimizer steps of ``T`` is the cosine ramp (the shape of the cosine
learning-rate schedule, Loshchilov & Hutter 2017, SGDR)::

    s(t) = s0 + (s1 - s0) * (1 - cos(pi * min(t, T) / T)) / 2          (s0 0.1, s1 0.7)

After every optimizer step each :class:`~lightning_mmpar.models.moe.MoEFeedForward` of the
LightningModule keeps ``n = ceil((1 - s) * E)`` experts routable (never fewer than its
``top_k``, never more than ``E``) and prunes the others through its persistent ``expert_mask``
buffer (masked experts get ``-inf`` router logits, so no token reaches them). The ``n`` kept
experts are those with the largest *load*: kept routes (``last_stats[m].kept_per_expert``,
summed over modalities) accumulated since fit start; ties keep the lower expert id. A pruned
expert receives no route, so its load stops growing; an expert comes back only when the
sparsity decreases (``s1 < s0``). The mask is unchanged before the first optimizer step.

Every rank must hold the same mask: each step's loads are summed over the ranks of the
pipeline stage (the data-parallel, then the tensor-parallel group, as
:attr:`lightning_mmpar.trainer_topology.TrainerTopology.stage_groups` gives them; one small
all-reduce per group and step, through :mod:`lightning_mmpar.parallel.comm`). Tensor-parallel
peers that route the same tokens multiply every count by ``tp``, which leaves the ranking
unchanged; peers that route different tokens (sequence parallelism) add up as they should.

The masks are saved with the model (``expert_mask`` is a persistent buffer); the schedule's own
state (loads since fit start, last step and sparsity) through :meth:`state_dict`. Logged on the
Trainer's logging steps: ``<prefix>/sparsity`` and ``<prefix>/<layer>/active_experts``.

Sources: the ramp and its defaults are this package's schedule; pruning the least-used experts as
in "Task-Specific Expert Pruning for Sparse Mixture-of-Experts" (Chen et al. 2022, which also
prunes progressively during fine-tuning). Limitation: under a pipeline schedule ``last_stats``
holds the last micro-batch of each step only (as for
:class:`~lightning_mmpar.callbacks.ExpertLoadMonitor`).
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from typing_extensions import override

from lightning_mmpar.callbacks.expert_load import moe_layers
from lightning_mmpar.callbacks.grad_stats import log_due
from lightning_mmpar.models.moe import MoEFeedForward
from lightning_mmpar.parallel import comm
from lightning_mmpar.trainer_topology import TrainerTopology

__all__ = ["ExpertSparsitySchedule", "active_expert_count", "cosine_sparsity", "pruning_mask"]


def _fraction(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
        raise ValueError(
            f"ExpertSparsitySchedule {name} ({value!r}) must be a number in [0, 1] (the fraction "
            "of experts pruned); use e.g. 0.1 for s0 and 0.7 for s1."
        )
    return float(value)


def _positive_steps(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"ExpertSparsitySchedule {name} ({value!r}) must be a positive integer number of "
            "optimizer steps; pass total_steps=... or give the Trainer max_steps / max_epochs."
        )
    return value


def cosine_sparsity(step: int, total: int, s0: float = 0.1, s1: float = 0.7) -> float:
    """``s0 + (s1 - s0) * (1 - cos(pi * t / total)) / 2`` with ``t = min(max(step, 0), total)``:
    ``s0`` at step 0, the mean at ``total / 2``, ``s1`` from ``total`` on.

    Raises ``ValueError`` when ``total`` is not a positive integer or ``s0`` / ``s1`` is
    outside ``[0, 1]``.
    """
    total = _positive_steps("total", total)
    s0, s1 = _fraction("s0", s0), _fraction("s1", s1)
    t = min(max(int(step), 0), total)
    return s0 + (s1 - s0) * (1.0 - math.cos(math.pi * t / total)) / 2.0


def active_expert_count(sparsity: float, num_experts: int, top_k: int) -> int:
    """Experts kept at ``sparsity``: ``ceil((1 - sparsity) * E)`` clamped to ``[max(top_k, 1),
    E]`` (``ceil`` with a 1e-9 slack, so that ``(1 - 0.7) * 10`` gives 3, not 4)."""
    keep = math.ceil((1.0 - float(sparsity)) * num_experts - 1e-9)
    return max(min(keep, num_experts), top_k, 1)


def pruning_mask(load: Tensor, keep: int) -> Tensor:
    """``[E]`` bool mask keeping the ``keep`` experts of largest ``load [E]``; ties keep the
    lower expert id. Raises ``ValueError`` unless ``1 <= keep <= E``."""
    e = load.numel()
    if not 1 <= keep <= e:
        raise ValueError(f"pruning_mask keep ({keep}) must be in [1, {e}]; keep >= 1 expert.")
    # a stable descending sort of the loads in id order: equal loads keep the lower id first
    order = torch.sort(load.detach().double().cpu(), descending=True, stable=True).indices
    mask = torch.zeros(e, dtype=torch.bool)
    mask[order[:keep]] = True
    return mask.to(load.device)


class ExpertSparsitySchedule(Callback):
    """Prune the least-loaded experts of every ``MoEFeedForward`` along a cosine sparsity ramp.

    See the module docstring for the rule. Args:
        total_steps: ``T``, optimizer steps of the ramp (``None``: the Trainer's
            ``estimated_stepping_batches`` at fit start).
        s0: sparsity at step 0 (fraction of experts pruned).
        s1: sparsity from step ``T`` on.
        prefix: first part of the logged names.

    Raises ``ValueError`` (naming the argument, its value and a fix) on invalid arguments, and
    at fit start when ``total_steps`` is ``None`` and the Trainer's step count is unbounded.
    Attributes: :attr:`layers` (name -> layer), :attr:`loads` (name -> ``[E]`` float64 kept
    routes since fit start, summed over the stage's ranks), :attr:`sparsity` (last applied),
    :attr:`active` (name -> experts kept).
    """

    def __init__(
        self,
        total_steps: int | None = None,
        s0: float = 0.1,
        s1: float = 0.7,
        prefix: str = "moe",
    ) -> None:
        if total_steps is not None:
            _positive_steps("total_steps", total_steps)
        if not isinstance(prefix, str) or not prefix.strip("/"):
            raise ValueError(
                f"ExpertSparsitySchedule prefix ({prefix!r}) must be a non-empty string; use "
                "e.g. 'moe'."
            )
        self.total_steps = total_steps
        self.s0, self.s1 = _fraction("s0", s0), _fraction("s1", s1)
        self.prefix = prefix.strip("/")
        self.layers: dict[str, MoEFeedForward] = {}
        self.loads: dict[str, Tensor] = {}
        self.active: dict[str, int] = {}
        self.sparsity: float | None = None
        self._total = total_steps or 0
        self._pending: dict[str, Tensor] = {}
        self._groups: list[Any] = []
        self._step = -1  # global_step of the last mask update
        self._restored: dict[str, Any] = {}

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        total = self.total_steps
        if total is None:
            estimated = trainer.estimated_stepping_batches
            if not math.isfinite(estimated):
                raise ValueError(
                    f"ExpertSparsitySchedule total_steps is None and the Trainer's step count "
                    f"is unbounded ({estimated}); pass total_steps=... or set max_steps."
                )
            total = max(int(estimated), 1)
        self._total = total
        self.layers = moe_layers(pl_module, "ExpertSparsitySchedule", "nothing is pruned")
        saved = self._restored.get("loads", {})
        self.loads = {}
        for name, layer in self.layers.items():
            e = layer.config.num_experts
            old = saved.get(name)
            ok = old is not None and len(old) == e
            self.loads[name] = torch.tensor(old if ok else [0.0] * e, dtype=torch.float64)
        self._pending = {name: torch.zeros_like(v) for name, v in self.loads.items()}
        self._step = int(self._restored.get("step", trainer.global_step))
        self.sparsity = self._restored.get("sparsity")
        self._restored = {}
        self._groups = TrainerTopology.of(trainer).stage_groups

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        for name, layer in self.layers.items():
            for stats in layer.last_stats.values():
                self._pending[name] += stats.kept_per_expert.detach().double().cpu()
        step = trainer.global_step
        if step != self._step:  # an optimizer step ran since the last update
            self._step = step
            self.update_masks(step)  # collective: same steps on every rank
        if self.sparsity is not None and log_due(trainer):
            pl_module.log(f"{self.prefix}/sparsity", self.sparsity, on_step=True, on_epoch=False)
            for name, n in self.active.items():
                key = f"{self.prefix}/{name}/active_experts"
                pl_module.log(key, float(n), on_step=True, on_epoch=False)

    def update_masks(self, step: int) -> float:
        """Add the pending loads (summed over the stage's ranks) to :attr:`loads` and set every
        layer's ``expert_mask`` for ``s(step)``; returns that sparsity. Collective over the
        stage groups (every rank of the stage must call it)."""
        names = list(self.layers)
        if names:
            vec = torch.cat([self._pending[n] for n in names])
            for group in self._groups:
                comm.all_reduce(vec, "sum", group)
            offset = 0
            for n in names:
                e = self.loads[n].numel()
                self.loads[n] += vec[offset : offset + e]
                self._pending[n].zero_()
                offset += e
        s = cosine_sparsity(step, self._total, self.s0, self.s1)
        for n, layer in self.layers.items():
            keep = active_expert_count(s, layer.config.num_experts, layer.config.top_k)
            layer.expert_mask.copy_(pruning_mask(self.loads[n], keep))
            self.active[n] = keep
        self.sparsity = s
        return s

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "loads": {n: v.tolist() for n, v in self.loads.items()},
            "step": self._step,
            "sparsity": self.sparsity,
            "total_steps": self._total,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore loads, last step and sparsity; applied at the next fit start (layers whose
        expert count changed start from zero load)."""
        self._restored = dict(state_dict)
        self.sparsity = state_dict.get("sparsity")
