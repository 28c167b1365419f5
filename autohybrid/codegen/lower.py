"""Lowering: a fused region (an fx GraphModule of ATen ops) → a kernel `Program`.

Owns the table of ATen ops the code generator takes (`LOWERINGS`) and how each becomes
primitives (gelu → erf, softmax → amax/exp/sum, layer_norm → sums and rsqrt, ...), the
checks that a region fits the one-tile model of `ir.py` (reductions only along the last
dim of the iteration shape), the shapes of the outputs (`recipe`: which iteration dims
each output has) and the region's structural key text. It does not print Triton.

    >>> gm = fx.symbolic_trace(lambda x, b: torch.ops.aten.relu.default(x + b))  # + ShapeProp
    >>> lowered = lower(gm)          # lowered.program, lowered.recipes, lowered.rank
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx

from . import ir
from .ir import FULL, ROW, Program, Value, op

aten = torch.ops.aten


class UnsupportedRegion(ValueError):
    """The region (or one of its nodes) does not fit the code generator; the message
    names the node and why. The fusion pass leaves such a region unfused."""


# ------------------------------------------------------------------ the op table

def _scalar(x):
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else x


def _alpha(b, alpha):
    return b if alpha == 1 else op("mul", b, _scalar(alpha))


def _gelu(x, approximate="none"):
    if approximate == "tanh":
        inner = op("mul", math.sqrt(2.0 / math.pi),
                   op("add", x, op("mul", 0.044715, op("pow", x, attrs=(3.0,)))))
        return op("mul", op("mul", 0.5, x), op("add", 1.0, op("tanh", inner)))
    return op("mul", op("mul", 0.5, x), op("add", 1.0, op("erf", op("mul", x, math.sqrt(0.5)))))


def _to(x, dtype=None, **_):
    return x if dtype is None or dtype == x.dtype else op("cast", x, attrs=(dtype,))


def _mean(x):
    return op("div", op("sum_row", x), ir.ncols())


def _softmax(x, log=False):
    m = op("stop_grad", op("amax_row", x))
    shifted = op("sub", x, m)
    total = op("sum_row", op("exp", shifted))
    return op("sub", shifted, op("log", total)) if log else op("div", op("exp", shifted), total)


def _layer_norm(x, shape, weight=None, bias=None, eps=1e-5, *_):
    centered = op("sub", x, _mean(x))
    var = _mean(op("mul", centered, centered))
    y = op("mul", centered, op("rsqrt", op("add", var, float(eps))))
    y = y if weight is None else op("mul", y, weight)
    return y if bias is None else op("add", y, bias)


def _rms_norm(x, shape, weight=None, eps=None, *, dtype):
    eps = torch.finfo(dtype).eps if eps is None else eps
    y = op("mul", x, op("rsqrt", op("add", _mean(op("mul", x, x)), float(eps))))
    return y if weight is None else op("mul", y, weight)


def _cmp(name):
    return lambda a, b: op(name, a, _scalar(b))


#: ATen op → builder of its value from lowered arguments (Values or Python scalars)
POINTWISE: dict[object, Callable] = {
    aten.add.Tensor: lambda a, b, alpha=1: op("add", a, _alpha(_scalar(b), alpha)),
    aten.add.Scalar: lambda a, b, alpha=1: op("add", a, _alpha(_scalar(b), alpha)),
    aten.sub.Tensor: lambda a, b, alpha=1: op("sub", a, _alpha(_scalar(b), alpha)),
    aten.sub.Scalar: lambda a, b, alpha=1: op("sub", a, _alpha(_scalar(b), alpha)),
    aten.rsub.Scalar: lambda a, b, alpha=1: op("sub", _scalar(b), _alpha(a, alpha)),
    aten.rsub.Tensor: lambda a, b, alpha=1: op("sub", _scalar(b), _alpha(a, alpha)),
    aten.mul.Tensor: lambda a, b: op("mul", a, _scalar(b)),
    aten.mul.Scalar: lambda a, b: op("mul", a, _scalar(b)),
    aten.div.Tensor: lambda a, b: op("div", a, _scalar(b)),
    aten.div.Scalar: lambda a, b: op("div", a, _scalar(b)),
    aten.neg.default: lambda a: op("neg", a),
    aten.exp.default: lambda a: op("exp", a),
    aten.log.default: lambda a: op("log", a),
    aten.tanh.default: lambda a: op("tanh", a),
    aten.sigmoid.default: lambda a: op("sigmoid", a),
    aten.relu.default: lambda a: op("relu", a),
    aten.gelu.default: _gelu,
    aten.silu.default: lambda a: op("mul", a, op("sigmoid", a)),
    aten.pow.Tensor_Scalar: lambda a, p: op("pow", a, attrs=(float(p),)),
    aten.sqrt.default: lambda a: op("sqrt", a),
    aten.rsqrt.default: lambda a: op("rsqrt", a),
    aten.reciprocal.default: lambda a: op("div", 1.0, a),
    aten.abs.default: lambda a: op("abs", a),
    aten.where.self: lambda c, a, b: op("where", c, _scalar(a), _scalar(b)),
    aten.where.ScalarOther: lambda c, a, b: op("where", c, a, _scalar(b)),
    aten.where.ScalarSelf: lambda c, a, b: op("where", c, _scalar(a), b),
    aten.maximum.default: lambda a, b: op("maximum", a, b),
    aten.minimum.default: lambda a, b: op("minimum", a, b),
    aten._to_copy.default: _to,
    aten.to.dtype: lambda x, dtype, *_, **__: _to(x, dtype),
    aten.type_as.default: lambda x, other: _to(x, other.dtype),
    aten.clone.default: lambda a, **_: a,
    aten.alias.default: lambda a: a,
    aten.detach.default: lambda a: op("stop_grad", a),
    **{getattr(aten, n).Tensor: _cmp(n) for n in ir.COMPARISONS},
    **{getattr(aten, n).Scalar: _cmp(n) for n in ir.COMPARISONS},
}

#: reductions along the last dim: op → (builder, index of the dim argument or None)
REDUCTIONS: dict[object, tuple[Callable, int | None]] = {
    aten.sum.dim_IntList: (lambda x, dims, keepdim=False, dtype=None: op("sum_row", _to(x, dtype)), 1),
    aten.mean.dim: (lambda x, dims, keepdim=False, dtype=None: _mean(_to(x, dtype)), 1),
    aten.amax.default: (lambda x, dims=(), keepdim=False: op("amax_row", x), 1),
    aten._softmax.default: (lambda x, dim, half_to_float: _softmax(x), 1),
    aten._log_softmax.default: (lambda x, dim, half_to_float: _softmax(x, log=True), 1),
    aten.softmax.int: (lambda x, dim, dtype=None: _softmax(_to(x, dtype)), 1),
    aten.log_softmax.int: (lambda x, dim, dtype=None: _softmax(_to(x, dtype), log=True), 1),
    aten.layer_norm.default: (_layer_norm, None),
    aten.rms_norm.default: (None, None),   # needs the input dtype: see _lower_node
}
_KEEPDIM = {aten.sum.dim_IntList: 2, aten.mean.dim: 2, aten.amax.default: 2}
_SHAPE_OPS = {aten.unsqueeze.default}
_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _val(n) -> torch.Tensor | None:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _reduce_dim_ok(node: fx.Node) -> bool:
    x = _val(node.args[0])
    if x is None or x.dim() == 0:
        return False
    if node.target in (aten.layer_norm.default, aten.rms_norm.default):
        return len(node.args[1]) == 1
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", ())
    dims = [dims] if isinstance(dims, int) else list(dims)
    return len(dims) == 1 and dims[0] in (-1, x.dim() - 1)


def supported(node: fx.Node) -> bool:
    """Whether the code generator can take this ATen node into a region."""
    if node.op != "call_function":
        return False
    if node.target not in POINTWISE and node.target not in REDUCTIONS \
            and node.target not in _SHAPE_OPS:
        return False
    out = _val(node)
    if out is None or not (out.dtype in _FLOAT or out.dtype == torch.bool):
        return False
    for a in node.all_input_nodes:
        v = _val(a)
        if v is None or not (v.dtype in _FLOAT or v.dtype == torch.bool):
            return False
    if node.target is aten._to_copy.default and set(node.kwargs) - {"dtype", "memory_format"}:
        return False  # a device or layout change is no fused element-wise op
    if node.target in _SHAPE_OPS:
        return node.args[1] in (-1, out.dim() - 1)
    return node.target not in REDUCTIONS or _reduce_dim_ok(node)


def is_reduction(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in REDUCTIONS


# ------------------------------------------------------------------ shapes

def _static(size) -> int | None:
    return size if isinstance(size, int) else None


def same_size(a, b) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return str(a) == str(b)


def iteration_shape(shapes: list) -> list:
    """Right-aligned broadcast of `shapes` (sizes may be SymInts), at least rank 1."""
    rank = max([1, *[len(s) for s in shapes]])
    out = []
    for d in range(rank):
        sizes = [s[d - rank + len(s)] for s in shapes if d - rank + len(s) >= 0]
        big = [s for s in sizes if _static(s) != 1]
        out.append(big[0] if big else 1)
    return out


def recipe(shape, kind: str, it: list) -> tuple[int, ...]:
    """Per dim of an output of `shape`: the iteration dim it takes its size from, or -1
    for a size-1 dim."""
    k = len(it)
    if kind == ROW:
        return tuple(range(k - 1)) + ((-1,) if len(shape) == k else ())
    offset = k - len(shape)
    return tuple(-1 if _static(s) == 1 else offset + d for d, s in enumerate(shape))


def shape_from(recipe_: tuple[int, ...], it) -> list:
    return [1 if d < 0 else it[d] for d in recipe_]


# ------------------------------------------------------------------ lowering

@dataclass
class Lowered:
    """A region as a kernel program, with what the launcher and fake impl need."""

    program: Program
    rank: int                                 # of the iteration shape
    recipes: tuple[tuple[int, ...], ...]      # per output, see `recipe`
    out_dtypes: tuple[torch.dtype, ...]
    in_dtypes: tuple[torch.dtype, ...]
    ops: tuple[str, ...]                      # the region's ATen ops, in order


def _fail(node: fx.Node, why: str):
    raise UnsupportedRegion(f"fused region node {node.name} ({node.target}): {why}")


def _lower_node(node: fx.Node, env: dict, it: list) -> Value:
    def arg(a):
        if isinstance(a, fx.Node):
            return env[a]
        if isinstance(a, (list, tuple)):
            return type(a)(arg(x) for x in a)
        return a

    args, kwargs = arg(node.args), {k: arg(v) for k, v in node.kwargs.items()}
    k = len(it)
    for a in node.all_input_nodes:   # a last-dim result without keepdim cannot broadcast
        v = _val(a)
        if env[a].kind == ROW and v.dim() < k and _val(node).dim() >= k:
            _fail(node, f"operand {a.name} is a reduced value without keepdim, which does "
                        "not broadcast against the full tile; reduce with keepdim=True")
    if node.target in _SHAPE_OPS:
        if env[node.args[0]].kind != ROW:
            _fail(node, "unsqueeze is only fused on a last-dim reduction's result")
        return env[node.args[0]]
    if node.target in POINTWISE:
        return POINTWISE[node.target](*args, **kwargs)
    x = _val(node.args[0])
    if x.dim() != k or not same_size(x.shape[-1], it[-1]):
        _fail(node, f"reduces an input of shape {tuple(x.shape)}, not the last dim of the "
                    f"region's iteration shape {tuple(it)}")
    if node.target is aten.rms_norm.default:
        return _rms_norm(*args, **kwargs, dtype=x.dtype)
    return REDUCTIONS[node.target][0](*args, **kwargs)


def lower(gm: fx.GraphModule | fx.Graph) -> Lowered:
    """The kernel program of region `gm` (see the module docstring); its graph alone
    will do (passes/fusion.py asks before it builds a module)."""
    graph = gm if isinstance(gm, fx.Graph) else gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for n in placeholders:
        if _val(n) is None:
            raise UnsupportedRegion(f"fused region input {n.name} has no meta['val'] tensor")
    it = iteration_shape([list(_val(n).shape) for n in placeholders])
    env = {n: ir.load(i, FULL, _val(n).dtype) for i, n in enumerate(placeholders)}
    ops = []
    for node in graph.nodes:
        if node.op == "call_function":
            if not supported(node):
                _fail(node, "not an op the code generator takes (see ops.fused.supported)")
            ops.append(str(node.target))
            value = _lower_node(node, env, it)
            env[node] = value
        elif node.op == "output":
            outs = node.args[0]
            outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        elif node.op != "placeholder":
            _fail(node, f"a region holds only placeholders and ATen calls, not {node.op}")
    values, recipes = [], []
    for o in outs:
        v = env[o]
        if v.kind == ir.SCALAR:
            _fail(o, "an output that depends on no input")
        values.append(v)
        recipes.append(recipe(list(_val(o).shape), v.kind, it))
    dtypes = [_val(n).dtype for n in placeholders] + [_val(o).dtype for o in outs]
    compute = torch.float64 if torch.float64 in dtypes else torch.float32
    program = Program(inputs=[env[n] for n in placeholders], outputs=values, dtype=compute)
    return Lowered(program, len(it), tuple(recipes), tuple(_val(o).dtype for o in outs),
                   tuple(_val(n).dtype for n in placeholders), tuple(ops))


def structure(gm: fx.GraphModule | fx.Graph) -> str:
    """The region's structure as text: ops, wiring, constant arguments, dtypes, static
    sizes (symbolic sizes as `s`); the same on every process for the same region."""
    names: dict[fx.Node, str] = {}

    def text(a) -> str:
        if isinstance(a, fx.Node):
            return names[a]
        if isinstance(a, (list, tuple)):
            return "[" + ",".join(text(x) for x in a) + "]"
        if isinstance(a, float):
            return repr(a)
        return str(a)

    lines = []
    graph = gm if isinstance(gm, fx.Graph) else gm.graph
    for i, n in enumerate(graph.nodes):
        names[n] = f"%{i}"
        v = _val(n)
        meta = "" if v is None else f"{v.dtype}{[s if isinstance(s, int) else 's' for s in v.shape]}"
        if n.op == "call_function":
            kw = ",".join(f"{k}={text(v)}" for k, v in sorted(n.kwargs.items()))
            lines.append(f"%{i}={n.target}({text(n.args)};{kw}):{meta}")
        else:
            lines.append(f"%{i}={n.op}({text(n.args) if n.op == 'output' else ''}):{meta}")
    return "\n".join(lines)
