"""Pass: expert parallelism — each MoE layer's experts split over the "ep" mesh axis.

With `Plan.mesh.ep` > 1, every `autohybrid::moe_experts` node (ops/moe.py; one per MoE
layer, from the zoo's MoE model or Hugging Face experts routed by capture_moe.py) gets
axis "ep": its tokens go to their experts' ranks and back by all-to-all, in
`Plan.moe_chunks` chunks (one chunk's exchange overlapping the next one's experts). Its two weight
parameters become this rank's slice of E/ep experts along dim 0 (`ShardSpec(axis="ep")`
in `ctx.notes["param_shards"]`, as tensor parallelism's shards: the runtime slices them,
gathers them back for full_state_dict and checkpoints, and sums their gradients over
"edp", the ranks holding the same experts, instead of over dp).

The ep axis is made of dp ranks (plan.expert_groups), so the batch is split over it as
data parallelism splits it; the op's output rows are its own tokens', so what follows is
unchanged. ZeRO-1/2 cut the expert slices' shards over "edp" (runtime/zero.py). Refused,
naming the node, with a reason: a layer whose experts do not divide by ep, expert weights
that are not parameters read by the op alone (a view, a weight shared with another op),
and ZeRO-3 (passes/zero.py gathers every parameter over dp).

Runs before tensor_parallel: the expert slices are replicated over tp, and tp's rules for
replicated parameters (sequence parallelism sums their gradients over tp) then apply to
the slices as to any replicated weight.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..errors import PlanError
from ..graph import AH_PARAM, AH_ROLE, VAL, fake_mode, module_path, schema_args
from ..ops import moe as moe_ops  # noqa: F401  (registers autohybrid::moe_experts)
from ..program import ShardSpec
from .manager import PassContext

AXIS = "ep"
#: the op's arguments before `axis` and `chunks`, in its schema's order
_ARGS = ("x", "top_k_index", "top_k_weights", "gate_up", "down", "num_experts", "act")
MOE_EXPERTS = torch.ops.autohybrid.moe_experts.default


def moe_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The MoE layers' experts nodes of `gm`, in graph order."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is MOE_EXPERTS]


def expert_parallel(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    mesh = ctx.plan.mesh
    if mesh.ep == 1:
        return gm
    nodes = moe_nodes(gm)
    if not nodes:
        raise PlanError(f"mesh.ep={mesh.ep}: the graph has no MoE layer "
                        "(autohybrid::moe_experts) whose experts expert parallelism could "
                        "split; pin ep=1")
    if ctx.plan.zero == 3:
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
        if experts % ep:
            raise PlanError(f"expert parallelism: {where} has {experts} experts, which do "
                            f"not split over ep={ep} ranks; choose an ep dividing {experts}")
        for name in ("gate_up", "down"):
            weight = kw[name]
            if not (isinstance(weight, fx.Node) and weight.op == "placeholder"
                    and weight.meta.get(AH_ROLE) == "param"):
                raise PlanError(f"expert parallelism: the {name} weights of {where} are not "
                                "a parameter the op reads directly; pin ep=1")
            users = [u for u in weight.users if u is not node]
            if users:
                raise PlanError(f"expert parallelism: the {name} weights of {where} are also "
                                f"read by {users[0].name!r}; pin ep=1")
            key = weight.meta.get(AH_PARAM, weight.name)
            spec = ShardSpec(0, experts, experts, 1, ep, index, axis=AXIS)
            if specs.setdefault(key, spec) is spec:
                full = weight.meta[VAL]
                with mode:
                    weight.meta[VAL] = torch.empty((experts // ep, *full.shape[1:]),
                                                   dtype=full.dtype, device=full.device)
        node.args = (*(kw[name] for name in _ARGS), AXIS, ctx.plan.moe_chunks)
        node.kwargs = {}
    ctx.notes["param_shards"] = {**ctx.notes.get("param_shards", {}), **specs}
    gm.recompile()
    return gm
