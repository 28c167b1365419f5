"""Capture: a hand-written loop over MoE experts, folded into `autohybrid::moe_experts`.

Owns recognizing, in the captured ATen graph, a mixture-of-experts layer written as a
loop over separate expert modules — transformers 4.4x's Mixtral / Qwen2-MoE sparse
blocks, and the nanoGPT-MoE and DeepSeek reference loops written like them:

    mask = one_hot(top_k_index, E).permute(2, 1, 0)       # or: top_k_index == e
    for e in range(E):
        slot, rows = torch.where(mask[e])                 # rows, slot = torch.where(idx == e)
        y = experts[e](x[rows])                           # w2(act(w1 x) * w3 x), no biases
        out.index_add_(0, rows, y * top_k_weights[rows, slot, None])

— and replacing it with the one op expert parallelism rewrites (ops/moe.py):

    moe_experts(x, top_k_index, top_k_weights,
                stack([cat([w1_e, w3_e]) for e]), stack([w2_e for e]), E, act, "")

the same function (every routed token reaches its expert, weighted by its route's
weight and summed), computed without the loop's data-dependent sizes: the planner
prices it by the routes' expected load instead of every expert over every token, a
pipeline may cut around it, and the ep pass can split it. The experts stay separate
parameters of the model: the stacks are computed in the graph at every step (autograd
takes their gradients back to each parameter), so every rank holds every expert's
weights; under expert parallelism a rank computes only its experts' slice of the stacks
(passes/expert_parallel.py).

Folded only when every piece matches exactly (the loop covers each of the E experts
once, every expert reads its own three parameters of the same shapes, no value of the
loop is read outside it, one dtype throughout: not under autocast); anything else is
captured as written and runs as eager runs it (its data-dependent sizes priced at their
bound).
`AUTOHYBRID_DEBUG_MOE_LOOP=1` prints why a candidate loop was not folded.
"""
from __future__ import annotations

import operator
import os
import sys
from dataclasses import dataclass

import torch
import torch.fx as fx

from .graph import VAL, fake_mode, is_param, new_node, op_name
from .ops.moe import moe_experts  # noqa: F401  (registers autohybrid::moe_experts)

PASS = "capture_moe_loop"
aten = torch.ops.aten
MOE_EXPERTS = torch.ops.autohybrid.moe_experts.default
_ACTS = {"aten.silu.default": "silu", "aten.relu.default": "relu", "aten.gelu.default": None}
_CASTS = ("aten.to.dtype", "aten._to_copy.default", "aten.to.dtype_layout")
_ZEROS = ("aten.zeros.default", "aten.zeros_like.default", "aten.new_zeros.default")
#: nodes that only check a value (a where's row count ≥ 0, a cast's metadata)
_GUARDS = ("aten.sym_size.int", "aten._assert_scalar.default",
           "aten._assert_tensor_metadata.default", "aten.sym_constrain_range_for_size.default")


class _NoMatch(Exception):
    """Why a candidate loop is not folded (debug output only)."""


@dataclass
class _Expert:
    index: int          # the expert this iteration computes
    w1: fx.Node         # (I, H) gate projection
    w3: fx.Node         # (I, H) up projection
    w2: fx.Node         # (H, I) down projection
    nodes: set          # the iteration's own nodes (erased once folded)


@dataclass
class _Loop:
    x: fx.Node          # (T, H) tokens
    index: fx.Node      # (T, k) each token's experts
    weights: fx.Node    # (T, k) their weights
    experts: int
    act: str
    last: fx.Node       # the last index_add: its users read the folded output
    iterations: list    # _Expert, in loop order
    extra: set          # the accumulator and the mask's nodes (erased when unused)


def fold_expert_loops(gm: fx.GraphModule) -> list[str]:
    """Fold every hand-written expert loop of `gm` into one `autohybrid::moe_experts`
    node; returns a line per folded loop (where, how many experts)."""
    folded = []
    for start in [n for n in gm.graph.nodes if op_name(n) in _ZEROS]:
        try:
            loop = _match(start)
        except _NoMatch as why:
            if os.environ.get("AUTOHYBRID_DEBUG_MOE_LOOP"):
                print(f"[autohybrid] expert loop from {start.name!r} not folded: {why}",
                      file=sys.stderr)
            continue
        if loop is not None:
            _replace(gm, loop)
            folded.append(f"{loop.last.name}: {loop.experts} experts ({loop.act})")
    if folded:
        gm.graph.lint()
        gm.recompile()
    return folded


def stacked_experts(node: fx.Node) -> bool:
    """Whether MoE node `node`'s expert weights are stacks of separate parameters (this
    fold's `stack` of `cat`s, as every rank's graph has it, also one loaded from another
    rank's capture, which keeps no pass marks): every rank holds every expert's
    parameters, expert parallelism computes its slice of the stacks, tensor parallelism
    cannot cut them."""
    def stacked(w, parts) -> bool:
        return isinstance(w, fx.Node) and op_name(w) == "aten.stack.default" \
            and all(parts(p) for p in w.args[0])

    gate_up, down = node.args[3:5]
    return stacked(gate_up, lambda p: op_name(p) == "aten.cat.default"
                   and all(is_param(q) for q in p.args[0])) and stacked(down, is_param)


def drop_unused_symbols(ep) -> None:
    """Forget the range constraints of the data-dependent sizes a fold removed from the
    graph of exported program `ep` (the serializer warns of each, capture_wire.py)."""
    from torch.fx.experimental.symbolic_shapes import free_symbols
    from torch.utils._sympy.symbol import SymT, symbol_is_type
    used = set()
    for node in ep.graph_module.graph.nodes:
        value = node.meta.get(VAL)
        if isinstance(value, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)):
            used |= free_symbols(value)
    for symbol in [s for s in ep.range_constraints if s not in used
                   and symbol_is_type(s, (SymT.UNBACKED_INT, SymT.UNBACKED_FLOAT))]:
        del ep.range_constraints[symbol]


# ------------------------------------------------------------------------- matching

def _match(start: fx.Node) -> _Loop | None:
    chain, node = [], start
    while len(node.users) == 1:
        user = next(iter(node.users))
        if op_name(user) not in ("aten.index_add_.default", "aten.index_add.default") \
                or user.args[0] is not node:
            break
        chain.append(user)
        node = user
    if len(chain) < 2:
        return None   # not a loop over experts (or a single index_add: nothing to fold)
    loop = None
    for link in chain:
        loop = _iteration(link, loop)
    iterations = loop.iterations
    if sorted(it.index for it in iterations) != list(range(loop.experts)):
        raise _NoMatch(f"the loop computes experts {sorted(it.index for it in iterations)} "
                       f"of {loop.experts}")
    x = loop.x.meta[VAL]
    zeros = start.meta.get(VAL)
    if not isinstance(zeros, torch.Tensor) or zeros.dim() != 2 or zeros.dtype != x.dtype \
            or any(a != b for a, b in zip(zeros.shape, x.shape)):
        raise _NoMatch("the accumulator is not zeros shaped like the tokens")
    shapes = {(tuple(it.w1.meta[VAL].shape), tuple(it.w3.meta[VAL].shape),
               tuple(it.w2.meta[VAL].shape)) for it in iterations}
    if len(shapes) != 1:
        raise _NoMatch(f"the experts' weights differ in shape: {sorted(shapes)}")
    (s1, s3, s2), = shapes
    hidden = x.shape[-1]
    if not (len(s1) == 2 and s1 == s3 and s2 == (s1[1], s1[0]) and s1[1] == hidden):
        raise _NoMatch(f"weights {s1}, {s3}, {s2} are not a gated MLP over {hidden} features")
    dtypes = {n.meta[VAL].dtype for it in iterations for n in (it.w1, it.w3, it.w2)}
    if dtypes | {loop.weights.meta[VAL].dtype} != {x.dtype}:
        raise _NoMatch("the tokens, routing weights and expert weights differ in dtype")
    floats = {n.meta[VAL].dtype for it in iterations for n in it.nodes
              if isinstance(n.meta.get(VAL), torch.Tensor) and n.meta[VAL].is_floating_point()}
    if floats != {x.dtype}:   # autocast computed the experts in another dtype than eager's
        raise _NoMatch(f"the loop computes in {sorted(map(str, floats))}, its tokens are "
                       f"{x.dtype}")
    loop.extra.add(start)
    inside = set().union(*(it.nodes for it in iterations)) | set(chain) | loop.extra
    for node in inside - {loop.last} - loop.extra:
        outside = [u for u in node.users if u not in inside]
        if outside:
            raise _NoMatch(f"{node.name!r} of the loop is also read by {outside[0].name!r}")
    return loop


def _iteration(link: fx.Node, loop: _Loop | None) -> _Loop:
    """Parse one `acc.index_add_(0, rows, contribution)` of the loop into `loop`."""
    if len(link.args) != 4 or link.args[1] != 0 or link.kwargs.get("alpha", 1) != 1:
        raise _NoMatch(f"{link.name!r} does not add rows along dim 0")
    rows, contribution = link.args[2], link.args[3]
    nodes = {link}
    where, rows_at = _getitem(rows)
    if op_name(where) != "aten.where.default" or len(where.args) != 1:
        raise _NoMatch(f"{link.name!r}: its rows are not torch.where over a mask")
    index, expert, experts, rows_item = _mask(where.args[0])
    if rows_at != rows_item:
        raise _NoMatch(f"{link.name!r}: its rows are the mask's other coordinate")
    slot = next((u for u in where.users if u.target is operator.getitem
                 and u.args[1] == 1 - rows_at), None)
    nodes |= {where, rows} | _guards(rows) | ({slot} | _guards(slot) if slot else set())
    factors = _strip_casts(contribution, nodes)
    if op_name(factors) != "aten.mul.Tensor":
        raise _NoMatch(f"{link.name!r}: its rows are not an output times a routing weight")
    nodes.add(factors)
    for y, z in (factors.args, factors.args[::-1]):
        if isinstance(y, fx.Node) and isinstance(z, fx.Node):
            weights = _route_weight(z, rows, slot, nodes)
            if weights is not None:
                break
    else:
        raise _NoMatch(f"{link.name!r}: no factor is weights[rows, slot]")
    x, w1, w3, w2, act = _gated_mlp(_strip_casts(y, nodes), rows, nodes)
    if loop is None:
        loop = _Loop(x, index, weights, experts, act, link, [], set())
    elif (x, index, weights, experts, act) != (loop.x, loop.index, loop.weights,
                                                loop.experts, loop.act):
        raise _NoMatch(f"{link.name!r}: another expert's tokens, routes or activation")
    loop.last = link
    loop.extra |= _mask_nodes(where.args[0])
    loop.iterations.append(_Expert(expert, w1, w3, w2, nodes))
    return loop


def _getitem(node) -> tuple[fx.Node, int]:
    if not (isinstance(node, fx.Node) and node.target is operator.getitem):
        raise _NoMatch(f"{getattr(node, 'name', node)!r} is not an item of a tuple")
    return node.args[0], node.args[1]


def _mask(mask: fx.Node) -> tuple[fx.Node, int, int, int]:
    """(top_k_index, expert, experts, which item of torch.where is the token row) of the
    loop's mask: one_hot(index, E).permute(2, 1, 0)[e] (where gives slot, row) or
    index == e (where gives row, slot)."""
    name = op_name(mask)
    if name == "aten.select.int" and mask.args[1] == 0:
        permute = mask.args[0]
        if op_name(permute) == "aten.permute.default" and list(permute.args[1]) == [2, 1, 0]:
            one_hot = permute.args[0]
            if op_name(one_hot) == "aten.one_hot.default" and len(one_hot.args) == 2:
                index, experts = one_hot.args
                return _index(index), int(mask.args[2]), int(experts), 1
    if name in ("aten.eq.Scalar", "aten.eq.Tensor") and isinstance(mask.args[1], int):
        index = _index(mask.args[0])
        source = index.args[0]
        if op_name(source) == "aten.topk.default":   # its scores' last dim: the experts
            experts = int(source.args[0].meta[VAL].shape[-1])
            if _topk_last_dim(source):
                return index, int(mask.args[1]), experts, 0
    raise _NoMatch(f"mask {mask.name!r} is not a one-hot of the routes (or routes == e)")


def _index(index) -> fx.Node:
    """The (T, k) experts of each token: topk's indices."""
    source, item = _getitem(index)
    if op_name(source) != "aten.topk.default" or item != 1 or not _topk_last_dim(source):
        raise _NoMatch(f"{index.name!r} is not top-k indices over the experts")
    if index.meta[VAL].dim() != 2:
        raise _NoMatch(f"{index.name!r}: routes of shape {tuple(index.meta[VAL].shape)}")
    return index


def _topk_last_dim(topk: fx.Node) -> bool:
    dim = topk.args[2] if len(topk.args) > 2 else topk.kwargs.get("dim", -1)
    return dim in (-1, topk.args[0].meta[VAL].dim() - 1)


def _mask_nodes(mask: fx.Node) -> set:
    return {mask, *(a for a in mask.all_input_nodes
                    if op_name(a) in ("aten.permute.default", "aten.one_hot.default")),
            *(b for a in mask.all_input_nodes for b in a.all_input_nodes
              if op_name(b) == "aten.one_hot.default")}


def _guards(node: fx.Node) -> set:
    """The checks that read `node` (and their own checks)."""
    out, todo = set(), [u for u in node.users if op_name(u) in _GUARDS]
    while todo:
        guard = todo.pop()
        out.add(guard)
        todo += [u for u in guard.users if u not in out and (
            op_name(u) in _GUARDS or (u.target.__module__ == "_operator"
                                      if callable(u.target) else False))]
    return out


def _strip_casts(node: fx.Node, nodes: set) -> fx.Node:
    """`node` without same-dtype casts (recorded in `nodes` with their checks)."""
    while op_name(node) in _CASTS and node.args[0].meta[VAL].dtype == node.meta[VAL].dtype:
        nodes |= {node} | _guards(node)
        node = node.args[0]
    nodes |= _guards(node)
    return node


def _route_weight(z: fx.Node, rows: fx.Node, slot: fx.Node | None,
                  nodes: set) -> fx.Node | None:
    """The (T, k) routing weights if `z` is weights[rows, slot, None] (weights.unsqueeze(-1)
    indexed, or the index unsqueezed)."""
    found: set = set()
    z = _strip_casts(z, found)
    if slot is None:
        return None
    found.add(z)
    if op_name(z) == "aten.unsqueeze.default" and z.args[1] in (-1, 1):
        inner = z.args[0]
        if op_name(inner) == "aten.index.Tensor" and list(inner.args[1]) == [rows, slot]:
            weights = inner.args[0]
            if weights.meta[VAL].dim() == 2:
                nodes |= found | {inner}
                return weights
    if op_name(z) == "aten.index.Tensor" and list(z.args[1]) == [rows, slot]:
        source = z.args[0]
        if op_name(source) == "aten.unsqueeze.default" and source.args[1] in (-1, 2) \
                and source.args[0].meta[VAL].dim() == 2:
            nodes |= found | {source}
            return source.args[0]
    return None


def _gated_mlp(y: fx.Node, rows: fx.Node, nodes: set):
    """(x, w1, w3, w2, act) of y = linear(act(linear(x[rows], w1)) * linear(x[rows], w3), w2)."""
    down = _linear(y)
    product = down.args[0]
    if op_name(product) != "aten.mul.Tensor":
        raise _NoMatch(f"{y.name!r}: the expert is not w2(act(w1 x) * w3 x)")
    for gated, up in (product.args, product.args[::-1]):
        if isinstance(gated, fx.Node) and isinstance(up, fx.Node) \
                and _activation(gated) is not None and op_name(up) == "aten.linear.default":
            break
    else:
        raise _NoMatch(f"{y.name!r}: the expert is not w2(act(w1 x) * w3 x)")
    act = _activation(gated)
    gate, up = _linear(gated.args[0]), _linear(up)
    if gate.args[0] is not up.args[0]:
        raise _NoMatch(f"{y.name!r}: the gate and up projections read different rows")
    x, picked = _picked_rows(gate.args[0], rows)
    nodes |= {y, down, product, gated, gate, up} | picked
    return x, gate.args[1], up.args[1], down.args[1], act


def _linear(node: fx.Node) -> fx.Node:
    if op_name(node) != "aten.linear.default" or len(node.args) > 2 and node.args[2] is not None:
        raise _NoMatch(f"{node.name!r} is not a linear without bias")
    weight = node.args[1]
    if not is_param(weight):
        raise _NoMatch(f"{node.name!r}: its weight is not a parameter")
    return node


def _activation(node: fx.Node) -> str | None:
    name = op_name(node)
    if name not in _ACTS:
        return None
    if name == "aten.gelu.default":
        approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1
                                      else "none")
        return "gelu" if approximate == "none" else "gelu_tanh"
    return _ACTS[name]


def _picked_rows(node: fx.Node, rows: fx.Node) -> tuple[fx.Node, set]:
    """(x, nodes) where `node` is x[rows] (x (T, H)), maybe as x[None, rows].reshape(-1, H)."""
    nodes = set()
    if op_name(node) in ("aten.reshape.default", "aten.view.default"):
        nodes.add(node)
        node = node.args[0]
    if op_name(node) != "aten.index.Tensor":
        raise _NoMatch(f"{node.name!r}: the expert's rows are not x[rows]")
    nodes.add(node)
    source, where = node.args[0], list(node.args[1])
    if where == [rows]:
        x = source
    elif where == [None, rows] and op_name(source) == "aten.unsqueeze.default" \
            and source.args[1] == 0:
        nodes.add(source)
        x = source.args[0]
    else:
        raise _NoMatch(f"{node.name!r}: the expert's rows are not x[rows]")
    if x.meta[VAL].dim() != 2:
        raise _NoMatch(f"{node.name!r}: tokens of shape {tuple(x.meta[VAL].shape)}")
    return x, nodes


# ------------------------------------------------------------------------- rewriting

def _replace(gm: fx.GraphModule, loop: _Loop) -> None:
    graph, mode = gm.graph, fake_mode(gm)
    ordered = sorted(loop.iterations, key=lambda it: it.index)

    def make(op, *args):
        return new_node(graph, op, args, None, pass_name=PASS, mode=mode, like=loop.last)

    with graph.inserting_before(loop.last):
        gate_up = make(aten.stack.default,
                       [make(aten.cat.default, [it.w1, it.w3], 0) for it in ordered], 0)
        down = make(aten.stack.default, [it.w2 for it in ordered], 0)
        out = make(MOE_EXPERTS, loop.x, loop.index, loop.weights, gate_up, down,
                   loop.experts, loop.act, "", 1, "")
    loop.last.replace_all_uses_with(out)
    doomed = set().union(*(it.nodes for it in loop.iterations)) | loop.extra
    # and the size arithmetic only they read (the accumulator's shape)
    doomed |= {a for n in doomed for a in n.all_input_nodes
               if a.op == "call_function" and getattr(a.target, "__module__", "") == "_operator"}
    for node in reversed(list(graph.nodes)):
        if node in doomed and not node.users:
            graph.erase_node(node)
