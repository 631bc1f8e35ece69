"""Which device runs each mesh position: a rank placement chosen from the device graph.

The mesh is ``(pp, edp, ep, tp)``, slowest first (:data:`MESH_AXES`, the strategy's
``MESH_DIMS``); position ``i`` is Megatron's global rank ``i``
(``((pp_rank * edp + edp_rank) * ep + ep_rank) * tp + tp_rank``, megatron-core's
``order="tp-cp-ep-dp-pp"``). A :class:`Placement` maps positions to devices;
:func:`megatron_placement` is the identity.

:func:`place` picks the placement with the least predicted communication time
(:func:`placement_seconds`: for each dimension, the slowest of its groups'
:func:`~lightning_mmpar.layout.devices.collective_seconds`, summed over dimensions). It
searches every nesting order of the mesh axes over a device order that keeps each link island
contiguous (devices sorted by their connected component at every bandwidth level, coarsest
first: node, socket, PCIe switch, NVLink pair), then improves the best by swapping pairs of
devices while that helps. Heavy traffic (``tp`` >> ``ep`` > ``pp`` > ``dp`` by default) lands
on the fastest islands; a placement never predicts worse than Megatron's order (a candidate
itself). Megatron-LM (Narayanan et al. 2021) places TP inside a node by rank order alone;
this reads the topology.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lightning_mmpar.layout.devices import COLLECTIVES, DeviceGraph, collective_seconds

__all__ = [
    "DEFAULT_TRAFFIC",
    "MESH_AXES",
    "Placement",
    "group_positions",
    "machine_placement",
    "megatron_placement",
    "place",
    "placement_seconds",
]

MESH_AXES: tuple[str, ...] = ("pp", "edp", "ep", "tp")
"""Mesh axes, slowest first (``lightning_mmpar.topology.MESH_DIMS``)."""
_FLATTENED = {"dp": ("edp", "ep"), "vl": ("tp",)}  # vl: the tp ranks' own communicator
_AS = {
    "send": "send_recv",
    "broadcast": "all_gather",  # a pipelined ring broadcast ~ a gather
    "all_to_all_v": "all_to_all",
}
_SKIP = ("recv", "barrier")  # a receive is the same message as a send, counted there
_KIND = {
    "tp": "all_reduce",
    "vl": "all_reduce",
    "dp": "all_reduce",
    "edp": "all_reduce",
    "ep": "all_to_all",
    "pp": "send_recv",
}
DEFAULT_TRAFFIC: dict[str, float] = {"tp": 8e9, "ep": 1e9, "pp": 1.25e8, "dp": 1.5e7}
"""Bytes per step per rank by dimension when none are given: relative weights
``tp >> ep > pp > dp`` (TP all-reduces every layer's activations; EP all-to-alls tokens;
pipelines send one boundary per micro-batch; data parallelism reduces gradients once)."""


def _shape(pp: int, dp: int, ep: int, tp: int) -> dict[str, int]:
    for name, value in (("pp", pp), ("dp", dp), ("ep", ep), ("tp", tp)):
        if type(value) is not int or value < 1:
            raise ValueError(f"{name} ({value!r}) must be a positive integer; use 1 to disable.")
    if dp % ep:
        raise ValueError(f"ep ({ep}) must divide dp ({dp}); choose a divisor of {dp}.")
    return {"pp": pp, "edp": dp // ep, "ep": ep, "tp": tp}


def group_positions(shape: Mapping[str, int] | Sequence[int], dim: str) -> list[list[int]]:
    """Mesh positions of every group along ``dim`` (``pp``, ``edp``, ``ep``, ``tp``, ``dp`` =
    ``(edp, ep)`` flattened, ``vl`` = ``tp``), sorted; within a group in mesh order (row-major
    over the group's axes), as ``lightning_mmpar.topology.ParallelDims.groups`` lists ranks.

    ``shape``: sizes by axis (``{"pp", "edp", "ep", "tp"}``, or ``dp`` in place of ``edp``) or
    a tuple in :data:`MESH_AXES` order.

    Raises:
        ValueError: an unknown ``dim`` or a shape without the four axes.
    """
    if isinstance(shape, Mapping):
        sizes = dict(shape)
        if "edp" not in sizes and "dp" in sizes:
            sizes["edp"] = sizes["dp"] // sizes.get("ep", 1)
        sizes = {a: int(sizes.get(a, 1)) for a in MESH_AXES}
    elif len(shape) == len(MESH_AXES):
        sizes = dict(zip(MESH_AXES, shape, strict=True))
    else:
        raise ValueError(f"shape {tuple(shape)} must give the sizes of {MESH_AXES}.")
    keep = _FLATTENED.get(dim, (dim,))
    if any(a not in MESH_AXES for a in keep):
        raise ValueError(f"dim ({dim!r}) must be one of {(*MESH_AXES, *_FLATTENED)}.")
    groups: dict[tuple[int, ...], list[int]] = {}
    for position, coords in enumerate(itertools.product(*(range(sizes[a]) for a in MESH_AXES))):
        rest = tuple(c for a, c in zip(MESH_AXES, coords, strict=True) if a not in keep)
        groups.setdefault(rest, []).append(position)
    return sorted(groups.values())


@dataclass(frozen=True)
class Placement:
    """Mesh position ``i`` (Megatron's rank order over :data:`MESH_AXES`) runs on global rank
    ``devices[i]``.

    Raises:
        ValueError: ``devices`` not a permutation of ``0 .. len(devices) - 1``.
    """

    devices: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(self.devices))  # a list works too
        if sorted(self.devices) != list(range(len(self.devices))):
            raise ValueError(
                f"placement devices ({list(self.devices)}) must be a permutation of "
                f"0 .. {len(self.devices) - 1}: each global rank runs exactly one mesh position."
            )

    @property
    def world(self) -> int:
        """Number of ranks."""
        return len(self.devices)


def megatron_placement(world: int) -> Placement:
    """The identity: position ``i`` on rank ``i`` (Megatron-LM's and torchtitan's order).

    Raises:
        ValueError: ``world`` not an int >= 1.
    """
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world ({world!r}) must be an int >= 1 (the job's device count).")
    return Placement(tuple(range(world)))


class _Cost:
    """:func:`placement_seconds` for many placements of one layout: groups computed once,
    collective times cached by device tuple."""

    def __init__(self, graph: DeviceGraph, shape: dict[str, int], traffic: Mapping[str, float]):
        world = math.prod(shape.values())
        if graph.num_devices != world:
            raise ValueError(
                f"the device graph has {graph.num_devices} devices but the layout needs "
                f"pp * dp * tp = {world}; describe exactly the devices of the job."
            )
        self.graph, self.terms = graph, []
        self.cache: dict[tuple[str, float, tuple[int, ...]], float] = {}
        for key, nbytes in traffic.items():
            dim, _, kind = key.partition(".")
            kind = _AS.get(kind, kind) or _KIND.get(dim, "")
            if dim not in _KIND or kind not in (*COLLECTIVES, *_SKIP):
                raise ValueError(
                    f"traffic key {key!r} must be a dimension ({', '.join(_KIND)}) or "
                    f"'<dim>.<kind>' (kind: {', '.join((*COLLECTIVES, *_AS, *_SKIP))}); values "
                    f"are bytes per step per rank."
                )
            if kind not in _SKIP and nbytes:
                self.terms.append((dim, kind, float(nbytes), group_positions(shape, dim)))

    def seconds(self, devices: Sequence[int]) -> tuple[dict[str, float], float]:
        """Seconds by dimension (each the slowest group), and the sum over all groups (a
        tie-breaker: lowering one group's time helps even while another is as slow)."""
        out: dict[str, float] = {}
        mass = 0.0
        for dim, kind, nbytes, groups in self.terms:
            worst = 0.0
            for group in groups:
                ranks = tuple(devices[p] for p in group)
                key = (kind, nbytes, ranks)
                if key not in self.cache:
                    self.cache[key] = collective_seconds(self.graph, kind, ranks, nbytes)
                worst, mass = max(worst, self.cache[key]), mass + self.cache[key]
            out[dim] = out.get(dim, 0.0) + worst
        return out, mass

    def better(self, devices: Sequence[int], than: tuple[float, float]) -> tuple[float, float]:
        """``(total, mass)`` of ``devices`` if it beats ``than`` (relative 1e-12), else ``than``."""
        by_dim, mass = self.seconds(devices)
        total = sum(by_dim.values())
        if total < than[0] * (1 - 1e-12) or (
            total <= than[0] * (1 + 1e-12) and mass < than[1] * (1 - 1e-12)
        ):
            return total, mass
        return than


def placement_seconds(
    graph: DeviceGraph,
    placement: Placement,
    *,
    pp: int,
    dp: int,
    ep: int,
    tp: int,
    traffic: Mapping[str, float] | None = None,
) -> dict[str, float]:
    """Predicted communication seconds per step by dimension.

    ``traffic``: bytes per step per rank, keyed by dimension (``tp``, ``vl``, ``ep``, ``pp``,
    ``dp``, ``edp``: that dimension's usual collective: all-reduce, all-to-all for ``ep``,
    send/recv for ``pp``) or ``"<dim>.<kind>"``, the keys of
    ``lightning_mmpar.layout.comm.comm_bytes`` (``send`` = ``send_recv``, ``broadcast`` priced
    as ``all_gather``; ``recv`` and ``barrier`` skipped: a receive is the same message as its
    send, and links are full duplex); default :data:`DEFAULT_TRAFFIC`. Each entry costs the
    slowest of its dimension's groups (they run at once) as one collective of that many bytes
    (the latency term counts once per entry).

    Raises:
        ValueError: bad degrees, a graph of another size, an unknown traffic key.
    """
    cost = _Cost(graph, _shape(pp, dp, ep, tp), DEFAULT_TRAFFIC if traffic is None else traffic)
    if placement.world != graph.num_devices:
        raise ValueError(
            f"placement has {placement.world} ranks, the graph {graph.num_devices} devices."
        )
    return cost.seconds(placement.devices)[0]


def _island_order(graph: DeviceGraph) -> list[int]:
    """Devices node by node, each node's sorted so that every connected component at every
    bandwidth level is contiguous (coarsest level first; a component named by its smallest
    device)."""
    order: list[int] = []
    for node in sorted(set(graph.node_of)):
        members = [i for i, k in enumerate(graph.node_of) if k == node]
        pairs = list(itertools.combinations(members, 2))
        bandwidth = {(i, j): graph.link(i, j).bandwidth for i, j in pairs}
        keys: dict[int, list[int]] = {i: [] for i in members}
        for level in sorted(set(bandwidth.values())):
            root = {i: i for i in members}

            def find(i: int, root: dict[int, int] = root) -> int:
                while root[i] != i:
                    i = root[i]
                return i

            for (i, j), bw in bandwidth.items():
                if bw >= level:
                    a, b = find(i), find(j)
                    root[max(a, b)] = min(a, b)
            for i in members:
                keys[i].append(find(i))
        order += sorted(members, key=lambda i: (keys[i], i))
    return order


def _nested(shape: dict[str, int], axes: Sequence[str], order: Sequence[int]) -> tuple[int, ...]:
    """Devices of the mesh positions when ``axes`` (slowest first) walk ``order``."""
    strides, stride = {}, 1
    for axis in reversed(axes):
        strides[axis], stride = stride, stride * shape[axis]
    coords = itertools.product(*(range(shape[a]) for a in MESH_AXES))
    return tuple(
        order[sum(c * strides.get(a, 0) for a, c in zip(MESH_AXES, cs, strict=True))]
        for cs in coords
    )


def place(
    graph: DeviceGraph,
    *,
    pp: int,
    dp: int,
    ep: int,
    tp: int,
    traffic: Mapping[str, float] | None = None,
) -> Placement:
    """The placement with the least :func:`placement_seconds` total found (module docstring:
    every axis nesting over the island order, then pairwise swaps); ties keep Megatron's order.

    Raises:
        ValueError: as :func:`placement_seconds`.
    """
    shape = _shape(pp, dp, ep, tp)
    cost = _Cost(graph, shape, DEFAULT_TRAFFIC if traffic is None else traffic)
    world = graph.num_devices
    best = tuple(range(world))
    score = cost.better(best, (math.inf, math.inf))
    islands = _island_order(graph)
    for axes in itertools.permutations([a for a in MESH_AXES if shape[a] > 1]):
        candidate = _nested(shape, axes, islands)
        if (new := cost.better(candidate, score)) is not score:
            best, score = candidate, new
    improved = world <= 16  # O(world^2) swaps per pass: small jobs only
    while improved:
        improved = False
        for i, j in itertools.combinations(range(world), 2):
            swapped = list(best)
            swapped[i], swapped[j] = swapped[j], swapped[i]
            if (new := cost.better(swapped, score)) is not score:
                best, score, improved = tuple(swapped), new, True
    return Placement(best)


def machine_placement(*, pp: int, dp: int, ep: int, tp: int, world: int) -> tuple[int, ...] | None:
    """:func:`place` on this machine's topology (``DeviceGraph.from_machine``), replicated over
    ``world // local GPUs`` identical nodes (global ranks node by node, as torchrun numbers
    them), as the tuple of devices; None when the topology cannot be read or ``world`` is not
    a whole number of such nodes (the caller keeps Megatron's order).

    Raises:
        ValueError: as :func:`place` (bad degrees).
    """
    local = DeviceGraph.from_machine()
    if local is None or world % local.num_devices:
        return None
    graph = local.replicate(world // local.num_devices)  # torchrun: node k has ranks k*n ..
    return place(graph, pp=pp, dp=dp, ep=ep, tp=tp).devices
