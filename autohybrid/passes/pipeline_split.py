"""Pass: cut the rank-local graph into pipeline stages at the Plan's stage boundaries.

Runs last, on the graph the other passes produced for this rank (tp collectives and
sequence slices included), and leaves it unchanged: its product is
`ctx.notes["pipeline"]` (`RankProgram.pipeline`), a `PipelineSplit` (program.py) whose
`StageGraph`s the runtime (runtime/pipeline.py) wraps as `torch.distributed.pipelining`
stages.

Which node runs where:
* every compute node belongs to a layer (search/layers.py); the Plan names the first
  layer of each stage after the first, so a layer's stage is the number of boundaries at
  or before it;
* nodes computed from the batch alone (position ids, attention masks, sizes: no
  parameter and no activation upstream, no random draw) move to the first stage that
  uses them, and every later stage that reads them computes them again, so they are
  never sent through the pipeline (nor are symbolic sizes, which cannot be sent);
* a node never runs before its inputs (stages only grow along the graph), a tuple
  output's `getitem`s stay with it, and the graph's outputs come from the last stage;
* tensors written in place (torch.export's training IR keeps `x[:, 0] = v`,
  `masked_fill_`, `add_`): the graph's edges do not order a write with the reads of the
  same storage (a write into a slice has no user at all), so the split never separates
  them. A tensor built in place from the batch alone (BART's and T5's `shift_tokens_right`
  of the labels into decoder inputs) is recomputed whole — every view and write — by each
  stage that reads it; any other such tensor, its views, its writes and every node that
  reads it before a write share one stage, which runs them in graph order. Each stage
  runs its nodes in the full graph's order, recomputed ones included.
* refused (`pipeline_blockers`, PlanError; the planner then ranks no pp > 1 plan as
  executable): a write into a parameter, buffer, constant or batch tensor, of which each
  stage holds its own copy.

What crosses stages: the model's inputs and targets reach every stage as keyword
arguments (the schedules split them into microbatches for each stage), so only
activations travel between neighbouring stages. A value made in stage a and read in
stage b > a + 1 is sent by a and forwarded unchanged by a+1 … b−1 (torch's schedules
connect neighbours only). Parameters are placeholders of each stage that reads them; a
parameter read by several stages (tied embedding and output weights) is in each of them,
and `PipelineSplit.shared_params` says which stages must sum its gradients.

The first stage receives the model's inputs positionally (as the schedules expect); the
last stage returns the graph's outputs (numerator, denominator of the loss after
`global_loss`). With AUTOHYBRID_DEBUG=1 each stage's graph is written beside the pass
dumps (`<kind>_stage<k>.py`).

Example::

    gm = pipeline_split(gm, ctx)
    split = ctx.notes["pipeline"]
    [s.describe() for s in split.stages]
"""
from __future__ import annotations

import bisect
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from ..errors import PlanError
from ..graph import (AH_PARAM, AH_ROLE, VAL, lazy_graph_module, module_path, op_name,
                     output_node, source_line)
from ..cost.compute import grad_nodes
from ..search.layers import segment
from ..program import PipelineSplit, StageGraph
from .batch_effects import updates_running_statistics
from .manager import PassContext, dump_dir

_BATCH_ROLES = ("input", "target")
#: Ops whose result depends on the random generator: never duplicated or moved.
_RANDOM = ("dropout", "bernoulli", "rand", "normal", "multinomial", "randperm")


def pipeline_split(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    plan = ctx.plan
    if plan.mesh.pp == 1:
        return gm
    stage_of = assign_stages(gm, plan.stage_boundaries, plan.num_stages)
    split = build_split(gm, stage_of, plan.num_stages)
    ctx.notes["pipeline"] = split
    dump = dump_dir(ctx.rank)
    if dump is not None:  # AUTOHYBRID_DEBUG=1: every stage's graph beside the pass dumps
        for stage in split.stages:
            (dump / f"{ctx.graph_kind}_stage{stage.index}.py").write_text(
                f"# {stage.describe()}\n" + stage.gm.print_readable(print_output=False))
    return gm


# ---------------------------------------------------------------------- assignment
def assign_stages(gm: fx.GraphModule, boundaries: tuple[str, ...],
                  num_stages: int) -> dict[fx.Node, int]:
    """The stage of every call_function node (see the module docstring)."""
    if len(boundaries) != num_stages - 1:
        raise PlanError(f"the plan has {len(boundaries)} stage boundaries for {num_stages} "
                        f"pipeline stages (needs {num_stages - 1}); make the plan again")
    blockers = pipeline_blockers(gm)
    if blockers:
        raise PlanError("this graph cannot be cut into pipeline stages: "
                        + "; ".join(blockers))
    layers = segment(gm)
    names = [layer.name for layer in layers]
    starts: list[int] = []
    for name in boundaries:
        after = starts[-1] + 1 if starts else 1
        try:
            starts.append(names.index(name, after))
        except ValueError:
            raise PlanError(
                f"stage boundary {name!r} is not a layer of this graph after "
                f"{names[after - 1]!r} (layers in order: {', '.join(names)})") from None
    stage: dict[fx.Node, int] = {}
    for i, layer in enumerate(layers):
        for node in layer.nodes:
            stage[node] = bisect.bisect_right(starts, i)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    last = num_stages - 1
    groups, recompute = _analysis(gm)
    # Nodes that must share a stage (union-find over the non-recomputed nodes): a tuple
    # output's getitems with it; a tensor written in place with its views, the in-place
    # ops and every reader that reads it before one of those writes (in its own stage
    # it reads in graph order, from a later one it would see the value after all writes).
    parent: dict[fx.Node, fx.Node] = {}

    def find(n: fx.Node) -> fx.Node:
        while parent.get(n, n) is not n:
            n = parent[n]
        return n

    def union(a: fx.Node, b: fx.Node) -> None:
        ra, rb = find(a), find(b)
        if ra is not rb:
            parent[rb] = ra

    for node in nodes:
        if node.target is operator.getitem and node.args[0] in stage \
                and node not in recompute:
            stage[node] = stage[node.args[0]]
            union(node.args[0], node)
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    for group in groups:
        if group.base in recompute:
            continue
        for member in group.members:
            union(group.base, member)
        last_write = max(position[m] for m in group.mutations)
        members = set(group.members)
        for member in group.members:
            for user in member.users:
                if user not in members and user.op == "call_function" \
                        and position[user] < last_write:
                    union(group.base, user)
    sets: dict[fx.Node, list[fx.Node]] = {}
    for node in nodes:
        if node not in recompute:
            sets.setdefault(find(node), []).append(node)
    tied = [s for s in sets.values() if len(s) > 1]
    changed = True
    while changed:  # never before an input (recomputed values are everywhere); tied sets
        changed = False
        for node in nodes:
            if node in recompute:
                continue
            inputs = [stage[a] for a in node.all_input_nodes
                      if a in stage and a not in recompute]
            if inputs and max(inputs) > stage[node]:
                stage[node], changed = max(inputs), True
        for members in tied:
            top = max(stage[m] for m in members)
            for m in members:
                if stage[m] != top:
                    stage[m], changed = top, True
    # batch-only values: at their first reader (every later reader computes them again,
    # see _stage_graph); a tensor built in place from the batch alone moves as one
    first: dict[fx.Node, int] = {}
    for node in reversed(nodes):
        if node in recompute:
            readers = [last if u.op == "output" else stage[u] for u in node.users
                       if u.op == "output" or u in stage]
            if readers:
                stage[node] = first[node] = min(readers)
    for group in groups:
        if group.base in recompute:
            read = [first[m] for m in group.members if m in first]
            home = min(read) if read else min(stage[m] for m in group.members)
            for m in group.members:
                stage[m] = home
    return stage


@dataclass
class _Written:
    """A tensor some node writes in place: its `base` (the node that made the storage),
    the `members` aliasing it (base, views, in-place ops, graph order) and the in-place
    ops among them (`mutations`)."""

    base: fx.Node
    members: list[fx.Node]
    mutations: list[fx.Node]


def _aliases(node: fx.Node) -> tuple[list[fx.Node], list[fx.Node]]:
    """(the inputs `node`'s output may alias, the inputs it writes in place), from the
    op's schema; a higher-order op whose subgraph writes into one of its operands writes
    it (every tensor operand, when the operands cannot be matched to the subgraph's)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        written = _subgraph_writes(node)
        return [], written
    returns = set()
    for ret in schema.returns:
        if ret.alias_info is not None:
            returns |= set(ret.alias_info.before_set)
    aliased: list[fx.Node] = []
    written: list[fx.Node] = []
    for i, arg in enumerate(schema.arguments):
        info = arg.alias_info
        if info is None:
            continue
        if i < len(node.args) and not arg.kwarg_only:
            value = node.args[i]
        else:
            value = node.kwargs.get(arg.name)
        values = [v for v in (value if isinstance(value, (list, tuple)) else [value])
                  if isinstance(v, fx.Node)]
        if info.is_write:
            written.extend(values)
        if set(info.before_set) & returns:
            aliased.extend(values)
    return aliased, written


def _subgraph_writes(node: fx.Node) -> list[fx.Node]:
    owner = node.graph.owning_module
    subs = [(i, a) for i, a in enumerate(node.args) if isinstance(a, fx.Node)
            and a.op == "get_attr" and isinstance(getattr(owner, str(a.target), None),
                                                 fx.GraphModule)]
    if not subs or owner is None:
        return []
    out: list[fx.Node] = []
    for i, attr in subs:
        sub = getattr(owner, str(attr.target))
        written = {g.base for g in written_tensors(sub) if g.base.op == "placeholder"}
        if not written:
            continue
        phs = [n for n in sub.graph.nodes if n.op == "placeholder"]
        operands = list(node.args[i + 1:])
        if len(operands) == len(phs):
            out.extend(o for o, p in zip(operands, phs)
                       if p in written and isinstance(o, fx.Node))
        else:
            out.extend(a for a in node.all_input_nodes if a.op != "get_attr")
    return out


def written_tensors(gm: fx.GraphModule) -> list[_Written]:
    """Every tensor the graph writes in place (`x[:, 0] = …`, `masked_fill_`, `add_`),
    with its aliases. The graph's edges do not order such writes with the reads of the
    same storage, so a split must keep them together or replay them all."""
    base_of: dict[fx.Node, fx.Node] = {}
    writes: dict[fx.Node, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is operator.getitem:
            if isinstance(node.args[0], fx.Node) and node.args[0] in base_of:
                base_of[node] = base_of[node.args[0]]
            continue
        aliased, written = _aliases(node)
        if aliased:
            base_of[node] = base_of.get(aliased[0], aliased[0])
        for arg in written:
            writes.setdefault(base_of.get(arg, arg), []).append(node)
    members: dict[fx.Node, list[fx.Node]] = {base: [] for base in writes}
    written_by: dict[fx.Node, list[fx.Node]] = {}
    for base, mutations in writes.items():
        for node in mutations:
            written_by.setdefault(node, []).append(base)
    for node in gm.graph.nodes:  # graph order; an op that writes but returns no alias too
        for base in dict.fromkeys([base_of.get(node, node), *written_by.get(node, ())]):
            if base in members:
                members[base].append(node)
    return [_Written(base, members[base], list(dict.fromkeys(mutations)))
            for base, mutations in writes.items()]


def pipeline_blockers(gm: fx.GraphModule) -> list[str]:
    """Why `gm` cannot be cut into pipeline stages at any boundaries (empty when it can):
    in-place writes into a parameter, buffer, constant or batch tensor, of which every
    stage reading it holds its own copy (the writes of one stage would not reach the
    others, nor the batch the caller passed), running statistics included
    (InstanceNorm's, which its op's schema does not declare as written)."""
    writes = []
    for group in written_tensors(gm):
        base = group.base
        if base.op == "call_function":
            continue
        if base.op == "placeholder":
            role = base.meta.get(AH_ROLE, "placeholder")
            what = f"the {role} {base.meta.get(AH_PARAM, base.name)!r}"
        else:
            what = f"the attribute {base.target!r}"
        first = group.mutations[0]
        writes.append(f"node {first.name!r} ({op_name(first)}, in "
                      f"{module_path(first) or 'the model'}) writes in place into {what}")
    writes += [f"node {n.name!r} ({op_name(n)}, in {module_path(n) or 'the model'}) "
               "updates its running statistics (buffers) in place"
               for n in gm.graph.nodes if updates_running_statistics(n)]
    if not writes:
        return []
    more = f" (and {len(writes) - 3} more)" if len(writes) > 3 else ""
    return ["pipeline stages cannot share in-place writes into a parameter, buffer or "
            "batch tensor (each stage holds its own copy): " + "; ".join(writes[:3]) + more
            + ". Write it out of place (`x = x.mul(2)`, not `x.mul_(2)`) or use pp=1"]


def _batch_only(gm: fx.GraphModule, excluded: set[fx.Node] = frozenset()) -> set[fx.Node]:
    """Nodes computed from the batch (and constants) alone: no parameter or activation
    upstream (`excluded` nodes count as activations)."""
    out: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if node.meta.get(AH_ROLE) in (*_BATCH_ROLES, "constant"):
                out.add(node)
        elif node.op == "call_function" and node not in excluded \
                and all(a in out for a in node.all_input_nodes):
            out.add(node)
    return out


def _analysis(gm: fx.GraphModule) -> tuple[list[_Written], set[fx.Node]]:
    """The tensors written in place, and the nodes every stage computes again for itself
    (batch-only, no random draw upstream; a tensor built in place is recomputed whole, or
    not at all — as an activation — when a write or a view of it is not batch-only)."""
    groups = [g for g in written_tensors(gm) if g.base.op == "call_function"]
    # a random draw is made once (its stage sends it), so what is computed from it is not
    # recomputed either: another stage would need the draw it does not have
    excluded = {n for n in gm.graph.nodes if n.op == "call_function" and _random(n)}
    while True:
        recompute = {n for n in _batch_only(gm, excluded) if n.op == "call_function"}
        partial = [g for g in groups if any(m in recompute for m in g.members)
                   and not all(m in recompute for m in g.members)]
        if not partial:
            return groups, recompute
        for g in partial:
            excluded.update(g.members)


def recomputed(gm: fx.GraphModule) -> tuple[set[fx.Node], list[list[fx.Node]]]:
    """The nodes each stage computes again for itself (batch-only, see the module
    docstring), and among them the tensors built in place, as alias groups (each group is
    computed whole, in graph order, or not at all)."""
    groups, recompute = _analysis(gm)
    return recompute, [g.members for g in groups if g.base in recompute]


def _random(node: fx.Node) -> bool:
    return any(word in op_name(node) for word in _RANDOM)


# ---------------------------------------------------------------------- stage graphs
def build_split(gm: fx.GraphModule, stage_of: dict[fx.Node, int],
                num_stages: int) -> PipelineSplit:
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    index_of = {n: i for i, n in enumerate(phs)}
    inputs = tuple(i for i, n in enumerate(phs) if n.meta.get(AH_ROLE) == "input")
    batch = inputs + tuple(i for i, n in enumerate(phs) if n.meta.get(AH_ROLE) == "target")
    out = output_node(gm)
    last = num_stages - 1
    groups, recompute = _analysis(gm)
    tensors = {n for n in stage_of if isinstance(n.meta.get(VAL), torch.Tensor)} - recompute
    # the last stage that reads each crossing tensor
    last_read: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        reader = last if node.op == "output" else stage_of.get(node)
        if reader is None:
            continue
        for arg in node.all_input_nodes:
            if arg in tensors and stage_of[arg] < reader:
                last_read[arg] = max(last_read.get(arg, -1), reader)
            elif arg in stage_of and stage_of[arg] < reader and arg not in recompute:
                raise PlanError(
                    f"node {arg.name!r} ({op_name(arg)}) of stage {stage_of[arg]} is read in "
                    f"stage {reader} but is neither a tensor (which the pipeline sends) nor a "
                    "size computable from the batch")
    needs_grad = grad_nodes(gm)
    stages: list[StageGraph] = []
    received_nodes = [phs[i] for i in inputs]
    for k in range(num_stages):
        own = [n for n in gm.graph.nodes if stage_of.get(n) == k]
        if k == last:
            sent_nodes = list(out.args[0])
        else:
            sent_nodes = [n for n in [*received_nodes, *own]
                          if n in last_read and last_read[n] > k and n in tensors]
            if not sent_nodes:
                raise PlanError(f"pipeline stage {k} sends nothing to stage {k + 1}: the "
                                "stages are not connected; choose other stage boundaries")
            sized_by_data = next((n for n in sent_nodes
                                  if free_unbacked_symbols(n.meta.get(VAL))), None)
            if sized_by_data is not None:
                raise PlanError(
                    f"pipeline stage {k} would send node {sized_by_data.name!r} "
                    f"({op_name(sized_by_data)}, `{source_line(sized_by_data)}`) to stage "
                    f"{k + 1}, whose shape depends on the data (e.g. the rows torch.where "
                    "picks): a stage's receive buffers are sized before the values arrive. "
                    "Choose stage boundaries it does not cross, or pp=1")
        stage = _stage_graph(gm, k, own, received_nodes, sent_nodes, index_of, out,
                             k == last, recompute, groups)
        stage.sent_requires_grad = tuple(n in needs_grad for n in sent_nodes
                                         if isinstance(n, fx.Node))
        stages.append(stage)
        received_nodes = sent_nodes
    shared: dict[str, set[int]] = {}
    for stage in stages:
        for name in stage.params:
            shared.setdefault(name, set()).add(stage.index)
    return PipelineSplit(stages, inputs, batch,
                         {n: tuple(sorted(s)) for n, s in shared.items() if len(s) > 1})


def _stage_graph(gm: fx.GraphModule, k: int, own: list[fx.Node], received: list[fx.Node],
                 sent: list[Any], index_of: dict[fx.Node, int], out: fx.Node,
                 is_last: bool, recompute: set[fx.Node],
                 groups: list[_Written]) -> StageGraph:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in received:
        env[node] = graph.placeholder(node.name)
        env[node].meta.update(node.meta)
    # what this stage runs: its own nodes and the batch-only values they read, computed
    # again here (a tensor built in place: all its views and writes), in graph order, so
    # every read of a tensor written in place sees the writes before it and no later one
    whole: dict[fx.Node, list[fx.Node]] = {}
    for g in groups:
        if g.base in recompute:
            for m in g.members:
                whole.setdefault(m, []).extend(g.members)
    run = set(own)
    todo = [a for n in ([*own, out] if is_last else own) for a in n.all_input_nodes]
    while todo:
        node = todo.pop()
        if node in run or node in env or node not in recompute:
            continue
        run.add(node)
        todo.extend(node.all_input_nodes)
        todo.extend(whole.get(node, ()))
    order = [n for n in gm.graph.nodes if n in run]
    # the full graph's placeholders this stage reads
    needed: dict[int, fx.Node] = {}
    for node in [*order, *([out] if is_last else [])]:
        for arg in node.all_input_nodes:
            if arg.op == "placeholder" and arg not in env:
                needed[index_of[arg]] = arg
    for node in sent:
        if isinstance(node, fx.Node) and node not in env and node.op == "placeholder":
            needed[index_of[node]] = node
    local: list[int] = []
    for i in sorted(needed):
        node = needed[i]
        env[node] = graph.placeholder(node.name)
        env[node].meta.update(node.meta)
        local.append(i)

    def lookup(arg: fx.Node) -> fx.Node:
        if arg not in env:
            if arg.op != "get_attr":
                raise PlanError(f"pipeline stage {k} reads node {arg.name!r} "
                                f"({op_name(arg)}), which it neither computes nor receives")
            env[arg] = graph.node_copy(arg, lookup)
        return env[arg]

    for node in order:
        env[node] = graph.node_copy(node, lookup)
    graph.output(tuple(fx.node.map_arg(n, lookup) for n in sent))
    stage_gm = lazy_graph_module(gm, graph)
    params = tuple(dict.fromkeys(
        n.meta.get(AH_PARAM, n.name) for i, n in ((i, needed[i]) for i in sorted(needed))
        if n.meta.get(AH_ROLE) == "param"))
    return StageGraph(
        index=k, gm=stage_gm, received=tuple(n.name for n in received),
        sent=tuple(n.name if isinstance(n, fx.Node) else repr(n) for n in sent),
        local_placeholders=tuple(local), params=params,
        received_vals=tuple(n.meta.get(VAL) for n in received),
        sent_vals=tuple(n.meta.get(VAL) if isinstance(n, fx.Node) else n for n in sent),
        nodes=len(own))
