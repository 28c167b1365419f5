"""Pass: activation recomputation (`Plan.recompute`), as the cost model prices it.

Why: a training step keeps, until backward, every tensor an op saves for its gradient;
for a transformer that is tens of bytes per token per hidden unit per block. Recomputing
part of the forward during backward trades that memory for compute, which is what lets
big models or long sequences fit (search/pricing.py's `layer_times`).

What, for `Plan.recompute`:
* "none": the graph is unchanged;
* "full": every layer that is a ModuleList entry (a transformer block: search/layers.py
  names it `model.blocks.3`, `model.layers.1`) keeps only its inputs; its forward runs
  again in backward. Pricing: the layer's time grows by one forward (its forward tp
  collectives twice), its kept bytes become `recompute_saved` (its input);
* "selective": only the attention core is recomputed (Korthikanti et al.): each
  `aten.scaled_dot_product_attention` node (under tp: autohybrid's `sharded_sdpa`) keeps
  its inputs q, k, v and not its outputs or internals (the softmax statistics, the
  attention weights and dropout mask of the math backend). Pricing: `attention_saved` is
  no longer kept and the core's FLOPs run again.

How: each region (a contiguous run of a layer's compute nodes, or one sdpa node) is moved
into a sub-GraphModule (its inputs: the values it reads from outside, parameter
placeholders included; its outputs: the values read after it), registered on the parent
as `ah_recompute_<k>`, and replaced by one call of `checkpoint_region(sub, *inputs)` and
a `getitem` per output. `checkpoint_region` is a higher-order op whose eager
implementation is `torch.utils.checkpoint.checkpoint(sub, *inputs, use_reentrant=False)`
with `preserve_rng_state=True`, so a dropout inside a region redraws the mask it drew in
the forward (gradients stay exactly eager's). Under tp/sp a region's collectives run
again in backward: every tp rank recomputes the same regions in the same order, so they
stay matched (likewise sync_batch_norm's dp all-reduces). In-place updates of values from
outside a region (BatchNorm's running statistics) must run once: they move after the
checkpointed call, or, where an op computes and updates at once (eager `batch_norm` in
training mode), the region is not checkpointed (`checkpoint_regions`).

Runs last, after pipeline_split: it rewrites the rank's graph (what runs when pp == 1)
and, when `ctx.notes["pipeline"]` exists, each stage's `stage.gm` (what runs when pp > 1),
since the stages were cut from the graph before. Forward-only graphs are left alone
(nothing is kept for a backward). Only the parent graph keeps the ATen format that
`graph.verify` checks; the regions' own nodes (with their meta) are in the submodules.

Example::

    gm = recompute(gm, ctx)    # ctx.plan.recompute == "full"
    [n.args[0].target for n in gm.graph.nodes if n.target is checkpoint_region]
    # ['ah_recompute_0', 'ah_recompute_1', ...]: one submodule per block
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch._ops import HigherOrderOperator

from ..graph import AH_PASS, VAL, is_param, op_name
from ..search.layers import is_block, segment
from .manager import PassContext

PASS = "recompute"
SDPA_OPS = ("aten.scaled_dot_product_attention.default", "autohybrid.sharded_sdpa.default")


class _CheckpointRegion(HigherOrderOperator):
    """`checkpoint_region(sub, *inputs)`: run the GraphModule `sub` on `inputs` keeping
    only the inputs for backward, recomputing `sub` when backward needs its internals."""

    def __init__(self) -> None:
        super().__init__("autohybrid_checkpoint_region")

    def __call__(self, sub: torch.nn.Module, *inputs: Any) -> Any:
        return torch.utils.checkpoint.checkpoint(sub, *inputs, use_reentrant=False,
                                                 preserve_rng_state=True)


checkpoint_region = _CheckpointRegion()


def recompute(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    mode = ctx.plan.recompute
    if mode == "none" or ctx.graph_kind != "train":
        return gm
    checkpoint_regions(gm, mode)
    split = ctx.notes.get("pipeline")
    if split is not None:
        for stage in split.stages:
            checkpoint_regions(stage.gm, mode)
            stage.gm.recompile()
    return gm


def regions(gm: fx.GraphModule, mode: str) -> list[list[fx.Node]]:
    """The node runs `mode` recomputes, in graph order."""
    if mode == "selective":
        return [[n] for n in gm.graph.nodes
                if n.op == "call_function" and op_name(n) in SDPA_OPS]
    if mode != "full":
        raise ValueError(f"recompute mode {mode!r} (expected 'none', 'selective' or 'full')")
    out = []
    for layer in segment(gm):
        if is_block(layer.name) and _reads_param(layer.nodes):
            out.append(list(layer.nodes))
    return out


def _reads_param(nodes) -> bool:
    """A region worth checkpointing computes on parameters (not a batch-only mask that a
    pipeline stage recomputes anyway)."""
    return any(is_param(a) for n in nodes for a in n.all_input_nodes)


def checkpoint_regions(gm: fx.GraphModule, mode: str) -> int:
    """Replace every region of `mode` in `gm` by a checkpointed submodule; their count.

    In-place updates of values from outside a region (BatchNorm's running statistics and
    batch counter) must run once, not again in backward: an update nothing in the region
    reads afterwards (`add_` on the counter, autohybrid's `update_running_stats`) moves
    after the checkpointed call; a region with another such write (eager `batch_norm` in
    training mode computes and updates in one op) is not checkpointed and keeps its
    activations."""
    found = []
    for nodes in regions(gm, mode):
        split = _split_updates(nodes)
        if split is not None:
            found.append(split)
    taken = {name for name, _ in gm.named_children()}
    k = 0
    for nodes, moved in found:
        while f"ah_recompute_{k}" in taken:
            k += 1
        name = f"ah_recompute_{k}"
        taken.add(name)
        _replace(gm, nodes, moved, name)
    gm.graph.lint()
    gm.recompile()
    return len(found)


def _written(node: fx.Node) -> list[fx.Node]:
    """The argument nodes `node` writes in place."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return []
    if op_name(node) == "aten.batch_norm.default" and len(node.args) > 5 and node.args[5]:
        return [a for a in node.args[3:5] if isinstance(a, fx.Node)]  # running statistics
    out = []
    for i, arg in enumerate(target._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            values = value if isinstance(value, (list, tuple)) else [value]
            out.extend(v for v in values if isinstance(v, fx.Node))
    return out


def _split_updates(nodes: list[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]] | None:
    """(the region's nodes, its in-place updates of outside values that move after it),
    or None when the region cannot be recomputed (see `checkpoint_regions`)."""
    members = set(nodes)
    moved: list[fx.Node] = []
    written: set[fx.Node] = set()
    for node in nodes:
        if any(a in written for a in node.all_input_nodes):
            return None                      # reads a value updated earlier in the region
        outside = [a for a in _written(node) if a not in members]
        if outside:
            if node.users:
                return None                  # computes and updates at once
            moved.append(node)
            written.update(outside)
    return [n for n in nodes if n not in moved], moved


def _replace(gm: fx.GraphModule, nodes: list[fx.Node], moved: list[fx.Node],
             name: str) -> None:
    members = set(nodes)
    inputs: dict[fx.Node, None] = {}
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg not in members:
                inputs.setdefault(arg, None)
    outputs = [n for n in nodes if any(u not in members for u in n.users)]
    # the submodule: placeholders for the inputs, the region's nodes, its outputs
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for arg in inputs:
        env[arg] = graph.placeholder(arg.name)
        env[arg].meta.update(arg.meta)
    for node in nodes:
        env[node] = graph.node_copy(node, lambda a: env[a])
    graph.output(tuple(env[n] for n in outputs))
    sub = fx.GraphModule(torch.nn.Module(), graph, class_name="RecomputedRegion")
    gm.add_submodule(name, sub)
    # the parent: get_attr, one checkpointed call, a getitem per output
    last = nodes[-1]
    with gm.graph.inserting_after(last):
        attr = gm.graph.get_attr(name)
    with gm.graph.inserting_after(attr):
        call = gm.graph.call_function(checkpoint_region, (attr, *inputs))
    call.meta[VAL] = tuple(n.meta.get(VAL) for n in outputs)
    for key in ("nn_module_stack", "stack_trace"):
        if key in nodes[0].meta:
            call.meta[key] = nodes[0].meta[key]
    attr.meta[AH_PASS] = call.meta[AH_PASS] = PASS
    getters = []
    anchor = call
    for i, node in enumerate(outputs):
        with gm.graph.inserting_after(anchor):
            get = gm.graph.call_function(operator.getitem, (call, i))
        get.meta.update({k: v for k, v in node.meta.items() if k != AH_PASS})
        get.meta[AH_PASS] = PASS
        getters.append(get)
        anchor = get
    for node in moved:  # the in-place updates run once, after the region
        anchor.append(node)
        anchor = node
    for node, get in zip(outputs, getters):
        node.replace_all_uses_with(get, delete_user_cb=lambda user: user not in members)
    for node in reversed(nodes):
        gm.graph.erase_node(node)
