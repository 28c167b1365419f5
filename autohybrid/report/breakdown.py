"""Where a training step's time goes: measured per part, beside the cost model's parts.

A measured `Timeline` (runtime/profile.py's `timeline_from_events`) already says, per rank
and step, when the main thread computes (by phase) and when each transfer is in flight.
`step_breakdowns(timeline, ops, rank)` adds what the profiler's op events say about the
compute: `ops` are plain `(name, thread, start_us, end_us)` tuples (`op_events(prof)`),
times on the timeline's clock before its shift (µs from the trace start). Per step:

- `step_s`: the step's span; `waits_s`: the main thread blocked (step minus compute),
  which is exposed communication plus waiting for a slower peer;
- `phases`: compute seconds per phase (forward, backward, after-backward, optimizer);
- `ops`: the non-optimizer compute by what ran: the self time (an event's span minus the
  spans of the events nested in it) of the main thread's ATen ops by category
  (`OP_CATEGORIES`: matmul, attention, copies — copies, concatenations, fills, the
  runtime's bucket packing among them — and other ops: element-wise, reductions, norms,
  views), and `framework`: the rest of the compute, the time between and around ops
  (Python, autograd's engine, hooks, dispatch);
- `comm`: per collective kind (all_reduce, all_gather, reduce_scatter, send, recv,
  broadcast, all_to_all, batch_agreement: the per-step check that every rank passed the
  same batch), `(total_s, exposed_s)`: in flight, and of that not covered by compute
  (hidden = total − exposed).

`median_breakdown` takes the field-wise median over steps, `predicted_parts(prediction)`
gives the cost model's counterparts (compute, hidden and exposed communication,
optimizer update), and `format_breakdown` prints variants side by side. Pure functions
over plain data: no processes, no profiler.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Sequence

from .timeline import STEP_PREFIX, Timeline, clip, subtract, total, union

OpEvent = tuple[str, int, float, float]  # name, thread, start µs, end µs

#: ATen op name (after "aten::") → category, first match wins
OP_CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("_scaled_dot_product", "scaled_dot_product", "_flash_attention",
                   "_efficient_attention", "_cudnn_attention")),
    ("matmul", ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "addmv", "mv",
                "_scaled_mm", "convolution", "_convolution", "conv", "mkldnn_convolution",
                "_slow_conv", "thnn_conv", "cudnn_convolution", "_grouped_mm")),
    ("copies", ("copy_", "cat", "stack", "clone", "_to_copy", "fill_", "zero_",
                "_foreach_copy_", "index_copy", "narrow_copy", "split_with_sizes_copy",
                "contiguous")),
)
OP_ORDER = ("matmul", "attention", "other ops", "copies", "framework")
#: one-word names in the breakdown table
COMM_ORDER = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast",
              "send", "recv", "batch_agreement")


@dataclass(frozen=True)
class StepBreakdown:
    """One step of one rank, in seconds (see the module docstring)."""

    step_s: float
    waits_s: float
    phases: dict[str, float] = field(default_factory=dict)
    ops: dict[str, float] = field(default_factory=dict)
    comm: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def compute_s(self) -> float:
        return sum(self.phases.values())

    @property
    def optimizer_s(self) -> float:
        return self.phases.get("optimizer", 0.0)

    @property
    def exposed_comm_s(self) -> float:
        return sum(e for _, e in self.comm.values())

    @property
    def comm_s(self) -> float:
        return sum(t for t, _ in self.comm.values())

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["comm"] = {k: {"total_s": t, "exposed_s": e} for k, (t, e) in self.comm.items()}
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "StepBreakdown":
        return cls(data["step_s"], data["waits_s"], dict(data["phases"]), dict(data["ops"]),
                   {k: (v["total_s"], v["exposed_s"]) for k, v in data["comm"].items()})


def category(op: str) -> str:
    """'aten::addmm' → 'matmul'; attention kernels by prefix (they carry backend
    suffixes), the rest by exact name; an op no category names is 'other ops'."""
    name = op.removeprefix("aten::")
    for cat, names in OP_CATEGORIES:
        if name in names or (cat == "attention" and name.startswith(names)):
            return cat
    return "other ops"


def op_events(events: Iterable[Any]) -> list[OpEvent]:
    """The host-side events of `prof.events()` as plain `(name, thread, start_us, end_us)`."""
    out = []
    for e in events:
        if str(getattr(e, "device_type", "CPU")).upper().endswith("CUDA"):
            continue
        out.append((e.name, int(e.thread), float(e.time_range.start),
                    float(e.time_range.end)))
    return out


def _self_times(ops: Sequence[OpEvent]) -> list[tuple[str, float, float]]:
    """(name, start, self µs) of each event of one thread: its span minus its children's."""
    ordered = sorted(ops, key=lambda e: (e[2], -e[3]))
    selfs = [e[3] - e[2] for e in ordered]
    stack: list[int] = []
    for i, (_, _, start, end) in enumerate(ordered):
        while stack and ordered[stack[-1]][3] <= start:
            stack.pop()
        if stack:
            selfs[stack[-1]] -= end - start
        stack.append(i)
    return [(e[0], e[2], max(0.0, s)) for e, s in zip(ordered, selfs)]


def step_breakdowns(timeline: Timeline, ops: Sequence[OpEvent], rank: int) -> list[StepBreakdown]:
    """Every step of `rank` in `timeline` (measured, unshifted: `ops` share its clock)."""
    origin = timeline.meta.get("trace_start_s", 0.0)
    to_us = lambda s: (s - origin) * 1e6  # noqa: E731
    steps = [iv for iv in timeline.ranks.get(rank, []) if iv.kind == "step"]
    step_ops = [e for e in ops if e[0].startswith(STEP_PREFIX)]
    main = min(step_ops, key=lambda e: e[2])[1] if step_ops else None
    mine = [e for e in ops if e[1] == main and not e[0].startswith(STEP_PREFIX)
            and not e[0].startswith("gloo:")]
    selfs = _self_times(mine)
    optimizer = union((e[2], e[3]) for e in mine if e[0].startswith("Optimizer."))
    out = []
    for span in steps:
        k, lo, hi = span.step, span.start_s, span.end_s
        compute = [iv for iv in timeline.ranks[rank] if iv.kind == "compute" and iv.step == k]
        busy = union(clip((iv.start_s, iv.end_s), lo, hi) for iv in compute)
        phases = {phase: total(union(clip((iv.start_s, iv.end_s), lo, hi)
                                     for iv in compute if iv.phase == phase))
                  for phase in dict.fromkeys(iv.phase for iv in compute)}
        lo_us, hi_us = to_us(lo), to_us(hi)
        cats = {c: 0.0 for c in OP_ORDER}
        for name, start, self_us in selfs:
            if not name.startswith("aten::") or not lo_us <= start <= hi_us:
                continue
            if any(a <= start <= b for a, b in optimizer):
                continue
            cats[category(name)] += self_us / 1e6
        work = sum(v for p, v in phases.items() if p != "optimizer")
        cats["framework"] = max(0.0, work - sum(cats.values()))
        comm: dict[str, tuple[float, float]] = {}
        kinds = sorted({iv.name for iv in timeline.ranks[rank]
                        if iv.kind == "communication" and iv.step == k})
        for kind in kinds:
            spans = union(clip((iv.start_s, iv.end_s), lo, hi) for iv in timeline.ranks[rank]
                          if iv.kind == "communication" and iv.step == k and iv.name == kind)
            comm[kind] = (total(spans), total(subtract(spans, busy)))
        out.append(StepBreakdown(hi - lo, max(0.0, hi - lo - total(busy)), phases, cats, comm))
    return out


def median_breakdown(steps: Sequence[StepBreakdown]) -> StepBreakdown:
    """The median step (by duration; of an even count, the shorter of the middle two),
    whole: its parts add up as one step's do, which medians taken part by part need not."""
    if not steps:
        raise ValueError("median_breakdown: no steps")
    ordered = sorted(steps, key=lambda s: s.step_s)
    return ordered[(len(ordered) - 1) // 2]


def predicted_parts(prediction: Any) -> dict[str, float]:
    """The cost model's step in the breakdown's terms (plan.py `Prediction`): compute
    (bubble included), communication hidden and exposed, and the optimizer update (what
    the pricing adds after them: step − compute − exposed)."""
    step, compute = prediction.step_time_s, prediction.compute_s
    exposed, comm = prediction.exposed_comm_s, prediction.comm_s
    return {"step_s": step, "compute_s": compute, "exposed_comm_s": exposed,
            "hidden_comm_s": max(0.0, comm - exposed),
            "optimizer_s": max(0.0, step - compute - exposed)}


def format_breakdown(rows: Sequence[tuple[str, StepBreakdown | None]],
                     predicted: dict[str, float] | None = None) -> str:
    """A table, one column per variant (ms), the prediction's parts in a last column."""
    present = [(n, b) for n, b in rows if b is not None]
    comm_kinds = [k for k in COMM_ORDER if any(k in b.comm for _, b in present)]
    comm_kinds += sorted({k for _, b in present for k in b.comm} - set(comm_kinds))
    phases = [p for p in ("forward", "backward", "after-backward")
              if any(p in b.phases for _, b in present)]
    lines: list[tuple[str, list[str], str]] = []
    ms = lambda s: f"{s * 1e3:.2f}"  # noqa: E731
    pred = predicted or {}
    pms = lambda key: ms(pred[key]) if key in pred else ""  # noqa: E731
    lines.append(("step", [ms(b.step_s) for _, b in present], pms("step_s")))
    lines.append(("compute (main thread)", [ms(b.compute_s - b.optimizer_s) for _, b in present],
                  pms("compute_s")))
    for p in phases:
        lines.append((f"  {p}", [ms(b.phases.get(p, 0.0)) for _, b in present], ""))
    for c in OP_ORDER:
        lines.append((f"  {c}", [ms(b.ops.get(c, 0.0)) for _, b in present], ""))
    lines.append(("optimizer", [ms(b.optimizer_s) for _, b in present], pms("optimizer_s")))
    lines.append(("blocked (waits)", [ms(b.waits_s) for _, b in present], ""))
    lines.append(("communication exposed", [ms(b.exposed_comm_s) for _, b in present],
                  pms("exposed_comm_s")))
    hidden = [ms(b.comm_s - b.exposed_comm_s) for _, b in present]
    lines.append(("communication hidden", hidden, pms("hidden_comm_s")))
    for k in comm_kinds:
        cells = []
        for _, b in present:
            t, e = b.comm.get(k, (0.0, 0.0))
            cells.append(f"{ms(e)}/{ms(t - e)}" if k in b.comm else "—")
        lines.append((f"  {k} exposed/hidden", cells, ""))
    names = [n for n, _ in present]
    width = max(len(label) for label, _, _ in lines)
    cols = [max(len(n), *(len(cells[i]) for _, cells, _ in lines)) for i, n in enumerate(names)]
    pcol = max(len("predicted"), *(len(p) for _, _, p in lines))
    head = "ms".ljust(width) + "  " + "  ".join(n.rjust(w) for n, w in zip(names, cols))
    head += "  " + "predicted".rjust(pcol) if predicted else ""
    out = [head, "─" * len(head)]
    for label, cells, p in lines:
        line = label.ljust(width) + "  " + "  ".join(c.rjust(w) for c, w in zip(cells, cols))
        out.append(line + ("  " + p.rjust(pcol) if predicted else ""))
    missing = [n for n, b in rows if b is None]
    if missing:
        out.append("no breakdown: " + ", ".join(missing))
    return "\n".join(out)
