"""Parallel degrees -> a named ``DeviceMesh`` in Megatron's rank order.

Rank order (fastest first) is tensor, expert, data, pipeline, i.e. for a global rank ``r``::

    r = ((pp_rank * edp + edp_rank) * ep + ep_rank) * tp + tp_rank

which is megatron-core's ``order="tp-cp-ep-dp-pp"`` (context parallel = 1). The data-parallel
group of dense parameters is the flattened ``(edp, ep)`` pair, so expert parallelism is carved
out of the data-parallel ranks exactly as in Megatron.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from lightning_mmpar import compat

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

MESH_DIMS: tuple[str, ...] = ("pp", "edp", "ep", "tp")
"""Dimensions of the root mesh, slowest first."""
DERIVED_DIMS: dict[str, tuple[str, ...]] = {"dp": ("edp", "ep")}
"""Flattened dimensions available through :meth:`ParallelDims.get_mesh`."""


@dataclass(kw_only=True)
class ParallelDims:
    """The degrees of one layout on ``world_size`` ranks, validated at construction.

    Data parallelism is inferred as ``world_size // (tp * pp)``; ``ep`` must divide it.
    """

    world_size: int
    """Total number of ranks."""
    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline-parallel degree."""
    ep: int = 1
    """Expert-parallel degree (a divisor of the data-parallel degree)."""
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    _vl_group: dist.ProcessGroup | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                fix = "pass the number of ranks" if name == "world_size" else "use 1 to disable it"
                raise ValueError(f"{name} ({value!r}) must be a positive integer; {fix}.")
        model = self.tp * self.pp
        if self.world_size % model != 0:
            raise ValueError(
                f"world_size ({self.world_size}) must be divisible by tensor_parallel * "
                f"pipeline_parallel ({self.tp} * {self.pp} = {model}); change the number of "
                f"devices to a multiple of {model} or reduce the model-parallel sizes."
            )
        if self.dp % self.ep != 0:
            raise ValueError(
                f"expert_parallel ({self.ep}) must divide the data-parallel size ({self.dp} = "
                f"world_size {self.world_size} / (tensor_parallel {self.tp} * pipeline_parallel "
                f"{self.pp})); choose expert_parallel from {_divisors(self.dp)}."
            )

    @property
    def dp(self) -> int:
        """Data-parallel degree: ``world_size // (tp * pp)``."""
        return self.world_size // (self.tp * self.pp)

    @property
    def edp(self) -> int:
        """Data-parallel degree of expert parameters: ``dp // ep``."""
        return self.dp // self.ep

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the root mesh, in :data:`MESH_DIMS` order."""
        return (self.pp, self.edp, self.ep, self.tp)

    def rank_coords(self, rank: int) -> dict[str, int]:
        """Coordinates of a global rank (no process group needed)."""
        coords = {}
        for name, size in zip(reversed(MESH_DIMS), reversed(self.shape), strict=True):
            coords[name] = rank % size
            rank //= size
        coords["dp"] = coords["edp"] * self.ep + coords["ep"]
        return coords

    def groups(self, name: str) -> list[list[int]]:
        """All rank groups along one dimension (``pp``, ``dp``, ``edp``, ``ep``, ``tp``)."""
        dims = DERIVED_DIMS.get(name, (name,))
        self._check_name(name)
        ranks = torch.arange(self.world_size).reshape(self.shape)
        keep = [MESH_DIMS.index(d) for d in dims]
        rest = [i for i in range(len(MESH_DIMS)) if i not in keep]
        flat = ranks.permute(*rest, *keep).reshape(
            -1, int(torch.tensor([self.shape[i] for i in keep]).prod())
        )
        return sorted(row.tolist() for row in flat)

    def _check_name(self, name: str) -> None:
        valid = (*MESH_DIMS, *DERIVED_DIMS)
        if name not in valid:
            raise KeyError(f"unknown mesh dimension {name!r}; valid names: {', '.join(valid)}.")

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Create the root mesh, its flattened ``dp`` dimension and the ``vl`` group.

        Collective: every rank must call it, after the default process group exists.
        """
        if self._mesh is None:
            self._mesh = compat.init_mesh(device_type, self.shape, MESH_DIMS, DERIVED_DIMS)
            self._vl_group = compat.new_subgroups(self.groups("tp"))
        return self._mesh

    @property
    def is_built(self) -> bool:
        """Whether :meth:`build_mesh` ran."""
        return self._mesh is not None

    @property
    def mesh(self) -> DeviceMesh:
        """The root mesh; raises before :meth:`build_mesh`."""
        if self._mesh is None:
            raise RuntimeError(
                "Accessing the device mesh before processes have initialized is not allowed."
            )
        return self._mesh

    def get_mesh(self, name: str) -> DeviceMesh:
        """The 1-D sub-mesh of one dimension (``pp``, ``dp``, ``edp``, ``ep``, ``tp``)."""
        self._check_name(name)
        return self.mesh[name]

    @property
    def vl_group(self) -> dist.ProcessGroup:
        """Dedicated vision-language group: same ranks as ``tp``, its own communicator.

        Cross-attention combines (TECHNIQUES 1.3) run here so they do not queue behind the
        text path's collectives on the tp communicator.
        """
        self.mesh  # noqa: B018 - raises the standard message before set-up
        assert self._vl_group is not None
        return self._vl_group


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
