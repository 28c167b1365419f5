"""The HTML plan report, its SVG drawings and the DOT export, opened in headless Chromium.

One plan (a 4-layer tiny GPT on 4 local ranks, pinned pp=2 × tp=2 with sequence
parallelism) and rank 0's rewritten program are built once; the tests then check

* the coarse graph view against the program itself (stages, shardings, collective counts),
  and that folding repeated blocks keeps the counts;
* the DOT text structurally (balanced braces outside strings, one cluster per stage,
  every edge endpoint declared), for the coarse and the per-node view;
* that a hostile model name and title are escaped;
* the report as Chromium parses it (`--dump-dom`: one `.stage` per pipeline stage, one
  timeline row per rank and timeline, one memory bar per rank, ...) and draws it
  (`--screenshot`: the graph area holds both stage colors, collective markers and many
  distinct colors; the timeline's backward and communication colors are painted).

Chromium: /usr/bin/chromium (Debian's package; `make` installs it in CI). Its absence is
a failure, not a skip: a report test that silently skips proves nothing, and the CI image
is built with it. Set AUTOHYBRID_CHROMIUM to use another binary.
"""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

import autohybrid as ah
from _limits import guard
from autohybrid.graph import op_name
from autohybrid.models import spec
from autohybrid.report import graphview
from autohybrid.report.html import render_report, write_report
from autohybrid.report.program import rank_program
from autohybrid.report.timeline import Timeline, predicted_timeline

MODEL = "gpt-tiny?layers=4&batch=4"
CHROMIUM = os.environ.get("AUTOHYBRID_CHROMIUM", "/usr/bin/chromium")
HOSTILE = '<script>alert("x")</script>&<b>'


@pytest.fixture(scope="module")
def built():
    """(plan, rank 0's program) for MODEL with pp=2, tp=2 pinned."""
    workload = spec.parse(MODEL).build(device="meta")
    # captures dominate the time: the plan from the forward graph alone, the program's
    # training graph (with the loss) once, without re-checking the forward graph's hash
    plan = ah.plan(workload.model, ah.Cluster.local(4), workload.inputs,
                   constraints=ah.Constraints(pp=2, tp=2, dp=1, sp=True), model_ref=MODEL)
    assert plan.mesh.pp == 2 and plan.mesh.tp == 2 and plan.num_stages == 2
    return plan, rank_program(plan, 0, workload, check=False)


# ---------------------------------------------------------------------- graph view
def _program_collectives(graphs) -> dict[str, int]:
    """autohybrid collectives in `graphs`, an issued one counted once (at its wait)."""
    counts: dict[str, int] = {}
    for gm in graphs:
        for sub in gm.modules():
            for node in getattr(getattr(sub, "graph", None), "nodes", ()):
                name = op_name(node) if node.op == "call_function" else ""
                short = name.split(".")[1] if name.startswith("autohybrid.") else ""
                if short and short not in graphview.COMPUTE_ONLY and not short.endswith("_start"):
                    key = short.removesuffix("_wait")
                    counts[key] = counts.get(key, 0) + 1
    return counts


def test_coarse_view_matches_program(built):
    plan, program = built
    view = graphview.coarse_view(program)
    names = [g.name for g in view.groups]
    for layer in range(4):
        assert f"blocks.{layer}.attn" in names and f"blocks.{layer}.mlp" in names, names
    assert names[0] in ("tok_emb", "pos_emb") and names[-1] == "loss", names
    stages = [g.stage for g in view.groups]
    assert stages == sorted(stages) and set(stages) == {0, 1}
    attn = view.groups[names.index("blocks.0.attn")]
    assert attn.sharding == "column: qkv · row: proj"
    assert dict(attn.collectives).get("sp_gather") == 1
    assert "vocab-parallel" in view.groups[names.index("tok_emb")].sharding
    # every collective of every stage lands in exactly one group of that stage
    split = program.pipeline
    for stage in split.stages:
        got: dict[str, int] = {}
        for g in view.groups:
            if g.stage == stage.index:
                for op, n in g.collectives:
                    got[op] = got.get(op, 0) + n
        assert got == _program_collectives([stage.gm]), stage.index
    assert any(e.crosses_stage for e in view.edges)
    order = {g.id: i for i, g in enumerate(view.groups)}
    assert all(order[e.src] < order[e.dst] for e in view.edges)


def test_fold_keeps_counts(built):
    _, program = built
    full = graphview.coarse_view(program)
    folded = graphview.coarse_view(program, max_groups=8)
    assert folded.folded and len(folded.groups) < len(full.groups)
    assert any(g.repeat == 2 and g.name.startswith("blocks.") for g in folded.groups)
    assert folded.collectives() == full.collectives()
    assert {g.stage for g in folded.groups} == {0, 1}


# ---------------------------------------------------------------------- DOT
def _dot_structure(text: str) -> tuple[list[str], set[str], list[tuple[str, str]]]:
    """(cluster names, declared node ids, edges) of DOT `text`, checking that braces
    and brackets balance outside quoted strings."""
    strings: list[str] = []
    bare = re.sub(r'"((?:[^"\\]|\\.)*)"', lambda m: strings.append(m.group(1)) or
                  f"@{len(strings) - 1}@", text)
    depth = 0
    for ch in bare:
        depth += {"{": 1, "}": -1}.get(ch, 0)
        assert depth >= 0, "a '}' closes nothing"
    assert depth == 0, "unbalanced braces"
    assert bare.count("[") == bare.count("]")
    assert re.match(r"\s*digraph @\d+@ \{", bare)
    name = lambda ref: strings[int(ref.strip("@"))]
    clusters = [name(m) for m in re.findall(r"subgraph (@\d+@)", bare)]
    nodes = {name(m) for m in re.findall(r"^\s*(@\d+@) \[label", bare, re.M)}
    edges = [(name(a), name(b)) for a, b in re.findall(r"(@\d+@) -> (@\d+@)", bare)]
    return clusters, nodes, edges


def test_dot_is_well_formed(built, tmp_path):
    plan, program = built
    view = graphview.coarse_view(program)
    path = graphview.write_dot(tmp_path / "rank0.dot", program)
    clusters, nodes, edges = _dot_structure(path.read_text())
    assert clusters == [f"cluster_stage{s}" for s in range(plan.num_stages)]
    assert nodes == {g.id for g in view.groups}
    assert edges and all(a in nodes and b in nodes for a, b in edges)
    assert 'label="send", style=dashed' in path.read_text()

    full = graphview.node_view(program)
    clusters, nodes, edges = _dot_structure(graphview.to_dot(full))
    assert len(clusters) == 2 and len(nodes) == len(full.groups) > 3 * len(view.groups)
    assert all(a in nodes and b in nodes for a, b in edges)
    text = graphview.to_dot(dataclasses.replace(view, title='a "quoted" \\ title'))
    assert _dot_structure(text)[1] == {g.id for g in view.groups}


def test_hostile_text_is_escaped(built):
    plan, _ = built
    hostile = dataclasses.replace(plan, model_ref=HOSTILE, alternatives=tuple(
        dataclasses.replace(a, reason=HOSTILE) for a in plan.alternatives))
    # programs=None rebuilds from model_ref: the unknown model becomes an escaped note
    html = render_report(hostile, title=HOSTILE)
    assert "<script" not in html and "<b>" not in html
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;&amp;&lt;b&gt;" in html
    assert "could not be rebuilt" in html


# ---------------------------------------------------------------------- Chromium
def _chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium package "
                    "(`apt-get install chromium`, as `make` does) or set AUTOHYBRID_CHROMIUM")
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
           "--disable-background-networking", "--disable-component-update", "--no-first-run",
           f"--user-data-dir={tmp_path / 'chromium-profile'}", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=guard(90))
    assert done.returncode == 0, f"chromium failed ({done.returncode}): {done.stderr[-2000:]}"
    return done


class _Elements(HTMLParser):
    """Every element's tag, attributes and the ids of the sections it is inside."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[str, dict[str, str], str]] = []
        self.sections: list[str] = []
        self.stack: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = {k: v or "" for k, v in attrs}
        section = attrs.get("id", "") if tag == "section" else (self.sections or [""])[-1]
        if tag == "section":
            self.sections.append(section)
        self.found.append((tag, attrs, section))
        if tag not in ("meta", "br", "img", "input", "link"):
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.found.append((tag, {k: v or "" for k, v in attrs}, (self.sections or [""])[-1]))

    def handle_endtag(self, tag):
        while self.stack:
            top = self.stack.pop()
            if top == "section":
                self.sections.pop()
            if top == tag:
                break

    def select(self, section: str, cls: str, **data: str) -> list[dict[str, str]]:
        return [a for _, a, s in self.found if s == section and cls in a.get("class", "").split()
                and all(a.get(f"data-{k}") == v for k, v in data.items())]


def _measured_like(plan) -> Timeline:
    """A 'measured' timeline: the prediction 30 % slower, as the profiler would give."""
    tl = predicted_timeline(plan)
    for ivs in tl.ranks.values():
        for iv in ivs:
            iv.start_s, iv.end_s = iv.start_s * 1.3, iv.end_s * 1.3
    return Timeline("measured", tl.ranks, {})


def _colored(rgb: np.ndarray, hex_color: str) -> np.ndarray:
    want = [int(hex_color[i:i + 2], 16) for i in (1, 3, 5)]
    return np.all(rgb == want, axis=-1)


@pytest.mark.procs
def test_report_in_chromium(built, tmp_path):
    plan, program = built
    bench = {"model": MODEL, "predicted": {"step_time_s": plan.predicted.step_time_s},
             "runs": [{"name": "eager", "kind": "eager", "available": True, "median_s": 4e-3,
                       "min_s": 3e-3, "max_s": 5e-3, "samples_per_s": 1e3,
                       "peak_memory_bytes": [2**20]},
                      {"name": "baseline", "kind": "baseline", "available": False,
                       "reason": HOSTILE}],
             "loss_check": {"ok": True}}
    path = write_report(tmp_path / "report.html", plan, programs=[program], bench=bench,
                        measured=_measured_like(plan), title=HOSTILE)
    dom = _chromium(tmp_path, "--dump-dom", path.as_uri()).stdout
    parsed = _Elements()
    parsed.feed(dom)
    ids = [a.get("id") for tag, a, _ in parsed.found if tag == "section"]
    assert ids == ["summary", "mesh", "graph", "timeline", "memory", "alternatives",
                   "comparison"]
    assert not [t for t, _, _ in parsed.found if t == "script"]
    assert HOSTILE in dom.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")

    stages = parsed.select("graph", "stage")
    assert sorted(a["data-stage"] for a in stages) == ["0", "1"]
    view = graphview.coarse_view(program)
    assert len(parsed.select("graph", "layer")) == len(view.groups)
    assert len(parsed.select("graph", "layer", stage="1")) == \
        sum(g.stage == 1 for g in view.groups)
    assert parsed.select("graph", "collective", op="sp_gather")
    for source in ("predicted", "measured"):
        rows = parsed.select("timeline", "timeline-row", source=source)
        assert sorted(int(a["data-rank"]) for a in rows) == list(range(plan.world_size))
    bars = parsed.select("memory", "mem-bar")
    assert sorted(int(a["data-rank"]) for a in bars) == list(range(plan.world_size))
    assert len(parsed.select("memory", "mem-seg")) == 4 * plan.world_size
    assert len(parsed.select("mesh", "gpu")) == plan.world_size
    assert len(parsed.select("comparison", "bench-bar")) == 2

    shot = tmp_path / "report.png"
    _chromium(tmp_path, "--window-size=1400,4000", f"--screenshot={shot}", path.as_uri())
    import matplotlib.image as mpimg
    rgb = (mpimg.imread(shot)[..., :3] * 255).round().astype(np.int32)
    # the graph's stage bands: rows where a stage's fill spans most of the width
    rows0 = np.nonzero(_colored(rgb, graphview.stage_color(0)[0]).sum(axis=1) > 600)[0]
    rows1 = np.nonzero(_colored(rgb, graphview.stage_color(1)[0]).sum(axis=1) > 600)[0]
    assert len(rows0) and len(rows1), "the graph's stage bands were not painted"
    area = rgb[rows0.min():rows1.max() + 1]
    assert area.shape[0] > 200
    white = np.all(area >= 248, axis=-1).mean()
    colors = len(np.unique(area.reshape(-1, 3) @ np.array([65536, 256, 1])))
    assert white < 0.7 and colors > 100, (white, colors)
    assert _colored(area, "#f97316").sum() > 50, "no collective markers in the graph area"
    assert _colored(rgb, "#8b5cf6").sum() > 500, "no backward compute in the timeline"
