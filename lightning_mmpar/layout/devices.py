"""Devices as a weighted link graph (:class:`DeviceGraph`: ``nvidia-smi topo -m`` output as the
NVIDIA System Management Interface documents it, YAML, uniform, this machine) and the alpha-beta
time of a collective on it (:func:`collective_seconds`; the alpha-beta model of Thakur et al.
2005, "Optimization of Collective Communication Operations in MPICH").

A :class:`LinkClass` is one direction's bandwidth per GPU pair (bytes/s) and a per-message
latency alpha (seconds). Defaults (:data:`LINK_CLASSES`; override them in YAML with measured
figures):

* ``NV#``: ``#`` bonded NVLinks at 25 GB/s each (NVLink 3/4: 50 GB/s bidirectional per link;
  A100 SXM 12 links = 600 GB/s, H100 SXM 18 links = 900 GB/s). ``NVSWITCH`` = ``NV18``.
* ``PIX`` / ``PXB``: PCIe 4.0 x16, 31.5 GB/s (16 GT/s x 16 lanes, 128b/130b); ``PHB`` /
  ``NODE``: the same through a host bridge, which carries each P2P byte as 6/5 bytes of TLPs
  (NCCL ``INTEL_P2P_OVERHEAD``, src/graph/topo.h); ``SYS``: 16 GB/s, NCCL's socket-interconnect
  figure (``AMD_BW``; Skylake UPI 10, Sapphire Rapids 22); ``NET``: 100 Gb/s per GPU (NCCL
  ``NET_BW``).
* Latencies: NCCL's ring / Simple-protocol hop latencies (src/graph/tuning.cc ``hwLat``):
  NVLink 3.4 us, PCIe 5.7 us, network 14 us.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import subprocess
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

__all__ = [
    "COLLECTIVES",
    "LINK_CLASSES",
    "DeviceGraph",
    "LinkClass",
    "collective_seconds",
    "load_topology",
]


@dataclass(frozen=True)
class LinkClass:
    """One kind of link between two devices."""

    name: str
    bandwidth: float
    """Bytes/s in one direction between one GPU pair."""
    latency: float
    """Seconds per message (alpha)."""

    def __post_init__(self) -> None:
        if not self.bandwidth > 0 or not self.latency >= 0:
            raise ValueError(
                f"link class {self.name!r}: bandwidth ({self.bandwidth!r}) must be > 0 bytes/s "
                f"and latency ({self.latency!r}) >= 0 seconds; give measured figures."
            )


_NVLINK_BW, _NVLINK_LAT, _PCI_BW, _PCI_LAT = 25e9, 3.4e-6, 31.5e9, 5.7e-6


LINK_CLASSES: dict[str, LinkClass] = {
    "SELF": LinkClass("SELF", math.inf, 0.0),
    "NVSWITCH": LinkClass("NVSWITCH", 18 * _NVLINK_BW, _NVLINK_LAT),
    **{f"NV{n}": LinkClass(f"NV{n}", n * _NVLINK_BW, _NVLINK_LAT) for n in range(1, 19)},
    "PIX": LinkClass("PIX", _PCI_BW, _PCI_LAT),
    "PXB": LinkClass("PXB", _PCI_BW, _PCI_LAT),
    "PHB": LinkClass("PHB", _PCI_BW * 5 / 6, _PCI_LAT),
    "NODE": LinkClass("NODE", _PCI_BW * 5 / 6, _PCI_LAT),
    "SYS": LinkClass("SYS", 16e9, _PCI_LAT),
    "NET": LinkClass("NET", 12.5e9, 14e-6),
}
"""Default link classes by name (module docstring gives the sources)."""
_ALIASES = {"X": "SELF", "SOC": "SYS"}  # nvidia-smi's self mark; SOC: SYS before driver 396
_NV = re.compile(r"NV(\d+)$")


def _class_of(token: str, classes: dict[str, LinkClass]) -> str | None:
    """The class name of an nvidia-smi cell (adding ``NV#`` classes on the way), or None."""
    name = _ALIASES.get(token, token)
    match = _NV.match(name)
    if match and name not in classes and int(match.group(1)) > 0:
        classes[name] = LinkClass(name, int(match.group(1)) * _NVLINK_BW, _NVLINK_LAT)
    return name if name in classes else None


@dataclass(frozen=True)
class DeviceGraph:
    """Devices (global ranks in launch order) and the link class of every pair.

    Raises:
        ValueError: ``links`` not square and symmetric with ``SELF`` on the diagonal,
            ``node_of`` not one entry per device, or a link name missing from ``classes``.
    """

    links: tuple[tuple[str, ...], ...]
    """``links[i][j]``: link class name between devices ``i`` and ``j`` (``SELF`` if equal)."""
    node_of: tuple[int, ...]
    """Node index of each device."""
    classes: dict[str, LinkClass]
    """Link classes by name (every name in ``links``)."""
    nics: dict[str, int] = field(default_factory=dict)
    """NIC name -> local index (on its node; the same on every node) of its closest GPU."""

    def __post_init__(self) -> None:
        n = len(self.links)
        if n == 0 or len(self.node_of) != n or any(len(row) != n for row in self.links):
            raise ValueError(
                f"DeviceGraph: links must be a square matrix with one node_of entry per device "
                f"(got {n} rows, row lengths {sorted({len(r) for r in self.links})}, "
                f"{len(self.node_of)} node_of entries)."
            )
        cells = ((i, j, name) for i, row in enumerate(self.links) for j, name in enumerate(row))
        for i, j, name in cells:
            if name not in self.classes or (i == j) != (name == "SELF") or self.links[j][i] != name:
                raise ValueError(
                    f"DeviceGraph: links[{i}][{j}] = {name!r}, links[{j}][{i}] = "
                    f"{self.links[j][i]!r}: the matrix must be symmetric, SELF exactly on its "
                    f"diagonal, every name in classes ({', '.join(sorted(self.classes))})."
                )

    @property
    def num_devices(self) -> int:
        """Number of devices."""
        return len(self.links)

    @property
    def nodes(self) -> int:
        """Number of nodes."""
        return len(set(self.node_of))

    def link(self, i: int, j: int) -> LinkClass:
        """The link class between devices ``i`` and ``j``."""
        return self.classes[self.links[i][j]]

    def select(self, devices: Sequence[int]) -> DeviceGraph:
        """The graph of ``devices`` only, renumbered ``0 .. len(devices) - 1`` in that order."""
        links = tuple(tuple(self.links[i][j] for j in devices) for i in devices)
        return replace(self, links=links, node_of=tuple(self.node_of[i] for i in devices))

    @classmethod
    def from_nvidia_smi(cls, text: str, nodes: int = 1) -> DeviceGraph:
        """Parse ``nvidia-smi topo -m`` output: ``nodes`` identical nodes joined by ``NET``.

        Reads the matrix (``X``, ``NV#``, ``PIX``, ``PXB``, ``PHB``, ``NODE``, ``SYS``; older
        drivers' ``SOC``) from the header row (``\\tGPU0\\tGPU1 ... NIC0 ... CPU Affinity``) to
        the first blank line, and NIC names from the ``NIC Legend:`` block. NIC rows and
        columns are not devices: each NIC is kept as its closest GPU (:attr:`nics`).

        Raises:
            ValueError: no header row; a row that is not a device of the header, has an unknown
                link or disagrees with its mirror entry: naming the line number and its text.
        """
        lines = re.sub(r"\x1b\[[0-9;]*m", "", text).splitlines()  # a terminal's underline
        start = next((i for i, ln in enumerate(lines) if re.search(r"\tGPU0\b", ln)), None)
        if start is None:
            raise ValueError("nvidia-smi topo -m: no header row with GPU0 (tab-separated) found.")
        names = [c.strip() for c in lines[start].split("\t")[1:]]
        names = [c for c in names if c and not c.endswith(("Affinity", "NUMA ID"))]
        col = {name: k for k, name in enumerate(names)}
        classes, rows, where = dict(LINK_CLASSES), dict[str, list[str]](), dict[str, str]()
        for number, line in enumerate(lines[start + 1 :], start + 2):
            if line.strip() in ("", "Legend:"):
                break
            cells = [c.strip() for c in line.split("\t")]
            tokens = [_class_of(t, classes) for t in cells[1 : len(names) + 1]]
            here = where[cells[0]] = f"nvidia-smi topo -m line {number}: {line!r}"
            if cells[0] not in names or cells[0] in rows or len(tokens) < len(names):
                raise ValueError(f"{here}: expected {len(names)} links of one of {names}.")
            if None in tokens:
                raise ValueError(
                    f"{here}: unknown link {cells[1 + tokens.index(None)]!r}; "
                    f"expected X, NV#, PIX, PXB, PHB, NODE or SYS."
                )
            rows[cells[0]] = [str(t) for t in tokens]
        if missing := [n for n in names if n not in rows]:
            raise ValueError(f"nvidia-smi topo -m: no row for {', '.join(missing)}.")
        for x in names:
            for y in names:
                if rows[x][col[y]] != rows[y][col[x]] or (x == y) != (rows[x][col[y]] == "SELF"):
                    raise ValueError(
                        f"{where[x]}: {x}-{y} is {rows[x][col[y]]} but {y}-{x} "
                        f"is {rows[y][col[x]]} (X only on the diagonal)."
                    )
        gpus = [n for n in names if re.fullmatch(r"GPU\d+", n)]
        legend = dict(re.findall(r"^\s*(NIC\d+)\s*:\s*(\S+)\s*$", text, re.M))
        hops = {"PIX": 1, "PXB": 2, "PHB": 3, "NODE": 4}  # the legend's order; NV#: 0, SYS: 5
        nics = {  # the closest GPU to each NIC; the lowest index on ties
            legend.get(nic, nic): min(
                range(len(gpus)), key=lambda g: hops.get(rows[nic][col[gpus[g]]], 5)
            )
            for nic in names
            if nic not in gpus
        }
        matrix = [[rows[x][col[y]] for y in gpus] for x in gpus]
        return _one_node(matrix, classes, nics).replicate(nodes)

    def replicate(self, nodes: int, inter: LinkClass | None = None) -> DeviceGraph:
        """``nodes`` copies of this one-node graph, device ``k * n + i`` = device ``i`` of node
        ``k`` (torchrun's rank order), joined by ``inter`` (default: its own ``NET``, else
        :data:`LINK_CLASSES`').

        Raises:
            ValueError: ``nodes`` < 1 or this graph spans several nodes.
        """
        if not isinstance(nodes, int) or nodes < 1:
            raise ValueError(f"nodes ({nodes!r}) must be a positive integer.")
        if self.nodes != 1:
            raise ValueError(
                f"the graph has {self.num_devices} devices in {self.nodes} nodes; "
                "only a one-node graph repeats; describe one node."
            )
        net, n = inter or self.classes.get("NET", LINK_CLASSES["NET"]), self.num_devices
        links = [
            [self.links[i % n][j % n] if i // n == j // n else net.name for j in range(n * nodes)]
            for i in range(n * nodes)
        ]
        classes = self.classes | ({net.name: net} if nodes > 1 or inter else {})
        node_of = tuple(i // n for i in range(n * nodes))
        return DeviceGraph(tuple(map(tuple, links)), node_of, classes, self.nics)

    @classmethod
    def uniform(cls, devices: int, devices_per_node: int, intra: str = "NVSWITCH") -> DeviceGraph:
        """``devices // devices_per_node`` nodes, every pair in a node linked by ``intra``.

        Raises:
            ValueError: ``devices_per_node`` not a positive divisor of ``devices``, or ``intra``
                not a :data:`LINK_CLASSES` name (or ``NV#``).
        """
        n = devices_per_node
        if n < 1 or devices < 1 or devices % n:
            raise ValueError(
                f"devices ({devices}) must be a positive multiple of "
                f"devices_per_node ({n}); use whole nodes."
            )
        cells = [["X" if i == j else intra for j in range(n)] for i in range(n)]
        return _one_node(cells, dict(LINK_CLASSES)).replicate(devices // n)

    @classmethod
    def from_yaml(cls, source: str | Path | Mapping[str, Any]) -> DeviceGraph:
        """A cluster description: a mapping, a YAML file path, or YAML text.

        Keys: ``nodes``, ``gpus_per_node`` (required); ``intra``: a link class name or
        ``{bandwidth, latency}`` (bytes/s, seconds), or ``links``: one node's
        ``gpus_per_node`` x ``gpus_per_node`` matrix of class names (nvidia-smi abbreviations,
        ``X`` on the diagonal); ``inter``: ``NET``'s ``{bandwidth, latency}`` (required for
        several nodes); ``classes``: ``{name: {bandwidth, latency}}`` overriding defaults.
        Text and files are read with ``yaml.safe_load`` (imported here only).

        Raises:
            ValueError: a missing or unknown key or a bad value, naming the key.
        """
        data = _mapping(source)
        valid = ("nodes", "gpus_per_node", "intra", "inter", "links", "classes")
        if unknown := [key for key in data if key not in valid]:
            raise ValueError(f"topology YAML: unknown key {unknown[0]!r}; valid keys: {valid}.")
        for key in ("nodes", "gpus_per_node"):
            if type(data.get(key)) is not int or data[key] < 1:
                raise ValueError(
                    f"topology YAML: {key!r} ({data.get(key)!r}) must be a positive "
                    f"integer; add `{key}: N`."
                )
        if data["nodes"] > 1 and "inter" not in data:
            raise ValueError(
                "topology YAML: 'inter' ({bandwidth, latency} between nodes) is "
                "missing; it is required when nodes > 1."
            )
        if ("intra" in data) == ("links" in data):
            raise ValueError(
                "topology YAML: give exactly one of 'intra' (one class for every "
                "pair in a node) or 'links' (the node's matrix)."
            )
        extra = data.get("classes") or {}
        classes = LINK_CLASSES | {k: _link(v, f"classes.{k}", k) for k, v in extra.items()}
        n, intra = data["gpus_per_node"], data.get("intra")
        if isinstance(intra, Mapping):
            classes["INTRA"], intra = _link(intra, "intra", "INTRA"), "INTRA"
        key, cells = ("links", data["links"]) if "links" in data else ("intra", None)
        cells = cells or [["X" if i == j else intra for j in range(n)] for i in range(n)]
        shape = (
            [len(r) if isinstance(r, list) else 0 for r in cells] if isinstance(cells, list) else 0
        )
        if shape != [n] * n:
            raise ValueError(f"topology YAML: 'links' must be {n} rows of {n} class names.")
        inter = _link(data["inter"], "inter", "NET") if "inter" in data else None
        return _one_node(cells, classes, key=key).replicate(data["nodes"], inter)

    @classmethod
    def from_machine(cls, nodes: int = 1) -> DeviceGraph | None:
        """This machine's ``nvidia-smi topo -m`` (``nodes`` copies), restricted to and ordered
        by a numeric ``CUDA_VISIBLE_DEVICES``; None when nvidia-smi is absent or fails, the
        output does not parse (a warning says why) or the visible devices are not indices.
        nvidia-smi numbers GPUs by PCI bus id, as CUDA does on one-model machines."""
        try:
            run = subprocess.run(
                ["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=60, check=True
            )
            graph = cls.from_nvidia_smi(run.stdout)
        except (OSError, subprocess.SubprocessError):  # absent, failed or hung
            return None
        except ValueError as err:
            warnings.warn(f"unreadable `nvidia-smi topo -m` output: {err}", stacklevel=2)
            return None
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
        if not visible[0]:  # unset or empty: every GPU nvidia-smi lists
            return graph.replicate(nodes)
        if not all(v.isdigit() and int(v) < graph.num_devices for v in visible):
            return None  # UUIDs, MIG instances or unknown indices: no safe mapping
        return graph.select([int(v) for v in visible]).replicate(nodes)


def _one_node(
    cells: Sequence[Sequence[Any]],
    classes: dict[str, LinkClass],
    nics: dict[str, int] | None = None,
    key: str = "intra",
) -> DeviceGraph:
    """A one-node graph from a matrix of nvidia-smi cells (``X`` = ``SELF``); ``classes`` gets
    any ``NV#`` it lacks; the graph keeps the classes it uses."""
    names = [[_class_of(str(c), classes) for c in row] for row in cells]
    if bad := [c for i, r in enumerate(cells) for j, c in enumerate(r) if not names[i][j]]:
        known = ", ".join(c for c in classes if not _NV.match(c))
        raise ValueError(f"{key} ({bad[0]!r}) must be a link class: NV# or one of {known}.")
    used = {str(c): classes[str(c)] for row in names for c in row}
    links = tuple(tuple(str(c) for c in row) for row in names)
    return DeviceGraph(links, (0,) * len(links), used, nics or {})


def _link(value: Any, key: str, name: str) -> LinkClass:
    if not isinstance(value, Mapping) or {"bandwidth", "latency"} - set(value):
        raise ValueError(
            f"topology YAML: {key!r} must be a mapping with 'bandwidth' (bytes/s) "
            f"and 'latency' (seconds), got {value!r}."
        )
    try:
        return LinkClass(name, float(value["bandwidth"]), float(value["latency"]))
    except (TypeError, ValueError) as err:
        raise ValueError(f"topology YAML: {key!r}: {err}") from None


def _mapping(source: str | Path | Mapping[str, Any]) -> Mapping[str, Any]:
    if isinstance(source, Mapping):
        return source
    import yaml  # only here: the layout package stays importable with the standard library

    is_file = isinstance(source, Path) or ("\n" not in source and Path(source).is_file())
    try:
        data = yaml.safe_load(Path(source).read_text() if is_file else source)
    except yaml.YAMLError as err:
        why, what = " ".join(str(err).split()), repr(str(source)) if is_file else "text"
        raise ValueError(f"topology YAML: {what} is not valid YAML: {why}") from None
    if not isinstance(data, Mapping):
        raise ValueError(
            f"topology YAML: {str(source)[:80]!r} is neither a file nor a mapping "
            f"with keys nodes, gpus_per_node, ..."
        )
    return data


def load_topology(path: str | Path, nodes: int = 1) -> DeviceGraph:
    """A topology file: ``nvidia-smi topo -m`` text (``nodes`` copies) or a YAML description
    (:meth:`DeviceGraph.from_yaml`), told apart by a tab-separated ``GPU0`` header row.

    Raises:
        ValueError: the parser's error (invalid YAML too), naming ``path``. OSError: unreadable.
    """
    text = Path(path).read_text()
    try:
        if re.search(r"\tGPU0\b", text):
            return DeviceGraph.from_nvidia_smi(text, nodes=nodes)
        return DeviceGraph.from_yaml(text)
    except ValueError as err:
        raise ValueError(f"topology file {str(path)!r}: {err}") from None


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
"""Collective kinds :func:`collective_seconds` prices."""


def collective_seconds(
    graph: DeviceGraph, kind: str, devices: Sequence[int], nbytes: float
) -> float:
    """Seconds for one collective of ``nbytes`` over ``devices`` (alpha-beta model).

    ``nbytes`` follows nccl-tests' "size": the all-reduce buffer, the all-gather OUTPUT, the
    reduce-scatter INPUT, one rank's all-to-all input, one send/recv message. With
    ``n = len(devices)`` and ``t(m) = max over the step's hops (alpha + m / bandwidth)`` (a step
    of a synchronous ring lasts as long as its slowest hop; ``2(n-1) alpha + 2(n-1)/n B / bw``
    when one link is both the slowest and the highest-latency one)::

        all_reduce      2(n-1) * t(B/n)  ring: reduce-scatter + all-gather (Rabenseifner;
                                         Thakur et al. 2005; nccl-tests busbw factor 2(n-1)/n)
        all_gather      (n-1) * t(B/n)   ring over devices[0] -> devices[1] -> ... -> devices[0]
        reduce_scatter  (n-1) * t(B/n)
        all_to_all      sum over s = 1..n-1 of t(B/n), step s pairing device r with r + s
        send_recv       t(B) over the pairs devices[k] -> devices[k+1], all sent at once
                        (a pipeline's stage boundaries; ``alpha + B / bw`` for two devices)

    One device: 0. A ring that crosses nodes runs over ``NET`` (the graph's link there).

    Raises:
        ValueError: unknown ``kind``, repeated or out-of-range devices, negative ``nbytes``.
    """
    if kind not in COLLECTIVES:
        raise ValueError(f"kind ({kind!r}) must be one of {', '.join(COLLECTIVES)}.")
    n = len(devices)
    if len(set(devices)) != n or any(not 0 <= d < graph.num_devices for d in devices):
        raise ValueError(
            f"devices ({list(devices)}) must be distinct indices in [0, {graph.num_devices})."
        )
    if not nbytes >= 0:
        raise ValueError(f"nbytes ({nbytes!r}) must be >= 0 bytes.")
    if n < 2:
        return 0.0

    def step(pairs: Sequence[tuple[int, int]], message: float) -> float:
        links = [graph.link(a, b) for a, b in pairs]
        return max(x.latency + message / x.bandwidth for x in links)

    if kind == "send_recv":
        return step(list(itertools.pairwise(devices)), nbytes)
    ring = [(devices[k], devices[(k + 1) % n]) for k in range(n)]
    if kind == "all_reduce":
        return 2 * (n - 1) * step(ring, nbytes / n)
    if kind == "all_to_all":
        shifts = ([(devices[r], devices[(r + s) % n]) for r in range(n)] for s in range(1, n))
        return sum(step(pairs, nbytes / n) for pairs in shifts)
    return (n - 1) * step(ring, nbytes / n)
