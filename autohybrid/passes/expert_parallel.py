"""Pass: expert parallelism — each MoE layer's experts split over the "ep" mesh axis.

With `Plan.mesh.ep` > 1, every `autohybrid::moe_experts` node (ops/moe.py; one per MoE
layer, from the zoo's MoE model, Hugging Face experts routed by capture_moe.py or a
hand-written loop folded by capture_moe_loop.py) gets axis "ep": its tokens go to their
experts' ranks and back by all-to-all, in `Plan.moe_chunks` chunks (one chunk's exchange
overlapping the next one's experts). Its two weight parameters become this rank's slice
of E/ep experts along dim 0 (`ShardSpec(axis="ep")` in `ctx.notes["param_shards"]`, as
tensor parallelism's shards: the runtime slices them, gathers them back for
full_state_dict and checkpoints, and sums their gradients over "edp", the ranks holding
the same experts, instead of over dp).

The ep axis is made of dp ranks (plan.expert_groups), so the batch is split over it as
data parallelism splits it; the op's output rows are its own tokens', so what follows is
unchanged. ZeRO-1/2 cut the expert slices' shards over "edp" (runtime/zero.py). Refused,
naming the node, with a reason: a layer whose experts do not divide by ep, expert weights
that are not parameters read by the op alone (a view, a weight shared with another op),
and ZeRO-3 (passes/zero.py gathers every parameter over dp).

A hand-written loop over separate expert modules, folded at capture into the op over
their parameters stacked in the graph (capture_moe_loop.py): every rank holds every
expert's parameters, so the op reads this rank's slice of the stacks (`aten.slice`), no
parameter is sharded, and the dp reduction of the (replicated) parameters sums each
expert's gradient from the ranks that computed it (the others' are zeros); ZeRO-3 gathers
them like any parameter. Tensor parallelism leaves such experts whole.

Runs before tensor_parallel: under sequence parallelism the expert slices are replicated
over tp, and tp's rules for replicated parameters (sequence parallelism sums their
gradients over tp) then apply to the slices as to any replicated weight.

Expert tensor parallelism: with tp > 1 and no sequence parallelism (the tp ranks then
hold the same tokens; `ops.moe.tensor_parallel_experts` decides, for the pricing too),
each tp rank holds slice j of every (under ep: every local) expert's intermediate size —
the same rows of the gate and the up projections (`ShardSpec(dim=1, chunks=2,
axis="tp")`, under ep the `inner` split of the ep slice) and those columns of `down`
(dim 2) — and the op gets `tp_axis="tp"`: it all-reduces its output, and in backward the
gradients of its tokens and router weights, over tp. Without it each tp rank would
compute every expert whole, the same work tp times. Refused as for ep (naming the node)
where the weights are not parameters the op alone reads.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..errors import PlanError
from ..capture_moe_loop import stacked_experts
from ..graph import (AH_PARAM, VAL, fake_mode, is_param, module_path, new_node,
                     schema_args)
from ..ops.moe import tensor_parallel_experts  # (and registers autohybrid::moe_experts)
from ..program import ShardSpec
from .manager import PassContext

AXIS = "ep"
TP_AXIS = "tp"
#: the op's arguments before `axis` and `chunks`, in its schema's order
_ARGS = ("x", "top_k_index", "top_k_weights", "gate_up", "down", "num_experts", "act")
MOE_EXPERTS = torch.ops.autohybrid.moe_experts.default


def moe_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The MoE layers' experts nodes of `gm`, in graph order."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is MOE_EXPERTS]


def expert_parallel(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    mesh = ctx.plan.mesh
    nodes = moe_nodes(gm)
    if mesh.ep > 1 and not nodes:
        raise PlanError(f"mesh.ep={mesh.ep}: the graph has no MoE layer "
                        "(autohybrid::moe_experts) whose experts expert parallelism could "
                        "split; pin ep=1")
    stacked = [n for n in nodes if stacked_experts(n)]
    tp_split = not stacked and tensor_parallel_experts(mesh.tp, mesh.sp, inter_sizes(nodes))
    if mesh.ep == 1 and not (tp_split and nodes):
        return gm
    if mesh.ep > 1 and ctx.plan.zero == 3 and len(stacked) < len(nodes):
        raise PlanError(f"mesh.ep={mesh.ep} with ZeRO-3: its per-layer gathers of the expert "
                        "slices would run over the ranks holding the same experts, which "
                        "passes/zero.py does not do; pin zero ≤ 2 with expert parallelism")
    ep, index = mesh.ep, ctx.coords[1] % mesh.ep
    mode = fake_mode(gm)
    specs: dict[str, ShardSpec] = {}
    for node in nodes:
        kw = schema_args(node)
        experts = int(kw["num_experts"])
        where = f"MoE layer {module_path(node) or node.name!r} (node {node.name!r})"
        what = (f"expert parallelism (ep={ep})" if ep > 1 else
                f"tensor parallelism of the experts (tp={mesh.tp})")
        pin = "pin ep=1" if ep > 1 else "pin sp=True (each tp rank's own tokens) or tp=1"
        if experts % ep:
            raise PlanError(f"expert parallelism: {where} has {experts} experts, which do "
                            f"not split over ep={ep} ranks; choose an ep dividing {experts}")
        if node in stacked:   # separate parameters: this rank computes its slice of them
            _slice_stacks(node, kw, experts // ep * index, experts // ep,
                          ctx.plan.moe_chunks, mode)
            continue
        for name in ("gate_up", "down"):
            weight = kw[name]
            if not is_param(weight):
                raise PlanError(f"{what}: the {name} weights of {where} are not a parameter "
                                f"the op reads directly; {pin}")
            users = [u for u in weight.users if u is not node]
            if users:
                raise PlanError(f"{what}: the {name} weights of {where} are also read by "
                                f"{users[0].name!r}; {pin}")
            key = weight.meta.get(AH_PARAM, weight.name)
            full = weight.meta[VAL]
            inner = _tp_spec(name, full.shape, mesh.tp, ctx.coords[2]) if tp_split else None
            spec = (ShardSpec(0, experts, experts, 1, ep, index, axis=AXIS, inner=inner)
                    if ep > 1 else inner)
            if specs.setdefault(key, spec) is spec:
                with mode:
                    weight.meta[VAL] = torch.empty(spec.local_shape(full.shape),
                                                   dtype=full.dtype, device=full.device)
        node.args = (*(kw[name] for name in _ARGS), AXIS if ep > 1 else "",
                     ctx.plan.moe_chunks if ep > 1 else 1, TP_AXIS if tp_split else "")
        node.kwargs = {}
    ctx.notes["param_shards"] = {**ctx.notes.get("param_shards", {}), **specs}
    gm.recompile()
    return gm


def _slice_stacks(node: fx.Node, kw: dict, start: int, count: int, chunks: int,
                  mode) -> None:
    """Under ep, a folded loop's op (its weights stacked in the graph from every expert's
    parameters, which every rank holds) reads experts [start, start + count) of the
    stacks; autograd gives the other experts' parameters zero gradients on this rank, so
    the dp reduction of the replicated parameters sums each expert's gradient from the
    ranks that computed it (its ep group's tokens on each)."""
    graph = node.graph
    with graph.inserting_before(node):
        local = [new_node(graph, torch.ops.aten.slice.Tensor,
                          (kw[name], 0, start, start + count), None, pass_name="expert_parallel",
                          mode=mode, like=node) for name in ("gate_up", "down")]
    node.args = (kw["x"], kw["top_k_index"], kw["top_k_weights"], *local,
                 kw["num_experts"], kw["act"], AXIS, chunks, "")
    node.kwargs = {}


def inter_sizes(nodes: list[fx.Node]) -> list[int]:
    """Each MoE layer's intermediate size (its `down` weights' last dimension)."""
    return [int(schema_args(n)["down"].meta[VAL].shape[-1]) for n in nodes]


def _tp_spec(name: str, shape, tp: int, index: int) -> ShardSpec:
    """This tp rank's slice of every expert's intermediate size: the same rows of the gate
    and of the up projection (`gate_up` (E, 2I, H): two blocks along dim 1), the same
    columns of `down` (E, H, I)."""
    if name == "gate_up":
        return ShardSpec(1, shape[1], shape[1], 2, tp, index, axis=TP_AXIS)
    return ShardSpec(2, shape[2], shape[2], 1, tp, index, axis=TP_AXIS)
