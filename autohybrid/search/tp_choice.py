"""The cheapest consistent tp sharding of the generic linears (issue: per-op shardings).

Megatron's patterns (search/sharding.py) fix most linears; the rest — linear-like ops
whose output reaches no row linear, attention or loss — are open: column-parallel (the
output stays split until a consumer needs it whole, where an all-gather joins it, or a
later linear becomes row-parallel) or replicated. `choose_layout` decides them by
coordinate descent from Megatron's assignment (replicated) on `layout_cost`, the time per
token of forward and backward:

    Σ ops   3 · (matmul FLOPs / flops  +  bytes of memory-bound ops / memory bandwidth) / t_op
    Σ tp collectives   ring bytes / tp-link bandwidth

with t_op = tp for ops working on shards, 1 otherwise. Compute saved and ring transfers
both scale as (t−1)/t, so the choice hardly depends on the degree; `Rates.of(cluster)`
takes the reference degree from the node size.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import sympy
import torch.fx as fx

from ..cost.compute import MATMUL_EFFICIENCY, MATMUL_OPS, MEMORY_EFFICIENCY, bytes_moved, \
    forward_flops
from ..graph import op_name
from .sharding import TensorParallelLayout
from .tp_gradients import megatron_layout

#: Forward + backward over forward (backward computes two products per forward one).
TRAINING_FACTOR = 3.0


@dataclass(frozen=True)
class Rates:
    """Throughputs the choice weighs: FLOP/s, memory bytes/s, tp-link bytes/s, degree."""

    flops: float
    memory_bandwidth: float
    link_bandwidth: float
    tp: int

    @classmethod
    def of(cls, cluster) -> "Rates":
        device = cluster.device
        peak = max(device.peak_flops.values())
        tp = max(2, min(8, cluster.devices_per_node))  # a reference degree, inside a node
        return cls(peak * MATMUL_EFFICIENCY, device.memory_bandwidth * MEMORY_EFFICIENCY,
                   cluster.intra_link.bandwidth, tp)


def _per_token(expr: sympy.Expr) -> float:
    """Value with every symbolic size set to 1 (linear ops: the cost of one token); where
    a size of 1 divides by zero (`b // (b // 2)`, a batch paired up by a reshape), the
    value at 2 (then 8) over that size to the power of the count of symbols."""
    expr = sympy.sympify(expr)
    symbols = expr.free_symbols
    for size in (1, 2, 8):
        try:
            value = float(expr.xreplace({s: size for s in symbols}))
        except (ZeroDivisionError, TypeError):
            continue
        if math.isfinite(value):
            return value / size ** len(symbols)
    return 0.0


class LayoutCost:
    """Prices layouts of one graph; per-node figures are evaluated once."""

    def __init__(self, gm: fx.GraphModule, rates: Rates):
        self.gm, self.rates = gm, rates
        self.node_time: dict[str, float] = {}
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            flops = _per_token(forward_flops(node))
            moved = _per_token(bytes_moved(node))
            if op_name(node) in MATMUL_OPS:
                time = flops / rates.flops
            else:
                time = moved / rates.memory_bandwidth
            self.node_time[node.name] = TRAINING_FACTOR * time
        self._bytes: dict[sympy.Expr, float] = {}

    def __call__(self, layout: TensorParallelLayout) -> float:
        t = self.rates.tp
        total = 0.0
        for name, time in self.node_time.items():
            split = layout.placements.get(name, "replicate") != "replicate" or \
                layout.linear_roles.get(name) in ("column", "row")
            total += time / t if split else time
        for c in layout.collectives:
            if c.nbytes not in self._bytes:
                self._bytes[c.nbytes] = _per_token(c.nbytes)
            ring = (2.0 if c.kind == "all_reduce" else 1.0) * (t - 1) / t
            total += ring * self._bytes[c.nbytes] / self.rates.link_bandwidth
        return total


#: a layer index in a module path (`blocks.3.mlp` → `blocks.#.mlp`)
_INDEX = re.compile(r"\.\d+(?=\.|$)")


def _role(node: fx.Node) -> str:
    """The module path of the node's innermost module with layer indices dropped
    (``model.blocks.#.mlp.router``) and its op: the same linear of every repeated block."""
    stack = node.meta.get("nn_module_stack") or {}
    path = next(reversed(stack.values()))[0] if stack else node.name
    return f"{_INDEX.sub('.#', path)} {op_name(node)}"


def choose_layout(gm: fx.GraphModule, rates: Rates) -> TensorParallelLayout:
    """Megatron's layout with each open generic linear set to its cheaper choice.

    Coordinate descent over roles: the open linears of one module path in every repeated
    block (`_role`) flip together, so a 32-layer model prices one trial per distinct
    linear, not one per layer (each trial propagates the whole graph)."""
    cost = LayoutCost(gm, rates)
    nodes = {n.name: n for n in gm.graph.nodes}
    choices: dict[str, str] = {}
    best = megatron_layout(gm, choices)
    best_cost = cost(best)
    improved = True
    while improved:
        improved = False
        groups: dict[tuple[str, str], list[str]] = {}
        for name in best.open:
            groups.setdefault((_role(nodes[name]), choices.get(name, "replicate")),
                              []).append(name)
        for (_, current), names in groups.items():
            flip = "replicate" if current == "column" else "column"
            trial = dict(choices) | {name: flip for name in names}
            layout = megatron_layout(gm, trial)
            value = cost(layout)
            if value < best_cost * (1 - 1e-9):
                choices, best, best_cost, improved = trial, layout, value, True
    return best
