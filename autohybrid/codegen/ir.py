"""The kernel IR: a fused region as straight-line primitive ops over one row-major tile.

Owns the value model every kernel shares. A region's *iteration shape* is the broadcast
of its input shapes, seen as R rows (all dims but the last) × N columns (the last dim).
Each value lives in one of three layouts (`kind`):

    full    one element per (row, column)            a [BLOCK_M, BLOCK_N] tile
    row     one element per row (a last-dim result)  a [BLOCK_M, 1] tile
    scalar  one element per kernel (the row length)  a scalar

Reductions (`sum_row`, `amax_row`) turn a full value into a row value; binary ops take
the widest layout of their operands. Every float value is computed in one compute dtype
(fp32, or fp64 for fp64 regions); `dtype` is the value's logical torch dtype, which
matters for loads, explicit casts (`cast` rounds to it) and comparisons (bool).

This module knows nothing of fx or Triton: `lower.py` builds programs from regions,
`autodiff.py` derives backward programs, `triton.py` prints them.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

FULL, ROW, SCALAR = "full", "row", "scalar"
FOLDS = (None, "rows", "cols", "both")
_WIDTH = {SCALAR: 0, ROW: 1, FULL: 2}

#: primitive → number of value operands (scalars may stand in for any operand)
ARITY = {
    "add": 2, "sub": 2, "mul": 2, "div": 2, "maximum": 2, "minimum": 2,
    "gt": 2, "lt": 2, "ge": 2, "le": 2, "eq": 2, "ne": 2, "where": 3,
    "neg": 1, "exp": 1, "log": 1, "tanh": 1, "sigmoid": 1, "erf": 1, "sqrt": 1,
    "rsqrt": 1, "abs": 1, "relu": 1, "pow": 1, "cast": 1, "stop_grad": 1,
    "sum_row": 1, "amax_row": 1, "expand_full": 1,
}
COMPARISONS = {"gt", "lt", "ge", "le", "eq", "ne"}
REDUCTIONS = {"sum_row", "amax_row"}

_ids = itertools.count()


@dataclass(eq=False)
class Value:
    """One SSA value. `op` is a primitive of ARITY, or "load" (attrs: input index),
    "ncols" (the row length N as a float), "zeros" (a full tile of 0)."""

    op: str
    args: tuple = ()
    kind: str = FULL
    dtype: torch.dtype = torch.float32
    attrs: tuple = ()
    uid: int = field(default_factory=lambda: next(_ids))

    @property
    def is_bool(self) -> bool:
        return self.dtype == torch.bool


Operand = "Value | float | int | bool"


def _kind_of(args: tuple) -> str:
    kinds = [a.kind for a in args if isinstance(a, Value)]
    return max(kinds, key=_WIDTH.__getitem__) if kinds else SCALAR


def _float_dtype(args: tuple) -> torch.dtype:
    dtypes = [a.dtype for a in args if isinstance(a, Value) and not a.is_bool]
    out = torch.float32
    for d in dtypes:
        out = torch.promote_types(out, d) if d.is_floating_point else out
    return out


def op(name: str, *args, attrs: tuple = ()) -> Value:
    """A new value `name(*args)`, its layout and logical dtype inferred."""
    if name not in ARITY:
        raise KeyError(f"unknown kernel primitive {name!r}")
    if len(args) != ARITY[name]:
        raise TypeError(f"{name} takes {ARITY[name]} operands, got {len(args)}")
    kind = _kind_of(args)
    if name in REDUCTIONS:
        if kind != FULL:
            raise ValueError(f"{name} reduces a full tile, got a {kind} value")
        kind = ROW
    if name == "expand_full":
        kind = FULL
    if name in COMPARISONS:
        dtype = torch.bool
    elif name == "cast":
        dtype = attrs[0]
    elif name == "where":
        dtype = _float_dtype(args[1:])
    elif name in ("stop_grad", "expand_full") and isinstance(args[0], Value):
        dtype = args[0].dtype
    else:
        dtype = _float_dtype(args)
    return Value(name, tuple(args), kind, dtype, tuple(attrs))


def load(index: int, kind: str, dtype: torch.dtype) -> Value:
    return Value("load", (), kind, dtype, (index,))


def ncols() -> Value:
    return Value("ncols", (), SCALAR, torch.float32)


def zeros() -> Value:
    return Value("zeros", (), FULL, torch.float32)


@dataclass
class Program:
    """A kernel's body: `inputs` (load values, in argument order) and `outputs` (values
    to store, in order); `dtype` is the compute dtype (fp32 or fp64). `folds` (empty, or
    one entry per output) says how a full output is summed inside the kernel before it
    is stored: None (stored whole), "rows" (over the rows: one partial row of N per row
    program), "cols" (over the columns: one partial value per row and column program),
    "both"; the caller sums the partials (a broadcast input's gradient, ops/fused.py)."""

    inputs: list[Value]
    outputs: list[Value]
    dtype: torch.dtype = torch.float32
    folds: tuple = ()

    def fold(self, j: int):
        return self.folds[j] if self.folds else None

    @property
    def reduces(self) -> bool:
        return any(v.op in REDUCTIONS for v in self.schedule())

    def schedule(self) -> list[Value]:
        """The values the outputs need, in creation order (a topological order)."""
        seen: dict[int, Value] = {}
        stack = list(self.outputs)
        while stack:
            v = stack.pop()
            if v.uid in seen:
                continue
            seen[v.uid] = v
            stack.extend(a for a in v.args if isinstance(a, Value))
        return sorted(seen.values(), key=lambda v: v.uid)
