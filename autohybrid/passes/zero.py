"""Pass: ZeRO-3 — parameters are flat dp shards, gathered by each layer before use.

Why: with `Plan.zero == 3` a rank keeps 1/dp of every parameter between uses
(runtime/zero.py holds the shards). The graph's parameter placeholders become those
1-D shards (`ceil(n/dp)` elements of the tp-local parameter, ops/zero.py's layout), and
each layer (search/layers.py) starts with one gather of the parameters it reads (a
`zero_gather_start` that issues the all-gather and a `zero_gather_wait` that gives the
whole parameters, back to back; passes/overlap.py moves the start earlier): one
all-gather per layer in forward and one reduce-scatter of their gradients in backward,
FSDP's granularity. A layer whose parameters are smaller than the dp link moves in one
latency (`Plan.gather_min_mb`: a norm, a position table) shares its neighbour's gather
instead of paying a collective's latency for itself. A parameter read by two layers
(tied embedding and output weights) is gathered by each. The whole parameters die after
their layer's last use; those autograd saves for backward are released by the runtime's
saved-tensor hooks (ops/zero.py `release_gathered`) and gathered again in backward.

Where: after tensor/sequence parallelism (the shards are of tp-local parameters) and
before pipeline_split (a gather is in its layer, so in the stage that reads it) and
recompute (a gather inside a checkpointed block runs again when the block does, so
nothing of the block is kept). ZeRO 1 and 2 leave the graph unchanged (their shards are
the optimizer's and the reducer's business).

Example::

    gm = zero(gm, ctx)     # ctx.plan.zero == 3, dp == 2
    [n for n in gm.graph.nodes if n.target is zero_gather_wait_op]   # one per layer
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..graph import VAL, fake_mode, is_param, new_node
from ..ops.zero import chunk, zero_gather_start_op, zero_gather_wait_op
from ..search.layers import gather_groups, segment
from .manager import PassContext

PASS = "zero"
AXIS = "dp"


def zero(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    plan = ctx.plan
    if plan.zero < 3 or plan.mesh.dp == 1:
        return gm
    mode = fake_mode(gm)
    whole: dict[fx.Node, torch.Tensor] = {}
    for node in gm.graph.nodes:
        if is_param(node):
            full = node.meta[VAL]
            whole[node] = full
            with mode:
                node.meta[VAL] = torch.empty(chunk(full.numel(), plan.mesh.dp),
                                             dtype=full.dtype, device=full.device)
    gathers = 0
    for readers, params in _gather_groups(gm, whole, plan):
        shapes = [int(d) for p in params for d in whole[p].shape]
        ndims = [whole[p].dim() for p in params]
        first = readers[0]
        with gm.graph.inserting_before(first):
            start = new_node(gm.graph, zero_gather_start_op, (params, plan.mesh.dp, AXIS),
                             None, pass_name=PASS, mode=mode, like=first)
            gather = new_node(gm.graph, zero_gather_wait_op,
                              (start, params, shapes, ndims, AXIS, plan.grad_reduce_dtype),
                              None, pass_name=PASS, mode=mode, like=first)
            items = [new_node(gm.graph, operator.getitem, (gather, i), None, pass_name=PASS,
                              mode=mode, like=first) for i in range(len(params))]
        for reader in readers:
            for param, item in zip(params, items):
                reader.replace_input_with(param, item)
        gathers += 1
    ctx.notes["zero_gathers"] = gathers
    gm.recompile()
    return gm


def _gather_groups(gm: fx.GraphModule, whole: dict[fx.Node, torch.Tensor],
                   plan) -> list[tuple[list[fx.Node], list[fx.Node]]]:
    """(nodes reading parameters, the parameters) of each gather, in execution order:
    `search.layers.gather_groups` of the layers that read parameters, by their bytes
    against `plan.gather_min_mb`; never across a pipeline stage boundary (a gather is in
    its first layer's stage), nor under full recomputation (a gather inside one
    checkpointed block must not feed another)."""
    limit = plan.gather_min_mb * 2**20 if plan.recompute != "full" else 0.0
    boundaries = set(plan.stage_boundaries)
    layers, starts = [], []         # (readers, parameters); a stage starts since the last
    crossed = False
    for layer in segment(gm):
        crossed = crossed or layer.name in boundaries
        readers = [n for n in layer.nodes if any(a in whole for a in n.all_input_nodes)]
        if readers:
            params = dict.fromkeys(a for n in readers for a in n.all_input_nodes if a in whole)
            layers.append((readers, list(params)))
            starts.append(crossed)
            crossed = False
    sizes = [sum(whole[p].numel() * whole[p].element_size() for p in params)
             for _, params in layers]
    out = []
    for group in gather_groups(sizes, starts, limit):
        readers = [r for i in group for r in layers[i][0]]
        params = list(dict.fromkeys(p for i in group for p in layers[i][1]))
        out.append((readers, params))
    return out
