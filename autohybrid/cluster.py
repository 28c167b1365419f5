"""The cluster model: what machines a plan runs on, and what a collective among ranks sees.

This module owns `Cluster` (a frozen, JSON-serialisable description of nodes × devices,
the in-node and across-node links, the NICs and the process-group backend), its presets,
its topology graph, and the ways to obtain one (`preset`, `local`, `from_env`, `parse`).
Every hardware figure comes from `autohybrid.hardware`, this machine's GPUs from
`autohybrid.device_facts` (NVML or a probe process: CUDA is never initialized here, so
`ah.launch` may still start ranks that use it). It must not import anything above it
(search, cost, passes, runtime), and starts no process beyond that probe.

Placement is torchrun's: rank r is device r % devices_per_node of node r // devices_per_node;
device i of a node uses NIC i % nics_per_node. `intra_link` is what a collective inside one
node gets per device (for NVSwitch presets the practical NCCL bus bandwidth, not the NVLink
peak); `inter_link` is one NIC. `is_local`: `ah.launch` may start the processes itself on
this machine (`Cluster.local`, the one-node "cpu" preset); not for torchrun or remote presets.

Example
-------
>>> c = Cluster.preset("dgx-a100-80gb", nodes=4)
>>> c.world_size, c.rank_location(9), c.same_node([8, 15])
(32, (1, 1), True)
>>> c.link_for([0, 8]).bandwidth == c.inter_link.bandwidth
True
>>> Cluster.from_json(c.to_json()) == c
True
"""
from __future__ import annotations

import dataclasses
import json
import operator
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, NamedTuple

from autohybrid import hardware
from autohybrid.device_facts import cuda_facts
from autohybrid.errors import ClusterError
from autohybrid.hardware import DeviceSpec, LinkSpec

if TYPE_CHECKING:
    import networkx

__all__ = ["Cluster", "LinkView", "PRESETS"]

BACKENDS = {"nccl": "cuda", "gloo": "cpu"}  # backend -> the device type it needs


class _Preset(NamedTuple):
    device: str  # hardware.DEVICES key
    devices_per_node: int
    intra_link: str  # hardware.LINKS keys
    inter_link: str
    nics_per_node: int


PRESETS: dict[str, _Preset] = {
    # DGX-1: 8×V100 SXM2, hybrid cube-mesh NVLink (modelled as one switch), 4×EDR IB.
    "dgx-v100": _Preset("V100", 8, "nvlink-v100", "ib-edr", 4),
    # DGX A100 / DGX H100 / HGX H200: 8 GPUs on NVSwitch, 8 compute NICs (HDR / NDR).
    "dgx-a100-40gb": _Preset("A100-40GB", 8, "nccl-a100-node", "ib-hdr", 8),
    "dgx-a100-80gb": _Preset("A100-80GB", 8, "nccl-a100-node", "ib-hdr", 8),
    "dgx-h100": _Preset("H100", 8, "nccl-h100-node", "ib-ndr", 8),
    "hgx-h200": _Preset("H200", 8, "nccl-h100-node", "ib-ndr", 8),
    # DGX B200: NVLink 5 peak (no practical NCCL figure in the reference yet), 8×NDR.
    "dgx-b200": _Preset("B200", 8, "nvlink-b200", "ib-ndr", 8),
    # CPU processes with gloo, 4 per node; placeholder figures.
    "cpu": _Preset("cpu", 4, "gloo-local", "ethernet-10g", 1),
}


class LinkView(NamedTuple):
    """What a collective among some ranks sees; unpacks as (bandwidth, latency, sharing).

    `bandwidth` is the link's own figure (bytes/s per direction, per NIC across nodes);
    the collective gets `effective_bandwidth` = bandwidth / nic_sharing_factor per rank.
    """

    bandwidth: float
    latency: float
    nic_sharing_factor: float

    @property
    def effective_bandwidth(self) -> float:
        return self.bandwidth / self.nic_sharing_factor


@dataclass(frozen=True)
class Cluster:
    """nodes × devices_per_node ranks, their links, NICs and process-group backend."""

    name: str
    nodes: int
    devices_per_node: int
    device: DeviceSpec
    intra_link: LinkSpec
    inter_link: LinkSpec | None
    nics_per_node: int
    backend: str
    device_type: str
    is_local: bool

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            hardware.check_type(f.name, getattr(self, f.name), _SCHEMA[f.name], "Cluster")
        for name in ("nodes", "devices_per_node"):
            if getattr(self, name) < 1:
                raise ClusterError(f"Cluster field {name!r} must be a positive integer, got "
                                   f"{getattr(self, name)!r}")
        if self.nics_per_node < 0 or (self.inter_link is not None) != (self.nics_per_node > 0):
            raise ClusterError(
                f"Cluster field 'nics_per_node' is {self.nics_per_node!r} with inter_link "
                f"{getattr(self.inter_link, 'name', None)!r}: give nics_per_node >= 1 with an "
                f"inter_link, or 0 with inter_link None")
        if self.nodes > 1 and self.inter_link is None:
            raise ClusterError(f"Cluster field 'inter_link' is None but nodes={self.nodes}: "
                               f"name the network link (e.g. 'ib-hdr') for several nodes")
        if self.backend not in BACKENDS:
            raise ClusterError(f"Cluster field 'backend' must be one of {sorted(BACKENDS)}, "
                               f"got {self.backend!r}")
        if self.device_type != BACKENDS[self.backend]:
            raise ClusterError(
                f"Cluster field 'device_type' is {self.device_type!r} but backend "
                f"{self.backend!r} needs {BACKENDS[self.backend]!r}: use nccl with cuda, "
                f"gloo with cpu")

    # ---- ranks and placement -------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def rank_location(self, rank: int) -> tuple[int, int]:
        """(node, local_index) of `rank`, in torchrun's order."""
        try:
            index = operator.index(rank)
        except TypeError:
            index = -1
        if not 0 <= index < self.world_size:
            raise ClusterError(f"rank {rank!r} is not in cluster {self.name!r}: ranks are "
                               f"0..{self.world_size - 1} (world_size {self.world_size})")
        return divmod(index, self.devices_per_node)

    def node_ranks(self, node: int) -> range:
        """The ranks that live on `node`."""
        if not 0 <= node < self.nodes:
            raise ClusterError(f"node {node!r} is not in cluster {self.name!r} "
                               f"(nodes 0..{self.nodes - 1})")
        return range(node * self.devices_per_node, (node + 1) * self.devices_per_node)

    def same_node(self, ranks: Iterable[int]) -> bool:
        """True when all `ranks` live on one node."""
        return len({node for node, _ in self._locations(ranks)}) == 1

    def _locations(self, ranks: Iterable[int]) -> list[tuple[int, int]]:
        locations = [self.rank_location(r) for r in ranks]
        if not locations:
            raise ClusterError("a collective needs at least one rank; got an empty rank list")
        return locations

    def link_for(self, ranks: Iterable[int], kind: str | None = None) -> LinkView:
        """The link a collective among `ranks` uses, and how many of them share one NIC.

        All on one node: the intra-node link, sharing 1 (with the figures measured for
        collective `kind` where calibration measured it: `LinkSpec.figures`). Across
        nodes: one NIC's bandwidth and the inter-node latency; nic_sharing_factor is the
        largest number of these ranks attached to one NIC (devices_per_node /
        nics_per_node when a whole node of ranks takes part and the node has fewer NICs
        than devices).
        """
        locations = self._locations(ranks)
        if len({node for node, _ in locations}) == 1:
            return LinkView(*self.intra_link.figures(kind), 1.0)
        assert self.inter_link is not None  # nodes > 1 implies an inter_link (validated)
        per_nic: dict[tuple[int, int], int] = {}
        for node, local in locations:
            key = (node, local % self.nics_per_node)
            per_nic[key] = per_nic.get(key, 0) + 1
        return LinkView(self.inter_link.bandwidth, self.inter_link.latency_s,
                        float(max(per_nic.values())))

    def hidden_share(self, ranks: Iterable[int], kind: str) -> float:
        """The share of collective `kind`'s time among `ranks` that compute started after
        it hides (`LinkSpec.hidden_share` of the link `link_for` picks; 1 uncalibrated)."""
        nodes = {node for node, _ in self._locations(ranks)}
        link = self.intra_link if len(nodes) == 1 else self.inter_link
        return link.hidden_share(kind) if link is not None else 1.0

    # ---- topology ------------------------------------------------------------------

    def device_node(self, rank: int) -> str:
        """The topology node name of `rank`, e.g. "n1.gpu3" (or "n0.cpu2" on CPU)."""
        node, local = self.rank_location(rank)
        return f"n{node}.{'gpu' if self.device_type == 'cuda' else 'cpu'}{local}"

    @cached_property
    def topology(self) -> "networkx.Graph":
        """Devices, one in-node hub per node, NICs and one "fabric" switch, as a graph.

        Node attribute `kind` is "device", "switch", "nic" or "fabric". Edges carry
        `bandwidth` (bytes/s per direction), `latency` (s) and `link` (its name); along
        the lowest-latency path between two devices the latencies add up to the link's.
        """
        import networkx as nx

        graph = nx.Graph(name=self.name)
        hub = _hub_name(self.intra_link)
        inter = self.inter_link
        if inter is not None:
            graph.add_node("fabric", kind="fabric")
        for node in range(self.nodes):
            graph.add_node(f"n{node}.{hub}", kind="switch", node=node)
            for nic in range(self.nics_per_node):
                graph.add_node(f"n{node}.nic{nic}", kind="nic", node=node, index=nic)
                graph.add_edge(f"n{node}.nic{nic}", "fabric", bandwidth=inter.bandwidth,
                               latency=inter.latency_s / 4, link=inter.name)
            for rank in self.node_ranks(node):
                name, local = self.device_node(rank), rank % self.devices_per_node
                graph.add_node(name, kind="device", node=node, index=local, rank=rank)
                graph.add_edge(name, f"n{node}.{hub}", bandwidth=self.intra_link.bandwidth,
                               latency=self.intra_link.latency_s / 2, link=self.intra_link.name)
                if inter is not None:
                    graph.add_edge(name, f"n{node}.nic{local % self.nics_per_node}",
                                   bandwidth=inter.bandwidth, latency=inter.latency_s / 4,
                                   link=inter.name)
        return graph

    # ---- constructors --------------------------------------------------------------

    @classmethod
    def preset(cls, name: str, nodes: int = 1, devices_per_node: int | None = None) -> Cluster:
        """A named machine type (see `PRESETS`), `nodes` of it; devices_per_node overrides."""
        key = name.lower() if isinstance(name, str) else name
        if key not in PRESETS:
            close = hardware.closest_name(str(name), PRESETS)
            raise ClusterError(f"unknown cluster preset {name!r}; closest: {close!r}. Known "
                               f"presets: {sorted(PRESETS)}; or pass a cluster .json file "
                               f"or local:N")
        p = PRESETS[key]
        cpu = p.device == "cpu"
        per_node = p.devices_per_node if devices_per_node is None else devices_per_node
        return cls(name=key, nodes=nodes, devices_per_node=per_node,
                   device=hardware.device(p.device), intra_link=hardware.link(p.intra_link),
                   inter_link=hardware.link(p.inter_link), nics_per_node=p.nics_per_node,
                   backend="gloo" if cpu else "nccl", device_type="cpu" if cpu else "cuda",
                   is_local=cpu and nodes == 1)

    @classmethod
    def local(cls, world_size: int, device_type: str | None = None) -> Cluster:
        """`world_size` processes on this machine: one GPU each with NCCL when there are
        enough GPUs (or device_type="cuda"), else CPU processes with gloo. The GPUs are
        counted without initializing CUDA in this process (autohybrid/device_facts.py)."""
        hardware.check_type("world_size", world_size, (int,), "Cluster.local")
        if world_size < 1:
            raise ClusterError(f"Cluster.local: world_size must be >= 1, got {world_size}")
        facts = cuda_facts()
        gpus = facts.count
        if device_type is None:
            device_type = "cuda" if gpus >= world_size else "cpu"
        if device_type not in ("cuda", "cpu"):
            raise ClusterError(f"Cluster.local: device_type must be 'cuda', 'cpu' or None, "
                               f"got {device_type!r}")
        if device_type == "cuda" and gpus < world_size:
            raise ClusterError(f"Cluster.local: world_size={world_size} needs one GPU per "
                               f"process but {gpus} are visible"
                               f"{' (' + facts.note + ')' if facts.note else ''}; use "
                               f"device_type='cpu' or fewer processes")
        return cls._detected(f"local:{world_size}", 1, world_size, device_type, is_local=True)

    @classmethod
    def from_env(cls) -> Cluster:
        """The cluster this process runs in under torchrun (WORLD_SIZE, LOCAL_WORLD_SIZE,
        optionally GROUP_WORLD_SIZE = nodes); CUDA/NCCL when CUDA is available.

        With RANK, GROUP_RANK and LOCAL_RANK set (torchrun sets them), checks that ranks
        are numbered node by node, as `rank_location` assumes."""
        missing = [v for v in ("WORLD_SIZE", "LOCAL_WORLD_SIZE") if v not in os.environ]
        if missing:
            raise ClusterError(f"Cluster.from_env: environment variable(s) {missing} not set; "
                               f"run the script under torchrun, or describe the machine with "
                               f"Cluster.local(world_size) or Cluster.preset(name)")
        world, local = _env_int("WORLD_SIZE"), _env_int("LOCAL_WORLD_SIZE")
        nodes = (_env_int("GROUP_WORLD_SIZE") if "GROUP_WORLD_SIZE" in os.environ
                 else world // local)
        if nodes * local != world:
            raise ClusterError(f"Cluster.from_env: WORLD_SIZE={world} is not nodes={nodes} × "
                               f"LOCAL_WORLD_SIZE={local}; every node must run the same "
                               f"number of processes")
        _check_node_major(nodes, local)
        device_type = "cuda" if cuda_facts().count > 0 else "cpu"
        return cls._detected(f"torchrun:{nodes}x{local}", nodes, local, device_type,
                             is_local=False)

    @classmethod
    def _detected(cls, name: str, nodes: int, per_node: int, device_type: str,
                  is_local: bool) -> Cluster:
        """A cluster of this machine's device kind; a network link only for several nodes."""
        device, intra, inter, nics = _detect_device(device_type)
        return cls(name=name, nodes=nodes, devices_per_node=per_node, device=device,
                   intra_link=intra, inter_link=inter if nodes > 1 else None,
                   nics_per_node=min(nics, per_node) if nodes > 1 else 0,
                   backend="nccl" if device_type == "cuda" else "gloo",
                   device_type=device_type, is_local=is_local)

    @classmethod
    def parse(cls, spec: str | os.PathLike, nodes: int | None = None) -> Cluster:
        """A cluster from a CLI string: "local:N", a preset name, or a path to a .json file."""
        text = os.fspath(spec)
        if text.lower().endswith(".json") or os.path.isfile(text):
            cluster = cls.from_json(Path(text))
            return cluster if nodes is None else dataclasses.replace(cluster, nodes=nodes)
        if text.lower().startswith("local"):
            count = text.partition(":")[2]
            if not count.isdigit() or int(count) < 1:
                raise ClusterError(f"cluster spec {text!r}: write local:N with N the number "
                                   f"of processes, e.g. local:4")
            if nodes not in (None, 1):
                raise ClusterError(f"cluster spec {text!r} is one machine; got nodes={nodes}")
            return cls.local(int(count))
        return cls.preset(text, nodes=1 if nodes is None else nodes)

    # ---- serialisation -------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data; `Cluster.from_dict(c.to_dict()) == c`."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Cluster:
        """Validate and build; device and links may be full dicts or hardware table names."""
        fields = hardware.checked_fields(data, _JSON_SCHEMA, "cluster")
        fields["device"] = _spec_from(fields["device"], DeviceSpec, "device")
        fields["intra_link"] = _spec_from(fields["intra_link"], LinkSpec, "intra_link")
        if fields["inter_link"] is not None:
            fields["inter_link"] = _spec_from(fields["inter_link"], LinkSpec, "inter_link")
        return cls(**fields)

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        """The JSON text of this cluster; also written to `path` when given."""
        text = json.dumps(self.to_dict(), indent=2) + "\n"
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_json(cls, path_or_str: str | os.PathLike) -> Cluster:
        """A cluster from a JSON file path or from JSON text."""
        text = path_or_str if isinstance(path_or_str, str) else None
        if text is None or not text.lstrip().startswith("{"):
            path = Path(path_or_str)
            if not path.is_file():
                raise ClusterError(f"cluster file {str(path)!r} does not exist")
            text = path.read_text()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ClusterError(f"cluster JSON is not valid JSON: {e}") from None
        return cls.from_dict(data)

    def describe(self) -> str:
        """One line: name, ranks, device, links."""
        intra, plural = self.intra_link, "s" if self.nodes > 1 else ""
        line = (f"{self.name}: {self.nodes} node{plural} × {self.devices_per_node} "
                f"{self.device.name} = {self.world_size} ranks ({self.backend}/{self.device_type}"
                f"{', local processes' if self.is_local else ''}); in-node {intra.name} "
                f"{intra.bandwidth / 1e9:g} GB/s, {intra.latency_s * 1e6:g} µs")
        if self.inter_link is not None:
            inter = self.inter_link
            line += (f"; across nodes {self.nics_per_node}× {inter.name} "
                     f"{inter.bandwidth / 1e9:g} GB/s per NIC, {inter.latency_s * 1e6:g} µs")
        return line


# ---- validation helpers --------------------------------------------------------------

_SCHEMA: dict[str, tuple[type, ...]] = {
    "name": (str,), "nodes": (int,), "devices_per_node": (int,), "device": (DeviceSpec,),
    "intra_link": (LinkSpec,), "inter_link": (LinkSpec, type(None)), "nics_per_node": (int,),
    "backend": (str,), "device_type": (str,), "is_local": (bool,),
}
#: In JSON, the device and the links are objects or names from the hardware table.
_JSON_SCHEMA = {**_SCHEMA, "device": (dict, str), "intra_link": (dict, str),
                "inter_link": (dict, str, type(None))}


def _spec_from(value: str | dict, cls: type, where: str) -> Any:
    """A DeviceSpec / LinkSpec from a hardware table name or a full JSON object."""
    if isinstance(value, str):
        return hardware.device(value) if cls is DeviceSpec else hardware.link(value)
    return cls.from_dict(value, where)


def _env_int(variable: str, minimum: int = 1) -> int:
    """An integer >= minimum from the environment, or a ClusterError naming the variable."""
    value = os.environ[variable]
    if not value.strip().isdigit() or int(value) < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ClusterError(f"environment variable {variable}={value!r} is not {kind}; is "
                           f"this process started by torchrun?")
    return int(value)


def _check_node_major(nodes: int, per_node: int) -> None:
    """This process is rank GROUP_RANK × LOCAL_WORLD_SIZE + LOCAL_RANK (torchrun's order,
    which `Cluster.rank_location` and so every Plan's placement assume); skipped unless
    RANK, GROUP_RANK and LOCAL_RANK are all set."""
    if not all(v in os.environ for v in ("RANK", "GROUP_RANK", "LOCAL_RANK")):
        return
    rank, node, local = (_env_int(v, minimum=0) for v in ("RANK", "GROUP_RANK", "LOCAL_RANK"))
    if node >= nodes or local >= per_node or rank != node * per_node + local:
        raise ClusterError(
            f"Cluster.from_env: RANK={rank} is not GROUP_RANK={node} × LOCAL_WORLD_SIZE="
            f"{per_node} + LOCAL_RANK={local} (with {nodes} nodes): autohybrid places rank r "
            f"on node r // LOCAL_WORLD_SIZE, so each node must hold consecutive ranks; start "
            f"the processes with torchrun (or number them node by node)")


def _hub_name(intra: LinkSpec) -> str:
    """The in-node hub a device attaches to: NVSwitch, PCIe switch, or the host."""
    if intra.name.startswith(("nvlink", "nccl")):
        return "nvswitch"
    return "pcie" if intra.name.startswith("pcie") else "host"


def _detect_device(device_type: str) -> tuple[DeviceSpec, LinkSpec, LinkSpec, int]:
    """This machine's device spec, in-node link, network link and NICs per node."""
    if device_type == "cpu":
        p = PRESETS["cpu"]
        return (hardware.device("cpu"), hardware.link(p.intra_link),
                hardware.link(p.inter_link), p.nics_per_node)
    facts = cuda_facts()  # (never get_device_properties: it would initialize CUDA here)
    if facts.count < 1 or facts.name is None:
        raise ClusterError(f"a CUDA cluster on this machine, but no CUDA device is visible"
                           f"{' (' + facts.note + ')' if facts.note else ''}; check "
                           f"CUDA_VISIBLE_DEVICES and the driver, or use device_type='cpu'")
    gpu_name = facts.name
    device = hardware.match_cuda_device(gpu_name, facts.memory_bytes)
    preset = next((p for p in PRESETS.values() if p.device == device.name), None)
    if preset is None:  # an unrecognised GPU: a guess, to be replaced by calibration
        return device, hardware.link("pcie-gen4"), hardware.link("ib-hdr"), 1
    pcie = "pcie" in gpu_name.lower()
    intra = hardware.PCIE_LINK_OF[device.name] if pcie else preset.intra_link
    return device, hardware.link(intra), hardware.link(preset.inter_link), preset.nics_per_node
