"""The one table of hardware constants: devices and links, each with its source.

This module owns every hardware figure autohybrid uses by default (peak FLOP/s, memory,
memory bandwidth, link bandwidth and latency). Nothing else in the package may hard-code
such a number: the cost model reads it from here through a `Cluster`, and calibration
(`ah.calibrate`) replaces it with measured figures. It must not import torch or anything
above it; it only knows numbers and where they come from.

Conventions
-----------
- FLOP/s are dense peaks (no 2:4 sparsity), keyed by dtype name: "float64", "float32",
  "tfloat32", "bfloat16", "float16".
- "float32" is the plain (non-tensor-core) FP32 rate. That is what PyTorch's default
  fp32 matmul gets (`torch.get_float32_matmul_precision() == "highest"` disables TF32).
  Megatron-style cost models quote TF32 for fp32 instead; that figure is kept separately
  under "tfloat32" and `DeviceSpec.flops(..., allow_tf32=True)` selects it.
- Bandwidths are bytes/s per direction. Latencies are per-call seconds of a collective.
- Memory sizes marked GiB are the binary capacities `nvidia-smi` reports (an "80 GB"
  A100 shows 81920 MiB); H200 and B200 use the datasheet figure in decimal GB, which is
  slightly below what the driver reports (a conservative choice for "does it fit").
- REF = /work/shared/reference/hardware_and_formulas.md (public figures, with sources).

Example
-------
>>> from autohybrid import hardware
>>> hardware.device("A100-80GB").flops("bfloat16")
312000000000000.0
>>> hardware.link("ib-hdr").bandwidth
25000000000.0
"""
from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping

from autohybrid.errors import ClusterError

__all__ = ["DeviceSpec", "LinkSpec", "DEVICES", "LINKS", "GEMM_TILES", "ATTENTION_QUERY_BLOCK",
           "device", "link", "dtype_name", "closest_name", "match_cuda_device",
           "PCIE_LINK_OF", "check_type", "checked_fields"]

GiB = 2**30
GB = 10**9
TERA = 1e12

#: Mid values of the per-call collective latencies in REF ("5–10 µs inside a node and
#: 15–30 µs across nodes", without CUDA graphs).
INTRA_NODE_LATENCY_S = 7.5e-6
INTER_NODE_LATENCY_S = 22.5e-6
#: Fixed cost per op (kernel launch, eager dispatch) when a device has not been calibrated.
#: Not in REF: the few µs commonly quoted for a CUDA kernel launch with PyTorch's dispatch
#: (same order as REF's 5–10 µs per collective call); `autohybrid calibrate` measures it.
LAUNCH_OVERHEAD_S = 5e-6
#: Share of a gloo collective between local CPU processes that compute started after it
#: hides, uncalibrated (the "gloo-local" link below says where it comes from).
GLOO_LOCAL_HIDDEN = 1 / 3

#: Output tiles (rows, columns) a GPU GEMM library chooses among; each tile is one thread
#: block on one SM, the blocks run in waves of `sm_count`, and a partial last wave leaves
#: SMs idle (tile and wave quantization). Source: NVIDIA Deep Learning Performance Guide,
#: "Matrix Multiplication Background" (tile quantization, wave quantization; cuBLAS's
#: tiles 256×128, 128×128, 128×64 …, larger tiles being the more efficient per FLOP).
GEMM_TILES = ((256, 128), (128, 128), (128, 64))
#: Queries per thread block of fused (flash) attention: one block per (sample, head,
#: 128 queries) over the whole head dimension. Source: Dao, "FlashAttention-2" (2023),
#: §3.2 (parallelism over the sequence length; block sizes {64, 128} × {64, 128}).
ATTENTION_QUERY_BLOCK = 128

DTYPE_NAMES = ("float64", "float32", "tfloat32", "bfloat16", "float16")


def dtype_name(dtype: object) -> str:
    """'float32' for `torch.float32`, `"torch.float32"` or `"float32"` (no torch import)."""
    return str(dtype).removeprefix("torch.")


def _check_positive(owner: str, field_name: str, value: object) -> None:
    """Raise a ClusterError naming `field_name` unless `value` is a number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ClusterError(f"{owner}: field {field_name!r} must be a number > 0, got {value!r}")


JSON_NUMBER = (int, float)


def check_type(field_name: str, value: object, types: tuple[type, ...],
               where: str = "cluster JSON") -> None:
    """Raise a ClusterError naming `field_name` unless `value` is one of `types` (a bool is
    not an int here)."""
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
        names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
        raise ClusterError(f"{where}: field {field_name!r} must be {names}, got {value!r} "
                           f"({type(value).__name__})")


def checked_fields(data: object, types: Mapping[str, tuple[type, ...]], where: str,
                   prefix: str = "") -> dict[str, Any]:
    """JSON object `data` checked against `types`: no unknown, no missing, right types.

    Field names in messages carry `prefix` (e.g. "device.") so nested fields are named by
    their path in the cluster JSON.
    """
    if not isinstance(data, dict):
        raise ClusterError(f"cluster JSON: {where!r} must be a JSON object, got "
                           f"{type(data).__name__}")
    unknown = [prefix + k for k in data if k not in types]
    if unknown:
        raise ClusterError(f"cluster JSON: unknown field(s) {unknown} (value "
                           f"{data[unknown[0][len(prefix):]]!r}); known: "
                           f"{[prefix + n for n in types]}")
    missing = [prefix + n for n in types if n not in data]
    if missing:
        raise ClusterError(f"cluster JSON: missing field(s) {missing}; for a complete example "
                           f"see Cluster.preset('cpu').to_json()")
    for name, allowed in types.items():
        check_type(prefix + name, data[name], allowed)
    return dict(data)


def _gemm_curves(value: object, where: str) -> tuple:
    """DeviceSpec.gemm_curves from JSON ([[dtype, [[flops, share], ...]], ...]), checked."""
    def bad() -> ClusterError:
        return ClusterError(f"{where} must be a list of [dtype name, [[GEMM FLOPs, share of "
                            f"the best rate], ...]] (as `ah.calibrate` writes), got {value!r}"
                            [:300])
    if not isinstance(value, (list, tuple)):
        raise bad()
    out = []
    for entry in value:
        if not isinstance(entry, (list, tuple)) or len(entry) != 2 or \
                not isinstance(entry[0], str) or not isinstance(entry[1], (list, tuple)):
            raise bad()
        points = []
        for point in entry[1]:
            if not isinstance(point, (list, tuple)) or len(point) != 2 or not all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0
                    for x in point):
                raise bad()
            points.append((float(point[0]), float(point[1])))
        out.append((entry[0], tuple(sorted(points))))
    return tuple(out)


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or one CPU process's share of a host): compute, memory, source."""

    name: str
    peak_flops: dict[str, float] = field(hash=False)  # FLOP/s per dtype name, dense
    memory_bytes: int
    memory_bandwidth: float  # bytes/s
    source: str
    #: fixed cost of one op (kernel launch / eager dispatch), s; calibration measures it
    launch_overhead_s: float = LAUNCH_OVERHEAD_S
    #: streaming multiprocessors (datasheet), which a GEMM's output tiles are spread over
    #: in waves (cost/gemm.py); 0: no tile model (a CPU, an unknown device): every GEMM
    #: at the one efficiency of cost/compute.py
    sm_count: int = 0
    #: measured GEMM rate by size, per dtype name: ((FLOPs of one GEMM call, its rate over
    #: the best measured rate), ...) ascending, from `ah.calibrate`; priced where there is
    #: no tile model (cost/gemm.py `curve_utilization`). Empty: one rate for every GEMM
    gemm_curves: tuple[tuple[str, tuple[tuple[float, float], ...]], ...] = ()
    #: how much faster one rank computes while the cluster's other ranks wait than while
    #: all compute at once: ranks that share a host's cores (from `ah.calibrate`: its
    #: matmul rate alone over its rate beside the others); 1 where each rank has its
    #: own device. A pipeline's idle ranks leave their share to the busy ones
    #: (search/pricing.py `shared_speedup`).
    alone_speedup: float = 1.0

    def __post_init__(self) -> None:
        _check_positive(f"device {self.name!r}", "memory_bytes", self.memory_bytes)
        if isinstance(self.alone_speedup, bool) \
                or not isinstance(self.alone_speedup, (int, float)) or self.alone_speedup < 1:
            raise ClusterError(f"device {self.name!r}: field 'alone_speedup' must be a "
                               f"number >= 1 (1: ranks do not share compute), got "
                               f"{self.alone_speedup!r}")
        _check_positive(f"device {self.name!r}", "launch_overhead_s", self.launch_overhead_s)
        _check_positive(f"device {self.name!r}", "memory_bandwidth", self.memory_bandwidth)
        if not isinstance(self.sm_count, int) or self.sm_count < 0:
            raise ClusterError(f"device {self.name!r}: field 'sm_count' must be an integer "
                               f">= 0 (0: no GEMM tile model), got {self.sm_count!r}")
        if not self.peak_flops:
            raise ClusterError(f"device {self.name!r}: field 'peak_flops' is empty; give "
                               f"FLOP/s per dtype name, e.g. {{'float32': 1e11}}")
        for dtype, value in self.peak_flops.items():
            _check_positive(f"device {self.name!r}", f"peak_flops[{dtype!r}]", value)

    @classmethod
    def from_dict(cls, data: object, where: str = "device") -> DeviceSpec:
        """A DeviceSpec from its JSON object (as `dataclasses.asdict` writes it), checked."""
        types = {"name": (str,), "peak_flops": (dict,), "memory_bytes": (int,),
                 "memory_bandwidth": JSON_NUMBER, "source": (str,)}
        overhead, sms, curves, alone = LAUNCH_OVERHEAD_S, 0, (), 1.0
        if isinstance(data, dict) and "launch_overhead_s" in data:  # optional field
            data = dict(data)
            overhead = data.pop("launch_overhead_s")
            check_type(f"{where}.launch_overhead_s", overhead, JSON_NUMBER)
        if isinstance(data, dict) and "sm_count" in data:  # optional field
            data = dict(data)
            sms = data.pop("sm_count")
            check_type(f"{where}.sm_count", sms, (int,))
        if isinstance(data, dict) and "gemm_curves" in data:  # optional field
            data = dict(data)
            curves = _gemm_curves(data.pop("gemm_curves"), f"{where}.gemm_curves")
        if isinstance(data, dict) and "alone_speedup" in data:  # optional field
            data = dict(data)
            alone = data.pop("alone_speedup")
            check_type(f"{where}.alone_speedup", alone, JSON_NUMBER)
        f = checked_fields(data, types, where, prefix=f"{where}.")
        for dtype, value in f["peak_flops"].items():
            check_type(f"{where}.peak_flops[{dtype!r}]", value, JSON_NUMBER)
        return cls(f["name"], {k: float(v) for k, v in f["peak_flops"].items()},
                   f["memory_bytes"], float(f["memory_bandwidth"]), f["source"],
                   float(overhead), sms, curves, float(alone))

    def __hash__(self) -> int:  # the dict field is not hashable; hash its items instead
        return hash((self.name, tuple(sorted(self.peak_flops.items())), self.memory_bytes,
                     self.memory_bandwidth, self.source, self.launch_overhead_s,
                     self.sm_count, self.gemm_curves, self.alone_speedup))

    def flops(self, dtype: object, allow_tf32: bool = False) -> float:
        """Peak FLOP/s for `dtype` (a torch dtype or its name); fp32 uses TF32 if allowed."""
        name = dtype_name(dtype)
        if name == "float32" and allow_tf32 and "tfloat32" in self.peak_flops:
            name = "tfloat32"
        if name not in self.peak_flops:
            raise ClusterError(
                f"device {self.name!r} has no peak FLOP/s for dtype {name!r}; known dtypes: "
                f"{sorted(self.peak_flops)}. Add it to autohybrid/hardware.py or calibrate.")
        return self.peak_flops[name]


@dataclass(frozen=True)
class LinkSpec:
    """One kind of link: bandwidth per direction (bytes/s), per-call latency, source."""

    name: str
    bandwidth: float  # bytes/s per direction
    latency_s: float
    source: str
    #: (kind, bandwidth, latency_s) of collectives measured apart on this link
    #: (calibrate.py: all_reduce, all_gather, reduce_scatter, send_recv, each between
    #: compute as training runs them); a kind not listed uses `bandwidth`, `latency_s`
    collectives: tuple[tuple[str, float, float], ...] = ()
    #: (kind, share) of a collective's time that compute hides when the collective is
    #: started before it (calibrate.py, CPU); a kind not listed: 1 (all of it)
    hidden: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        _check_positive(f"link {self.name!r}", "bandwidth", self.bandwidth)
        if isinstance(self.latency_s, bool) or not isinstance(self.latency_s, (int, float)) \
                or self.latency_s < 0:
            raise ClusterError(f"link {self.name!r}: field 'latency_s' must be a number >= 0 "
                               f"(seconds), got {self.latency_s!r}")
        for entry in self.collectives:
            if not (isinstance(entry, (tuple, list)) and len(entry) == 3
                    and isinstance(entry[0], str)
                    and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                            for x in entry[1:]) and entry[1] > 0 and entry[2] >= 0):
                raise ClusterError(f"link {self.name!r}: each of 'collectives' is [kind, "
                                   f"bandwidth > 0, latency_s >= 0], got {entry!r}")
        object.__setattr__(self, "collectives",
                           tuple((str(k), float(b), float(t)) for k, b, t in self.collectives))
        for entry in self.hidden:
            if not (isinstance(entry, (tuple, list)) and len(entry) == 2
                    and isinstance(entry[0], str) and isinstance(entry[1], (int, float))
                    and not isinstance(entry[1], bool) and 0 <= entry[1] <= 1):
                raise ClusterError(f"link {self.name!r}: each of 'hidden' is [kind, share in "
                                   f"0..1], got {entry!r}")
        object.__setattr__(self, "hidden", tuple((str(k), float(v)) for k, v in self.hidden))

    def figures(self, kind: str | None = None) -> tuple[float, float]:
        """(bandwidth, latency_s) of collective `kind` on this link (None: the link's)."""
        for name, bandwidth, latency in self.collectives:
            if name == kind:
                return bandwidth, latency
        return self.bandwidth, self.latency_s

    def hidden_share(self, kind: str) -> float:
        """The share of collective `kind`'s time that compute started after it hides."""
        return dict(self.hidden).get(kind, 1.0)

    @classmethod
    def from_dict(cls, data: object, where: str = "link") -> LinkSpec:
        """A LinkSpec from its JSON object (as `dataclasses.asdict` writes it), checked;
        `collectives` and `hidden` may be absent (files written before they existed)."""
        types = {"name": (str,), "bandwidth": JSON_NUMBER, "latency_s": JSON_NUMBER,
                 "source": (str,)}
        optional = {}
        for name in ("collectives", "hidden"):  # absent from files written before them
            if isinstance(data, dict) and name in data:
                data = dict(data)
                value = data.pop(name)
                if not isinstance(value, (list, tuple)):
                    raise ClusterError(f"cluster JSON: {where}.{name} must be a list, got "
                                       f"{value!r}")
                optional[name] = tuple(tuple(e) if isinstance(e, (list, tuple)) else e
                                       for e in value)
        f = checked_fields(data, types, where, prefix=f"{where}.")
        return cls(f["name"], float(f["bandwidth"]), float(f["latency_s"]), f["source"],
                   **optional)


def _flops(fp64: float, fp32: float, tf32: float, bf16: float, fp16: float) -> dict[str, float]:
    """A peak-FLOP/s dict from TFLOP/s figures in the order of the datasheets."""
    return {"float64": fp64 * TERA, "float32": fp32 * TERA, "tfloat32": tf32 * TERA,
            "bfloat16": bf16 * TERA, "float16": fp16 * TERA}


DEVICES: Mapping[str, DeviceSpec] = {d.name: d for d in (
    DeviceSpec(
        "V100", _flops(7.8, 15.7, 15.7, 15.7, 125.0), 32 * GiB, 0.90e12,
        "NVIDIA V100 SXM2 datasheet (fp16 tensor 125, fp32 15.7, fp64 7.8 TFLOP/s; 32 GB "
        "HBM2, 900 GB/s); REF. V100 has no TF32 or bf16 tensor cores: tfloat32 and bfloat16 "
        "are set to the fp32 rate as an upper bound; 80 SMs (V100 whitepaper)", sm_count=80),
    DeviceSpec(
        "A100-40GB", _flops(9.7, 19.5, 156.0, 312.0, 312.0), 40 * GiB, 1.555e12,
        "NVIDIA A100 SXM4 datasheet (bf16/fp16 312, tf32 156, fp32 19.5, fp64 9.7 TFLOP/s "
        "dense; 40 GB HBM2, 1555 GB/s; 108 SMs, A100 whitepaper); REF", sm_count=108),
    DeviceSpec(
        "A100-80GB", _flops(9.7, 19.5, 156.0, 312.0, 312.0), 80 * GiB, 2.039e12,
        "NVIDIA A100 SXM4 datasheet (bf16/fp16 312, tf32 156, fp32 19.5, fp64 9.7 TFLOP/s "
        "dense; 80 GB HBM2e, 2039 GB/s; 108 SMs, A100 whitepaper); REF", sm_count=108),
    DeviceSpec(
        "H100", _flops(34.0, 67.0, 494.7, 989.4, 989.4), 80 * GiB, 3.35e12,
        "NVIDIA H100 SXM5 datasheet (bf16/fp16 989, tf32 495, fp32 67, fp64 34 TFLOP/s "
        "dense — 1979 bf16 is with sparsity; 80 GB HBM3, 3.35 TB/s; 132 SMs, H100 "
        "whitepaper); REF", sm_count=132),
    DeviceSpec(
        "H200", _flops(34.0, 67.0, 494.7, 989.4, 989.4), 141 * GB, 4.8e12,
        "NVIDIA H200 SXM datasheet (same compute as H100 SXM, 132 SMs; 141 GB HBM3e, "
        "4.8 TB/s); REF", sm_count=132),
    DeviceSpec(
        "B200", _flops(40.0, 80.0, 1100.0, 2250.0, 2250.0), 180 * GB, 8.0e12,
        "NVIDIA Blackwell datasheet, HGX B200 at 1000 W (bf16/fp16 2250, tf32 1100, fp32 80, "
        "fp64 40 TFLOP/s dense; 180 GB HBM3e per GPU in HGX/DGX B200, 8 TB/s; 148 SMs, "
        "Blackwell architecture brief); REF", sm_count=148),
    DeviceSpec(
        "cpu", {"float64": 5e10, "float32": 1e11, "tfloat32": 1e11, "bfloat16": 5e10,
                "float16": 5e10}, 24 * GiB, 2e10,
        "PLACEHOLDER, not a measurement: a modest multi-core host share (1e11 fp32 FLOP/s, "
        "24 GiB, 20 GB/s) so plans on CPU/gloo can be ranked; replace with ah.calibrate"),
    DeviceSpec(
        "gpu-unknown", _flops(0.5, 20.0, 20.0, 80.0, 80.0), 16 * GiB, 5e11,
        "PLACEHOLDER for a CUDA GPU not in this table (a mid-range card); Cluster.local "
        "keeps its real memory size from the driver; replace with ah.calibrate"),
)}


LINKS: Mapping[str, LinkSpec] = {l.name: l for l in (
    # NVLink, nominal per-GPU bandwidth per direction, by generation.
    LinkSpec("nvlink-v100", 150e9, INTRA_NODE_LATENCY_S,
             "NVLink 2 (V100 SXM2): 6 links × 25 GB/s = 150 GB/s per direction, datasheet; "
             "latency: REF mid value"),
    LinkSpec("nvlink-a100", 300e9, INTRA_NODE_LATENCY_S,
             "NVLink 3 (A100 SXM4): 600 GB/s total = 300 GB/s per direction, datasheet; REF"),
    LinkSpec("nvlink-h100", 450e9, INTRA_NODE_LATENCY_S,
             "NVLink 4 (H100/H200 SXM): 900 GB/s total = 450 GB/s per direction, datasheet; REF"),
    LinkSpec("nvlink-b200", 900e9, INTRA_NODE_LATENCY_S,
             "NVLink 5 (B200): 1.8 TB/s total = 900 GB/s per direction, datasheet; REF"),
    # What an NCCL collective among the 8 GPUs of an NVSwitch node actually reaches.
    LinkSpec("nccl-a100-node", 230e9, INTRA_NODE_LATENCY_S,
             "practical NCCL ring all-reduce bus bandwidth in an 8×A100 NVSwitch node "
             "(≈200–235 GB/s, REF; upper end used)"),
    LinkSpec("nccl-h100-node", 370e9, INTRA_NODE_LATENCY_S,
             "practical NCCL ring all-reduce bus bandwidth in an 8×H100/H200 NVSwitch node "
             "(≈370 GB/s, REF)"),
    # PCIe x16, nominal per direction.
    LinkSpec("pcie-gen3", 16e9, INTRA_NODE_LATENCY_S,
             "PCIe 3.0 x16: ≈15.75 GB/s per direction (PCI-SIG), rounded; latency: REF mid"),
    LinkSpec("pcie-gen4", 32e9, INTRA_NODE_LATENCY_S,
             "PCIe 4.0 x16: ≈31.5 GB/s per direction (PCI-SIG), rounded; latency: REF mid"),
    LinkSpec("pcie-gen5", 64e9, INTRA_NODE_LATENCY_S,
             "PCIe 5.0 x16: ≈63 GB/s per direction (PCI-SIG), rounded; latency: REF mid"),
    # InfiniBand, per NIC (one port) per direction.
    LinkSpec("ib-edr", 12.5e9, INTER_NODE_LATENCY_S,
             "InfiniBand EDR 100 Gb/s = 12.5 GB/s per NIC (DGX-1 V100: 4 NICs); "
             "latency: REF mid value of 15–30 µs"),
    LinkSpec("ib-hdr", 25e9, INTER_NODE_LATENCY_S,
             "InfiniBand HDR 200 Gb/s = 25 GB/s per NIC, REF; latency: REF mid value"),
    LinkSpec("ib-ndr", 50e9, INTER_NODE_LATENCY_S,
             "InfiniBand NDR 400 Gb/s = 50 GB/s per NIC, REF; latency: REF mid value"),
    # Local CPU processes (gloo) and plain Ethernet: placeholders.
    # Both run gloo, where autohybrid sums a reduce-scatter's scratch input by an
    # all-reduce (ops/groups.py `reduce_scatter_single`; gloo's own reduce-scatter takes
    # twice as long): its ring formula (p−1)α + (p−1)/p·n·β is priced with α and β
    # doubled, which is the all-reduce's 2(p−1)α + 2(p−1)/p·n·β. Calibration measures
    # the reduce-scatter as it runs and replaces these.
    LinkSpec("gloo-local", 1e9, 50e-6,
             "PLACEHOLDER, not a measurement: gloo between processes on one host "
             "(loopback TCP / shared memory), ~1 GB/s and 50 µs; replace with ah.calibrate "
             "(on the 2-core reference VM it measures an all-reduce's α at 120–210 µs on 2 "
             "ranks); "
             "gloo runs a collective on a thread that shares the cores the ranks compute "
             "on, so compute started after it hides only part of it: a third of an "
             "all-reduce, all-gather or reduce-scatter (ah.calibrate's hidden_share on the "
             "2-core reference VM, 2 ranks, three runs: 0.25–0.42, 0.26–0.48, 0.10–0.36), "
             "none of an all-to-all",
             collectives=(("reduce_scatter", 0.5e9, 100e-6),),
             hidden=(("all_gather", GLOO_LOCAL_HIDDEN), ("all_reduce", GLOO_LOCAL_HIDDEN),
                     ("all_to_all", 0.0), ("reduce_scatter", GLOO_LOCAL_HIDDEN))),
    LinkSpec("ethernet-10g", 1.25e9, 100e-6,
             "PLACEHOLDER: 10 GbE line rate (1.25 GB/s) with a guessed 100 µs gloo/TCP "
             "per-call latency; replace with ah.calibrate",
             collectives=(("reduce_scatter", 0.625e9, 200e-6),),
             hidden=(("all_to_all", 0.0),)),
)}


def closest_name(name: str, known: Iterable[str]) -> str | None:
    """The known name most like `name`: one it is a part of first, else the one sharing the
    longest prefix, ties broken by difflib's similarity ratio."""
    known = sorted(known)
    lowered = name.lower()
    containing = [k for k in known if lowered and lowered in k.lower()]
    if containing:
        return containing[0]

    def prefix(k: str) -> int:
        return len(os.path.commonprefix([lowered, k.lower()]))

    scored = [(prefix(k), difflib.SequenceMatcher(None, lowered, k.lower()).ratio(), k)
              for k in known]
    return max(scored, key=lambda t: (t[0], t[1], [-ord(c) for c in t[2]]))[2] if scored else None


#: The PCIe link of a PCIe-card variant of each GPU (used when the device name says PCIe).
PCIE_LINK_OF = {"V100": "pcie-gen3", "A100-40GB": "pcie-gen4", "A100-80GB": "pcie-gen4",
                "H100": "pcie-gen5", "H200": "pcie-gen5", "B200": "pcie-gen5"}


def match_cuda_device(gpu_name: str, memory_bytes: int) -> DeviceSpec:
    """The table entry for a CUDA device name such as "NVIDIA A100-SXM4-80GB".

    An unrecognised GPU gets the "gpu-unknown" placeholder under its own name and with
    the memory size the driver reports.
    """
    upper = gpu_name.upper()
    if "A100" in upper:
        return device("A100-80GB" if "80GB" in upper or memory_bytes > 48 * GiB else "A100-40GB")
    key = next((k for k in ("H200", "H100", "B200", "V100") if k in upper), None)
    if key is not None:
        return device(key)
    return replace(device("gpu-unknown"), name=gpu_name, memory_bytes=memory_bytes)


def _unknown(kind: str, name: str, known: Mapping[str, object]) -> ClusterError:
    """The error for an unknown table key: names it, the closest key and all known keys."""
    close = closest_name(name, known)
    hint = f" Did you mean {close!r}?" if close else ""
    return ClusterError(f"unknown {kind} {name!r}.{hint} Known {kind}s: {sorted(known)}; "
                        f"add new hardware to autohybrid/hardware.py with its source.")


def _lookup(kind: str, name: str, table: Mapping[str, object]) -> object:
    """Case-insensitive lookup of `name` in `table`, or a ClusterError naming the key."""
    if not isinstance(name, str):
        raise ClusterError(f"{kind} name must be a string, got {name!r}")
    by_lower = {k.lower(): v for k, v in table.items()}
    if name.lower() not in by_lower:
        raise _unknown(kind, name, table)
    return by_lower[name.lower()]


def device(name: str) -> DeviceSpec:
    """The DeviceSpec named `name` (case-insensitive), e.g. "H100", "A100-80GB", "cpu"."""
    return _lookup("device", name, DEVICES)  # type: ignore[return-value]


def link(name: str) -> LinkSpec:
    """The LinkSpec named `name` (case-insensitive), e.g. "nvlink-a100", "ib-ndr"."""
    return _lookup("link", name, LINKS)  # type: ignore[return-value]
