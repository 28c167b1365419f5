"""Pass: collective matmul — chunk sequence parallelism's collectives with their linears.

Why: under sequence parallelism each column-parallel linear waits for `sp_gather`, the
whole sequence from every tp rank, and each row-parallel linear's output waits for its
`sp_reduce_scatter`; the link and the matmul units take turns. ops/collective_matmul.py
pipelines them chunk by chunk along the sequence, forward and backward. This pass puts
those ops in the graph for the layers the Plan lists (`plan.collective_matmul_layers`:
the layer, by search/layers.py name, and its chunk count, chosen per layer by the cost
model or forced by `Constraints(collective_matmul=True)`):

* `sp_gather(x, d)` whose every user is `aten.linear(gathered, w, b?)` becomes one
  `cm_gather_linear(x, [w…], [b…], has_bias, d, "tp", chunks)`; each linear reads its
  output j (q, k and v, or gate and up, share the one chunked gather);
* `aten.linear(x, w)` (no bias: a row-parallel linear's bias is added after the sum)
  whose only user is `sp_reduce_scatter(y, d)` becomes `cm_linear_reduce_scatter(x, w,
  d, "tp", chunks)`.

A pattern is left alone when its sequence dim is the feature dim, when its values do not
share one dtype (autocast's casts live inside the linear: mixed precision keeps the
unchunked ops), or when a weight of a later linear is only computed after the first
linear (the chunked op must come before every reader). Nothing else changes, and the
rewrite depends on the Plan and the graph only, so every rank makes the same one.

Where: after `zero` (weights may be ZeRO-3 gathers) and before `pipeline_split` (each
chunked op lands in its layer's stage) and `recompute` (a checkpointed block recomputes
the chunked op like any other).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..graph import VAL, NodeOrder, fake_mode, new_node, op_name
from ..ops.collective_matmul import cm_gather_linear_op, cm_linear_reduce_scatter_op
from ..search.layers import segment
from .manager import PassContext

PASS = "collective_matmul"
AXIS = "tp"
_SP_GATHER = torch.ops.autohybrid.sp_gather.default
_SP_REDUCE_SCATTER = torch.ops.autohybrid.sp_reduce_scatter.default
_LINEAR = "aten.linear.default"


def collective_matmul(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    plan = ctx.plan
    chunks = {entry.layer: entry.chunks for entry in plan.collective_matmul_layers}
    if not plan.collective_matmul or not chunks or plan.mesh.tp == 1 or not plan.mesh.sp:
        return gm
    layer_of = {node: layer.name for layer in segment(gm) for node in layer.nodes}
    mode = fake_mode(gm)
    positions = NodeOrder(gm)
    rewritten = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node not in layer_of:  # (or erased meanwhile)
            continue
        if node.target is _SP_GATHER:
            rewritten += _gather_linears(gm, node, chunks, layer_of, mode, positions)
        elif op_name(node) == _LINEAR:
            rewritten += _linear_scatter(gm, node, chunks, layer_of, mode)
    ctx.notes["collective_matmuls"] = rewritten
    return gm


def _dtypes_agree(*nodes: fx.Node | None) -> bool:
    dtypes = {n.meta[VAL].dtype for n in nodes if n is not None}
    return len(dtypes) == 1


def _linear_args(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None]:
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    return node.args[0], node.args[1], bias


def _gather_linears(gm: fx.GraphModule, gather: fx.Node, chunks: dict[str, int],
                    layer_of: dict[fx.Node, str], mode, positions: NodeOrder) -> int:
    x, dim = gather.args[0], gather.args[1]
    users = list(gather.users)
    if not users or any(op_name(u) != _LINEAR or _linear_args(u)[0] is not gather
                        or gather in _linear_args(u)[1:] for u in users):
        return 0
    k = chunks.get(layer_of.get(users[0], ""))
    if not k or dim % x.meta[VAL].dim() == x.meta[VAL].dim() - 1:
        return 0
    order = positions.of([*users, *(a for u in users for a in _linear_args(u)[1:]
                                    if isinstance(a, fx.Node))])
    users.sort(key=order)
    parts = [_linear_args(u) for u in users]
    inputs = [a for _, w, b in parts for a in (w, b) if a is not None]
    if any(order(a) > order(users[0]) for a in inputs) or \
            not _dtypes_agree(x, *inputs, *users):
        return 0
    with gm.graph.inserting_before(users[0]):
        fused = new_node(gm.graph, cm_gather_linear_op,
                         (x, [w for _, w, _ in parts], [b for _, _, b in parts if b is not None],
                          [b is not None for _, _, b in parts], dim, AXIS, k),
                         None, pass_name=PASS, mode=mode, like=users[0])
        for j, user in enumerate(users):
            out = new_node(gm.graph, operator.getitem, (fused, j), None, pass_name=PASS,
                           mode=mode, like=user)
            user.replace_all_uses_with(out)
    for user in users:
        gm.graph.erase_node(user)
        del layer_of[user]
    gm.graph.erase_node(gather)
    return 1


def _linear_scatter(gm: fx.GraphModule, linear: fx.Node, chunks: dict[str, int],
                    layer_of: dict[fx.Node, str], mode) -> int:
    x, weight, bias = _linear_args(linear)
    users = list(linear.users)
    if bias is not None or len(users) != 1 or users[0].target is not _SP_REDUCE_SCATTER:
        return 0
    scatter = users[0]
    dim = scatter.args[1]
    k = chunks.get(layer_of.get(linear, ""))
    rank = linear.meta[VAL].dim()
    if not k or dim % rank == rank - 1 or not _dtypes_agree(x, weight, linear):
        return 0
    with gm.graph.inserting_before(scatter):
        fused = new_node(gm.graph, cm_linear_reduce_scatter_op, (x, weight, dim, AXIS, k),
                         None, pass_name=PASS, mode=mode, like=linear)
    scatter.replace_all_uses_with(fused)
    gm.graph.erase_node(scatter)
    gm.graph.erase_node(linear)
    return 1
