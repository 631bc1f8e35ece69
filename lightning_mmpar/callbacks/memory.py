"""Deprecated alias of :mod:`lightning_mmpar.callbacks.peak_memory`; removed in the next
release (YAML class path: ``lightning_mmpar.callbacks.PeakMemory``)."""

import warnings

from lightning_mmpar.callbacks.peak_memory import PeakMemory, peak_bytes

__all__ = ["PeakMemory", "peak_bytes"]

warnings.warn(
    "lightning_mmpar.callbacks.memory moved to lightning_mmpar.callbacks.peak_memory; use "
    "lightning_mmpar.callbacks.PeakMemory (this alias goes in the next release).",
    DeprecationWarning,
    stacklevel=2,
)
