"""FP8 linear layers with delayed per-tensor scaling and a run-time switch to BF16.

Formats (OCP FP8): activations and weights in ``e4m3`` (max 448), gradients in ``e5m2``
(max 57344). A tensor ``x`` is cast as ``q = fp8(clamp(x * s, -max, max))`` with the scale

    s = max / amax_ref / 2**margin,   amax_ref = max(amax history of the last ``history_len`` casts)

(delayed scaling, as in Transformer Engine); the first cast, with an empty history, uses its own
amax. Values beyond the format's range are clamped explicitly and counted (``saturated``); a cast
whose current amax exceeds the representable range by more than ``overflow_ratio`` is an
*overflow event*, and a non-finite amax a *non-finite event* - :class:`FP8FallbackCallback`
reacts to both. The matmuls are ``Y = (q_x / s_x) (q_w / s_w)^T`` (forward, e4m3 x e4m3),
``dX = (q_g / s_g) (q_w / s_w)`` and ``dW = (q_g / s_g)^T (q_x / s_x)`` (backward, e5m2 x e4m3).

Backends: ``scaled_mm`` (``torch._scaled_mm``; chosen automatically on CUDA GPUs with compute
capability >= 8.9, and usable on CPU), ``emulate`` (exact quantise-dequantise in fp32: it equals
``_scaled_mm`` on CPU bit for bit), and ``torchao`` (``torchao.float8`` training, explicit only:
its modules cannot be switched at run time, so the fallback callback does not apply to them).

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

import fnmatch
import importlib.util
import logging
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

log = logging.getLogger(__name__)

Precision = Literal["fp8", "bf16", "fp32"]
Backend = Literal["auto", "scaled_mm", "emulate", "torchao"]
E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
_HIGH: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(kw_only=True)
class FP8Policy:
    """Which ``nn.Linear`` layers run in FP8 and how they are scaled."""

    keep_high_precision: tuple[str, ...] = ()
    """fnmatch patterns of module names kept in :attr:`high_precision` (still converted, so
    they can be switched later), e.g. ``("vision.*", "decoder.layers.0.*", "lm_head")``."""
    high_precision: Precision = "bf16"
    """Precision of kept modules and of modules the fallback switches away from FP8."""
    history_len: int = 16
    """Length of the amax history used for delayed scaling."""
    margin: int = 0
    """Scale head-room in powers of two: ``s = max / amax / 2**margin``."""
    overflow_ratio: float = 2.0
    """A cast whose amax exceeds the representable range ``max / s`` by this factor is an
    overflow event."""
    power_of_two_scales: bool = True
    """Round scales down to powers of two, so scaling is exact and ``_scaled_mm`` on GPU
    (scales applied after accumulation) equals the emulation up to summation order."""
    backend: Backend = "auto"
    """``auto`` picks ``scaled_mm`` on FP8-capable GPUs, else ``emulate``."""

    def __post_init__(self) -> None:
        if self.high_precision not in _HIGH:
            raise ValueError(
                f"high_precision ({self.high_precision!r}) must be one of {sorted(_HIGH)}."
            )
        if self.history_len < 1:
            raise ValueError(f"history_len ({self.history_len}) must be >= 1; use e.g. 16.")
        if self.margin < 0:
            raise ValueError(f"margin ({self.margin}) must be >= 0.")
        if self.overflow_ratio < 1.0:
            raise ValueError(
                f"overflow_ratio ({self.overflow_ratio}) must be >= 1.0 (1.0 flags any clamping)."
            )
        if self.backend not in ("auto", "scaled_mm", "emulate", "torchao"):
            raise ValueError(
                f"backend ({self.backend!r}) must be 'auto', 'scaled_mm', 'emulate' or 'torchao'."
            )

    def keeps(self, name: str) -> bool:
        """Whether the module called ``name`` stays in high precision."""
        return any(fnmatch.fnmatchcase(name, p) for p in self.keep_high_precision)


@dataclass(kw_only=True)
class BackendInfo:
    """Result of capability detection."""

    name: Literal["scaled_mm", "emulate", "torchao"]
    """Chosen backend."""
    reason: str
    """Why it was chosen (logged at conversion)."""
    torchao_available: bool
    """Whether ``torchao.float8`` can be imported."""


def detect_backend(requested: Backend = "auto") -> BackendInfo:
    """Choose the FP8 backend from the hardware and installed packages."""
    has_ao = importlib.util.find_spec("torchao") is not None
    cap = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    if requested == "torchao":
        if not has_ao:
            raise ValueError(
                "backend ('torchao') needs the torchao package; `pip install torchao` or use "
                "backend='auto'."
            )
        return BackendInfo(name="torchao", reason="requested", torchao_available=True)
    if requested in ("scaled_mm", "emulate"):
        return BackendInfo(name=requested, reason="requested", torchao_available=has_ao)
    if cap is not None and cap >= (8, 9):
        why = f"CUDA device with compute capability {cap[0]}.{cap[1]} >= 8.9"
        return BackendInfo(name="scaled_mm", reason=why, torchao_available=has_ao)
    why = "no FP8-capable GPU" if cap is None else f"GPU capability {cap} < 8.9"
    return BackendInfo(name="emulate", reason=why, torchao_available=has_ao)


class CastMeta:
    """Delayed-scaling state and per-step statistics of one cast site (input/weight/grad)."""

    def __init__(self, fmt: torch.dtype, policy: FP8Policy) -> None:
        self.fmt = fmt
        self.fmax = float(torch.finfo(fmt).max)
        self.policy = policy
        self.history = torch.zeros(policy.history_len, dtype=torch.float32)
        self.reset_stats()

    def reset_stats(self) -> None:
        """Forget the per-step counters (amax, saturated, overflow, nonfinite)."""
        self.amax = torch.zeros((), dtype=torch.float32)
        self.saturated = torch.zeros((), dtype=torch.int64)
        self.overflow = torch.zeros((), dtype=torch.int64)
        self.nonfinite = torch.zeros((), dtype=torch.int64)
        self.shape: list[int] = []

    def reset_history(self) -> None:
        """Empty the amax history (the next cast scales from its own amax)."""
        self.history.zero_()

    def _to(self, device: torch.device) -> None:
        if self.history.device != device:
            self.history = self.history.to(device)
            for k in ("amax", "saturated", "overflow", "nonfinite"):
                setattr(self, k, getattr(self, k).to(device))

    def scale(self, amax: Tensor) -> Tensor:
        """Scale from the history (delayed), or from ``amax`` while the history is empty."""
        hist = self.history.max()
        ref = torch.where(hist > 0, hist, amax)
        ok = torch.isfinite(ref) & (ref > 0)
        s = torch.where(ok, self.fmax / ref.clamp_min(1e-30), torch.ones_like(ref))
        s = s / 2.0**self.policy.margin
        if self.policy.power_of_two_scales:
            s = torch.exp2(torch.floor(torch.log2(s)))
        return s.float()

    def cast(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Quantise ``x``: return ``(q, inv_scale)`` with ``x ~= q.float() * inv_scale``."""
        self._to(x.device)
        self.shape = list(x.shape)
        amax = x.detach().abs().amax().float()
        s = self.scale(amax)
        scaled = x.detach().float() * s
        sat = (scaled.abs() > self.fmax).sum()
        q = scaled.clamp(-self.fmax, self.fmax).to(self.fmt)
        finite = torch.isfinite(amax)
        self.saturated += sat
        self.nonfinite += (~finite).long()
        self.overflow += (finite & (amax * s > self.fmax * self.policy.overflow_ratio)).long()
        self.amax = torch.maximum(self.amax, torch.where(finite, amax, self.amax))
        # a non-finite amax never enters the history; torch.where avoids a host sync
        rolled = torch.cat([amax.reshape(1), self.history[:-1]])
        self.history.copy_(torch.where(finite, rolled, self.history))
        return q, s.reciprocal()


def fp8_matmul(
    a: Tensor, inv_a: Tensor, b: Tensor, inv_b: Tensor, out_dtype: torch.dtype, backend: str
) -> Tensor:
    """``(a * inv_a) @ (b * inv_b)`` for FP8 ``a [M, K]`` and ``b [K, N]``."""
    if backend == "scaled_mm" and (a.device.type == "cpu" or _aligned(a, b)):
        b_col = b.t().contiguous().t()  # _scaled_mm wants its second operand column-major
        return torch._scaled_mm(
            a.contiguous(), b_col, scale_a=inv_a, scale_b=inv_b, out_dtype=out_dtype
        )
    # same operations as ATen's CPU _scaled_mm (contiguous operands, scale, fp32 matmul),
    # so the emulation is bit-identical to it on CPU
    return ((a.contiguous().float() * inv_a) @ (b.contiguous().float() * inv_b)).to(out_dtype)


def _aligned(a: Tensor, b: Tensor) -> bool:
    return all(d % 16 == 0 for d in (*a.shape, b.shape[1]))


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
        self, in_features: int, out_features: int, bias: bool = True, *,
        policy: FP8Policy | None = None, backend: str = "emulate", precision: Precision = "fp8",
        device: Any = None, dtype: torch.dtype | None = None,
    ) -> None:  # fmt: skip
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
        """Wrap ``linear``'s own Parameters (no copy)."""
        new = cls(linear.in_features, linear.out_features, linear.bias is not None,
                  policy=policy, backend=backend, precision=precision, device="meta")  # fmt: skip
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        return new

    def forward(self, x: Tensor) -> Tensor:
        if self.precision != "fp8":
            dt = _HIGH[self.precision]
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
    log.info("FP8 backend: %s (%s; torchao available: %s)", info.name, info.reason,
             info.torchao_available)  # fmt: skip
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
    if precision not in ("fp8", *_HIGH):
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
