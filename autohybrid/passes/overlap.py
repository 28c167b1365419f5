"""Pass: overlap — issue collectives early and wait for them late, within a memory budget.

Why: a collective that starts only when its result is needed leaves the compute idle for
its whole duration. Split into an issue node (starts the collective and returns the
buffer it fills) and a wait node (waits, then gives the result), the issue can move up
to where its inputs exist, and the compute between issue and wait hides the transfer.
Each issue moved up holds its buffer longer, so the distance is bounded by a budget of
bytes in flight (issued, not yet waited for) at every point of the graph.

What moves today: ZeRO-3's gathers (passes/zero.py: `zero_gather_start` issues a layer's
all-gather, `zero_gather_wait` before the layer's first use). Their inputs are parameter
shards, so a gather may start anywhere before its layer; the budget decides how far: the
default, the largest single gather's bytes, lets the next layer's gather start right
after the current layer's wait, while the current layer computes (FSDP's forward
prefetch of one layer), and never two gathers in flight at once. Waits stay where their
pass put them (before the first use).

Rules (all from the graph and the Plan, so every rank derives the same order and the
collectives of a process group are issued in the same order everywhere, or gloo/NCCL
would pair different collectives and hang):
* an issue never moves above another issue (issues keep their order) nor above a node it
  reads;
* it moves up one node at a time while the bytes in flight there, with it, stay within
  the budget; then it stops;
* only the graph's own nodes move: an issue inside a checkpointed region (full
  recomputation) stays in its region, and each pipeline stage's graph is scheduled on
  its own (`ctx.notes["pipeline"]`).

Where: last (after pipeline_split and recompute), on the final per-rank and per-stage
graphs.

Example::

    schedule_issues(gm, budget_bytes=2 * 2**20)   # → the number of issues moved
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..graph import VAL
from ..ops.zero import zero_gather_start_op, zero_gather_wait_op
from .manager import PassContext

PASS = "overlap"

#: issue op → the wait op that consumes its result
ISSUE_OPS = {zero_gather_start_op: zero_gather_wait_op}


def overlap(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    graphs = [gm]
    split = ctx.notes.get("pipeline")
    if split is not None:
        graphs += [stage.gm for stage in split.stages]
    moved = 0
    for g in graphs:
        moved += schedule_issues(g, default_budget(g))
        g.recompile()
    ctx.notes["overlap_moved"] = moved
    return gm


def issue_bytes(node: fx.Node) -> int:
    value = node.meta.get(VAL)
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def _issues(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in ISSUE_OPS]


def default_budget(gm: fx.GraphModule) -> int:
    """The largest single issue's bytes: one collective in flight ahead of its use."""
    return max((issue_bytes(n) for n in _issues(gm)), default=0)


def _wait_of(issue: fx.Node) -> fx.Node:
    waits = [u for u in issue.users if u.target is ISSUE_OPS[issue.target]]
    if len(waits) != 1:
        raise AssertionError(f"overlap: {issue.name} has {len(waits)} waits, expected one")
    return waits[0]


def in_flight(gm: fx.GraphModule) -> list[tuple[fx.Node, int]]:
    """(node, bytes of the collectives issued before it whose wait is it or later) in
    graph order: an issue's buffer counts from the node after the issue up to and
    including its wait (which reads it)."""
    pending: dict[fx.Node, int] = {}            # wait node → its issue's bytes
    out = []
    for node in gm.graph.nodes:
        out.append((node, sum(pending.values())))
        pending.pop(node, None)
        if node.op == "call_function" and node.target in ISSUE_OPS:
            pending[_wait_of(node)] = issue_bytes(node)
    return out


def schedule_issues(gm: fx.GraphModule, budget_bytes: int) -> int:
    """Move every issue node of `gm` up as far as the rules allow; how many moved."""
    moved = 0
    for issue in _issues(gm):
        size = issue_bytes(issue)
        reads = set(issue.all_input_nodes)
        flight = dict(in_flight(gm))
        target = None
        node = issue.prev
        while node.op != "root":
            if node in reads or node.op == "placeholder" or node.target in ISSUE_OPS:
                break
            if flight[node] + size > budget_bytes:
                break
            target = node
            node = node.prev
        if target is not None:
            target.prepend(issue)
            moved += 1
    return moved
