"""FP8 training: formats and delayed scaling (:mod:`.formats`), FP8 linear layers with a
run-time switch to BF16 and the conversion policy (:mod:`.fp8`)."""

from lightning_mmpar.precision.formats import (
    E4M3,
    E5M2,
    Backend,
    BackendInfo,
    CastMeta,
    FP8Policy,
    Precision,
    detect_backend,
    fp8_matmul,
)
from lightning_mmpar.precision.fp8 import (
    Float8Linear,
    convert_to_fp8,
    fp8_modules,
    set_precision,
)
from lightning_mmpar.precision.plugins import (
    GlobalNormClipping,
    ParallelHalfPrecision,
    ParallelMixedPrecision,
    ParallelPrecision,
    with_global_clipping,
)

__all__ = [
    "E4M3",
    "E5M2",
    "Backend",
    "BackendInfo",
    "CastMeta",
    "FP8Policy",
    "Float8Linear",
    "GlobalNormClipping",
    "ParallelHalfPrecision",
    "ParallelMixedPrecision",
    "ParallelPrecision",
    "Precision",
    "convert_to_fp8",
    "detect_backend",
    "fp8_matmul",
    "fp8_modules",
    "set_precision",
    "with_global_clipping",
]
