"""Small SVG drawings for the plan report, written as text with no dependencies.

Why hand-written SVG: the report must be one file that opens offline, in any browser,
without scripts, fonts or a plotting library. Every function returns one `<svg>` element
as a string, with all text escaped. Drawn elements carry stable classes and data
attributes, which the report's CSS styles and the tests count:

* graph: `g.stage[data-stage]` per pipeline stage, `g.layer[data-group][data-stage]` per
  group, `.collective[data-op]` markers, `path.edge` (`.edge.send` across stages);
* mesh: `g.machine[data-node]` per node, `g.gpu[data-rank][data-pp]` per rank;
* timeline: `g.timeline-row[data-rank][data-source]` per rank and timeline, inside it
  `rect.iv` with `data-kind` (`compute`, `communication`, `bubble`) and `data-phase`;
* memory: `g.mem-bar[data-rank]`, its `rect.mem-seg[data-part]`, `line.mem-limit`;
* bench: `g.bench-bar[data-run]`.
"""
from __future__ import annotations

import math
from html import escape
from typing import Any, Iterable, Sequence

from .graphview import GraphView, Group, group_lines, stage_color
from .timeline import Timeline

FONT = "font-family=\"system-ui, -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif\""
PHASE_COLORS = {"forward": "#3b82f6", "backward": "#8b5cf6", "after-backward": "#a78bfa",
                "optimizer": "#64748b", "": "#94a3b8"}
COMM_COLOR = "#f97316"
BUBBLE_COLOR = "#fde68a"
MEMORY_PARTS = (("params", "parameters", "#2563eb"), ("grads", "gradients", "#16a34a"),
                ("optimizer", "optimizer state", "#d97706"),
                ("activations", "activations", "#db2777"))


def esc(text: Any) -> str:
    """Text escaped for SVG/HTML content and attribute values."""
    return escape(str(text), quote=True)


def _svg(width: float, height: float, body: Iterable[str], cls: str, label: str) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" class="{cls}" role="img" '
            f'aria-label="{esc(label)}" width="{width:.0f}" height="{height:.0f}" '
            f'viewBox="0 0 {width:.0f} {height:.0f}" {FONT} font-size="12">'
            + "".join(body) + "</svg>")


def _text(x: float, y: float, text: Any, *, size: int = 12, anchor: str = "start",
          weight: str = "normal", fill: str = "#111827", cls: str = "") -> str:
    klass = f' class="{cls}"' if cls else ""
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" '
            f'font-weight="{weight}" fill="{fill}"{klass}>{esc(text)}</text>')


def _rect(x: float, y: float, w: float, h: float, fill: str, *, stroke: str = "none",
          rx: float = 0, cls: str = "", attrs: str = "", title: str = "") -> str:
    klass = f' class="{cls}"' if cls else ""
    inner = f"<title>{esc(title)}</title>" if title else ""
    return (f'<rect x="{x:.2f}" y="{y:.2f}" width="{max(w, 0):.2f}" height="{h:.2f}" '
            f'rx="{rx}" fill="{fill}" stroke="{stroke}"{klass}{attrs}>{inner}</rect>')


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_time(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} µs"


def nice_ticks(hi: float, count: int = 6) -> list[float]:
    """Round tick values from 0 to at least `hi` (1, 2 or 5 × a power of ten apart)."""
    if hi <= 0:
        return [0.0]
    raw = hi / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    return [i * step for i in range(int(math.ceil(hi / step - 1e-9)) + 1)]


# ---------------------------------------------------------------------- graph
BOX_W, LINE_H, GAP_X, GAP_Y, PAD = 240, 14, 34, 26, 14


def graph_svg(view: GraphView, per_row: int = 4) -> str:
    """The coarse program: one band per pipeline stage (its color), its layers left to
    right in execution order (wrapping every `per_row`), sharding and collectives in
    each box, data edges as arrows (dashed and dark where they cross stages)."""
    box_h = max((len(group_lines(g)) for g in view.groups), default=2) * LINE_H + 12
    width = PAD * 2 + per_row * BOX_W + (per_row - 1) * GAP_X + 20
    y = PAD
    bands: list[str] = []
    where: dict[str, tuple[float, float, int]] = {}    # group id → (x, y, row key)
    for stage in view.stages():
        members = [g for g in view.groups if g.stage == stage]
        rows = max(1, math.ceil(len(members) / per_row))
        band_h = 28 + rows * box_h + (rows - 1) * GAP_Y + 12
        fill, stroke = stage_color(stage)
        pp = view.stage_ranks[stage] if stage < len(view.stage_ranks) else stage
        parts = [_rect(PAD / 2, y, width - PAD, band_h, fill, stroke=stroke, rx=8,
                       cls="stage-band"),
                 # right-aligned: edges into a stage arrive at its left boxes
                 _text(width - PAD - 8, y + 18, f"stage {stage} · pp rank {pp} · "
                       f"{len(members)} group{'s' if len(members) != 1 else ''}",
                       anchor="end", weight="600", fill=stroke)]
        for i, g in enumerate(members):
            row, col = divmod(i, per_row)
            gx = PAD + 10 + col * (BOX_W + GAP_X)
            gy = y + 28 + row * (box_h + GAP_Y)
            where[g.id] = (gx, gy, stage * 10000 + row)
            parts.append(_layer_box(g, gx, gy, box_h, stroke))
        bands.append(f'<g class="stage" data-stage="{stage}" id="stage-{stage}">'
                     + "".join(parts) + "</g>")
        y += band_h + 10
    edges = [_edge(e.src, e.dst, e.crosses_stage, e.values, where, box_h)
             for e in view.edges if e.src in where and e.dst in where]
    defs = ('<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" '
            'markerWidth="7" markerHeight="7" orient="auto-start-reverse">'
            '<path d="M0,0 L10,5 L0,10 z" fill="#6b7280"/></marker>'
            '<marker id="arrow-send" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="8" '
            'markerHeight="8" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" '
            'fill="#111827"/></marker></defs>')
    return _svg(width, y + PAD, [defs, *bands, '<g class="edges">', *edges, "</g>"],
                "graph-svg", f"{view.title}: layers by pipeline stage")


def _layer_box(g: Group, x: float, y: float, h: float, stroke: str) -> str:
    lines = group_lines(g)
    heavy = 2.5 if g.collectives else 1.2
    title = "\n".join(lines) + (f"\nparameters: {', '.join(g.params)}" if g.params else "")
    parts = [_rect(x, y, BOX_W, h, "#ffffff", stroke=stroke, rx=6, title=title,
                   attrs=f' stroke-width="{heavy}"')]
    for i, line in enumerate(lines):
        parts.append(_text(x + 8, y + 16 + i * LINE_H, _clip(line, 38), size=11 if i else 12,
                           weight="600" if i == 0 else "normal",
                           fill="#111827" if i == 0 else "#374151"))
    for k, (op, n) in enumerate(g.collectives):      # a marker per collective kind
        cx, cy = x + BOX_W - 10 - k * 14, y + 10
        parts.append(f'<path class="collective" data-op="{esc(op)}" data-count="{n}" '
                     f'd="M{cx:.1f},{cy - 5:.1f} L{cx + 5:.1f},{cy:.1f} L{cx:.1f},{cy + 5:.1f} '
                     f'L{cx - 5:.1f},{cy:.1f} z" fill="{COMM_COLOR}">'
                     f"<title>{esc(op)} ×{n}</title></path>")
    return (f'<g class="layer" data-group="{esc(g.id)}" data-stage="{g.stage}" '
            f'data-name="{esc(g.name)}">' + "".join(parts) + "</g>")


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[:n - 1] + "…"


def _edge(src: str, dst: str, send: bool, values: int,
          where: dict[str, tuple[float, float, int]], box_h: float) -> str:
    sx, sy, srow = where[src]
    dx, dy, drow = where[dst]
    if srow == drow and dx > sx:                       # same row: right side → left side
        a, b = (sx + BOX_W, sy + box_h / 2), (dx, dy + box_h / 2)
        bend = min(40.0, (b[0] - a[0]) / 2)
        if dx - sx > BOX_W + GAP_X + 1:                # skips a box: arc above the row
            path = (f"M{a[0] - 20:.1f},{sy:.1f} C{a[0]:.1f},{sy - 22:.1f} "
                    f"{b[0] + 20:.1f},{dy - 22:.1f} {b[0] + 20:.1f},{dy:.1f}")
        else:
            path = (f"M{a[0]:.1f},{a[1]:.1f} C{a[0] + bend:.1f},{a[1]:.1f} "
                    f"{b[0] - bend:.1f},{b[1]:.1f} {b[0]:.1f},{b[1]:.1f}")
    else:                                              # next row or stage: bottom → top
        a, b = (sx + BOX_W / 2, sy + box_h), (dx + BOX_W / 2, dy)
        mid = (a[1] + b[1]) / 2
        path = (f"M{a[0]:.1f},{a[1]:.1f} C{a[0]:.1f},{mid:.1f} {b[0]:.1f},{mid:.1f} "
                f"{b[0]:.1f},{b[1]:.1f}")
    cls = "edge send" if send else "edge"
    style = ('stroke="#111827" stroke-dasharray="6 4" stroke-width="1.6" '
             'marker-end="url(#arrow-send)"') if send else \
        f'stroke="#6b7280" stroke-width="{min(3.0, 1 + 0.3 * (values - 1)):.1f}" ' \
        'marker-end="url(#arrow)"'
    return (f'<path class="{cls}" data-src="{esc(src)}" data-dst="{esc(dst)}" d="{path}" '
            f'fill="none" {style}/>')


# ---------------------------------------------------------------------- mesh
def mesh_svg(plan: Any) -> str:
    """Machines as boxes, their GPUs inside, each labelled with its rank and (pp, dp,
    tp) coordinates and colored by its pipeline rank (the stage color of that pp rank)."""
    by_node: dict[int, list[Any]] = {}
    for p in sorted(plan.placement, key=lambda p: (p.node, p.device)):
        by_node.setdefault(p.node, []).append(p)
    small = plan.world_size > 64                       # labels only in tooltips
    cell_w, cell_h = (22, 22) if small else (92, 46)
    per_node = max(len(v) for v in by_node.values())
    cols = min(per_node, 8)
    node_w = 16 + cols * (cell_w + 6)
    node_h = 30 + math.ceil(per_node / cols) * (cell_h + 6) + 6
    nodes_per_row = max(1, int(1100 // (node_w + 16)))
    parts: list[str] = []
    for i, (node, ranks) in enumerate(sorted(by_node.items())):
        r, c = divmod(i, nodes_per_row)
        nx, ny = 10 + c * (node_w + 16), 10 + r * (node_h + 16)
        cells = [_rect(nx, ny, node_w, node_h, "#f9fafb", stroke="#9ca3af", rx=8),
                 _text(nx + 8, ny + 18, f"node {node}", weight="600")]
        for k, p in enumerate(ranks):
            pp, dp, tp = plan.mesh.coords(p.rank)
            fill, stroke = stage_color(pp)
            gx = nx + 8 + (k % cols) * (cell_w + 6)
            gy = ny + 28 + (k // cols) * (cell_h + 6)
            title = f"rank {p.rank}: node {p.node}, device {p.device}, (pp, dp, tp) = " \
                    f"({pp}, {dp}, {tp})"
            inner = [_rect(gx, gy, cell_w, cell_h, fill, stroke=stroke, rx=4, title=title)]
            if not small:
                inner += [_text(gx + cell_w / 2, gy + 18, f"rank {p.rank} · gpu {p.device}",
                                size=11, anchor="middle", weight="600"),
                          _text(gx + cell_w / 2, gy + 35, f"({pp}, {dp}, {tp})", size=11,
                                anchor="middle", fill="#374151")]
            cells.append(f'<g class="gpu" data-rank="{p.rank}" data-pp="{pp}" data-dp="{dp}"'
                         f' data-tp="{tp}">' + "".join(inner) + "</g>")
        parts.append(f'<g class="machine" data-node="{node}">' + "".join(cells) + "</g>")
    rows = math.ceil(len(by_node) / nodes_per_row)
    width = 20 + min(len(by_node), nodes_per_row) * (node_w + 16)
    return _svg(width, 20 + rows * (node_h + 16), parts, "mesh-svg",
                f"{plan.world_size} ranks on {len(by_node)} nodes")


# ---------------------------------------------------------------------- timeline
ROW_H, LABEL_W = 22, 150


def timeline_svg(timelines: Sequence[Timeline], width: int = 1100) -> str:
    """Per-rank rows of each timeline (predicted above measured), on one time axis so
    they compare: compute colored by phase, communication as a strip along the row's
    bottom, the bubble (inside the step, neither compute nor communication) shaded."""
    if not timelines:
        raise ValueError("timeline_svg needs at least one Timeline")
    end = max((iv.end_s for tl in timelines for ivs in tl.ranks.values() for iv in ivs),
              default=0.0) or 1e-9
    plot_w = width - LABEL_W - 20
    scale = plot_w / end
    parts: list[str] = []
    y = 10.0
    row_h = _row_height(max(len(tl.ranks) for tl in timelines))
    for tl in timelines:
        parts.append(_text(10, y + 14, f"{tl.source} timeline", weight="600"))
        y += 24
        for rank in sorted(tl.ranks):
            parts.append(_timeline_row(tl, rank, y, scale, row_h))
            y += row_h + (4 if row_h == ROW_H else 1)
        y += 8
    axis = [f'<line x1="{LABEL_W}" y1="{y:.1f}" x2="{LABEL_W + plot_w}" y2="{y:.1f}" '
            'stroke="#9ca3af"/>']
    for t in nice_ticks(end):
        x = LABEL_W + t * scale
        if x > LABEL_W + plot_w + 1:
            break
        axis += [f'<line x1="{x:.1f}" y1="{y:.1f}" x2="{x:.1f}" y2="{y + 5:.1f}" '
                 'stroke="#9ca3af"/>',
                 _text(x, y + 18, fmt_time(t), size=11, anchor="middle", fill="#4b5563")]
    return _svg(width, y + 30, parts + ['<g class="axis">', *axis, "</g>"], "timeline-svg",
                "per-rank timelines")


def _row_height(rows: int) -> float:
    """Rows stay readable up to 32 ranks; beyond, thin rows keep the drawing short."""
    return ROW_H if rows <= 32 else 6


def _row_label(rank: int, y: float, row_h: float) -> list[str]:
    if row_h == ROW_H:
        return [_text(10, y + 15, f"rank {rank}", size=11)]
    return [_text(10, y + row_h, f"rank {rank}", size=9)] if rank % 8 == 0 else []


def _timeline_row(tl: Timeline, rank: int, y: float, scale: float,
                  row_h: float = ROW_H) -> str:
    x0 = LABEL_W
    parts = _row_label(rank, y, row_h)
    for iv in tl.intervals(rank, "step"):
        parts.append(_rect(x0 + iv.start_s * scale, y, iv.duration_s * scale, row_h,
                           BUBBLE_COLOR, cls="iv", title=f"{iv.name}: idle (bubble) where "
                           "nothing is drawn over it",
                           attrs=' data-kind="bubble" data-phase=""'))
    for iv in tl.intervals(rank, "compute"):
        parts.append(_rect(x0 + iv.start_s * scale, y, max(iv.duration_s * scale, 0.5),
                           row_h, PHASE_COLORS.get(iv.phase, PHASE_COLORS[""]), cls="iv",
                           title=f"{iv.name} ({fmt_time(iv.duration_s)})",
                           attrs=f' data-kind="compute" data-phase="{esc(iv.phase)}"'))
    for iv in tl.intervals(rank, "communication"):
        parts.append(_rect(x0 + iv.start_s * scale, y + row_h * 0.62,
                           max(iv.duration_s * scale, 0.5), row_h * 0.38, COMM_COLOR,
                           cls="iv", title=f"{iv.name} ({fmt_time(iv.duration_s)})",
                           attrs=f' data-kind="communication" data-phase="{esc(iv.phase)}"'))
    return (f'<g class="timeline-row" data-rank="{rank}" data-source="{esc(tl.source)}">'
            + "".join(parts) + "</g>")


# ---------------------------------------------------------------------- memory
def memory_per_rank(plan: Any) -> list[Any]:
    """The predicted MemoryBreakdown of every rank (per pp coordinate where the plan
    predicts it so, else the most loaded rank's: `Prediction.memory_of_rank`)."""
    return [plan.predicted.memory_of_rank(plan, r) for r in range(plan.world_size)]


def memory_svg(plan: Any, width: int = 1100) -> str:
    """A stacked bar per rank (parameters, gradients, optimizer state, activations) and
    the device's memory as a red line (or a note when it is far off the scale)."""
    mems = memory_per_rank(plan)
    limit = plan.predicted.device_memory_bytes
    top = max((m.total for m in mems), default=0) or 1
    show_limit = 0 < limit <= 4 * top
    full = max(top, limit) if show_limit else top
    plot_w = width - LABEL_W - 140
    scale = plot_w / (full * 1.05)
    parts: list[str] = []
    y = 10.0
    row_h = _row_height(len(mems))
    for rank, m in enumerate(mems):
        x = LABEL_W
        segs = _row_label(rank, y, row_h)
        for attr, label, color in MEMORY_PARTS:
            size = getattr(m, attr)
            segs.append(_rect(x, y, size * scale, row_h, color, cls="mem-seg",
                              title=f"rank {rank} {label}: {fmt_bytes(size)}",
                              attrs=f' data-part="{attr}" data-bytes="{size}"'))
            x += size * scale
        if row_h == ROW_H:
            segs.append(_text(x + 6, y + 15, fmt_bytes(m.total), size=11, fill="#374151"))
        parts.append(f'<g class="mem-bar" data-rank="{rank}" data-bytes="{m.total}">'
                     + "".join(segs) + "</g>")
        y += row_h + (4 if row_h == ROW_H else 1)
    if show_limit:
        lx = LABEL_W + limit * scale
        parts += [f'<line class="mem-limit" x1="{lx:.1f}" y1="4" x2="{lx:.1f}" y2="{y:.1f}" '
                  'stroke="#dc2626" stroke-width="2" stroke-dasharray="5 3"/>',
                  _text(lx, y + 14, f"device {fmt_bytes(limit)}", size=11, anchor="middle",
                        fill="#dc2626")]
    elif limit:
        parts.append(_text(LABEL_W, y + 14, f"device memory {fmt_bytes(limit)} — the "
                           f"fullest rank uses {100 * top / limit:.3g} % of it (off scale)",
                           size=11, fill="#dc2626", cls="mem-limit-note"))
    return _svg(width, y + 26, parts, "memory-svg", "predicted memory per rank")


# ---------------------------------------------------------------------- bench
def bench_svg(bench: dict[str, Any], width: int = 1100) -> str:
    """Median step time of each available bench run (min–max whisker) beside the
    predicted step time (dashed line); unavailable runs listed with their reason."""
    runs = list(bench.get("runs") or [])
    predicted = (bench.get("predicted") or {}).get("step_time_s")
    ok = [r for r in runs if r.get("available") and r.get("median_s") is not None]
    top = max([r.get("max_s") or r["median_s"] for r in ok] + [predicted or 0]) or 1e-9
    plot_w = width - LABEL_W - 160
    scale = plot_w / (top * 1.05)
    parts: list[str] = []
    y = 10.0
    for r in runs:
        name = str(r.get("name", "?"))
        bar = [_text(10, y + 15, _clip(name, 22), size=11)]
        if r in ok:
            med = float(r["median_s"])
            bar.append(_rect(LABEL_W, y, med * scale, ROW_H, "#3b82f6",
                             title=f"{name}: median {fmt_time(med)}"))
            lo, hi = r.get("min_s"), r.get("max_s")
            if lo is not None and hi is not None:
                cy = y + ROW_H / 2
                bar.append(f'<line x1="{LABEL_W + lo * scale:.1f}" y1="{cy}" '
                           f'x2="{LABEL_W + hi * scale:.1f}" y2="{cy}" stroke="#1e3a8a" '
                           'stroke-width="2"/>')
            bar.append(_text(LABEL_W + med * scale + 6, y + 15, fmt_time(med), size=11))
        else:
            bar.append(_text(LABEL_W, y + 15, f"not run: {r.get('reason') or 'unavailable'}",
                             size=11, fill="#6b7280"))
        parts.append(f'<g class="bench-bar" data-run="{esc(name)}" '
                     f'data-available="{str(r in ok).lower()}">' + "".join(bar) + "</g>")
        y += ROW_H + 4
    if predicted:
        px = LABEL_W + predicted * scale
        parts += [f'<line class="bench-predicted" x1="{px:.1f}" y1="4" x2="{px:.1f}" '
                  f'y2="{y:.1f}" stroke="#16a34a" stroke-width="2" stroke-dasharray="5 3"/>',
                  _text(px, y + 14, f"predicted {fmt_time(predicted)}", size=11,
                        anchor="middle", fill="#16a34a")]
    return _svg(width, y + 26, parts, "bench-svg", "bench: step time per run")
