"""Sharded checkpoints: DCP save and load in any layout (:mod:`.dcp`), each rank's own callback
and loop state (:mod:`.rank_state`) and generator states (:mod:`.rng_state`), the atomic commit
(:mod:`.atomic`), the checks that name a bad file or a differing setting (:mod:`.check`) and the
newest complete checkpoint under a directory (:mod:`.find`).
``from lightning_mmpar.parallel import checkpoint as ckpt`` reaches every name below as
``ckpt.<name>``.
"""

from lightning_mmpar.parallel.checkpoint.atomic import (
    PARTIAL_SUFFIX,
    PREVIOUS_SUFFIX,
    commit,
    partial_path,
    remove,
    resolve,
)
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
from lightning_mmpar.parallel.checkpoint.dcp import (
    OPTIM_OPTIONS,
    load_sharded,
    save_sharded,
    validate_checkpoint,
)
from lightning_mmpar.parallel.checkpoint.find import AUTO, complete_checkpoints, newest_checkpoint
from lightning_mmpar.parallel.checkpoint.rank_state import (
    LAYOUT_KEYS,
    PER_RANK_KEYS,
    RANKS_DIR,
    check_layout,
    rank_file,
    rank_layout,
    restore_rank_state,
    set_sampler_epoch,
    write_rank_state,
)
from lightning_mmpar.parallel.checkpoint.rng_state import (
    RNG_KEY,
    apply_rng_state,
    capture_rng_state,
    resume_points,
    saved_rng_state,
)

__all__ = [
    "AUTO",
    "DCP_METADATA",
    "HPARAMS_KEY",
    "LAYOUT_KEYS",
    "METADATA_FILE",
    "OPTIM_OPTIONS",
    "PARTIAL_SUFFIX",
    "PER_RANK_KEYS",
    "PREVIOUS_SUFFIX",
    "RANKS_DIR",
    "RNG_KEY",
    "CheckedCheckpoint",
    "apply_rng_state",
    "capture_rng_state",
    "check_layout",
    "check_state_keys",
    "commit",
    "complete_checkpoints",
    "damaged_files",
    "hparams_diff",
    "inspect_checkpoint",
    "load_sharded",
    "newest_checkpoint",
    "partial_path",
    "rank_file",
    "rank_layout",
    "remove",
    "resolve",
    "restore_rank_state",
    "resume_points",
    "root_error",
    "save_sharded",
    "saved_rng_state",
    "set_sampler_epoch",
    "validate_checkpoint",
    "write_rank_state",
]
