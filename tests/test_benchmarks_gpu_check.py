"""benchmarks/gpu_check.py --cpu: every section of the GPU check runs its code path at tiny
sizes on CPU (each in its own subprocess), writes its JSON with status ok, and the losses
agree with eager's (the GPT on one rank; dp, ZeRO-3 and tp+sp on two gloo ranks with
every collective's tensors checked to be on the model's device)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _limits import guard

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_gpu_check_cpu_mode_writes_every_section(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--cpu",
                           "--out", str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=guard(200), cwd=str(ROOT))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:] + json.dumps(
        {k: v.get("error", "")[-1500:] for k, v in summary["sections"].items()})
    assert summary["mode"] == "cpu" and summary["ok"]
    sections = {name: json.loads((tmp_path / f"{name}.json").read_text())
                for name in ("roofline", "kernels", "gpt", "dist")}
    assert set(summary["sections"]) == set(sections)
    for name, data in sections.items():
        assert data["status"] == "ok", (name, data.get("error"))
    roof = sections["roofline"]
    assert roof["copy_bandwidth"] > 0 and roof["bf16_gemm_best_flops"] > 0
    assert roof["versions"]["torch"]
    kernels = sections["kernels"]["patterns"]
    assert {k["pattern"] for k in kernels} == {"add+layernorm", "bias+gelu", "softmax"}
    assert all(k["equal_fwd"] and k["equal_bwd"] and k["fwd_bwd_ah_gbs"] > 0 for k in kernels)
    runs = sections["gpt"]["runs"]
    assert set(runs) == {"eager", "autohybrid fused", "autohybrid unfused"}
    for name, run in runs.items():
        assert "error" not in run, (name, run)
        assert run["step_s"] > 0 and run["tokens_per_s"] > 0 and run["mfu_of_spec"] > 0
        assert name == "eager" or run["loss_agrees"], (name, run)
    dist = sections["dist"]
    assert set(dist["cases"]) == {"dp", "zero3", "tp+sp"}
    for name, case in dist["cases"].items():
        assert case["ok"] and case["ranks_agree"], (name, case)
        assert min(case["collective_calls_checked"]) > 0 or dist["device_check"].startswith(
            "autohybrid."), (name, case)


def test_failed_section_is_recorded_and_the_others_run(tmp_path, monkeypatch):
    """A section that raises or runs past its timeout leaves its error in its JSON."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check

    calls = []

    def fake_run(cmd, timeout, **kw):
        name = cmd[cmd.index("--section") + 1]
        calls.append(name)
        if name == "kernels":    # it saved one pattern's row, then ran out of time
            (tmp_path / "kernels.json").write_text(json.dumps(
                {"status": "partial", "patterns": [{"pattern": "softmax"}]}))
            raise subprocess.TimeoutExpired(cmd, timeout, output=b"compiling...")
        if name == "gpt":
            return subprocess.CompletedProcess(cmd, 1, "", "Traceback: boom")
        (tmp_path / f"{name}.json").write_text(json.dumps({"status": "ok", "x": 1}))
        return subprocess.CompletedProcess(cmd, 0, "", "")
    monkeypatch.setattr(gpu_check.subprocess, "run", fake_run)
    assert gpu_check.main(["--cpu", "--out", str(tmp_path)]) == 1
    assert calls == ["roofline", "kernels", "gpt", "dist"]
    summary = json.loads((tmp_path / "summary.json").read_text())["sections"]
    assert summary["kernels"]["status"] == "timeout" and "compiling" in summary["kernels"]["error"]
    assert summary["kernels"]["patterns"] == [{"pattern": "softmax"}]  # kept
    assert summary["gpt"]["status"] == "failed" and "boom" in summary["gpt"]["error"]
    assert summary["dist"] == {"status": "ok", "x": 1, "wall_s": summary["dist"]["wall_s"]}
