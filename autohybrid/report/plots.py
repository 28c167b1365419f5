"""Plots of plans, timelines and benchmark results with matplotlib (Agg, no pyplot).

- `plot_timeline(timeline, path, title=None, others=())`: one row per rank, compute
  coloured by phase, communication in a lane below it, idle time inside a step (the
  bubble) in grey; further timelines (a prediction beside a measurement) in panels below
  on the same time axis;
- `plot_memory(plan, path)`: predicted bytes per rank stacked as params / grads /
  optimizer / activations, with the device's memory as a line;
- `plot_bench(result, path)`: median step time per variant with min–max whiskers and the
  predicted step time marked, and throughput per variant; n/a variants labelled.

Each writes the format its path's suffix names (.png, .svg, .pdf) and returns the path.
Figures are `matplotlib.figure.Figure` objects drawn on an Agg canvas, so nothing touches
pyplot's global state. Artists carry gids (`rank-0-compute`, `step-eager`, …) that the SVG
output keeps as element ids.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from ..plan import Plan
from .terminal import format_bytes, format_seconds, memory_per_pp_rank
from .timeline import Interval, Timeline, subtract, union

FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf"}
COLORS = {"forward": "#4C72B0", "backward": "#55A868", "optimizer": "#8172B2",
          "compute": "#64B5CD", "communication": "#DD8452", "bubble": "#D0D0D0",
          "params": "#4C72B0", "grads": "#55A868", "optimizer_state": "#C44E52",
          "activations": "#8172B2", "na": "#999999", "predicted": "#C44E52"}
MEMORY_PARTS = ("params", "grads", "optimizer", "activations")
#: above this many ranks `plot_memory` draws one bar per pp coordinate instead
MAX_RANK_BARS = 64


# ---------------------------------------------------------------------- helpers
def _format_of(path: str | Path) -> tuple[Path, str]:
    """The path and the matplotlib format its suffix names; ValueError for others."""
    path = Path(path)
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(f"cannot tell the image format of {str(path)!r}: use a path ending "
                         f"in {', '.join(FORMATS)}")
    return path, fmt


def _new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path: Path, fmt: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format=fmt, dpi=100)
    return path


def gid(*parts: object) -> str:
    """An element id from `parts`: characters other than letters, digits, _ and - become -."""
    return re.sub(r"[^A-Za-z0-9_-]+", "-", "-".join(str(p) for p in parts)).strip("-")


def time_unit(seconds: float) -> tuple[float, str]:
    """(factor, label) to show durations up to `seconds` in s, ms or µs."""
    if seconds >= 1:
        return 1.0, "s"
    if seconds >= 1e-3:
        return 1e3, "ms"
    return 1e6, "µs"


def byte_unit(n: float) -> tuple[float, str]:
    """(divisor, label) to show byte counts up to `n` in B, KiB, MiB, GiB or TiB."""
    for power, label in ((4, "TiB"), (3, "GiB"), (2, "MiB"), (1, "KiB")):
        if n >= 1024 ** power:
            return float(1024 ** power), label
    return 1.0, "B"


# ---------------------------------------------------------------------- timeline
def plot_timeline(timeline: Timeline, path: str | Path, title: str | None = None,
                  others: Sequence[Timeline] = ()) -> Path:
    """Draw `timeline` (and `others`, one panel each below it, same time axis) to `path`.

    Each rank is a row: compute intervals in its upper lane coloured by phase (forward,
    backward, optimizer), communication in its lower lane, and the step's idle time (no
    compute and no communication: pipeline bubble, waiting) as grey across the row. SVG
    ids: `<source>-rank-<r>-<kind>` for kind compute, communication, bubble.
    """
    path, fmt = _format_of(path)
    timelines = [timeline, *others]
    for tl in timelines:
        if not tl.ranks:
            raise ValueError(f"the {tl.source} timeline has no ranks to plot")
    end = max((iv.end_s for tl in timelines for ivs in tl.ranks.values() for iv in ivs),
              default=0.0)
    if end <= 0:
        raise ValueError("the timelines have no intervals to plot")
    factor, unit = time_unit(end)
    rows = sum(len(tl.ranks) for tl in timelines)
    fig = _new_figure(10, 1.2 + 0.45 * rows + 0.5 * len(timelines))
    axes = fig.subplots(len(timelines), 1, sharex=True, squeeze=False,
                        height_ratios=[len(tl.ranks) for tl in timelines])[:, 0]
    for ax, tl in zip(axes, timelines):
        _draw_timeline(ax, tl, factor)
        ax.set_title(f"{tl.source} timeline", loc="left", fontsize=10)
    axes[-1].set_xlabel(f"time ({unit})")
    axes[0].legend(handles=_timeline_legend(), loc="upper right", fontsize=8, ncols=5,
                   bbox_to_anchor=(1.0, 1.0 + 0.6 / max(1, len(timelines[0].ranks))))
    if title:
        fig.suptitle(title)
    return _save(fig, path, fmt)


def _draw_timeline(ax: Any, tl: Timeline, factor: float) -> None:
    ranks = sorted(tl.ranks)
    for row, rank in enumerate(ranks):
        y = len(ranks) - 1 - row         # rank 0 at the top
        ivs = tl.ranks[rank]
        compute = [iv for iv in ivs if iv.kind == "compute"]
        comm = [iv for iv in ivs if iv.kind == "communication"]
        bubbles = _idle(ivs)
        _bars(ax, bubbles, y - 0.4, 0.8, COLORS["bubble"], gid(tl.source, "rank", rank,
                                                                 "bubble"), factor)
        _bars(ax, [(iv.start_s, iv.end_s) for iv in compute], y - 0.02, 0.42,
              [COLORS.get(_phase_color(iv), COLORS["compute"]) for iv in compute],
              gid(tl.source, "rank", rank, "compute"), factor)
        _bars(ax, [(iv.start_s, iv.end_s) for iv in comm], y - 0.4, 0.34,
              COLORS["communication"], gid(tl.source, "rank", rank, "communication"),
              factor)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in reversed(ranks)])
    ax.set_ylim(-0.6, len(ranks) - 0.4)
    ax.grid(axis="x", alpha=0.3)


def _phase_color(iv: Interval) -> str:
    return {"after-backward": "backward"}.get(iv.phase, iv.phase or "compute")


def _idle(ivs: Iterable[Interval]) -> list[tuple[float, float]]:
    """The parts of the rank's steps with neither compute nor communication."""
    ivs = list(ivs)
    steps = union((iv.start_s, iv.end_s) for iv in ivs if iv.kind == "step")
    busy = [(iv.start_s, iv.end_s) for iv in ivs if iv.kind in ("compute", "communication")]
    return subtract(steps, busy)


def _bars(ax: Any, spans: Sequence[tuple[float, float]], y: float, height: float,
          color: Any, name: str, factor: float) -> None:
    if not spans:
        return
    collection = ax.broken_barh([(a * factor, (b - a) * factor) for a, b in spans],
                                (y, height), facecolors=color, edgecolors="white",
                                linewidth=0.4)
    collection.set_gid(name)


def _timeline_legend() -> list[Patch]:
    return [Patch(color=COLORS[k], label=k) for k in
            ("forward", "backward", "optimizer", "communication", "bubble")]


# ---------------------------------------------------------------------- memory
def plot_memory(plan: Plan, path: str | Path) -> Path:
    """Predicted memory per rank of `plan`, stacked by kind, with the device's memory.

    One bar per rank (SVG ids `memory-rank-<r>-<part>`), or one per pp coordinate when the
    mesh has more than `MAX_RANK_BARS` ranks (`memory-pp-<k>-<part>`). The device's memory
    is a dashed line (`device-limit-line`); when it is more than four times the largest
    bar, the axis stops above the bars and it is written in the corner instead
    (`device-limit-note`).
    """
    path, fmt = _format_of(path)
    per_pp = memory_per_pp_rank(plan)
    if plan.world_size <= MAX_RANK_BARS:
        labels = [f"rank {r}" for r in range(plan.world_size)]
        ids = [f"rank-{r}" for r in range(plan.world_size)]
        mems = [per_pp[plan.mesh.coords(r)[0]] for r in range(plan.world_size)]
    else:
        labels = [f"pp {k}" for k in range(plan.mesh.pp)]
        ids = [f"pp-{k}" for k in range(plan.mesh.pp)]
        mems = list(per_pp)
    device = plan.predicted.device_memory_bytes
    largest = max(m.total for m in mems)
    if largest <= 0 and not device:
        raise ValueError("the plan predicts no memory to plot")
    divisor, unit = byte_unit(max(largest, device if device <= 4 * largest else 0))
    fig = _new_figure(max(6.0, 0.5 * len(labels) + 3), 4.5)
    ax = fig.add_subplot()
    _stacked_memory(ax, mems, ids, divisor)
    _device_line(ax, device, largest, divisor)
    ax.set_xticks(range(len(labels)), labels, rotation=45 if len(labels) > 8 else 0)
    ax.set_ylabel(f"predicted memory ({unit})")
    ax.set_title(f"{plan.mesh.describe()}: predicted memory per rank", loc="left")
    fig.legend(*ax.get_legend_handles_labels(), loc="outside right upper", fontsize=8)
    return _save(fig, path, fmt)


def _stacked_memory(ax: Any, mems: Sequence[Any], ids: Sequence[str], divisor: float) -> None:
    bottoms = [0.0] * len(mems)
    for part in MEMORY_PARTS:
        values = [getattr(m, part) / divisor for m in mems]
        color = COLORS["optimizer_state" if part == "optimizer" else part]
        bars = ax.bar(range(len(mems)), values, bottom=bottoms, color=color, label=part)
        for bar, name in zip(bars, ids):
            bar.set_gid(gid("memory", name, part))
        bottoms = [b + v for b, v in zip(bottoms, values)]


def _device_line(ax: Any, device: int, largest: int, divisor: float) -> None:
    if not device:
        return
    label = f"device memory {format_bytes(device)}"
    if device <= 4 * largest:
        line = ax.axhline(device / divisor, color="black", linestyle="--", label=label)
        line.set_gid("device-limit-line")
        return
    ax.set_ylim(0, largest / divisor * 1.25)
    text = ax.text(0.99, 0.98, f"{label}: above the axis\n"
                   f"({device / max(largest, 1):,.0f}× the largest rank)",
                   transform=ax.transAxes, ha="right", va="top", fontsize=8)
    text.set_gid("device-limit-note")


# ---------------------------------------------------------------------- benchmarks
def plot_bench(result: Mapping[str, Any], path: str | Path) -> Path:
    """A benchmark result dict: median step time per variant with min–max whiskers and
    the predicted step time as a dashed line (left), samples/s per variant (right).
    Unavailable variants get no bar but an "n/a" label. SVG ids: `step-<name>`,
    `throughput-<name>`, `na-<name>`, `predicted-step`."""
    path, fmt = _format_of(path)
    runs = list(result.get("runs") or ())
    if not runs:
        raise ValueError("the benchmark result has no runs to plot")
    available = [r for r in runs if r.get("available") and r.get("median_s") is not None]
    longest = max([r.get("max_s") or r["median_s"] for r in available]
                  + [(result.get("predicted") or {}).get("step_time_s") or 0.0])
    factor, unit = time_unit(longest) if longest > 0 else (1e3, "ms")
    fig = _new_figure(max(8.0, 1.2 * len(runs) + 4), 4.5)
    left, right = fig.subplots(1, 2)
    _step_bars(left, runs, factor)
    _predicted_line(left, result, factor)
    left.set_ylim(top=left.get_ylim()[1] * 1.3)     # room for the legend
    _kind_legend(left)
    left.set_ylabel(f"step time ({unit}), median with min–max")
    left.set_title("step time", loc="left")
    _throughput_bars(right, runs)
    right.set_title("throughput", loc="left")
    fig.suptitle(f"{result.get('model', '?')} on {result.get('cluster', '?')}"
                 + (f" ({result['plan']['mesh']})" if (result.get("plan") or {}).get("mesh")
                    else ""))
    return _save(fig, path, fmt)


def _step_bars(ax: Any, runs: Sequence[Mapping[str, Any]], factor: float) -> None:
    for x, run in enumerate(runs):
        if not _usable(run):
            _na_label(ax, x, run)
            continue
        median = run["median_s"] * factor
        lo = (run.get("min_s") if run.get("min_s") is not None else run["median_s"]) * factor
        hi = (run.get("max_s") if run.get("max_s") is not None else run["median_s"]) * factor
        bars = ax.bar([x], [median], color=_kind_color(run), label=run.get("kind"))
        bars[0].set_gid(gid("step", run.get("name", x)))
        ax.bar_label(bars, fmt="%.3g", label_type="center", color="white", fontsize=8)
        ax.errorbar([x], [median], yerr=[[median - lo], [hi - median]], color="black",
                    capsize=4, linewidth=1)
    _variant_ticks(ax, runs)


def _throughput_bars(ax: Any, runs: Sequence[Mapping[str, Any]]) -> None:
    for x, run in enumerate(runs):
        if not _usable(run) or run.get("samples_per_s") is None:
            _na_label(ax, x, run, prefix="na-throughput")
            continue
        bars = ax.bar([x], [run["samples_per_s"]], color=_kind_color(run))
        bars[0].set_gid(gid("throughput", run.get("name", x)))
        ax.bar_label(bars, fmt="%.4g", padding=2, fontsize=8)
    _variant_ticks(ax, runs)
    ax.set_ylabel("samples/s")


def _usable(run: Mapping[str, Any]) -> bool:
    return bool(run.get("available")) and run.get("median_s") is not None


def _kind_color(run: Mapping[str, Any]) -> str:
    return {"eager": "#4C72B0", "compiled": "#55A868", "baseline": "#8172B2"}.get(
        run.get("kind", ""), "#64B5CD")


def _na_label(ax: Any, x: int, run: Mapping[str, Any], prefix: str = "na") -> None:
    reason = str(run.get("reason") or "not available")
    short = reason if len(reason) <= 40 else reason[:37] + "…"
    text = ax.text(x, 0.02, f"n/a: {short}", ha="center", va="bottom", fontsize=7,
                   color="#555555", rotation=90, transform=ax.get_xaxis_transform(),
                   bbox={"facecolor": "white", "edgecolor": COLORS["na"], "pad": 2})
    text.set_gid(gid(prefix, run.get("name", x)))


def _variant_ticks(ax: Any, runs: Sequence[Mapping[str, Any]]) -> None:
    ax.set_xticks(range(len(runs)), [str(r.get("name", i)) for i, r in enumerate(runs)],
                  rotation=30, ha="right")
    ax.set_xlim(-0.6, len(runs) - 0.4)
    ax.grid(axis="y", alpha=0.3)


def _predicted_line(ax: Any, result: Mapping[str, Any], factor: float) -> None:
    predicted = (result.get("predicted") or {}).get("step_time_s")
    if not predicted:
        return
    line = ax.axhline(predicted * factor, color=COLORS["predicted"], linestyle="--",
                      label=f"predicted {format_seconds(predicted)}")
    line.set_gid("predicted-step")


def _kind_legend(ax: Any) -> None:
    """One legend entry per kind of variant (the first bar of each) and the prediction."""
    seen: dict[str, Any] = {}
    for handle, label in zip(*ax.get_legend_handles_labels()):
        seen.setdefault(label, handle)
    if seen:
        ax.legend(seen.values(), seen.keys(), loc="upper right", fontsize=8)
