"""Rich terminal reports (report/terminal.py) and matplotlib plots (report/plots.py)."""
from __future__ import annotations

import copy
import dataclasses
import io
import xml.etree.ElementTree as ET

import matplotlib.image
import pytest
import torch

import autohybrid as ah
from autohybrid import logs
from autohybrid.plan import MemoryBreakdown
from autohybrid.report import plots, terminal
from autohybrid.report.timeline import predicted_timeline

from rich.console import Console

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SVG_NS = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def plan():
    ids = torch.zeros(8, 16, dtype=torch.long, device="meta")
    model = ah.models.gpt(layers=4, hidden=32, heads=2, vocab=64, seq=16, device="meta")
    return ah.plan(model, ah.Cluster.local(4), (ids,), constraints=ah.Constraints(pp=2, tp=2))


def _run(name, kind, median, **extra):
    times = [median * 0.95, median, median * 1.1]
    run = {"name": name, "kind": kind, "available": True, "reason": None,
           "step_times_s": times, "median_s": median, "min_s": min(times),
           "max_s": max(times), "iqr_s": median * 0.08, "samples_per_s": 8 / median,
           "tokens_per_s": 128 / median, "peak_memory_bytes": [3 * 2**20, 5 * 2**20],
           "memory_measure": "rss", "exposed_comm_s": 0.001, "losses": [4.1, 4.0]}
    run.update(extra)
    return run


@pytest.fixture()
def bench():
    return {
        "model": "gpt-tiny", "cluster": "local:4", "world_size": 4, "global_batch": 8,
        "steps": 5, "warmup": 2,
        "plan": {"summary": "pp2×dp1×tp2", "mesh": "pp2×dp1×tp2+sp", "hash": "abc"},
        "predicted": {"step_time_s": 0.004, "exposed_comm_s": 0.001,
                      "memory_per_rank_bytes": 2**20},
        "runs": [_run("eager", "eager", 0.010), _run("compiled", "compiled", 0.005),
                 _run("ddp", "baseline", 0.008, peak_memory_bytes=[None, 4 * 2**20]),
                 {"name": "fsdp", "kind": "baseline", "available": False,
                  "reason": "FSDP needs CUDA on this torch"}],
        "loss_check": {"max_abs_diff": 2e-6, "max_rel_diff": 5e-7, "tolerance": 1e-4,
                       "ok": True},
    }


def _render(renderables, width=200) -> str:
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=False, width=width)
    for r in renderables:
        console.print(r)
    return buf.getvalue()


def _row(text: str, first_cell: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip("│ ").startswith(first_cell)]
    assert len(lines) == 1, (first_cell, text)
    return lines[0]


# ---------------------------------------------------------------------- terminal
def test_plan_tables(plan):
    out = _render(terminal.plan_tables(plan))
    assert "\x1b" not in out
    assert plan.mesh.describe() in out and "pp2×dp1×tp2" in out
    assert f"{plan.schedule}, {plan.num_stages} stages" in out
    assert f"{plan.bucket_mb:g} MB" in out and plan.collective_algorithm in out
    assert terminal.format_seconds(plan.predicted.step_time_s) in out
    # memory: one row per pp coordinate, with the ranks it covers (row-major pp, dp, tp)
    assert "0–1" in _row(out, "0 ") and "2–3" in _row(out, "1 ")
    per_pp = getattr(plan.predicted, "memory_per_pp_rank", ()) or (plan.predicted.memory,) * 2
    for k in (0, 1):
        assert terminal.format_bytes(per_pp[k].total) in _row(out, f"{k} ")
    assert plan.alternatives
    for alt in plan.alternatives:
        assert alt.reason in _row(out, alt.summary.split(" |")[0])


def test_memory_table_uses_per_pp_breakdown(plan):
    small, big = MemoryBreakdown(1024, 1024, 2048, 0), MemoryBreakdown(0, 0, 0, 3 * 2**20)
    pred = plan.predicted
    if "memory_per_pp_rank" in {f.name for f in dataclasses.fields(pred)}:
        pred = dataclasses.replace(pred, memory_per_pp_rank=(small, big))
    else:  # before the lead adds the field: read through getattr like the module does
        pred = copy.copy(pred)
        object.__setattr__(pred, "memory_per_pp_rank", (small, big))
    other = copy.copy(plan)
    object.__setattr__(other, "predicted", pred)
    out = _render([terminal.memory_table(other)])
    assert "4.00 KiB" in _row(out, "0 ") and "3.00 MiB" not in _row(out, "0 ")
    assert "3.00 MiB" in _row(out, "1 ")


def test_format_helpers():
    assert terminal.format_ranks([5, 0, 2, 1]) == "0–2, 5"
    assert terminal.format_bytes(1536) == "1.50 KiB"
    assert terminal.format_bytes(3 * 2**40) == "3.00 TiB"
    assert terminal.format_seconds(0.0123) == "12.3 ms"
    assert terminal.format_seconds(2.5e-5) == "25.0 µs"


def test_bench_table(bench):
    out = _render(terminal.bench_renderables(bench), width=80)
    assert "\x1b" not in out and "…" not in out            # nothing cropped at 80 columns
    assert "median" in out and "ms" in out and "MiB" in out
    cells = {ln.split()[0]: ln.split()[1:] for ln in out.splitlines()
             if ln.split() and ln.split()[0] in ("eager", "compiled", "ddp", "fsdp")}
    # median, min–max, samples/s, × eager, × baseline, peak MiB, exposed ms, predicted ms
    assert cells["compiled"] == ["5.00", "4.75–5.50", "1,600", "2.00×", "1.60×", "5.00",
                                 "1.00", "4.00"]
    assert cells["eager"][3:5] == ["1.00×", "0.80×"] and cells["eager"][-1] == "—"
    assert cells["ddp"][5] == "4.00"                         # the rank that measured
    assert cells["fsdp"] == ["n/a"]
    assert "n/a fsdp (baseline): FSDP needs CUDA on this torch" in out
    assert "baseline 'ddp'" in out and "peak memory: rss" in out
    assert "loss check: ok" in out and "tolerance 0.0001" in out
    bench["loss_check"]["ok"] = False
    assert "loss check: FAILED" in _render(terminal.bench_renderables(bench))


def test_progress_factory_counts_and_stays_plain():
    buf = io.StringIO()
    factory = terminal.rich_progress_factory(Console(file=buf, force_terminal=False, width=100))
    logs.set_progress_factory(factory)
    try:
        with logs.progress(7, "search plans") as outer:
            with logs.progress(3, "calibrate") as inner:   # nested bars share one display
                for _ in range(3):
                    inner.advance()
            outer.advance(5)
            outer.advance()
    finally:
        logs.set_progress_factory(None)
    assert (outer.completed, inner.completed) == (6, 3)
    out = buf.getvalue()
    assert "\x1b" not in out
    assert "search plans" in out and "6/7" in out and "3/3" in out


# ---------------------------------------------------------------------- plots
def _svg_ids(path) -> list[str]:
    root = ET.parse(path).getroot()
    assert root.tag == SVG_NS + "svg"
    return [el.get("id") for el in root.iter() if el.get("id")]


def _png_shape(path) -> tuple[int, ...]:
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    return matplotlib.image.imread(path).shape


def test_plot_timeline(plan, tmp_path):
    tl = predicted_timeline(plan)
    png = plots.plot_timeline(tl, tmp_path / "tl.png", title="predicted")
    height, width, _ = _png_shape(png)
    assert width == 1000 and height > 100
    measured = dataclasses.replace(tl, source="measured")
    svg = plots.plot_timeline(measured, tmp_path / "tl.svg", others=[tl])
    ids = _svg_ids(svg)
    for source in ("measured", "predicted"):
        assert {i for i in ids if i.startswith(f"{source}-rank-") and i.endswith("-compute")} \
            == {f"{source}-rank-{r}-compute" for r in range(plan.world_size)}
    # the pipeline's bubble and its exposed communication are drawn on every rank
    assert {f"predicted-rank-{r}-{kind}" for r in range(4)
            for kind in ("bubble", "communication")} <= set(ids)


def test_plot_memory(plan, tmp_path):
    ids = _svg_ids(plots.plot_memory(plan, tmp_path / "mem.svg"))
    for part in ("params", "grads", "optimizer", "activations"):
        assert sorted(i for i in ids if i.startswith("memory-") and i.endswith(f"-{part}")) \
            == [f"memory-rank-{r}-{part}" for r in range(plan.world_size)]
    assert plan.predicted.device_memory_bytes > 4 * plan.predicted.memory.total
    assert "device-limit-note" in ids and "device-limit-line" not in ids
    assert _png_shape(plots.plot_memory(plan, tmp_path / "mem.png"))[0] == 450
    # a device close to full: the limit is drawn as a line over the bars
    near = dataclasses.replace(plan.predicted,
                               device_memory_bytes=plan.predicted.memory.total * 2)
    tight = copy.copy(plan)
    object.__setattr__(tight, "predicted", near)
    ids = _svg_ids(plots.plot_memory(tight, tmp_path / "tight.svg"))
    assert "device-limit-line" in ids and "device-limit-note" not in ids


def test_plot_memory_per_pp_coordinate_on_large_meshes(plan, tmp_path, monkeypatch):
    monkeypatch.setattr(plots, "MAX_RANK_BARS", 2)
    ids = _svg_ids(plots.plot_memory(plan, tmp_path / "mem.svg"))
    assert sorted(i for i in ids if i.startswith("memory-") and i.endswith("-params")) \
        == ["memory-pp-0-params", "memory-pp-1-params"]


def test_plot_bench(bench, tmp_path):
    ids = _svg_ids(plots.plot_bench(bench, tmp_path / "bench.svg"))
    assert sorted(i for i in ids if i.startswith("step-")) == \
        ["step-compiled", "step-ddp", "step-eager"]
    assert sorted(i for i in ids if i.startswith("throughput-")) == \
        ["throughput-compiled", "throughput-ddp", "throughput-eager"]
    assert {"na-fsdp", "predicted-step"} <= set(ids)
    assert len(_png_shape(plots.plot_bench(bench, tmp_path / "bench.png"))) == 3
    assert (tmp_path / "bench.png").stat().st_size > 1000


def test_plot_errors(plan, bench, tmp_path):
    with pytest.raises(ValueError, match=r"\.png"):
        plots.plot_memory(plan, tmp_path / "mem.jpg")
    with pytest.raises(ValueError, match="no runs"):
        plots.plot_bench({**bench, "runs": []}, tmp_path / "b.png")
    empty = dataclasses.replace(predicted_timeline(plan), ranks={})
    with pytest.raises(ValueError, match="no ranks"):
        plots.plot_timeline(empty, tmp_path / "t.svg")
    with pytest.raises(ValueError, match="no intervals"):
        plots.plot_timeline(dataclasses.replace(empty, ranks={0: []}), tmp_path / "t.svg")
    assert not list(tmp_path.iterdir())
