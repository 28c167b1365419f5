"""Pass: batch normalization in training computes its statistics over the global batch.

Each data-parallel rank holds a slice of the batch; eager BatchNorm on the whole batch
normalizes with the statistics of all of it. This pass replaces every training-mode
`aten.batch_norm` by `autohybrid::sync_batch_norm` over the "dp" axis. With dp = 1 the
graph is left as it is.

Example::

    gm = sync_batch_norm(gm, ctx)   # ctx.plan.mesh.dp == 2
    assert any(n.target is torch.ops.autohybrid.sync_batch_norm.default for n in gm.graph.nodes)
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .. import ops  # noqa: F401  (registers autohybrid::sync_batch_norm)
from ..graph import AH_PASS, propagate_fake
from .manager import PassContext

_BATCH_NORM = torch.ops.aten.batch_norm.default


def training_batch_norms(gm: fx.GraphModule) -> list[fx.Node]:
    """The `aten.batch_norm` nodes that compute batch statistics (training=True)."""
    out = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is _BATCH_NORM:
            training = node.args[5] if len(node.args) > 5 else node.kwargs.get("training")
            if training:
                out.append(node)
    return out


def sync_batch_norm(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if ctx.dp == 1:
        return gm
    created = []
    for node in training_batch_norms(gm):
        created += replace_batch_norm(gm, node, "dp", "sync_batch_norm")
    propagate_fake(gm, created)
    return gm


def replace_batch_norm(gm: fx.GraphModule, node: fx.Node, axis: str,
                       pass_name: str) -> list[fx.Node]:
    """Replace the training-mode `aten.batch_norm` `node` by `autohybrid::sync_batch_norm`
    over mesh axis `axis` (and the running-stats update); the new nodes, in order, their
    fake values still to fill (`propagate_fake`). Also used by spatial_parallel."""
    x, weight, bias, running_mean, running_var, _training, momentum, eps = node.args[:8]
    graph = gm.graph
    with graph.inserting_before(node):  # new nodes go, in order, where the old one was
        sync = graph.call_function(torch.ops.autohybrid.sync_batch_norm.default,
                                   (x, weight, bias, float(eps), axis))
        out = graph.call_function(operator.getitem, (sync, 0))
        new_nodes = [sync, out]
        if running_mean is not None and running_var is not None:
            mean = graph.call_function(operator.getitem, (sync, 1))
            var = graph.call_function(operator.getitem, (sync, 3))
            update = graph.call_function(
                torch.ops.autohybrid.update_running_stats.default,
                (running_mean, running_var, mean, var, float(momentum)))
            new_nodes += [mean, var, update]
    for new in new_nodes:
        new.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        new.meta[AH_PASS] = pass_name
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    return new_nodes
