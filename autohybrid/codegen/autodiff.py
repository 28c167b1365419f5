"""Reverse-mode differentiation of kernel programs: forward `Program` → backward `Program`.

Owns one vector-Jacobian rule per primitive of `ir.ARITY`. The backward program reads
the forward inputs and the output gradients only: every forward value it needs is
recomputed from the inputs inside the backward kernel (nothing but the inputs is saved).
Its outputs are the gradients of the float inputs, each a full tile over the iteration
shape; the caller sums a broadcast input's gradient down to its shape (`sum_to_size`).
A gradient that reaches a row value from a full use is summed along the row (`sum_row`).

Rules follow ATen's derivatives where they choose (relu: 0 at 0; maximum: half to each
side on ties; amax: split evenly among the maxima).
"""
from __future__ import annotations

import math

from . import ir
from .ir import FULL, ROW, SCALAR, Program, Value, op


def _rule(v: Value, g: Value) -> list:
    """Gradient contributions of `v = v.op(*v.args)` to each of its args (None: none)."""
    a = v.args[0] if v.args else None
    b = v.args[1] if len(v.args) > 1 else None
    name = v.op
    if name == "add":
        return [g, g]
    if name == "sub":
        return [g, op("neg", g)]
    if name == "mul":
        return [op("mul", g, b), op("mul", g, a)]
    if name == "div":
        return [op("div", g, b), op("neg", op("div", op("mul", g, v), b))]
    if name == "neg":
        return [op("neg", g)]
    if name == "exp":
        return [op("mul", g, v)]
    if name == "log":
        return [op("div", g, a)]
    if name == "tanh":
        return [op("mul", g, op("sub", 1.0, op("mul", v, v)))]
    if name == "sigmoid":
        return [op("mul", g, op("mul", v, op("sub", 1.0, v)))]
    if name == "erf":
        return [op("mul", g, op("mul", 2.0 / math.sqrt(math.pi), op("exp", op("neg", op("mul", a, a)))))]
    if name == "sqrt":
        return [op("div", op("mul", g, 0.5), v)]
    if name == "rsqrt":
        return [op("mul", g, op("mul", -0.5, op("div", v, a)))]
    if name == "abs":
        return [op("where", op("gt", a, 0.0), g, op("where", op("lt", a, 0.0), op("neg", g), 0.0))]
    if name == "relu":
        return [op("where", op("gt", v, 0.0), g, 0.0)]
    if name == "pow":
        p = v.attrs[0]
        if p == 0.0:
            return [None]
        d = op("mul", p, a) if p == 2.0 else op("mul", p, op("pow", a, attrs=(p - 1.0,)))
        return [op("mul", g, d)]
    if name in ("maximum", "minimum"):
        wins = op("gt" if name == "maximum" else "lt", a, b)
        tie = op("eq", a, b)
        half = op("mul", g, 0.5)
        ga = op("where", tie, half, op("where", wins, g, 0.0))
        gb = op("where", tie, half, op("where", wins, 0.0, g))
        return [ga, gb]
    if name == "where":
        return [None, op("where", a, g, 0.0), op("where", a, 0.0, g)]
    if name == "cast":
        return [op("cast", g, attrs=(a.dtype,)) if isinstance(a, Value) and not a.is_bool else None]
    if name == "sum_row":
        return [g]
    if name == "amax_row":
        hit = op("cast", op("eq", a, v), attrs=(v.dtype,))
        return [op("div", op("mul", g, hit), op("sum_row", hit))]
    if name == "expand_full":
        return [g]
    if name in ir.COMPARISONS or name == "stop_grad":
        return [None] * len(v.args)
    raise NotImplementedError(f"no derivative rule for kernel primitive {name!r}")


def _fit(g: Value, target: Value) -> Value:
    """`g` in the layout of `target`: a full gradient of a row value sums along the row."""
    if target.kind == ROW and g.kind == FULL:
        return op("sum_row", g)
    return g


def backward(fwd: Program) -> Program:
    """The backward program of `fwd`: inputs are fwd's inputs then one gradient per
    output (its layout); outputs are the gradients of fwd's float inputs (full tiles)."""
    n_in = len(fwd.inputs)
    grad_outs = [ir.load(n_in + i, o.kind, o.dtype) for i, o in enumerate(fwd.outputs)]
    grads: dict[int, Value] = {}
    for o, g in zip(fwd.outputs, grad_outs):
        if not o.is_bool:
            grads[o.uid] = g if o.uid not in grads else op("add", grads[o.uid], g)
    for v in reversed(fwd.schedule()):
        g = grads.get(v.uid)
        if g is None or not v.args or v.is_bool:
            continue
        for arg, contrib in zip(v.args, _rule(v, g)):
            if contrib is None or not isinstance(arg, Value) or arg.is_bool \
                    or arg.kind == SCALAR or arg.op == "ncols":
                continue
            contrib = _fit(contrib, arg)
            grads[arg.uid] = contrib if arg.uid not in grads else op("add", grads[arg.uid], contrib)
    outputs = []
    for x in fwd.inputs:
        if x.is_bool:
            continue
        g = grads.get(x.uid)
        if g is None:
            g = ir.zeros()
        elif g.kind != FULL:
            g = op("expand_full", g)
        outputs.append(g)
    return Program(inputs=list(fwd.inputs) + grad_outs, outputs=outputs, dtype=fwd.dtype)
