"""The plan report: one self-contained HTML file (inline CSS and SVG, no script).

Why one file: a plan is read on a laptop far from the cluster, attached to an issue or a
CI artifact; it must open offline in any browser. `render_report(plan, ...)` returns the
HTML text, `write_report(path, plan, ...)` writes it. Sections, each a
`<section id=...>`:

* `summary`: the plan's key figures (mesh, batch split, schedule, predicted step,
  communication, bubble, memory);
* `mesh`: machines and their GPUs, each rank with its (pp, dp, tp) coordinates;
* `graph`: a rank's program as layers colored by pipeline stage, with their tensor
  parallel sharding and the collectives the passes inserted (graphview.py), and its
  Graphviz DOT text;
* `timeline`: the predicted per-rank step (timeline.py), beside a measured one if given;
* `memory`: predicted bytes per rank against the device's memory;
* `alternatives`: the runner-up plans and why each lost;
* `comparison` (only with `measured` or `bench`): predicted against measured figures.

Every text that comes from the plan, the model or a bench result is escaped.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from ..errors import AutohybridError
from ..plan import Plan
from .graphview import coarse_view, stage_color, to_dot
from .svg import (BUBBLE_COLOR, COMM_COLOR, MEMORY_PARTS, PHASE_COLORS, bench_svg, esc,
                  fmt_bytes, fmt_time, graph_svg, memory_per_rank, memory_svg, mesh_svg,
                  timeline_svg)
from .timeline import Timeline, predicted_timeline

CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',Helvetica,Arial,sans-serif;margin:0;
 background:#f8fafc;color:#111827}
header{background:#1e293b;color:#f8fafc;padding:18px 28px}
header h1{margin:0 0 4px;font-size:22px}header p{margin:0;color:#cbd5e1;font-size:13px}
main{padding:8px 28px 40px;max-width:1200px}
section{background:#fff;border:1px solid #e5e7eb;border-radius:10px;margin:18px 0;
 padding:14px 18px;overflow-x:auto}
h2{font-size:17px;margin:2px 0 10px}
.cards{display:flex;flex-wrap:wrap;gap:10px}
.card{border:1px solid #e5e7eb;border-radius:8px;padding:8px 12px;min-width:150px}
.card .k{font-size:11px;color:#6b7280;text-transform:uppercase;letter-spacing:.04em}
.card .v{font-size:17px;font-weight:600;margin-top:2px}
table{border-collapse:collapse;font-size:13px;margin-top:8px}
th,td{border-bottom:1px solid #e5e7eb;padding:5px 10px;text-align:left;vertical-align:top}
th{background:#f1f5f9}td.num{text-align:right;font-variant-numeric:tabular-nums}
.legend{display:flex;flex-wrap:wrap;gap:14px;font-size:12px;margin:4px 0 8px}
.legend span.sw{display:inline-block;width:12px;height:12px;border-radius:3px;
 margin-right:5px;vertical-align:-2px;border:1px solid #9ca3af}
.note{color:#6b7280;font-size:12px}.bad{color:#b91c1c;font-weight:600}
.good{color:#15803d;font-weight:600}
pre{background:#f1f5f9;padding:10px;border-radius:6px;font-size:11px;max-height:360px;
 overflow:auto}
"""


def render_report(plan: Plan, *, programs: Any = None, measured: Timeline | None = None,
                  bench: Any = None, title: str | None = None) -> str:
    """The report of `plan` as HTML text.

    `programs`: a RankProgram (report/program.py), a sequence of them or a dict rank →
    RankProgram; the first is
    drawn (every rank's program has every stage; ranks differ only in which they run).
    None rebuilds rank 0's from `plan.model_ref` when the plan records its model; an
    empty sequence draws no graph. `measured`: a measured Timeline (`compiled.profile`),
    drawn under the prediction. `bench`: an `ah.bench` result (BenchResult or its dict).
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"render_report needs a Plan, got {type(plan).__name__}")
    bench_dict = _bench_dict(bench)
    title = title or (f"autohybrid plan: {plan.model_ref or 'model ' + plan.model_hash}, "
                      f"{plan.mesh.describe()} on {plan.world_size} ranks")
    sections = [_summary(plan), _mesh(plan), _graph(plan, programs),
                _timeline(plan, measured), _memory(plan), _alternatives(plan)]
    if measured is not None or bench_dict is not None:
        sections.append(_comparison(plan, measured, bench_dict))
    subtitle = (f"{plan.mesh.describe()} · {plan.world_size} ranks · plan {plan.hash()} · "
                f"model graph {plan.model_hash}")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width\"><title>{esc(title)}</title>"
            f"<style>{CSS}</style></head><body><header><h1>{esc(title)}</h1>"
            f"<p>{esc(subtitle)}</p></header><main>" + "\n".join(sections)
            + "</main></body></html>\n")


def write_report(path: str | Path, plan: Plan, **kwargs: Any) -> Path:
    """Write `render_report(plan, **kwargs)` to `path`; returns the path."""
    path = Path(path)
    path.write_text(render_report(plan, **kwargs), encoding="utf-8")
    return path


# ---------------------------------------------------------------------- helpers
def _section(sid: str, heading: str, body: str) -> str:
    return f'<section id="{sid}"><h2>{esc(heading)}</h2>{body}</section>'


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]],
           numeric: frozenset[int] | set[int] = frozenset(), cls: str = "") -> str:
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(
        f'<td{" class=num" if i in numeric else ""}>{esc(c)}</td>' for i, c in enumerate(row))
        + "</tr>" for row in rows)
    klass = f' class="{cls}"' if cls else ""
    return f"<table{klass}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _legend(items: Sequence[tuple[str, str]]) -> str:
    return '<div class="legend">' + "".join(
        f'<span><span class="sw" style="background:{color}"></span>{esc(label)}</span>'
        for label, color in items) + "</div>"


def _stage_legend(stages: int, stage_ranks: Sequence[int]) -> str:
    return _legend([(f"stage {s} (pp rank {stage_ranks[s] if s < len(stage_ranks) else s})",
                     stage_color(s)[0]) for s in range(stages)])


def _bench_dict(bench: Any) -> dict[str, Any] | None:
    if bench is None or isinstance(bench, dict):
        return bench
    if hasattr(bench, "to_dict"):
        return bench.to_dict()
    raise TypeError(f"bench must be an ah.bench result or its dict, got {type(bench).__name__}")


# ---------------------------------------------------------------------- sections
def _summary(plan: Plan) -> str:
    p, m = plan.predicted, plan.predicted.memory
    cards = [
        ("mesh", plan.mesh.describe()), ("ranks", plan.world_size),
        ("step time", fmt_time(p.step_time_s)), ("compute", fmt_time(p.compute_s)),
        ("communication", f"{fmt_time(p.comm_s)} ({fmt_time(p.exposed_comm_s)} exposed)"),
        ("pipeline bubble", f"{p.bubble_fraction * 100:.1f} %"), ("MFU", f"{p.mfu * 100:.1f} %"),
        ("memory / rank", f"{fmt_bytes(m.total)} of {fmt_bytes(p.device_memory_bytes)}"),
        ("batch", f"{plan.global_batch} = dp {plan.mesh.dp} × {plan.microbatch_size} × "
                  f"{plan.num_microbatches} microbatches"),
        ("schedule", plan.schedule + (f" ×{plan.virtual_stages}" if plan.virtual_stages > 1
                                      else "")),
        ("ZeRO / recompute", f"{plan.zero} / {plan.recompute}"),
        ("dtype / optimizer", f"{plan.dtype} / {plan.optimizer}"),
    ]
    body = '<div class="cards">' + "".join(
        f'<div class="card"><div class="k">{esc(k)}</div><div class="v">{esc(v)}</div></div>'
        for k, v in cards) + "</div>"
    facts = [("cluster", plan.cluster), ("model", plan.model_ref or "(not recorded)"),
             ("gradient sync", f"{plan.collective_algorithm}, {plan.bucket_mb:g} MB buckets"),
             ("stage boundaries", ", ".join(plan.stage_boundaries) or "none")]
    if plan.collective_matmul_layers:
        facts.append(("collective matmul", ", ".join(f"{c.layer} ({c.chunks} chunks)"
                                                     for c in plan.collective_matmul_layers)))
    body += _table(("", ""), facts)
    if not plan.executable:
        body += (f'<p class="bad">Not executable yet: '
                 f'{esc("; ".join(plan.not_executable_because))}</p>')
    return _section("summary", "Summary", body)


def _mesh(plan: Plan) -> str:
    legend = _legend([(f"pp rank {i}", stage_color(i)[0]) for i in range(plan.mesh.pp)])
    note = (f'<p class="note">Ranks are laid out row-major over (pp, dp, tp); tp '
            f'{"stays inside a node" if _tp_in_node(plan) else "spans nodes"}.</p>')
    return _section("mesh", "Mesh and placement", legend + mesh_svg(plan) + note)


def _tp_in_node(plan: Plan) -> bool:
    node = {p.rank: p.node for p in plan.placement}
    tp = plan.mesh.tp
    return all(node[r] == node[r - r % tp] for r in range(plan.world_size))


def _programs(plan: Plan, programs: Any) -> tuple[list[Any], str]:
    """The programs to draw and, when there are none, why."""
    if programs is None:
        if not plan.model_ref:
            return [], ("the plan does not record its model (plan.model_ref), so its program "
                        "cannot be rebuilt; pass programs= or make the plan with model_ref")
        from .program import rank_program
        try:
            return [rank_program(plan, 0)], ""
        except AutohybridError as exc:
            return [], f"rank 0's program could not be rebuilt: {exc}"
    if hasattr(programs, "gm"):
        return [programs], ""
    programs = list(programs.values() if isinstance(programs, dict) else programs)
    return programs, "" if programs else "no program given"


def _graph(plan: Plan, programs: Any) -> str:
    progs, why = _programs(plan, programs)
    if not progs:
        return _section("graph", "Program graph", f'<p class="note">{esc(why)}</p>')
    view = coarse_view(progs[0], plan=plan)
    legend = _stage_legend(view.num_stages, view.stage_ranks) + _legend(
        [("collective inserted by a pass (◆)", COMM_COLOR),
         ("pipeline send (dashed)", "#111827")])
    notes = "".join(f'<p class="note">{esc(n)}</p>' for n in view.notes)
    totals = view.collectives()
    table = _table(("collective", "count in the program"), sorted(totals.items()), {1}) \
        if totals else ('<p class="note">no collectives inside the graph (no tensor or '
                        'sequence parallelism); the data-parallel gradient sync and pipeline '
                        'transfers are run by the runtime around it</p>')
    dot = (f"<details><summary>Graphviz DOT of this view (render with "
           f"<code>dot -Tsvg</code>)</summary><pre>{esc(to_dot(view))}</pre></details>")
    heading = f"Program graph: {view.title}, {len(view.groups)} groups, {view.num_stages} stages"
    return _section("graph", heading, legend + graph_svg(view) + notes + table + dot)


def _timeline(plan: Plan, measured: Timeline | None) -> str:
    timelines = [predicted_timeline(plan)] + ([measured] if measured is not None else [])
    legend = _legend([("forward", PHASE_COLORS["forward"]),
                      ("backward", PHASE_COLORS["backward"]),
                      ("optimizer", PHASE_COLORS["optimizer"]),
                      ("communication (lower strip)", COMM_COLOR),
                      ("bubble / idle", BUBBLE_COLOR)])
    note = ('<p class="note">The prediction places the cost model\'s totals in the '
            "schedule's order (report/timeline.py); measured rows come from torch.profiler."
            "</p>")
    return _section("timeline", "Timeline of one step" + (": predicted and measured"
                                                          if measured is not None else ""),
                    legend + timeline_svg(timelines) + note)


def _memory(plan: Plan) -> str:
    mems = memory_per_rank(plan)
    legend = _legend([(label, color) for _, label, color in MEMORY_PARTS]
                     + [("device memory", "#dc2626")])
    rows, seen = [], set()
    for rank, m in enumerate(mems):
        pp = plan.mesh.coords(rank)[0]
        if pp in seen:
            continue
        seen.add(pp)
        ranks = [r for r in range(plan.world_size) if plan.mesh.coords(r)[0] == pp]
        rows.append((pp, ", ".join(map(str, ranks)), fmt_bytes(m.params), fmt_bytes(m.grads),
                     fmt_bytes(m.optimizer), fmt_bytes(m.activations), fmt_bytes(m.total)))
    table = _table(("pp rank", "ranks", "parameters", "gradients", "optimizer",
                    "activations", "total"), rows, {2, 3, 4, 5, 6})
    return _section("memory", "Predicted memory per rank", legend + memory_svg(plan) + table)


def _alternatives(plan: Plan) -> str:
    if not plan.alternatives:
        return _section("alternatives", "Alternatives",
                        '<p class="note">no runner-up plans were recorded</p>')
    rows = [(plan.summary().split(" |")[0], fmt_time(plan.predicted.step_time_s),
             fmt_bytes(plan.predicted.memory_per_rank_bytes), "yes",
             "yes" if plan.executable else "no", "chosen")]
    runs = {True: "yes", False: "no", None: "not tried"}  # None: its passes were not run
    rows += [(a.summary, fmt_time(a.step_time_s), fmt_bytes(a.memory_per_rank_bytes),
              "yes" if a.fits else "no", runs[a.executable], a.reason)
             for a in plan.alternatives]
    return _section("alternatives", "Alternatives and why they lost",
                    _table(("plan", "step time", "memory / rank", "fits", "executable",
                            "why it lost"), rows, {1, 2}, cls="alternatives"))


def _comparison(plan: Plan, measured: Timeline | None, bench: dict[str, Any] | None) -> str:
    body = ""
    p = plan.predicted
    if measured is not None:
        rows = []
        for s in measured.summaries():
            rows.append((s.rank, s.step, fmt_time(s.step_time_s), fmt_time(p.step_time_s),
                         fmt_time(s.compute_s), fmt_time(s.exposed_comm_s),
                         fmt_time(p.exposed_comm_s)))
        body += "<h3>Measured timeline</h3>" + _table(
            ("rank", "step", "measured step", "predicted step", "measured compute",
             "measured exposed comm", "predicted exposed comm"), rows, {2, 3, 4, 5, 6})
    if bench is not None:
        body += "<h3>Bench</h3>" + bench_svg(bench) + _bench_table(plan, bench)
    return _section("comparison", "Predicted vs measured", body)


def _bench_table(plan: Plan, bench: dict[str, Any]) -> str:
    rows = []
    for r in bench.get("runs") or []:
        ok = bool(r.get("available"))
        peak = r.get("peak_memory_bytes") or []
        rows.append((r.get("name", "?"), r.get("kind", ""),
                     fmt_time(r["median_s"]) if ok and r.get("median_s") is not None else "n/a",
                     f"{r['samples_per_s']:.1f}" if ok and r.get("samples_per_s") else "n/a",
                     fmt_bytes(max(peak)) if peak else "n/a",
                     fmt_time(r["exposed_comm_s"]) if r.get("exposed_comm_s") is not None
                     else "n/a", "" if ok else (r.get("reason") or "unavailable")))
    pred = bench.get("predicted") or {}
    rows.append(("prediction", "plan",
                 fmt_time(pred.get("step_time_s", plan.predicted.step_time_s)), "",
                 fmt_bytes(plan.predicted.memory.total), fmt_time(plan.predicted.exposed_comm_s),
                 ""))
    table = _table(("run", "kind", "median step", "samples/s", "peak memory (max rank)",
                    "exposed comm", "note"), rows, {2, 3, 4, 5}, cls="bench")
    check = bench.get("loss_check")
    if check:
        ok = check.get("ok", check.get("passed"))
        label = {True: '<span class="good">losses match</span>',
                 False: '<span class="bad">losses differ</span>'}.get(ok, "")
        table += f"<p>{label} <span class=note>{esc(check)}</span></p>"
    return table
