"""Generated Triton kernels for fused regions (codegen/, ops/fused.py), in the interpreter.

Every region is checked forward and backward against float64 eager on the same values,
in fp32/bf16/fp16, with small tiles so that kernels run several programs with ragged
edges. The sources of the kernels are also compiled for sm_90 in a subprocess.
"""
import os
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402

import pytest  # noqa: E402
from _limits import guard
import torch  # noqa: E402
import torch.fx as fx  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402
from torch.fx.experimental.symbolic_shapes import ShapeEnv  # noqa: E402
from torch.fx.passes.fake_tensor_prop import FakeTensorProp  # noqa: E402

from autohybrid.codegen import triton as tgen  # noqa: E402
from autohybrid.errors import RuntimeFailure  # noqa: E402
from autohybrid.ops import fused  # noqa: E402

aten = torch.ops.aten
TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.float16: dict(rtol=4e-3, atol=4e-3),
       torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    """Kernels on CPU tensors run in Triton's interpreter (ops/fused.py reads
    TRITON_INTERPRET at each call; the loader builds interpreted kernels whatever triton
    read at import), with 128-element tiles: a few programs per kernel, rows and columns
    with ragged edges. Set per test, not at import: set at import it stayed set for the
    whole pytest process, and every later multi-process test ran its fused regions in
    the interpreter instead of eager (half the 4-rank matrix's time)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(tgen, "TILE_INTERPRET", 128)


def region(fn, *examples, symbolic=False) -> fx.GraphModule:
    """`fn` (calling aten ops, returning a tuple) as a region GraphModule with fake vals."""
    gm = fx.symbolic_trace(fn)
    mode = FakeTensorMode(shape_env=ShapeEnv() if symbolic else None)
    fakes = [mode.from_tensor(x) for x in examples]
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)
    return gm


def run_and_check(fn, shapes, dtype, positive=(), seed=0):
    """Fused forward and backward of `fn` on random inputs of `shapes` in `dtype` equal
    float64 eager on the same values (inputs in `positive` are drawn > 0)."""
    gen = torch.Generator().manual_seed(seed)
    masters = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    masters = [m.abs() + 0.1 if i in positive else m for i, m in enumerate(masters)]
    xs = [m.to(dtype).requires_grad_() for m in masters]
    key = fused.register_region(region(fn, *xs))
    outs = torch.ops.autohybrid.fused_region(xs, key)
    refs_in = [x.detach().double().requires_grad_() for x in xs]
    refs = fn(*refs_in)
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs):
        assert o.shape == r.shape
        torch.testing.assert_close(o.double(), r.double(), **TOL[dtype])
    cots = [torch.randn(r.shape, generator=gen, dtype=torch.float64) for r in refs]
    got = torch.autograd.grad(outs, xs, [c.to(o.dtype) for c, o in zip(cots, outs)])
    want = torch.autograd.grad(refs, refs_in, [c.to(r.dtype) for c, r in zip(cots, refs)],
                               allow_unused=True)
    want = [torch.zeros_like(x) if w is None else w for w, x in zip(want, refs_in)]
    for g, w, x in zip(got, want, xs):
        assert g.shape == x.shape and g.dtype == x.dtype
        scale = max(1.0, w.abs().max().item())   # gradients summed over broadcast dims
        torch.testing.assert_close(g.double() / scale, w.double() / scale, **TOL[dtype])
    return key


# ------------------------------------------------------------------ element-wise chains

def arith(x, b, c, y):
    t = aten.add.Tensor(x, b)                                 # [B,S,H] + [H]
    t = aten.mul.Tensor(aten.sub.Tensor(t, c, alpha=0.5), 2.5)  # - [S,1]
    u = aten.div.Tensor(y, aten.add.Scalar(aten.mul.Tensor(c, c), 1.0))
    return (aten.neg.default(aten.add.Tensor(t, u)), aten.rsub.Scalar(t, 1.0))


UNARY = {
    "exp": lambda x: aten.exp.default(aten.tanh.default(x)),
    "log": lambda x: aten.log.default(aten.add.Scalar(aten.abs.default(x), 0.5)),
    "tanh": lambda x: aten.tanh.default(x),
    "sigmoid": lambda x: aten.sigmoid.default(x),
    "relu": lambda x: aten.relu.default(x),
    "gelu": lambda x: aten.gelu.default(x),
    "gelu_tanh": lambda x: aten.gelu.default(x, approximate="tanh"),
    "silu": lambda x: aten.silu.default(x),
    "pow2": lambda x: aten.pow.Tensor_Scalar(x, 2),
    "pow3": lambda x: aten.pow.Tensor_Scalar(x, 3),
    "pow1.5": lambda x: aten.pow.Tensor_Scalar(aten.add.Scalar(aten.mul.Tensor(x, x), 0.1), 1.5),
    "sqrt": lambda x: aten.sqrt.default(aten.add.Scalar(aten.mul.Tensor(x, x), 0.1)),
    "rsqrt": lambda x: aten.rsqrt.default(aten.add.Scalar(aten.mul.Tensor(x, x), 0.1)),
    "reciprocal": lambda x: aten.reciprocal.default(aten.add.Scalar(aten.abs.default(x), 0.5)),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", DTYPES)
def test_arithmetic_with_broadcasting(dtype):
    run_and_check(arith, [(2, 3, 37), (37,), (3, 1), (2, 1, 37)], dtype)


def unary(x, b):
    return tuple(f(aten.add.Tensor(x, b)) for f in UNARY.values())


def where_casts(x, y):
    mask = aten.gt.Scalar(x, 0.1)
    w = aten.where.self(mask, x, aten.mul.Tensor(y, 3.0))
    hi = aten.maximum.default(x, y)
    lo = aten.minimum.default(x, aten.neg.default(y))
    low = aten._to_copy.default(aten._to_copy.default(w, dtype=torch.float16),
                                dtype=torch.float32)
    back = aten.type_as.default(aten._to_copy.default(lo, dtype=torch.float64), x)
    return (w, hi, lo, low, aten._to_copy.default(hi, dtype=torch.bfloat16), back)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", DTYPES)
def test_unary_ops(dtype):
    run_and_check(unary, [(3, 45), (45,)], dtype)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", DTYPES)
def test_where_maximum_minimum_casts(dtype):
    run_and_check(where_casts, [(4, 33), (4, 33)], dtype)


@pytest.mark.timeout(60)
def test_bool_input_and_output():
    def fn(x, m):
        return (aten.where.ScalarOther(m, aten.exp.default(x), 0.0), aten.lt.Scalar(x, 0.0))
    x = torch.randn(3, 17, requires_grad=True)
    m = torch.rand(17) > 0.5
    key = fused.register_region(region(fn, x, m))
    w, neg = torch.ops.autohybrid.fused_region([x, m], key)
    assert neg.dtype == torch.bool and torch.equal(neg, x < 0)
    torch.testing.assert_close(w, torch.where(m, x.exp(), 0.0))
    (g,) = torch.autograd.grad(w.sum(), [x])
    torch.testing.assert_close(g, torch.where(m, x.exp(), 0.0).detach())


@pytest.mark.timeout(60)
def test_ragged_tiles_many_programs(monkeypatch):
    """Tiles of 32 elements: more column blocks than one and more row blocks than one."""
    monkeypatch.setattr(tgen, "TILE_INTERPRET", 32)
    assert tgen.blocks(15, 37, False, True) == (1, 32)
    run_and_check(arith, [(3, 5, 37), (37,), (5, 1), (3, 1, 37)], torch.float32, seed=3)
    run_and_check(lambda x: (aten._softmax.default(x, -1, False),), [(3, 5, 37)],
                  torch.float32, seed=4)


# ------------------------------------------------------------------ last-dim reductions

def rms(x, w):   # the Llama pattern
    var = aten.mean.dim(aten.pow.Tensor_Scalar(x, 2), [-1], True)
    return (aten.mul.Tensor(aten.mul.Tensor(x, aten.rsqrt.default(aten.add.Scalar(var, 1e-6))), w),)


REDUCTIONS = {
    "sum": (lambda x: (aten.sum.dim_IntList(aten.mul.Tensor(x, x), [-1], True),
                       aten.sum.dim_IntList(x, [-1])), 1),
    "mean": (lambda x: (aten.mean.dim(aten.tanh.default(x), [-1], True),
                        aten.mean.dim(x, [2], False)), 1),
    "amax": (lambda x: (aten.amax.default(x, [-1], True), aten.amax.default(x, [-1])), 1),
    "softmax": (lambda x: (aten._softmax.default(x, -1, False),), 1),
    "softmax_int": (lambda x: (aten.softmax.int(aten.mul.Tensor(x, 0.125), -1),), 1),
    "log_softmax": (lambda x: (aten._log_softmax.default(x, -1, False),), 1),
    "layer_norm": (lambda x, w, b: (aten.layer_norm.default(x, [37], w, b, 1e-5),), 3),
    "layer_norm_plain": (lambda x: (aten.layer_norm.default(x, [37]),), 1),
    "rms_pattern": (rms, 2),
    "rms_norm": (lambda x, w: (aten.rms_norm.default(x, [37], w, 1e-6),), 2),
    "epilogue": (lambda x, b: (aten.gelu.default(aten.add.Tensor(
        aten.sub.Tensor(x, aten.mean.dim(x, [-1], True)), b)),), 2),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(REDUCTIONS))
def test_reductions(name, dtype):
    fn, n = REDUCTIONS[name]
    shapes = [(2, 3, 37)] + [(37,)] * (n - 1)
    run_and_check(fn, shapes, dtype, seed=len(name))


@pytest.mark.timeout(60)
def test_softmax_of_scaled_masked_scores_in_bf16_to_fp32():
    def fn(s, bias):
        return (aten._softmax.default(aten._to_copy.default(
            aten.add.Tensor(aten.mul.Tensor(s, 0.3), bias), dtype=torch.float32), -1, False),)
    run_and_check(fn, [(2, 4, 19), (4, 19)], torch.bfloat16)


# ------------------------------------------------------------------ random regions

_CHAIN_OPS = [
    lambda a, b: aten.add.Tensor(a, b), lambda a, b: aten.sub.Tensor(a, b),
    lambda a, b: aten.mul.Tensor(a, b), lambda a, b: aten.maximum.default(a, b),
    lambda a, b: aten.div.Tensor(a, aten.add.Scalar(aten.exp.default(b), 1.0)),
    lambda a, b: aten.where.self(aten.gt.Tensor(a, b), a, aten.mul.Scalar(b, 0.5)),
    lambda a, b: aten.tanh.default(a), lambda a, b: aten.sigmoid.default(a),
    lambda a, b: aten.gelu.default(a), lambda a, b: aten.silu.default(a),
    lambda a, b: aten.mul.Scalar(aten.neg.default(a), 1.5),
    lambda a, b: aten.sqrt.default(aten.add.Scalar(aten.mul.Tensor(a, a), 1.0)),
]


def _chain(steps):
    def fn(x, y):
        values = [x, y]
        for op, i, j in steps:
            values.append(_CHAIN_OPS[op](values[i % len(values)], values[j % len(values)]))
        return (values[-1], values[len(values) // 2 + 1])
    return fn


_steps = st.lists(st.tuples(st.integers(0, len(_CHAIN_OPS) - 1), st.integers(0, 9),
                            st.integers(0, 9)), min_size=1, max_size=6)


@pytest.mark.timeout(120)
@settings(max_examples=20, deadline=None, derandomize=True, database=None)
@given(steps=_steps, rows=st.integers(1, 5), cols=st.integers(1, 70), bcast=st.booleans())
def test_random_elementwise_chains(steps, rows, cols, bcast):
    run_and_check(_chain(steps), [(rows, cols), (cols,) if bcast else (rows, cols)],
                  torch.float32)


_REDUCE = [lambda t: aten.sum.dim_IntList(t, [-1], True),
           lambda t: aten.mean.dim(t, [-1], True),
           lambda t: aten.amax.default(t, [-1], True),
           lambda t: aten._softmax.default(t, -1, False),
           lambda t: aten._log_softmax.default(t, -1, False),
           lambda t: aten.layer_norm.default(t, [t.shape[-1]])]


@pytest.mark.timeout(120)
@settings(max_examples=20, deadline=None, derandomize=True, database=None)
@given(pre=_steps, red=st.integers(0, len(_REDUCE) - 1), post=st.integers(0, 11),
       rows=st.integers(1, 6), cols=st.integers(2, 70))
def test_random_reduction_regions(pre, red, post, rows, cols):
    chain = _chain(pre)

    def fn(x, y):
        t = aten.add.Tensor(chain(x, y)[0], x)
        r = _REDUCE[red](t) if red < 5 else aten.layer_norm.default(t, [cols])
        return (_CHAIN_OPS[post](aten.add.Tensor(r, x), y),)
    run_and_check(fn, [(rows, cols), (cols,)], torch.float32)


# ------------------------------------------------------------------ the op in graphs

def _bias_gelu_key(symbolic: bool) -> str:
    def fn(x, b):
        return (aten.gelu.default(aten.add.Tensor(x, b)),)
    return fused.register_region(region(fn, torch.randn(2, 5, 8), torch.randn(8),
                                        symbolic=symbolic))


@pytest.mark.timeout(60)
def test_traced_with_symbolic_sizes():
    key = _bias_gelu_key(symbolic=True)

    def model(x, b):
        (h,) = torch.ops.autohybrid.fused_region([x * 2, b], key)
        return h.sum(-1)

    gm = make_fx(model, tracing_mode="symbolic")(torch.randn(3, 7, 8), torch.randn(8))
    node = next(n for n in gm.graph.nodes if n.target is torch.ops.autohybrid.fused_region.default)
    shape = node.meta["val"][0].shape
    assert isinstance(shape[0], torch.SymInt) and isinstance(shape[1], torch.SymInt)
    assert shape[2] == 8
    x, b = torch.randn(4, 3, 8), torch.randn(8)
    torch.testing.assert_close(gm(x, b), torch.nn.functional.gelu(x * 2 + b).sum(-1))

    def joint(x, b):   # forward + backward: the backward is an autohybrid op as well
        return torch.autograd.grad(model(x, b).sum(), [x, b])
    jg = make_fx(joint, tracing_mode="symbolic")(torch.randn(3, 7, 8, requires_grad=True),
                                                 torch.randn(8, requires_grad=True))
    targets = {n.target for n in jg.graph.nodes}
    assert torch.ops.autohybrid.fused_region_backward.default in targets


@pytest.mark.timeout(60)
def test_unknown_key_names_it():
    with pytest.raises(RuntimeFailure, match="fr_doesnotexist"):
        torch.ops.autohybrid.fused_region([torch.randn(3)], "fr_doesnotexist")


@pytest.mark.timeout(60)
def test_eager_fallback_equals_kernels(monkeypatch):
    fn, _ = REDUCTIONS["layer_norm"]
    torch.manual_seed(0)
    xs = [torch.randn(2, 3, 37, requires_grad=True), torch.randn(37, requires_grad=True),
          torch.randn(37, requires_grad=True)]
    key = fused.register_region(region(fn, *xs))
    results = {}
    for interpret in ("1", "0"):
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
        calls = []
        monkeypatch.setattr(tgen, "launch", lambda *a, _f=tgen.launch, **k: (calls.append(1), _f(*a, **k)))
        (y,) = torch.ops.autohybrid.fused_region(xs, key)
        grads = torch.autograd.grad(y, xs, torch.ones_like(y) * torch.arange(37.0))
        results[interpret] = (y, grads, len(calls))
    assert results["1"][2] == 2 and results["0"][2] == 0   # kernels ran only when asked
    torch.testing.assert_close(results["1"][0], results["0"][0])
    for a, b in zip(results["1"][1], results["0"][1]):   # sums of terms up to ~100
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)


@pytest.mark.timeout(60)
def test_unsupported_nodes_and_regions():
    def not_last(x):
        return (aten.sum.dim_IntList(x, [0], True),)
    gm = region(not_last, torch.randn(3, 4))
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    assert not fused.supported(node) and fused.is_reduction(node)
    with pytest.raises(fused.UnsupportedRegion, match="sum"):
        fused.register_region(gm)

    def dropout(x):
        return (aten.native_dropout.default(x, 0.1, True)[0],)
    gm = fx.symbolic_trace(dropout)
    assert not any(fused.supported(n) for n in gm.graph.nodes)

    def no_keepdim(x):   # [B,S] against [B,S,H] is no row broadcast
        return (aten.sub.Tensor(x, aten.sum.dim_IntList(x, [-1])),)
    with pytest.raises(fused.UnsupportedRegion, match="keepdim"):
        fused.register_region(region(no_keepdim, torch.randn(4, 4)))


@pytest.mark.timeout(60)
def test_kernels_listing_and_debug_dump(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOHYBRID_DEBUG", "1")
    monkeypatch.setenv("AUTOHYBRID_DUMP_DIR", str(tmp_path))
    key = _bias_gelu_key(symbolic=False)
    info = next(k for k in fused.kernels() if k.key == key)
    assert info.ops == ("aten.add.Tensor", "aten.gelu.default") and not info.reduction
    assert "@triton.jit" in info.forward_source and "tl.erf" in info.forward_source
    assert f"def {info.backward_name}(" in info.backward_source
    dumped = (tmp_path / "kernels" / f"{key}.py").read_text()
    assert info.forward_source in dumped and info.backward_source in dumped
    with pytest.raises(Exception):
        info.key = "other"     # frozen


_SUBPROCESS = textwrap.dedent("""
    import json, sys
    import torch, torch.fx as fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
    from autohybrid.codegen import triton as tgen
    from autohybrid.ops import fused
    aten = torch.ops.aten
    def fn(x, b):
        return (aten.gelu.default(aten.add.Tensor(x, b)),)
    gm = fx.symbolic_trace(fn)
    mode = FakeTensorMode()
    FakeTensorProp(gm, mode).propagate(torch.randn(2, 5, 8), torch.randn(8))
    key = fused.register_region(gm)
    for path, name, sig in json.loads(sys.argv[1]):
        compiled = tgen.compile_aot(path, name, dict(sig), block_m=4, block_n=64, arch=90)
        assert compiled.asm["cubin"], name
        print("compiled", name, flush=True)
    print("key", key)
""")


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_every_kernel_compiles_for_sm90_and_keys_match_across_processes(tmp_path):
    """In fresh processes without TRITON_INTERPRET: every kernel generated by this module
    compiles to a cubin for sm_90, and the same region gets the same key."""
    key = _bias_gelu_key(symbolic=False)
    patterns = [(arith, [(2, 3, 37), (37,), (3, 1), (2, 1, 37)]), (unary, [(3, 45), (45,)]),
                (arith, [(3, 37), (1,), (3, 1), (1, 37)]),   # gradients summed every way
                (where_casts, [(4, 33), (4, 33)])]
    patterns += [(fn, [(2, 3, 37)] + [(37,)] * (n - 1)) for fn, n in REDUCTIONS.values()]
    keys = {fused.register_region(region(fn, *[torch.randn(s, dtype=dtype) for s in shapes]))
            for fn, shapes in patterns for dtype in (torch.float32,)}
    keys |= {fused.register_region(region(fn, *[torch.randn(s, dtype=dtype) for s in shapes]))
             for fn, shapes in patterns[:1] for dtype in (torch.bfloat16,)}
    jobs, sources = [], set()   # regions that print the same kernel compile once
    for info in fused.kernels():
        if info.key in keys and info.forward_source.split(":", 1)[1] not in sources:
            sources.add(info.forward_source.split(":", 1)[1])
            jobs += [(info.path, info.name, info.forward_signature),
                     (info.path, info.backward_name, info.backward_signature)]
            jobs += [(info.path, name, info.backward_signature if "_bwd" in name
                      else info.forward_signature) for name in info.looped]
    assert len(jobs) >= 2 * len(patterns)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "triton"), PYTHONPATH=os.pathsep.join(sys.path))
    procs = [subprocess.Popen([sys.executable, "-c", _SUBPROCESS, json.dumps(jobs[i::2])],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=guard(110)) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        assert out.splitlines()[-1] == f"key {key}"
    compiled = [line.split()[1] for out, _ in outs for line in out.splitlines()
                if line.startswith("compiled")]
    assert sorted(compiled) == sorted(name for _, name, _ in jobs)


@pytest.mark.timeout(60)
def test_same_region_same_key():
    assert _bias_gelu_key(symbolic=False) == _bias_gelu_key(symbolic=False)
    assert _bias_gelu_key(symbolic=True) == _bias_gelu_key(symbolic=True)
    assert _bias_gelu_key(symbolic=True) != _bias_gelu_key(symbolic=False)


@pytest.mark.timeout(60)
def test_autotuning_keeps_the_fastest_launch_and_every_launch_is_exact(monkeypatch):
    """On a GPU each kernel is timed over `configs` once per shape class and the fastest
    kept. Here a stand-in timer makes each config the fastest in turn (the interpreter
    runs them): every one computes the region exactly, forward and backward, the kept
    one is the fastest, and a second call does not time again."""
    monkeypatch.setattr(tgen, "TUNE_IN_INTERPRETER", True)
    monkeypatch.setattr(tgen, "_FROZEN", [False])
    assert len(tgen.configs(15, 37, False)) == 3 and len(tgen.configs(6, 37, True)) == 2
    assert {c[1] for c in tgen.configs(6, 37, True)} == {64}   # a reduction keeps its row
    preferences = [lambda c: -c[0], lambda c: c[0], lambda c: c[1] * 1e4 + c[0]]
    for prefer in preferences:
        timed: list[tuple] = []

        def timer(fn, config, _prefer=prefer):
            fn()
            timed.append(config)
            return float(_prefer(config))

        monkeypatch.setattr(tgen, "time_launch", timer)
        monkeypatch.setattr(tgen, "_TUNED", {})
        run_and_check(arith, [(3, 5, 37), (37,), (5, 1), (3, 1, 37)], torch.float32, seed=5)
        run_and_check(rms, [(6, 37), (37,)], torch.float32, seed=6)
        # forward kernels; a backward summing a broadcast input's gradient in the kernel
        # (the bias, the weight) runs its default tiles (its partials follow the tiles)
        assert len(tgen._TUNED) == 2
        run_and_check(where_casts, [(4, 33), (4, 33)], torch.float32, seed=8)
        assert len(tgen._TUNED) == 4   # forward and backward (nothing broadcast)
        for (_, _, rows, n, whole), config in tgen._TUNED.items():
            assert config == min(tgen.configs(rows, n, whole), key=prefer)
        count = len(timed)
        run_and_check(rms, [(6, 37), (37,)], torch.float32, seed=7)
        assert len(timed) == count   # remembered per shape class



def _to_noop(x):
    y = aten.mul.Tensor(x, 1.0)
    return y, aten.to.dtype(y, torch.float32)   # a no-op cast: the same tensor in eager


@pytest.mark.timeout(60)
@pytest.mark.parametrize("interpret", ["0", "1"])
def test_outputs_that_alias_each_other_are_returned_as_distinct_tensors(monkeypatch,
                                                                         interpret):
    """Issue 17 E1: HF's rotary embedding ends with `(sin * 1.0).to(x.dtype)`, a no-op
    `aten.to.dtype`; a region returning both values returned one tensor twice on the
    eager CPU path and torch's custom-op check refused it ("must not also be an input
    ... or other returns"). Every path returns distinct tensors with eager's values."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    x = torch.randn(4, 16, requires_grad=True)
    key = fused.register_region(region(_to_noop, x))
    a, b = torch.ops.autohybrid.fused_region([x], key)
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    torch.testing.assert_close(a, x * 1.0)
    torch.testing.assert_close(b, x * 1.0)
    (grad,) = torch.autograd.grad(a.sum() + 2 * b.sum(), [x])
    torch.testing.assert_close(grad, torch.full_like(x, 3.0))
