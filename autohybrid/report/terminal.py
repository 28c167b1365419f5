"""Terminal reports with rich: plan tables, benchmark tables and progress bars.

- `plan_tables(plan)` / `print_plan(plan)`: the plan's decisions and predictions, the
  predicted memory of each pipeline coordinate (the ranks it covers all hold the same) and
  the runner-up plans with why they lost;
- `bench_renderables(result)` / `print_bench(result)`: a benchmark result (the JSON dict
  `autohybrid/bench.py` writes) as one table of variants plus the loss-check line;
- `rich_progress_factory(console)`: progress bars for `logs.set_progress_factory`.

Every printer takes an optional `rich.console.Console`; without one it uses a console on
stdout, which rich turns plain (no escape codes) when stdout is not a terminal.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

from rich import box
from rich.console import Console, RenderableType
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn,
                           TimeElapsedColumn)
from rich.table import Table
from rich.text import Text

from ..plan import MemoryBreakdown, Plan
from .text import experts_text, has_experts_choice

NA = "n/a"
DASH = "—"


# ---------------------------------------------------------------------- formatting
def format_bytes(n: float | None) -> str:
    """Bytes in binary units with three significant figures: 1.50 GiB, 512 B."""
    if n is None:
        return DASH
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{_sig3(value)} {unit}"
        value /= 1024
    return f"{_sig3(value)} TiB"


def format_seconds(s: float | None) -> str:
    """A duration in s, ms or µs with three significant figures."""
    if s is None:
        return DASH
    if abs(s) >= 1:
        return f"{_sig3(s)} s"
    if abs(s) >= 1e-3:
        return f"{_sig3(s * 1e3)} ms"
    return f"{_sig3(s * 1e6)} µs"


def _sig3(x: float) -> str:
    """`x` with three significant figures, trailing zeros kept (5.00, 12.3, 512)."""
    digits = 2 if abs(x) < 10 else 1 if abs(x) < 100 else 0
    return f"{x:.{digits}f}"


def format_ranks(ranks: Iterable[int]) -> str:
    """Ranks as compact ranges: [0, 1, 2, 5] → "0–2, 5"."""
    runs: list[list[int]] = []
    for r in sorted(set(ranks)):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}–{b}" for a, b in runs)


def _percent(fraction: float) -> str:
    """A fraction in percent: one decimal, two significant figures below 0.1 %."""
    if 0 < abs(fraction) < 1e-3:
        return f"{fraction * 100:.2g} %"
    return f"{fraction * 100:.1f} %"


def _console(console: Console | None) -> Console:
    return console if console is not None else Console()


# ---------------------------------------------------------------------- plan
def plan_tables(plan: Plan) -> list[RenderableType]:
    """The plan as rich renderables: summary, memory per pp coordinate, alternatives (the
    last only when the plan has any)."""
    out: list[RenderableType] = [plan_summary_table(plan), memory_table(plan)]
    if plan.alternatives:
        out.append(alternatives_table(plan))
    return out


def print_plan(plan: Plan, console: Console | None = None) -> None:
    """Print `plan_tables(plan)` on `console` (stdout by default)."""
    console = _console(console)
    for renderable in plan_tables(plan):
        console.print(renderable)


def plan_summary_table(plan: Plan) -> Table:
    """Decisions and predicted times of `plan`, one row per topic."""
    table = Table(title=f"plan for {plan.cluster}", show_header=False, title_justify="left")
    table.add_column("topic", style="bold")
    table.add_column("value")
    for key, value in _summary_rows(plan):
        table.add_row(key, value)
    return table


def _summary_rows(plan: Plan) -> list[tuple[str, str]]:
    p, mesh = plan.predicted, plan.mesh
    rows = [
        ("mesh", f"{mesh.describe()} ({plan.world_size} ranks)"),
        ("batch", f"global {plan.global_batch} = dp {mesh.dp} × microbatch "
                  f"{plan.microbatch_size} × {plan.num_microbatches} microbatches"),
        ("dtype", f"{plan.dtype}, optimizer {plan.optimizer}"),
        ("ZeRO", f"stage {plan.zero}"),
        ("recompute", plan.recompute),
        ("schedule", _schedule_text(plan)),
        ("buckets", f"{plan.bucket_mb:g} MB"),
        ("collectives", _collective_text(plan)),
        ("step time", f"{format_seconds(p.step_time_s)} predicted"),
        ("compute", format_seconds(p.compute_s)),
        ("communication", f"{format_seconds(p.comm_s)}, "
                          f"{format_seconds(p.exposed_comm_s)} exposed"),
        ("bubble", _percent(p.bubble_fraction)),
        ("MFU", _percent(p.mfu)),
        ("memory", f"{format_bytes(p.memory.total)} on the most loaded rank of "
                   f"{format_bytes(p.device_memory_bytes)}"),
    ]
    if has_experts_choice(plan):
        rows.append(("experts", experts_text(plan)))
    if not plan.executable:
        rows.append(("NOT EXECUTABLE", "; ".join(plan.not_executable_because)))
    return rows


def _schedule_text(plan: Plan) -> str:
    if plan.mesh.pp == 1:
        return f"{plan.schedule} (no pipeline)"
    text = f"{plan.schedule}, {plan.num_stages} stages ({plan.virtual_stages} per rank)"
    if plan.stage_boundaries:
        text += "; stages start at " + ", ".join(plan.stage_boundaries)
    return text


def _collective_text(plan: Plan) -> str:
    text = f"{plan.collective_algorithm} gradient reduction"
    if plan.grad_reduce_dtype:
        text += f" in {plan.grad_reduce_dtype}"
    if plan.collective_matmul:
        text += f"; collective matmul on {len(plan.collective_matmul_layers)} layers"
    return text


def memory_per_pp_rank(plan: Plan) -> tuple[MemoryBreakdown, ...]:
    """Predicted memory of each pp coordinate: `predicted.memory_per_pp_rank` when the
    prediction has it, else `predicted.memory` (the most loaded rank) for every one."""
    per = tuple(getattr(plan.predicted, "memory_per_pp_rank", ()) or ())
    if len(per) == plan.mesh.pp:
        return per
    return (plan.predicted.memory,) * plan.mesh.pp


def ranks_of_pp(plan: Plan, pp_rank: int) -> list[int]:
    """The mesh ranks at pipeline coordinate `pp_rank`."""
    return [r for r in range(plan.world_size) if plan.mesh.coords(r)[0] == pp_rank]


def memory_table(plan: Plan) -> Table:
    """Predicted bytes per rank, one row per pp coordinate with the ranks it covers."""
    device = plan.predicted.device_memory_bytes
    table = Table(title="predicted memory per rank", title_justify="left")
    for name in ("pp", "ranks", "params", "grads", "optimizer", "activations", "total"):
        table.add_column(name, justify="left" if name in ("pp", "ranks") else "right")
    table.add_column("of device", justify="right")
    for pp_rank, mem in enumerate(memory_per_pp_rank(plan)):
        share = _percent(mem.total / device) if device else DASH
        table.add_row(str(pp_rank), format_ranks(ranks_of_pp(plan, pp_rank)),
                      format_bytes(mem.params), format_bytes(mem.grads),
                      format_bytes(mem.optimizer), format_bytes(mem.activations),
                      format_bytes(mem.total), share)
    return table


def alternatives_table(plan: Plan) -> Table:
    """The runner-up plans: shape, predicted step time and memory, why each lost."""
    table = Table(title="alternatives (why they lost)", title_justify="left")
    table.add_column("shape", ratio=3)
    table.add_column("step", justify="right", no_wrap=True)
    table.add_column("memory / rank", justify="right", no_wrap=True)
    table.add_column("fits", no_wrap=True)
    table.add_column("runs", no_wrap=True)
    table.add_column("why it lost", ratio=2)
    for alt in plan.alternatives:
        table.add_row(alt.summary.split(" |")[0], format_seconds(alt.step_time_s),
                      format_bytes(alt.memory_per_rank_bytes), _yes_no(alt.fits),
                      _yes_no(alt.executable), alt.reason)
    return table


def _yes_no(flag: bool | None) -> Text:
    if flag is None:  # an alternative whose passes were not run
        return Text("not tried", style="yellow")
    return Text("yes", style="green") if flag else Text("no", style="red")


# ---------------------------------------------------------------------- benchmarks
def bench_renderables(result: Mapping[str, Any]) -> list[RenderableType]:
    """A benchmark result dict as rich renderables: the variants table, why each n/a
    variant could not run, and the loss check."""
    out: list[RenderableType] = [bench_table(result)]
    out += [Text(f"{NA} {run.get('name', '?')} ({run.get('kind', '?')}): "
                 f"{run.get('reason') or 'not available'}", style="yellow")
            for run in result.get("runs") or () if not run.get("available")]
    out.append(loss_check_text(result.get("loss_check")))
    return out


def print_bench(result: Mapping[str, Any], console: Console | None = None) -> None:
    """Print `bench_renderables(result)` on `console` (stdout by default)."""
    console = _console(console)
    for renderable in bench_renderables(result):
        console.print(renderable)


def bench_table(result: Mapping[str, Any]) -> Table:
    """One row per benchmarked variant: median step time, its spread (min–max),
    samples/s, speed-up over eager and over the baseline (their median / this median),
    peak memory (the largest rank's), measured exposed communication, and the plan's
    prediction on compiled rows; times in one unit and bytes in one unit, named in the
    headers. Unavailable variants read n/a (`bench_renderables` adds their reasons)."""
    runs = list(result.get("runs") or ())
    predicted = result.get("predicted") or {}
    times = [run.get(k) or 0.0 for run in runs for k in ("median_s", "max_s")]
    seconds, t_unit = _unit(max(times + [predicted.get("step_time_s") or 0.0]), _TIME_UNITS)
    per_byte, b_unit = _unit(max([_peak(run) or 0 for run in runs] + [0]), _BYTE_UNITS)
    eager, baseline = _reference(runs, "eager"), _reference(runs, "baseline")
    columns = _Columns(seconds, per_byte, eager and eager["median_s"],
                       baseline and baseline["median_s"], predicted.get("step_time_s"))
    table = Table(title=_bench_title(result), title_justify="left", box=box.SIMPLE_HEAD,
                  padding=(0, 1, 0, 0), show_edge=False,     # fits 80 columns
                  caption=_caption(runs, eager, baseline), caption_justify="left")
    table.add_column("variant")
    for name in (f"median\n{t_unit}", f"min–max\n{t_unit}", "samples\n/s", "×\neager",
                 "×\nbaseline", f"peak\n{b_unit}", f"exposed\ncomm {t_unit}",
                 f"predicted\n{t_unit}"):
        table.add_column(name, justify="right")
    for run in runs:
        table.add_row(*columns.row(run))
    return table


_TIME_UNITS = ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs"))
_BYTE_UNITS = ((2.0**40, "TiB"), (2.0**30, "GiB"), (2.0**20, "MiB"), (2.0**10, "KiB"),
               (1.0, "B"))


def _unit(largest: float, units: Sequence[tuple[float, str]]) -> tuple[float, str]:
    """The largest (size, name) of `units` not above `largest` (the smallest for 0)."""
    return next((u for u in units if largest >= u[0]), units[-1])


@dataclass
class _Columns:
    """Formats a run's cells in the table's units, with its references."""

    seconds: float
    per_byte: float
    eager: float | None
    baseline: float | None
    predicted: float | None

    def row(self, run: Mapping[str, Any]) -> list[RenderableType]:
        head: list[RenderableType] = [Text(str(run.get("name", "?")),
                                           style=_KIND_STYLES.get(run.get("kind"), ""))]
        if not run.get("available"):
            return head + [Text(NA, style="yellow")] + [""] * 7
        median, peak = run.get("median_s"), _peak(run)
        lo, hi = run.get("min_s"), run.get("max_s")
        return head + [
            self.time(median),
            f"{self.time(lo)}–{self.time(hi)}" if lo is not None and hi is not None else DASH,
            _rate(run.get("samples_per_s")),
            _ratio(self.eager, median), _ratio(self.baseline, median),
            DASH if peak is None else _sig3(peak / self.per_byte),
            self.time(run.get("exposed_comm_s")),
            self.time(self.predicted) if run.get("kind") == "compiled" else DASH]

    def time(self, s: float | None) -> str:
        return DASH if s is None else _sig3(s / self.seconds)


def _bench_title(result: Mapping[str, Any]) -> str:
    plan = result.get("plan") or {}
    parts = [f"benchmark {result.get('model', '?')} on {result.get('cluster', '?')}"]
    if plan.get("mesh"):
        parts.append(str(plan["mesh"]))
    if result.get("steps") is not None:
        parts.append(f"{result['steps']} steps after {result.get('warmup', 0)} warm-up")
    return ", ".join(parts)


def _reference(runs: Sequence[Mapping[str, Any]], kind: str) -> Mapping[str, Any] | None:
    """The first available run of `kind` with a median: the speed-ups' reference."""
    for run in runs:
        if run.get("kind") == kind and run.get("available") and run.get("median_s"):
            return run
    return None


def _peak(run: Mapping[str, Any]) -> int | None:
    """The largest rank's peak memory of `run` (ranks without a measure skipped)."""
    measured = [b for b in run.get("peak_memory_bytes") or () if b is not None]
    return max(measured) if measured else None


def _caption(runs: Sequence[Mapping[str, Any]], eager: Mapping[str, Any] | None,
             baseline: Mapping[str, Any] | None) -> str | None:
    """What the speed-ups are relative to and how peak memory was measured."""
    notes = []
    names = [f"{kind} {run['name']!r}" for kind, run in (("eager", eager),
                                                          ("baseline", baseline)) if run]
    if names:
        notes.append(f"× = reference median ÷ this median; references: {', '.join(names)}")
    measures = sorted({str(r["memory_measure"]) for r in runs
                       if r.get("available") and r.get("memory_measure")})
    if measures:
        notes.append(f"peak memory: {', '.join(measures)}, largest rank")
    paired = next((r.get("paired_ratio") for r in runs if r.get("paired_ratio")), None)
    if paired and baseline:
        notes.append(f"paired: autohybrid ÷ {baseline['name']}, adjacent steps, median "
                     f"{paired:.3f} (< 1: faster)")
    return "\n".join(notes) or None


_KIND_STYLES = {"eager": "blue", "compiled": "green", "baseline": "magenta"}


def _rate(value: float | None) -> str:
    return DASH if value is None else f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _ratio(reference: float | None, median: float | None) -> str:
    if not reference or not median:
        return DASH
    return f"{reference / median:.2f}×"


def loss_check_text(check: Mapping[str, Any] | None) -> Text:
    """The loss-check line: largest absolute and relative difference against eager and
    whether it is within tolerance."""
    if not check:
        return Text("loss check: not run", style="yellow")
    ok = bool(check.get("ok"))
    text = Text("loss check: ")
    text.append("ok" if ok else "FAILED", style="green" if ok else "bold red")
    text.append(f" (max |Δ| {_num(check.get('max_abs_diff'))}, max relative "
                f"{_num(check.get('max_rel_diff'))}, tolerance {_num(check.get('tolerance'))})")
    return text


def _num(value: float | None) -> str:
    return DASH if value is None else f"{value:.3g}"


# ---------------------------------------------------------------------- progress
class RichProgressBar(AbstractContextManager):
    """One bar of a shared `rich.progress.Progress`; `.advance(n)` moves it, `.completed`
    counts the units done."""

    def __init__(self, owner: "_SharedProgress", total: int | None, description: str) -> None:
        self._owner, self.total, self.description = owner, total, description
        self.completed = 0
        self._task: TaskID | None = None

    def __enter__(self) -> "RichProgressBar":
        self._task = self._owner.open(self.total, self.description)
        return self

    def __exit__(self, *exc: object) -> None:
        self._owner.close(self._task)
        self._task = None

    def advance(self, n: int = 1) -> None:
        self.completed += n
        if self._task is not None:
            self._owner.progress.advance(self._task, n)


class _SharedProgress:
    """One `Progress` display for nested bars (rich allows one live display per console):
    it starts with the first open bar and stops when the last one closes."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.progress: Progress | None = None
        self._open = 0

    def open(self, total: int | None, description: str) -> TaskID:
        if self.progress is None:
            self.progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                     MofNCompleteColumn(), TimeElapsedColumn(),
                                     console=self.console)
            self.progress.start()
        self._open += 1
        return self.progress.add_task(description, total=total)

    def close(self, task: TaskID | None) -> None:
        self._open -= 1
        if self.progress is not None and self._open == 0:
            self.progress.stop()
            self.progress = None


def rich_progress_factory(console: Console | None = None
                          ) -> Callable[[int, str], RichProgressBar]:
    """A factory `f(total, description)` of rich progress bars on `console` (stderr by
    default, so that stdout stays the report), for `logs.set_progress_factory(f)`. Nested
    bars share one display. On a console that is not a terminal rich draws no live
    display and no escape codes: each display prints its final state once when it ends."""
    shared = _SharedProgress(console if console is not None else Console(stderr=True))

    def factory(total: int, description: str) -> RichProgressBar:
        return RichProgressBar(shared, total, description)

    return factory
