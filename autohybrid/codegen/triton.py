"""Triton source for kernel programs, the kernel cache on disk, launching and AOT compiles.

Owns the printing of a `Program` (ir.py) as one `@triton.jit` kernel, the choice of block
sizes from the runtime shapes, and the launch. Every kernel has the same frame:

    rows × cols tile   rows = flattened leading dims of the iteration shape (runtime R,
                       decomposed into dims d1… with % and //), cols = last dim (N)
    operands           pointers + strides over the iteration shape (a broadcast input
                       has stride 0 on its broadcast dims), so any layout and any size
                       works; masks cover the ragged edges
    grid               (cdiv(R, BLOCK_M), cdiv(N, BLOCK_N)) for element-wise programs;
                       (cdiv(R, BLOCK_M), 1) with BLOCK_N ≥ N when a value is reduced
                       along the row (the whole row lives in one tile)

Loads convert to the compute dtype (fp32; fp64 for fp64 regions), stores convert to the
output pointer's dtype. Sources live in files (`@triton.jit` reads its source back) under
`cache_dir()`; `load_kernel` wraps the function for the GPU (JITFunction) or the CPU
interpreter (InterpretedFunction) as asked, whatever TRITON_INTERPRET said at import.
"""
from __future__ import annotations

import importlib.util
import math
import os
import tempfile
from pathlib import Path

import torch

from . import ir
from .ir import FULL, ROW, Program, Value

#: the longest row a reduction kernel holds in one tile (elements)
MAX_ROW = 1 << 15
#: elements per tile: on the GPU (registers) and in the interpreter (few programs)
TILE_GPU, TILE_INTERPRET = 4096, 1 << 16

_TL = {torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16",
       torch.float32: "tl.float32", torch.float64: "tl.float64", torch.bool: "tl.int1"}
_PTR = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32",
        torch.float64: "*fp64", torch.bool: "*i1"}

_FORMAT = {
    "add": "{0} + {1}", "sub": "{0} - {1}", "mul": "{0} * {1}", "div": "{0} / {1}",
    "neg": "-{0}", "exp": "tl.exp({0})", "log": "tl.log({0})", "erf": "tl.erf({0})",
    "tanh": "2.0 * tl.sigmoid(2.0 * {0}) - 1.0", "sigmoid": "tl.sigmoid({0})",
    "sqrt": "tl.sqrt({0})", "rsqrt": "tl.rsqrt({0})", "abs": "tl.abs({0})",
    "relu": "tl.where({0} < 0.0, 0.0, {0})",
    "maximum": "tl.maximum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)",
    "minimum": "tl.minimum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)",
    "gt": "{0} > {1}", "lt": "{0} < {1}", "ge": "{0} >= {1}", "le": "{0} <= {1}",
    "eq": "{0} == {1}", "ne": "{0} != {1}", "where": "tl.where({0}, {1}, {2})",
    "stop_grad": "{0}",
    "sum_row": "tl.sum(tl.where(mask, {0}, 0.0), axis=1)[:, None]",
    "amax_row": "tl.max(tl.where(mask, {0}, float('-inf')), axis=1)[:, None]",
    "expand_full": "tl.broadcast_to({0}, [BLOCK_M, BLOCK_N])",
    "zeros": "tl.zeros([BLOCK_M, BLOCK_N], CDT)", "ncols": "N * 1.0",
}


def whole_rows(program: Program) -> bool:
    """Whether the kernel needs each row in one tile (it reduces along rows)."""
    return program.reduces or any(o.kind == ROW for o in program.outputs)


def _literal(x) -> str:
    if isinstance(x, bool):
        return repr(x)
    x = float(x)
    if math.isinf(x):
        return "float('inf')" if x > 0 else "float('-inf')"
    return "float('nan')" if math.isnan(x) else repr(x)


def _pow(a: str, p: float) -> str:
    if p == 0.5:
        return f"tl.sqrt({a})"
    if p == -0.5:
        return f"tl.rsqrt({a})"
    if p == int(p) and abs(p) <= 8:
        prod = " * ".join([a] * int(abs(p))) if p else f"({a} * 0.0 + 1.0)"
        return f"1.0 / ({prod})" if p < 0 else f"({prod})"
    if p == int(p):   # odd powers keep the sign of the base
        mag = f"tl.exp2({_literal(p)} * tl.log2(tl.abs({a})))"
        return mag if int(p) % 2 == 0 else f"tl.where({a} < 0.0, -{mag}, {mag})"
    return f"tl.exp2({_literal(p)} * tl.log2({a}))"


def _cast(a: str, src: Value, dtype: torch.dtype, compute: torch.dtype) -> str:
    if dtype == torch.bool:
        return f"({a} != 0)"
    if src.is_bool or dtype == compute or dtype == torch.float64:
        return f"{a}.to(CDT)"
    if dtype == torch.bfloat16 and compute == torch.float32:
        # round to nearest even by hand: the interpreter truncates in .to(tl.bfloat16)
        bits = f"{a}.to(tl.uint32, bitcast=True)"
        rounded = f"(({bits} + 0x7FFF + (({bits} >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)"
        return f"tl.where({a} != {a}, {a}, {rounded})"
    return f"{a}.to({_TL[dtype]}).to(CDT)"   # rounds to the narrower float, as eager does


def _expression(v: Value, names: dict[int, str], compute: torch.dtype) -> str:
    args = [names[a.uid] if isinstance(a, Value) else _literal(a) for a in v.args]
    if v.op == "pow":
        return _pow(args[0], v.attrs[0])
    if v.op == "cast":
        return _cast(args[0], v.args[0], v.attrs[0], compute)
    return _FORMAT[v.op].format(*args)


def _offsets(prefix: str, kind: str, rank: int) -> str:
    row = " + ".join(f"i{j} * {prefix}_s{j}" for j in range(rank - 1)) or "rows * 0"
    return row if kind == ROW else f"{row} + cols * {prefix}_s{rank - 1}"


def _strides(prefix: str, kind: str, rank: int) -> list[str]:
    return [f"{prefix}_s{j}" for j in range(rank - 1 if kind == ROW else rank)]


def parameters(program: Program, rank: int) -> list[str]:
    """The kernel's parameters, in order (see `launch` for what each receives)."""
    params = [f"in{i}" for i in range(len(program.inputs))]
    params += [f"out{j}" for j in range(len(program.outputs))]
    params += ["R", "N"] + [f"d{j}" for j in range(1, rank - 1)]
    for i, v in enumerate(program.inputs):
        params += _strides(f"in{i}", v.kind, rank)
    for j, v in enumerate(program.outputs):
        params += _strides(f"out{j}", v.kind, rank)
    return params + ["BLOCK_M", "BLOCK_N"]


def source(program: Program, name: str, rank: int, doc: str) -> str:
    """The Triton source of `program` as kernel `name` over an iteration shape of `rank`."""
    params = parameters(program, rank)
    head = ", ".join(p + (": tl.constexpr" if p.startswith("BLOCK") else "") for p in params)
    lines = [f"@triton.jit", f"def {name}({head}):", f'    """{doc}"""',
             f"    CDT: tl.constexpr = {_TL[program.dtype]}",
             "    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None]",
             "    cols = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)[None, :]",
             "    row_mask = rows < R", "    mask = row_mask & (cols < N)"]
    if rank > 1:
        lines.append("    r = rows")
        for j in range(rank - 2, 0, -1):
            lines += [f"    i{j} = r % d{j}", f"    r = r // d{j}"]
        lines.append("    i0 = r")
    names: dict[int, str] = {}
    seen: dict[str, str] = {}                 # expression → its value: common subexpressions
    for v in program.schedule():
        if v.op == "load":
            i = v.attrs[0]
            where = "mask" if v.kind == FULL else "row_mask"
            raw = f"tl.load(in{i} + {_offsets(f'in{i}', v.kind, rank)}, mask={where}, other=0)"
            expr = f"{raw} != 0" if v.is_bool else f"{raw}.to(CDT)"
        else:
            expr = _expression(v, names, program.dtype)
        if expr not in seen:
            seen[expr] = f"v{len(seen)}"
            lines.append(f"    {seen[expr]} = {expr}")
        names[v.uid] = seen[expr]
    for j, v in enumerate(program.outputs):
        value = names[v.uid]
        if v.kind == ROW:
            lines.append(f"    tl.store(out{j} + {_offsets(f'out{j}', ROW, rank)}, "
                         f"{value}.to(out{j}.dtype.element_ty), mask=row_mask)")
        else:
            if v.kind != FULL:
                value = f"tl.broadcast_to({value}, [BLOCK_M, BLOCK_N])"
            lines.append(f"    tl.store(out{j} + {_offsets(f'out{j}', FULL, rank)}, "
                         f"{value}.to(out{j}.dtype.element_ty), mask=mask)")
    return "\n".join(lines) + "\n"


def module_source(kernels: list[str], header: str) -> str:
    return (f'"""{header}"""\nimport triton\nimport triton.language as tl\n\n\n'
            + "\n\n".join(kernels))


# ------------------------------------------------------------------ files and loading

def cache_dir() -> Path:
    """Where kernel sources live: $AUTOHYBRID_KERNEL_CACHE, else ~/.cache/autohybrid/
    kernels, else a temporary directory."""
    env = os.environ.get("AUTOHYBRID_KERNEL_CACHE")
    for root in ([Path(env)] if env else []) + [Path.home() / ".cache" / "autohybrid" / "kernels",
                                                Path(tempfile.gettempdir()) / "autohybrid_kernels"]:
        try:
            root.mkdir(parents=True, exist_ok=True)
            if os.access(root, os.W_OK):
                return root
        except OSError:
            continue
    raise OSError("no writable directory for autohybrid's kernel sources; set "
                  "AUTOHYBRID_KERNEL_CACHE")


def write_source(key: str, text: str) -> Path:
    """Write `text` as <cache>/<key>.py (atomically: ranks may write it at once)."""
    path = cache_dir() / f"{key}.py"
    if path.exists() and path.read_text() == text:
        return path
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    return path


def load_kernel(path: Path, name: str, interpret: bool):
    """Kernel `name` of source file `path`, for the interpreter or for the GPU."""
    spec = importlib.util.spec_from_file_location(f"autohybrid_kernel_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, name).fn           # the plain function under @triton.jit
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction
        return InterpretedFunction(fn)
    from triton.runtime.jit import JITFunction
    return JITFunction(fn)


# ------------------------------------------------------------------ launching

def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def blocks(R: int, N: int, rows_whole: bool, interpret: bool) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) for R rows of N: the whole row when reducing, else ≤ 1024
    columns; as many rows as fit in a tile."""
    tile = TILE_INTERPRET if interpret else TILE_GPU
    if rows_whole and N > MAX_ROW:
        raise ValueError(f"fused reduction over rows of {N} elements: more than the "
                         f"{MAX_ROW} one tile holds; leave this region unfused")
    bn = _pow2(N) if rows_whole else min(_pow2(N), 1024 if not interpret else tile)
    return max(1, min(_pow2(R), tile // bn)), bn


def launch(kernel, program: Program, inputs: list[torch.Tensor],
           outputs: list[torch.Tensor], shape: list[int], interpret: bool) -> None:
    """Run `kernel` (printed from `program`) over iteration `shape`; input/output tensors
    are given in their own shapes (broadcastable to `shape`, or row-shaped for rows)."""
    rank = len(shape)
    R, N = math.prod(shape[:-1]), shape[-1]
    if R == 0 or N == 0:
        return
    args: list = [*inputs, *outputs, R, N, *shape[1:-1]]
    for t, v in [*zip(inputs, program.inputs), *zip(outputs, program.outputs)]:
        if v.kind == ROW:
            args += list(t.stride()[:rank - 1]) if t.dim() >= rank - 1 else [0] * (rank - 1)
        else:
            args += list(t.expand(shape).stride())
    rows_whole = whole_rows(program)
    # the interpreter truncates fp32 → bf16: write those outputs in fp32, round in torch
    staged = [(i, torch.empty_like(t, dtype=torch.float32)) for i, t in enumerate(outputs)
              if interpret and t.dtype == torch.bfloat16]
    for i, tmp in staged:
        args[len(inputs) + i] = tmp

    def run(config: tuple[int, int, int]) -> None:
        bm, bn, warps = config
        grid = (triton_cdiv(R, bm), 1 if rows_whole else triton_cdiv(N, bn))
        extra = {} if interpret else {"num_warps": warps}
        kernel[grid](*args, BLOCK_M=bm, BLOCK_N=bn, **extra)

    if (interpret and not TUNE_IN_INTERPRETER) or os.environ.get("AUTOHYBRID_AUTOTUNE") == "0":
        bm, bn = blocks(R, N, rows_whole, interpret)
        run((bm, bn, _warps(bm, bn, rows_whole)))
    else:
        run(tuned(kernel, R, N, rows_whole, run, time_launch))
    for i, tmp in staged:
        outputs[i].copy_(tmp)


def _warps(bm: int, bn: int, rows_whole: bool) -> int:
    """Warps per program: by tile size; for a reduction by the row length only, so the
    rows per program (the tuned BLOCK_M) never change how a row is summed."""
    return min(16, max(4, _pow2((bn if rows_whole else bm * bn) // 512)))


def configs(R: int, N: int, rows_whole: bool) -> list[tuple[int, int, int]]:
    """The (BLOCK_M, BLOCK_N, warps) launches `tuned` times: the default of `blocks` and
    tiles a quarter and four times its size. A reduction keeps its whole row in one tile
    and only the rows per program vary (each row is summed the same way in all, so every
    rank gets the same bits whichever it picks); element-wise kernels vary both."""
    bm, bn = blocks(R, N, rows_whole, interpret=False)
    out = [(bm, bn)]
    if rows_whole:
        out += [(max(1, bm // 4), bn), (min(_pow2(R), bm * 4), bn)]
    else:
        out += [(bm, max(16, bn // 4)), (max(1, bm // 4), bn), (min(_pow2(R), bm * 4), bn)]
    unique = list(dict.fromkeys(out))
    return [(m, n, _warps(m, n, rows_whole)) for m, n in unique]


#: the launch `tuned` chose per (kernel, rows, row length) class, in this process
_TUNED: dict[tuple, tuple[int, int, int]] = {}


def tuned(kernel, R: int, N: int, rows_whole: bool, run, timer) -> tuple[int, int, int]:
    """The fastest of `configs` for `kernel` at this shape class (rows and row length
    rounded up to powers of two; a reduction's exact row length), timed once per class
    with `timer(fn, config) -> seconds` (`fn` runs `run(config)`), then remembered (the
    earlier config on a tie)."""
    key = (id(kernel), _pow2(R), N if rows_whole else _pow2(N), rows_whole)
    if key not in _TUNED:
        timed = [(timer(lambda c=c: run(c), c), i, c)
                 for i, c in enumerate(configs(R, N, rows_whole))]
        _TUNED[key] = min(timed)[2]
    return _TUNED[key]


def _gpu_time(fn, config) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=3, rep=10) / 1e3


#: how `launch` times a config (seconds); tests put a stand-in here
time_launch = _gpu_time
#: on a GPU every launch class is tuned (AUTOHYBRID_AUTOTUNE=0: the default tiles); in
#: the interpreter only when a test sets this
TUNE_IN_INTERPRETER = False


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------ ahead-of-time compile

def signature(program: Program, rank: int, in_dtypes: list[torch.dtype],
              out_dtypes: list[torch.dtype]) -> dict[str, str]:
    """The Triton signature of the kernel printed from `program` (32-bit integers)."""
    ptrs = [_PTR[d] for d in [*in_dtypes, *out_dtypes]]
    params = parameters(program, rank)
    sig = {p: (ptrs[i] if i < len(ptrs) else "i32") for i, p in enumerate(params[:-2])}
    return {**sig, "BLOCK_M": "constexpr", "BLOCK_N": "constexpr"}


def compile_aot(path: str | Path, name: str, sig: dict[str, str], block_m: int = 4,
                block_n: int = 256, arch: int = 90):
    """Compile kernel `name` of `path` for CUDA sm_`arch` without a GPU (to a cubin).
    Run it in a process where TRITON_INTERPRET is unset."""
    import triton
    from triton.backends.compiler import GPUTarget
    kernel = load_kernel(Path(path), name, interpret=False)
    src = triton.compiler.ASTSource(fn=kernel, signature=sig,
                                    constexprs={"BLOCK_M": block_m, "BLOCK_N": block_n})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32))
