"""FP8 formats, delayed per-tensor scaling, backend choice and the scaled matmul.

Formats (OCP FP8): activations and weights in ``e4m3`` (max 448), gradients in ``e5m2``
(max 57344). A tensor ``x`` is cast as ``q = fp8(clamp(x * s, -max, max))`` with the scale

    s = max / amax_ref / 2**margin,   amax_ref = max(amax history of the last ``history_len`` casts)

(delayed scaling, as in Transformer Engine); the first cast, with an empty history, uses its own
amax. Values beyond the format's range are clamped explicitly and counted (``saturated``); a cast
whose current amax exceeds the representable range by more than ``overflow_ratio`` is an
*overflow event*, and a non-finite amax a *non-finite event* - the FP8 fallback callback
reacts to both.

Backends: ``scaled_mm`` (``torch._scaled_mm``; chosen automatically on CUDA GPUs with compute
capability >= 8.9, and usable on CPU), ``emulate`` (exact quantise-dequantise in fp32: it
equals ATen's reference CPU ``_scaled_mm`` bit for bit; oneDNN's native FP8 kernels, on CPUs
with AVX512-FP16 / AMX, differ by about one fp32 ulp), and ``torchao`` (``torchao.float8``
training, explicit only: its modules cannot be switched at run time, so the fallback callback
does not apply to them).
"""

from __future__ import annotations

import fnmatch
import importlib.util
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

Precision = Literal["fp8", "bf16", "fp32"]
"""What a :class:`~lightning_mmpar.precision.fp8.Float8Linear` computes in."""
Backend = Literal["auto", "scaled_mm", "emulate", "torchao"]
"""FP8 backend names (``auto``: :func:`detect_backend` decides)."""
E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
HIGH_PRECISION: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp32": torch.float32}
"""dtype of each high precision a layer can fall back to."""


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
        if self.high_precision not in HIGH_PRECISION:
            raise ValueError(
                f"high_precision ({self.high_precision!r}) must be one of {sorted(HIGH_PRECISION)}."
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
        """Forget the per-step counters (amax, saturated, overflow, nonfinite), keeping them on
        the device of the amax history (a reset after the first cast on a GPU stays there)."""
        device = self.history.device
        self.amax = torch.zeros((), dtype=torch.float32, device=device)
        self.saturated = torch.zeros((), dtype=torch.int64, device=device)
        self.overflow = torch.zeros((), dtype=torch.int64, device=device)
        self.nonfinite = torch.zeros((), dtype=torch.int64, device=device)
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
    # so the emulation is bit-identical to its reference path (oneDNN FP8 kernels: ~1 ulp off)
    return ((a.contiguous().float() * inv_a) @ (b.contiguous().float() * inv_b)).to(out_dtype)


def _aligned(a: Tensor, b: Tensor) -> bool:
    return all(d % 16 == 0 for d in (*a.shape, b.shape[1]))
