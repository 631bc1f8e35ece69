"""Device graph (lightning_mmpar.layout.devices): nvidia-smi topo -m fixtures, YAML descriptions,
every parse error naming its line or key, and the alpha-beta collective times by hand."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from lightning_mmpar.layout.devices import (
    LINK_CLASSES,
    DeviceGraph,
    LinkClass,
    collective_seconds,
    load_topology,
)

TOPO = Path(__file__).resolve().parents[2] / "fixtures" / "topology"


def graph(name: str, nodes: int = 1) -> DeviceGraph:
    return load_topology(TOPO / name, nodes=nodes)


def test_dgx_h100_nvswitch_node() -> None:
    g = graph("dgx_h100.txt")
    assert g.num_devices == 8 and g.nodes == 1 and g.node_of == (0,) * 8
    assert {g.links[i][j] for i in range(8) for j in range(8) if i != j} == {"NV18"}
    assert all(g.links[i][i] == "SELF" for i in range(8))
    assert g.link(0, 7).bandwidth == 450e9  # 18 links x 25 GB/s, one direction
    # compute NICs sit on one GPU's PCIe switch (PIX); storage NICs: the first GPU of their socket
    assert g.nics == {
        "mlx5_0": 0,
        "mlx5_1": 0,
        "mlx5_2": 0,
        "mlx5_3": 1,
        "mlx5_4": 2,
        "mlx5_5": 3,
        "mlx5_6": 4,
        "mlx5_7": 4,
        "mlx5_8": 4,
        "mlx5_9": 5,
        "mlx5_10": 6,
        "mlx5_11": 7,
    }


def test_pcie_box_two_numa_nodes() -> None:
    g = graph("pcie_4gpu_2numa.txt")
    assert g.links == (
        ("SELF", "PIX", "SYS", "SYS"),
        ("PIX", "SELF", "SYS", "SYS"),
        ("SYS", "SYS", "SELF", "PHB"),
        ("SYS", "SYS", "PHB", "SELF"),
    )
    assert g.nics == {"mlx5_0": 3}
    assert set(g.classes) == {"SELF", "PIX", "PHB", "SYS"}


def test_nvlink_pairs_box_and_bandwidth_order() -> None:
    g = graph("nvlink_pairs_8gpu.txt")
    assert [g.links[0][j] for j in range(8)] == ["SELF", "NV12", *["PXB"] * 2, *["SYS"] * 4]
    assert all(g.links[2 * k][2 * k + 1] == "NV12" for k in range(4))
    assert g.nics == {"mlx5_0": 0, "mlx5_1": 6}  # PIX beats PXB at equal bandwidth
    assert g.link(0, 1).bandwidth == 12 * 25e9
    bw = {name: c.bandwidth for name, c in LINK_CLASSES.items()}
    assert bw["NV18"] > bw["NV12"] > bw["PIX"] >= bw["PXB"] > bw["PHB"] >= bw["NODE"]
    assert bw["NODE"] > bw["SYS"] > bw["NET"]
    lat = {name: c.latency for name, c in LINK_CLASSES.items()}
    assert lat["NV18"] < lat["PIX"] == lat["SYS"] < lat["NET"]


def test_nodes_joined_by_net() -> None:
    g = graph("nvlink_pairs_8gpu.txt", nodes=2)
    assert g.num_devices == 16 and g.nodes == 2 and g.node_of == (0,) * 8 + (1,) * 8
    assert g.links[9][8] == "NV12" and g.links[0][8] == g.links[7][15] == "NET"
    assert g.link(0, 8) == LINK_CLASSES["NET"]


def test_yaml_two_nodes() -> None:
    g = graph("two_nodes_h100.yaml")
    assert g.num_devices == 16 and g.nodes == 2
    assert g.links[0][7] == "NVSWITCH" and g.links[7][8] == "NET"
    assert g.link(3, 12) == LinkClass("NET", 50e9, 14e-6)
    m = graph("two_nodes_pcie_matrix.yaml")
    assert m.links[0][:4] == ("SELF", "PIX", "SYS", "SYS") and m.links[2][3] == "PHB"
    assert m.link(0, 2).bandwidth == 10e9 and m.link(0, 4).bandwidth == 12.5e9
    same = DeviceGraph.from_yaml((TOPO / "two_nodes_h100.yaml").read_text())
    assert same == g == DeviceGraph.from_yaml(TOPO / "two_nodes_h100.yaml")
    custom = DeviceGraph.from_yaml(
        {"nodes": 1, "gpus_per_node": 2, "intra": {"bandwidth": "2e9", "latency": 1e-6}}
    )
    assert custom.link(0, 1) == LinkClass("INTRA", 2e9, 1e-6)
    net = {"bandwidth": 12.5e9, "latency": 14e-6}
    described = {"nodes": 2, "gpus_per_node": 8, "intra": "NVSWITCH", "inter": net}
    assert DeviceGraph.uniform(16, 8) == DeviceGraph.from_yaml(described)
    one = DeviceGraph.from_yaml({**described, "nodes": 1, "inter": {**net, "bandwidth": 5e10}})
    assert one.num_devices == 8 and one.replicate(2).link(0, 8).bandwidth == 5e10  # its NET


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"gpus_per_node": 8, "intra": "NVSWITCH"}, "'nodes' (None) must be a positive integer"),
        ({"nodes": 1, "intra": "NVSWITCH"}, "'gpus_per_node' (None) must be a positive"),
        ({"nodes": 2, "gpus_per_node": 2, "intra": "NV4"}, "'inter'"),
        ({"nodes": 1, "gpus_per_node": 2}, "exactly one of 'intra'"),
        ({"nodes": 1, "gpus_per_node": 2, "intra": "FAST"}, "intra ('FAST') must be a link"),
        ({"nodes": 1, "gpus_per_node": 2, "intra": "NV4", "speed": 1}, "unknown key 'speed'"),
        ({"nodes": 1, "gpus_per_node": 2, "links": [["X", "PIX"]]}, "'links' must be 2 rows"),
        (
            {"nodes": 1, "gpus_per_node": 2, "links": [["X", "PIX"], ["PXB", "X"]]},
            "links[0][1] = 'PIX', links[1][0] = 'PXB'",
        ),
        (
            {"nodes": 2, "gpus_per_node": 1, "intra": "X", "inter": {"bandwidth": 1}},
            "'inter' must be a mapping with 'bandwidth'",
        ),
        (
            {
                "nodes": 1,
                "gpus_per_node": 1,
                "intra": "X",
                "classes": {"PIX": {"bandwidth": -1, "latency": 0}},
            },
            "'classes.PIX': link class 'PIX': bandwidth (-1.0)",
        ),
    ],
)
def test_yaml_errors_name_the_key(data: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        DeviceGraph.from_yaml(data)


def test_malformed_yaml_and_replicating_several_nodes(tmp_path: Path) -> None:
    bad = tmp_path / "topo.yaml"
    bad.write_text("gpus: [1,2\n")
    with pytest.raises(ValueError, match=r"topology file '.*topo\.yaml': .* not valid YAML"):
        load_topology(bad)
    with pytest.raises(ValueError, match=r"topology YAML: text is not valid YAML: while parsing"):
        DeviceGraph.from_yaml("nodes: {1\n")
    two = load_topology(TOPO / "two_nodes_h100.yaml")
    with pytest.raises(ValueError, match=r"graph has 16 devices in 2 nodes; only a one-node"):
        two.replicate(2)
    with pytest.raises(ValueError, match=r"nodes \(0\) must be a positive integer"):
        DeviceGraph.uniform(2, 2).replicate(0)


def test_malformed_nvidia_smi_names_the_line() -> None:
    text = (TOPO / "pcie_4gpu_2numa.txt").read_text()
    bad_link = r"line 4: 'GPU2\\tSYS\\tSYS\\t X \\tPHX.*unknown link 'PHX'"
    with pytest.raises(ValueError, match=bad_link):
        DeviceGraph.from_nvidia_smi(text.replace("X \tPHB", "X \tPHX", 1))
    with pytest.raises(ValueError, match=r"line 3: 'GPU9.*expected 5 links of one of"):
        DeviceGraph.from_nvidia_smi(text.replace("GPU1\tPIX", "GPU9\tPIX", 1))
    with pytest.raises(ValueError, match=r"line 2: .*GPU0-GPU1 is PIX but GPU1-GPU0 is PXB"):
        DeviceGraph.from_nvidia_smi(text.replace("GPU1\tPIX", "GPU1\tPXB", 1))
    with pytest.raises(ValueError, match="no header row"):
        DeviceGraph.from_nvidia_smi("GPU0 X\n")
    with pytest.raises(ValueError, match="no row for GPU3, NIC0"):
        DeviceGraph.from_nvidia_smi("\n".join(text.splitlines()[:4]))


def test_older_driver_format_and_terminal_escapes() -> None:
    """Before the NIC legend (drivers < 470): NICs named in the header, no GPU NUMA ID column,
    ``SOC`` for SYS (< 396); a terminal copy carries ANSI underline codes on the header."""
    text = (
        "\x1b[4m\tGPU0\tGPU1\tmlx5_0\tCPU Affinity\x1b[0m\n"
        "GPU0\t X \tNV2\tSOC\t0-9\nGPU1\tNV2\t X \tPHB\t10-19\nmlx5_0\tSOC\tPHB\t X \n\n"
        "Legend:\n\n  X   = Self\n"
    )
    g = DeviceGraph.from_nvidia_smi(text)
    assert g.links == (("SELF", "NV2"), ("NV2", "SELF")) and g.link(0, 1).bandwidth == 50e9
    assert g.nics == {"mlx5_0": 1}


def test_from_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    text = (TOPO / "nvlink_pairs_8gpu.txt").read_text()
    calls: list[list[str]] = []

    def fake_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout=text, stderr="")

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert DeviceGraph.from_machine() == DeviceGraph.from_nvidia_smi(text)
    assert calls == [["nvidia-smi", "topo", "-m"]]
    assert DeviceGraph.from_machine(nodes=2) == DeviceGraph.from_nvidia_smi(text, nodes=2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,7,0")
    seen = DeviceGraph.from_machine()
    assert seen is not None and seen.links[0] == ("SELF", "NV12", "SYS")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1c2d")
    assert DeviceGraph.from_machine() is None
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")

    def missing(cmd: list[str], **kwargs: object) -> None:
        raise FileNotFoundError(cmd[0])

    monkeypatch.setattr(subprocess, "run", missing)
    assert DeviceGraph.from_machine() is None
    failed = subprocess.CalledProcessError(9, ["nvidia-smi"])
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(failed))
    assert DeviceGraph.from_machine() is None
    monkeypatch.setattr(
        subprocess,
        "run",
        lambda cmd, **k: subprocess.CompletedProcess(cmd, 0, stdout="No devices were found\n"),
    )
    with pytest.warns(UserWarning, match="no header row"):
        assert DeviceGraph.from_machine() is None


def test_collective_seconds_by_hand() -> None:
    g = graph("pcie_4gpu_2numa.txt")
    pix, sys_, phb = LINK_CLASSES["PIX"], LINK_CLASSES["SYS"], LINK_CLASSES["PHB"]
    b = 64e6
    # two devices on one PCIe switch: ring of 2, one hop class
    assert collective_seconds(g, "all_reduce", [0, 1], b) == pytest.approx(
        2 * (pix.latency + b / 2 / pix.bandwidth)
    )
    assert collective_seconds(g, "send_recv", [0, 1], b) == pytest.approx(
        pix.latency + b / pix.bandwidth
    )
    # four devices: the ring 0-1-2-3-0 crosses SYS (slowest), each step lasts a SYS hop
    ring = [0, 1, 2, 3]
    t = sys_.latency + b / 4 / sys_.bandwidth
    assert collective_seconds(g, "all_reduce", ring, b) == pytest.approx(6 * t)
    assert collective_seconds(g, "all_gather", ring, b) == pytest.approx(3 * t)
    assert collective_seconds(g, "reduce_scatter", ring, b) == pytest.approx(3 * t)
    assert collective_seconds(g, "all_to_all", ring, b) == pytest.approx(3 * t)
    # the textbook form when one class is both slowest and highest-latency (PCIe: same alpha)
    assert 6 * t == pytest.approx(2 * 3 * sys_.latency + 2 * 3 / 4 * b / sys_.bandwidth)
    # a pipeline chain 0 -> 1 -> 2 -> 3 waits for its slowest boundary (1 -> 2 over SYS)
    assert collective_seconds(g, "send_recv", ring, b) == pytest.approx(
        sys_.latency + b / sys_.bandwidth
    )
    assert collective_seconds(g, "send_recv", [2, 3], b) == pytest.approx(
        phb.latency + b / phb.bandwidth
    )
    assert collective_seconds(g, "all_reduce", [2], b) == 0.0
    two = graph("two_nodes_h100.yaml")
    net = two.link(0, 8)
    assert collective_seconds(two, "all_gather", [0, 8], 1e9) == pytest.approx(
        net.latency + 0.5e9 / net.bandwidth
    )


@pytest.mark.parametrize(
    ("kind", "devices", "nbytes", "message"),
    [
        ("broadcast", [0, 1], 1.0, "kind"),
        ("all_reduce", [0, 0], 1.0, "distinct"),
        ("all_reduce", [0, 4], 1.0, r"in \[0, 4\)"),
        ("send_recv", [0, 1], -1.0, "nbytes"),
    ],
)
def test_collective_seconds_errors(
    kind: str, devices: list[int], nbytes: float, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        collective_seconds(graph("pcie_4gpu_2numa.txt"), kind, devices, nbytes)


def test_graph_validation() -> None:
    with pytest.raises(ValueError, match="square matrix"):
        DeviceGraph((("SELF",), ("SELF",)), (0, 0), LINK_CLASSES)
    with pytest.raises(ValueError, match=r"links\[0\]\[1\] = 'WIRE'"):
        DeviceGraph((("SELF", "WIRE"), ("WIRE", "SELF")), (0, 0), LINK_CLASSES)
    with pytest.raises(ValueError, match="bandwidth"):
        LinkClass("slow", 0.0, 1e-6)
    with pytest.raises(ValueError, match="devices_per_node"):
        DeviceGraph.uniform(12, 8)
    with pytest.raises(ValueError, match="nodes"):
        DeviceGraph.uniform(16, 8).replicate(2)
