"""Pass: overlap — issue collectives early, wait for them late, and run compute between.

Why: a collective that starts only when its result is needed leaves the compute idle for
its whole duration. Split into an issue node (starts the collective and returns the
buffer it fills) and a wait node (waits, then gives the result), the compute between the
two hides the transfer. Each buffer in flight (issued, not yet waited for) and each value
computed earlier than before holds memory longer, so every move is bounded by budgets.

What moves:
* the forward tp/sp collectives (`tp_reduce`, `tp_gather`, `sp_gather`,
  `sp_reduce_scatter`, inserted by passes/tensor_parallel.py and sequence_parallel.py)
  are first split into their issue/wait forms (ops/tensor_parallel.py `ASYNC_FORMS`):
  `<op>_start` where the sync node was, the sync node itself becoming `<op>_wait`;
  ZeRO-3's gathers come split already (passes/zero.py: `zero_gather_start` /
  `zero_gather_wait`);
* every wait moves down to just before its first use;
* every issue moves up as far as its inputs and the budgets allow (a ZeRO-3 gather's
  inputs are parameter shards, so with the default budget, the largest issue's bytes, the
  next layer's gather starts right after the current layer's wait: FSDP's prefetch of one
  layer; a tp/sp collective's input is usually computed right before it);
* independent compute moves in: nodes after a wait that do not depend on its result
  (nor on anything that stays after it) move, in order, to just before the wait, until
  the compute between issue and wait covers the collective's time — `cost(node)` and
  `comm_time(issue)` in seconds: by default a roofline of the node's FLOPs and bytes
  (cost/compute.py) and the α–β formula of the collective (cost/comm.py), both on a
  nominal machine, since only their ratio matters and every rank must derive the same;
* a tp/sp pair with no compute between its issue and wait becomes the sync op again (the
  split costs a copy of the result and would hide nothing).

Rules (all from the graph and the Plan, so every rank derives the same order and the
collectives of a process group are issued in the same order everywhere, or gloo/NCCL
would pair different collectives and hang):
* issues keep their relative order: an issue never moves above another issue, and
  compute never moves across an issue;
* nothing moves across a node that is not pure compute: placeholders, the output,
  random ops (dropout, `sharded_dropout`, sdpa with dropout: the RNG must be drawn in
  eager's order), other autohybrid ops that communicate or draw (vocab-parallel, sync
  batch norm, sharded sdpa), mutations, and checkpointed regions from passes/recompute.py
  (a `checkpoint_region` call and its `get_attr` stay put as one unit, with the
  collectives inside them); an issue may move above a wait, a wait never above anything
  but pure compute;
* an issue moves up one node at a time while the bytes in flight there, with it, stay
  within `budget_bytes`;
* a move is kept only while the peak of live bytes stays within `memory_bytes` (a graph
  already above it may reorder below its own peak). Live bytes: every value the graph
  computes, issue buffers included, from its node to its last use (views and getitems
  keep their base alive; with `keep_saved`, the values autograd saves for backward live
  to the end); placeholders (parameters, inputs) are held outside the graph and not
  counted. By default `memory_bytes` is the peak before the pass plus `budget_bytes`;
* ties are broken by graph position (the pass walks the node list; no set or dict order
  decides anything); only the graph's own nodes move: each pipeline stage's graph is
  scheduled on its own (`ctx.notes["pipeline"]`).

Where: last (after pipeline_split and recompute), on the final per-rank and per-stage
graphs.

Example::

    schedule(gm, budget_bytes=2 * 2**20, cost=lambda n: costs.get(n.name, 0.0),
             comm_time=lambda issue: 1e-4)        # → the number of nodes moved
    schedule_issues(gm, budget_bytes=2 * 2**20)   # only the issues' hoisting
"""
from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import sympy
import torch
import torch.fx as fx

from ..cost import comm
from ..cost.compute import bytes_moved, forward_flops, grad_nodes, saved_nodes
from ..graph import (AH_PASS, MODULE_STACK, STACK_TRACE, SYM_SIZE_OPS, VAL, VIEW_OPS,
                     fake_mode, op_name)
from ..ops.tensor_parallel import ASYNC_FORMS
from ..ops.zero import zero_gather_start_op, zero_gather_wait_op
from .manager import PassContext

PASS = "overlap"
AH = torch.ops.autohybrid

#: issue op → the wait op that consumes its result
ISSUE_OPS = {zero_gather_start_op: zero_gather_wait_op,
             **{start: wait for start, wait in ASYNC_FORMS.values()}}
WAIT_OPS = frozenset(ISSUE_OPS.values())
#: a tp/sp start → the sync op it was split from (to join an idle pair again)
SYNC_OF = {start: sync for sync, (start, _) in ASYNC_FORMS.items()}
#: autohybrid ops whose forward is local compute (a copy or a slice): they may move
LOCAL_OPS = frozenset({AH.tp_copy.default, AH.tp_split.default, AH.tp_replicated.default})
#: autohybrid ops that only compute (passes/fusion.py's kernels): they may move too
COMPUTE_OPS = frozenset({AH.fused_region.default})
#: random autohybrid ops (for the rule, not for purity: every other autohybrid op is
#: a barrier anyway)
RANDOM_OPS = frozenset({AH.sharded_dropout.default, AH.sharded_sdpa.default})
_SDPA = "aten.scaled_dot_product_attention.default"

Cost = Callable[[fx.Node], float]


def overlap(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    graphs = [gm]
    split = ctx.notes.get("pipeline")
    if split is not None:
        graphs += [stage.gm for stage in split.stages]
    sizes = {"dp": ctx.plan.mesh.dp, "tp": ctx.plan.mesh.tp, "pp": ctx.plan.mesh.pp}
    moved = pairs = 0
    for g in graphs:
        moved += schedule(g, comm_time=nominal_comm_time(sizes),
                          keep_saved=ctx.graph_kind == "train")
        pairs += sum(1 for n in _issues(g) if n.target in SYNC_OF)
        # (recompiled once, with every stage graph, by the pass manager at the end)
    ctx.notes["overlap_moved"] = moved
    ctx.notes["overlap_split"] = pairs   # tp/sp collectives left as issue + wait
    return gm


def schedule(gm: fx.GraphModule, budget_bytes: int | None = None,
             memory_bytes: int | None = None, cost: Cost | None = None,
             comm_time: Cost | None = None, keep_saved: bool = False) -> int:
    """Split `gm`'s tp/sp collectives, then move waits, issues and compute as the module
    docstring says; the number of nodes moved. `budget_bytes`: bytes in flight (default
    the largest issue's); `memory_bytes`: peak live bytes (default the peak before plus
    `budget_bytes`); `cost(node)` and `comm_time(issue)`: seconds (default: nominal)."""
    split_collectives(gm)
    if budget_bytes is None:
        budget_bytes = default_budget(gm)
    memory = LiveBytes(gm, keep_saved)
    if memory_bytes is None:
        memory_bytes = memory.peak() + budget_bytes
    cost = cost or default_cost(gm)
    comm_time = comm_time or nominal_comm_time()
    moved = sink_waits(gm)
    moved += schedule_issues(gm, budget_bytes, memory_bytes, memory)
    moved += fill(gm, cost, comm_time, memory_bytes, memory)
    join_idle(gm, cost)
    return moved


# ------------------------------------------------------------------ what may move

def is_issue(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in ISSUE_OPS


def is_wait(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in WAIT_OPS


def is_random(node: fx.Node) -> bool:
    """Whether `node` draws from the RNG (then its place in the order matters)."""
    target = node.target
    if target in RANDOM_OPS:
        return True
    if not isinstance(target, torch._ops.OpOverload) \
            or torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    if op_name(node) == _SDPA:        # tagged for its dropout, which is off by default
        p = node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0)
        return p != 0.0
    return True


def is_pure(node: fx.Node) -> bool:
    """Compute that may change places: a call_function of an ATen/prim op that neither
    mutates nor draws random numbers, a getitem, size arithmetic, a local autohybrid
    op (tp_copy, tp_split, tp_replicated) or a fused kernel (fused_region)."""
    if node.op != "call_function":
        return False
    target = node.target
    if target is operator.getitem or target in SYM_SIZE_OPS or target in LOCAL_OPS \
            or target in COMPUTE_OPS:
        return True
    if not isinstance(target, torch._ops.OpOverload) or target.namespace not in ("aten", "prim"):
        return False
    return not target._schema.is_mutable and not is_random(node)


def _issues(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if is_issue(n)]


def _wait_of(issue: fx.Node) -> fx.Node:
    waits = [u for u in issue.users if u.target is ISSUE_OPS[issue.target]]
    if len(waits) != 1:
        raise AssertionError(f"overlap: {issue.name} has {len(waits)} waits, expected one")
    return waits[0]


def _between(first: fx.Node, last: fx.Node) -> Iterator[fx.Node]:
    node = first.next
    while node is not last:
        yield node
        node = node.next


# ------------------------------------------------------------------ sizes

def _env(gm: fx.GraphModule) -> dict:
    """Symbol → its example value, to price symbolic sizes (never guarding on them)."""
    mode = fake_mode(gm)
    shape_env = getattr(mode, "shape_env", None)
    for name in ("backed_var_to_val", "var_to_val"):   # torch ≥ 2.13 renames it
        if hasattr(shape_env, name):
            return dict(getattr(shape_env, name) or {})
    return {}


def _number(expr, env: dict) -> float:
    if isinstance(expr, (int, float)):
        return float(expr)
    value = sympy.sympify(expr).xreplace(env)
    return float(value) if value.is_number else 0.0


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _nbytes(value, env: dict) -> int:
    total = 0
    for t in _tensors(value):
        numel = sympy.Mul(*[s.node.expr if isinstance(s, torch.SymInt) else sympy.Integer(s)
                            for s in t.shape])
        total += int(_number(numel, env)) * t.element_size()
    return total


def issue_bytes(node: fx.Node, env: dict | None = None) -> int:
    """Bytes of the buffer an issue fills (its value's; symbolic sizes at their example,
    from `env`, `_env` of the graph when not given)."""
    value = node.meta.get(VAL)
    if not isinstance(value, torch.Tensor):
        return 0
    if all(isinstance(s, int) for s in value.shape):
        return value.numel() * value.element_size()
    return _nbytes(value, _env(node.graph.owning_module) if env is None else env)


def default_budget(gm: fx.GraphModule) -> int:
    """The largest single issue's bytes: one collective in flight ahead of its use."""
    env = _env(gm)
    return max((issue_bytes(n, env) for n in _issues(gm)), default=0)


def in_flight(gm: fx.GraphModule) -> list[tuple[fx.Node, int]]:
    """(node, bytes of the collectives issued before it whose wait is it or later) in
    graph order: an issue's buffer counts from the node after the issue up to and
    including its wait (which reads it)."""
    pending: dict[fx.Node, int] = {}            # wait node → its issue's bytes
    out, env = [], _env(gm)
    for node in gm.graph.nodes:
        out.append((node, sum(pending.values())))
        pending.pop(node, None)
        if is_issue(node):
            pending[_wait_of(node)] = issue_bytes(node, env)
    return out


#: autohybrid ops that keep no tensor of the graph for backward (only their arguments)
_SAVE_NOTHING = frozenset({*ISSUE_OPS, *WAIT_OPS, *ASYNC_FORMS, *LOCAL_OPS})


class LiveBytes:
    """Bytes of the values alive at each node of `gm` (see the module docstring), for
    the order the graph has when asked. Node sizes are computed once and cached."""

    def __init__(self, gm: fx.GraphModule, keep_saved: bool = False):
        self.gm, self.env = gm, _env(gm)
        self.sizes: dict[fx.Node, int] = {}
        self.saved: set[fx.Node] = set()
        if keep_saved:
            needs = grad_nodes(gm)
            for node in gm.graph.nodes:
                if node.op == "call_function" and node.target not in _SAVE_NOTHING:
                    self.saved.update(saved_nodes(node, needs))

    def size(self, node: fx.Node) -> int:
        if node not in self.sizes:
            self.sizes[node] = _nbytes(node.meta.get(VAL), self.env)
        return self.sizes[node]

    def profile(self) -> list[tuple[fx.Node, int]]:
        """(node, bytes alive while it runs, its own output included) in graph order."""
        nodes = list(self.gm.graph.nodes)
        root: dict[fx.Node, fx.Node | None] = {}    # value → the node owning its memory
        last: dict[fx.Node, int] = {}                # owner → the last position needing it
        end = len(nodes) - 1
        for i, node in enumerate(nodes):
            for a in node.all_input_nodes:
                owner = root.get(a)
                if owner is not None:
                    last[owner] = end if node.op == "output" else max(last[owner], i)
            if node.op != "call_function":
                continue
            source = node.args[0] if node.args else None
            if (node.target is operator.getitem or op_name(node) in VIEW_OPS) \
                    and isinstance(source, fx.Node):
                root[node] = root.get(source)
            else:
                root[node] = node
                last[node] = i
        for node in self.saved:
            owner = root.get(node)
            if owner is not None:
                last[owner] = end
        delta = [0] * (len(nodes) + 1)
        position = {n: i for i, n in enumerate(nodes)}
        for owner, stop in last.items():
            size = self.size(owner)
            delta[position[owner]] += size
            delta[stop + 1] -= size
        out, live = [], 0
        for node, change in zip(nodes, delta):
            live += change
            out.append((node, live))
        return out

    def peak(self) -> int:
        return max((b for _, b in self.profile()), default=0)


def peak_live_bytes(gm: fx.GraphModule, keep_saved: bool = False) -> int:
    """The most bytes alive at any node of `gm` (what `memory_bytes` bounds)."""
    return LiveBytes(gm, keep_saved).peak()


# ------------------------------------------------------------------ default prices

#: A nominal accelerator and link for the default prices. Only ratios decide the order
#: (compute time against collective time), and the order must be a function of the Plan
#: and the graph only, so the figures are fixed here rather than read from the machine.
NOMINAL_FLOPS = 1e14              # FLOP/s
NOMINAL_MEMORY_BANDWIDTH = 2e12   # bytes/s
NOMINAL_LINK_BANDWIDTH = 1e11     # bytes/s per direction
NOMINAL_LINK_LATENCY_S = 1e-5


@dataclass(frozen=True)
class NominalLink:
    """The link of every group, for cost/comm.py's formulas (its `_Cluster` protocol)."""

    bandwidth: float = NOMINAL_LINK_BANDWIDTH
    latency_s: float = NOMINAL_LINK_LATENCY_S
    devices_per_node: int = 8

    def link_for(self, ranks: Sequence[int], kind: str | None = None
                 ) -> tuple[float, float, float]:
        return self.bandwidth, self.latency_s, 1.0


def default_cost(gm: fx.GraphModule) -> Cost:
    """Seconds of a node on the nominal machine: the roofline max of its FLOPs and bytes
    moved (cost/compute.py); a checkpointed region costs its nodes' sum; issues, waits,
    getitems and size arithmetic cost nothing."""
    env = _env(gm)

    def cost(node: fx.Node) -> float:
        if node.op != "call_function" or node.target is operator.getitem \
                or node.target in SYM_SIZE_OPS or is_issue(node) or is_wait(node):
            return 0.0
        sub = _region(node)
        if sub is not None:
            return sum(cost(n) for n in sub.graph.nodes)
        flops = _number(forward_flops(node), env)
        moved = _number(bytes_moved(node), env)
        return max(flops / NOMINAL_FLOPS, moved / NOMINAL_MEMORY_BANDWIDTH)

    return cost


def _region(node: fx.Node) -> fx.GraphModule | None:
    """The submodule a `checkpoint_region(sub, *inputs)` call runs, else None."""
    first = node.args[0] if node.args else None
    if isinstance(first, fx.Node) and first.op == "get_attr":
        sub = getattr(node.graph.owning_module, first.target, None)
        if isinstance(sub, fx.GraphModule):
            return sub
    return None


def _axis(issue: fx.Node) -> str:
    return issue.kwargs.get("axis", issue.args[-1])


def _group_size(issue: fx.Node, sizes: dict[str, int]) -> int:
    if issue.target is zero_gather_start_op:
        return int(issue.args[1])
    if _axis(issue) in sizes:
        return sizes[_axis(issue)]
    x, buffer = issue.args[0].meta.get(VAL), issue.meta.get(VAL)
    if issue.target is AH.tp_reduce_start.default or x is None or buffer is None:
        return 2
    env = _env(issue.graph.owning_module)
    a, b = _nbytes(x, env), _nbytes(buffer, env)
    return max(1, round(max(a, b) / max(1, min(a, b))))


def nominal_comm_time(sizes: dict[str, int] | None = None,
                      link: NominalLink = NominalLink()) -> Cost:
    """Seconds of an issue's collective over its group (size from `sizes` by axis, else
    from its shapes) on `link`: cost/comm.py's ring formulas."""
    sizes = sizes or {}

    def comm_time(issue: fx.Node) -> float:
        p = _group_size(issue, sizes)
        ranks, n = range(p), issue_bytes(issue)
        if issue.target is AH.tp_reduce_start.default:
            return comm.all_reduce(link, ranks, n)
        if issue.target is AH.sp_reduce_scatter_start.default:
            return comm.reduce_scatter(link, ranks, n * p)   # its input's bytes
        return comm.all_gather(link, ranks, n)               # the gathered bytes

    return comm_time


# ------------------------------------------------------------------ the steps

def split_collectives(gm: fx.GraphModule) -> int:
    """Split each sync forward tp/sp collective into its start (inserted before it) and
    its wait (the node itself, retargeted: name, users and value stay); how many."""
    mode = fake_mode(gm)
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in ASYNC_FORMS:
            continue
        start_op, wait_op = ASYNC_FORMS[node.target]
        with gm.graph.inserting_before(node):
            issue = gm.graph.call_function(start_op, node.args, dict(node.kwargs))
        issue.meta[AH_PASS] = PASS
        for key in (MODULE_STACK, STACK_TRACE):
            if key in node.meta:
                issue.meta[key] = node.meta[key]
        issue.meta[VAL] = _buffer_value(node, mode)
        node.target = wait_op
        node.args = (issue, *node.args)
        count += 1
    return count


def _buffer_value(node: fx.Node, mode) -> torch.Tensor:
    """The fake value of the buffer a start fills: the sync result with `dim` in front."""
    value = node.meta.get(VAL)
    if not isinstance(value, torch.Tensor):
        raise AssertionError(f"overlap: {node.name} ({op_name(node)}) has no fake value in "
                             f"meta['{VAL}']; the pass that inserted it must set one "
                             "(graph.new_node does)")
    if node.target is AH.tp_reduce.default:
        dim = 0
    else:
        dim = node.kwargs["dim"] if "dim" in node.kwargs else node.args[1]
    with mode if mode is not None else contextlib.nullcontext():
        return value.movedim(dim, 0).contiguous() if value.dim() else value.clone()


def sink_waits(gm: fx.GraphModule) -> int:
    """Move each wait down to just before its first user, past pure compute only."""
    moved = 0
    for wait in [n for n in gm.graph.nodes if is_wait(n)]:
        node = wait.next
        while node not in wait.users and is_pure(node):
            node = node.next
        if node is not wait.next:
            node.prepend(wait)
            moved += 1
    return moved


def schedule_issues(gm: fx.GraphModule, budget_bytes: int, memory_bytes: int | None = None,
                    memory: LiveBytes | None = None) -> int:
    """Move every issue node of `gm` up as far as the rules allow; how many moved."""
    if memory_bytes is not None and memory is None:
        memory = LiveBytes(gm)
    moved = 0
    env = _env(gm)
    for issue in _issues(gm):
        size = issue_bytes(issue, env)
        reads = set(issue.all_input_nodes)
        flight = dict(in_flight(gm))
        live, limit = {}, None
        if memory_bytes is not None:
            profile = memory.profile()
            live = dict(profile)
            limit = max(memory_bytes, max(b for _, b in profile))
        target = None
        node = issue.prev
        while node.op != "root":
            if node in reads or not (is_pure(node) or is_wait(node)):
                break
            if flight[node] + size > budget_bytes:
                break
            if limit is not None and live[node] + size > limit:
                break
            target = node
            node = node.prev
        if target is not None:
            target.prepend(issue)
            moved += 1
    return moved


def fill(gm: fx.GraphModule, cost: Cost, comm_time: Cost, memory_bytes: int,
         memory: LiveBytes | None = None) -> int:
    """For each issue in order: move the compute after its wait that does not depend on
    it to just before the wait, in order, until the compute between issue and wait covers
    `comm_time(issue)`; stop at an issue or a node that is not pure. Of those moves, the
    longest run after which the peak of live bytes is within `memory_bytes` (or not above
    the peak before them) is kept, the rest undone (a chain of moves may pass through a
    higher peak: a value moved before its reader is). How many nodes moved."""
    memory = memory or LiveBytes(gm)
    moved = 0
    for issue in _issues(gm):
        wait = _wait_of(issue)
        covered = sum(cost(n) for n in _between(issue, wait))
        need = comm_time(issue)
        if covered >= need:
            continue
        limit = max(memory_bytes, memory.peak())
        tried: list[tuple[fx.Node, fx.Node]] = []    # (node moved, the node it preceded)
        kept = 0
        stays = {wait}
        node = wait.next
        while covered < need and (is_pure(node) or is_wait(node)):
            following = node.next
            if is_wait(node) or any(a in stays for a in node.all_input_nodes):
                stays.add(node)
            else:
                wait.prepend(node)
                tried.append((node, following))
                covered += cost(node)
                if memory.peak() <= limit:
                    kept = len(tried)
            node = following
        for node, following in reversed(tried[kept:]):
            following.prepend(node)                  # back where it was
        moved += kept
    return moved


def join_idle(gm: fx.GraphModule, cost: Cost) -> int:
    """Turn each tp/sp pair with no compute (nor another collective) between its issue
    and its wait back into the sync op, at the wait; how many."""
    joined = 0
    for issue in _issues(gm):
        if issue.target not in SYNC_OF:
            continue
        wait = _wait_of(issue)
        if any(is_issue(n) or is_wait(n) or cost(n) > 0 for n in _between(issue, wait)):
            continue
        wait.target = SYNC_OF[issue.target]
        wait.args = wait.args[1:]
        gm.graph.erase_node(issue)
        joined += 1
    return joined
