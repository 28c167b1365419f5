"""Per-rank timelines of compute and communication: measured, predicted, Chrome trace.

A `Timeline` maps each rank to a list of `Interval(kind, name, start_s, end_s, step)`:

- kind "step": one per step and rank, the step's boundaries;
- kind "compute": the rank's main thread working (not blocked in a collective), tagged
  with its `phase` ("forward", "backward", "after-backward", "optimizer");
- kind "communication": a collective or point-to-point transfer in flight, from its issue
  to its completion, tagged with the phase it was issued in.

Times are seconds from the timeline's origin (the earliest step start over all ranks).
`Timeline.summary(rank, step)` does the interval arithmetic: total communication (the
union of the communication intervals), exposed communication (the part of it not covered
by the rank's compute intervals) and compute time.

Two sources fill it: `runtime/profile.py` measures one from `torch.profiler` events
(`profile_steps`, `compiled.profile`), and `predicted_timeline(plan)` draws the cost
model's prediction in the same classes. `to_chrome_trace` / `write_chrome_trace` export
either (or both, side by side) as Chrome Trace Event Format JSON, which opens in
chrome://tracing and https://ui.perfetto.dev.

What the predicted timeline contains (only what `Plan.predicted` says, plus the order of
the schedule): the prediction gives totals per step, not a placement of every op, so

- the compute phase of every rank is `predicted.compute_s` long (it includes the pipeline
  bubble, as the prediction's compute does); the busy part, `compute_s × (1 −
  bubble_fraction)`, is split evenly over the microbatches (and over the v stages a rank
  runs), a microbatch's slot drawn 1/3 forward, 2/3 backward (the FLOP ratio of a
  matmul-heavy layer; the prediction does not split them; zero-bubble schedules split the
  backward into equal input- and weight-gradient halves, as the pricing's t_w = t_b / 2);
- with pp > 1 the slots follow the schedule's order (torch.distributed.pipelining's order
  for the looped and V-shaped schedules, the runtime's for GPipe and 1F1B), placed by a
  dependency simulation with instant transfers, then scaled so that the longest rank
  lasts `compute_s` (`meta["schedule_scale"]` records that factor: 1 where the schedule's
  simulated bubble equals the pricing's formula);
- communication the prediction counts as hidden (`comm_s − exposed_comm_s`: the dp
  gradient sync overlapping the last backward) is drawn at the end of the rank's last
  compute slots, covered by them; the exposed communication (`exposed_comm_s`: tensor
  parallel collectives, pipeline transfers and the exposed part of the dp sync, which the
  prediction sums without splitting) is one interval after the compute phase, where the
  pricing adds it to the step; the optimizer update is the rest of the step
  (`step_time_s − compute_s − exposed_comm_s`, what the pricing adds last).

So per rank the step lasts `step_time_s`, its communication totals `comm_s` and its
exposed communication `exposed_comm_s`; with pp > 1 and tp > 1 the bubble is taken of
`compute_s` (the prediction folds tp time into the pipeline's per-microbatch time and
does not report it apart).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from ..plan import Plan, stage_ranks

#: the record_function range around each profiled step ("ah::step<k>"): the runtime's
#: profiler opens it (runtime/profile.py, bench.py), the readers of its events find it
STEP_PREFIX = "ah::step"

KINDS = ("step", "compute", "communication")
PHASES = ("forward", "backward", "after-backward", "optimizer")


# ---------------------------------------------------------------------- data classes
@dataclass
class Interval:
    kind: str           # "step" | "compute" | "communication"
    name: str
    start_s: float
    end_s: float
    step: int
    phase: str = ""     # forward | backward | after-backward | optimizer ("" for steps)
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass
class StepSummary:
    """One rank's step by interval arithmetic over its intervals."""

    rank: int
    step: int
    start_s: float
    end_s: float
    compute_s: float          # union of the compute intervals
    comm_s: float             # union of the communication intervals
    exposed_comm_s: float     # communication not covered by compute

    @property
    def step_time_s(self) -> float:
        return self.end_s - self.start_s


@dataclass
class Timeline:
    source: str                                  # "measured" | "predicted"
    ranks: dict[int, list[Interval]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def intervals(self, rank: int, kind: str | None = None, step: int | None = None,
                  phase: str | None = None) -> list[Interval]:
        return [iv for iv in self.ranks.get(rank, ())
                if (kind is None or iv.kind == kind) and (step is None or iv.step == step)
                and (phase is None or iv.phase == phase)]

    def steps(self, rank: int | None = None) -> list[int]:
        ranks = self.ranks if rank is None else [rank]
        return sorted({iv.step for r in ranks for iv in self.ranks.get(r, ())
                       if iv.kind == "step"})

    def summary(self, rank: int, step: int) -> StepSummary:
        spans = self.intervals(rank, "step", step)
        if not spans:
            raise KeyError(f"rank {rank} has no step {step} in this timeline")
        span = spans[0]
        compute = union(clip((iv.start_s, iv.end_s), span.start_s, span.end_s)
                        for iv in self.intervals(rank, "compute", step))
        comm = union(clip((iv.start_s, iv.end_s), span.start_s, span.end_s)
                     for iv in self.intervals(rank, "communication", step))
        return StepSummary(rank, step, span.start_s, span.end_s, total(compute), total(comm),
                           total(subtract(comm, compute)))

    def summaries(self) -> list[StepSummary]:
        return [self.summary(r, s) for r in sorted(self.ranks) for s in self.steps(r)]

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "meta": self.meta,
                "ranks": {str(r): [asdict(iv) for iv in ivs] for r, ivs in self.ranks.items()}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Timeline":
        return cls(data["source"], {int(r): [Interval(**iv) for iv in ivs]
                                    for r, ivs in data["ranks"].items()}, dict(data["meta"]))

    def shifted(self, origin_s: float) -> "Timeline":
        """The same timeline with times measured from `origin_s`."""
        return Timeline(self.source, {r: [_moved(iv, -origin_s) for iv in ivs]
                                      for r, ivs in self.ranks.items()},
                        {**self.meta, "origin_s": self.meta.get("origin_s", 0.0) + origin_s})


def _moved(iv: Interval, by: float) -> Interval:
    return Interval(iv.kind, iv.name, iv.start_s + by, iv.end_s + by, iv.step, iv.phase,
                    dict(iv.args))


def merge(parts: Iterable[Timeline]) -> Timeline:
    """One timeline of several ranks' timelines (same clock), times from the earliest step."""
    parts = list(parts)
    out = Timeline(parts[0].source if parts else "measured")
    for part in parts:
        out.ranks.update(part.ranks)
        for key, value in part.meta.items():
            out.meta.setdefault(key, value)
    starts = [iv.start_s for ivs in out.ranks.values() for iv in ivs if iv.kind == "step"]
    origin = min(starts) if starts else 0.0
    out = out.shifted(origin)
    out.ranks = dict(sorted(out.ranks.items()))
    return out


def gather(local: Timeline, group: Any = None) -> Timeline:
    """Every rank's timeline merged, on every rank (`all_gather_object` over `group`; the
    local one alone without torch.distributed). Every rank of the group must call it."""
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return merge([local])
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, local, group=group)
    return merge(parts)


# ---------------------------------------------------------------------- interval arithmetic
Span = tuple[float, float]


def clip(span: Span, lo: float, hi: float) -> Span:
    return (max(span[0], lo), min(span[1], hi))


def union(spans: Iterable[Span]) -> list[Span]:
    """Sorted, disjoint spans covering the same points (empty spans dropped)."""
    out: list[list[float]] = []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def subtract(spans: Iterable[Span], minus: Iterable[Span]) -> list[Span]:
    """The points of `spans` not in `minus` (both any spans)."""
    cut = union(minus)
    out: list[Span] = []
    for a, b in union(spans):
        for c, d in cut:
            if d <= a or c >= b:
                continue
            if c > a:
                out.append((a, c))
            a = max(a, d)
            if a >= b:
                break
        if a < b:
            out.append((a, b))
    return out


def intersect(spans: Iterable[Span], other: Iterable[Span]) -> list[Span]:
    spans = union(spans)
    return subtract(spans, subtract(spans, other))


def total(spans: Iterable[Span]) -> float:
    return sum(b - a for a, b in union(spans))


# ---------------------------------------------------------------------- Chrome trace
def to_chrome_trace(timeline: Timeline, *others: Timeline) -> dict[str, Any]:
    """The Chrome Trace Event Format of `timeline` (and of `others`, side by side).

    One process per rank (pid = rank; a second timeline's ranks get pid 1000 + rank, a
    third's 2000 + rank, …), named by a `process_name` metadata event ("rank 0", or
    "predicted rank 0" beside a measured one); threads (lanes): tid 0 the steps, tid 1
    compute, tid 2, 3, … communication (intervals that overlap, such as two gradient
    buckets in flight, go to separate lanes). Complete events ("ph": "X") in microseconds.
    """
    events: list[dict[str, Any]] = []
    for index, tl in enumerate((timeline, *others)):
        label = f"{tl.source} " if others else ""
        for rank in sorted(tl.ranks):
            pid = index * 1000 + rank
            events.append(_meta("process_name", pid, 0, {"name": f"{label}rank {rank}"}))
            events.append(_meta("process_sort_index", pid, 0, {"sort_index": pid}))
            lanes = _lanes(tl.ranks[rank])
            names = {0: "steps", 1: "compute"}
            names.update({lane: f"communication {lane - 1}" for lane in set(lanes.values())
                          if lane >= 2})
            for tid, name in sorted(names.items()):
                events.append(_meta("thread_name", pid, tid, {"name": name}))
                events.append(_meta("thread_sort_index", pid, tid, {"sort_index": tid}))
            for i, iv in enumerate(tl.ranks[rank]):
                args = {"step": iv.step, **({"phase": iv.phase} if iv.phase else {}),
                        **{k: _jsonable(v) for k, v in iv.args.items()}}
                events.append({"name": iv.name, "cat": iv.kind, "ph": "X", "pid": pid,
                               "tid": lanes[i], "ts": round(iv.start_s * 1e6, 3),
                               "dur": round(max(0.0, iv.end_s - iv.start_s) * 1e6, 3),
                               "args": args})
    others_meta = {"source": timeline.source,
                   **{k: _jsonable(v) for k, v in timeline.meta.items()}}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": others_meta}


def write_chrome_trace(path: str | Path, timeline: Timeline, *others: Timeline) -> Path:
    """Write `to_chrome_trace(timeline, *others)` as JSON to `path`; returns the path."""
    path = Path(path)
    path.write_text(json.dumps(to_chrome_trace(timeline, *others)))
    return path


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "ts": 0, "dur": 0, "args": args}


def _lanes(intervals: Sequence[Interval]) -> dict[int, int]:
    """tid of each interval (by index): steps 0, compute 1, communication packed greedily
    into lanes 2, 3, … so that no two overlapping intervals share one."""
    out: dict[int, int] = {}
    ends: list[float] = []   # end of the last interval in lane 2 + k
    comm = sorted((iv.start_s, iv.end_s, i) for i, iv in enumerate(intervals)
                  if iv.kind == "communication")
    for start, end, i in comm:
        for k, last in enumerate(ends):
            if last <= start:
                ends[k] = end
                out[i] = 2 + k
                break
        else:
            ends.append(end)
            out[i] = 1 + len(ends)
    for i, iv in enumerate(intervals):
        if i not in out:
            out[i] = 0 if iv.kind == "step" else 1
    return out


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except TypeError:
        return str(value)


# ---------------------------------------------------------------------- predicted
def predicted_timeline(plan: Plan) -> Timeline:
    """The cost model's predicted step of `plan` on every rank, as a `Timeline` (see the
    module docstring for what is drawn and what it assumes)."""
    p = plan.predicted
    mesh, m, v = plan.mesh, plan.num_microbatches, plan.virtual_stages
    compute = max(0.0, p.compute_s)
    exposed = max(0.0, p.exposed_comm_s)
    hidden = max(0.0, p.comm_s - p.exposed_comm_s)
    update = max(0.0, p.step_time_s - compute - exposed)
    busy = compute * (1.0 - p.bubble_fraction)
    per_micro = busy / m if m else 0.0
    slots, scale = _schedule_slots(plan.schedule, mesh.pp, v, m, per_micro, compute)
    parts = _exposed_parts(plan)
    timeline = Timeline("predicted", meta={
        "plan": plan.summary(), "schedule": plan.schedule, "schedule_scale": scale,
        "predicted": {"step_time_s": p.step_time_s, "compute_s": p.compute_s,
                      "comm_s": p.comm_s, "exposed_comm_s": p.exposed_comm_s,
                      "bubble_fraction": p.bubble_fraction},
        "optimizer_update_s": update})
    for rank in range(mesh.world_size):
        pp_rank = mesh.coords(rank)[0]
        ivs = [Interval("step", "step 0", 0.0, update + compute + exposed, 0)]
        mine = slots[pp_rank]
        for kind, stage, micro, start, end in mine:
            phase = "forward" if kind == "F" else "backward"
            name = {"F": "forward", "B": "backward", "I": "backward (input grad)",
                    "W": "backward (weight grad)"}[kind]
            ivs.append(Interval("compute", f"{name} mb{micro}" + (f" stage {stage}"
                                                                  if mesh.pp > 1 else ""),
                                start, end, 0, phase, {"microbatch": micro, "stage": stage}))
        if hidden > 0:
            ivs += _hidden_sync(mine, hidden)
        if exposed > 0:
            ivs.append(Interval("communication", "exposed communication", compute,
                                compute + exposed, 0, "after-backward",
                                {"contains": parts}))
        if update > 0:
            ivs.append(Interval("compute", "optimizer update", compute + exposed,
                                compute + exposed + update, 0, "optimizer"))
        timeline.ranks[rank] = ivs
    return timeline


def _exposed_parts(plan: Plan) -> str:
    parts = []
    if plan.mesh.tp > 1:
        parts.append("tensor-parallel collectives")
    if plan.mesh.pp > 1:
        parts.append("pipeline sends")
    if plan.mesh.dp > 1:
        parts.append("dp gradient sync (exposed part)")
        if plan.zero in (1, 2):
            parts.append("ZeRO parameter all-gather")
    return ", ".join(parts) or "none"


def _hidden_sync(slots: list[tuple], hidden: float) -> list[Interval]:
    """The hidden part of the dp gradient sync, laid backwards from the end of the rank's
    last compute slot over its compute slots (so compute covers it)."""
    out: list[Interval] = []
    left = hidden
    spans = union((s[3], s[4]) for s in slots)
    for start, end in reversed(spans):
        if left <= 0:
            break
        take = min(left, end - start)
        out.append(Interval("communication", "dp gradient sync (hidden part)", end - take,
                            end, 0, "backward"))
        left -= take
    return out[::-1]


# ---------------------------------------------------------------------- schedule order
Action = tuple[str, int, int]     # (kind F/B/I/W, stage, microbatch)


def schedule_order(schedule: str, pp: int, virtual_stages: int,
                   num_microbatches: int) -> dict[int, list[Action]]:
    """The compute actions each pp rank runs, in order.

    pp = 1: forward and backward of each microbatch in turn (the executor's loop). GPipe:
    all forwards, then all backwards; 1F1B: min(m, pp − rank) forwards, then one backward
    and one forward while forwards remain, then the backwards left (torch's runtime
    `_step_microbatches`). The looped and V-shaped schedules: the order torch's schedule
    classes compute (`_calculate_single_rank_operations`), idle steps dropped and a
    DualPipeV overlapped forward-backward pair taken as its two actions in turn.
    """
    p, v, m = pp, virtual_stages, num_microbatches
    if p == 1:
        return {0: [a for i in range(m) for a in (("F", 0, i), ("B", 0, i))]}
    if schedule == "gpipe":
        return {r: [("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)]
                for r in range(p)}
    if schedule == "1f1b":
        out = {}
        for r in range(p):
            warm = min(m, p - r)
            acts: list[Action] = [("F", r, i) for i in range(warm)]
            f = warm
            for b in range(m):
                acts.append(("B", r, b))
                if f < m:
                    acts.append(("F", r, f))
                    f += 1
            out[r] = acts
        return out
    return _torch_order(schedule, p, v, m)


def _torch_order(schedule: str, p: int, v: int, m: int) -> dict[int, list[Action]]:
    from torch.distributed.pipelining import schedules as tps
    classes = {"interleaved": tps.ScheduleInterleaved1F1B, "looped-bfs": tps.ScheduleLoopedBFS,
               "zero-bubble": tps.ScheduleInterleavedZeroBubble,
               "zbv": tps.ScheduleZBVZeroBubble, "dualpipev": tps.ScheduleDualPipeV}
    cls = classes[schedule]
    # the order is computed from these attributes only; no stage or process group is needed
    obj = cls.__new__(cls)
    rounds = max(1, m // p)
    obj.__dict__.update(
        pp_group_size=p, n_local_stages=v, _n_microbatches=m, _num_stages=p * v,
        num_stages=p * v, _stages=[None] * v, rank=0, pipeline_order={},
        number_of_rounds=rounds, microbatches_per_round=m // rounds,
        stage_index_to_group_rank=dict(enumerate(stage_ranks(schedule, p, v))))
    order = {r: cls._calculate_single_rank_operations(obj, r) for r in range(p)}
    if schedule == "zero-bubble":
        obj.pipeline_order = order
        order = cls._add_bubbles_to_actions(obj, v)
    out: dict[int, list[Action]] = {}
    for r in range(p):
        acts: list[Action] = []
        for action in order[r]:
            if action is None:
                continue
            for a in (action.sub_actions or (action,)):
                kind = a.computation_type.value
                if kind in ("F", "B", "I", "W"):
                    acts.append((kind, a.stage_index, a.microbatch_index))
        out[r] = acts
    return out


def _schedule_slots(schedule: str, pp: int, v: int, m: int, per_micro: float,
                    span: float) -> tuple[dict[int, list[tuple]], float]:
    """Each pp rank's compute slots (kind, stage, microbatch, start, end) of the schedule's
    order with the given busy time per microbatch, simulated with instant transfers and
    scaled so that the longest rank ends at `span`; and that scale factor."""
    order = schedule_order(schedule, pp, v, m)
    stages = pp * v if pp > 1 else 1
    unit = per_micro / (3 * (v if pp > 1 else 1))
    length = {"F": unit, "B": 2 * unit, "I": unit, "W": unit}
    done: dict[tuple[str, int, int], float] = {}
    slots: dict[int, list[tuple]] = {r: [] for r in order}
    nxt = {r: 0 for r in order}
    free = {r: 0.0 for r in order}
    remaining = sum(len(a) for a in order.values())
    while remaining:
        progressed = False
        for r, acts in order.items():
            while nxt[r] < len(acts):
                kind, s, i = acts[nxt[r]]
                deps = _deps(kind, s, i, stages)
                if any(d not in done for d in deps):
                    break
                start = max([free[r], *(done[d] for d in deps)])
                end = start + length[kind]
                done[(kind, s, i)] = end
                if kind in ("B", "I"):  # either satisfies the previous stage's dependency
                    done[("grad", s, i)] = end
                slots[r].append((kind, s, i, start, end))
                free[r] = end
                nxt[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError(f"schedule {schedule!r} (pp={pp}, v={v}, m={m}): the order "
                             "deadlocks in the simulation")
    longest = max((sl[-1][4] for sl in slots.values() if sl), default=0.0)
    scale = span / longest if longest > 0 else 1.0
    scaled = {r: [(k, s, i, a * scale, b * scale) for k, s, i, a, b in sl]
              for r, sl in slots.items()}
    return scaled, scale


def _deps(kind: str, stage: int, micro: int, stages: int) -> list[tuple[str, int, int]]:
    if kind == "F":
        return [("F", stage - 1, micro)] if stage > 0 else []
    if kind == "W":
        return [("grad", stage, micro)]
    deps = [("F", stage, micro)]
    if stage < stages - 1:
        deps.append(("grad", stage + 1, micro))
    return deps
