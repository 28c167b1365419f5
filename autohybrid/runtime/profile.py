"""Measured per-rank timelines: training steps under `torch.profiler`, as a `Timeline`.

`profile_steps(compiled, batches, steps)` runs real training steps (`train_step`: the model
trains) under `torch.profiler.profile` (CPU activity) on every rank, each step inside a
`record_function("ah::step<k>")` range, and turns the profiler's events into plain data
(report/timeline.py): per step and rank, the step's span, compute intervals of the main
thread by phase, and communication intervals from issue to completion. Every rank gets
every rank's timeline (`all_gather_object`); `compiled.profile(...)` is the same call.

What torch 2.13 (CPU build, gloo) records for communication, seen by experiment:

- a collective (`all_reduce`, `all_gather_into_tensor`, `reduce_scatter_tensor`, …) is
  an op event on the thread that issues it, `c10d::allreduce_`, `c10d::_allgather_base_`,
  `c10d::_reduce_scatter_base_`, `c10d::broadcast_`, … lasting while the call enqueues
  the work (async or not), and a `gloo:<op>` event on one of gloo's worker threads
  (`gloo:all_reduce`, `gloo:all_gather`; a reduce-scatter shows as `gloo:all_reduce`)
  spanning the transfer itself, from when a worker picks the work up to its completion;
  the worker's own ops (copies into the output) nest under it;
- point-to-point `send` / `recv` (pipeline stages) are `c10d::send` / `c10d::recv_` on
  the issuing thread, then a `gloo:send` / `gloo:recv` event on that same thread from
  issue to completion (an asynchronous range: it overlaps later ops of the thread);
- `Work.wait()` (and the wait inside a synchronous collective) records nothing: the
  issuing thread just has no events until the collective completes. No
  `record_param_comms` or `ProcessGroup*` events appear on this build.

The check that every rank passed the same batch (runtime/batch_agreement.py: one small
all-gather at the start of each step) runs inside an `ah::batch_agreement` range and its
interval is named "batch_agreement"; the large all-gathers, which run on gloo as one
broadcast per rank (ops/groups.all_gather_single), inside an `ah::all_gather` range, and
their intervals are named "all_gather".

So a communication interval is a `c10d::` issue matched to its `gloo:` event (in issue
order, a collective with a collective, a send with a send), from the issue's start to the
transfer's end; an unmatched one stands alone. The bucket all-reduces the dp reducer
launches during backward (runtime/reducer.py, `async_op=True`) thus span from their issue
inside the backward to their completion on the worker thread.

Compute is the main thread (the one running `train_step`) not blocked in communication:
the step minus the `c10d::` calls and minus the waits, a wait being a gap between the
thread's innermost op events in which a transfer completes (the thread resumed when a
collective it waited on finished). Gaps without a completion (Python between ops) count
as compute; so a transfer that happens to complete during such a gap makes that gap
count as a wait (a few microseconds of Python). Phases come from the events: backward is
a run of `autograd::engine::evaluate_function` events (on CPU autograd runs on the
calling thread), optimizer an `Optimizer.step`/`Optimizer.zero_grad` event, forward the
compute before a backward, after-backward the rest (loss and gradient sums, scaling).
Exposed communication per step is then the communication time not covered by compute
(`Timeline.summary`).

On CUDA (the compiled model's device, or `activities` given) the profiler also records
device events (`ProfilerActivity.CUDA`): kernels with their stream, NCCL's transfers
among them as `ncclDevKernel_*` kernels on NCCL's stream (report/device_events.py sorts
them: a pure function over `(name, device, stream, start, end)` tuples). Where a step has
device kernels, its compute intervals are the compute kernels and its communication
intervals the NCCL kernels (phase: the host phase when the kernel started, an
approximation since kernels lag their launch), the step span reaches the last kernel,
and the exposed communication (`Timeline.summary`) is NCCL kernel time not overlapped by
compute kernels on other streams. A kernel belongs to the step its start falls in (from
one step range's start to the next one's).

Times are the profiler's, on the kineto trace clock (epoch nanoseconds), the same clock
in every process of a machine; across machines they are as close as the clocks are.
"""
from __future__ import annotations

import bisect
import time
from collections import deque
from typing import Any, Sequence

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from ..errors import AutohybridError
from ..report.device_events import DeviceEvent, classify_device_events, comm_op
from ..report.timeline import (STEP_PREFIX, Interval, Timeline, gather, merge, subtract,
                               union)
from ..ops.groups import GATHER_RANGE
from .batch_agreement import AGREEMENT_RANGE

_P2P = {"send", "recv"}
_EPS_US = 1.0


def profile_steps(compiled: Any, batches: Sequence[Any], steps: int | None = None, *,
                  warmup: int = 1, gather_ranks: bool = True,
                  torch_trace_dir: str | None = None, **step_kwargs: Any) -> Timeline:
    """Run `warmup` unprofiled then `steps` profiled `compiled.train_step`s on `batches`
    (a sequence of `(inputs, targets)`, cycled; `steps` defaults to its length) and return
    the measured `Timeline` of every rank (this rank's alone with `gather_ranks=False`).

    Call it on every rank, like `train_step`. `torch_trace_dir`: also write torch's own
    op-level trace of each rank there (`rank<r>.torch_trace.json`). `step_kwargs` go to
    `train_step` (e.g. `max_grad_norm`).
    """
    batches = list(batches)
    if not batches:
        raise AutohybridError("profile_steps: give at least one (inputs, targets) batch")
    steps = len(batches) if steps is None else steps
    if steps < 1 or warmup < 0:
        raise AutohybridError(f"profile_steps: steps must be ≥ 1 and warmup ≥ 0, got "
                              f"steps={steps}, warmup={warmup}")
    for j in range(warmup):
        _step(compiled, batches[j % len(batches)], step_kwargs)
    losses: list[float] = []
    with profile(activities=activities_for(compiled)) as prof:
        for k in range(steps):
            with record_function(f"{STEP_PREFIX}{k}"):
                loss = _step(compiled, batches[k % len(batches)], step_kwargs)
            losses.append(float(loss))
    rank = getattr(compiled, "rank", 0)
    if torch_trace_dir is not None:
        from pathlib import Path
        Path(torch_trace_dir).mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(Path(torch_trace_dir) / f"rank{rank}.torch_trace.json"))
    local = timeline_from_events(prof.events(), rank, _trace_start_s(prof), losses)
    plan = getattr(compiled, "plan", None)
    if plan is not None:
        local.meta.update(plan=plan.summary(), world_size=plan.world_size)
    return gather(local) if gather_ranks else merge([local])


def activities_for(compiled: Any) -> list[ProfilerActivity]:
    """CPU, plus CUDA where `compiled` runs on a CUDA device."""
    device = getattr(compiled, "device", None)
    on_cuda = getattr(device, "type", str(device or "")).startswith("cuda")
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])


def device_events(events: Sequence[Any]) -> list[DeviceEvent]:
    """The device-side (CUDA) kernels among profiler events as plain tuples
    `(name, "cuda", stream, start_us, end_us)`; record_function ranges mirrored onto the
    device timeline (user annotations) are left out."""
    out = []
    for e in events:
        if not str(getattr(e, "device_type", "CPU")).upper().endswith("CUDA"):
            continue
        if getattr(e, "is_user_annotation", False):
            continue
        stream = getattr(e, "device_resource_id", None)
        stream = e.thread if stream is None else stream
        out.append((e.name, "cuda", int(stream), float(e.time_range.start),
                    float(e.time_range.end)))
    return out


def _step(compiled: Any, batch: Any, kwargs: dict[str, Any]) -> torch.Tensor:
    try:
        inputs, targets = batch
    except (TypeError, ValueError):
        raise AutohybridError("profile_steps: each batch must be a pair (inputs, targets)"
                              ) from None
    return compiled.train_step(inputs, targets, **kwargs)


def _trace_start_s(prof: profile) -> float:
    """The epoch time (s) the profiler's event times count from."""
    results = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if results is not None and hasattr(results, "trace_start_ns"):
        return results.trace_start_ns() / 1e9
    return time.time()  # (older builds: ranks then align only roughly)


# ---------------------------------------------------------------------- events → intervals
class _Ev:
    """What we use of a profiler event (µs relative to the trace start)."""
    __slots__ = ("name", "start", "end", "thread")

    def __init__(self, name: str, start: float, end: float, thread: int):
        self.name, self.start, self.end, self.thread = name, start, end, thread


def timeline_from_events(events: Sequence[Any], rank: int, trace_start_s: float = 0.0,
                         losses: Sequence[float] = ()) -> Timeline:
    """This rank's `Timeline` from `torch.profiler` events (`prof.events()`), whose steps
    are `record_function("ah::step<k>")` ranges (see the module docstring)."""
    kernels = device_events(events)
    evs = [_Ev(e.name, float(e.time_range.start), float(e.time_range.end), e.thread)
           for e in events
           if not str(getattr(e, "device_type", "CPU")).upper().endswith("CUDA")]
    step_evs = sorted((e for e in evs if e.name.startswith(STEP_PREFIX)), key=lambda e: e.start)
    if not step_evs:
        raise AutohybridError("no 'ah::step' ranges among the profiler's events")
    main = step_evs[0].thread
    on_main = sorted((e for e in evs if e.thread == main and not e.name.startswith(STEP_PREFIX)
                      and not e.name.startswith("gloo:")), key=lambda e: (e.start, -e.end))
    transfers = sorted((e for e in evs if e.name.startswith("gloo:")), key=lambda e: e.start)
    issues = [e for e in on_main if e.name.startswith("c10d::")]
    comms = _match(issues, transfers)
    leaves = _leaves(on_main)
    to_s = lambda us: trace_start_s + us / 1e6  # noqa: E731
    out: list[Interval] = []
    for k, step in enumerate(step_evs):
        lo, hi = step.start, step.end
        args = {"loss": losses[k]} if k < len(losses) else {}
        upto = step_evs[k + 1].start if k + 1 < len(step_evs) else float("inf")
        mine_k = [d for d in kernels if lo <= d[3] < upto]
        if mine_k:
            phases = _phases([e for e in on_main if e.start >= lo and e.end <= hi], lo, hi)
            out += _device_step(mine_k, k, lo, hi, args, phases, to_s)
            continue
        out.append(Interval("step", f"step {k}", to_s(lo), to_s(hi), k, "", args))
        inside = lambda e: e.start >= lo and e.end <= hi  # noqa: E731
        mine = [c for c in comms if lo <= c[0] <= hi]
        completions = [c[1] for c in mine]
        calls = union((e.start, e.end) for e in issues if inside(e))
        busy = union((e.start, e.end) for e in leaves if inside(e))
        gaps = subtract([(lo, hi)], busy)
        waits = [g for g in gaps if any(g[0] - _EPS_US <= t <= g[1] + _EPS_US
                                        for t in completions)]
        compute = subtract([(lo, hi)], calls + waits)
        phases = _phases([e for e in on_main if inside(e)], lo, hi)
        for a, b in compute:
            for phase, pa, pb in phases:
                s, t = max(a, pa), min(b, pb)
                if t > s:
                    out.append(Interval("compute", phase, to_s(s), to_s(t), k, phase))
        named = [(e.start, e.end, _RANGE_NAMES[e.name]) for e in on_main
                 if e.name in _RANGE_NAMES and inside(e)]
        for start, end, name, extra in mine:
            end = min(end, hi)
            name = next((as_ for a, b, as_ in named if a <= start <= b), name)
            out.append(Interval("communication", name, to_s(start), to_s(max(start, end)), k,
                                _phase_at(phases, start), extra))
    out.sort(key=lambda iv: (iv.step, iv.start_s, iv.kind != "step"))
    return Timeline("measured", {rank: out}, {"trace_start_s": trace_start_s})


#: ranges whose collectives are named for what they do: the check that every rank
#: passed the same batch (no gradients), and the all-gathers gloo runs as broadcasts
#: (ops/groups.all_gather_single)
_RANGE_NAMES = {AGREEMENT_RANGE: "batch_agreement", GATHER_RANGE: "all_gather"}


def _device_step(kernels: list[DeviceEvent], k: int, lo: float, hi: float, args: dict,
                 phases: list[tuple[str, float, float]], to_s: Any) -> list[Interval]:
    """Step `k`'s intervals from its device kernels (module docstring)."""
    split = classify_device_events(kernels)
    end = max([hi] + [d[4] for d in kernels])
    args = dict(args, device="cuda", exposed_comm_us=round(split.exposed_total, 3))
    out = [Interval("step", f"step {k}", to_s(lo), to_s(end), k, "", args)]
    for a, b in split.compute_spans:
        out.append(Interval("compute", _phase_at(phases, a), to_s(a), to_s(b), k,
                            _phase_at(phases, a)))
    for name, stream, a, b in split.communication:
        out.append(Interval("communication", comm_op(name), to_s(a), to_s(b), k,
                            _phase_at(phases, a), {"kernel": name, "stream": stream}))
    return out


def _op(name: str) -> str:
    """'c10d::_allgather_base_' → 'all_gather'; 'gloo:all_reduce' → 'all_reduce'."""
    op = name.split(":")[-1].strip("_")
    op = op.replace("_base", "").replace("_into_tensor", "").replace("_coalesced", "")
    return {"allreduce": "all_reduce", "allgather": "all_gather", "recv": "recv",
            "reduce_scatter": "reduce_scatter", "alltoall": "all_to_all"}.get(op, op)


def _family(name: str) -> str:
    op = _op(name)
    return op if op in _P2P else "collective"


def _match(issues: list[_Ev], transfers: list[_Ev]) -> list[tuple[float, float, str, dict]]:
    """(start, end, name, args) of each communication: every `gloo:` transfer paired with
    the earliest unpaired `c10d::` issue of its family (p2p by op, collectives together)
    that began before it; what stays unpaired stands alone."""
    pending: dict[str, deque[_Ev]] = {}
    for e in sorted(issues, key=lambda e: e.start):
        pending.setdefault(_family(e.name), deque()).append(e)
    out = []
    for t in transfers:
        queue = pending.get(_family(t.name))
        if queue and queue[0].start <= t.start + _EPS_US:
            issue = queue.popleft()
            out.append((issue.start, max(t.end, issue.end), _op(issue.name),
                        {"issue": issue.name, "transfer": t.name,
                         "queued_us": round(max(0.0, t.start - issue.start), 3)}))
        else:
            out.append((t.start, t.end, _op(t.name), {"transfer": t.name}))
    out += [(e.start, e.end, _op(e.name), {"issue": e.name})
            for queue in pending.values() for e in queue]
    return sorted(out, key=lambda c: (c[0], c[1]))


def _leaves(events: list[_Ev]) -> list[_Ev]:
    """Events with no other event nested in them (`events` sorted by (start, −end), one
    thread: ranges nest properly)."""
    out = []
    for i, e in enumerate(events):
        nxt = events[i + 1] if i + 1 < len(events) else None
        if nxt is None or nxt.start >= e.end or e.end <= e.start:
            out.append(e)
    return out


def _phases(events: list[_Ev], lo: float, hi: float) -> list[tuple[str, float, float]]:
    """[lo, hi] cut into (phase, start, end) pieces from the step's main-thread events."""
    engine = union((e.start, e.end) for e in events
                   if e.name.startswith("autograd::engine::evaluate_function"))
    starts = [a for a, _ in engine]
    forward_ops = sorted(e.start for e in events if e.name.startswith("aten::")
                         and not _within(engine, starts, e.start, e.end))
    runs: list[list[float]] = []     # backward: engine spans with no forward op between
    j = 0
    for a, b in engine:
        split = False
        while j < len(forward_ops) and forward_ops[j] < a:
            split = True
            j += 1
        if runs and not split:
            runs[-1][1] = b
        else:
            runs.append([a, b])
    optimizer = union((e.start, e.end) for e in events if e.name.startswith("Optimizer."))
    last_backward = runs[-1][1] if runs else None
    marks = sorted({lo, hi, *(x for r in runs for x in r), *(x for o in optimizer for x in o)})
    pieces: list[tuple[str, float, float]] = []
    for a, b in zip(marks, marks[1:]):
        if not lo <= a < b <= hi:
            continue
        mid = (a + b) / 2
        if any(s <= mid <= t for s, t in optimizer):
            phase = "optimizer"
        elif any(s <= mid <= t for s, t in runs):
            phase = "backward"
        elif last_backward is None or mid < last_backward:
            phase = "forward"
        else:
            phase = "after-backward"
        if pieces and pieces[-1][0] == phase and pieces[-1][2] == a:
            pieces[-1] = (phase, pieces[-1][1], b)
        else:
            pieces.append((phase, a, b))
    return pieces


def _within(spans: list[tuple[float, float]], starts: list[float], a: float, b: float) -> bool:
    """Whether [a, b] lies inside one of the sorted disjoint `spans`."""
    i = bisect.bisect_right(starts, a) - 1
    return i >= 0 and spans[i][1] >= b


def _phase_at(phases: list[tuple[str, float, float]], t: float) -> str:
    for phase, a, b in phases:
        if a <= t <= b:
            return phase
    return phases[-1][0] if phases else ""
