"""The strategy's layout arguments, typed and validated.

:class:`ParallelConfig` holds what ``MultimodalParallelStrategy`` is given; its rules are
:func:`lightning_mmpar.layout.validate`'s (the one check the pre-launch check and the planner run
too), on :attr:`ParallelConfig.layout`: at construction, before any process group exists, then
against the world size (:meth:`ParallelConfig.check_world`) and the batch
(:meth:`ParallelConfig.check_batch_size`). Each raises a ``ValueError`` that names the field,
the value, the constraint and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from lightning_mmpar.layout import LayoutFacts, ParallelLayout, parse_partition, validate
from lightning_mmpar.layout.schedules import (  # the schedule facts' home; names kept here
    MULTI_STAGE_SCHEDULES as MULTI_STAGE_SCHEDULES,
)
from lightning_mmpar.layout.schedules import ROUND_SCHEDULES as ROUND_SCHEDULES
from lightning_mmpar.layout.schedules import SCHEDULES as SCHEDULES
from lightning_mmpar.layout.schedules import SPLIT_BACKWARD_SCHEDULES as SPLIT_BACKWARD_SCHEDULES
from lightning_mmpar.layout.schedules import V_SCHEDULES as V_SCHEDULES
from lightning_mmpar.layout.schedules import Schedule as Schedule
from lightning_mmpar.layout.schedules import min_micro_batches as min_micro_batches
from lightning_mmpar.layout.schedules import stage_layout as stage_layout

DataParallel = Literal["fsdp", "ddp", "none"]
DATA_PARALLEL_ENGINES: tuple[str, ...] = ("fsdp", "ddp", "none")
VisionDataParallel = Literal["ddp", "fsdp"]


@dataclass(kw_only=True)
class ParallelConfig:
    """The sizes and engines of one parallel layout, as the strategy takes them.

    Data parallelism is inferred: ``data_parallel_size = world_size / (tensor_parallel *
    pipeline_parallel)``; expert parallelism is carved out of the data-parallel ranks.
    Validated at construction by :func:`lightning_mmpar.layout.validate` (on :attr:`layout`).
    """

    tensor_parallel: int = 1
    """Ranks that split each layer's weights (attention heads, FFN inner dim)."""
    pipeline_parallel: int = 1
    """Number of pipeline ranks; consecutive blocks form one stage per rank (or ``virtual_pipeline``
    stages per rank with the interleaved schedule)."""
    expert_parallel: int = 1
    """Ranks over which MoE experts are spread; must divide the data-parallel size."""
    virtual_pipeline: int = 1
    """Pipeline stages per rank (Megatron's virtual pipeline); > 1 needs a multi-stage schedule."""
    micro_batches: int | None = None
    """Micro-batches per optimizer step under pipeline parallelism; default ``pipeline_parallel``
    (``2 * pipeline_parallel`` for ``dualpipev``, whose minimum is the stage count)."""
    schedule: Schedule = "1f1b"
    """Pipeline schedule, one of :data:`SCHEDULES`; multi-stage ones
    (:data:`MULTI_STAGE_SCHEDULES`) need ``virtual_pipeline >= 2``, the V ones
    (:data:`V_SCHEDULES`) exactly 2; micro-batch minimums in :func:`min_micro_batches`."""
    data_parallel: DataParallel = "fsdp"
    """Data-parallel engine: ``fsdp`` (FSDP2 ``fully_shard``, ZeRO-3 role), ``ddp`` or ``none``
    (no data parallelism: only for a data-parallel size of 1, see :meth:`check_world`)."""
    partition: str | list[int] = "equal"
    """How the pipeline blocks are cut into ``pp * v`` stages
    (:func:`lightning_mmpar.layout.plan_stages`): ``equal``, ``balanced`` (least maximum stage
    FLOPs), ``measured`` (least maximum stage time, each block's forward + backward timed at
    set-up: :mod:`lightning_mmpar.parallel.pipeline.block_timing`), ``memory`` (least maximum
    stage bytes), ``ratio:V:A:D`` (vision : aligner : decoder
    stage counts) or explicit boundaries (first block of stages 1 .. S-1)."""
    placement: str | list[int] | None = None
    """Global rank of each mesh position (topology-aware, :meth:`resolve_placement`): ``None`` /
    ``"auto"``, ``"megatron"`` (identity), a list (``list[i]`` = rank at Megatron position
    ``i``) or a topology file (nvidia-smi text or YAML)."""
    vision_ranks: int = 0
    """Ranks that run the vision tower alone (non-colocated, :mod:`lightning_mmpar.parallel.
    towers`): the last ``vision_ranks`` global ranks; the others are the language ranks, laid
    out by the sizes above. ``0``: colocated (every rank holds its share of every tower)."""
    vision_data_parallel: VisionDataParallel = "ddp"
    """The vision tower's data parallelism over the ``vision_ranks``: ``ddp`` (a full copy on
    each, gradients summed) or ``fsdp`` (FSDP2 over the vision ranks: parameters, gradients and
    optimizer state sharded; needs ``vision_ranks >= 2``)."""

    def __post_init__(self) -> None:
        validate(self.layout)
        check_placement_option(self.placement)

    @property
    def layout(self) -> ParallelLayout:
        """These arguments as the layout value (``dp`` unknown until the world size is)."""
        part = self.partition
        return ParallelLayout(
            tp=self.tensor_parallel,
            pp=self.pipeline_parallel,
            dp=None,
            ep=self.expert_parallel,
            virtual=self.virtual_pipeline,
            micro_batches=self.micro_batches,
            schedule=self.schedule,
            data_parallel=self.data_parallel,
            partition=tuple(part) if isinstance(part, list) else part,
            vision_ranks=self.vision_ranks,
            vision_data_parallel=self.vision_data_parallel,
        )

    def check_world(self, world_size: int) -> None:
        """Check this layout against the number of processes, once it is known
        (:func:`~lightning_mmpar.layout.validate` with ``world_size``).

        Raises ``ValueError`` for a ``world_size`` the model-parallel sizes do not divide, an
        ``expert_parallel`` not dividing the data-parallel size ``world_size / (tensor_parallel
        * pipeline_parallel)``, ``data_parallel="none"`` with a data-parallel size above 1
        (replicas whose gradients are never averaged and whose weights drift apart, silently),
        and a zero-bubble schedule (:data:`SPLIT_BACKWARD_SCHEDULES`) with
        ``data_parallel="fsdp"`` over several replicas (wrong gradients on torch 2.14; DDP is
        exact); each message names the fixes.
        """
        validate(self.layout, LayoutFacts(world_size=world_size))

    def ineffective_options(self) -> list[str]:
        """Options this layout accepts but never uses, one warning text each: ``partition`` at
        ``pipeline_parallel=1`` (not refused: the planner carries a recipe's partition into
        its layouts without a pipeline). ``micro_batches`` above 1 and a schedule other than
        ``"1f1b"`` at ``pipeline_parallel=1`` cannot act either; :func:`validate` refuses them
        at construction."""
        if self.pipeline_parallel == 1 and self.partition_mode != "equal":
            return [
                f"partition ({self.partition!r}) has no effect with pipeline_parallel=1: there "
                "are no stages to cut; set pipeline_parallel >= 2 or leave partition unset."
            ]
        return []

    def resolve_placement(self, world_size: int) -> tuple[tuple[int, ...] | None, str]:
        """``(placement, source)`` for ``world_size`` ranks (cached): ``placement[i]`` is the
        global rank at mesh position ``i`` (``None``: Megatron's order). ``None`` / ``"auto"``:
        :func:`lightning_mmpar.layout.placement.machine_placement` on a CUDA machine whose
        ``nvidia-smi topo -m`` shows ``world_size`` GPUs, else Megatron's order. A file:
        ``layout.devices.load_topology`` then ``layout.placement.place``.

        Raises:
            ValueError: a list not of length ``world_size``; a topology file that does not
                parse or describes another number of devices.
        """
        value = self.placement
        key = tuple(value) if isinstance(value, list) else value
        return _resolve(
            key, world_size, self.tensor_parallel, self.pipeline_parallel, self.expert_parallel
        )

    @staticmethod
    def check_clipping(plugin: str, global_norm: bool, clip: float | None, mode: str | None) -> str:
        """The warning (``""``: none) for a precision plugin named ``plugin`` that does not clip
        by the global norm (``global_norm`` False) under ``on_nonfinite=mode`` (``None``: off).
        Raises ``ValueError`` if ``clip`` (``gradient_clip_val``) is set with such a plugin."""
        if clip and not global_norm:
            raise ValueError(
                f"gradient_clip_val ({clip}) needs a precision plugin that clips by the global "
                f"norm; {plugin} clips local shards only. Use precision='32-true', 'bf16-mixed', "
                "'16-mixed', 'bf16-true' or '16-true', or mix "
                "lightning_mmpar.precision.GlobalNormClipping into your plugin."
            )
        if mode is None or global_norm:
            return ""
        return (
            f"on_nonfinite={mode!r} is not checked with the precision plugin {plugin}; use one "
            "of Lightning's precision flags or mix lightning_mmpar.precision.GlobalNormClipping "
            "into your plugin."
        )

    @property
    def partition_mode(self) -> str:
        """``partition``'s mode (``explicit`` for boundaries)."""
        return parse_partition(self.partition).mode

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per step: ``micro_batches``, by default ``pipeline_parallel`` (or the
        schedule's minimum when higher, :func:`min_micro_batches`); 1 without pipeline
        parallelism."""
        return 1 if self.pipeline_parallel == 1 else self.layout.num_micro_batches

    @property
    def num_stages(self) -> int:
        """Total pipeline stages: ``pipeline_parallel * virtual_pipeline``."""
        return self.pipeline_parallel * self.virtual_pipeline

    def check_batch_size(self, batch_size: int, name: str = "data.batch_size") -> None:
        """Under pipeline parallelism every batch splits into :attr:`num_micro_batches` equal
        micro-batches (torch's pipeline stages fix activation shapes at the first step):
        :func:`~lightning_mmpar.layout.validate` with ``batch_size``.

        Raises:
            ValueError: ``batch_size`` (per data-parallel rank; ``name`` in the message) not
                divisible by the micro-batches.
        """
        validate(self.layout, LayoutFacts(batch_size=batch_size, batch_name=name))


PLACEMENT_NAMES: tuple[str, ...] = ("auto", "megatron")
"""Named :attr:`ParallelConfig.placement` values; any other string is a topology file path."""


def check_placement_option(value: Any) -> None:
    """Check a :attr:`ParallelConfig.placement` before the world size is known: raises
    ``ValueError`` for a list that is not a permutation of ``0 .. len - 1``, a string neither
    ``"auto"`` / ``"megatron"`` nor an existing file, or another type."""
    if value is None or value in PLACEMENT_NAMES:
        return
    if isinstance(value, str):
        if not Path(value).is_file():
            raise ValueError(
                f"placement ({value!r}) is neither one of {', '.join(PLACEMENT_NAMES)} nor an "
                "existing topology file; pass the path of `nvidia-smi topo -m` output or a YAML "
                "topology, or 'auto'."
            )
        return
    ints = isinstance(value, (list, tuple)) and all(type(r) is int for r in value)
    if ints and sorted(value) == list(range(len(value))):
        return
    raise ValueError(
        f"placement ({value!r}) must be None, 'auto', 'megatron', a topology file path or a "
        "list of global ranks (each of 0 .. world_size - 1 once: list[i] = the rank running "
        "mesh position i); fix the list or use 'megatron'."
    )


@lru_cache(maxsize=16)
def _resolve(
    value: str | tuple[int, ...] | None, world_size: int, tp: int, pp: int, ep: int
) -> tuple[tuple[int, ...] | None, str]:
    """:meth:`ParallelConfig.resolve_placement` (a topology file or nvidia-smi read once)."""
    dp = max(1, world_size // (tp * pp))
    if value is None or value == "auto":
        found = _machine_placement(world_size, pp=pp, dp=dp, ep=ep, tp=tp)
        return (found, "machine topology (nvidia-smi topo -m)") if found else (None, "megatron")
    if value == "megatron":
        return None, "megatron"
    if isinstance(value, str):
        from lightning_mmpar.layout.devices import load_topology
        from lightning_mmpar.layout.placement import place

        graph = load_topology(value)
        if graph.num_devices != world_size:
            raise ValueError(
                f"placement ({value!r}) describes {graph.num_devices} devices but the run has "
                f"{world_size} processes; pass the topology of all {world_size} devices "
                "(nodes * GPUs per node) or placement='megatron'."
            )
        return tuple(place(graph, pp=pp, dp=dp, ep=ep, tp=tp).devices), f"topology {value}"
    if len(value) != world_size:
        raise ValueError(
            f"placement ({list(value)!r}) lists {len(value)} ranks but the run has {world_size} "
            f"processes; list each of the {world_size} global ranks once."
        )
    return tuple(value), "given"


def _machine_placement(world: int, **degrees: int) -> tuple[int, ...] | None:
    """This CUDA machine's placement; ``None`` without CUDA, ``layout.placement`` or a readable
    ``nvidia-smi topo -m``."""
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        from lightning_mmpar.layout.placement import machine_placement
    except ImportError:
        return None
    found = machine_placement(world=world, **degrees)
    return None if found is None else tuple(found)


def loader_batching(dataloader: object) -> tuple[object, object]:
    """``(batch_size, drop_last)`` a DataLoader batches with: its own, or its batch sampler's
    when it was built with ``batch_sampler=`` (its own then read ``None`` and ``False``: the
    loaders Lightning re-creates around a distributed sampler, torchdata's
    ``StatefulDataLoader`` among them)."""
    batch_size = getattr(dataloader, "batch_size", None)
    drop_last = getattr(dataloader, "drop_last", None)
    sampler = getattr(dataloader, "batch_sampler", None)
    if batch_size is None and sampler is not None and hasattr(sampler, "batch_size"):
        batch_size, drop_last = sampler.batch_size, getattr(sampler, "drop_last", drop_last)
    return batch_size, drop_last


def check_train_batches(total: int | None, dataloader: object) -> None:
    """Refuse a fit whose train dataloader yields no batch on any rank.

    ``total`` is ``len(dataloader)`` summed over all ranks (``None`` for an unsized loader, which
    passes). Lightning only logs ``Trainer.fit stopped: No training batches`` and exits 0 after
    zero steps, with a summary and metrics as if it had trained.

    Raises:
        ValueError: ``total == 0``, naming the loader, its dataset size and batch size, and fixes.
    """
    if total is None or total > 0:
        return
    dataset = getattr(dataloader, "dataset", None)
    size = len(dataset) if hasattr(dataset, "__len__") else "unknown"  # type: ignore[arg-type]
    batch_size, drop_last = loader_batching(dataloader)
    raise ValueError(
        f"the train dataloader ({type(dataloader).__name__} over {type(dataset).__name__} of "
        f"{size} samples, batch_size {batch_size}, drop_last "
        f"{drop_last}) has 0 batches on every rank, so fit would "
        "run 0 steps. Check the datamodule's data path and train split, use a batch_size no "
        "larger than the samples per data-parallel rank, or set drop_last=False."
    )
