"""Whole-batch statistics in a loss term: each shard's partial sums added over dp.

Hugging Face's MoE models (Mixtral, Qwen2-MoE, ...) with `output_router_logits` train on

    loss = cross_entropy(logits, labels) + coef · balance(router logits of the whole batch)

where the balance term divides the tokens each expert received, counted over every token
of the batch, by the batch's token count: a product of two batch-wide means, not a sum of
per-sample terms, so data-parallel shards cannot each compute a part of it.
`globalize` makes it exact: every value of the term's dataflow that is a sum over the
shard's samples (`passes/batch_flow.py` proves these `partial`: a `sum` over the batch
dim, `histc` with fixed bins, a batch-size number such as the token count used as a
value) is followed by `autohybrid::batch_sum` over dp, which adds the shards' partial
sums; everything after it is then the whole batch's value on every rank. Gradients: the
op's backward adds the ranks' gradients the same way (ops/batch_sum.py), and
global_loss.py back-propagates the term on each rank weighted by that rank's share of
the loss's denominator, so the data-parallel gradient sum gives eager's gradient.

The partial sums of all microbatches must be added before any backward: with several
microbatches the runtime computes them first, in a forward without autograd
(ops/batch_sum.WholeBatch, runtime/whole_batch.py), and the term's weight in each
shard's numerator is `autohybrid::term_weight(denominator)` (global_loss.py).

Example::

    main, term = loss_terms(loss)              # cross-entropy, 0.02 · balance
    created = globalize(gm, term, flows, "dp")  # batch_sum after each partial sum
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .. import ops  # noqa: F401  (registers autohybrid::batch_sum)
from ..graph import AH_PASS, VAL, draws_random, op_name, schema_args
from .batch_flow import BSIZE, PARTIAL, BatchFlow, Flow

_BATCH_SUM = torch.ops.autohybrid.batch_sum.default
_SCALAR_TENSOR = torch.ops.aten.scalar_tensor.default
_ADDS = {"aten.add.Tensor", "aten.add_.Tensor"}


def loss_terms(loss: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(a, b) when `loss` is the tensor sum a + b (`add`, or `add_` as `loss += ...`,
    alpha 1), else None."""
    if loss.op != "call_function" or op_name(loss) not in _ADDS:
        return None
    kw = schema_args(loss)
    a, b = kw.get("self"), kw.get("other")
    if kw.get("alpha", 1) != 1 or not isinstance(a, fx.Node) or not isinstance(b, fx.Node):
        return None
    if not all(isinstance(x.meta.get(VAL), torch.Tensor) for x in (a, b)):
        return None
    return a, b


def ancestors(node: fx.Node) -> set[fx.Node]:
    """`node` and every node its value is computed from."""
    seen, todo = {node}, [node]
    while todo:
        for a in todo.pop().all_input_nodes:
            if a not in seen:
                seen.add(a)
                todo.append(a)
    return seen


def globalize(gm: fx.GraphModule, term: fx.Node, flows: BatchFlow, axis: str
              ) -> list[fx.Node]:
    """Insert `autohybrid::batch_sum(., axis, key)` (key: its node's name) after each
    partial sum `term` is computed from, and for each batch-size number an element-wise
    op of `term`'s dataflow uses as a value; return the new nodes (fake values still to
    fill). Uses outside the term's dataflow keep the shard's values."""
    graph = gm.graph
    cone = ancestors(term)
    created: list[fx.Node] = []
    for node in _statistics(graph, cone, flows):
        f = flows.flows.get(node)
        if isinstance(f, Flow) and f.kind == PARTIAL:
            users = [u for u in node.users if u in cone]
            with graph.inserting_after(node):
                total = graph.call_function(_BATCH_SUM, (node, axis))
            total.args = (node, axis, total.name)   # its key (ops/batch_sum.WholeBatch)
            for user in users:
                user.replace_input_with(node, total)
            created.append(total)
        elif _elementwise(node):
            for a in _counts_as_tensors(node, flows):
                with graph.inserting_before(node):
                    count = graph.call_function(_SCALAR_TENSOR, (a,),
                                                {"dtype": node.meta[VAL].dtype})
                    total = graph.call_function(_BATCH_SUM, (count, axis))
                total.args = (count, axis, total.name)
                node.replace_input_with(a, total)
                created += [count, total]
    for node in created:
        node.meta[AH_PASS] = "global_loss"
    return created


def reads_statistics(gm: fx.GraphModule, term: fx.Node, flows: BatchFlow) -> bool:
    """Whether `globalize` would add anything: `term` is computed from partial sums over
    the shard's samples or from its batch size (the planner prices the forward that adds
    them up under microbatches: runtime/whole_batch.py)."""
    return next(_statistics(gm.graph, ancestors(term), flows), None) is not None


def _statistics(graph: fx.Graph, cone: set[fx.Node], flows: BatchFlow):
    """The nodes of `cone` `globalize` rewrites: partial sums, and element-wise ops
    reading batch-size numbers as tensors; in graph order."""
    for node in [n for n in graph.nodes if n in cone and n.op == "call_function"]:
        f = flows.flows.get(node)
        if isinstance(f, Flow) and f.kind == PARTIAL or \
                _elementwise(node) and _counts_as_tensors(node, flows):
            yield node


def _elementwise(node: fx.Node) -> bool:
    """A floating-point element-wise tensor op (where a Python number operand and a 0-dim
    tensor of the result's dtype compute alike)."""
    target, val = node.target, node.meta.get(VAL)
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags \
        and isinstance(val, torch.Tensor) and val.is_floating_point()


def _counts_as_tensors(node: fx.Node, flows: BatchFlow) -> list[fx.Node]:
    """The batch-size numbers `node` reads where its schema takes a Tensor (`x / n` is
    `div.Tensor(x, n)`); a number where a Scalar is expected stays, and is refused."""
    schema = node.target._schema
    out = []
    for arg, value in zip(schema.arguments, node.args):
        if isinstance(value, fx.Node) and str(arg.type) == "Tensor" and \
                not isinstance(value.meta.get(VAL), torch.Tensor) and \
                flows.flow(value).kind == BSIZE and value not in out:
            out.append(value)
    return out


def whole_batch_problem(gm: fx.GraphModule, plan) -> str | None:
    """Why the whole-batch statistics of `gm` (its `batch_sum` nodes) cannot be added up
    over `plan`'s microbatches before the step, or None. The runtime computes them in a
    forward without autograd and then runs the step's forwards with the totals
    (runtime/whole_batch.py): the second forward must draw the random numbers the first
    drew. The generator is restored between them, which gives the same draws when each
    rank runs its forwards in the same order both times: one pipeline stage per rank.
    (A statistic computed from another's total never gets here: batch_flow.py does not
    prove it a partial sum.)"""
    stages_per_rank = plan.virtual_stages
    if plan.mesh.pp > 1 and stages_per_rank > 1:
        drawn = next((n for n in gm.graph.nodes if draws_random(n)), None)
        if drawn is not None:
            return (f"node {drawn.name!r} ({op_name(drawn)}) draws random numbers, and with "
                    f"{stages_per_rank} pipeline stages per rank the schedule runs a rank's "
                    "forwards in another order than that first forward, so they would draw "
                    "other numbers. Use one stage per rank, or one microbatch")
    return None
