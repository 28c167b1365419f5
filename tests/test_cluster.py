"""Tests of the cluster model (autohybrid/cluster.py) and the hardware table (hardware.py).

Pure tests: no processes, no GPU. They check that presets take their figures from the
one hardware table, that JSON round-trips and rejects each bad field by name, the
topology graph and the link a collective sees, and the environment-driven constructors.
"""
from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import networkx as nx
import pytest
import torch
from _fake_cuda import fake_gpus

from autohybrid import hardware
from autohybrid.cluster import PRESETS, Cluster, LinkView
from autohybrid.errors import ClusterError

# ---- hardware table -------------------------------------------------------------------


def test_every_table_entry_has_a_source_and_positive_figures():
    for spec in hardware.DEVICES.values():
        assert spec.source and spec.memory_bytes > 0 and spec.memory_bandwidth > 0
        assert {"float32", "bfloat16", "float16", "float64"} <= set(spec.peak_flops)
    for spec in hardware.LINKS.values():
        assert spec.source and spec.bandwidth > 0 and spec.latency_s >= 0


def test_reference_figures():
    assert hardware.device("V100").flops("float16") == 125e12
    assert hardware.device("A100-80GB").flops(torch.bfloat16) == 312e12
    assert hardware.device("A100-80GB").flops(torch.float32) == 19.5e12
    assert hardware.device("A100-80GB").flops("float32", allow_tf32=True) == 156e12
    assert hardware.device("H200").memory_bandwidth == 4.8e12
    assert hardware.link("ib-hdr").bandwidth == 25e9
    assert hardware.link("ib-ndr").bandwidth == 50e9
    assert hardware.link("nvlink-h100").bandwidth == 450e9
    assert "PLACEHOLDER" in hardware.device("cpu").source
    assert "PLACEHOLDER" in hardware.link("gloo-local").source


def test_unknown_table_keys_name_the_key_and_the_known_ones():
    with pytest.raises(ClusterError, match=r"'A100'.*'A100-40GB'.*Known devices"):
        hardware.device("A100")
    with pytest.raises(ClusterError, match=r"'nvlnk-a100'.*Did you mean 'nvlink-a100'"):
        hardware.link("nvlnk-a100")
    with pytest.raises(ClusterError, match="no peak FLOP/s for dtype 'int8'"):
        hardware.device("H100").flops("int8")


def test_specs_are_hashable_and_validate():
    assert hash(hardware.device("H100")) == hash(hardware.device("h100"))
    with pytest.raises(ClusterError, match="memory_bytes"):
        hardware.DeviceSpec("x", {"float32": 1.0}, 0, 1.0, "test")
    with pytest.raises(ClusterError, match="bandwidth"):
        hardware.LinkSpec("x", -1.0, 0.0, "test")


def test_match_cuda_device_names():
    assert hardware.match_cuda_device("NVIDIA A100-SXM4-80GB", 85 * 2**30).name == "A100-80GB"
    assert hardware.match_cuda_device("NVIDIA A100-SXM4-40GB", 40 * 2**30).name == "A100-40GB"
    assert hardware.match_cuda_device("NVIDIA H200", 140 * 2**30).name == "H200"
    unknown = hardware.match_cuda_device("NVIDIA GeForce RTX 4090", 24 * 2**30)
    assert unknown.name == "NVIDIA GeForce RTX 4090" and unknown.memory_bytes == 24 * 2**30


# ---- presets --------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_take_their_figures_from_the_table(name):
    entry = PRESETS[name]
    cluster = Cluster.preset(name, nodes=2)
    assert cluster.world_size == 2 * entry.devices_per_node
    assert cluster.device == hardware.device(entry.device)
    assert cluster.intra_link == hardware.link(entry.intra_link)
    assert cluster.inter_link == hardware.link(entry.inter_link)
    assert cluster.nics_per_node == entry.nics_per_node
    assert (cluster.backend, cluster.device_type) == (
        ("gloo", "cpu") if name == "cpu" else ("nccl", "cuda"))
    assert name in cluster.describe() and "\n" not in cluster.describe()


def test_preset_examples():
    a100 = Cluster.preset("dgx-a100-80gb", nodes=4)
    assert a100.world_size == 32 and a100.device.memory_bytes == 80 * 2**30
    assert a100.inter_link.name == "ib-hdr" and a100.nics_per_node == 8
    assert Cluster.preset("dgx-v100").nics_per_node == 4
    assert Cluster.preset("hgx-h200").device.name == "H200"
    assert not a100.is_local and Cluster.preset("cpu").is_local


def test_unknown_preset_names_the_closest():
    with pytest.raises(ClusterError, match=r"closest: 'dgx-a100-80gb'.*Known presets"):
        Cluster.preset("dgx-a100-80")
    with pytest.raises(ClusterError, match="closest: 'dgx-h100'"):
        Cluster.preset("dgx-h10")


# ---- placement and links --------------------------------------------------------------


def test_rank_location_and_same_node():
    c = Cluster.preset("dgx-h100", nodes=2)
    assert c.rank_location(0) == (0, 0) and c.rank_location(11) == (1, 3)
    assert c.same_node(range(8)) and not c.same_node([7, 8])
    assert list(c.node_ranks(1)) == list(range(8, 16))
    with pytest.raises(ClusterError, match="rank 16"):
        c.rank_location(16)
    with pytest.raises(ClusterError, match="at least one rank"):
        c.link_for([])


def test_link_for_picks_intra_or_inter_link():
    c = Cluster.preset("dgx-a100-80gb", nodes=2)
    intra = c.link_for([0, 1, 2, 3])
    assert intra == (c.intra_link.bandwidth, c.intra_link.latency_s, 1.0)
    inter = c.link_for([0, 8])
    assert isinstance(inter, LinkView)
    assert inter == (c.inter_link.bandwidth, c.inter_link.latency_s, 1.0)
    assert c.link_for(range(16)).nic_sharing_factor == 1.0  # 8 NICs for 8 GPUs


def test_nic_sharing_when_fewer_nics_than_gpus():
    c = Cluster.preset("dgx-v100", nodes=2)  # 8 GPUs, 4 NICs per node
    whole = c.link_for(range(16))
    assert whole.nic_sharing_factor == c.devices_per_node / c.nics_per_node == 2.0
    assert whole.effective_bandwidth == c.inter_link.bandwidth / 2
    assert c.link_for([0, 1, 8, 9]).nic_sharing_factor == 1.0  # GPUs 0 and 1: two NICs
    assert c.link_for([0, 4, 8]).nic_sharing_factor == 2.0  # GPUs 0 and 4 share NIC 0


def test_topology_graph():
    c = Cluster.preset("dgx-v100", nodes=2)
    g = c.topology
    assert g is c.topology  # built once
    kinds = nx.get_node_attributes(g, "kind")
    assert sum(k == "device" for k in kinds.values()) == 16
    assert sum(k == "nic" for k in kinds.values()) == 8
    assert kinds["fabric"] == "fabric" and kinds["n1.nvswitch"] == "switch"
    assert set(g.neighbors("n0.nic1")) == {"n0.gpu1", "n0.gpu5", "fabric"}
    assert all("bandwidth" in d and "latency" in d for _, _, d in g.edges(data=True))
    same = nx.shortest_path_length(g, "n0.gpu0", "n0.gpu4", weight="latency")
    across = nx.shortest_path_length(g, "n0.gpu0", "n1.gpu4", weight="latency")
    assert same == pytest.approx(c.intra_link.latency_s)
    assert across == pytest.approx(c.inter_link.latency_s)


def test_topology_of_a_local_cpu_cluster_has_no_network():
    g = Cluster.local(3, device_type="cpu").topology
    assert sorted(g.nodes) == ["n0.cpu0", "n0.cpu1", "n0.cpu2", "n0.host"]


# ---- JSON -----------------------------------------------------------------------------


@pytest.mark.parametrize("cluster", [Cluster.preset("dgx-v100", nodes=3),
                                     Cluster.preset("hgx-h200"), Cluster.local(2, "cpu")])
def test_json_round_trip(cluster, tmp_path):
    assert Cluster.from_json(cluster.to_json()) == cluster
    path = tmp_path / "cluster.json"
    cluster.to_json(path)
    assert Cluster.from_json(path) == cluster
    assert Cluster.from_json(str(path)) == cluster
    assert Cluster.from_dict(cluster.to_dict()) == cluster


def test_json_accepts_table_names_for_device_and_links():
    data = Cluster.preset("dgx-h100", nodes=2).to_dict()
    data.update(device="H100", intra_link="nccl-h100-node", inter_link="ib-ndr")
    assert Cluster.from_dict(data) == Cluster.preset("dgx-h100", nodes=2)


def _bad(**changes):
    data = Cluster.preset("dgx-a100-80gb", nodes=2).to_dict()
    for key, value in changes.items():
        if "__" in key:
            outer, inner = key.split("__")
            data[outer][inner] = value
        else:
            data[key] = value
    return json.dumps(data)


@pytest.mark.parametrize("text, field", [
    (_bad(nodes=0), "nodes"),
    (_bad(nodes=-3), "nodes"),
    (_bad(devices_per_node=0), "devices_per_node"),
    (_bad(nodes="2"), "nodes"),
    (_bad(nodes=2.0), "nodes"),
    (_bad(nodes=True), "nodes"),
    (_bad(nics_per_node=0), "nics_per_node"),
    (_bad(nics_per_node=-1), "nics_per_node"),
    (_bad(is_local="yes"), "is_local"),
    (_bad(backend="mpi"), "backend"),
    (_bad(backend="gloo"), "device_type"),
    (_bad(device_type=3), "device_type"),
    (_bad(name=None), "name"),
    (_bad(inter_link=None), "inter_link"),
    (_bad(device="Z100"), "Z100"),
    (_bad(intra_link=12), "intra_link"),
    (_bad(gpus=8), "gpus"),
    (_bad(device__memory_bytes=-1), "memory_bytes"),
    (_bad(device__memory_bytes="80GB"), "device.memory_bytes"),
    (_bad(device__peak_flops={"float32": "fast"}), "peak_flops"),
    (_bad(device__color="green"), "color"),
    (_bad(inter_link__bandwidth=0), "bandwidth"),
    (_bad(intra_link__latency_s=-1e-6), "latency_s"),
])
def test_bad_json_field_names_the_field(text, field):
    with pytest.raises(ClusterError, match=field.replace(".", r"\.")):
        Cluster.from_json(text)


@pytest.mark.parametrize("drop", ["nodes", "device", "backend", "is_local"])
def test_missing_json_field_names_it(drop):
    data = Cluster.preset("cpu").to_dict()
    del data[drop]
    with pytest.raises(ClusterError, match=f"missing field.*'{drop}'"):
        Cluster.from_dict(data)


def test_bad_json_text_and_path():
    with pytest.raises(ClusterError, match="not valid JSON"):
        Cluster.from_json("{nodes: 1")
    with pytest.raises(ClusterError, match="does not exist"):
        Cluster.from_json("/nonexistent/cluster.json")
    with pytest.raises(ClusterError, match="JSON object"):
        Cluster.from_dict([1, 2])  # type: ignore[arg-type]


# ---- constructors from this machine ----------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fallback")
def test_local_on_a_cpu_only_machine_is_gloo():
    c = Cluster.local(4)
    assert (c.world_size, c.nodes, c.backend, c.device_type) == (4, 1, "gloo", "cpu")
    assert c.is_local and c.inter_link is None and c.device == hardware.device("cpu")
    with pytest.raises(ClusterError, match="world_size=4 needs one GPU per process"):
        Cluster.local(4, device_type="cuda")


def test_local_rejects_bad_arguments():
    with pytest.raises(ClusterError, match="world_size"):
        Cluster.local(0)
    with pytest.raises(ClusterError, match="device_type"):
        Cluster.local(2, device_type="tpu")


def _fake_gpus(monkeypatch, name, count, memory=80 * 2**30):
    """Pretend this machine has `count` CUDA devices called `name` (NVML only: reading
    them any other way would initialize CUDA here, and fails the test)."""
    fake_gpus(monkeypatch, name, count, memory)


def test_local_with_enough_gpus_is_nccl(monkeypatch):
    _fake_gpus(monkeypatch, "NVIDIA H100 80GB HBM3", 8)
    c = Cluster.local(4)
    assert (c.backend, c.device_type, c.world_size) == ("nccl", "cuda", 4)
    assert c.device == hardware.device("H100") and c.intra_link.name == "nccl-h100-node"
    assert Cluster.local(4, device_type="cpu").backend == "gloo"
    assert Cluster.local(16).backend == "gloo"  # more processes than GPUs
    _fake_gpus(monkeypatch, "NVIDIA A100-PCIE-40GB", 2, 40 * 2**30)
    assert Cluster.local(2).intra_link.name == "pcie-gen4"
    _fake_gpus(monkeypatch, "NVIDIA GeForce RTX 4090", 1, 24 * 2**30)
    odd = Cluster.local(1)
    assert odd.device.name == "NVIDIA GeForce RTX 4090" and "PLACEHOLDER" in odd.device.source


def test_from_env_with_cuda_on_several_nodes(monkeypatch):
    _fake_gpus(monkeypatch, "NVIDIA H200", 8, 140 * 2**30)
    monkeypatch.setenv("WORLD_SIZE", "32")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "4")
    c = Cluster.from_env()
    assert (c.nodes, c.backend, c.device.name) == (4, "nccl", "H200")
    assert (c.inter_link.name, c.nics_per_node) == ("ib-ndr", 8)


def test_from_env_under_torchrun(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.delenv("GROUP_WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    c = Cluster.from_env()
    assert (c.nodes, c.devices_per_node, c.world_size) == (2, 4, 8)
    assert (c.backend, c.device_type, c.is_local) == ("gloo", "cpu", False)
    assert c.inter_link is not None and not c.same_node([3, 4])
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    assert Cluster.from_env() == c
    monkeypatch.setenv("GROUP_WORLD_SIZE", "3")
    with pytest.raises(ClusterError, match="WORLD_SIZE=8 is not nodes=3"):
        Cluster.from_env()


def test_from_env_single_node_and_errors(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("GROUP_WORLD_SIZE", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ClusterError, match="torchrun.*Cluster.local"):
        Cluster.from_env()
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ClusterError, match="WORLD_SIZE='two'"):
        Cluster.from_env()
    monkeypatch.setenv("WORLD_SIZE", "2")
    c = Cluster.from_env()
    assert c.nodes == 1 and c.inter_link is None and c.nics_per_node == 0


# ---- Cluster.parse (the CLI's --cluster) -----------------------------------------------


def test_parse(tmp_path):
    assert Cluster.parse("dgx-h100", nodes=2) == Cluster.preset("dgx-h100", nodes=2)
    assert Cluster.parse("DGX-H100") == Cluster.preset("dgx-h100")
    assert Cluster.parse("local:2") == Cluster.local(2)
    path = tmp_path / "mine.json"
    Cluster.preset("dgx-v100", nodes=2).to_json(path)
    assert Cluster.parse(str(path)) == Cluster.preset("dgx-v100", nodes=2)
    assert Cluster.parse(path, nodes=4) == Cluster.preset("dgx-v100", nodes=4)
    for bad in ("local", "local:0", "local:x"):
        with pytest.raises(ClusterError, match="local:N"):
            Cluster.parse(bad)
    with pytest.raises(ClusterError, match="one machine"):
        Cluster.parse("local:2", nodes=2)
    with pytest.raises(ClusterError, match="closest"):
        Cluster.parse("dgx-z100")


def test_direct_construction_is_validated():
    base = Cluster.preset("cpu")
    with pytest.raises(ClusterError, match="'nodes'.*-1"):
        dataclasses.replace(base, nodes=-1)
    with pytest.raises(ClusterError, match="inter_link"):
        dataclasses.replace(base, nodes=2, inter_link=None, nics_per_node=0)
