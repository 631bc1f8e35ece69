"""Lightning's checkpoint hooks over sharded DCP checkpoints, for a strategy with a mesh.

:class:`ShardedCheckpointHooks` is mixed into
:class:`~lightning_mmpar.strategy.MultimodalParallelStrategy`: ``save_checkpoint`` writes the
DCP shards, rank 0's ``meta.pt`` and each rank's own callback/loop state
(:func:`~lightning_mmpar.parallel.checkpoint.save_sharded`) atomically (``<path>.partial``,
then a rename); ``load_checkpoint`` reshards into the current layout. It uses only Lightning's
``Strategy`` interface and ``_rank_layout()``, which the strategy provides.

Checkpoint guard: before anything is written, every rank checks that its parameters are
finite (:func:`~lightning_mmpar.parallel.finite.nonfinite_weights`, one all-reduce); if not,
``RuntimeError`` names the parameters, ranks and step, and the checkpoint already at the path
(if any) stays as it was, so a NaN run never replaces the last finite ``last.ckpt``.

Generator states: every rank saves its own (:func:`~lightning_mmpar.parallel.checkpoint.
capture_rng_state`: Python, NumPy, torch CPU and accelerator, the model-parallel tracker) and a
resume in the same layout puts them back where the uninterrupted run had them
(:func:`~lightning_mmpar.parallel.checkpoint.resume_points`), so dropout masks and data-loader
worker seeds after a resume are the uninterrupted run's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities import rank_zero_warn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mmpar.parallel import checkpoint as ckpt
from lightning_mmpar.parallel.finite import nonfinite_weights

__all__ = ["ShardedCheckpointHooks"]


class ShardedCheckpointHooks(Strategy):
    """Mixin: Lightning checkpoint hooks writing and reading sharded DCP checkpoints."""

    def _rank_layout(self) -> dict[str, int]:
        """This rank's layout (:func:`~lightning_mmpar.parallel.checkpoint.rank_layout`)."""
        raise NotImplementedError

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the shards are written by save_checkpoint()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return {}

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None
    ) -> None:
        """Write the checkpoint at ``filepath`` (a directory). Raises ``TypeError`` for
        ``storage_options``, ``RuntimeError`` when a parameter holds a NaN or inf (nothing is
        written; module docstring)."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options.")
        assert self.model is not None
        if bad := nonfinite_weights(self.model):
            names = "; ".join(f"rank {r}: {', '.join(n[:3])}" for r, n in sorted(bad.items()))
            raise RuntimeError(
                f"Refusing to save checkpoint {filepath} at global step "
                f"{checkpoint.get('global_step', '?')}: non-finite weights ({names}). Nothing "
                "was written; an earlier checkpoint at that path is left as it was. Train with "
                "MultimodalParallelStrategy(on_nonfinite='raise' or 'skip') so that a "
                "non-finite step never reaches the weights."
            )
        path = Path(self.broadcast(str(filepath)))
        partial = ckpt.partial_path(path)
        if self.is_global_zero:
            ckpt.remove(partial)
            partial.mkdir(parents=True)
        self.barrier()
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        own = {k: checkpoint[k] for k in ckpt.PER_RANK_KEYS if k in checkpoint}
        ckpt.save_sharded(
            partial,
            self.model,
            self.optimizers,
            meta,
            self.is_global_zero,
            rank_state={
                "layout": self._rank_layout(),
                **own,
                ckpt.RNG_KEY: ckpt.capture_rng_state(self.root_device),
            },
        )
        self.barrier()
        if self.is_global_zero:
            ckpt.commit(path)
        self.barrier()

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict:
        path = ckpt.resolve(Path(self.broadcast(str(checkpoint_path))))
        assert self.model is not None and self.lightning_module is not None
        meta = ckpt.load_sharded(
            path, self.model, self.optimizers, strict=self.lightning_module.strict_loading
        )
        layout = self._rank_layout()
        for note in ckpt.restore_rank_state(path, meta, layout):
            rank_zero_warn(note)
        self._resume_rng = ckpt.saved_rng_state(path, layout)
        self._resume_rng_points: tuple[str, ...] = ()
        if self._resume_rng is None:
            rank_zero_warn(
                f"checkpoint {path} holds no generator states for this layout: dropout masks "
                "and data-loader worker seeds after the resume differ from an uninterrupted "
                "run's (weights, optimizer and data order are restored)."
            )
        return meta

    _resume_rng: dict[str, Any] | None = None
    _resume_rng_points: tuple[str, ...] = ()

    def _apply_resume_rng(self, hook: str) -> None:
        """Put the loaded generator states back at ``hook`` if it is one of this resume's
        points (:func:`~lightning_mmpar.parallel.checkpoint.resume_points`)."""
        if self._resume_rng is None:
            return
        if hook == "on_train_start":
            assert self.lightning_module is not None
            mid_epoch = self.lightning_module.trainer.fit_loop.restarted_mid_epoch
            self._resume_rng_points = ckpt.resume_points(mid_epoch)
        if hook in self._resume_rng_points:
            ckpt.apply_rng_state(self._resume_rng, self.root_device)
            if hook == self._resume_rng_points[-1]:
                self._resume_rng = None

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._apply_resume_rng("on_train_start")

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self._apply_resume_rng("on_train_batch_start")

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        if self.is_global_zero:
            ckpt.remove(Path(filepath))
