"""Compute cost of a captured graph: FLOPs, bytes moved and saved activations per op.

Rules are keyed by ATen op name (the one graph format). Sizes are sympy expressions of
the graph's symbolic batch and sequence sizes; search/space.py sums them per layer once
and turns the sums into fast functions, so a search evaluates a 175B-parameter graph at
any microbatch in microseconds.
This module reads graphs and device figures; it does not know about plans or meshes.
"""
from __future__ import annotations

import math
import operator
from typing import Any

import sympy
import torch
import torch.fx as fx

from ..graph import AH_ROLE, VAL, VIEW_OPS, op_name

#: Documented efficiency constants of the roofline (fractions of peak). Calibration
#: replaces them for a measured machine. Sources: hardware_and_formulas.md "practical
#: ceilings" (large bf16 GEMMs reach 75–80 % of peak; memory-bound kernels ~80 % of HBM).
MATMUL_EFFICIENCY = 0.80
MEMORY_EFFICIENCY = 0.80

MATMUL_OPS = frozenset({
    "aten.linear.default", "aten.mm.default", "aten.bmm.default", "aten.matmul.default",
    "aten.addmm.default", "aten.baddbmm.default", "aten.conv1d.default", "aten.conv2d.default",
    "aten.conv3d.default", "aten.convolution.default", "aten.scaled_dot_product_attention.default",
    "aten.einsum.default", "autohybrid.moe_experts.default",
})
#: a MoE layer's experts (ops/moe.py): every route is two matmuls of one expert's weights
MOE_EXPERTS = "autohybrid.moe_experts.default"
# ops whose backward needs their tensor inputs (the rest: outputs or nothing)
_SAVES_NOTHING = frozenset({"aten.add.Tensor", "aten.sub.Tensor", "aten.neg.default",
                            "aten.add_.Tensor", "aten.cat.default", "aten.clone.default",
                            "aten.arange.default", "aten.arange.start", "aten.zeros.default",
                            "aten.ones.default", "aten.full.default", "aten.copy_.default",
                            "aten._to_copy.default", "aten.to.dtype", "aten.ones_like.default",
                            "aten.zeros_like.default", "aten.new_zeros.default",
                            "aten.mean.dim", "aten.mean.default", "aten.sum.default",
                            "aten.sum.dim_IntList", "aten.type_as.default",
                            "aten.scalar_tensor.default", "aten.ne.Scalar", "aten.eq.Scalar",
                            # spatial tiles' moves: their backward needs only sizes
                            "autohybrid.halo_fetch.default", "autohybrid.spatial_split.default",
                            "autohybrid.spatial_gather.default", "autohybrid.tp_copy.default"})
_SAVES_OUTPUT = frozenset({"aten.softmax.int", "aten._softmax.default", "aten.log_softmax.int",
                           "aten.tanh.default", "aten.sigmoid.default", "aten.exp.default",
                           "aten.relu.default", "aten.relu_.default", "aten.rsqrt.default"})


def _floor_div(a: Any, b: Any) -> Any:
    """a // b; 0 where b is 0 (a size of a batch too small for the model: `b // (b // 2)`
    of a batch paired up by a reshape, at one sample — the plan trial refuses it, and
    pricing it must not raise)."""
    return a // b if b else 0


def _mod(a: Any, b: Any) -> Any:
    return a % b if b else 0


#: torch's sympy functions (torch.utils._sympy.functions) as Python, for size functions:
#: a size a model computes with `//`, `%`, max/min, casts (XLNet's relative positions)
#: holds them, and sympy's printers do not know them
_TORCH_SYMPY = {
    "FloorDiv": _floor_div, "CleanDiv": _floor_div, "CeilDiv": lambda a, b: -(-a // b),
    "Mod": _mod, "PythonMod": _mod,
    "ModularIndexing": lambda x, d, m: _mod(_floor_div(x, d), m),
    "IntTrueDiv": operator.truediv, "FloatTrueDiv": operator.truediv,
    "ToFloat": float, "TruncToFloat": lambda x: float(math.trunc(x)), "TruncToInt": math.trunc,
    "FloorToInt": math.floor, "CeilToInt": math.ceil, "RoundToInt": round,
    "RoundDecimal": round, "Max": max, "Min": min, "Identity": lambda x: x,
    "PowByNatural": pow, "FloatPow": pow, "Where": lambda c, a, b: a if c else b,
    "LShift": operator.lshift, "RShift": operator.rshift,
    "BitwiseFn_bitwise_and": operator.and_, "BitwiseFn_bitwise_or": operator.or_,
    "BitwiseFn_bitwise_xor": operator.xor,
    **{f"OpaqueUnaryFn_{f}": getattr(math, f) for f in (
        "acos", "asin", "asinh", "atan", "cos", "cosh", "exp", "log", "log2", "sin", "sinh",
        "sqrt", "tan", "tanh")},
}


def size_function(args: Any, exprs: Any) -> Any:
    """`sympy.lambdify(args, exprs)` for expressions of graph sizes: a fast Python
    function of the size symbols, torch's own sympy functions included."""
    return sympy.lambdify(args, exprs, modules=[_TORCH_SYMPY, "math"])


def sym_expr(x: Any) -> sympy.Expr:
    if isinstance(x, torch.SymInt):
        return x.node.expr
    return sympy.Integer(int(x))


def numel_expr(t: torch.Tensor) -> sympy.Expr:
    return sympy.Mul(*[sym_expr(s) for s in t.shape]) if t.dim() else sympy.Integer(1)


def nbytes_expr(t: torch.Tensor) -> sympy.Expr:
    return numel_expr(t) * t.element_size()


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    return []


def forward_flops(node: fx.Node) -> sympy.Expr:
    """FLOPs of one forward op (multiply-add = 2), a sympy expression of the symbols."""
    name = op_name(node)
    out = node.meta.get(VAL)
    outs = _tensors(out)
    if not outs or name in VIEW_OPS:
        return sympy.Integer(0)
    args = [a.meta.get(VAL) if isinstance(a, fx.Node) else a for a in node.args]
    if name in ("aten.linear.default", "aten.addmm.default"):
        weight = args[1] if name == "aten.linear.default" else args[2]
        k = weight.shape[-1] if name == "aten.linear.default" else weight.shape[0]
        return 2 * numel_expr(outs[0]) * sym_expr(k)
    if name in ("aten.mm.default", "aten.bmm.default", "aten.matmul.default",
                "aten.baddbmm.default"):
        a = args[1] if name == "aten.baddbmm.default" else args[0]
        return 2 * numel_expr(outs[0]) * sym_expr(a.shape[-1])
    if name in ("aten.conv1d.default", "aten.conv2d.default", "aten.conv3d.default",
                "aten.convolution.default"):
        weight = args[1]
        per_output = sympy.Mul(*[sym_expr(s) for s in weight.shape[1:]])
        return 2 * numel_expr(outs[0]) * per_output
    if name == "aten.scaled_dot_product_attention.default":
        q, k = args[0], args[1]
        return 4 * numel_expr(q) * sym_expr(k.shape[-2])
    if name in ("aten.embedding.default",):
        return sympy.Integer(0)
    if name == MOE_EXPERTS:
        routes, gate_up, down = numel_expr(args[1]), args[3], args[4]
        return 2 * routes * (sym_expr(gate_up.shape[1]) * sym_expr(gate_up.shape[2])
                             + sym_expr(down.shape[1]) * sym_expr(down.shape[2]))
    return sum((numel_expr(t) for t in outs), sympy.Integer(0))


def bytes_moved(node: fx.Node) -> sympy.Expr:
    """Bytes read and written by one forward op (inputs + outputs), 0 for views."""
    name = op_name(node)
    if name in VIEW_OPS or node.op != "call_function":
        return sympy.Integer(0)
    ins = [t for a in node.args for t in _tensors(a.meta.get(VAL) if isinstance(a, fx.Node) else None)]
    outs = _tensors(node.meta.get(VAL))
    if name == "aten.embedding.default":  # reads only the gathered rows
        ins = ins[1:]
    return sum((nbytes_expr(t) for t in ins + outs), sympy.Integer(0))


def extra_saved_bytes(node: fx.Node) -> sympy.Expr:
    """Bytes an op keeps for backward beyond the graph values `saved_nodes` names: a MoE
    layer's experts keep, per route, its row as its expert received it, the gate/up
    projection and the expert's output (ops/moe.py)."""
    if op_name(node) != MOE_EXPERTS:
        return sympy.Integer(0)
    x, index, gate_up = (node.args[i].meta[VAL] for i in (0, 1, 3))
    per_route = 2 * sym_expr(x.shape[-1]) + sym_expr(gate_up.shape[1])
    return numel_expr(index) * per_route * x.element_size()


def grad_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes whose values require grad: parameters and everything computed from them."""
    out: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if node.meta.get(AH_ROLE) == "param":
                out.add(node)
        elif node.op == "call_function" and any(a in out for a in node.all_input_nodes):
            val = node.meta.get(VAL)
            if any(t.is_floating_point() for t in _tensors(val)):
                out.add(node)
    return out


def saved_nodes(node: fx.Node, needs_grad: set[fx.Node] | None = None) -> list[fx.Node]:
    """Nodes whose values autograd keeps for this op's backward.

    With `needs_grad` (from `grad_nodes`), an op that no gradient flows through saves
    nothing, and a product saves each factor only for the gradient of the other one.
    """
    name = op_name(node)
    if node.op != "call_function" or name in VIEW_OPS or name in _SAVES_NOTHING:
        return []
    if node.target is operator.getitem:
        return []
    if needs_grad is not None and node not in needs_grad:
        return []
    if name in _SAVES_OUTPUT:
        return [node]
    tensors = [a for a in node.args if isinstance(a, fx.Node)
               and isinstance(a.meta.get(VAL), torch.Tensor)]
    if needs_grad is not None and name in ("aten.mul.Tensor", "aten.div.Tensor") \
            and len(tensors) == 2:
        a, b = tensors
        saved = [b] if a in needs_grad else []
        if b in needs_grad:
            saved.append(a)
            if name == "aten.div.Tensor":
                saved.append(b)
        return saved
    if name == "aten.scaled_dot_product_attention.default":
        tensors.append(node)
    if name == MOE_EXPERTS:   # the tokens (the rest: extra_saved_bytes) and routes
        return tensors[:3]
    return tensors
