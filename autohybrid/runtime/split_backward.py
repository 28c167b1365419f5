"""Whether torch's split backward computes a stage's weight gradients right.

The zero-bubble schedules split a stage's backward in two (torch.distributed.pipelining
_backward.py): the input step computes the gradients of the stage's inputs, keeping the
graph, and saves the gradients arriving at each *intermediate* (a node where a
parameter's paths meet the inputs' paths, `get_param_groups`); the weight step later
runs one `torch.autograd.grad` per parameter group, from its intermediates (their saved
gradients) to its parameters, freeing what it ran through (retain_graph=False).

That is right when no node runs in two groups' calls. It is not when a parameter is read
again after the values built from it have been through other parameters' layers: a raw
table every block reads (DeBERTa's relative-position embeddings, `q(h) @ r.t()` and
`softmax(s) @ r` in each block). The table's group runs from the second block's
intermediates back through the first block — through the second block's `q` linear,
another group's intermediate, since its input depends on the table too — and frees it;
that group's call then fails ("Trying to backward through the graph a second time"),
and where it does not fail the order of the groups decides what each one reads.

`split_is_safe` walks what each group's call would run: from its intermediates along
the graph's edges, through the nodes from which one of its parameters is reachable. Two
groups sharing a node, or a group running through another's intermediate, make the split
unsafe; runtime/pipeline.py then runs that stage's backward whole in the input step (as
1F1B does) and leaves its weight step nothing to do. The answer depends on the stage's
graph only, so it is computed once per stage.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Iterable, Sequence

import torch


def split_is_safe(outputs: Sequence[Any], inputs: Sequence[Any],
                  params: Iterable[torch.nn.Parameter]) -> bool:
    """Whether torch's weight step over this stage's graph (outputs `outputs`, received
    `inputs`, parameters `params`) runs each autograd node in one parameter group only."""
    from torch.distributed.pipelining._backward import (
        _get_grad_fn_or_grad_acc, construct_reverse_graph, get_param_groups, reverse_closure)

    def fns(tensors: Iterable[Any]) -> list:
        return [f for t in tensors if isinstance(t, torch.Tensor)
                and (t.requires_grad or t.grad_fn is not None)
                and (f := _get_grad_fn_or_grad_acc(t)) is not None]

    consumers = construct_reverse_graph(fns(outputs))
    groups = get_param_groups(fns(inputs), fns(p for p in params if p.requires_grad),
                              consumers)
    intermediate_of = {n: i for i, g in enumerate(groups) for n in g["intermediates"]}
    owner: dict[Any, int] = {}
    for i, group in enumerate(groups):
        # the nodes from which one of its parameters is reachable: theirs, their
        # consumers', … up to the outputs
        reaches, _ = reverse_closure(list(group["params"]), set(), consumers)
        for node in _run_by(group["intermediates"], reaches):
            if intermediate_of.get(node, i) != i or owner.setdefault(node, i) != i:
                return False
    return True


def _run_by(starts: Iterable[Any], reaches: set) -> set:
    """The nodes an `autograd.grad` from `starts` to the parameters runs: those reachable
    from `starts` along the edges, through nodes that lead to a parameter."""
    seen: set = set()
    queue = deque(starts)
    while queue:
        node = queue.popleft()
        if node in seen:
            continue
        seen.add(node)
        queue.extend(child for child, _ in node.next_functions
                     if child is not None and child in reaches)
    return seen
