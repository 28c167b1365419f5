"""Fused-kernel benchmark: autohybrid's generated Triton kernels against eager ATen and
torch.compile, one GPT training step with fusion on and off against eager, and the GEMM
and attention efficiencies the cost model assumes.

    PYTHONPATH=. python benchmarks/fused_kernels.py [--dtype bfloat16] [--bandwidth-gbs 4800]
                                              [--sections patterns,train,gemm,attention]
    PYTHONPATH=. python benchmarks/fused_kernels.py --smoke    # CPU: tiny, Triton's interpreter

What each section measures (one process, one device):

- patterns: each fused pattern of the zoo's GPT and Llama blocks, built as a region
  GraphModule the way tests/test_codegen.py builds them (fx trace of ATen calls, fake
  values) at transformer sizes (GPT-3 XL h=2048 and Llama 3 8B h=4096 / ffn 14336, 4 ×
  2048 tokens; vocabulary 32000, under the code generator's 32768-element row limit):
  residual add + layer norm, bias + GELU, residual add + RMS norm, SiLU × up, rotary
  (mul, mul, add), softmax of attention scores, log-softmax and the cross-entropy
  log-sum-exp over logits. The `pass fuses it in` column says whether
  `passes.fusion.find_regions` fuses the same region (same ATen ops, inputs and outputs)
  in the captured gpt-tiny / llama-tiny forward graphs (the RMS norm region runs through
  RMSNorm's `type_as` to the weight multiply); the rest are regions the pass does not
  meet in the zoo
  (the fc's bias lives in `aten.linear`, attention is one SDPA op, the loss one
  cross-entropy op) but that the code generator takes. A zoo pattern the pass no longer
  finds is marked NOT FOUND and fails the run. Every pattern is timed three ways,
  forward (under no_grad) and forward+backward (autograd.grad of every floating input):
  eager (the region's ATen ops), autohybrid (`torch.ops.autohybrid.fused_region`:
  the generated forward kernel; its backward kernel recomputes from the inputs) and
  `torch.compile` of the same function (inductor on a GPU; on a CPU `aot_eager`, which
  only checks that it traces: its times are eager's). The achieved bandwidth of each is
  the bytes the fused region must move at least (`region_bytes`: inputs read once,
  outputs written; backward: inputs and output gradients read, input gradients
  written) over the time, against the device's memory bandwidth from
  autohybrid/hardware.py (`--bandwidth-gbs` overrides it); `unfused MB` is what the
  region's ops move one by one (`passes.fusion.region_bytes`). Ratios are eager time /
  time (> 1: faster than eager). Each run also checks the fused outputs and gradients
  (and torch.compile's) against eager's (allclose; `= eager`), and how the fused op ran
  (`gpu`: Triton kernels; `interpret`: the same kernels in Triton's interpreter).
- train: one training step (SGD) of a GPT compiled with `ah.compile` on
  `ah.Cluster.local(1)` (fusion on, as by default, and off with
  AUTOHYBRID_DISABLE_PASSES=fusion) against the same model in eager PyTorch; bf16 runs
  are mixed precision (ah.compile's dtype=, eager under torch.autocast). The first
  step's losses must agree.
- gemm / attention: achieved TFLOP/s of `F.linear` at transformer matmul shapes and of
  `F.scaled_dot_product_attention` (causal), forward and forward+backward, over the
  device's peak for the dtype — the efficiencies the cost model assumes
  (cost/compute.py MATMUL_EFFICIENCY). FLOPs are counted as the cost model counts them:
  2·M·N·K per linear, 4·B·H·S²·D per attention (no causal discount: a causal kernel does
  about half of that work), backward twice the forward.

On a GPU times are `triton.testing.do_bench` medians (it flushes L2 between calls); the
full sizes are chosen to take a few minutes on one H200 (at most a few GB per pattern;
most of the time is inductor's compiles); `--sections` runs a part. `--smoke` is for
machines without one: tiny sizes, fp32, the kernels in Triton's interpreter
(TRITON_INTERPRET=1, set here before triton is imported when no GPU is present), a few
wall-clock repetitions; it prints the same tables, but its times and bandwidths say
nothing about a GPU (labelled so). The script exits with 1 when any output differs from
eager's or a section fails.
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import re
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

if __name__ == "__main__" and "--smoke" in sys.argv[1:] and not torch.cuda.is_available():
    if "triton" in sys.modules:      # (torch does not import it; nothing above does)
        print("warning: triton was imported before TRITON_INTERPRET could be set")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # numpy's warnings about the masked-off lanes of a tile (log(0), 0/0) in the interpreter
    import warnings
    warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")

import torch.fx as fx  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.fx.passes.fake_tensor_prop import FakeTensorProp  # noqa: E402

import autohybrid as ah  # noqa: E402
from autohybrid import hardware  # noqa: E402
from autohybrid.cost.compute import MATMUL_EFFICIENCY, MEMORY_EFFICIENCY  # noqa: E402
from autohybrid.graph import op_name  # noqa: E402
from autohybrid.ops import fused  # noqa: E402

aten = torch.ops.aten
MB = 1e6
SECTIONS = ("patterns", "train", "gemm", "attention")


# ------------------------------------------------------------------ sizes

@dataclass(frozen=True)
class Sizes:
    batch: int
    seq: int
    gpt_hidden: int
    gpt_ffn: int
    llama_hidden: int
    llama_ffn: int
    heads: int
    head_dim: int
    vocab: int
    score_batch: int      # softmax of attention scores: (score_batch, heads, seq, seq)
    score_heads: int


#: GPT-3 XL (h 2048, ffn 8192) and Llama 3 8B (h 4096, ffn 14336, 32 × 128 heads),
#: 4 × 2048 tokens; vocabulary 32000 (Llama 2): rows of a fused reduction hold at most
#: codegen.triton.MAX_ROW = 32768 elements, so GPT's 51200 and Llama 3's 128256 do not fit
FULL = Sizes(batch=4, seq=2048, gpt_hidden=2048, gpt_ffn=8192, llama_hidden=4096,
             llama_ffn=14336, heads=32, head_dim=128, vocab=32000, score_batch=2,
             score_heads=16)
#: tiny and ragged (no power of two along rows), for the interpreter
SMOKE = Sizes(batch=2, seq=12, gpt_hidden=48, gpt_ffn=192, llama_hidden=40, llama_ffn=112,
              heads=2, head_dim=16, vocab=200, score_batch=2, score_heads=2)

#: (name, M tokens, K in, N out) of `F.linear`, forward x[M,K] @ w[N,K]^T
GEMMS_FULL = [
    ("gpt3-xl qkv", 8192, 2048, 6144), ("gpt3-xl fc", 8192, 2048, 8192),
    ("gpt3-xl fc2", 8192, 8192, 2048), ("llama3-8b wq/wo", 8192, 4096, 4096),
    ("llama3-8b gate/up", 8192, 4096, 14336), ("llama3-8b down", 8192, 14336, 4096),
    ("lm head V=32000", 8192, 4096, 32000),
]
GEMMS_SMOKE = [("tiny qkv", 24, 48, 144), ("tiny fc", 24, 48, 192), ("tiny down", 24, 112, 40)]
#: (name, batch, heads, seq, head_dim) of causal SDPA
ATTENTION_FULL = [("gpt3-xl s2048", 4, 16, 2048, 128), ("llama3-8b s2048", 4, 32, 2048, 128),
                  ("llama3-8b s8192", 1, 32, 8192, 128)]
ATTENTION_SMOKE = [("tiny s12", 2, 2, 12, 16), ("tiny s32", 1, 2, 32, 8)]
#: GPT trained in the train section: (gpt kwargs, batch)
TRAIN_FULL = (dict(layers=6, hidden=1024, heads=16, vocab=32000, seq=1024), 8)
TRAIN_SMOKE = (dict(layers=2, hidden=32, heads=4, vocab=96, seq=16), 4)


# ------------------------------------------------------------------ the patterns

@dataclass(frozen=True)
class Pattern:
    """One fused region: `fn` calls ATen ops on its inputs and returns a tuple."""

    name: str
    model: str                       # the zoo block it comes from ("—": none)
    fn: Callable
    shapes: tuple[tuple[int, ...], ...]
    note: str = ""                   # why the pass does not fuse it in the zoo, if so


def patterns(s: Sizes) -> list[Pattern]:
    tokens = (s.batch, s.seq)
    g, lh, ffn = s.gpt_hidden, s.llama_hidden, s.llama_ffn

    def add_layer_norm(x, y, w, b):           # GPT block: x + attn(...), then ln2
        t = aten.add.Tensor(x, y)
        return (t, aten.layer_norm.default(t, [g], w, b, 1e-05))

    def bias_gelu(x, b):                      # GPT MLP: fc's bias, GELU
        return (aten.gelu.default(aten.add.Tensor(x, b)),)

    def add_rms_norm(x, y, w):
        # Llama block: x + attn(...), then RMSNorm: x·rsqrt(mean(x²) + eps), cast back to
        # the input's dtype (`type_as`), times the weight
        t = aten.add.Tensor(x, y)
        var = aten.mean.dim(aten.pow.Tensor_Scalar(t, 2), [-1], True)
        normed = aten.mul.Tensor(t, aten.rsqrt.default(aten.add.Tensor(var, 1e-05)))
        return (t, aten.mul.Tensor(aten.type_as.default(normed, t), w))

    def silu_mul(gate, up):                   # Llama SwiGLU
        return (aten.mul.Tensor(aten.silu.default(gate), up),)

    def rotary(q, cos, rot, sin):             # q·cos + rotate_half(q)·sin, cast back
        rotated = aten.add.Tensor(aten.mul.Tensor(q, cos), aten.mul.Tensor(rot, sin))
        return (aten.type_as.default(rotated, q),)

    def softmax(x):
        return (aten._softmax.default(x, -1, False),)

    def log_softmax(x):
        return (aten._log_softmax.default(x, -1, False),)

    def logsumexp(x):                         # cross-entropy's row reduction
        m = aten.amax.default(x, [-1], True)
        total = aten.sum.dim_IntList(aten.exp.default(aten.sub.Tensor(x, m)), [-1], True)
        return (aten.add.Tensor(aten.log.default(total), m),)

    q = (s.batch, s.heads, s.seq, s.head_dim)
    table = (s.seq, s.head_dim)
    logits = (s.batch * s.seq, s.vocab)
    return [
        Pattern("add+layernorm", "gpt", add_layer_norm, ((*tokens, g), (*tokens, g), (g,), (g,))),
        Pattern("bias+gelu", "gpt", bias_gelu, ((*tokens, s.gpt_ffn), (s.gpt_ffn,)),
                "fc's bias is inside aten.linear"),
        Pattern("add+rmsnorm", "llama", add_rms_norm, ((*tokens, lh), (*tokens, lh), (lh,))),
        Pattern("silu*up", "llama", silu_mul, ((*tokens, ffn), (*tokens, ffn))),
        Pattern("rotary", "llama", rotary, (q, table, q, table)),
        Pattern("softmax", "—", softmax,
                ((s.score_batch, s.score_heads, s.seq, s.seq),), "attention is one SDPA op"),
        Pattern("log_softmax", "—", log_softmax, (logits,), "the loss is one cross-entropy op"),
        Pattern("logsumexp", "—", logsumexp, (logits,), "the loss is one cross-entropy op"),
    ]


def region(fn: Callable, *examples: torch.Tensor) -> fx.GraphModule:
    """`fn` as a region GraphModule with fake values (as tests/test_codegen.py builds it)."""
    gm = fx.symbolic_trace(fn)
    mode = FakeTensorMode()
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*[mode.from_tensor(x) for x in examples])
    return gm


def signature(ops: Sequence[str], num_inputs: int, num_outputs: int) -> tuple:
    return (tuple(ops), num_inputs, num_outputs)


def region_signature(gm: fx.GraphModule) -> tuple:
    nodes = list(gm.graph.nodes)
    output = next(n for n in nodes if n.op == "output").args[0]
    return signature([op_name(n) for n in nodes if n.op == "call_function"],
                     sum(n.op == "placeholder" for n in nodes), len(output))


def zoo_regions() -> dict[tuple, set[str]]:
    """signature → the tiny zoo models whose forward graph `find_regions` fuses it in."""
    from autohybrid.capture import capture
    from autohybrid.passes.fusion import find_regions, region_io
    found: dict[tuple, set[str]] = {}
    for name in ("gpt-tiny", "llama-tiny"):
        torch.manual_seed(0)
        inputs, _ = ah.models.example_batch(name, 2)
        cap = capture(ah.models.preset(name), inputs, with_loss=False)
        for members in find_regions(cap.gm):
            ins, outs = region_io(members)
            sig = signature([op_name(m) for m in members], len(ins), len(outs))
            found.setdefault(sig, set()).add(name.split("-")[0])
    return found


# ------------------------------------------------------------------ bytes

def nbytes(t: Any) -> int:
    """Bytes of a tensor (real or fake) or of a (shape, dtype) pair."""
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    shape, dtype = t
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def region_bytes(inputs: Sequence[Any], outputs: Sequence[Any], backward: bool = False) -> int:
    """The bytes a fused region moves at least: each input read once, each output written
    once; with `backward` also autohybrid's backward kernel (it saves only the inputs and
    recomputes): the inputs and one gradient per floating output read, one gradient per
    floating input written. Broadcast inputs count at their own size."""
    def is_float(t):
        return (t.dtype if isinstance(t, torch.Tensor) else t[1]).is_floating_point
    total = sum(nbytes(t) for t in inputs) + sum(nbytes(t) for t in outputs)
    if backward:
        total += sum(nbytes(t) for t in inputs)
        total += sum(nbytes(t) for t in outputs if is_float(t))
        total += sum(nbytes(t) for t in inputs if is_float(t))
    return total


def unfused_bytes(gm: fx.GraphModule) -> int:
    """What the region's ops move one by one (the fusion pass's count)."""
    from autohybrid.passes.fusion import region_bytes as pass_bytes
    return int(pass_bytes([n for n in gm.graph.nodes if n.op == "call_function"])[1])


# ------------------------------------------------------------------ timing

class Timer:
    """Seconds per call of a function: do_bench medians on a GPU, else the median of
    `reps` wall-clock calls after one warm-up call."""

    def __init__(self, gpu: bool, reps: int):
        self.gpu, self.reps = gpu, reps

    def __call__(self, fn: Callable[[], Any]) -> float:
        if self.gpu:
            from triton.testing import do_bench
            return do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3
        fn()
        times = []
        for _ in range(self.reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def sync(self) -> None:
        if self.gpu:
            torch.cuda.synchronize()


TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float64: dict(rtol=1e-7, atol=1e-7),
       torch.bfloat16: dict(rtol=3e-2, atol=3e-2), torch.float16: dict(rtol=4e-3, atol=4e-3)}


def max_error(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> float:
    """Largest |got − want| over the tensors, each scaled by max(1, max |want|) (gradients
    summed over broadcast dims grow with the row count)."""
    err = 0.0
    for g, w in zip(got, want):
        if g.shape != w.shape:
            return math.inf
        scale = max(1.0, w.double().abs().max().item()) if w.numel() else 1.0
        err = max(err, ((g.double() - w.double()).abs().max().item() / scale) if w.numel() else 0.0)
    return err


def matches(got, want, dtype) -> bool:
    tol = TOL[dtype]
    scaled = [(g.double() / max(1.0, w.double().abs().max().item()),
               w.double() / max(1.0, w.double().abs().max().item())) for g, w in zip(got, want)]
    return len(got) == len(want) and all(
        g.shape == w.shape and torch.allclose(g, w, **tol) for g, w in scaled)


# ------------------------------------------------------------------ patterns section

@dataclass
class PatternResult:
    pattern: Pattern
    dtype: torch.dtype
    in_pass: str
    bytes_fwd: int
    bytes_fwd_bwd: int
    bytes_unfused: int
    mode: str
    launches: int
    fwd: dict[str, float]            # eager / ah / compile → seconds
    fwd_bwd: dict[str, float]
    match_fwd: bool
    match_bwd: bool
    err_fwd: float
    err_bwd: float
    compile_match: bool | None


def _count_launches() -> list[int]:
    from autohybrid.codegen import triton as tgen
    count = [0]
    original = tgen.launch

    def launch(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)
    tgen.launch = launch
    return count


def run_pattern(p: Pattern, dtype: torch.dtype, device: str, timer: Timer,
                compile_backend: str | None, zoo: dict[tuple, set[str]],
                launches: list[int]) -> PatternResult:
    gen = torch.Generator(device).manual_seed(len(p.name))
    xs = [torch.randn(s, generator=gen, device=device).to(dtype) for s in p.shapes]
    gm = region(p.fn, *xs)
    key = fused.register_region(gm)
    sig = region_signature(gm)
    if sig in zoo:
        in_pass = "+".join(sorted(zoo[sig]))
    else:   # "NOT FOUND": a zoo region the pass should fuse (it fails the run)
        in_pass = f"no: {p.note}" if p.note else "NOT FOUND"

    def ah_fn(*a):
        return torch.ops.autohybrid.fused_region(list(a), key)
    compiled = torch.compile(p.fn, backend=compile_backend, dynamic=False) \
        if compile_backend else None
    fns = {"eager": p.fn, "ah": ah_fn, **({"compile": compiled} if compiled else {})}

    # ---- forward
    with torch.no_grad():
        outs = {k: list(f(*xs)) for k, f in fns.items()}
    mode = fused._mode(xs)
    bytes_fwd = region_bytes(xs, outs["eager"])
    fwd = {}
    for k, f in fns.items():
        def call(f=f):
            with torch.no_grad():
                return f(*xs)
        fwd[k] = timer(call)

    # ---- forward + backward (gradients of every floating input)
    xg = [x.detach().requires_grad_(x.is_floating_point()) for x in xs]
    wrt = [x for x in xg if x.requires_grad]
    cots = [torch.randn(o.shape, generator=gen, device=device).to(o.dtype)
            for o in outs["eager"]]
    grads = {}
    for k, f in fns.items():
        grads[k] = list(torch.autograd.grad(list(f(*xg)), wrt, cots))
    bytes_fwd_bwd = region_bytes(xs, outs["eager"], backward=True)
    fwd_bwd = {}
    for k, f in fns.items():
        fwd_bwd[k] = timer(lambda f=f: torch.autograd.grad(list(f(*xg)), wrt, cots))
    before = launches[0]     # one forward and one backward kernel
    torch.autograd.grad(list(ah_fn(*xg)), wrt, cots)
    ran = launches[0] - before

    compile_match = None
    if compiled is not None:
        compile_match = matches(outs["compile"], outs["eager"], dtype) and \
            matches(grads["compile"], grads["eager"], dtype)
    return PatternResult(p, dtype, in_pass, bytes_fwd, bytes_fwd_bwd, unfused_bytes(gm), mode,
                         ran, fwd, fwd_bwd,
                         matches(outs["ah"], outs["eager"], dtype),
                         matches(grads["ah"], grads["eager"], dtype),
                         max_error(outs["ah"], outs["eager"]),
                         max_error(grads["ah"], grads["eager"]), compile_match)


_NUMBER = re.compile(r"^([-+]?[\d.]+(e[-+]?\d+)?%?|—)$")


def _table(header: Sequence[str], rows: list[Sequence[Any]]) -> None:
    """Columns of numbers right-aligned, of text left-aligned."""
    cells = [list(map(str, header))] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    numeric = [all(_NUMBER.match(r[i]) for r in cells[1:]) for i in range(len(header))]
    for r in cells:
        print("  ".join(c.rjust(w) if num else c.ljust(w)
                        for c, w, num in zip(r, widths, numeric)).rstrip())


def _short(x: float) -> str:
    return f"{x:.2f}" if x >= 0.995 else f"{x:.3g}"


def _ms(t: float | None) -> str:
    return "—" if t is None else f"{t * 1e3:.3f}"


def _ratio(base: float, t: float | None) -> str:
    return "—" if t is None else _short(base / t)


def _gbs(nbytes_: int, t: float | None) -> str:
    return "—" if t is None else _short(nbytes_ / t / 1e9)


def _pct(part: float, whole: float) -> str:
    pct = 100 * part / whole
    return f"{pct:.0f}%" if pct >= 1 else f"{pct:.2g}%"


def report_patterns(results: list[PatternResult], bandwidth: float, where: str,
                    compile_label: str) -> None:
    print(f"\nfused patterns ({where}); {compile_label}")
    rows = []
    for r in results:
        rows.append([r.pattern.name, r.pattern.model, r.in_pass,
                     " ".join("x".join(map(str, s)) for s in r.pattern.shapes),
                     str(r.dtype).removeprefix("torch."), f"{r.bytes_fwd / MB:.2f}",
                     f"{r.bytes_unfused / MB:.2f}", f"{r.bytes_fwd_bwd / MB:.2f}", r.mode,
                     r.launches])
    _table(["pattern", "block", "pass fuses it in", "input shapes", "dtype", "fwd MB",
            "unfused MB", "fwd+bwd MB", "ah ran as", "fwd+bwd launches"], rows)
    for kind, attr, size in (("forward", "fwd", "bytes_fwd"),
                             ("forward+backward", "fwd_bwd", "bytes_fwd_bwd")):
        print(f"\n{kind}: ms; ×eager = eager ms / ms (> 1 faster); GB/s = region bytes / time "
              f"(fused minimum, same bytes for all three); peak {bandwidth / 1e9:.0f} GB/s")
        rows = []
        for r in results:
            t = getattr(r, attr)
            b = getattr(r, size)
            ok = r.match_fwd if attr == "fwd" else r.match_bwd
            err = r.err_fwd if attr == "fwd" else r.err_bwd
            rows.append([r.pattern.name, _ms(t["eager"]), _ms(t["ah"]), _ms(t.get("compile")),
                         _ratio(t["eager"], t["ah"]), _ratio(t["eager"], t.get("compile")),
                         _gbs(b, t["eager"]), _gbs(b, t["ah"]), _gbs(b, t.get("compile")),
                         _pct(b / t["ah"], bandwidth),
                         "—" if "compile" not in t else _pct(b / t["compile"], bandwidth),
                         f"{err:.1e}", "yes" if ok else "NO"])
        _table(["pattern", "eager ms", "ah ms", "compile ms", "ah ×eager", "compile ×eager",
                "eager GB/s", "ah GB/s", "compile GB/s", "ah %peak", "compile %peak",
                "max err", "= eager"], rows)
    compile_checked = [r for r in results if r.compile_match is not None]
    if compile_checked:
        bad = [r.pattern.name for r in compile_checked if not r.compile_match]
        print(f"torch.compile outputs and gradients = eager: "
              f"{'yes' if not bad else 'NO for ' + ', '.join(bad)}")
    for r in results:
        print(f"check {r.pattern.name}: autohybrid forward {'=' if r.match_fwd else '!='} "
              f"eager (max err {r.err_fwd:.1e}), backward {'=' if r.match_bwd else '!='} "
              f"eager (max err {r.err_bwd:.1e}); {r.launches} kernel launch(es) per "
              f"forward+backward, run as {r.mode}")


# ------------------------------------------------------------------ train section

def _sgd(params):
    return torch.optim.SGD(params, lr=0.05)


def _lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def run_training(config: dict, batch: int, device: str, dtype: torch.dtype, steps: int,
                 timer: Timer) -> dict:
    """Step times (median) of eager, autohybrid with fusion and without; first losses."""
    torch.manual_seed(0)
    base = ah.models.gpt(**config, device=device)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config["vocab"], (batch, config["seq"] + 1), generator=gen)
    inputs, targets = ids[:, :-1].to(device), ids[:, 1:].to(device)
    mixed = dtype != torch.float32
    out: dict[str, Any] = {"notes": {}}

    eager = copy.deepcopy(base)
    opt = _sgd(list(eager.parameters()))

    def eager_step():
        for p in eager.parameters():
            p.grad = None
        with torch.autocast(device, dtype=dtype, enabled=mixed):
            loss = _lm_loss(eager(inputs), targets)
        loss.backward()
        opt.step()
        return loss.detach()
    out["eager_loss"] = float(eager_step())
    out["eager"] = _step_time(eager_step, steps, timer)

    for label, disabled in (("ah fused", False), ("ah unfused", True)):
        model = copy.deepcopy(base)
        saved = os.environ.get("AUTOHYBRID_DISABLE_PASSES")
        if disabled:
            os.environ["AUTOHYBRID_DISABLE_PASSES"] = ",".join(filter(None, [saved, "fusion"]))
        try:
            compiled = ah.compile(model, ah.Cluster.local(1), (inputs,), loss_fn=_lm_loss,
                                  example_targets=targets, optimizer=_sgd,
                                  dtype=dtype if mixed else None)
            first = float(compiled.train_step((inputs,), targets))   # captures, rewrites
        finally:
            if disabled:
                if saved is None:
                    os.environ.pop("AUTOHYBRID_DISABLE_PASSES", None)
                else:
                    os.environ["AUTOHYBRID_DISABLE_PASSES"] = saved
        out[f"{label} loss"] = first
        out[label] = _step_time(lambda: compiled.train_step((inputs,), targets), steps, timer)
        regions = compiled.programs["train"].fused_regions if "train" in compiled.programs else ()
        out["notes"][label] = (f"{len(regions)} fused regions, {len(compiled.kernels)} "
                               f"kernels; plan {compiled.plan.mesh}")
    return out


def _step_time(step: Callable[[], Any], steps: int, timer: Timer) -> float:
    step()
    timer.sync()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        timer.sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def report_training(res: dict, config: dict, batch: int, dtype: torch.dtype, steps: int,
                    where: str) -> bool:
    print(f"\ntraining step ({where}): gpt {config}, batch {batch}, "
          f"{str(dtype).removeprefix('torch.')}, SGD; median of {steps} steps after the "
          f"capture step and one warm-up; ×eager = eager ms / ms")
    rows = [[k, f"{res[k] * 1e3:.2f}", _ratio(res["eager"], res[k]),
             f"{res['eager_loss' if k == 'eager' else k + ' loss']:.6f}",
             res["notes"].get(k, "")] for k in ("eager", "ah fused", "ah unfused")]
    _table(["run", "step ms", "×eager", "first loss", ""], rows)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    ok = all(abs(res[f"{k} loss"] - res["eager_loss"]) <= tol * max(1, abs(res["eager_loss"]))
             for k in ("ah fused", "ah unfused"))
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") and not torch.cuda.is_available():
        print("(CPU: 'ah fused' runs its fused regions in Triton's interpreter, hence slow)")
    print(f"first-step losses agree with eager: {'yes' if ok else 'NO'}")
    return ok


# ------------------------------------------------------------------ gemm / attention

def run_gemms(shapes, device: str, dtype: torch.dtype, timer: Timer, peak: float) -> list:
    rows = []
    gen = torch.Generator(device).manual_seed(0)
    for name, m, k, n in shapes:
        x = torch.randn(m, k, generator=gen, device=device).to(dtype)
        w = (torch.randn(n, k, generator=gen, device=device) * k ** -0.5).to(dtype)
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        g = torch.randn(m, n, generator=gen, device=device).to(dtype)
        with torch.no_grad():
            fwd = timer(lambda: F.linear(x, w))
        both = timer(lambda: torch.autograd.grad(F.linear(xg, wg), (xg, wg), g))
        flops = 2 * m * n * k
        rows.append([name, f"{m}x{k} @ {k}x{n}", _ms(fwd), _short(flops / fwd / 1e12),
                     _pct(flops / fwd, peak), _ms(both), _short(3 * flops / both / 1e12),
                     _pct(3 * flops / both, peak)])
    return rows


def run_attention(shapes, device: str, dtype: torch.dtype, timer: Timer, peak: float) -> list:
    rows = []
    gen = torch.Generator(device).manual_seed(0)
    for name, b, h, s, d in shapes:
        q, k, v = [torch.randn(b, h, s, d, generator=gen, device=device).to(dtype)
                   for _ in range(3)]
        qg, kg, vg = [t.clone().requires_grad_() for t in (q, k, v)]
        g = torch.randn(b, h, s, d, generator=gen, device=device).to(dtype)
        with torch.no_grad():
            fwd = timer(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        both = timer(lambda: torch.autograd.grad(
            F.scaled_dot_product_attention(qg, kg, vg, is_causal=True), (qg, kg, vg), g))
        flops = 4 * b * h * s * s * d          # the cost model's count (cost/compute.py)
        rows.append([name, f"{b}x{h}x{s}x{d}", _ms(fwd), _short(flops / fwd / 1e12),
                     _pct(flops / fwd, peak), _ms(both), _short(3 * flops / both / 1e12),
                     _pct(3 * flops / both, peak)])
    return rows


# ------------------------------------------------------------------ main

def device_figures(gpu: bool, bandwidth_gbs: float | None, dtype: torch.dtype
                   ) -> tuple[str, float, float, str]:
    """(device name, memory bandwidth B/s, peak FLOP/s for dtype, where they come from)."""
    if gpu:
        props = torch.cuda.get_device_properties(0)
        spec = hardware.match_cuda_device(props.name, props.total_memory)
        name, source = props.name, f"autohybrid/hardware.py entry {spec.name!r}"
    else:
        spec = hardware.device("cpu")
        name, source = "cpu", "autohybrid/hardware.py 'cpu' PLACEHOLDER (not a measurement)"
    bandwidth = spec.memory_bandwidth
    if bandwidth_gbs is not None:
        bandwidth, source = bandwidth_gbs * 1e9, "--bandwidth-gbs"
    return name, bandwidth, spec.flops(dtype), source


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, fp32, few repetitions; on a CPU in Triton's interpreter")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="default: bfloat16 on a GPU, float32 in --smoke")
    parser.add_argument("--bandwidth-gbs", type=float, default=None,
                        help="device memory bandwidth, GB/s (default: autohybrid/hardware.py)")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--reps", type=int, default=3, help="wall-clock repetitions (CPU)")
    parser.add_argument("--steps", type=int, default=None, help="timed training steps")
    args = parser.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; known: {list(SECTIONS)}")

    start = time.perf_counter()
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    if not gpu and not args.smoke:
        print("no GPU: run with --smoke (tiny sizes in Triton's interpreter)")
        return 2
    dtype = getattr(torch, args.dtype or ("float32" if args.smoke else "bfloat16"))
    sizes = SMOKE if args.smoke else FULL
    timer = Timer(gpu, args.reps)
    dev_name, bandwidth, peak, source = device_figures(gpu, args.bandwidth_gbs, dtype)
    compile_backend = "inductor" if gpu else "aot_eager"
    meaningless = "" if gpu else " — CPU: times, GB/s and %peak say nothing about a GPU"
    where = f"{dev_name}{meaningless}"
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    print(f"# benchmarks/fused_kernels.py{' --smoke' if args.smoke else ''}: device {dev_name}, "
          f"torch {torch.__version__}, dtype {str(dtype).removeprefix('torch.')}, "
          f"TRITON_INTERPRET={'1' if interpret else 'unset'}")
    print(f"memory bandwidth {bandwidth / 1e9:.0f} GB/s and peak "
          f"{peak / 1e12:.1f} TFLOP/s ({str(dtype).removeprefix('torch.')}) from {source}; "
          f"the cost model assumes {MEMORY_EFFICIENCY:.0%} of the bandwidth and "
          f"{MATMUL_EFFICIENCY:.0%} of the peak (cost/compute.py)")
    failures: list[str] = []

    def section(name: str, fn: Callable[[], Any]) -> None:
        if name not in sections:
            return
        try:
            fn()
        except Exception:    # a benchmark reports every section it can
            failures.append(name)
            print(f"\nsection {name} FAILED:\n{traceback.format_exc()}")

    def do_patterns():
        zoo = zoo_regions()
        launches = _count_launches()
        results = [run_pattern(p, dtype, device, timer, compile_backend, zoo, launches)
                   for p in patterns(sizes)]
        label = ("torch.compile: default inductor" if gpu else
                 "torch.compile: backend aot_eager on CPU (checks that it traces; its times "
                 "are eager ATen's, inductor is not run)")
        report_patterns(results, bandwidth, where, label)
        for r in results:
            if not (r.match_fwd and r.match_bwd) or r.compile_match is False:
                failures.append(f"pattern {r.pattern.name} differs from eager")
            if r.in_pass == "NOT FOUND":
                failures.append(f"pattern {r.pattern.name}: the fusion pass does not fuse it "
                                "in the zoo's block")
            if r.launches < 2 or r.mode not in ("gpu", "interpret"):
                failures.append(f"pattern {r.pattern.name}: no kernel ran ({r.mode})")

    def do_train():
        config, batch = TRAIN_SMOKE if args.smoke else TRAIN_FULL
        steps = args.steps or (3 if args.smoke else 10)
        res = run_training(config, batch, device, dtype, steps, timer)
        if not report_training(res, config, batch, dtype, steps, where):
            failures.append("training losses differ from eager")

    def do_gemm():
        rows = run_gemms(GEMMS_SMOKE if args.smoke else GEMMS_FULL, device, dtype, timer, peak)
        print(f"\nGEMM efficiency ({where}): F.linear x[M,K] @ w[N,K]^T, FLOPs 2·M·N·K, "
              f"forward+backward 3× (dgrad + wgrad); %peak of {peak / 1e12:.1f} TFLOP/s; the "
              f"cost model assumes {MATMUL_EFFICIENCY:.0%}")
        _table(["gemm", "shape", "fwd ms", "fwd TFLOP/s", "fwd %peak", "fwd+bwd ms",
                "fwd+bwd TFLOP/s", "fwd+bwd %peak"], rows)

    def do_attention():
        rows = run_attention(ATTENTION_SMOKE if args.smoke else ATTENTION_FULL, device, dtype,
                             timer, peak)
        print(f"\nattention efficiency ({where}): F.scaled_dot_product_attention(is_causal="
              f"True) of q,k,v [B,H,S,D]; FLOPs as the cost model counts them, 4·B·H·S²·D "
              f"(a causal kernel does about half), forward+backward 3×; %peak of "
              f"{peak / 1e12:.1f} TFLOP/s")
        _table(["attention", "B x H x S x D", "fwd ms", "fwd TFLOP/s", "fwd %peak",
                "fwd+bwd ms", "fwd+bwd TFLOP/s", "fwd+bwd %peak"], rows)

    section("patterns", do_patterns)
    section("train", do_train)
    section("gemm", do_gemm)
    section("attention", do_attention)
    print(f"\n{'FAILED: ' + '; '.join(failures) if failures else 'all checks passed'} "
          f"({time.perf_counter() - start:.1f} s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
