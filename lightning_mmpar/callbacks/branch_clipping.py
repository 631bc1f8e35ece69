"""BranchGradientClipping: per-branch gradient clipping of a vision-language model.

In ``on_before_optimizer_step`` (after Lightning unscales AMP gradients, before the optimizer
step and before ``Trainer(gradient_clip_val=...)`` clipping):

* **Vision branch**: its gradients are scaled by ``min(1, max_norm / (|g| + 1e-6))`` where
  ``|g|`` is the global L2 norm of the branch over every tensor-parallel / FSDP shard and
  pipeline stage (:mod:`lightning_mmpar.parallel.numerics`: one all-reduce over the world, the
  rule of ``torch.nn.utils.clip_grad_norm_``).
* **Text branch**: adaptive gradient clipping (AGC, Brock et al. 2021, "High-Performance
  Large-Scale Image Recognition Without Normalization", section 4), unit-wise: for every unit
  ``i`` (an output row ``W[i, ...]`` of a matrix or higher-order tensor; the whole tensor for
  biases and other 1-D parameters) with ``M_i = lambda * max(|W_i|, eps)``, ``G_i`` becomes
  ``G_i * M_i / max(|G_i|, 1e-6)`` when ``|G_i| > M_i`` and stays as it is otherwise (the
  reference ``nfnets/agc_optax.py``). NFNets leave the final classifier out: keep such
  parameters out of ``text_prefixes``. A stacked MoE expert weight ``[E, D, F]`` has one unit
  per expert (dim 0).

Branches: a parameter belongs to a branch when one of its names starts with one of the
branch's prefixes. Its names are those of ``pl_module.named_parameters()`` plus, when the module
has a ``fusion_model`` (the recipe's :class:`~lightning_mmpar.recipes.module.ClipLlamaModule`,
whose registered names are ``blocks.N.*``), the names in that model (``vision.*``,
``language.*``). Parameters of neither branch are left alone; one in both raises.

Sharded parameters (DTensors): a unit norm is over the full row. When every sharded placement
splits dim 0 (column-wise tensor parallelism, FSDP2), the local rows are whole and the norms are
local; otherwise (a row-wise shard, a sharded bias) the squared row norms are summed by DTensor
ops (a ``Partial`` -> ``Replicate`` redistribution); a layout where that does not give whole
rows raises ``ValueError`` naming the parameter. Lightning's ``FSDPStrategy`` (flat shards that
cut rows) is refused when a text branch exists.

Logged on the Trainer's logging steps: ``<prefix>/vision_grad_norm`` (the pre-clip global norm
of the vision branch, this step) and ``<prefix>/text_clipped_fraction`` (clipped units / units
of the text branch since the last logged step, over the whole model: one all-reduce).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from typing_extensions import override

from lightning_mmpar.callbacks.grad_stats import log_due, norm_weights
from lightning_mmpar.parallel import comm, numerics
from lightning_mmpar.trainer_topology import TrainerTopology

__all__ = ["BranchGradientClipping", "agc_coefficients", "branch_parameters"]

VISION_PREFIXES = ("vision.", "model.vision.")
TEXT_PREFIXES = ("language.", "model.language.")


def _prefixes(name: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not all(isinstance(p, str) and p for p in value):
        raise ValueError(
            f"BranchGradientClipping {name} ({value!r}) must be a tuple of non-empty strings; "
            "use e.g. ('vision.', 'model.vision.')."
        )
    return tuple(value)


def _positive(name: str, value: Any, fix: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"BranchGradientClipping {name} ({value!r}) must be > 0; {fix}.")
    return float(value)


def branch_parameters(
    module: nn.Module, vision_prefixes: Sequence[str], text_prefixes: Sequence[str]
) -> tuple[list[tuple[str, Tensor]], list[tuple[str, Tensor]]]:
    """``(vision, text)``: the trainable ``(name, parameter)`` pairs of ``module`` in each
    branch (module docstring for the names searched). Raises ``ValueError`` naming a parameter
    that matches both branches."""
    names: dict[int, list[str]] = {}
    params: dict[int, tuple[str, Tensor]] = {}
    for first, param in module.named_parameters():
        names.setdefault(id(param), []).append(first)
        params.setdefault(id(param), (first, param))
    try:
        inner = getattr(module, "fusion_model", None)
    except RuntimeError:  # the recipe module before configure_model()
        inner = None
    if isinstance(inner, nn.Module) and inner is not module:
        for alias, q in inner.named_parameters():
            if id(q) in names:
                names[id(q)].append(alias)
    vision: list[tuple[str, Tensor]] = []
    text: list[tuple[str, Tensor]] = []
    for key, (n, p) in params.items():
        if not p.requires_grad:
            continue
        in_v = any(a.startswith(tuple(vision_prefixes)) for a in names[key])
        in_t = any(a.startswith(tuple(text_prefixes)) for a in names[key])
        if in_v and in_t:
            raise ValueError(
                f"BranchGradientClipping: parameter {n!r} (names {names[key]}) matches both "
                f"vision_prefixes {tuple(vision_prefixes)} and text_prefixes "
                f"{tuple(text_prefixes)}; make the prefixes disjoint."
            )
        if in_v:
            vision.append((n, p))
        elif in_t:
            text.append((n, p))
    return vision, text


def _row_sq(t: Tensor, name: str, what: str) -> tuple[Tensor, int]:
    """Squared unit norms of this rank's rows of ``t`` (``[rows_local]`` float32+) and the
    number of distinct row shards (product of the mesh sizes splitting dim 0)."""
    from torch.distributed.tensor import DTensor, Replicate

    dims = tuple(range(1, t.ndim)) if t.ndim >= 2 else tuple(range(t.ndim))
    if not isinstance(t, DTensor):
        x = t.detach().float() if t.dtype in (torch.float16, torch.bfloat16) else t.detach()
        sq = x.square().sum(dim=dims) if dims else x.square()
        return (sq if t.ndim >= 2 else sq.reshape(1)), 1
    sharded = [(i, pl) for i, pl in enumerate(t.placements) if not pl.is_replicate()]
    rows_whole = t.ndim >= 2 and all(getattr(pl, "dim", None) == 0 for _, pl in sharded)
    if rows_whole:  # Shard(0) / _StridedShard(0): whole local rows, no communication
        local, _ = _row_sq(comm.to_local(t), name, what)
        return local, numerics.shard_count(t)
    try:
        x = t.detach()
        x = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        sq = x.square().sum(dim=dims) if t.ndim >= 2 else x.square().sum().reshape(1)
        assert isinstance(sq, DTensor)
        sq = sq.redistribute(
            sq.device_mesh, [Replicate() if p.is_partial() else p for p in sq.placements]
        )
        bad = [p for p in sq.placements if not (p.is_replicate() or getattr(p, "dim", 1) == 0)]
        if bad or (t.ndim >= 2 and comm.to_local(sq).shape[0] != comm.to_local(t).shape[0]):
            raise ValueError("unit norms do not line up with the local rows")
    except Exception as err:  # unsupported op or layout: refuse, naming the parameter
        raise ValueError(
            f"BranchGradientClipping: cannot compute whole-row AGC norms of the {what} of "
            f"{name!r} (placements {list(t.placements)}): {err}; shard it on dim 0 or leave it "
            "out of text_prefixes."
        ) from err
    return comm.to_local(sq), numerics.shard_count(sq)


@torch.no_grad()
def agc_coefficients(
    weight: Tensor, grad: Tensor, *, clipping: float = 0.01, eps: float = 1e-3, name: str = "?"
) -> tuple[Tensor, int]:
    """Per-unit AGC factors of this rank's rows: ``[rows_local]`` (``[1]`` for 1-D params),
    ``1`` where ``|G_i| <= clipping * max(|W_i|, eps)``, else ``M_i / max(|G_i|, 1e-6)``; and
    the number of distinct row shards. ``weight`` and ``grad`` have the same shape and layout
    (plain tensors or DTensors; a ``Partial`` gradient is summed first). Raises ``ValueError``
    for a DTensor layout without whole-row norms (module docstring)."""
    w_sq, shards = _row_sq(weight, name, "weight")
    g_sq, _ = _row_sq(grad, name, "gradient")
    max_norm = w_sq.sqrt().clamp_min(eps) * clipping
    g_norm = g_sq.sqrt().to(max_norm)
    coef = torch.where(g_norm > max_norm, max_norm / g_norm.clamp_min(1e-6), 1.0)
    return coef, shards


class BranchGradientClipping(Callback):
    """Clip the vision branch by its global L2 norm and the text branch by unit-wise AGC.

    See the module docstring. Args:
        max_norm: vision-branch global norm bound (1.0).
        clipping: AGC ``lambda`` (0.01).
        eps: AGC floor of the weight norm (1e-3).
        vision_prefixes / text_prefixes: parameter-name prefixes of each branch.
        prefix: first part of the logged names.

    Raises ``ValueError`` (naming the argument, its value and a fix) on invalid arguments.
    Attributes: :attr:`vision` / :attr:`text` (name -> parameter, resolved at fit start),
    :attr:`last_vision_norm` (0-dim tensor, pre-clip), :attr:`last_metrics` (values logged).
    """

    def __init__(
        self,
        max_norm: float = 1.0,
        clipping: float = 0.01,
        eps: float = 1e-3,
        vision_prefixes: Sequence[str] = VISION_PREFIXES,
        text_prefixes: Sequence[str] = TEXT_PREFIXES,
        prefix: str = "clip",
    ) -> None:
        self.max_norm = _positive("max_norm", max_norm, "use e.g. 1.0")
        self.clipping = _positive("clipping", clipping, "use e.g. 0.01 (NFNets' lambda)")
        self.eps = _positive("eps", eps, "use e.g. 1e-3")
        self.vision_prefixes = _prefixes("vision_prefixes", vision_prefixes)
        self.text_prefixes = _prefixes("text_prefixes", text_prefixes)
        if not isinstance(prefix, str) or not prefix.strip("/"):
            raise ValueError(
                f"BranchGradientClipping prefix ({prefix!r}) must be a non-empty string; use "
                "e.g. 'clip'."
            )
        self.prefix = prefix.strip("/")
        self.vision: dict[str, Tensor] = {}
        self.text: dict[str, Tensor] = {}
        self.last_vision_norm: Tensor | None = None
        self.last_metrics: dict[str, float] = {}
        self._counts: Tensor | None = None  # weighted [clipped units, units] since last log
        self._pp = 1

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        vision, text = branch_parameters(pl_module, self.vision_prefixes, self.text_prefixes)
        self.vision, self.text = dict(vision), dict(text)
        if text and TrainerTopology.of(trainer).lightning_fsdp:
            raise ValueError(
                "BranchGradientClipping: Lightning's FSDPStrategy keeps flat shards that cut "
                f"rows, so AGC of {text[0][0]!r} has no unit norms; use ModelParallelStrategy / "
                "mm_parallel (FSDP2) or text_prefixes=() ."
            )
        if not (vision or text):
            rank_zero_warn(
                f"BranchGradientClipping: no parameter of {type(pl_module).__name__} matches "
                f"vision_prefixes {self.vision_prefixes} or text_prefixes {self.text_prefixes} "
                "on this rank; nothing is clipped there."
            )
        self._pp = TrainerTopology.of(trainer).dims.pp if comm.group_size() > 1 else 1
        self._counts = None

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        self.clip_text()
        params = [p for p in self.vision.values() if p.grad is not None]
        norms = numerics.local_grad_norms(params)
        weights = norm_weights(trainer, params)
        total = numerics.global_norm_from_local(norms, weights)  # collective: every rank
        numerics.scale_grads_(params, self.max_norm, total)
        self.last_vision_norm = total

    def clip_text(self) -> None:
        """AGC on the text branch's gradients in place; adds the weighted ``[clipped, units]``
        counts to the interval (weights ``S_rows * pp / world`` so that a world sum counts each
        unit once)."""
        world = comm.group_size()
        for name, p in self.text.items():
            if p.grad is None:
                continue
            coef, shards = agc_coefficients(
                p, p.grad, clipping=self.clipping, eps=self.eps, name=name
            )
            g = comm.to_local(p.grad)
            g.mul_(coef.to(g.dtype).reshape(-1, *[1] * (g.ndim - 1)) if g.ndim else coef[0])
            w = shards * self._pp / world
            clipped = (coef < 1).sum().double()  # stays on the device: no host sync per step
            counts = torch.stack([clipped, torch.full_like(clipped, coef.numel())]) * w
            self._counts = counts if self._counts is None else self._counts + counts

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self.last_vision_norm is None or not log_due(trainer):
            return
        counts = self._counts if self._counts is not None else torch.zeros(2, dtype=torch.float64)
        counts = comm.all_reduce(counts.clone())  # collective: same logging steps everywhere
        self._counts = None
        logged = {f"{self.prefix}/vision_grad_norm": float(self.last_vision_norm)}
        if float(counts[1]) > 0:
            logged[f"{self.prefix}/text_clipped_fraction"] = float(counts[0] / counts[1])
        for key, v in logged.items():
            pl_module.log(key, v, on_step=True, on_epoch=False)
        self.last_metrics = logged
