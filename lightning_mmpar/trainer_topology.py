"""What layout a trainer runs in, under any strategy: the one accessor callbacks and recipes use.

:meth:`TrainerTopology.of` reads ``trainer.strategy`` by duck typing (no strategy class is
imported: callbacks may not import the strategy): the degrees and groups
(:meth:`ParallelDims.of <lightning_mmpar.topology.ParallelDims.of>`), the pipeline engine that
``mm_parallel`` runs (``strategy.pipeline``, ``None`` before set-up, at ``pp == 1`` and under
any other strategy), its schedule, micro-batches and last stage, and whether the strategy is
Lightning's FSDP (flat shards, no replicas). Under DDP, DeepSpeed or one device: no pipeline,
and every rank is a data-parallel rank of the world group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from lightning_mmpar.config import stage_layout
from lightning_mmpar.topology import ParallelDims

__all__ = ["TrainerTopology"]


@dataclass(frozen=True)
class TrainerTopology:
    """The layout of one trainer's run; built on each call of :meth:`of` (cheap: the dims are
    cached on the strategy), read lazily (the pipeline engine exists only after set-up)."""

    dims: ParallelDims
    """Degrees and groups (:meth:`ParallelDims.of <lightning_mmpar.topology.ParallelDims.of>`)."""
    strategy: Any
    """``trainer.strategy`` (``None`` for a trainer stand-in without one)."""

    @classmethod
    def of(cls, trainer: Any) -> TrainerTopology:
        """The layout of whatever strategy ``trainer`` runs."""
        return cls(dims=ParallelDims.of(trainer), strategy=getattr(trainer, "strategy", None))

    @property
    def engine(self) -> Any:
        """The strategy's pipeline engine (``strategy.pipeline``), or ``None``."""
        return getattr(self.strategy, "pipeline", None)

    def engine_with(self, needs: str) -> Any:
        """:attr:`engine` when it has the attribute ``needs``; ``None`` otherwise."""
        engine = self.engine
        return engine if engine is not None and hasattr(engine, needs) else None

    @property
    def micro_batches(self) -> int:
        """Micro-batches per step of the pipeline schedule (``pp > 1``), else 1."""
        engine = self.engine
        return int(engine.num_micro_batches) if engine is not None else 1

    @property
    def virtual(self) -> int:
        """Pipeline stages per pipeline rank (``virtual_pipeline``; 1 for other strategies)."""
        return int(getattr(getattr(self.strategy, "config", None), "virtual_pipeline", 1))

    @property
    def last_stage_rank(self) -> int:
        """Pipeline rank of the last stage: ``pp - 1`` in the loop layout, 0 in the V layout of
        ZBV / DualPipeV (the engine's ``last_rank``; from the strategy's schedule before the
        engine exists)."""
        engine = self.engine
        if engine is not None:
            return int(engine.last_rank)
        schedule = getattr(getattr(self.strategy, "config", None), "schedule", "1f1b")
        return 0 if stage_layout(schedule) == "v" else self.dims.pp - 1

    @property
    def owns_last_stage(self) -> bool:
        """Whether this rank runs the last pipeline stage (always true without a pipeline)."""
        return self.dims.pp == 1 or self.dims.local_rank("pp") == self.last_stage_rank

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The data-parallel group: ``mm_parallel``'s dp mesh, another strategy's world group;
        ``None`` when there is a single data-parallel rank (nothing to gather)."""
        if self.dims.dp == 1:
            return None
        group = self.dims.get_group("dp")
        return group if group is not None else dist.group.WORLD

    @property
    def stage_groups(self) -> list[Any]:
        """Groups whose successive all-reduces sum over the ranks of one pipeline stage (``dp``
        then ``tp``, those of size > 1; the world group under strategies without tensor or
        pipeline parallelism; none in a single process)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return []
        return [self.dims.get_group(n) for n in ("dp", "tp") if self.dims.size(n) > 1]

    @property
    def lightning_fsdp(self) -> bool:
        """Whether the strategy is Lightning's ``FSDPStrategy`` (flat shards, no replicas)."""
        from lightning.pytorch.strategies import FSDPStrategy

        return isinstance(self.strategy, FSDPStrategy)

    @property
    def strategy_name(self) -> str:
        """``mm_parallel/<data_parallel>`` (a strategy with its own
        :class:`~lightning_mmpar.topology.ParallelDims`), else the strategy's class name."""
        if isinstance(getattr(self.strategy, "parallel_dims", None), ParallelDims):
            config = getattr(self.strategy, "config", None)
            return f"mm_parallel/{getattr(config, 'data_parallel', '?')}"
        return type(self.strategy).__name__

    def as_dict(self) -> dict[str, Any]:
        """``{"strategy", "world", "tp", "pp", "dp", "ep", "virtual"}`` (``strategy``:
        :attr:`strategy_name`), for run summaries and logs."""
        dims = self.dims
        return {
            "strategy": self.strategy_name,
            "world": dims.world_size,
            "tp": dims.tp,
            "pp": dims.pp,
            "dp": dims.dp,
            "ep": dims.ep,
            "virtual": self.virtual,
        }
