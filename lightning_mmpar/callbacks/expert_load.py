"""ExpertLoadMonitor: per layer and modality router statistics of MoE layers, logged and drawn.

Every :class:`lightning_mmpar.models.moe.MoEFeedForward` in the LightningModule is watched (its
module name is the *layer*). After each training batch the layer's ``last_stats`` (modality ->
:class:`~lightning_mmpar.models.moe.MoEStats`) is added to a running sum: routes per expert
before dropping (``tokens_per_expert``), kept routes per expert, tokens, and the token-weighted
sums of the per-forward means (top-1 share, routing entropy, load-balancing loss, z-loss). On the
Trainer's logging steps (``Trainer(log_every_n_steps=...)``) the sums of the interval are summed
over the data-parallel group (one all-reduce of one fixed-layout vector, through
:mod:`lightning_mmpar.parallel.comm`) and logged by ``pl_module.log`` as
``<prefix>/<layer>/<modality>/<metric>``:

==========================  ==========================================================
``top1_share``              token-weighted mean of the largest router probability
``routing_entropy_bits``    token-weighted mean router entropy (bits, <= ``log2 E``)
``dropped_fraction``        dropped routes / all routes (``k T``) of the interval
``experts_per_token``       kept routes / tokens of the interval
``load_balancing_loss``     token-weighted mean of the unweighted Switch loss (1 = balanced)
``z_loss``                  token-weighted mean of the unweighted router z-loss
``max_load``                ``E * max_e share_e``, share = routes choosing ``e`` / all routes
                            (before dropping); 1.0 = balanced, ``E`` = one expert takes all
==========================  ==========================================================

At fit end (and every ``heatmap_every_n_steps`` optimizer steps if set) rank 0 draws the share
of routes of every expert since the fit started (rows ``layer/modality``, columns experts) to
``<log_dir>/expert_load.png`` (matplotlib, Agg backend), path kept in :attr:`heatmap_path`.

Sources: DeepSpeed's ``exp_counts`` and Megatron-core's per-layer MoE load logging
(``track_moe_metrics``), Switch Transformer (Fedus et al. 2021) and ST-MoE (Zoph et al. 2022)
for the losses. Under a pipeline the sums are also added over the stages (a stage's layers hold
zeros on the other stages), so global rank 0 logs and draws every stage's layers. Limitation:
under a pipeline schedule ``last_stats`` holds the last micro-batch of each step only.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_mmpar.callbacks.grad_stats import log_due
from lightning_mmpar.models.moe import MoEFeedForward, MoEStats
from lightning_mmpar.parallel import comm
from lightning_mmpar.topology import ParallelDims

METRICS = (
    "top1_share",
    "routing_entropy_bits",
    "dropped_fraction",
    "experts_per_token",
    "load_balancing_loss",
    "z_loss",
    "max_load",
)
"""Metric names logged per layer and modality."""

_SCALARS = ("top1_share", "routing_entropy_bits", "load_balancing_loss", "z_loss")
"""Per-forward means accumulated as token-weighted sums."""


def _slot_size(num_experts: int) -> int:
    """Vector entries of one (layer, modality): demand [E], kept [E], tokens, the scalars."""
    return 2 * num_experts + 1 + len(_SCALARS)


def stats_vector(stats: MoEStats, num_experts: int) -> Tensor:
    """One forward's stats as ``[2E + 5]`` float64: routes per expert before dropping ``[E]``,
    kept routes per expert ``[E]``, tokens ``T``, then ``T *`` each of top-1 share, entropy
    (bits), load-balancing loss, z-loss (sums, so that intervals and ranks add up)."""
    tokens = float(stats.tokens)
    scalars = [tokens * float(getattr(stats, name)) for name in _SCALARS]
    head = torch.cat([stats.tokens_per_expert.double().cpu(), stats.kept_per_expert.double().cpu()])
    return torch.cat([head, torch.tensor([tokens, *scalars], dtype=torch.float64)])


def metrics_from_vector(vec: Tensor, num_experts: int) -> dict[str, float] | None:
    """The :data:`METRICS` of one summed ``[2E + 5]`` slot (:func:`stats_vector`); ``None``
    when it saw no token."""
    e = num_experts
    demand, kept, tokens = vec[:e], vec[e : 2 * e], float(vec[2 * e])
    routes = float(demand.sum())
    if tokens <= 0 or routes <= 0:
        return None
    out = {name: float(vec[2 * e + 1 + i]) / tokens for i, name in enumerate(_SCALARS)}
    out["dropped_fraction"] = 1.0 - float(kept.sum()) / routes
    out["experts_per_token"] = float(kept.sum()) / tokens
    out["max_load"] = float(demand.max()) / routes * e
    return out


def moe_layers(module: Any, owner: str, consequence: str) -> dict[str, MoEFeedForward]:
    """Every ``MoEFeedForward`` under ``module`` by module name (``"<root>"`` for the module
    itself); warns once, naming ``owner`` and the ``consequence``, when there is none."""
    layers = {
        name or "<root>": m for name, m in module.named_modules() if isinstance(m, MoEFeedForward)
    }
    if not layers:
        rank_zero_warn(
            f"{owner}: {type(module).__name__} has no MoEFeedForward layer on this rank; "
            f"{consequence}."
        )
    return layers


class ExpertLoadMonitor(Callback):
    """Log router load statistics of every ``MoEFeedForward`` and draw an expert-load heatmap.

    Works in any Trainer (one device, DDP, FSDP, ``mm_parallel``); see the module docstring for
    the metrics. Args:
        heatmap_every_n_steps: also draw the heatmap every this many optimizer steps (``None``:
            at fit end only).
        log_dir: folder of ``expert_load.png`` (``None``: ``trainer.log_dir``, else
            ``trainer.default_root_dir``).
        prefix: first part of every metric name.

    Raises ``ValueError`` (naming the argument, its value and a fix) on invalid arguments.
    Attributes: :attr:`layers` (name -> layer), :attr:`last_metrics` (the values logged last),
    :attr:`totals` (per ``(layer, modality)`` the ``[2E + 5]`` sums since fit start, summed over
    the data-parallel group), :attr:`heatmap_path`.
    """

    def __init__(
        self,
        heatmap_every_n_steps: int | None = None,
        log_dir: str | Path | None = None,
        prefix: str = "moe",
    ) -> None:
        n = heatmap_every_n_steps
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(
                f"ExpertLoadMonitor heatmap_every_n_steps ({n!r}) must be a positive integer or "
                "None; use None to draw the heatmap at fit end only."
            )
        if not isinstance(prefix, str) or not prefix.strip("/"):
            raise ValueError(
                f"ExpertLoadMonitor prefix ({prefix!r}) must be a non-empty string; use e.g. 'moe'."
            )
        if log_dir is not None and not isinstance(log_dir, str | Path):
            raise ValueError(
                f"ExpertLoadMonitor log_dir ({log_dir!r}) must be a str or Path; use None for "
                "the Trainer's log_dir."
            )
        self.heatmap_every_n_steps = n
        self.log_dir = None if log_dir is None else Path(log_dir)
        self.prefix = prefix.strip("/")
        self.layers: dict[str, MoEFeedForward] = {}
        self.last_metrics: dict[str, float] = {}
        self.totals: dict[tuple[str, str], Tensor] = {}
        self.heatmap_path: Path | None = None
        self._slots: list[tuple[str, str, int]] = []  # (layer, modality, num_experts)
        self._pending: Tensor | None = None  # this rank's sums since the last reduction
        self._interval: Tensor | None = None  # reduced sums since the last logged step
        self._total: Tensor | None = None  # reduced sums since fit start
        self._group: Any = None
        self._drawn_step = -1
        self._folder: Path | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # ``trainer.log_dir`` broadcasts under DDP: resolved here, on every rank
        self._folder = self.log_dir or Path(trainer.log_dir or trainer.default_root_dir)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.layers = moe_layers(pl_module, "ExpertLoadMonitor", "nothing is logged")
        self._slots = [
            (name, mod, layer.config.num_experts)
            for name, layer in self.layers.items()
            for mod in layer.config.modalities
        ]
        size = sum(_slot_size(e) for _, _, e in self._slots)
        self._pending = torch.zeros(size, dtype=torch.float64)
        self._interval = torch.zeros(size, dtype=torch.float64)
        self._total = torch.zeros(size, dtype=torch.float64)
        self._group = self._pp_group = None
        if comm.group_size() > 1:
            dims = ParallelDims.of(trainer)
            self._group = dims.get_group("dp") if dims.dp > 1 else None
            if dims.pp > 1:  # rank 0 (first stage) reports every stage's layers
                self._pp_group = self._stage_group(dims.get_group("pp"), size)

    @staticmethod
    def _stage_group(group: Any, size: int) -> Any:
        """``group`` (pipeline) when every stage watches the same layers (the same vector
        size), so summing over it adds each stage's own layers; else ``None`` with a warning."""
        sizes = comm.all_reduce(torch.tensor([size, -size], dtype=torch.float64), "max", group)
        if int(sizes[0]) == size == -int(sizes[1]):
            return group
        rank_zero_warn(
            "ExpertLoadMonitor: pipeline stages hold different MoE layers; each stage reports "
            "its own layers only (global rank 0: the first stage's)."
        )
        return None

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self._pending is None:
            return
        self._accumulate()
        due_log = log_due(trainer)
        n, step = self.heatmap_every_n_steps, trainer.global_step
        due_map = n is not None and step % n == 0 and step != self._drawn_step
        if not (due_log or due_map):
            return
        self._reduce()  # collective: every rank reaches here on the same steps
        if due_log:
            self._log(pl_module)
        if due_map:
            self._drawn_step = step
            self.draw_heatmap(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._pending is None:
            return
        self._reduce()
        self.draw_heatmap(trainer)

    def _accumulate(self) -> None:
        assert self._pending is not None
        offset = 0
        for name, mod, e in self._slots:
            stats = self.layers[name].last_stats.get(mod)
            if stats is not None:
                self._pending[offset : offset + _slot_size(e)] += stats_vector(stats, e)
            offset += _slot_size(e)

    def _reduce(self) -> None:
        """Collective over the data-parallel group: add every rank's pending sums to the
        interval and run totals, then clear them."""
        assert self._pending is not None and self._interval is not None
        assert self._total is not None
        if self._group is not None:
            comm.all_reduce(self._pending, "sum", self._group)
        if self._pp_group is not None:  # layers of other stages hold zeros here
            comm.all_reduce(self._pending, "sum", self._pp_group)
        self._interval += self._pending
        self._total += self._pending
        self._pending.zero_()
        offset = 0
        for name, mod, e in self._slots:
            self.totals[(name, mod)] = self._total[offset : offset + _slot_size(e)].clone()
            offset += _slot_size(e)

    def _log(self, pl_module: pl.LightningModule) -> None:
        assert self._interval is not None
        offset, logged = 0, {}
        for name, mod, e in self._slots:
            values = metrics_from_vector(self._interval[offset : offset + _slot_size(e)], e)
            offset += _slot_size(e)
            for metric, v in (values or {}).items():
                logged[f"{self.prefix}/{name}/{mod}/{metric}"] = v
        self._interval.zero_()
        for key, v in logged.items():
            pl_module.log(key, v, on_step=True, on_epoch=False)
        self.last_metrics = logged

    def modality_summary(self) -> dict[str, dict[str, float]]:
        """Per modality, the :data:`METRICS` since fit start over every watched layer
        (token-weighted mean of the layers' values) and ``layers``, the number of layers that
        routed tokens of that modality; the run summary prints them."""
        sums: dict[str, dict[str, float]] = {}
        weights: dict[str, float] = {}
        layers: dict[str, int] = {}
        for name, mod, e in self._slots:
            vec = self.totals.get((name, mod))
            values = None if vec is None else metrics_from_vector(vec, e)
            if vec is None or values is None:
                continue
            tokens = float(vec[2 * e])
            weights[mod] = weights.get(mod, 0.0) + tokens
            layers[mod] = layers.get(mod, 0) + 1
            acc = sums.setdefault(mod, dict.fromkeys(values, 0.0))
            for key, value in values.items():
                acc[key] += tokens * value
        return {
            m: {**{k: v / weights[m] for k, v in acc.items()}, "layers": float(layers[m])}
            for m, acc in sums.items()
        }

    def shares(self) -> tuple[list[str], Tensor]:
        """Row labels ``layer/modality`` and the ``[rows, max E]`` share of routes of each
        expert since fit start (before dropping; NaN past a layer's own ``E`` or for a modality
        without tokens)."""
        labels = [f"{name}/{mod}" for name, mod, _ in self._slots]
        width = max((e for _, _, e in self._slots), default=0)
        grid = torch.full((len(labels), width), math.nan, dtype=torch.float64)
        for i, (name, mod, e) in enumerate(self._slots):
            vec = self.totals.get((name, mod))
            if vec is not None and float(vec[:e].sum()) > 0:
                grid[i, :e] = vec[:e] / vec[:e].sum()
        return labels, grid

    def draw_heatmap(self, trainer: pl.Trainer) -> Path | None:
        """Write ``expert_load.png`` from :attr:`totals` on global rank 0 (no collective);
        returns its path, ``None`` on other ranks, without layers, or without matplotlib."""
        if not trainer.is_global_zero or not self._slots:
            return None
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            rank_zero_warn(
                "ExpertLoadMonitor: matplotlib is not installed, no expert-load heatmap is "
                "written (pip install matplotlib); the metrics are still logged."
            )
            return None
        labels, grid = self.shares()
        if bool(grid.isnan().all()):
            rank_zero_warn("ExpertLoadMonitor: no routed token seen on this rank; no heatmap.")
            return None
        folder = self._folder or self.log_dir or Path(trainer.default_root_dir)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "expert_load.png"
        fig, ax = plt.subplots(
            figsize=(2.0 + 0.5 * grid.shape[1], 1.2 + 0.35 * len(labels)), layout="constrained"
        )
        image = ax.imshow(grid.numpy(), aspect="auto", cmap="viridis", vmin=0.0)
        ax.set_xticks(range(grid.shape[1]))
        ax.set_yticks(range(len(labels)), labels)
        ax.set_xlabel("expert")
        ax.set_title(f"share of routes (step {trainer.global_step})")
        fig.colorbar(image, ax=ax)
        fig.savefig(path, dpi=80)
        plt.close(fig)
        self.heatmap_path = path
        return path
