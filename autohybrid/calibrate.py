"""Measure this machine: matmul and element-wise throughput, per-op launch overhead,
collective α and β.

    profile = ah.calibrate(ah.Cluster.local(2))      # or: autohybrid calibrate --world-size 2
    profile.to_json("calibration.json")
    plan = ah.plan(model, cluster, inputs, calibration=profile)   # plan.calibration_hash set

The cost model keeps its documented efficiencies; a profile replaces the cluster's device
and link figures so that efficiency × figure equals what was measured here (`apply`).
Matmuls are timed at several sizes, all ranks at once (a barrier before each, and on CPU
a window of several scheduler slices, so ranks sharing cores are measured sharing them):
the best size's rate is the device's figure, and each size's rate over it is the curve
by which a GEMM of another size is priced (`Profile.matmul_curve`,
DeviceSpec.gemm_curves, cost/gemm.py) where the device has no tile model. On CPU, rank 0
also times its best size for a fixed window beside every rank computing, then alone while
the others wait: the ratio (`Profile.alone_speedup`, DeviceSpec.alone_speedup) is what
ranks sharing the host's cores gain while a pipeline leaves some of them idle
(search/pricing.py).
Collectives are timed on real processes (`ah.launch`), α and β fitted by least squares on
the ring all-reduce formula T(n) = 2(p−1)α + 2(p−1)/p · n · β.

A collective costs more inside a training step than alone: on CPU the ranks' compute and
gloo's threads share the cores, and each collective waits out the skew its peers' compute
left. So each collective kind the runtime issues (`COLLECTIVE_KINDS`) is also timed as it
runs in training, between matmuls (`CONTEXT_MATMUL`): the time a loop of matmul +
collective takes beyond the same loop without the collective, per collective. α and β per
kind are fitted from those, each on its own formula (`FORMULAS`: all-gather and
reduce-scatter (p−1)α + (p−1)/p · n · β, a pipeline's send α + n · β), and priced by
kind (`Profile.collectives`, hardware.LinkSpec.collectives, cost/comm.py). On CUDA,
where NCCL runs on its own stream, each kind is timed alone.
"""
from __future__ import annotations

import hashlib
import json
import math
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from . import logs
from .cluster import Cluster
from .cost import comm
from .cost.compute import MATMUL_EFFICIENCY, MEMORY_EFFICIENCY
from .errors import AutohybridError
from .hardware import LinkSpec
from .ops.groups import all_gather_single, reduce_scatter_single

PROFILE_VERSION = 1
ALL_REDUCE_SIZES = (4 << 10, 64 << 10, 1 << 20, 8 << 20)
#: matmuls timed on CPU (squares) and on CUDA: large squares and GPT-1.3B-like shapes
#: (tokens × hidden against hidden × 3·hidden / 4·hidden, and back), m×k @ k×n as (m, k, n)
CPU_MATMULS: tuple = (128, 256, 512, 1024)
CUDA_MATMULS: tuple = (4096, 8192, (8192, 2048, 6144), (8192, 2048, 8192), (8192, 8192, 2048))
CUDA_DTYPES = (torch.float32, torch.bfloat16)
#: the least time one CPU matmul timing spans: several of the kernel scheduler's slices
#: (a few ms each), so ranks sharing cores are measured sharing them
CPU_TIMING_WINDOW_S = 0.03
#: the window every rank computes for at once, then rank 0 alone (`Profile.alone_speedup`)
SHARED_WINDOW_S = 0.3
#: collectives timed in a step's context, per kind; priced by kind (cost/comm.py)
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
#: the compute between two timed collectives on CPU: (m, k, n), run twice (a layer's
#: matmuls; about 5 ms on one core of these machines)
CONTEXT_MATMUL = (1024, 256, 1024)
CONTEXT_ITERATIONS = 6
#: collectives the runtime starts before the compute they overlap (dp gradient buckets:
#: all-reduces, ZeRO-1/2's reduce-scatters; ZeRO-3's prefetched gathers and deferred
#: reduce-scatters; a MoE layer's chunked all-to-alls): how much of each that compute
#: hides is measured too
OVERLAPPED_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


@dataclass(frozen=True)
class Profile:
    """What calibration measured (achieved figures, not peaks)."""

    machine: str
    matmul_flops: dict[str, float]                 # dtype → achieved FLOP/s
    memory_bandwidth: float                        # bytes/s of a large element-wise add
    world_size: int = 1
    all_reduce_latency_s: float | None = None      # α
    all_reduce_bandwidth: float | None = None      # 1/β, bytes/s
    launch_overhead_s: float | None = None         # per op: dispatch + launch of a tiny op
    samples: dict[str, list[float]] = field(default_factory=dict)
    #: collective kind → [α seconds, bandwidth bytes/s] timed in a step's context
    collectives: dict[str, list[float]] = field(default_factory=dict)
    #: collective kind → the share of its time that compute hides when it is started
    #: before that compute (1 − its cost so ÷ its cost between matmuls), largest size
    hidden_share: dict[str, float] = field(default_factory=dict)
    #: dtype → [[FLOPs of one GEMM, achieved FLOP/s], ...] ascending: the rate by size
    #: (the slowest rank's), priced where the device has no tile model (cost/gemm.py)
    matmul_curve: dict[str, list[list[float]]] = field(default_factory=dict)
    #: dtype → a rank's matmul rate computing alone (the others waiting) over its rate
    #: computing beside them (CPU ranks sharing the host's cores; empty: one rank, CUDA)
    alone_speedup: dict[str, float] = field(default_factory=dict)
    version: int = PROFILE_VERSION

    def hash(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_json(cls, path_or_text: str | Path) -> "Profile":
        text = str(path_or_text)
        try:
            if not text.lstrip().startswith("{"):
                text = Path(path_or_text).read_text()
            data = json.loads(text)
        except (OSError, json.JSONDecodeError) as exc:
            raise AutohybridError(f"cannot read calibration profile {str(path_or_text)[:80]!r}: "
                                  f"{exc}; give a file `autohybrid calibrate --out` wrote"
                                  ) from exc
        if not isinstance(data, dict):
            raise AutohybridError("a calibration profile is a JSON object; give a file "
                                  "`autohybrid calibrate --out` wrote")
        if data.get("version") != PROFILE_VERSION:
            raise AutohybridError(f"calibration profile version {data.get('version')!r} is not "
                                  f"{PROFILE_VERSION}; run `autohybrid calibrate` again")
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise AutohybridError(f"unknown field {sorted(unknown)[0]!r} in calibration profile")
        return cls(**data)

    def apply(self, cluster: Cluster) -> Cluster:
        """`cluster` with the measured figures (peak = measured / the model's efficiency)."""
        peaks = dict(cluster.device.peak_flops)
        for dtype, flops in self.matmul_flops.items():
            peaks[dtype] = flops / MATMUL_EFFICIENCY
        device = replace(cluster.device, peak_flops=peaks,
                         memory_bandwidth=self.memory_bandwidth / MEMORY_EFFICIENCY,
                         source=f"calibrated on {self.machine} ({self.hash()})")
        if self.launch_overhead_s is not None:
            device = replace(device, launch_overhead_s=self.launch_overhead_s)
        curves = tuple((dtype, tuple((float(f), rate / self.matmul_flops[dtype])
                                     for f, rate in points))
                       for dtype, points in sorted(self.matmul_curve.items())
                       if points and self.matmul_flops.get(dtype))
        if curves:
            device = replace(device, gemm_curves=curves)
        if self.alone_speedup:   # below 1 is noise: ranks alone are no slower
            device = replace(device, alone_speedup=max(1.0, max(self.alone_speedup.values())))
        out = replace(cluster, device=device)
        if self.all_reduce_latency_s is not None and self.all_reduce_bandwidth is not None:
            link = LinkSpec(name=f"{cluster.intra_link.name}-calibrated",
                            bandwidth=self.all_reduce_bandwidth,
                            latency_s=self.all_reduce_latency_s,
                            source=f"calibrated on {self.machine} ({self.hash()})",
                            collectives=tuple((kind, bandwidth, latency) for kind, (
                                latency, bandwidth) in sorted(self.collectives.items())),
                            hidden=tuple(sorted(self.hidden_share.items())))
            out = replace(out, intra_link=link)
        return out


def _timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def device_time(fn, repeats: int, device: str = "cpu") -> float:
    """Seconds per call of `fn` on `device`: CUDA events on a GPU (`cuda_time`), the host
    clock's median after a warm-up elsewhere (`_timed`)."""
    return cuda_time(fn, repeats) if str(device).startswith("cuda") else _timed(fn, repeats)


def gemm_flops(size: int | Sequence[int]) -> int:
    """FLOPs of one (m, k) @ (k, n) matmul, `size` an int (a square) or (m, k, n)."""
    m, k, n = (size, size, size) if isinstance(size, int) else tuple(size)
    return 2 * m * k * n


def measure_matmul(size: int | Sequence[int], dtype: torch.dtype, repeats: int = 5,
                   device: str = "cpu") -> float:
    """Achieved FLOP/s of an (m, k) @ (k, n) matmul, `size` an int (a square) or (m, k, n).

    On CUDA each timing is CUDA events around several back-to-back matmuls after a
    synchronize (kernels are asynchronous: a host clock around one launch measures the
    launch), the median over `repeats`; on CPU the host clock around as many matmuls as
    fill `CPU_TIMING_WINDOW_S`, the median over `repeats` (a window shorter than the
    scheduler's slice would miss the time a rank waits for a core it shares)."""
    m, k, n = (size, size, size) if isinstance(size, int) else tuple(size)
    flops = gemm_flops(size)
    if device.startswith("cuda"):
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        return flops / device_time(lambda: torch.mm(a, b), repeats, device)
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, n, device=device).to(dtype)
    one = _timed(lambda: torch.mm(a, b), 1)
    inner = max(1, math.ceil(CPU_TIMING_WINDOW_S / max(one, 1e-9)))

    def window() -> None:
        for _ in range(inner):
            torch.mm(a, b)
    return flops * inner / _timed(window, repeats)


def matmul_rate_over(size: int | Sequence[int], dtype: torch.dtype, seconds: float) -> float:
    """FLOP/s of back-to-back CPU matmuls of `size` for a fixed wall-clock window (so
    that ranks started together compute side by side for all of it)."""
    m, k, n = (size, size, size) if isinstance(size, int) else tuple(size)
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    torch.mm(a, b)
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        torch.mm(a, b)
        count += 1
    return gemm_flops(size) * count / elapsed


def cuda_time(fn, repeats: int, inner: int = 10) -> float:
    """Seconds per call of `fn` on the current CUDA device: a warm-up, then per repeat
    `inner` calls between two CUDA events (synchronized), the median."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / inner)
    return statistics.median(times)


def measure_bandwidth(numel: int = 1 << 23, repeats: int = 5, device: str = "cpu") -> float:
    """Bytes/s of `out = a + b` on float32 tensors (two reads, one write)."""
    a, b = torch.randn(numel, device=device), torch.randn(numel, device=device)
    out = torch.empty_like(a)
    run = lambda: torch.add(a, b, out=out)  # noqa: E731
    return 3 * 4 * numel / device_time(run, repeats, device)


def measure_launch_overhead(ops: int = 1000, repeats: int = 5, device: str = "cpu") -> float:
    """Seconds per op of a training step besides its FLOPs and bytes, in the cost model's
    unit (a forward op's share; its backward is charged twice that): forward and backward
    of `ops` one-element multiplies recorded by autograd, over 3 · `ops`."""
    a = torch.zeros(1, device=device, requires_grad=True)
    b = torch.ones(1, device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def run():
        x = a
        for _ in range(ops):
            x = torch.mul(x, b)
        x.backward()
        sync()
    return _timed(run, repeats) / (3 * ops)


#: T(n) = a·α + b·n·β of each collective kind on p ranks: (a, b), as the cost model
#: prices them
FORMULAS = comm.COEFFICIENTS


def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float], ranks: int,
                   kind: str = "all_reduce") -> tuple[float, float]:
    """α, β of collective `kind`'s T(n) (`FORMULAS`; the all-reduce's 2(p−1)α +
    2(p−1)/p · n · β by default), fitted on relative errors (both ≥ 0).

    Why relative: the sizes span three decades, and in an absolute least-squares fit the
    noise of the largest message (milliseconds on a busy machine) swamps the smallest
    one's time, so the intercept α came out negative (reported as 0) under load. Each
    point weighted by 1/T² keeps the latency-dominated small messages in the fit; exact
    data give the same α, β either way. Where noise still makes the intercept ≤ 0, the
    smallest message's whole time bounds the latency from above and is what α reports;
    where it makes the slope ≤ 0 (seen under load: a kind's larger messages timed no
    slower), the largest message's whole time per byte bounds β from above likewise."""
    c, per_byte = FORMULAS[kind](ranks)
    xs = [per_byte * n for n in sizes]
    weights = [1.0 / (t * t) if t > 0 else 0.0 for t in times]
    sw = sum(weights)
    if not sw:
        return 0.0, 0.0
    sx = sum(w * x for w, x in zip(weights, xs))
    st = sum(w * t for w, t in zip(weights, times))
    sxx = sum(w * x * x for w, x in zip(weights, xs))
    sxt = sum(w * x * t for w, x, t in zip(weights, xs, times))
    det = sw * sxx - sx * sx
    beta = max((sw * sxt - sx * st) / det if det else 0.0, 0.0)
    smallest = min(range(len(xs)), key=xs.__getitem__)
    if beta <= 0 and xs[smallest] < max(xs):
        # noise hid the growth with size (the larger messages no slower): the largest
        # message's whole time per byte bounds β from above, as the smallest's bounds α
        largest = max(range(len(xs)), key=xs.__getitem__)
        return times[smallest] / c, times[largest] / xs[largest]
    intercept = (st - beta * sx) / sw
    if intercept <= 0:
        intercept = times[smallest]
    return intercept / c, beta


def _rank_device(device: str) -> torch.device:
    """This rank's device of type `device` (cuda: the current one, set by the launch)."""
    return torch.device("cuda", torch.cuda.current_device()) if device == "cuda" \
        else torch.device(device)


def _time_all_reduce(sizes: Sequence[int], repeats: int, device: str = "cpu") -> list[float]:
    """Seconds per all-reduce of each size, on `device` (NCCL takes CUDA tensors only),
    the device synchronized after each so the time is the collective's, not its launch."""
    out = []
    for nbytes in sizes:
        t = torch.zeros(nbytes // 4, device=device)

        def run():
            dist.all_reduce(t)
            if t.is_cuda:
                torch.cuda.synchronize(t.device)
        dist.barrier()
        out.append(_timed(run, repeats))
    return out


def _collective(kind: str, nbytes: int, world: int, device: torch.device,
                async_op: bool = False) -> Callable:
    """One call of collective `kind` moving `nbytes` (the whole tensor: all-reduced, the
    gathered output, the scattered input, the message sent), the device synchronized
    after it; `async_op`: a call that starts it and returns its wait."""
    numel = max(world, nbytes // 4 // world * world)
    whole = torch.zeros(numel, device=device)
    part = torch.zeros(numel // world, device=device)
    rank = dist.get_rank()
    peer = rank ^ 1  # send_recv: ranks in pairs, the even one sends (a pipeline's hop)
    received = torch.zeros_like(whole) if kind == "all_to_all" else None
    run = {"all_reduce": lambda: dist.all_reduce(whole, async_op=async_op),
           "all_gather": lambda: all_gather_single(whole, part, async_op=async_op),
           # as the runtime's gradient reduce-scatters run (on gloo: an all-reduce)
           "reduce_scatter": lambda: reduce_scatter_single(part, whole, async_op=async_op,
                                                           input_scratch=True),
           # expert parallelism's dispatch (ops/moe.py): `whole` split equally over ranks
           "all_to_all": lambda: dist.all_to_all_single(received, whole, async_op=async_op),
           "send_recv": (lambda: None) if peer >= world else
           (lambda: dist.isend(whole, peer)) if rank % 2 == 0 else
           (lambda: dist.irecv(whole, peer))}[kind]

    def synchronized():
        if whole.is_cuda:
            torch.cuda.synchronize(whole.device)

    def call():
        work = run()
        if kind == "send_recv" and work is not None:
            work.wait()
        synchronized()

    def start():
        work = run()
        return lambda: (work.wait() if work is not None else None, synchronized())
    return start if async_op else call


def _time_in_context(sizes: Sequence[int], repeats: int, device: torch.device
                     ) -> dict[str, list[float]]:
    """Seconds per collective of each kind and size as training runs it (see the module
    docstring): the median over `repeats` of (a loop with it − the same loop without,
    run next) / iterations, all ranks together; on CUDA no compute in between (the
    collective alone)."""
    world = dist.get_world_size()
    if device.type == "cuda":
        compute = lambda: None  # noqa: E731
    else:
        m, k, n = CONTEXT_MATMUL
        a, b = torch.randn(m, k), torch.randn(k, n)

        def compute():
            for _ in range(2):
                torch.mm(a, b)

    def loop(op: Callable | None, started: Callable | None = None) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(CONTEXT_ITERATIONS):
            wait = started() if started is not None else None
            compute()
            if op is not None:
                op()
            if wait is not None:
                wait()
        return time.perf_counter() - start

    def extra(op: Callable | None, started: Callable | None = None) -> float:
        # each loop with the collective beside one without: drift falls on both
        diffs = [loop(op, started) - loop(None) for _ in range(repeats)]
        return max(statistics.median(diffs) / CONTEXT_ITERATIONS, 1e-7)

    out: dict[str, Any] = {}
    for kind in COLLECTIVE_KINDS:
        out[kind] = []
        for nbytes in sizes:
            op = _collective(kind, nbytes, world, device)
            op()  # warm-up: the first call of a kind and size sets its buffers up
            out[kind].append(extra(op))
    if device.type != "cuda":  # (on CUDA NCCL's own stream overlaps: not measured here)
        nbytes = max(sizes)
        out["overlap"] = {kind: (out[kind][list(sizes).index(nbytes)],
                                 extra(None, _collective(kind, nbytes, world, device, True)))
                          for kind in OVERLAPPED_KINDS}
    return out


def _measure(rank: int, matmul_sizes: Sequence, dtypes: Sequence[torch.dtype],
             repeats: int, all_reduce_sizes: Sequence[int], device: str) -> dict:
    """One rank's figures; all ranks measure at once, as they will train (contention)."""
    def together(fn):  # every rank starts the measurement at once: ranks sharing cores
        if dist.is_initialized():  # are measured sharing them
            dist.barrier()
        return fn()

    rates = {str(d).removeprefix("torch."): [
        together(lambda: measure_matmul(s, d, repeats, device)) for s in matmul_sizes]
        for d in dtypes}
    alone = None
    if device == "cpu" and dist.is_initialized() and dist.get_world_size() > 1:
        alone = {}
        for d in dtypes:
            name = str(d).removeprefix("torch.")
            size = matmul_sizes[max(range(len(matmul_sizes)), key=rates[name].__getitem__)]
            # every rank busy for the same window (none done early, leaving a core to the
            # rest), then rank 0 alone while the others wait in a barrier (blocked, not
            # spinning): its rate when its peers leave it their share of the cores
            beside = together(lambda: matmul_rate_over(size, d, SHARED_WINDOW_S))
            dist.barrier()
            if dist.get_rank() == 0:
                alone[name] = matmul_rate_over(size, d, SHARED_WINDOW_S) / beside
            dist.barrier()
    result = {"rates": rates, "alone": alone,
              "bandwidth": together(lambda: measure_bandwidth(repeats=repeats, device=device)),
              "launch_s": together(lambda: measure_launch_overhead(repeats=repeats,
                                                                   device=device))}
    if dist.is_initialized() and dist.get_world_size() > 1:
        result["all_reduce_s"] = _time_all_reduce(all_reduce_sizes, max(repeats, 20),
                                                  _rank_device(device))
        result["in_context_s"] = _time_in_context(all_reduce_sizes, max(repeats, 3),
                                                  _rank_device(device))
    return result


def calibrate(cluster: Cluster | None = None, *, matmul_sizes: Sequence | None = None,
              dtypes: Sequence[torch.dtype] | None = None, repeats: int = 5,
              all_reduce_sizes: Sequence[int] = ALL_REDUCE_SIZES,
              start_method: str | None = None) -> Profile:
    """Measure this machine, per rank of `cluster` (one process per rank when local;
    `start_method` as for `ah.launch`: None is spawn on CUDA, fork on CPU).

    `matmul_sizes`: ints (squares) or (m, k, n); default `CPU_MATMULS` on CPU,
    `CUDA_MATMULS` on CUDA. `dtypes`: default float32 on CPU, float32 and bfloat16 on CUDA;
    each dtype's figure is its best shape's."""
    device = "cuda" if cluster is not None and cluster.device_type == "cuda" else "cpu"
    on_cuda = device == "cuda"
    if matmul_sizes is None:
        matmul_sizes = CUDA_MATMULS if on_cuda else CPU_MATMULS
    if dtypes is None:
        dtypes = CUDA_DTYPES if on_cuda else (torch.float32,)
    args = (tuple(matmul_sizes), tuple(dtypes), repeats, tuple(all_reduce_sizes), device)
    ranks = 1 if cluster is None else cluster.world_size
    with logs.progress(None, f"calibrating on {ranks} process(es)") as bar:
        if cluster is None or cluster.world_size < 2:
            results = [_measure(0, *args)]
        else:
            from .runtime.launch import launch
            results = launch(_measure, cluster, args=args, start_method=start_method)
        bar.advance()
    # per size the slowest rank's rate; a dtype's figure is its best size's
    curve = {d: sorted([gemm_flops(size), min(r["rates"][d][i] for r in results)]
                       for i, size in enumerate(matmul_sizes)) for d in results[0]["rates"]}
    flops = {d: max(rate for _, rate in points) for d, points in curve.items()}
    speedup = dict(results[0].get("alone") or {})
    profile = Profile(machine=f"{platform.node()} {platform.machine()} {device}",
                      matmul_flops=flops, matmul_curve=curve, alone_speedup=speedup,
                      memory_bandwidth=min(r["bandwidth"] for r in results),
                      world_size=len(results),
                      launch_overhead_s=max(r["launch_s"] for r in results))
    if "all_reduce_s" not in results[0]:
        return profile
    times = [max(r["all_reduce_s"][i] for r in results) for i in range(len(all_reduce_sizes))]
    alpha, beta = fit_alpha_beta(all_reduce_sizes, times, len(results))
    samples = {"all_reduce_bytes": [float(s) for s in all_reduce_sizes], "all_reduce_s": times}
    collectives = {}
    for kind in COLLECTIVE_KINDS:
        kind_times = [max(r["in_context_s"][kind][i] for r in results)
                      for i in range(len(all_reduce_sizes))]
        samples[f"{kind}_in_context_s"] = kind_times
        a, b = fit_alpha_beta(all_reduce_sizes, kind_times, len(results), kind)
        if b > 0:
            collectives[kind] = [a, 1 / b]
    hidden = {}
    for kind in results[0]["in_context_s"].get("overlap", {}):
        blocking = max(r["in_context_s"]["overlap"][kind][0] for r in results)
        started = max(r["in_context_s"]["overlap"][kind][1] for r in results)
        samples[f"{kind}_started_before_compute_s"] = [started]
        hidden[kind] = min(1.0, max(0.0, 1.0 - started / blocking))
    return replace(profile, all_reduce_latency_s=alpha,
                   all_reduce_bandwidth=(1 / beta) if beta > 0 else None,
                   samples=samples, collectives=collectives, hidden_share=hidden)
