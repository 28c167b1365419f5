"""Pass: ZeRO-3 — parameters are flat dp shards, gathered by each layer before use.

Why: with `Plan.zero == 3` a rank keeps 1/dp of every parameter between uses
(runtime/zero.py holds the shards). The graph's parameter placeholders become those
1-D shards (`ceil(n/dp)` elements of the tp-local parameter, ops/zero.py's layout), and
each layer (search/layers.py) starts with one `zero_gather` of the parameters it reads:
one all-gather per layer in forward and one reduce-scatter of their gradients in
backward, FSDP's granularity. A parameter read by two layers (tied embedding and output
weights) is gathered by each. The whole parameters die after their layer's last use;
those autograd saves for backward are released by the runtime's saved-tensor hooks
(ops/zero.py `release_gathered`) and gathered again in backward.

Where: after tensor/sequence parallelism (the shards are of tp-local parameters) and
before pipeline_split (a gather is in its layer, so in the stage that reads it) and
recompute (a gather inside a checkpointed block runs again when the block does, so
nothing of the block is kept). ZeRO 1 and 2 leave the graph unchanged (their shards are
the optimizer's and the reducer's business).

Example::

    gm = zero(gm, ctx)     # ctx.plan.zero == 3, dp == 2
    [n for n in gm.graph.nodes if n.target is zero_gather_op]   # one per layer
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..graph import AH_ROLE, VAL, fake_mode, new_node
from ..ops.zero import chunk, zero_gather_op
from ..search.layers import segment
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
        if node.op == "placeholder" and node.meta.get(AH_ROLE) == "param":
            full = node.meta[VAL]
            whole[node] = full
            with mode:
                node.meta[VAL] = torch.empty(chunk(full.numel(), plan.mesh.dp),
                                             dtype=full.dtype, device=full.device)
    gathers = 0
    for layer in segment(gm):
        readers = [n for n in layer.nodes if any(a in whole for a in n.all_input_nodes)]
        if not readers:
            continue
        params = list(dict.fromkeys(a for n in readers for a in n.all_input_nodes if a in whole))
        shapes = [int(d) for p in params for d in whole[p].shape]
        ndims = [whole[p].dim() for p in params]
        first = readers[0]
        with gm.graph.inserting_before(first):
            gather = new_node(gm.graph, zero_gather_op, (params, shapes, ndims, AXIS), None,
                              pass_name=PASS, mode=mode, like=first)
            items = [new_node(gm.graph, operator.getitem, (gather, i), None, pass_name=PASS,
                              mode=mode, like=first) for i in range(len(params))]
        for reader in readers:
            for param, item in zip(params, items):
                reader.replace_input_with(param, item)
        gathers += 1
    ctx.notes["zero_gathers"] = gathers
    gm.recompile()
    return gm
