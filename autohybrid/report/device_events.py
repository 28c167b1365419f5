"""Device-side (CUDA) profiler events as compute and communication: a pure function.

On CUDA the work of a step is kernels on streams, run after the CPU enqueued them; what
the CPU thread does says little about what the device overlaps. `torch.profiler` with
`ProfilerActivity.CUDA` records each kernel with its stream and device-clock times
(aligned to the trace clock). NCCL's work is kernels too, named `ncclDevKernel_AllReduce_…`
(`ncclKernel_…` on older NCCL), on NCCL's own stream; the host side of a collective is a
`nccl:all_reduce` record_function range (and a `c10d::` op) on the issuing thread.

`classify_device_events` takes plain tuples `(name, device_type, stream, start, end)` —
runtime/profile.py builds them from `prof.events()` — so that the classification is tested
without a process or a GPU:

- a device event (device_type "cuda") whose name contains "nccl" is communication;
- a device `Memcpy …` / `Memset …` is a copy (the copy engines run beside kernels): neither;
- every other device event is a compute kernel;
- host events (any other device_type) named `nccl:<op>` are the collectives' issue ranges,
  returned as they are; other host events are ignored.

Exposed communication = each communication kernel's span minus the compute kernels on
*other* streams (kernels of one stream run one after another, so only another stream can
hide a transfer), unioned over the kernels.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from .timeline import Span, subtract, total, union

#: (name, device_type, stream, start, end): times in any one unit (the profiler's µs)
DeviceEvent = tuple[str, str, int, float, float]


@dataclass
class DeviceSplit:
    """Device kernels sorted into compute and communication (times as given)."""

    compute: list[tuple[str, int, float, float]] = field(default_factory=list)
    communication: list[tuple[str, int, float, float]] = field(default_factory=list)
    copies: list[tuple[str, int, float, float]] = field(default_factory=list)
    issues: list[tuple[str, float, float]] = field(default_factory=list)  # host nccl: ranges
    exposed: list[Span] = field(default_factory=list)

    @property
    def compute_spans(self) -> list[Span]:
        return union((a, b) for _, _, a, b in self.compute)

    @property
    def comm_spans(self) -> list[Span]:
        return union((a, b) for _, _, a, b in self.communication)

    @property
    def exposed_total(self) -> float:
        return total(self.exposed)

    @property
    def comm_total(self) -> float:
        return total(self.comm_spans)


def is_comm_kernel(name: str) -> bool:
    return "nccl" in name.lower()


def is_copy(name: str) -> bool:
    return name.startswith(("Memcpy", "Memset", "memcpy", "memset"))


def comm_op(name: str) -> str:
    """'ncclDevKernel_AllReduce_Sum_f32_RING_LL' → 'all_reduce'; 'nccl:all_gather' →
    'all_gather'; unknown names stay as they are (lower-cased)."""
    low = name.lower()
    if low.startswith("nccl:"):
        return low.split(":", 1)[1]
    for key, op in (("allreduce", "all_reduce"), ("allgather", "all_gather"),
                    ("reducescatter", "reduce_scatter"), ("broadcast", "broadcast"),
                    ("sendrecv", "send_recv"), ("send", "send"), ("recv", "recv"),
                    ("alltoall", "all_to_all"), ("reduce", "reduce")):
        if key in low.replace("_", ""):
            return op
    return low


def classify_device_events(events: Iterable[DeviceEvent]) -> DeviceSplit:
    """Sort `events` (see the module docstring) and compute the exposed communication."""
    out = DeviceSplit()
    for name, device_type, stream, start, end in events:
        if end < start:
            raise ValueError(f"device event {name!r} ends ({end}) before it starts ({start})")
        if str(device_type).lower() != "cuda":
            if name.lower().startswith("nccl:"):
                out.issues.append((name, start, end))
            continue
        item = (name, int(stream), float(start), float(end))
        if is_comm_kernel(name):
            out.communication.append(item)
        elif is_copy(name):
            out.copies.append(item)
        else:
            out.compute.append(item)
    for part in (out.compute, out.communication, out.copies):
        part.sort(key=lambda e: (e[2], e[3]))
    out.issues.sort(key=lambda e: (e[1], e[2]))
    by_stream: dict[int, list[Span]] = {}
    for _, stream, a, b in out.compute:
        by_stream.setdefault(stream, []).append((a, b))
    others: dict[int, list[Span]] = {}
    exposed: list[Span] = []
    for _, stream, a, b in out.communication:
        if stream not in others:
            others[stream] = union(s for st, spans in by_stream.items() if st != stream
                                   for s in spans)
        exposed += subtract([(a, b)], others[stream])
    out.exposed = union(exposed)
    return out
