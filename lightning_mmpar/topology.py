"""Parallel degrees -> a named ``DeviceMesh`` in Megatron's rank order.

Rank order (fastest first) is tensor, expert, data, pipeline, i.e. for a global rank ``r``::

    r = ((pp_rank * edp + edp_rank) * ep + ep_rank) * tp + tp_rank

which is megatron-core's ``order="tp-cp-ep-dp-pp"`` (context parallel = 1). The data-parallel
group of dense parameters is the flattened ``(edp, ep)`` pair, so expert parallelism is carved
out of the data-parallel ranks exactly as in Megatron.

A *placement* permutes that order: ``placement[i]`` is the global rank that runs
mesh position ``i`` (``i`` the Megatron rank above), so a topology-aware order
(:func:`lightning_mmpar.layout.placement.place`) puts tensor-parallel peers on the fastest links
without changing any coordinate's meaning. The mesh is then built from the permuted rank tensor
(``DeviceMesh(device_type, torch.tensor(placement).reshape(shape))``) with order-preserving
groups (:func:`lightning_mmpar.compat.init_mesh`), so every group-local rank equals the
coordinate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from lightning_mmpar import compat
from lightning_mmpar.layout import LayoutFacts, ParallelLayout, validate

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

MESH_DIMS: tuple[str, ...] = ("pp", "edp", "ep", "tp")
"""Dimensions of the root mesh, slowest first."""
DERIVED_DIMS: dict[str, tuple[str, ...]] = {"dp": ("edp", "ep")}
"""Flattened dimensions available through :meth:`ParallelDims.get_mesh`."""
LIGHTNING_ALIASES: dict[str, str] = {"data_parallel": "dp", "tensor_parallel": "tp"}
"""Lightning ``ModelParallelStrategy`` mesh names -> ours; the mesh answers to both, so a module
written for ``ModelParallelStrategy`` (``self.device_mesh["tensor_parallel"]``) runs unchanged."""


@dataclass(kw_only=True)
class ParallelDims:
    """The degrees of one layout on ``world_size`` ranks, validated at construction.

    Data parallelism is inferred as ``world_size // (tp * pp)``; ``ep`` must divide it.
    ``placement`` (default ``None``: Megatron's order, the identity) is stored resolved, as a
    tuple: ``placement[i]`` = the global rank at mesh position ``i``. Raises ``ValueError``
    for a degree below 1, a world the sizes do not divide or ``ep`` not dividing the
    data-parallel size (:func:`lightning_mmpar.layout.validate`'s rules), or a placement that is
    not a permutation of ``range(world_size)``.
    """

    world_size: int
    """Total number of ranks."""
    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline-parallel degree."""
    ep: int = 1
    """Expert-parallel degree (a divisor of the data-parallel degree)."""
    placement: tuple[int, ...] | None = None
    """Global rank of each mesh position (Megatron row-major over :data:`MESH_DIMS`); ``None``
    is the identity and is stored as ``tuple(range(world_size))``."""
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    _vl_mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    _position: dict[int, int] = field(default_factory=dict, init=False, repr=False, compare=False)
    _groups: dict[str, Any] | None = field(default=None, init=False, repr=False)
    """Groups of a layout this package did not build (another strategy's), by dim name."""
    _sub_meshes: dict[str, DeviceMesh] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    """:meth:`get_mesh`'s 1-D sub-meshes of the built mesh, by name: slicing a ``DeviceMesh``
    costs ~0.2 ms of Python, and the strategy's steps ask for the ``dp`` group several times
    per step."""

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                fix = "pass the number of ranks" if name == "world_size" else "use 1 to disable it"
                raise ValueError(f"{name} ({value!r}) must be a positive integer; {fix}.")
        degrees = ParallelLayout(tp=self.tp, pp=self.pp, ep=self.ep, dp=None)
        validate(degrees, LayoutFacts(world_size=self.world_size))
        self.placement = check_placement(self.placement, self.world_size)
        self._position = {rank: i for i, rank in enumerate(self.placement)}

    @property
    def is_identity(self) -> bool:
        """Whether :attr:`placement` is Megatron's order (mesh position = global rank)."""
        return self.placement == tuple(range(self.world_size))

    def position(self, rank: int) -> int:
        """Mesh position (the Megatron rank) that global ``rank`` runs; the inverse of
        :attr:`placement`. Raises ``ValueError`` for a rank outside ``[0, world_size)``."""
        if rank not in self._position:
            raise ValueError(
                f"rank ({rank!r}) must be a global rank in [0, {self.world_size}); pass a rank "
                "of this world."
            )
        return self._position[rank]

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

    def check_agreed(self, placements: list[Any]) -> None:
        """Check that every rank resolved the same placement (``placements``: each rank's
        :attr:`placement`, by global rank, e.g. an object all-gather). Raises ``RuntimeError``
        naming the ranks that differ from rank 0 (a placement read from each node's
        ``nvidia-smi`` that disagrees would silently pair the wrong ranks)."""
        first = tuple(placements[0])
        odd = [r for r, p in enumerate(placements) if tuple(p) != first]
        if odd:
            raise RuntimeError(
                f"ranks {odd} resolved another rank placement than rank 0 ({first}); pass "
                "placement='megatron', a list of ranks or one topology file to every rank."
            )

    def rank_coords(self, rank: int) -> dict[str, int]:
        """Coordinates of a global rank (no process group needed): those of its mesh position
        :meth:`position`, i.e. Megatron's arithmetic on ``placement.index(rank)``."""
        coords, rank = {}, self.position(rank)
        for name, size in zip(reversed(MESH_DIMS), reversed(self.shape), strict=True):
            coords[name] = rank % size
            rank //= size
        coords["dp"] = coords["edp"] * self.ep + coords["ep"]
        return coords

    def groups(self, name: str) -> list[list[int]]:
        """All rank groups along one dimension (``pp``, ``dp``, ``edp``, ``ep``, ``tp``).

        Each group lists its global ranks in coordinate order (index = group-local rank); the
        groups are sorted. Under a placement: the identity layout's groups mapped through it.
        """
        dims = DERIVED_DIMS.get(name, (name,))
        self._check_name(name)
        ranks = torch.tensor(self.placement).reshape(self.shape)
        keep = [MESH_DIMS.index(d) for d in dims]
        rest = [i for i in range(len(MESH_DIMS)) if i not in keep]
        flat = ranks.permute(*rest, *keep).reshape(
            -1, int(torch.tensor([self.shape[i] for i in keep]).prod())
        )
        return sorted(row.tolist() for row in flat)

    @classmethod
    def of(cls, trainer: Any) -> ParallelDims:
        """The layout of whatever strategy ``trainer`` runs, for callbacks and losses.

        ``mm_parallel``: its own dims. Lightning's ``ModelParallelStrategy``: ``tp`` and ``dp``
        from its ``tensor_parallel`` / ``data_parallel`` mesh. Any other strategy (DDP, FSDP,
        DeepSpeed, one device): every rank is a data-parallel rank of the world group. Reads the
        strategy by duck typing (no import of any strategy class); cached on the strategy.
        """
        strategy = getattr(trainer, "strategy", None)
        dims = getattr(strategy, "parallel_dims", None)
        if isinstance(dims, ParallelDims):
            return dims
        cached = getattr(strategy, "_lightning_mmpar_dims", None)
        world = int(getattr(trainer, "world_size", 1) or 1)
        if isinstance(cached, ParallelDims) and cached.world_size == world:
            return cached
        mesh = getattr(strategy, "_device_mesh", None)
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        if mesh is not None and {"data_parallel", "tensor_parallel"} <= set(names):
            tp_mesh = mesh["tensor_parallel"]
            out = cls(world_size=world, tp=tp_mesh.size())
            out._groups = {"dp": mesh["data_parallel"].get_group(), "tp": tp_mesh.get_group()}
        else:
            out = cls(world_size=world)
            out._groups = {}
        if strategy is not None:
            setattr(strategy, "_lightning_mmpar_dims", out)  # noqa: B010 - foreign class
        return out

    def get_group(self, name: str) -> dist.ProcessGroup | None:
        """The process group of one dimension (``pp``, ``dp``, ``edp``, ``ep``, ``tp`` or a
        Lightning alias), for :mod:`lightning_mmpar.parallel.comm`.

        ``None`` only when no process group exists (one process: comm's collectives are then
        the identity). A dimension of size 1 gets a one-rank group, never the world group, so a
        collective over it is a no-op. Under another strategy the data-parallel group is the
        world group. Raises ``KeyError`` for unknown names.
        """
        import torch.distributed as _dist

        name = LIGHTNING_ALIASES.get(name, name)
        self._check_name(name)
        if not (_dist.is_available() and _dist.is_initialized()):
            return None
        if self._groups is None:
            return self.get_mesh(name).get_group()
        if name not in self._groups:
            if self.size(name) == self.world_size:
                self._groups[name] = _dist.group.WORLD
            elif self.size(name) == 1:  # only this rank takes part in creating it
                rank = _dist.get_rank()
                self._groups[name] = _dist.new_group([rank], use_local_synchronization=True)
            else:
                raise KeyError(f"dimension {name!r} has no group under this strategy.")
        group: dist.ProcessGroup | None = self._groups[name]
        return group

    def size(self, name: str) -> int:
        """Degree of one dimension (``pp``, ``dp``, ``edp``, ``ep``, ``tp`` or a Lightning
        alias)."""
        name = LIGHTNING_ALIASES.get(name, name)
        self._check_name(name)
        return int(getattr(self, name))

    def local_rank(self, name: str) -> int:
        """This process's coordinate along one dimension (0 before processes exist)."""
        import torch.distributed as _dist

        if not (_dist.is_available() and _dist.is_initialized()):
            return 0
        return self.rank_coords(_dist.get_rank())[LIGHTNING_ALIASES.get(name, name)]

    def _check_name(self, name: str) -> None:
        valid = (*MESH_DIMS, *DERIVED_DIMS)
        if name not in valid:
            raise KeyError(f"unknown mesh dimension {name!r}; valid names: {', '.join(valid)}.")

    def build_mesh(self, device_type: str, timeout: timedelta | None = None) -> DeviceMesh:
        """Create the root mesh, its flattened ``dp`` dimension and the ``vl`` group;
        ``timeout``: of every group it creates (default: torch's, 30 min on gloo).

        Collective: every rank must call it, after the default process group exists.
        """
        if self._mesh is None:
            flattened = {
                **DERIVED_DIMS,
                **{alias: DERIVED_DIMS.get(d, (d,)) for alias, d in LIGHTNING_ALIASES.items()},
            }
            ranks = None if self.is_identity else self.placement
            self._mesh = compat.init_mesh(
                device_type, self.shape, MESH_DIMS, flattened, ranks, timeout
            )
            self._vl_mesh = compat.own_communicator(self._mesh["tp"], "vl")
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
        """The 1-D sub-mesh of one dimension (``pp``, ``dp``, ``edp``, ``ep``, ``tp``, or
        Lightning's ``data_parallel`` / ``tensor_parallel``); sliced once, then cached."""
        sub = self._sub_meshes.get(name)
        if sub is None:
            self._check_name(LIGHTNING_ALIASES.get(name, name))
            sub = self._sub_meshes[name] = self.mesh[name]
        return sub

    @property
    def vl_mesh(self) -> DeviceMesh:
        """Dedicated vision-language mesh: same ranks as ``tp``, its own communicator, derived
        from the root mesh (so FSDP2 composes with TP styles applied on it).

        Cross-attention combines (``vl_combine``) run here so they do not queue behind the
        text path's collectives on the tp communicator.
        """
        self.mesh  # noqa: B018 - raises the standard message before set-up
        assert self._vl_mesh is not None
        return self._vl_mesh

    @property
    def vl_group(self) -> dist.ProcessGroup:
        """The process group of :attr:`vl_mesh`."""
        return self.vl_mesh.get_group()


def check_placement(placement: Any, world_size: int) -> tuple[int, ...]:
    """``placement`` as a tuple (``None``: the identity ``0 .. world_size - 1``).

    Raises:
        ValueError: not a sequence of ``world_size`` distinct ints covering
            ``range(world_size)``; the message names the value and the fix.
    """
    if placement is None:
        return tuple(range(world_size))
    values = list(placement) if isinstance(placement, (list, tuple)) else None
    if (
        values is None
        or any(isinstance(r, bool) or not isinstance(r, int) for r in values)
        or sorted(values) != list(range(world_size))
    ):
        raise ValueError(
            f"placement ({placement!r}) must list every global rank 0 .. {world_size - 1} once "
            f"(placement[i] = the rank running mesh position i, world_size {world_size}); pass "
            "a permutation of range(world_size), or None for Megatron's order."
        )
    return tuple(values)


@dataclass(frozen=True)
class TowerLink:
    """One path of a non-colocated step: the images of language replica ``replica`` (or its
    ``chunk``-th of ``chunks`` contiguous parts) go to vision rank ``vision`` (global rank) and
    come back as embeddings to the replica's first-stage ranks ``stage0`` (by tp rank)."""

    replica: int
    vision: int
    chunk: int
    chunks: int
    stage0: tuple[int, ...]


@dataclass(frozen=True)
class TowerRanks:
    """The non-colocated layout (Megatron-Bridge MIMO): the language ranks ``0 .. L - 1`` laid
    out by ``dims`` (``L = dims.world_size``), then ``vision_ranks`` ranks ``L .. L + V - 1``
    that run the vision tower alone (a full copy each, or FSDP2 shards:
    ``vision_data_parallel``).

    Each step vision rank ``L + v`` encodes the images of ``dp / V`` whole replicas (``V <=
    dp``: replicas ``v * dp / V ..``) or one ``V / dp``-th of one replica's images (``V >
    dp``). Raises ``ValueError`` when ``V < 1`` or ``V`` and ``dp`` do not divide one another
    (:func:`lightning_mmpar.layout.validate`'s rule).
    """

    dims: ParallelDims
    vision_ranks: int

    def __post_init__(self) -> None:
        v, dp = self.vision_ranks, self.dims.dp
        if not isinstance(v, int) or v < 1 or (dp % v and v % dp):
            raise ValueError(
                f"vision_ranks ({v!r}) must be a positive integer dividing, or divided by, the "
                f"language data-parallel size ({dp}); choose another vision_ranks."
            )

    @property
    def world_size(self) -> int:
        """Language ranks plus vision ranks."""
        return self.dims.world_size + self.vision_ranks

    def is_vision(self, rank: int) -> bool:
        """Whether global ``rank`` is a vision rank."""
        return self.dims.world_size <= rank < self.world_size

    @property
    def vision_group_ranks(self) -> list[int]:
        """The vision ranks' global ranks, ascending (their data-parallel group)."""
        return list(range(self.dims.world_size, self.world_size))

    def stage0(self, replica: int) -> tuple[int, ...]:
        """Global ranks of language replica ``replica``'s first pipeline stage, by tp rank."""
        found = []
        for rank in range(self.dims.world_size):
            c = self.dims.rank_coords(rank)
            if c["pp"] == 0 and c["dp"] == replica:
                found.append((c["tp"], rank))
        return tuple(r for _, r in sorted(found))

    def links(self) -> list[TowerLink]:
        """Every (replica, vision rank) path, by replica then chunk."""
        dp, v, base = self.dims.dp, self.vision_ranks, self.dims.world_size
        if v >= dp:
            f = v // dp
            pairs = [(r, base + r * f + j, j, f) for r in range(dp) for j in range(f)]
        else:
            k = dp // v
            pairs = [(r, base + r // k, 0, 1) for r in range(dp)]
        return [TowerLink(r, vis, j, n, self.stage0(r)) for r, vis, j, n in pairs]

    def links_of(self, rank: int) -> list[TowerLink]:
        """The paths global ``rank`` takes part in: a vision rank's (its replicas in order) or
        a first-stage language rank's (its replica's chunks in order); empty for others."""
        return [x for x in self.links() if rank == x.vision or rank in x.stage0]


def chunk_sizes(n: int, chunks: int) -> list[int]:
    """``n`` items in ``chunks`` contiguous parts, the first ``n % chunks`` one larger."""
    return [n // chunks + (j < n % chunks) for j in range(chunks)]
