"""Printing a kernel `Program` (ir.py) as the source of one `@triton.jit` kernel.

Every kernel has the same frame (see triton.py for the launch): R rows × N columns,
operands as pointers + strides over the iteration shape, masks on the ragged edges.
Loads convert to the compute dtype (CDT: fp32, fp64 for fp64 regions), stores to the
output pointer's dtype. `source` prints the one-tile kernel (a reduction holds its whole
row; outputs summed over the rows make each row program loop over row blocks, see
`strided`); rowloop.py prints the looped kernel from the helpers here (`Emitter`, the
stores).
"""
from __future__ import annotations

import math

import torch

from .ir import FULL, ROW, Program, Value

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


def _strides(prefix: str, kind: str, rank: int, fold=None) -> list[str]:
    if fold is not None:          # a partial sum: [row programs or rows, N or col programs]
        return [f"{prefix}_s0", f"{prefix}_s1"]
    return [f"{prefix}_s{j}" for j in range(rank - 1 if kind == ROW else rank)]


def parameters(program: Program, rank: int) -> list[str]:
    """The kernel's parameters, in order (see `launch` for what each receives)."""
    params = [f"in{i}" for i in range(len(program.inputs))]
    params += [f"out{j}" for j in range(len(program.outputs))]
    params += ["R", "N"] + [f"d{j}" for j in range(1, rank - 1)]
    for i, v in enumerate(program.inputs):
        params += _strides(f"in{i}", v.kind, rank)
    for j, v in enumerate(program.outputs):
        params += _strides(f"out{j}", v.kind, rank, program.fold(j))
    return params + ["BLOCK_M", "BLOCK_N"]


def strided(program: Program) -> bool:
    """Whether a program's row programs loop over row blocks (grid-stride): an output
    summed over the rows is then one partial row per program, not per row block."""
    return any(f in ("rows", "both") for f in program.folds)


def head(program: Program, name: str, rank: int, doc: str) -> list[str]:
    params = parameters(program, rank)
    text = ", ".join(p + (": tl.constexpr" if p.startswith("BLOCK") else "") for p in params)
    return [f"@triton.jit", f"def {name}({text}):", f'    """{doc}"""',
            f"    CDT: tl.constexpr = {_TL[program.dtype]}"]


def row_lines(rank: int, pad: str, start: str = "tl.program_id(0)") -> list[str]:
    """`rows`, `row_mask` and the row's index per leading dim (`i0`…), at indent `pad`."""
    lines = [f"{pad}rows = ({start} * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None]",
             f"{pad}row_mask = rows < R"]
    if rank > 1:
        lines.append(f"{pad}r = rows")
        for j in range(rank - 2, 0, -1):
            lines += [f"{pad}i{j} = r % d{j}", f"{pad}r = r // d{j}"]
        lines.append(f"{pad}i0 = r")
    return lines


class Emitter:
    """Prints values as assignments; one CSE scope per loop body (`scope`), names
    unique across the kernel (a name bound inside a loop is never rebound outside)."""

    def __init__(self, program: Program, rank: int):
        self.program, self.rank = program, rank
        self.names: dict[int, str] = {}
        self.count = 0

    def scope(self) -> "Scope":
        return Scope(self)


class Scope:
    """One CSE scope: the values printed in it and those of the kernel's outer part."""

    def __init__(self, emitter: Emitter):
        self.e, self.seen = emitter, {}
        self.names = dict(emitter.names)

    def emit(self, values: list[Value], lines: list[str], pad: str) -> None:
        program, rank = self.e.program, self.e.rank
        for v in values:
            if v.uid in self.names:
                continue
            if v.op == "load":
                i = v.attrs[0]
                where = "mask" if v.kind == FULL else "row_mask"
                raw = f"tl.load(in{i} + {_offsets(f'in{i}', v.kind, rank)}, mask={where}, other=0)"
                expr = f"{raw} != 0" if v.is_bool else f"{raw}.to(CDT)"
            else:
                expr = _expression(v, self.names, program.dtype)
            if expr not in self.seen:
                self.seen[expr] = f"v{self.e.count}"
                self.e.count += 1
                lines.append(f"{pad}{self.seen[expr]} = {expr}")
            self.names[v.uid] = self.seen[expr]

    def keep(self, values: list[Value]) -> None:
        """Make these values' names visible to later scopes (values outside loops)."""
        for v in values:
            self.e.names[v.uid] = self.names[v.uid]


def masked(value: str) -> str:
    return f"tl.where(mask, {value}, 0.0)"


def store(j: int, v: Value, value: str, rank: int, pad: str) -> str:
    """The store of output `j` (no fold) from a tile holding `value`."""
    if v.kind == ROW:
        return (f"{pad}tl.store(out{j} + {_offsets(f'out{j}', ROW, rank)}, "
                f"{value}.to(out{j}.dtype.element_ty), mask=row_mask)")
    if v.kind != FULL:
        value = f"tl.broadcast_to({value}, [BLOCK_M, BLOCK_N])"
    return (f"{pad}tl.store(out{j} + {_offsets(f'out{j}', FULL, rank)}, "
            f"{value}.to(out{j}.dtype.element_ty), mask=mask)")


def store_partial(j: int, value: str, where: str, pad: str, col: str = "tl.program_id(1)"
                  ) -> str:
    """The store of a partial sum of output `j`: `where` is "rows" (a [BLOCK_M, 1]
    value per row), "row program" (a [1, BLOCK_N] value per column) or "program" ([1, 1])."""
    cast = f"{value}.to(out{j}.dtype.element_ty)"
    if where == "rows":
        return f"{pad}tl.store(out{j} + rows * out{j}_s0 + {col} * out{j}_s1, {cast}, mask=row_mask)"
    if where == "row program":
        return (f"{pad}tl.store(out{j} + tl.program_id(0) * out{j}_s0 + cols * out{j}_s1, "
                f"{cast}, mask=cols < N)")
    return (f"{pad}tl.store(out{j} + tl.zeros([1, 1], tl.int64) + tl.program_id(0) * out{j}_s0"
            f" + {col} * out{j}_s1, {cast})")


def source(program: Program, name: str, rank: int, doc: str) -> str:
    """The Triton source of `program` as kernel `name` over an iteration shape of `rank`:
    each program one tile of BLOCK_M rows × BLOCK_N columns; with outputs summed over
    the rows (`strided`), each row program loops over row blocks."""
    lines = head(program, name, rank, doc)
    loop = strided(program)
    pad = "        " if loop else "    "
    cols = "cols = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)[None, :]"
    rows = row_lines(rank, pad, "rb" if loop else "tl.program_id(0)")
    if loop:
        lines.append(f"    {cols}")
        for j, f in enumerate(program.folds):
            if f in ("rows", "both"):
                lines.append(f"    acc{j} = tl.zeros([1, {'BLOCK_N' if f == 'rows' else 1}], CDT)")
        lines.append("    for rb in range(tl.program_id(0), tl.cdiv(R, BLOCK_M), tl.num_programs(0)):")
        lines += rows[:1]
    else:
        lines += [rows[0], f"{pad}{cols}"]
    lines += [rows[1], f"{pad}mask = row_mask & (cols < N)"] + rows[2:]
    body = Emitter(program, rank).scope()
    body.emit(program.schedule(), lines, pad)
    for j, v in enumerate(program.outputs):
        value, fold = body.names[v.uid], program.fold(j)
        if fold is None:
            lines.append(store(j, v, value, rank, pad))
        elif fold == "cols":
            lines.append(store_partial(j, f"tl.sum({masked(value)}, axis=1)[:, None]", "rows", pad))
        elif fold == "rows":
            lines.append(f"{pad}acc{j} += tl.sum({masked(value)}, axis=0)[None, :]")
        else:
            lines.append(f"{pad}acc{j} += tl.sum(tl.sum({masked(value)}, axis=1)[:, None], axis=0)[None, :]")
    for j, f in enumerate(program.folds):
        if f in ("rows", "both"):
            lines.append(store_partial(j, f"acc{j}", "row program" if f == "rows" else "program", "    "))
    return "\n".join(lines) + "\n"


def module_source(kernels: list[str], header: str) -> str:
    return (f'"""{header}"""\nimport triton\nimport triton.language as tl\n\n\n'
            + "\n\n".join(kernels))
