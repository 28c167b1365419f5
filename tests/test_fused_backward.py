"""Fused kernels beyond one tile and the backward's bytes (codegen/rowloop.py, the folds
of codegen/ir.py, ops/fused.py), in Triton's interpreter.

Rows longer than `MAX_ROW` run the looped kernel (each row walked in chunks), equal to
float64 eager forward and backward; the backward computes only the gradients autograd
asks for, and sums a broadcast input's gradient inside the kernel into partials instead
of writing a full-size buffer per input.
"""
import math
import types

import pytest
import torch

from autohybrid.codegen import triton as tgen
from autohybrid.ops import fused
from test_codegen import REDUCTIONS, TOL, arith, region, run_and_check

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(tgen, "TILE_INTERPRET", 128)


def _record(monkeypatch) -> list[tuple[str, list[torch.Tensor]]]:
    """Every launch: (kernel name, its output buffers)."""
    seen: list = []
    original = tgen.launch

    def launch(kernel, program, inputs, outputs, shape, interpret):
        seen.append((kernel.fn.__name__, list(outputs)))
        return original(kernel, program, inputs, outputs, shape, interpret)

    monkeypatch.setattr(tgen, "launch", launch)
    return seen


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(REDUCTIONS))
def test_rows_longer_than_one_tile_run_the_looped_kernel(name, monkeypatch):
    """MAX_ROW 16 (chunks of 16): rows of 37 take three chunks, ragged, in every walk."""
    monkeypatch.setattr(tgen, "MAX_ROW", 16)
    seen = _record(monkeypatch)
    fn, n = REDUCTIONS[name]
    run_and_check(fn, [(2, 3, 37)] + [(37,)] * (n - 1), torch.float32, seed=len(name))
    key = fused.region_key(region(fn, *[torch.randn(s) for s in [(2, 3, 37)] + [(37,)] * (n - 1)]))
    backward_reduces = tgen.whole_rows(fused._REGIONS[key].backward)  # sum's does not
    assert [k for k, _ in seen] == [f"{key}_loop",
                                    f"{key}_bwd_loop" if backward_reduces else f"{key}_bwd"]


@pytest.mark.timeout(120)
def test_log_softmax_of_scaled_logits_over_a_40k_vocabulary(monkeypatch):
    """log_softmax(logits / T) over 40,000 columns (over MAX_ROW = 32,768, which
    raised at launch before): equal to eager, forward and backward."""
    monkeypatch.setattr(tgen, "TILE_INTERPRET", 1 << 14)
    seen = _record(monkeypatch)
    vocab = 40_000
    assert vocab > tgen.MAX_ROW

    def fn(x):
        return (aten._log_softmax.default(aten.div.Tensor(x, 0.7), -1, False),)
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(3, vocab, generator=gen) * 4).requires_grad_()
    key = fused.register_region(region(fn, x))
    (y,) = torch.ops.autohybrid.fused_region([x], key)
    ref = torch.log_softmax(x.detach().double() / 0.7, -1)
    torch.testing.assert_close(y.double(), ref, **TOL[torch.float32])
    cot = torch.randn(3, vocab, generator=gen)
    (g,) = torch.autograd.grad(y, [x], cot)
    xr = x.detach().double().requires_grad_()
    (want,) = torch.autograd.grad(torch.log_softmax(xr / 0.7, -1), [xr], cot.double())
    torch.testing.assert_close(g.double(), want, **TOL[torch.float32])
    assert [k for k, _ in seen] == [f"{key}_loop", f"{key}_bwd_loop"]


def _layer_norm(x, w, b):
    return (aten.layer_norm.default(x, [37], w, b, 1e-5),)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.timeout(120)
def test_backward_writes_only_wanted_gradients_and_partials_for_broadcast_inputs(monkeypatch):
    """Layer norm over [64, 37] with weight and bias [37], row programs capped at 4 (each
    loops over row blocks): the weight's and bias's gradients are 4 partial rows each,
    not [64, 37] fp32 buffers; an input that needs no gradient gets no buffer and no
    store in the kernel that runs; every gradient equals eager."""
    monkeypatch.setattr(tgen, "ROW_PROGRAMS", 4)
    seen = _record(monkeypatch)
    gen = torch.Generator().manual_seed(1)
    x, w, b = (torch.randn(64, 37, generator=gen), torch.randn(37, generator=gen),
               torch.randn(37, generator=gen))
    key = fused.register_region(region(_layer_norm, x, w, b))
    cot = torch.randn(64, 37, generator=gen)
    old_bytes = 3 * 64 * 37 * 4       # before: one fp32 [64, 37] buffer per input
    for needs in [(True, True, True), (False, True, True), (True, False, False),
                  (False, False, True)]:
        seen.clear()
        xs = [t.clone().requires_grad_(r) for t, r in zip((x, w, b), needs)]
        (y,) = torch.ops.autohybrid.fused_region(xs, key)
        wrt = [t for t in xs if t.requires_grad]
        got = torch.autograd.grad(y, wrt, cot)
        refs = [t.detach().double().requires_grad_(r) for t, r in zip((x, w, b), needs)]
        want = torch.autograd.grad(_layer_norm(*refs)[0], [t for t in refs if t.requires_grad],
                                   cot.double())
        for g, v in zip(got, want):
            torch.testing.assert_close(g.double(), v, **TOL[torch.float32])
        (fwd, _), (bwd, buffers) = seen
        assert bwd.startswith(f"{key}_bwd") and len(buffers) == len(wrt)
        expected = (64 * 37 * 4 if needs[0] else 0) + 4 * 37 * 4 * sum(needs[1:])
        assert _bytes(buffers) == expected < old_bytes
        program, _, path = fused._backward_of(fused._REGIONS[key],
                                              tuple(i for i, r in enumerate(needs) if r))
        text = path.read_text()
        kernel = text[text.index(f"def {bwd}("):]
        kernel = kernel[:kernel.index("\n\n") if "\n\n" in kernel else None]
        assert kernel.count("tl.store(") == len(wrt)


@pytest.mark.timeout(120)
def test_gradients_summed_along_rows_columns_and_both(monkeypatch):
    """Inputs [1] (summed everywhere), [R, 1] (along the row), [1, N] and [N] (over the
    rows) and one broadcast over only some leading dims (a full buffer): gradients equal
    eager, with several row and column programs and row programs looping."""
    monkeypatch.setattr(tgen, "TILE_INTERPRET", 32)
    monkeypatch.setattr(tgen, "ROW_PROGRAMS", 2)
    assert [fused.fold_of(s, 3) for s in [(1,), (3, 5, 1), (1, 37), (37,), (5, 1), (3, 1, 37),
                                          (3, 5, 37)]] == \
        ["both", "cols", "rows", "rows", None, None, None]
    run_and_check(arith, [(3, 5, 37), (1,), (3, 5, 1), (1, 37)], torch.float32, seed=9)
    run_and_check(arith, [(3, 5, 37), (37,), (5, 1), (3, 1, 37)], torch.float32, seed=10)
    monkeypatch.setattr(tgen, "MAX_ROW", 16)    # the looped kernel's partials
    fn = lambda x, w, s, c: (aten.mul.Tensor(aten.mul.Tensor(   # noqa: E731
        aten._softmax.default(x, -1, False), w), aten.add.Tensor(s, c)),)
    run_and_check(fn, [(4, 37), (37,), (1,), (4, 1)], torch.float32, seed=11)


@pytest.mark.timeout(60)
def test_eager_backward_computes_only_wanted_gradients(monkeypatch):
    """Without the interpreter (CPU eager): an input that needs no gradient gets none."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, w, b = torch.randn(4, 37), torch.randn(37), torch.randn(37)
    key = fused.register_region(region(_layer_norm, x, w, b))
    got = fused._eager_backward(fused._REGIONS[key], [x, w, b], [torch.ones(4, 37)], (1,))
    assert len(got) == 1 and got[0].shape == (37,)
    xs = [x.requires_grad_(), w, b]
    (y,) = torch.ops.autohybrid.fused_region(xs, key)
    (g,) = torch.autograd.grad(y.sum(), [x])
    xr = x.detach().requires_grad_()
    (want,) = torch.autograd.grad(torch.layer_norm(xr, [37], w, b, 1e-5).sum(), [xr])
    torch.testing.assert_close(g, want)
    assert math.isfinite(g.abs().sum().item())


@pytest.mark.timeout(60)
def test_tuned_launches_are_kept_on_disk_by_source_shape_and_device(monkeypatch, tmp_path):
    """A launch tuned on a device is written to the tuning file under the kernel's
    source, its shape class and the device's name; another process (here: a cleared
    in-process memo) takes it without timing; another device or an unreadable file
    times again."""
    monkeypatch.setenv("AUTOHYBRID_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(tgen, "_TUNED", {})
    monkeypatch.setattr(tgen, "_FROZEN", [False])
    path = tgen.write_source("tuning_probe", "def probe_kernel(x):\n    return x\n")
    ns: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), ns)
    kernel = types.SimpleNamespace(fn=ns["probe_kernel"])   # a kernel's plain function
    timed = []

    def timer(fn, config):
        timed.append(config)
        return -config[0]            # the most rows per program is the fastest

    want = max(tgen.configs(64, 300, True))
    got = tgen.tuned(kernel, 64, 300, True, lambda c: None, timer, "Fake GPU")
    assert got == want and len(timed) == len(tgen.configs(64, 300, True))
    assert tgen.tuning_file().exists()
    monkeypatch.setattr(tgen, "_TUNED", {})
    count = len(timed)
    assert tgen.tuned(kernel, 60, 300, True, lambda c: None, timer, "Fake GPU") == want
    assert len(timed) == count                         # from the file: no timing
    tgen.tuned(kernel, 64, 300, True, lambda c: None, timer, "Other GPU")
    assert len(timed) > count                          # another device: timed
    monkeypatch.setattr(tgen, "_TUNED", {})
    tgen.tuning_file().write_text("{not json")
    count = len(timed)
    assert tgen.tuned(kernel, 64, 300, True, lambda c: None, timer, "Fake GPU") == want
    assert len(timed) > count                          # unreadable: timed, rewritten
    assert tgen._saved()
