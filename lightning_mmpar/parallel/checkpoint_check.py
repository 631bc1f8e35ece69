"""Deprecated alias of :mod:`lightning_mmpar.parallel.checkpoint.check`; removed in the next
release. Import from ``lightning_mmpar.parallel.checkpoint`` instead."""

import warnings

from lightning_mmpar.parallel.checkpoint.check import (
    DCP_METADATA,
    HPARAMS_KEY,
    METADATA_FILE,
    CheckedCheckpoint,
    check_state_keys,
    damaged_files,
    hparams_diff,
    inspect_checkpoint,
    root_error,
)

__all__ = [
    "DCP_METADATA",
    "HPARAMS_KEY",
    "METADATA_FILE",
    "CheckedCheckpoint",
    "check_state_keys",
    "damaged_files",
    "hparams_diff",
    "inspect_checkpoint",
    "root_error",
]

warnings.warn(
    "lightning_mmpar.parallel.checkpoint_check moved to lightning_mmpar.parallel.checkpoint.check; "
    "import from lightning_mmpar.parallel.checkpoint (this alias goes in the next release).",
    DeprecationWarning,
    stacklevel=2,
)
