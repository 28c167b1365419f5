"""The gradient semantics of a tp layout: a proof that every collective's backward is right.

Under tensor parallelism a value is split (each rank holds its shard, and its gradient
there is that shard's gradient) or replicated. A replicated value's gradient on a rank is
*replicated* — the whole gradient, the same on every rank — or *partial* — that rank's
share of a sum over the ranks. The contracts of the collectives the pass inserts
(ops/tensor_parallel.py), and of what it leaves alone:

    where                                          backward               needs at its output
    tp_copy: input of a column linear              all-reduce (sum)       a partial gradient
    tp_reduce: row linear, vocabulary embedding    identity               a replicated one
    tp_gather: split value → op needing it whole   this rank's slice      a replicated one
    tp_split: replicated operand spanning the
              shard dim of a split op              all-gather             (shard gradients)
    a replicated parameter                         (tp sums nothing)      a replicated one

A column linear always hands tp_copy a partial gradient (each rank's product covers its
output features), so f holds. Partial gradients of replicated values arise in one place:
a replicated operand broadcast along the shard dim of a split op — an RMSNorm's
statistics times a hidden-split activation, `rsqrt(mean(x²)) * x`: each rank's gradient of
the statistics sums over its own slice of the hidden dim. Through replicated ops a partial
gradient stays partial. `gradient_problems` propagates the kinds backwards over a layout
and returns, per origin, the contract the partial gradient would break; `megatron_layout`
(below) replicates the column linears whose sharding reaches the origin
(`sharding_sources`) until no problem is left, so a layout the search can choose never
runs a `tp_gather` (or `tp_reduce`) into a consumer whose gradient is not replicated.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from ..capture import _WRAPPER_PREFIX
from ..cost.compute import grad_nodes
from ..errors import PlanError
from ..graph import AH_ROLE, VAL, module_path, op_name, source_line
from .sharding import (R, TensorParallelLayout, _BROADCASTING, _ELEMENTWISE_PREFIXES,
                       param_key, propagate_layout, shard_dim)

AXIS = "tp"


@dataclass(frozen=True)
class GradientProblem:
    """A partial gradient from `origin` (its replicated operand `operand` broadcast along
    the shard dim) reaching `contract`, whose backward needs a replicated one."""

    origin: str
    operand: str
    contract: str
    kind: str       # "tp_gather" | "tp_reduce" | "parameter"

    def describe(self, gm: fx.GraphModule | None = None) -> str:
        nodes = {n.name: n for n in gm.graph.nodes} if gm is not None else {}
        return (f"replicated operand {self.operand!r} of split op {self.origin!r}"
                f"{_where(nodes.get(self.origin))} would get a partial gradient on mesh axis "
                f"{AXIS!r} (each rank's share of a sum over its shard), and it reaches "
                f"{_contract_text(self.kind)} at {self.contract!r}"
                f"{_where(nodes.get(self.contract))}, whose backward needs the gradient "
                "replicated")


def _where(node: fx.Node | None) -> str:
    if node is None:
        return ""
    path, line = module_path(node).removeprefix(_WRAPPER_PREFIX), source_line(node)
    bits = [f"module {path}" if path else "", f"`{line}`" if line else ""]
    text = ", ".join(b for b in bits if b)
    return f" ({text})" if text else ""


def _contract_text(kind: str) -> str:
    return {"tp_gather": "the all-gather (tp_gather, backward: this rank's slice)",
            "tp_reduce": "the all-reduce (tp_reduce, backward: identity)",
            "parameter": "a replicated parameter (whose gradient tp never sums)"}[kind]


def _split_param(node: fx.Node, layout: TensorParallelLayout) -> bool:
    return node.op == "placeholder" and \
        layout.param_placements.get(param_key(node), R) != R


def spans_shard_dim(operand: torch.Tensor, out: torch.Tensor, out_dim: int) -> bool:
    """Does a replicated `operand` of an op whose output is split on `out_dim` span that
    dim (the pass slices it with tp_split) rather than broadcast along it?"""
    dim = out_dim - (out.dim() - operand.dim())
    return dim >= 0 and operand.shape[dim] != 1


def sliced_operand(user: fx.Node, operand: fx.Node, out_dim: int) -> bool:
    """Does the tp pass give split op `user` this rank's slice of replicated `operand`
    (tp_split: its backward all-gathers, so the operand's gradient stays replicated)?"""
    name = op_name(user)
    out, val = user.meta.get(VAL), operand.meta.get(VAL)
    if not (isinstance(out, torch.Tensor) and isinstance(val, torch.Tensor)):
        return False
    if name == "aten.scaled_dot_product_attention.default":
        mask = user.args[3] if len(user.args) > 3 else user.kwargs.get("attn_mask")
        return operand is mask and spans_shard_dim(val, out, out_dim)
    if not (name.startswith(_ELEMENTWISE_PREFIXES) or name in _BROADCASTING):
        return False
    return spans_shard_dim(val, out, out_dim)


def _partial_via(user: fx.Node, node: fx.Node, layout: TensorParallelLayout,
                 partial: dict[fx.Node, tuple[str, str]]) -> tuple[str, str] | None:
    """(origin, operand) when `user` hands replicated `node` a partial gradient."""
    if user.op != "call_function":
        return None  # the graph's output: the loss's gradient is the same everywhere
    if layout.linear_roles.get(user.name) == "column":
        return None  # x through tp_copy: the partial gradient is summed (Megatron's f)
    out_dim = shard_dim(layout.placements.get(user.name, R))
    if out_dim is None:
        return partial.get(user)  # a replicated op passes its gradient's kind on
    if sliced_operand(user, node, out_dim):
        return None
    return user.name, node.name


def _contract(node: fx.Node, layout: TensorParallelLayout) -> str | None:
    """The contract that needs `node`'s gradient replicated, if any."""
    if node.op == "placeholder":
        return "parameter" if node.meta.get(AH_ROLE) == "param" else None
    role = layout.linear_roles.get(node.name)
    if role == "row" or (op_name(node) == "aten.embedding.default" and isinstance(
            node.args[0], fx.Node) and param_key(node.args[0]) in layout.vocab_params):
        return "tp_reduce"
    if any(shard_dim(layout.placements.get(a.name, R)) is not None
           for a in node.all_input_nodes):
        return "tp_gather"
    return None


def gradient_problems(gm: fx.GraphModule, layout: TensorParallelLayout
                      ) -> list[GradientProblem]:
    """Every origin of a partial gradient in `layout`, with the first contract it breaks
    (empty: the layout's gradients are exactly eager's). Fills `layout.partial_grads`."""
    needs_grad = grad_nodes(gm)
    partial: dict[fx.Node, tuple[str, str]] = {}
    for node in reversed(gm.graph.nodes):
        if node not in needs_grad or layout.is_sharded(node) or _split_param(node, layout):
            continue
        for user in node.users:
            why = _partial_via(user, node, layout, partial)
            if why is not None:
                partial[node] = why
                break
    layout.partial_grads = {n.name: why for n, why in partial.items()}
    problems: dict[str, GradientProblem] = {}
    for node in gm.graph.nodes:  # forward order: the contract nearest the origin first
        if node not in partial:
            continue
        origin, operand = partial[node]
        kind = _contract(node, layout)
        if kind is not None and origin not in problems:
            problems[origin] = GradientProblem(origin, operand, node.name, kind)
    return list(problems.values())


def sharding_sources(gm: fx.GraphModule, layout: TensorParallelLayout, origin: str,
                     budget: int = 4096) -> list[str]:
    """The column linears whose split output reaches op `origin` (through split values)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    frontier, seen, found = [nodes[origin]], set(), []
    while frontier and budget > 0:
        node = frontier.pop()
        budget -= 1
        if node in seen:
            continue
        seen.add(node)
        if layout.linear_roles.get(node.name) == "column":
            found.append(node.name)
            continue
        frontier.extend(a for a in node.all_input_nodes if layout.is_sharded(a))
    return found


def _replicate_tied(gm: fx.GraphModule, layout: TensorParallelLayout,
                    forced: dict[str, str]) -> bool:
    """Replicate the linears of each parameter that linears would split differently
    (`layout.tied_conflicts`: a weight tied between a column and a row linear reads, on
    each rank, the one shard its single placement holds — a wrong product for one of
    them), and the column linears splitting the input of a row one among them (a row
    linear is row-parallel because its input is split). Whether anything was added."""
    added = False
    for key, users in layout.tied_conflicts.items():
        why = (f"its parameter {key} is also read by "
               f"{', '.join(users)}, which would split it differently")
        for linear in users:
            more = [linear] + (sharding_sources(gm, layout, linear)
                               if layout.linear_roles.get(linear) == "row" else [])
            for name in more:
                if name not in forced:
                    forced[name] = why
                    added = True
    return added


def megatron_layout(gm: fx.GraphModule, choices: dict[str, str] | None = None
                    ) -> TensorParallelLayout:
    """Propagate Megatron's shardings through `gm` (forward graph order), proven.

    `choices` decides open generic linears by node name ("column" or "replicate"); the
    ones it leaves out keep Megatron's rule (replicated). The layout returned satisfies
    every collective's gradient contract (search/tp_gradients.py): where a column linear's
    sharding would make a gradient partial, that linear is replicated instead and the
    layout recomputed — the result is never one that would run with a wrong gradient.
    """
    choices = choices or {}
    forced: dict[str, str] = {}
    while True:
        layout = propagate_layout(gm, choices, forced)
        if layout.tied_conflicts:
            if not _replicate_tied(gm, layout, forced):
                key, users = next(iter(layout.tied_conflicts.items()))
                raise PlanError(
                    f"tensor parallelism: parameter {key!r} is read by linears that would "
                    f"split it differently ({', '.join(users)}) and no replicated layout "
                    "resolves it; pin tp=1")
            continue
        problems = gradient_problems(gm, layout)
        if not problems:
            layout.partial_grads.clear()
            layout.replicated_for_gradients = dict(forced)
            return layout
        added = False
        for problem in problems:
            for linear in sharding_sources(gm, layout, problem.origin):
                if linear not in forced:
                    forced[linear] = problem.describe(gm)
                    added = True
        if not added:  # nothing left to replicate: a bug in the propagation, never run it
            raise PlanError("tensor parallelism: no layout of this graph satisfies the "
                            f"gradient contracts on mesh axis 'tp': {problems[0].describe(gm)}; "
                            "pin tp=1")
