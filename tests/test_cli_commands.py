"""The `inspect` and `train` commands (and MODEL strings) on tiny models.

`inspect` rebuilds the model a saved plan records and runs the passes for one rank without
processes; `train` compiles a zoo model for a local cluster (its losses are checked
against eager training of the same model on the same batches) or runs a script under
torchrun. The JSON output's content is what is checked.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import autohybrid as ah
from autohybrid import cli
from autohybrid.errors import ModelError
from autohybrid.models import spec
from autohybrid.passes import passes_for

TINY = "gpt-tiny?layers=2"


def _main(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def pp_tp_plan(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("plan")
    path = folder / "plan.json"
    code = cli.main(["plan", TINY, "--cluster", "local:4", "--constrain", "pp=2,tp=2,dp=1",
                     "--dtype", "float32", "--out", str(path), "--json",
                     "--trace", str(folder / "trace.json"), "--plots", str(folder / "plots")])
    assert code == 0
    return str(path)


def test_plan_trace_and_plots(pp_tp_plan) -> None:
    """The predicted timeline as Chrome trace JSON (one process per rank) and PNG plots."""
    folder = Path(pp_tp_plan).parent
    trace = json.loads((folder / "trace.json").read_text())
    events = trace["traceEvents"]
    assert isinstance(events, list) and events
    for event in events:
        assert event["ph"] in ("X", "M") and isinstance(event["pid"], int)
        if event["ph"] == "X":
            assert event["ts"] >= 0 and event["dur"] >= 0 and event["cat"] in (
                "step", "compute", "communication")
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {rank: f"rank {rank}" for rank in range(4)}
    assert {e["pid"] for e in events if e["ph"] == "X"} == set(range(4))
    plan = ah.Plan.from_json(pp_tp_plan)
    steps = [e for e in events if e.get("cat") == "step"]
    assert len(steps) == 4 and all(e["dur"] == pytest.approx(plan.predicted.step_time_s * 1e6,
                                                               rel=1e-3) for e in steps)
    for name in ("timeline.png", "memory.png"):
        data = (folder / "plots" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_model_strings() -> None:
    s = spec.parse("gpt-tiny?seq=8&layers=1&batch=4")
    assert s.ref == "gpt-tiny?batch=4&layers=1&seq=8" and spec.parse(s.ref) == s
    work = s.build()
    assert work.inputs[0].shape == (4, 8) and len(work.model.blocks) == 1
    assert work.tokens_per_sample == 8
    with pytest.raises(ModelError, match="'gpt-tiny'"):
        spec.parse("gpt-tinny")
    with pytest.raises(ModelError, match="not key=value"):
        spec.parse("gpt-tiny?layers")
    with pytest.raises(ModelError, match="batch must be a positive integer"):
        spec.parse("gpt-tiny?batch=0")
    with pytest.raises(ModelError, match="no such file"):
        spec.parse("nowhere/model.py:build")
    with pytest.raises(ModelError, match="longer than the model's 16 positions"):
        spec.parse("gpt-tiny?seq=17").build()


def test_model_string_factory(tmp_path) -> None:
    source = tmp_path / "mine.py"
    source.write_text(
        "import torch\n"
        "def build(width=4):\n"
        "    model = torch.nn.Sequential(torch.nn.Linear(3, width), torch.nn.Linear(width, 2))\n"
        "    x = torch.randn(8, 3)\n"
        "    return model, (x,), torch.zeros(8, dtype=torch.long)\n")
    work = spec.parse(f"{source}:build?width=5").build(device="cpu")
    assert work.model[0].out_features == 5 and work.targets.shape == (8,)
    assert work.loss_fn is spec.zoo_loss and not work.zoo
    assert len(work.batches(3)) == 3
    with pytest.raises(ModelError, match="has no function 'missing'"):
        spec.parse(f"{source}:missing").build()


@pytest.mark.timeout(240)
def test_inspect_json(pp_tp_plan, capsys, tmp_path) -> None:
    plan = ah.Plan.from_json(pp_tp_plan)
    assert plan.model_ref == TINY and plan.mesh.pp == 2 and plan.mesh.tp == 2
    code, out, err = _main(capsys, "inspect", pp_tp_plan, "--rank", "3", "--json",
                           "--pass", "tensor_parallel", "--dot", str(tmp_path / "dot"))
    assert code == 0, err
    data = json.loads(out)
    assert data["rank"] == 3 and data["coords"] == {"pp": 1, "dp": 0, "tp": 1}
    assert [s["ranks"] for s in data["stages"]] == [[0, 1], [2, 3]]
    assert data["stages"][1]["starts_at"] == plan.stage_boundaries[0]
    assert data["rank_stages"] == ["stage1"]
    # only the parameters of the rank's stage (and the tied embedding) are listed
    assert data["shards"] and all(not name.startswith("blocks.0.") for name in data["shards"])
    assert {s["of"] for s in data["shards"].values()} == {2}
    assert all(s["shard"] == 1 for s in data["shards"].values())
    assert [p["pass"] for p in data["passes"]] == [name for name, _ in passes_for("train")]
    by_pass = {p["pass"]: p for p in data["passes"]}
    assert by_pass["tensor_parallel"]["nodes_created"] > 0 and "code" in by_pass["tensor_parallel"]
    assert "autohybrid.tp_copy" in by_pass["tensor_parallel"]["code"]["train"]
    assert list(by_pass["fusion"]["graphs"]) == ["stage1"]
    assert data["autohybrid_ops"].get("sp_gather", 0) > 0
    dots = data["dot"]
    assert len(dots) == 1 and open(dots[0]).read().lstrip().startswith(("digraph", "strict"))
    code, out, err = _main(capsys, "inspect", pp_tp_plan, "--rank", "0")
    assert code == 0 and "pipeline stages" in out and "rank 0" in out


@pytest.mark.timeout(120)
def test_inspect_refuses_bad_input(pp_tp_plan, capsys, tmp_path) -> None:
    code, _, err = _main(capsys, "inspect", pp_tp_plan, "--rank", "4")
    assert code == 2 and "outside the plan's 4 ranks" in err
    plan = ah.Plan.from_json(pp_tp_plan)
    changed = tmp_path / "changed.json"
    plan.__class__.from_dict({**plan.to_dict(), "model_ref": "gpt-tiny?layers=3"}).to_json(changed)
    code, _, err = _main(capsys, "inspect", str(changed))
    assert code == 2 and "plan it again" in err
    anonymous = tmp_path / "anonymous.json"
    plan.__class__.from_dict({**plan.to_dict(), "model_ref": None}).to_json(anonymous)
    code, _, err = _main(capsys, "inspect", str(anonymous))
    assert code == 2 and "does not record its model" in err
    code, _, err = _main(capsys, "inspect", str(tmp_path / "missing.json"))
    assert code == 2 and "cannot read plan file" in err


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_train_model_matches_eager(capsys, tmp_path) -> None:
    """train on 2 ranks equals eager SGD; `--calibration`: the ranks plan on the cluster
    with the profile's figures (its calibrated link in the plan's cluster)."""
    from autohybrid.calibrate import Profile

    ref, steps, lr = "gpt-tiny?layers=1&seq=8", 3, 1e-2
    saved, profile = tmp_path / "state.pt", tmp_path / "profile.json"
    Profile(machine="a test machine", matmul_flops={"float32": 1e10}, memory_bandwidth=5e9,
            world_size=2, all_reduce_latency_s=2e-4, all_reduce_bandwidth=2e9).to_json(profile)
    code, out, err = _main(capsys, "train", ref, "--cluster", "local:2", "--steps", str(steps),
                           "--optimizer", "sgd", "--lr", str(lr), "--constrain", "dp=2",
                           "--save", str(saved), "--check", "--json", "--calibration",
                           str(profile))
    assert code == 0, err
    data = json.loads(out)
    assert data["ranks_agree"] and len(data["losses"]) == steps and data["checked"]
    assert data["plan"]["mesh"]["dp"] == 2
    assert "gloo-local-calibrated 2 GB/s, 200 µs" in data["plan"]["cluster"]
    # the same model, batches and optimizer in eager PyTorch
    work, eager = _eager_sgd(ref, steps, lr)
    assert data["losses"] == pytest.approx(eager, rel=1e-5, abs=1e-6)
    state = torch.load(saved)
    for name, value in work.model.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-4, atol=1e-5)


def _eager_sgd_losses(ref: str, steps: int, lr: float) -> list[float]:
    """The same model, batches and SGD as `train` uses, in eager PyTorch: the losses."""
    return _eager_sgd(ref, steps, lr)[1]


def _eager_sgd(ref: str, steps: int, lr: float):
    """(the trained model's work, its losses) for the model, batches and SGD `train` uses."""
    work = spec.parse(ref).build(device="cpu", seed=0)
    optimizer = torch.optim.SGD(work.model.parameters(), lr=lr)
    eager = []
    for inputs, targets in work.batches(steps, seed=1):
        optimizer.zero_grad()
        loss = work.loss_fn(work.model(*inputs), targets)
        loss.backward()
        optimizer.step()
        eager.append(loss.item())
    return work, eager


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_train_saves_checkpoints_and_resumes_to_the_same_losses(capsys, tmp_path) -> None:
    """train --save-dir --save-every to step 3, then --resume to step 5: the losses of
    both runs are eager's 5 steps, and keep_last prunes the older checkpoints."""
    ref, lr, ckpt = "gpt-tiny?layers=1&seq=8", 1e-2, tmp_path / "ckpt"
    common = ["--cluster", "local:2", "--optimizer", "sgd", "--lr", str(lr),
              "--constrain", "dp=2", "--save-dir", str(ckpt), "--json"]
    code, out, err = _main(capsys, "train", ref, "--steps", "3", "--save-every", "2",
                           "--keep-last", "1", *common)
    assert code == 0, err
    first = json.loads(out)
    assert [Path(p).name for p in first["checkpoints"]] == ["step-00000002", "step-00000003"]
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000003"]
    code, out, err = _main(capsys, "train", ref, "--steps", "5", "--resume", *common)
    assert code == 0, err
    second = json.loads(out)
    assert second["start_step"] == 3 and second["resumed_from"].endswith("step-00000003")
    assert second["ranks_agree"] and second["tokens_per_s"] > 0
    eager = _eager_sgd_losses(ref, 5, lr)
    assert first["losses"] + second["losses"] == pytest.approx(eager, rel=1e-5, abs=1e-6)


def test_train_refuses_checkpoint_flags_that_cannot_work(capsys, tmp_path) -> None:
    ref = "gpt-tiny?layers=1&seq=8"
    for flags, message in ((["--save-every", "2"], "--save-every needs --save-dir"),
                           (["--keep-last", "2"], "--keep-last needs --save-dir"),
                           (["--resume"], "--resume needs --save-dir"),
                           (["--save-dir", str(tmp_path), "--save-every", "0"],
                            "--save-every must be at least 1"),
                           (["--save-dir", str(tmp_path), "--resume", "--check"],
                            "run the check without --resume")):
        code, _, err = _main(capsys, "train", ref, *flags)
        assert code == 2 and message in err, (flags, err)
    code, _, err = _main(capsys, "train", ref, "--calibration", str(tmp_path / "none.json"))
    assert code == 2 and "cannot read calibration profile" in err, err
    script = tmp_path / "job.py"
    script.write_text("print('not run')\n")
    code, _, err = _main(capsys, "train", str(script), "--calibration", "profile.json")
    assert code == 2 and "a script plans itself" in err and "Profile.from_json" in err, err


@pytest.mark.procs
@pytest.mark.timeout(180)
def test_train_check_stage_checks_each_pipeline_stage(capsys) -> None:
    ref = "gpt-tiny?layers=2&seq=8"
    code, out, err = _main(capsys, "train", ref, "--cluster", "local:2", "--steps", "1",
                           "--optimizer", "sgd", "--constrain", "pp=2,dp=1,tp=1",
                           "--check", "stage")
    assert code == 0, err
    assert "equal the reference's (--check stage)" in out
    with pytest.raises(SystemExit):   # argparse: not one of auto, whole, stage
        cli.main(["train", ref, "--check", "sometimes"])
    assert "invalid choice: 'sometimes'" in capsys.readouterr().err


@pytest.mark.procs
@pytest.mark.timeout(180)
def test_train_script_under_torchrun(capsys, tmp_path) -> None:
    script = tmp_path / "job.py"
    script.write_text(
        "import os, sys\n"
        "import torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "out = sys.argv[sys.argv.index('--out') + 1]\n"
        "open(f\"{out}.{dist.get_rank()}\", 'w').write(os.environ['WORLD_SIZE'])\n"
        "dist.barrier()  # no rank leaves while another still connects (seen under load)\n"
        "dist.destroy_process_group()\n")
    out = tmp_path / "rank"
    code, _, err = _main(capsys, "train", str(script), "--cluster", "local:2", "--",
                         "--out", str(out))
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.glob("rank.*")) == ["rank.0", "rank.1"]
    assert (tmp_path / "rank.1").read_text() == "2"
    code, _, err = _main(capsys, "train", str(script), "--cluster", "dgx-h100")
    assert code == 2 and "local:N" in err


def test_every_command_has_help_and_json(capsys) -> None:
    for command in ("plan", "inspect", "bench", "train", "calibrate"):
        with pytest.raises(SystemExit) as exit_:
            cli.main([command, "--help"])
        assert exit_.value.code == 0
        text = capsys.readouterr().out
        assert f"usage: autohybrid {command}" in text and "--json" in text
