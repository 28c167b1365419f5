"""Tests of the `autohybrid` command line.

The top-level help runs `python -m autohybrid.cli` in a subprocess, as a user would (the
entry point, exit codes, output streams); every other case calls `autohybrid.cli.main(argv)`
in this process (the same code path after argument parsing, without a second torch
import), the GPT-3 175B question among them.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import autohybrid as ah
from _limits import guard
from autohybrid import cli

REPO = Path(__file__).resolve().parents[1]


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "autohybrid.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_help_documents_the_commands() -> None:
    top = _cli("--help")
    assert top.returncode == 0, top.stderr
    assert "usage: autohybrid" in top.stdout and "plan" in top.stdout
    assert "choose a parallel plan" in top.stdout


def test_plan_help_documents_its_options(capsys) -> None:
    with pytest.raises(SystemExit) as exited:     # argparse's --help exits 0
        cli.main(["plan", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    for option in ("--cluster", "--nodes", "--global-batch", "--seq", "--dtype", "--constrain",
                   "--out", "--json", "--list-models"):
        assert option in out
    assert "Exit status 2" in out and "MODEL" in out.upper()


def _main(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.timeout(60)
def test_list_models(capsys) -> None:
    code, out, _ = _main(capsys, "plan", "--list-models")
    assert code == 0 and set(out.split()) == set(ah.models.PRESETS)


@pytest.mark.timeout(90)
def test_plan_json_and_out(tmp_path, capsys) -> None:
    out = tmp_path / "plan.json"
    code, stdout, err = _main(capsys, "plan", "gpt-tiny", "--cluster", "local:2",
                              "--global-batch", "8", "--json", "--out", str(out))
    assert code == 0, err
    printed = ah.Plan.from_json(stdout)
    assert printed.global_batch == 8 and printed.world_size == 2
    assert printed.mesh.dp * printed.mesh.tp * printed.mesh.pp == 2
    assert printed.model_ref == "gpt-tiny" and printed.dtype == "bfloat16"
    assert out.read_text() == stdout  # --out writes the same JSON
    assert ah.Plan.from_json(out) == printed
    # the plan made on meta by the CLI serves the real model: it names the training graph
    # (model + the MODEL's loss), as ah.compile with example_targets captures it
    from autohybrid.capture import capture
    from autohybrid.models.spec import zoo_loss
    model = ah.models.preset("gpt-tiny")
    inputs, targets = ah.models.example_batch("gpt-tiny", 8)
    assert capture(model, inputs, zoo_loss, targets).hash == printed.model_hash


@pytest.mark.timeout(90)
def test_plan_constrain_is_applied_and_text_report(capsys) -> None:
    code, out, err = _main(capsys, "plan", "gpt-tiny", "--cluster", "local:2",
                           "--global-batch", "8", "--constrain",
                           "num_microbatches=2,zero=0,collective_algorithm=hierarchical,"
                           "collective_matmul=true", "--json")
    assert code == 0, err
    plan = ah.Plan.from_json(out)
    assert plan.num_microbatches == 2 and plan.zero == 0 and plan.executable
    assert plan.collective_algorithm == "hierarchical" and plan.collective_matmul
    assert plan.mesh.tp == 2 and plan.mesh.sp and plan.collective_matmul_layers
    code, out, err = _main(capsys, "plan", "gpt-tiny", "--cluster", "local:2",
                           "--global-batch", "8")
    assert code == 0, err
    assert "pp1×dp2×tp1" in out and "alternatives" in out and "planned in" in out


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_plan_gpt3_175b_answers(capsys) -> None:
    """GPT-3 175B on 1024 A100s from the command line, on the meta device. How long it
    takes is a benchmark's figure (benchmarks/search_scaling.py), not a timed assertion:
    the timeout only catches a hang."""
    code, stdout, stderr = _main(capsys, "plan", "gpt3-175b", "--cluster", "dgx-a100-80gb",
                                 "--nodes", "128", "--global-batch", "1536")
    assert code in (0, 2), stderr
    if code == 2:
        message = stderr
        assert "no plan fits" in message
        figures = [float(x) for x in re.findall(r"([0-9.]+) GiB", message)]
        assert len(figures) >= 2 and max(figures) > 1
        assert "1024 ranks" in message and "A100-80GB" in message
    else:
        assert "pp" in stdout and "GiB" in stdout


@pytest.mark.timeout(60)
def test_bad_input_exits_2_with_a_message(capsys) -> None:
    code, _, err = _main(capsys, "plan", "gpt-tinyy")
    assert code == 2
    assert "'gpt-tinyy'" in err and "'gpt-tiny'" in err and "Traceback" not in err
    code, _, err = _main(capsys, "plan", "gpt-tiny", "--cluster", "dgx-h10")
    assert code == 2 and "closest: 'dgx-h100'" in err
    code, _, err = _main(capsys, "plan", "gpt-tiny", "--constrain", "zero=7")
    assert code == 2 and "Constraints.zero" in err
    code, _, err = _main(capsys, "plan")
    assert code == 2 and "MODEL" in err
    code, _, err = _main(capsys, "plan", "gpt-tiny", "--cluster", "local:2", "--global-batch", "7",
                         "--constrain", "tp=1,pp=1")
    assert code == 2 and "multiple of 2" in err


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_calibrate_then_plan_with_the_profile(tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "calibration.json"
    proc = subprocess.run([sys.executable, "-m", "autohybrid.cli", "calibrate", "--world-size",
                           "2", "--repeats", "1", "--out", str(out), "--json"], env=env, capture_output=True,
                          text=True, timeout=guard(110))
    assert proc.returncode == 0, proc.stderr
    profile = ah.Profile.from_json(out)
    printed = json.loads(proc.stdout)  # --json: the profile written to --out
    assert printed == json.loads(out.read_text()) and printed["world_size"] == 2
    assert printed["all_reduce_latency_s"] > 0 and printed["memory_bandwidth"] > 0
    assert all(v > 0 for v in printed["matmul_flops"].values())
    code = cli.main(["plan", "gpt-tiny", "--cluster", "local:2", "--calibration", str(out),
                     "--out", str(tmp_path / "plan.json")])
    assert code == 0
    assert ah.Plan.from_json(tmp_path / "plan.json").calibration_hash == profile.hash()
