"""Pass: cut the rank-local graph into pipeline stages at the Plan's stage boundaries.

Runs last, on the graph the other passes produced for this rank (tp collectives and
sequence slices included), and leaves it unchanged: its product is
`ctx.notes["pipeline"]`, a `PipelineSplit` whose `StageGraph`s the runtime
(runtime/pipeline.py) wraps as `torch.distributed.pipelining` stages.

Which node runs where:
* every compute node belongs to a layer (search/layers.py); the Plan names the first
  layer of each stage after the first, so a layer's stage is the number of boundaries at
  or before it;
* nodes computed from the batch alone (position ids, attention masks, sizes: no
  parameter and no activation upstream, no random draw) move to the first stage that
  uses them, and every later stage that reads them computes them again, so they are
  never sent through the pipeline (nor are symbolic sizes, which cannot be sent);
* a node never runs before its inputs (stages only grow along the graph), a tuple
  output's `getitem`s stay with it, and the graph's outputs come from the last stage.

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
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ..errors import PlanError
from ..graph import AH_PARAM, AH_ROLE, VAL, op_name, output_node
from ..cost.compute import grad_nodes
from ..search.layers import segment
from .manager import PassContext, dump_dir

_BATCH_ROLES = ("input", "target")
#: Ops whose result depends on the random generator: never duplicated or moved.
_RANDOM = ("dropout", "bernoulli", "rand", "normal", "multinomial", "randperm")


@dataclass
class StageGraph:
    """One pipeline stage: its graph and what it exchanges.

    `gm` takes `(*received, *local)`: `received` are the values the previous stage sends
    (for the first stage: the model's inputs), `local` the full graph's placeholders
    (parameters, buffers, constants, inputs, targets) it reads, by their index in the full
    graph's placeholder list (`local_placeholders`). It returns the values it sends to the
    next stage (`sent`), or for the last stage the full graph's outputs.
    """

    index: int
    gm: fx.GraphModule
    received: tuple[str, ...]            # names of the values it receives, in order
    sent: tuple[str, ...]                # names of the values it sends (last: the outputs)
    local_placeholders: tuple[int, ...]  # full-graph placeholder indices it reads
    params: tuple[str, ...]              # canonical names of the parameters it reads
    received_vals: tuple[Any, ...] = ()  # fake values (symbolic shapes) of `received`
    sent_vals: tuple[Any, ...] = ()
    sent_requires_grad: tuple[bool, ...] = ()
    nodes: int = 0

    def describe(self) -> str:
        def shapes(vals):
            return ", ".join(f"{tuple(v.shape)}" for v in vals if isinstance(v, torch.Tensor))
        return (f"stage {self.index}: {self.nodes} ops, {len(self.params)} parameters; "
                f"receives [{shapes(self.received_vals)}], sends [{shapes(self.sent_vals)}]")


@dataclass
class PipelineSplit:
    stages: list[StageGraph]
    input_placeholders: tuple[int, ...]          # full-graph indices of model inputs
    batch_placeholders: tuple[int, ...]          # inputs then targets (keyword arguments)
    shared_params: dict[str, tuple[int, ...]] = field(default_factory=dict)  # name → stages


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
    batch_only = _batch_only(gm)
    for node in reversed(nodes):  # batch-only values move to their first reader
        if node in batch_only and not _random(node):
            readers = [last if u.op == "output" else stage[u] for u in node.users]
            stage[node] = min(readers, default=stage[node])
    for node in nodes:  # never before an input; tuple outputs keep their getitems
        inputs = [stage[a] for a in node.all_input_nodes if a in stage]
        if node.target is operator.getitem and node.args[0] in stage:
            stage[node] = stage[node.args[0]]
        elif inputs:
            stage[node] = max(stage[node], *inputs)
    return stage


def _batch_only(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes computed from the batch (and constants) alone: no parameter or activation
    upstream."""
    out: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if node.meta.get(AH_ROLE) in (*_BATCH_ROLES, "constant"):
                out.add(node)
        elif node.op == "call_function" and all(a in out for a in node.all_input_nodes):
            out.add(node)
    return out


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
    recompute = {n for n in _batch_only(gm) if n.op == "call_function" and not _random(n)}
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
        stage = _stage_graph(gm, k, own, received_nodes, sent_nodes, index_of, out,
                             k == last, recompute)
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
                 is_last: bool, recompute: set[fx.Node]) -> StageGraph:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in received:
        env[node] = graph.placeholder(node.name)
        env[node].meta.update(node.meta)
    local: list[int] = []
    members = set(own)
    # the full graph's placeholders this stage reads (directly or through recomputed sizes)
    needed: dict[int, fx.Node] = {}

    def collect(node: fx.Node) -> None:
        for arg in node.all_input_nodes:
            if arg in env or arg in members:
                continue
            if arg.op == "placeholder":
                needed[index_of[arg]] = arg
            elif arg in recompute:
                collect(arg)

    for node in [*own, out] if is_last else own:
        collect(node)
    for node in sent:
        if isinstance(node, fx.Node) and node not in env and node not in members \
                and node.op == "placeholder":
            needed[index_of[node]] = node
    for i in sorted(needed):
        node = needed[i]
        env[node] = graph.placeholder(node.name)
        env[node].meta.update(node.meta)
        local.append(i)

    def lookup(arg: fx.Node) -> fx.Node:
        if arg not in env:  # a batch-only value of an earlier stage: computed again here
            env[arg] = graph.node_copy(arg, lookup)
        return env[arg]

    for node in own:
        env[node] = graph.node_copy(node, lookup)
    graph.output(tuple(fx.node.map_arg(n, lookup) for n in sent))
    stage_gm = fx.GraphModule(gm, graph)
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
