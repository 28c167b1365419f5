"""`ah.bench` (autohybrid/bench.py) and the hand-written baselines (autohybrid/baselines.py).

Three real benches on a tiny GPT over 2 local ranks (one `ah.launch` each): dp with DDP,
tp with DTensor, pp with pipelining; each checks the JSON's content — losses of the
compiled run and of the baseline equal eager's, positive times with consistent
statistics, one memory figure per rank of a sensible size, exposed communication. The
rest runs without processes: which layouts get no baseline and why (on real plans), the
statistics and the table from synthetic per-rank data, the memory measure's parts, and
bad input.
"""
from __future__ import annotations

import json
import math
import statistics

import pytest
import torch
import torch.nn.functional as F

import autohybrid as ah
from _limits import guard
from autohybrid import baselines, cli
from autohybrid.bench import (CPU_MEASURE, BenchError, _Job, aggregate, bench,
                              held_tensor_bytes, loss_check, step_stats, transient_peak)
from autohybrid.errors import ClusterError, ModelError
from autohybrid.report.breakdown import StepBreakdown
from autohybrid.report.timeline import Timeline

TINY = dict(layers=2, hidden=32, heads=2, vocab=64, seq=16)
MODEL = "gpt-tiny?layers=2&hidden=32&heads=2&vocab=64&seq=16&batch=8"
KEYS = {"model", "cluster", "world_size", "global_batch", "steps", "warmup", "plan",
        "predicted", "runs", "loss_check"}
RUN_KEYS = {"name", "kind", "available", "reason", "step_times_s", "median_s", "min_s",
            "max_s", "iqr_s", "samples_per_s", "tokens_per_s", "peak_memory_bytes",
            "memory_measure", "exposed_comm_s", "losses"}
STEPS, WARMUP = 2, 1
CPU2 = ah.Cluster.local(2, device_type="cpu")  # the CPU memory measure, also on GPU hosts


def _param_bytes(**overrides) -> int:
    torch.manual_seed(0)
    model = ah.models.gpt(**{**TINY, **overrides})
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _check_result(result, baseline: str, world: int = 2, model_bytes: int | None = None
                  ) -> dict:
    """What every real bench must satisfy; returns the JSON dict."""
    data = json.loads(result.to_json())
    _check_data(data, result.format_table(), baseline, world, model_bytes)
    assert "MISMATCH" not in result.format_table()
    return data


def _check_data(data: dict, table: str, baseline: str, world: int = 2,
                model_bytes: int | None = None) -> None:
    """The JSON's content (and the printed table's) of a real bench."""
    assert KEYS <= set(data) and data["world_size"] == world and data["global_batch"] == 8
    assert (data["steps"], data["warmup"]) == (STEPS, WARMUP)
    assert {"summary", "mesh", "hash"} <= set(data["plan"]) and data["plan"]["hash"]
    assert data["predicted"]["step_time_s"] > 0 and data["predicted"]["memory_per_rank_bytes"] > 0
    runs = {r["name"]: r for r in data["runs"]}
    assert list(runs) == ["eager", "autohybrid", baseline], list(runs)
    assert [r["kind"] for r in data["runs"]] == ["eager", "compiled", "baseline"]
    for run in data["runs"]:
        assert RUN_KEYS <= set(run) and run["available"], run
        times = run["step_times_s"]
        assert len(times) == STEPS and all(t > 0 for t in times), run
        assert run["min_s"] <= run["median_s"] <= run["max_s"] and run["iqr_s"] >= 0
        assert run["samples_per_s"] == pytest.approx(8 / run["median_s"])
        assert run["tokens_per_s"] == pytest.approx(8 * TINY["seq"] / run["median_s"])
        ranks = 1 if run["kind"] == "eager" else world
        assert len(run["peak_memory_bytes"]) == ranks and run["memory_measure"] == CPU_MEASURE
        assert len(run["losses"]) == STEPS + WARMUP and all(math.isfinite(x) for x in run["losses"])
        assert run["exposed_comm_s"] is not None and run["exposed_comm_s"] >= 0
        parts = StepBreakdown.from_dict(run["breakdown"])  # the median profiled step
        assert parts.step_s > 0 and 0 < parts.compute_s <= parts.step_s * 1.001, parts
        assert 0 <= parts.waits_s <= parts.step_s and parts.ops["matmul"] > 0, parts
    eager = runs["eager"]
    # the compiled run's steps are those paired with the baseline's, one after the other
    paired = [a / b for a, b in zip(runs["autohybrid"]["step_times_s"],
                                    runs[baseline]["step_times_s"])]
    assert runs["autohybrid"]["paired_ratio"] == pytest.approx(statistics.median(paired))
    # one process holds the whole model, its gradients and the whole batch's activations
    assert eager["peak_memory_bytes"][0] > 2 * (model_bytes or _param_bytes())
    assert eager["exposed_comm_s"] == 0.0
    for name in ("autohybrid", baseline):
        check = runs[name]["loss_vs_eager"]
        assert check["ok"] and check["max_rel_diff"] <= check["tolerance"], (name, check)
        assert runs[name]["losses"] == pytest.approx(eager["losses"], rel=1e-5)
        assert len(runs[name]["exposed_comm_per_rank_s"]) == world
    assert data["loss_check"] == runs["autohybrid"]["loss_vs_eager"]
    ratio = data["prediction_check"]["measured_over_predicted"]
    assert ratio == pytest.approx(runs["autohybrid"]["median_s"] / data["predicted"]["step_time_s"])
    for name in runs:
        assert name in table
    assert "ok" in table
    assert ah.Plan.from_dict(data["full_plan"]).hash() == data["plan"]["hash"]


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_bench_dp_against_ddp_from_the_cli(tmp_path, capsys):
    """`autohybrid bench` (the CLI, in this process) at dp=2, ZeRO 0 → DDP: the JSON, the
    printed table, the plot, the HTML report with predicted beside measured, the Chrome
    trace of both timelines; the compiled run communicates (exposed communication on a
    profiled step) and each rank holds at least the whole model (dp replicates it).
    `--calibration`: the ranks plan, and the bench predicts, with the profile's figures
    (a profile of a machine 20× slower than the placeholders: the predicted
    communication is the calibrated plan's, not the placeholders')."""
    out, svg, html = tmp_path / "bench.json", tmp_path / "bench.svg", tmp_path / "report.html"
    trace, profile = tmp_path / "trace.json", _slow_profile(tmp_path / "profile.json")
    code = cli.main(["bench", MODEL, "--cluster", "local:2", "--steps", str(STEPS),
                     "--warmup", str(WARMUP), "--constrain",
                     "dp=2,tp=1,pp=1,zero=0,num_microbatches=1", "--out", str(out),
                     "--plot", str(svg), "--report", str(html), "--trace", str(trace),
                     "--breakdown", "--calibration", str(profile)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "paired: autohybrid ÷ DDP, adjacent steps, median" in printed
    # --breakdown: both variants' parts beside the prediction, dp's all-reduce among them
    table = printed[printed.index("where the time goes"):]
    assert table.splitlines()[1].split() == ["ms", "eager", "autohybrid", "DDP", "predicted"]
    assert "communication exposed" in table and "all_reduce exposed/hidden" in table
    data = json.loads(out.read_text())
    _check_data(data, printed, "DDP")
    assert svg.stat().st_size > 0 and "<svg" in svg.read_text()[:500]
    assert "dp2" in data["plan"]["summary"] and "zero0" in data["plan"]["summary"]
    runs = {r["name"]: r for r in data["runs"]}
    for name in ("autohybrid", "DDP"):
        assert min(runs[name]["peak_memory_bytes"]) > _param_bytes()
    assert sum(runs["autohybrid"]["exposed_comm_per_rank_s"]) > 0
    # the measured timeline: both ranks' profiled step, with communication in it
    measured = Timeline.from_dict(data["measured_timeline"])
    assert sorted(measured.ranks) == [0, 1]
    assert all(measured.summary(rank, 0).comm_s > 0 for rank in (0, 1))
    events = json.loads(trace.read_text())["traceEvents"]
    names = sorted(e["args"]["name"] for e in events if e["name"] == "process_name")
    assert names == ["measured rank 0", "measured rank 1", "predicted rank 0",
                     "predicted rank 1"]
    page = html.read_text()
    assert 'id="comparison"' in page and "DDP" in page
    assert page.count('data-source="measured"') == 2 and page.count('data-source="predicted"') == 2
    pinned = dict(dp=2, tp=1, pp=1, zero=0, num_microbatches=1)
    placeholders, calibrated = _plan(2, **pinned)[0], _plan(2, calibration=profile, **pinned)[0]
    assert calibrated.predicted.step_time_s > 10 * placeholders.predicted.step_time_s
    # the same gradients cross the same (calibrated) link in the ranks' plan
    assert data["predicted"]["exposed_comm_s"] == pytest.approx(
        calibrated.predicted.exposed_comm_s, rel=1e-9)
    assert calibrated.predicted.exposed_comm_s > 10 * placeholders.predicted.exposed_comm_s


def _slow_profile(path):
    """A calibration profile of a machine 20× slower than the local placeholders."""
    from autohybrid.calibrate import Profile

    device = CPU2.device
    Profile(machine="a slow test machine",
            matmul_flops={"float32": device.peak_flops["float32"] / 20},
            memory_bandwidth=device.memory_bandwidth / 20, world_size=2,
            all_reduce_latency_s=CPU2.intra_link.latency_s * 20,
            all_reduce_bandwidth=CPU2.intra_link.bandwidth / 20,
            launch_overhead_s=device.launch_overhead_s * 20).to_json(path)
    return path


def tiny_gpt():
    """A factory as `ah.bench` takes one: (model, inputs, targets, loss_fn)."""
    model = ah.models.gpt(**TINY)
    (tokens,), targets = ah.models.example_batch(model, 8)
    return model, (tokens,), targets, lambda out, t: F.cross_entropy(out.flatten(0, 1),
                                                                      t.flatten())


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_bench_tp_against_dtensor():
    """tp=2 (no sp) → DTensor parallelize_module, AdamW, the model from a factory: the
    same losses as eager."""
    result = bench(tiny_gpt, CPU2, steps=STEPS, warmup=WARMUP, optimizer="adamw",
                   constraints=ah.Constraints(tp=2, dp=1, pp=1, sp=False), timeout_s=guard(280))
    data = _check_result(result, "DTensor")
    assert data["plan"]["mesh"].startswith("pp1×dp1×tp2") and data["lr"] == 1e-3
    assert data["model"] == "tiny_gpt"
    # each rank keeps a tp shard: less than the whole model's eager footprint
    eager = result.run("eager").peak_memory_bytes[0]
    assert max(result.run("DTensor").peak_memory_bytes) < eager


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_bench_pp_against_pipelining():
    """pp=2, 1F1B, 2 microbatches (untied head) → pipeline() split at the plan's
    boundaries; the pipeline's p2p transfers show as exposed communication."""
    model = MODEL + "&tie_embeddings=false"
    result = bench(model, CPU2, steps=STEPS, warmup=WARMUP,
                   constraints=ah.Constraints(pp=2, dp=1, tp=1, schedule="1f1b",
                                              num_microbatches=2), timeout_s=guard(280))
    _check_result(result, "pipelining", model_bytes=_param_bytes(tie_embeddings=False))
    assert "tie_embeddings=false" in result.model
    assert max(result.run("pipelining").exposed_comm_per_rank_s) > 0


# ---------------------------------------------------------------------- no processes
def _plan(world: int, calibration=None, **constraints):
    torch.manual_seed(0)
    model = ah.models.gpt(**TINY, tie_embeddings=constraints.pop("tied", True))
    (tokens,), _ = ah.models.example_batch(model, 8)
    plan = ah.plan(model, ah.Cluster.local(world, device_type="cpu"), example_inputs=(tokens,),
                   constraints=ah.Constraints(**constraints), executable_only=True,
                   calibration=calibration)
    return plan, model


@pytest.mark.timeout(180)
def test_layouts_without_a_baseline_say_why():
    """Real plans: sp, pp with tied weights, dp×tp at ZeRO 0, an interleaved pipeline and
    an MLP under tp get "n/a" with a reason; dp×tp at ZeRO 3 gets FSDP2+DTensor; a plan
    that recomputes keeps its baseline, with a note that the baseline does not."""
    cases = [
        (dict(tp=2, dp=1, pp=1, sp=True), "sequence parallelism"),
        (dict(pp=2, dp=1, tp=1, schedule="1f1b", num_microbatches=2), "tied weights"),
        (dict(pp=2, dp=1, tp=1, schedule="interleaved", virtual_stages=2,
              num_microbatches=2, tied=False), "schedule 'interleaved'"),
    ]
    for constraints, why in cases:
        plan, model = _plan(2, **constraints)
        choice = baselines.choose(plan, model)
        assert not choice.available and choice.name == "n/a" and why in choice.reason, choice
    plan, model = _plan(4, dp=2, tp=2, pp=1, sp=False, zero=0)
    assert "DDP does not take DTensor" in baselines.choose(plan, model).reason
    plan, model = _plan(4, dp=2, tp=2, pp=1, sp=False, zero=3)
    assert baselines.choose(plan, model) == baselines.Choice("FSDP2+DTensor")
    plan, model = _plan(2, dp=2, tp=1, pp=1, zero=1, recompute="full")
    choice = baselines.choose(plan, model)
    assert choice.name == "DDP+ZeroRedundancyOpt" and choice.available
    assert "recompute=full" in choice.note
    mlp = ah.models.mlp(in_features=8, hidden=16, out_features=4, layers=2)
    assert "zoo GPT and Llama" in baselines.tp_problem(mlp, 2)


def _job(world: int = 2) -> _Job:
    return _Job(source=None, global_batch=None, steps=3, warmup=1, plan=None, constraints=None,
                optimizer=baselines.Optim(torch.optim.SGD, {"lr": 0.01}), baselines=True,
                seed=0, cluster=ah.Cluster.local(world, device_type="cpu"))


def _rank(times, losses, memory=1000, exposed=0.001):
    return {"times": times, "losses": losses, "memory": memory, "exposed": exposed}


def test_aggregate_takes_the_slowest_rank_and_reports_na():
    """Per step the slowest rank's time after warm-up; an n/a baseline keeps its reason
    through the JSON and the table; a loss off by more than the tolerance fails."""
    losses = [4.0, 3.9, 3.8, 3.7]
    common = {"batch": 8, "tokens_per_sample": 16, "ref": "gpt-tiny", "plan":
              {"summary": "s", "mesh": "pp1×dp1×tp2+sp", "hash": "h"},
              "predicted": {"step_time_s": 0.01, "exposed_comm_s": 0.0,
                            "memory_per_rank_bytes": 10},
              "baseline": {"name": "n/a", "reason": "sequence parallelism: why"}}
    r0 = {**common, "eager": _rank([9, 0.05, 0.04, 0.06], losses, exposed=0.0),
          "compiled": _rank([9, 0.02, 0.01, 0.03], losses, 100, 0.002)}
    r1 = {**common, "eager": {},
          "compiled": _rank([9, 0.01, 0.04, 0.02], [x + 1e-3 for x in losses], 200, 0.005)}
    result = aggregate([r0, r1], _job(), "sgd")
    compiled = result.run("autohybrid")
    assert compiled.step_times_s == [0.02, 0.04, 0.03] and compiled.median_s == 0.03
    assert compiled.peak_memory_bytes == [100, 200] and compiled.exposed_comm_s == 0.005
    assert compiled.losses == losses and result.loss_check["ok"]
    assert result.prediction_check["measured_over_predicted"] == pytest.approx(3.0)
    base = result.baseline
    assert not base.available and base.median_s is None and "why" in base.reason
    data = json.loads(result.to_json())
    assert data["runs"][2]["reason"] == "sequence parallelism: why"
    table = result.format_table()
    assert "n/a: sequence parallelism: why" in table and "eager" in table
    # a baseline measured without a timeline says so instead of a number
    base_raw = {"name": "DTensor", "reason": "",
                **_rank([9, 0.05, 0.05, 0.05], [x + 0.1 for x in losses], 50, None)}
    result = aggregate([{**r0, "baseline": base_raw}, {**r1, "baseline": base_raw}], _job(),
                       "sgd")
    base = result.run("DTensor")
    assert base.available and base.exposed_comm_s is None and "no timeline" in base.exposed_comm_note
    assert not base.loss_vs_eager["ok"] and base.loss_vs_eager["max_abs_diff"] == \
        pytest.approx(0.1)
    row = next(l for l in result.format_table().splitlines() if l.startswith("autohybrid"))
    assert row.count("1.67×") == 2, row  # eager's and the baseline's 0.05 s / its 0.03 s
    # paired: the compiled run's times are the steps run beside the baseline's
    paired = {**base_raw, "exposed": 0.001}
    result = aggregate([{**r0, "baseline": {**paired, "paired_times": [9, 0.1, 0.02, 0.04]}},
                        {**r1, "baseline": {**paired, "paired_times": [9, 0.03, 0.03, 0.03]}}],
                       _job(), "sgd")
    assert result.run("autohybrid").step_times_s == [0.1, 0.03, 0.04]
    assert result.run("autohybrid").paired_ratio == pytest.approx(0.8)  # of 2, 0.6, 0.8
    assert "adjacent steps, median 0.800" in result.format_table()
    check = loss_check([4.0, 3.9], [4.0, 3.8], 1e-5)
    assert not check["ok"] and check["max_abs_diff"] == pytest.approx(0.1)
    assert not loss_check([math.nan], [4.0], 1e-5)["ok"]
    assert not loss_check([4.0], [4.0, 3.9], 1e-5)["ok"]


def test_dtype_is_the_compiled_runs_autocast_for_every_variant():
    """bench(dtype='bf16') asks ah.compile for dtype bfloat16 and runs eager and the
    baseline under the same autocast; float32 (the parameters' own) means none."""
    from autohybrid.bench import _autocast_dtype, _dtype, _under_autocast

    model = torch.nn.Linear(4, 4)
    job = _job()
    job.dtype = _dtype("bf16")
    assert job.dtype == "bfloat16" and _autocast_dtype(job, model) == torch.bfloat16
    job.dtype = _dtype(torch.float32)
    assert _autocast_dtype(job, model) is None
    seen = []
    step = _under_autocast(lambda i, t: seen.append(torch.get_autocast_dtype("cpu"))
                           or torch.is_autocast_enabled("cpu"), torch.device("cpu"),
                           torch.bfloat16)
    assert step((), None) and seen == [torch.bfloat16]


def test_cli_bench_takes_dtype():
    from autohybrid.cli import _parser

    args = _parser().parse_args(["bench", "gpt-tiny", "--dtype", "bf16"])
    assert args.dtype == "bf16"
    assert _parser().parse_args(["bench", "gpt-tiny"]).dtype is None


def test_step_stats():
    stats = step_stats([0.4, 0.1, 0.3, 0.2, 0.5])
    assert stats == {"median_s": 0.3, "min_s": 0.1, "max_s": 0.5,
                     "iqr_s": pytest.approx(0.2)}
    assert step_stats([0.7])["iqr_s"] == 0.0
    with pytest.raises(BenchError):
        step_stats([])


def test_memory_measure_parts():
    """held: parameters (a tied weight once), gradients and optimizer state reachable
    from the objects; transient: the profiler's allocation high-water mark of a step."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = ah.models.gpt(**TINY)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert held_tensor_bytes(model) == params
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    (tokens,), targets = ah.models.example_batch(model, 4)
    logits = model(tokens)
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    opt.step()
    del logits
    assert held_tensor_bytes(model, opt) == 3 * params  # weights, grads, momentum
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        big = torch.ones(1 << 18)  # 1 MiB
        del big
        small = torch.ones(1 << 10)
    assert transient_peak(prof) >= 1 << 20
    del small


def test_bad_input_is_refused_before_any_process():
    local = ah.Cluster.local(2, device_type="cpu")
    with pytest.raises(ClusterError, match="local"):
        bench(MODEL, ah.Cluster.preset("dgx-a100-80gb", nodes=2))
    with pytest.raises(ClusterError, match="ah.Cluster"):
        bench(MODEL, 2)
    with pytest.raises(BenchError, match="steps"):
        bench(MODEL, local, steps=0)
    with pytest.raises(BenchError, match="warmup"):
        bench(MODEL, local, warmup=-1)
    with pytest.raises(ModelError, match="factory"):
        bench(ah.models.gpt(**TINY), local)
    with pytest.raises(ModelError, match="MODEL string"):
        bench(42, local)
    with pytest.raises(ModelError):
        bench("no-such-model", local)
    with pytest.raises(BenchError, match="optimizer"):
        bench(MODEL, local, optimizer="lbfgs")
    with pytest.raises(BenchError, match="lr"):
        bench(MODEL, local, lr=-1.0)
    with pytest.raises(BenchError, match="global_batch"):
        bench(MODEL, local, global_batch=0)
    with pytest.raises(BenchError, match="dtype"):
        bench(MODEL, local, dtype=16)
    with pytest.raises(ah.PlanError, match="not supported"):
        bench(MODEL, local, dtype="int8")
    with pytest.raises(BenchError, match="constraints"):
        bench(MODEL, local, constraints={"dp": 2})
    plan, _ = _plan(2, dp=2, tp=1, pp=1)
    with pytest.raises(BenchError, match="not both"):
        bench(MODEL, local, plan=plan, constraints=ah.Constraints(dp=2))
    with pytest.raises(ah.AutohybridError, match="cannot read calibration profile"):
        bench(MODEL, local, calibration="no-such-profile.json")
    with pytest.raises(baselines.BaselineError):
        baselines.torch_dp(4, torch.nn.Linear(2, 2), baselines.Optim(torch.optim.SGD))
