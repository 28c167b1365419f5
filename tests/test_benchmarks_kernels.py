"""benchmarks/fused_kernels.py: its smoke run (`--smoke`: tiny sizes, the fused kernels in
Triton's interpreter) exits 0 and prints, for every fused pattern, a row in the
forward and the forward+backward tables marked as equal to eager, and a check line
saying the generated kernel ran (its timings are not checked); and the bytes a fused
region moves, from which the benchmark's bandwidths are computed, equal a hand count
and the fusion pass's own count."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _limits import guard
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import fused_kernels as kb  # noqa: E402  (benchmarks/fused_kernels.py; not "kernels": Hugging Face's `kernels` package is probed by transformers)

aten = torch.ops.aten


@pytest.mark.procs
@pytest.mark.timeout(180)
def test_smoke_run_prints_every_pattern_equal_to_eager():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
           "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "benchmarks/fused_kernels.py", "--smoke"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=guard(170))
    elapsed = time.monotonic() - start
    out = proc.stdout
    assert proc.returncode == 0, f"{out[-4000:]}\n{proc.stderr[-4000:]}"
    mode = "gpu" if torch.cuda.is_available() else "interpret"
    names = [p.name for p in kb.patterns(kb.SMOKE)]
    assert len(names) == 8
    forward = out.split("\nforward: ")[1].split("\nforward+backward: ")[0]
    backward = out.split("\nforward+backward: ")[1].split("\ntorch.compile outputs")[0]
    for name in names:
        for table in (forward, backward):
            rows = [line for line in table.splitlines() if line.split()[:1] == [name]]
            assert len(rows) == 1, (name, table)
            cells = rows[0].split()
            assert cells[-1] == "yes" and float(cells[-2]) < 1e-4, rows[0]
            assert all(float(c) > 0 for c in cells[1:4]), rows[0]     # three timings
        check = re.search(rf"^check {re.escape(name)}: autohybrid forward = eager .*, "
                          r"backward = eager .*; (\d+) kernel launch\(es\) per "
                          r"forward\+backward, run as (\w+)$", out, re.M)
        assert check, (name, out)
        # the generated forward and backward kernels both ran, as the op decides
        assert int(check.group(1)) == 2 and check.group(2) == mode, check.group(0)
    # the zoo's patterns are the regions the fusion pass fuses in the tiny blocks
    summary = out.split("\nforward: ")[0]
    for name, block in (("add+layernorm", "gpt"), ("add+rmsnorm", "llama"),
                        ("silu*up", "llama"), ("rotary", "llama")):
        row = next(line for line in summary.splitlines() if line.startswith(name + " "))
        assert row.split()[1:3] == [block, block], row
    assert "torch.compile outputs and gradients = eager: yes" in out
    assert "first-step losses agree with eager: yes" in out
    if mode == "interpret":     # CPU figures are labelled as such
        assert "say nothing about a GPU" in out and "backend aot_eager" in out
    for header in ("GEMM efficiency", "attention efficiency", "training step"):
        assert header in out, header
    assert re.search(r"^all checks passed \([\d.]+ s\)$", out, re.M), out[-2000:]
    print(f"smoke run: {elapsed:.1f} s")


def test_region_bytes_hand_count():
    """Residual add + layer norm at [8,16,32] fp32 with weight and bias [32]: the kernel
    reads x, y, w, b and writes the sum and the normed; its backward reads the four
    inputs and two output gradients and writes four input gradients."""
    act, vec = 8 * 16 * 32 * 4, 32 * 4
    x, y = torch.randn(8, 16, 32), torch.randn(8, 16, 32)
    w, b = torch.randn(32), torch.randn(32)
    fn = kb.patterns(kb.Sizes(batch=8, seq=16, gpt_hidden=32, gpt_ffn=128, llama_hidden=32,
                              llama_ffn=64, heads=2, head_dim=16, vocab=64, score_batch=1,
                              score_heads=1))[0]
    assert fn.name == "add+layernorm"
    outs = fn.fn(x, y, w, b)
    assert kb.region_bytes([x, y, w, b], outs) == 4 * act + 2 * vec
    assert kb.region_bytes([x, y, w, b], outs, backward=True) == \
        (4 * act + 2 * vec) + (2 * act + 2 * vec) + 2 * act + (2 * act + 2 * vec)
    # the fusion pass counts the same bytes fused; unfused, the add's output is
    # written and read back once more (tests/test_fusion.py's count)
    from autohybrid.passes.fusion import region_bytes as pass_bytes
    gm = kb.region(fn.fn, x, y, w, b)
    fused_count, unfused_count = pass_bytes([n for n in gm.graph.nodes
                                             if n.op == "call_function"])
    assert int(fused_count) == kb.region_bytes([x, y, w, b], outs)
    assert int(unfused_count) == kb.unfused_bytes(gm) == 5 * act + 2 * vec


def test_region_bytes_dtypes_and_non_float_outputs():
    """bf16 counts 2 bytes an element; a bool output is written but gets no gradient;
    (shape, dtype) pairs count like tensors."""
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    mask = torch.zeros(4, 8, dtype=torch.bool)
    assert kb.region_bytes([x], [mask]) == 64 + 32
    assert kb.region_bytes([x], [mask], backward=True) == 64 + 32 + 64 + 0 + 64
    assert kb.region_bytes([((4, 8), torch.bfloat16)], [((4, 8), torch.bool)],
                           backward=True) == 64 + 32 + 64 + 64
    assert kb.nbytes(((3, 5), torch.float64)) == 120
