"""Deprecated alias of :mod:`lightning_mmpar.parallel.checkpoint.find`; removed in the next
release. Import from ``lightning_mmpar.parallel.checkpoint`` instead."""

import warnings

from lightning_mmpar.parallel.checkpoint.find import AUTO, complete_checkpoints, newest_checkpoint

__all__ = ["AUTO", "complete_checkpoints", "newest_checkpoint"]

warnings.warn(
    "lightning_mmpar.parallel.checkpoint_find moved to lightning_mmpar.parallel.checkpoint.find; "
    "import from lightning_mmpar.parallel.checkpoint (this alias goes in the next release).",
    DeprecationWarning,
    stacklevel=2,
)
