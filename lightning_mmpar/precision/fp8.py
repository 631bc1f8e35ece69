"""FP8 linear layers with a run-time switch to BF16: conversion, switching, TP placements.

:class:`Float8Linear` runs ``Y = (q_x / s_x) (q_w / s_w)^T`` (forward, e4m3 x e4m3),
``dX = (q_g / s_g) (q_w / s_w)`` and ``dW = (q_g / s_g)^T (q_x / s_x)`` (backward, e5m2 x e4m3)
with the casts and scales of :mod:`lightning_mmpar.precision.formats`, or a high precision
(``bf16``, ``fp32``) chosen at run time by :func:`set_precision`.

Tensor parallelism: with DTensor weights (1-D mesh, ``Shard(0)`` column- or ``Shard(1)``
row-parallel, or replicated) the FP8 matmul runs on the local shards with per-shard scales and
the result is re-wrapped as a DTensor (``Shard(-1)`` resp. ``Partial()``), so the layer composes
with ``torch.distributed.tensor.parallel`` plans.

Pipeline parallelism: ``torch.distributed.pipelining`` infers stage shapes in its first step by
running the stages on placeholder tensors (``torch.empty``: arbitrary values, NaN included)
and a backward with ones. Those casts enter the statistics and the amax history like any other;
:class:`~lightning_mmpar.callbacks.fp8_fallback.FP8FallbackCallback` discards them and redoes
the first pipelined step (without the callback, call :meth:`Float8Linear.reset_amax_history`
after the first step).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_mmpar.precision.formats import (
    E4M3,
    E5M2,
    HIGH_PRECISION,
    CastMeta,
    FP8Policy,
    Precision,
    detect_backend,
    fp8_matmul,
)

log = logging.getLogger(__name__)


_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)
"""The ``nn.Module`` hook registries :meth:`Float8Linear.from_linear` carries over."""


class _FP8Linear(torch.autograd.Function):
    """``y = x w^T`` with FP8 operands; see the module docstring for the three matmuls."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, layer: Float8Linear) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        qx, ix = layer.meta["input"].cast(x2)
        qw, iw = layer.meta["weight"].cast(w)
        out = fp8_matmul(qx, ix, qw.t(), iw, x.dtype, layer.backend)
        ctx.save_for_backward(qx, ix, qw, iw)
        ctx.layer, ctx.x_shape, ctx.x_dtype, ctx.w_dtype = layer, x.shape, x.dtype, w.dtype
        return out.reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        qx, ix, qw, iw = ctx.saved_tensors
        layer: Float8Linear = ctx.layer
        g2 = grad.reshape(-1, grad.shape[-1])
        qg, ig = layer.meta["grad"].cast(g2)
        dx = fp8_matmul(qg, ig, qw, iw, ctx.x_dtype, layer.backend)
        dw = fp8_matmul(qg.t(), ig, qx, ix, ctx.w_dtype, layer.backend)
        return dx.reshape(ctx.x_shape), dw, None


class Float8Linear(nn.Linear):
    """``nn.Linear`` computing in FP8 (or a high precision) with a run-time switch.

    Shares its ``weight``/``bias`` Parameters with the layer it replaced, so optimizers built
    before conversion keep working. ``precision`` is one of ``fp8``, ``bf16``, ``fp32``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        policy: FP8Policy | None = None,
        backend: str = "emulate",
        precision: Precision = "fp8",
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.policy = policy or FP8Policy()
        self.backend = backend
        self.precision: Precision = precision
        self.pinned = False
        """Kept in high precision by policy; ``set_precision(..., "fp8")`` skips it."""
        self.meta = {
            "input": CastMeta(E4M3, self.policy),
            "weight": CastMeta(E4M3, self.policy),
            "grad": CastMeta(E5M2, self.policy),
        }

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, policy: FP8Policy, backend: str, precision: Precision = "fp8"
    ) -> Float8Linear:
        """Wrap ``linear``'s own Parameters (no copy) and keep its forward hooks (a
        tensor-parallel plan's DTensor input/output hooks: the same hook dictionaries, so
        handles taken on ``linear`` still remove them)."""
        new = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            policy=policy,
            backend=backend,
            precision=precision,
            device="meta",
        )
        new.weight = linear.weight
        new.bias = linear.bias
        for hooks in _HOOK_DICTS:
            setattr(new, hooks, getattr(linear, hooks))
        new.train(linear.training)
        return new

    def forward(self, x: Tensor) -> Tensor:
        if self.precision != "fp8":
            dt = HIGH_PRECISION[self.precision]
            b = None if self.bias is None else self.bias.to(dt)
            return F.linear(x.to(dt), self.weight.to(dt), b).to(x.dtype)
        if _is_dtensor(self.weight):
            return _dtensor_forward(self, x)
        out = _FP8Linear.apply(x, self.weight, self)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def fp8_stats(self) -> dict[str, dict[str, float]]:
        """Per cast site: amax, saturated, overflow and nonfinite counts since the last reset."""
        return {
            k: {f: float(getattr(m, f)) for f in ("amax", "saturated", "overflow", "nonfinite")}
            for k, m in self.meta.items()
        }

    def reset_fp8_stats(self) -> None:
        """Zero the per-step statistics of all three cast sites."""
        for m in self.meta.values():
            m.reset_stats()

    def reset_amax_history(self) -> None:
        """Empty the delayed-scaling histories (used when returning to FP8)."""
        for m in self.meta.values():
            m.reset_history()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, precision={self.precision}, backend={self.backend}"


def _is_dtensor(t: Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _dtensor_forward(layer: Float8Linear, x: Tensor) -> Tensor:
    """FP8 on local shards of a 1-D TP mesh; placements as in Colwise/RowwiseParallel."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    w: Any = layer.weight
    if w.device_mesh.ndim != 1 or not isinstance(x, DTensor):
        raise ValueError(
            f"Float8Linear with DTensor weights needs a 1-D mesh and a DTensor input (got mesh "
            f"ndim {w.device_mesh.ndim}, input {type(x).__name__}); apply FP8 after the TP plan "
            "on the tp sub-mesh, or keep this module in high precision via keep_high_precision."
        )
    wp, xp = w.placements[0], x.placements[0]
    if wp == Shard(0) and xp.is_replicate():
        out_p: Any = Shard(x.ndim - 1)
    elif wp == Shard(1) and xp == Shard(x.ndim - 1):
        out_p = Partial()
    elif wp.is_replicate() and not (isinstance(xp, Shard) and xp.dim == x.ndim - 1):
        out_p = xp
    else:
        raise ValueError(
            f"Float8Linear: unsupported placements weight={wp}, input={xp}; supported are "
            "column-parallel (Shard(0), Replicate), row-parallel (Shard(1), Shard(-1)) and "
            "replicated weights."
        )
    # column-parallel: each rank's input gradient is a partial sum over its output columns;
    # marking it Partial makes DTensor all-reduce it where the replicated input came from
    # (without it, every tp rank would keep only its own part: replicated norms drift)
    grad_p: Any = [Partial()] if isinstance(out_p, Shard) and wp == Shard(0) else None
    local = _FP8Linear.apply(x.to_local(grad_placements=grad_p), w.to_local(), layer)
    out = DTensor.from_local(local, w.device_mesh, [out_p], run_check=False)
    if layer.bias is not None:
        bias: Any = layer.bias
        if isinstance(out_p, Partial):
            out = out.redistribute(placements=[Replicate()])
        out = out + bias.to(out.dtype)
    return out


def fp8_modules(module: nn.Module) -> dict[str, Float8Linear]:
    """All :class:`Float8Linear` submodules that hold their weight, by qualified name.

    Under pipeline parallelism the layers of other pipeline ranks stay in the module tree with
    their parameters unregistered; they are left out.
    """
    return {
        n: m
        for n, m in module.named_modules()
        if isinstance(m, Float8Linear) and m._parameters.get("weight") is not None
    }


def convert_to_fp8(module: nn.Module, policy: FP8Policy | None = None) -> list[str]:
    """Replace every ``nn.Linear`` in ``module`` by a :class:`Float8Linear`, in place.

    Modules matching ``policy.keep_high_precision`` are converted but pinned to
    ``policy.high_precision``. Returns the names of the modules running in FP8. With the
    ``torchao`` backend the conversion is delegated to ``torchao.float8`` instead.
    """
    policy = policy or FP8Policy()
    info = detect_backend(policy.backend)
    log.info(
        "FP8 backend: %s (%s; torchao available: %s)",
        info.name,
        info.reason,
        info.torchao_available,
    )
    if info.name == "torchao":
        return _convert_torchao(module, policy)
    fp8: list[str] = []
    for name, child in list(module.named_modules()):
        if type(child) is not nn.Linear:
            continue
        keep = policy.keeps(name)
        new = Float8Linear.from_linear(
            child, policy, info.name, policy.high_precision if keep else "fp8"
        )
        new.pinned = keep
        _set_submodule(module, name, new)
        if not keep:
            fp8.append(name)
    return fp8


def _convert_torchao(module: nn.Module, policy: FP8Policy) -> list[str]:
    from torchao.float8 import convert_to_float8_training  # type: ignore[import-not-found]

    names = [n for n, m in module.named_modules() if type(m) is nn.Linear and not policy.keeps(n)]
    convert_to_float8_training(module, module_filter_fn=lambda _m, fqn: fqn in names)
    return names


def _set_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, attr, new)


def set_precision(
    module: nn.Module, precision: Precision, names: list[str] | None = None, *, force: bool = False
) -> list[str]:
    """Switch :class:`Float8Linear` layers (all, or those in ``names``) to ``precision``.

    Pinned layers are not moved to FP8 unless ``force``. Returns the names that changed.
    """
    if precision not in ("fp8", *HIGH_PRECISION):
        raise ValueError(f"precision ({precision!r}) must be 'fp8', 'bf16' or 'fp32'.")
    mods = {"": module} if isinstance(module, Float8Linear) else fp8_modules(module)
    changed = []
    for name, m in mods.items():
        if names is not None and name not in names:
            continue
        if precision == "fp8" and m.pinned and not force:
            continue
        if m.precision != precision:
            m.precision = precision
            if precision == "fp8":
                m.reset_amax_history()
            changed.append(name)
    return changed
