"""Triton kernels of programs: the kernel cache on disk, launching, AOT compiles.

Sources are printed by printer.py (`source`, the one-tile kernel) and rowloop.py
(`loop_source`, the looped kernel of a reduction over rows longer than MAX_ROW). Every
kernel has the same frame:

    rows × cols tile   rows = flattened leading dims of the iteration shape (runtime R,
                       decomposed into dims d1… with % and //), cols = last dim (N)
    operands           pointers + strides over the iteration shape (a broadcast input
                       has stride 0 on its broadcast dims), so any layout and any size
                       works; masks cover the ragged edges
    grid               (cdiv(R, BLOCK_M), cdiv(N, BLOCK_N)) for element-wise programs;
                       (cdiv(R, BLOCK_M), 1) when a value is reduced along the row:
                       BLOCK_N ≥ N up to MAX_ROW, beyond it the looped kernel walks the
                       row in chunks of BLOCK_N; at most ROW_PROGRAMS row programs when
                       an output is summed over the rows (printer.py `strided`)

Sources live in files (`@triton.jit` reads its source back) under `cache_dir()`;
`load_kernel` wraps the function for the GPU (JITFunction) or the CPU interpreter
(InterpretedFunction) as asked, whatever TRITON_INTERPRET said at import.
"""
from __future__ import annotations

import importlib.util
import math
import os
import tempfile
from pathlib import Path

import torch

from ..errors import RuntimeFailure, VersionError
from ..features import TRITON_SUPPORTED, _range
from .ir import ROW, Program

#: the longest row a reduction kernel holds in one tile (elements)
MAX_ROW = 1 << 15
#: elements per tile: on the GPU (registers) and in the interpreter (few programs)
TILE_GPU, TILE_INTERPRET = 4096, 1 << 16
#: columns per walk of a looped reduction (rows longer than MAX_ROW) on the GPU
LOOP_CHUNK_GPU = 4096
#: the most row programs of a kernel with outputs summed over rows (`strided`): each
#: loops over row blocks and writes one partial row, so partials hold this many rows
ROW_PROGRAMS = 256

from .printer import (_PTR, module_source, parameters, source, strided,  # noqa: F401
                      whole_rows)
from .rowloop import loop_source  # noqa: F401

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


def looped(program: Program, N: int) -> bool:
    """Whether `program` runs as its looped kernel (rowloop.py) on rows of N: it reduces
    along rows longer than one tile holds."""
    return whole_rows(program) and N > MAX_ROW


def blocks(R: int, N: int, rows_whole: bool, interpret: bool) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) for R rows of N: the whole row when reducing (a chunk of the
    row when it is longer than MAX_ROW: the looped kernel), else ≤ 1024 columns; as many
    rows as fit in a tile."""
    tile = TILE_INTERPRET if interpret else TILE_GPU
    if rows_whole and N > MAX_ROW:
        bn = min(MAX_ROW, tile if interpret else LOOP_CHUNK_GPU)
    else:
        bn = _pow2(N) if rows_whole else min(_pow2(N), 1024 if not interpret else tile)
    return max(1, min(_pow2(R), tile // bn)), bn


def grid(program: Program, R: int, N: int, bm: int, bn: int) -> tuple[int, int]:
    """The launch grid: row programs × column programs."""
    rows = triton_cdiv(R, bm)
    if strided(program) and not looped(program, N):
        rows = min(rows, ROW_PROGRAMS)
    return rows, 1 if whole_rows(program) else triton_cdiv(N, bn)


def partial_shape(fold: str, R: int, N: int, grid_: tuple[int, int]) -> list[int]:
    """The shape of an output summed inside the kernel (`Program.folds`), before the
    caller sums the partials: rows → [row programs, N], cols → [R, column programs],
    both → [row programs, column programs]."""
    return {"rows": [grid_[0], N], "cols": [R, grid_[1]], "both": list(grid_)}[fold]


def partials(program: Program, shape: list[int], interpret: bool, device
             ) -> list[torch.Tensor | None]:
    """Per output of `program`: the zeroed buffer of its partial sums where the kernel
    sums it (`Program.folds`; `partial_shape` at the default tiles, in the compute
    dtype), else None. `launch` writes them; the caller sums them."""
    R, N = math.prod(shape[:-1]), shape[-1]
    g = grid(program, R, N, *blocks(R, N, whole_rows(program), interpret)) if R and N \
        else (0, 0)
    return [None if program.fold(j) is None else
            torch.zeros(partial_shape(program.fold(j), R, N, g), dtype=program.dtype,
                        device=device) for j in range(len(program.outputs))]


def launch(kernel, program: Program, inputs: list[torch.Tensor],
           outputs: list[torch.Tensor], shape: list[int], interpret: bool) -> None:
    """Run `kernel` (printed from `program`: its looped kernel where `looped`) over
    iteration `shape`; input/output tensors are given in their own shapes (broadcastable
    to `shape`, or row-shaped for rows; an output the kernel sums, `Program.folds`, as
    the buffer `partials` made). Kernels with summed outputs launch with the default
    tiles, untuned: the partials' shapes and sums follow the tiles."""
    rank = len(shape)
    R, N = math.prod(shape[:-1]), shape[-1]
    rows_whole, loop = whole_rows(program), looped(program, N)
    name = getattr(getattr(kernel, "fn", None), "__name__", None)
    if name is not None and name.endswith("_loop") != loop:
        raise RuntimeFailure(f"kernel {name} launched on rows of {N}: the "
                             f"{'looped' if loop else 'one-tile'} kernel of its program "
                             f"runs there (MAX_ROW {MAX_ROW})")
    folded = any(f is not None for f in program.folds)
    default = blocks(R, N, rows_whole, interpret)
    if R == 0 or N == 0:
        return
    if folded:
        g = grid(program, R, N, *default)
        for j, t in enumerate(outputs):
            f = program.fold(j)
            if f is not None and list(t.shape) != partial_shape(f, R, N, g):
                raise RuntimeFailure(f"kernel {name}: output {j} is summed in the kernel "
                                     f"into {partial_shape(f, R, N, g)} partials, given a "
                                     f"buffer of {list(t.shape)}; allocate it with partials()")
    args: list = [*inputs, *outputs, R, N, *shape[1:-1]]
    for j, (t, v) in enumerate([*zip(inputs, program.inputs), *zip(outputs, program.outputs)]):
        out = j - len(inputs)
        if out >= 0 and program.fold(out) is not None:
            args += list(t.stride())
        elif v.kind == ROW:
            args += list(t.stride()[:rank - 1]) if t.dim() >= rank - 1 else [0] * (rank - 1)
        else:
            args += list(t.expand(shape).stride())
    # the interpreter truncates fp32 → bf16: write those outputs in fp32, round in torch
    staged = [(i, torch.empty_like(t, dtype=torch.float32)) for i, t in enumerate(outputs)
              if interpret and t.dtype == torch.bfloat16]
    for i, tmp in staged:
        args[len(inputs) + i] = tmp

    def run(config: tuple[int, int, int]) -> None:
        bm, bn, warps = config
        extra = {} if interpret else {"num_warps": warps}
        kernel[grid(program, R, N, bm, bn)](*args, BLOCK_M=bm, BLOCK_N=bn, **extra)

    if folded or (interpret and not TUNE_IN_INTERPRETER) \
            or os.environ.get("AUTOHYBRID_AUTOTUNE") == "0":
        run((*default, _warps(*default, rows_whole)))
    else:
        device = inputs[0].device
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
        run(tuned(kernel, R, N, rows_whole, run, time_launch, name))
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


def tuned(kernel, R: int, N: int, rows_whole: bool, run, timer, device: str | None = None
          ) -> tuple[int, int, int]:
    """The fastest of `configs` for `kernel` at this shape class (rows and row length
    rounded up to powers of two; a reduction's exact row length), timed once per class
    with `timer(fn, config) -> seconds` (`fn` runs `run(config)`), then remembered (the
    earlier config on a tie). With `device` (the GPU's name) the choice is also kept on
    disk (`tuning_file`), keyed by the kernel's source, the shape class and the device:
    a later process on that machine (every rank of the next run, or of this one once a
    rank has tuned) takes it without timing. The config never changes a kernel's result
    (`configs`), only its speed."""
    shape = (_pow2(R), N if rows_whole else _pow2(N), rows_whole)
    key = (_source_hash(kernel), device or "host") + shape
    if key not in _TUNED:
        choices = configs(R, N, rows_whole)
        saved = _saved().get("|".join(map(str, key))) if device is not None else None
        if saved is not None and tuple(saved) in choices:
            _TUNED[key] = tuple(saved)
        elif _FROZEN[0]:      # a step is running: the default launch, never a timing
            _TUNED[key] = choices[0]
        else:
            timed = [(timer(lambda c=c: run(c), c), i, c) for i, c in enumerate(choices)]
            _TUNED[key] = min(timed)[2]
            if device is not None:
                _save("|".join(map(str, key)), _TUNED[key])
    return _TUNED[key]


#: set by `freeze_tuning` once a compiled model's first step begins (runtime/pretune.py
#: tuned its kernels before it): a shape class met later takes the default launch
_FROZEN = [False]


def freeze_tuning(frozen: bool = True) -> None:
    """From now on `tuned` never times (no device synchronization while collectives are
    in flight): an untuned shape class takes `configs`' default."""
    _FROZEN[0] = frozen


def tuning_active(device: torch.device) -> bool:
    """Whether `launch` tunes launches on `device`: on a GPU (in the interpreter only
    when a test sets TUNE_IN_INTERPRETER), unless AUTOHYBRID_AUTOTUNE=0."""
    if os.environ.get("AUTOHYBRID_AUTOTUNE") == "0":
        return False
    return device.type == "cuda" or TUNE_IN_INTERPRETER


def tuning_choices() -> dict[str, tuple[int, int, int]]:
    """The launches chosen in this process, by a key that names the same kernel and
    shape class in every process (kernel source digest, device name, rows, row length)."""
    return {"|".join(map(str, key)): config for key, config in _TUNED.items()}


def install_choices(choices: dict[str, tuple[int, int, int]]) -> int:
    """Take `choices` (`tuning_choices`' form, e.g. another rank's) for the kernels and
    shape classes they name; how many replaced this process's own."""
    by_text = {"|".join(map(str, key)): key for key in _TUNED}
    changed = 0
    for text, config in choices.items():
        key = by_text.get(text)
        if key is None:
            source, device, rows, n, whole = text.split("|")
            key = (source, device, int(rows), int(n), whole == "True")
        changed += key in _TUNED and _TUNED[key] != tuple(config)
        _TUNED[key] = tuple(config)
    return changed


def tuning_file() -> Path:
    """Where tuned launches are kept: <cache_dir()>/tuning.json."""
    return cache_dir() / "tuning.json"


_SOURCES: dict[int, tuple[object, str]] = {}


def _source_hash(kernel) -> str:
    import hashlib
    import inspect
    entry = _SOURCES.get(id(kernel))
    if entry is None or entry[0] is not kernel:
        fn = getattr(kernel, "fn", kernel)
        text = getattr(kernel, "src", None) or inspect.getsource(fn)
        entry = (kernel, hashlib.sha256(text.encode()).hexdigest()[:20])
        _SOURCES[id(kernel)] = entry
    return entry[1]


def _saved() -> dict:
    import json
    try:
        data = json.loads(tuning_file().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}         # none yet, or unreadable: tune again (and rewrite it)


def _save(key: str, config: tuple[int, int, int]) -> None:
    import json
    data = _saved()
    data[key] = list(config)
    path = tuning_file()
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass              # a read-only cache: tuned again by the next process


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
    Run it in a process where TRITON_INTERPRET is unset. Uses Triton's compile API of
    features.TRITON_SUPPORTED (`ASTSource(fn, signature, constexprs)` with constexprs by
    name, `GPUTarget`); another raises VersionError naming the installed Triton."""
    import triton
    from triton.backends.compiler import GPUTarget
    check_compile_api(triton.compiler.ASTSource, getattr(triton, "__version__", "?"))
    kernel = load_kernel(Path(path), name, interpret=False)
    src = triton.compiler.ASTSource(fn=kernel, signature=sig,
                                    constexprs={"BLOCK_M": block_m, "BLOCK_N": block_n})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32))


def check_compile_api(source_class, version: str) -> None:
    """Raise VersionError unless `source_class` (triton.compiler.ASTSource) takes
    `fn`, `signature` and `constexprs` (Triton 3.2 on; 3.0 and 3.1 took `constants`)."""
    import inspect
    try:
        params = set(inspect.signature(source_class).parameters)
    except (TypeError, ValueError):
        params = set()
    missing = {"fn", "signature", "constexprs"} - params
    if missing:
        raise VersionError(
            f"triton {version}: triton.compiler.ASTSource takes no {', '.join(sorted(missing))}"
            f"; autohybrid's kernels compile with triton{_range(TRITON_SUPPORTED)}; install "
            "the Triton of a torch in autohybrid's supported range")
