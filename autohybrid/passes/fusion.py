"""Pass: fusion — join chains of element-wise ops and row reductions into one kernel each.

Why: an element-wise op or a reduction does a few FLOPs per byte it reads and writes, so
its time is its memory traffic. A chain of them (a residual add and the layer norm after
it; RMS norm's pow, mean, rsqrt and products; SiLU times the up projection) writes every
intermediate to memory only for the next op to read it back. One kernel for the chain
reads the chain's inputs once and writes only the values used after it.

What (decide, then rewrite; `find_regions` decides, from the graph alone):
* fusible nodes: ATen ops the code generator takes (`ops.fused.supported`): element-wise
  ops with broadcasting and reductions along the last dim (sum, mean, max, softmax,
  log-softmax, layer norm, RMS norm) — never a matmul, linear, attention, embedding or
  convolution, a collective or any other autohybrid op, an op that draws random numbers
  (eager's RNG order is kept), a mutation, a view, a getitem, size arithmetic, a
  placeholder, the output or a checkpointed region's call;
* regions grow in graph order: a fusible node joins the regions of the fusible nodes it
  reads (all of them merged, else the first one that accepts it, in argument order), or
  starts its own. A region must stay convex (no path leaves it and comes back, so one
  node can stand for it), placeable (every value it reads is computed before any value
  it gives is used, so no other node moves) and within what one kernel computes: every
  member's value has the region's full shape, except the reductions along its last dim
  and the element-wise ops on their results (one row per program);
* a region is kept when the cost model says it moves fewer bytes: its inputs plus its
  outputs (values used after it) against the sum of what each member reads and writes
  alone (`cost.compute.bytes_moved`, symbolic sizes at their example values). One op alone
  saves nothing, so it stays as it is.

How: each kept region becomes a standalone GraphModule (placeholders: the tensors it
reads, with their fake values; its nodes with their meta; output: a tuple of the values
used after it), `ops.fused.register_region` builds its kernels and gives a key, and the
region's nodes are replaced by one `autohybrid.fused_region(inputs, key)` node (autograd
aware: it has a backward) and a getitem per output.

Where: last, after overlap, on the rank's graph, on every pipeline stage's graph
(`ctx.notes["pipeline"]`) and inside every checkpointed submodule (passes/recompute.py),
so that recomputation runs the fused kernels again; train and forward graphs. Regions
never span a checkpointed call, a collective's issue or wait, or a stage boundary, so
overlap's order stays. `ctx.notes["fusion"]`: one `FusedRegion` per region, in order.

Example::

    regions = find_regions(gm)                # [[add_1, layer_norm_1], ...]
    summaries = fuse(gm)                      # the rewrite; one FusedRegion each
    [s.ops for s in summaries][0]             # ('aten.add.Tensor', 'aten.layer_norm.default')
"""
from __future__ import annotations

import functools
import logging
import operator
from typing import Callable

import sympy
import torch
import torch.fx as fx

from ..cost.compute import bytes_moved, nbytes_expr
from ..graph import AH_PASS, MODULE_STACK, STACK_TRACE, VAL, NodeOrder, op_name
from ..program import FusedRegion
from .manager import PassContext
from .overlap import _env, _number, is_pure
from .recompute import checkpoint_region

PASS = "fusion"
log = logging.getLogger("autohybrid.passes")

#: ops that are never fused, whatever the code generator says (their own kernels are
#: better, or they are where a region must end)
BARRIER_OPS = frozenset({
    "aten.linear.default", "aten.mm.default", "aten.bmm.default", "aten.matmul.default",
    "aten.addmm.default", "aten.baddbmm.default", "aten.einsum.default",
    "aten.outer.default", "aten.dot.default", "aten.mv.default",
    "aten.scaled_dot_product_attention.default", "aten.embedding.default",
    "aten.conv1d.default", "aten.conv2d.default", "aten.conv3d.default",
    "aten.convolution.default", "aten.sym_size.int", "aten.sym_numel.default",
})

Predicate = Callable[[fx.Node], bool]


def fusion(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    graphs = [("rank", gm)]
    split = ctx.notes.get("pipeline")
    if split is not None:
        graphs += [(f"stage{stage.index}", stage.gm) for stage in split.stages]
    summaries: list[FusedRegion] = []
    done: set[int] = set()
    for where, g in graphs:
        summaries += _fuse_with_submodules(g, where, done)
    ctx.notes["fusion"] = summaries
    return gm


def _fuse_with_submodules(gm: fx.GraphModule, where: str, done: set[int]) -> list[FusedRegion]:
    """Fuse `gm` and the checkpointed submodules it calls (each once: `done` by id)."""
    out: list[FusedRegion] = []
    if id(gm) in done:
        return out
    done.add(id(gm))
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is checkpoint_region:
            name = node.args[0].target
            sub = getattr(gm, name)
            if id(sub) not in done:
                done.add(id(sub))
                regions = fuse(sub, f"{where}/{name}", recompile=False)
                if regions:
                    sub.recompile()
                out += regions
    # `gm` itself (the rank's graph or a stage's) is recompiled once, with every stage
    # graph, by the pass manager at the end
    return out + fuse(gm, where, recompile=False)


# ------------------------------------------------------------------ what may be fused

def _codegen():
    from ..ops import fused   # the code generator's op (imported when the pass runs)
    return fused


def is_fusible(node: fx.Node, supported: Predicate | None = None) -> bool:
    """Whether `node` may be a member of a region: a pure ATen op with one tensor value,
    tensor inputs only, that the code generator takes (`supported`, default
    `ops.fused.supported`) and that is no barrier (see the module docstring)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    target = node.target
    if target.namespace not in ("aten", "prim") or op_name(node) in BARRIER_OPS:
        return False
    if target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags:
        return False
    if not isinstance(node.meta.get(VAL), torch.Tensor):
        return False
    if not all(isinstance(a.meta.get(VAL), torch.Tensor) for a in node.all_input_nodes):
        return False      # reads a symbolic size (or a tuple): not a tensor input
    return (supported or _codegen().supported)(node)


# ------------------------------------------------------------------ deciding regions

def find_regions(gm: fx.GraphModule, supported: Predicate | None = None,
                 is_reduction: Predicate | None = None,
                 fits: Callable[[list[fx.Node]], bool] | None = None,
                 profitable: Callable[[list[fx.Node]], bool] | None = None
                 ) -> list[list[fx.Node]]:
    """The regions to fuse in `gm`, each a list of nodes in graph order, in the order of
    their first node; a function of the graph only (see the module docstring).
    `supported` / `is_reduction` default to the code generator's, `fits` (one kernel
    computes these members) to `lowers`, `profitable` to `saves_bytes`."""
    if supported is None or is_reduction is None:
        fused = _codegen()
        supported = supported or fused.supported
        is_reduction = is_reduction or fused.is_reduction
    fits = fits or lowers
    if profitable is None:
        env = _env(gm)
        profitable = lambda members: saves_bytes(members, env)  # noqa: E731
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    regions: list[list[fx.Node] | None] = []
    region_of: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        if not is_fusible(node, supported):
            continue
        candidates: list[int] = []
        for a in node.all_input_nodes:
            r = region_of.get(a)
            if r is not None and r not in candidates:
                candidates.append(r)
        options = [candidates] + ([[c] for c in candidates] if len(candidates) > 1 else [])
        chosen, members = None, [node]
        for option in options:
            if not option:
                break
            merged = sorted([m for r in option for m in regions[r]] + [node],
                            key=position.__getitem__)
            if _valid(merged, position, is_reduction) and fits(merged):
                chosen, members = option, merged
                break
        if chosen:
            for r in chosen[1:]:
                regions[r] = None
            index = chosen[0]
            regions[index] = members
        else:
            index = len(regions)
            regions.append(members)
        for m in members:
            region_of[m] = index
    kept = [r for r in regions if r is not None and len(r) > 1 and profitable(r)]
    return sorted(kept, key=lambda r: position[r[0]])


def _valid(members: list[fx.Node], position: dict[fx.Node, int],
           is_reduction: Predicate) -> bool:
    return (_fits_one_kernel(members, is_reduction) and _span_is_pure(members)
            and _placeable(members, position) and _convex(members, position))


def _convex(members: list[fx.Node], position: dict[fx.Node, int]) -> bool:
    """No path from a member through a non-member back to a member."""
    inside = set(members)
    first = position[members[0]]
    seen: set[fx.Node] = set()
    stack = [a for m in members for a in m.all_input_nodes
             if a not in inside and position[a] > first]
    while stack:                    # walk up from outside inputs while after the first member
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for a in node.all_input_nodes:
            if a in inside:
                return False
            if position[a] > first:
                stack.append(a)
    return True


def _placeable(members: list[fx.Node], position: dict[fx.Node, int]) -> bool:
    """Every outside value the region reads comes before every outside use of a value it
    gives: one node can stand for it without moving any other."""
    inside = set(members)
    reads = [position[a] for m in members for a in m.all_input_nodes if a not in inside]
    uses = [position[u] for m in members for u in m.users if u not in inside]
    return not reads or not uses or max(reads) < min(uses)


def _shape(node: fx.Node) -> tuple[str, ...]:
    """The node's shape as text, what str() of each size gives. A symbolic size's text is
    its sympy expression printed (`SymNode.str`), memoized per expression: printing is
    most of what deciding GPT-3's regions costs, and its 96 blocks share a few sizes."""
    return tuple(_expr_text(s.node.expr) if isinstance(s, torch.SymInt) else str(s)
                 for s in node.meta[VAL].shape)


@functools.lru_cache(maxsize=4096)
def _expr_text(expr: sympy.Basic) -> str:
    return f"{expr}"


def _fits_one_kernel(members: list[fx.Node], is_reduction: Predicate) -> bool:
    """One kernel computes the region: without reductions every member has one shape;
    with them, all reduce the last dim of one shape (the region's full shape, one row per
    program) and every member has the full shape or a row's (last dim 1 or dropped)."""
    reductions = [m for m in members if is_reduction(m)]
    if not reductions:
        return len({_shape(m) for m in members}) == 1
    full = _shape(reductions[0].args[0])
    if any(_shape(r.args[0]) != full for r in reductions):
        return False
    shapes = {full, full[:-1] + ("1",), full[:-1]}
    return all(_shape(m) in shapes for m in members)


def _span_is_pure(members: list[fx.Node]) -> bool:
    """Only pure compute lies between the first and the last member: the fused node
    moves no computation across a collective's issue or wait, a random op, a mutation
    or a checkpointed call (overlap's order stays)."""
    inside = set(members)
    node = members[0]
    while node is not members[-1]:
        node = node.next
        if node not in inside and not is_pure(node):
            return False
    return True


#: what the code generator raises for a region it cannot take (UnsupportedRegion is a
#: ValueError; a builder given arguments it does not know raises TypeError or KeyError)
_CANNOT_GENERATE = (ValueError, TypeError, KeyError)


def lowers(members: list[fx.Node]) -> bool:
    """Whether the code generator lowers `members` to one kernel (codegen/lower.py)."""
    from ..codegen.lower import lower
    try:
        lower(region_graph(members))
    except _CANNOT_GENERATE as exc:
        log.debug("fusion: %s do not lower: %s", [m.name for m in members], exc)
        return False
    return True


# ------------------------------------------------------------------ pricing

def region_io(members: list[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]]:
    """(the values the region reads from outside, in first-read order; the members whose
    values are used after it, in graph order)."""
    inside = set(members)
    inputs: dict[fx.Node, None] = {}
    for m in members:
        for a in m.all_input_nodes:
            if a not in inside:
                inputs.setdefault(a, None)
    outputs = [m for m in members if any(u not in inside for u in m.users)]
    return list(inputs), outputs


def region_bytes(members: list[fx.Node]) -> tuple[sympy.Expr, sympy.Expr]:
    """(bytes the fused kernel moves: inputs once + outputs; bytes the members move
    unfused: each op's reads and writes)."""
    inputs, outputs = region_io(members)
    fused = sum((nbytes_expr(n.meta[VAL]) for n in inputs + outputs), sympy.Integer(0))
    unfused = sum((bytes_moved(m) for m in members), sympy.Integer(0))
    return fused, unfused


def saves_bytes(members: list[fx.Node], env: dict) -> bool:
    """Whether fusing `members` moves fewer bytes (symbolic sizes at their examples)."""
    fused, unfused = region_bytes(members)
    return _number(fused, env) < _number(unfused, env)


# ------------------------------------------------------------------ the rewrite

def fuse(gm: fx.GraphModule, where: str = "rank", supported: Predicate | None = None,
         is_reduction: Predicate | None = None, *, recompile: bool = True
         ) -> list[FusedRegion]:
    """Replace every region `find_regions` picks in `gm` by one fused-kernel call
    (`recompile=False`: the caller recompiles `gm`, e.g. with the module it is part of)."""
    fused = _codegen()
    env = _env(gm)
    out = []
    positions = NodeOrder(gm)
    for members in find_regions(gm, supported, is_reduction):
        fused_bytes, unfused_bytes = region_bytes(members)
        inputs, outputs = region_io(members)
        try:
            key = fused.register_region(region_graph(members))
        except _CANNOT_GENERATE as exc:     # (`lowers` said yes: its backward failed)
            log.info("fusion: region %s left unfused: %s", [m.name for m in members], exc)
            continue
        _replace(gm, members, inputs, outputs, key, positions)
        out.append(FusedRegion(where, key, tuple(op_name(m) for m in members),
                               tuple(m.name for m in members), len(inputs), len(outputs),
                               int(_number(fused_bytes, env)), int(_number(unfused_bytes, env))))
    if out:
        gm.graph.lint()
        if recompile:
            gm.recompile()
    return out


def extract_region(members: list[fx.Node]) -> fx.GraphModule:
    """The region as a standalone GraphModule: a placeholder per value it reads (its fake
    value in meta), its nodes with their meta, a tuple of the values used after it."""
    return fx.GraphModule(torch.nn.Module(), region_graph(members), class_name="FusedRegion")


def region_graph(members: list[fx.Node]) -> fx.Graph:
    """`extract_region`'s graph, without the module (whose code generation costs more
    than the graph: the pass asks the code generator about every region it grows)."""
    inputs, outputs = region_io(members)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in inputs:
        env[a] = graph.placeholder(a.name)
        env[a].meta[VAL] = a.meta[VAL]
    for m in members:
        env[m] = graph.node_copy(m, lambda a: env[a])
    graph.output(tuple(env[m] for m in outputs))
    return graph


def _replace(gm: fx.GraphModule, members: list[fx.Node], inputs: list[fx.Node],
             outputs: list[fx.Node], key: str, positions: NodeOrder) -> None:
    inside = set(members)
    last = members[-1]
    users = [u for m in outputs for u in m.users if u not in inside]
    order = positions.of([*users, last])
    first_use = min(users, key=order) if users else None
    if first_use is not None and order(first_use) < order(last):
        context = gm.graph.inserting_before(first_use)
    else:
        context = gm.graph.inserting_after(last)
    with context:
        call = gm.graph.call_function(torch.ops.autohybrid.fused_region.default,
                                      (list(inputs), key))
    call.meta[VAL] = [m.meta[VAL] for m in outputs]
    call.meta[AH_PASS] = PASS
    for meta_key in (MODULE_STACK, STACK_TRACE):
        if meta_key in members[0].meta:
            call.meta[meta_key] = members[0].meta[meta_key]
    anchor = call
    for i, m in enumerate(outputs):
        with gm.graph.inserting_after(anchor):
            get = gm.graph.call_function(operator.getitem, (call, i))
        get.meta.update({k: v for k, v in m.meta.items() if k != AH_PASS})
        get.meta[AH_PASS] = PASS
        m.replace_all_uses_with(get, delete_user_cb=lambda user: user not in inside)
        anchor = get
    for m in reversed(members):
        gm.graph.erase_node(m)


# ------------------------------------------------------------------ undoing it for eager runs

def inline_where_eager(graphs: list[fx.GraphModule], device: torch.device) -> int:
    """`inline_regions` on each of a rank's `graphs` when its regions would run eagerly on
    `device` (`ops.fused.runs_eagerly`); how many regions were inlined. What the runtime
    runs on such a device, and what the dry run shows of it."""
    from ..ops.fused import runs_eagerly

    return sum(inline_regions(gm) for gm in graphs) if runs_eagerly(device) else 0


def inline_regions(gm: fx.GraphModule) -> int:
    """Put every fused region of `gm` and of the graph modules it holds (checkpointed
    regions) back as its own ATen ops, in place; how many regions were inlined.

    For a rank whose regions would run eagerly (`ops.fused.runs_eagerly`: CPU without
    Triton's interpreter), where the op computes the region's ops and its backward
    computes them again to differentiate them: inlined, autograd saves what it needs
    once, as in eager. The same function either way (the region's graph is the ops the
    pass took out); `ctx.notes["fusion"]` still records the regions found."""
    from ..ops.fused import region_graph

    count = 0
    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        graph = module.graph
        changed = False
        for node in list(graph.nodes):
            if node.op != "call_function" or \
                    node.target is not torch.ops.autohybrid.fused_region.default:
                continue
            inputs, key = node.args
            region = region_graph(key).graph
            env: dict[fx.Node, fx.Node] = {}
            placeholders = [n for n in region.nodes if n.op == "placeholder"]
            env.update(zip(placeholders, inputs))
            with graph.inserting_before(node):
                for member in region.nodes:
                    if member.op == "call_function":
                        env[member] = graph.node_copy(member, lambda a: env[a])
            outputs = next(n for n in region.nodes if n.op == "output").args[0]
            for user in list(node.users):
                user.replace_all_uses_with(env[outputs[user.args[1]]])
                graph.erase_node(user)
            graph.erase_node(node)
            count += 1
            changed = True
        if changed:
            module.recompile()
    return count
