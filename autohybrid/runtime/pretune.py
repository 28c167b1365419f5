"""Fused kernels tuned before the first step, with the same choice on every rank.

Owns when tuning happens in a compiled model's life: once, at the start of the first
run of each program (train_step, or the forward), before any of that step's collectives.
The timing itself (which launches, how they are timed, the on-disk memo) is
codegen/triton.py's; the kernels are ops/fused.py's.

Why: a fused kernel is tuned the first time it meets a shape class (`triton.tuned`, with
`triton.testing.do_bench`, which synchronizes the device). Inside a step that runs while
collectives are in flight (the dp buckets during backward, tp's all-reduces), on one rank
and not another, and on each rank from its own timings, so ranks may launch different
tiles. None changes a result (`triton.configs`), but a synchronization inside an NCCL
collective's window stalls every rank, and different tiles give ranks different step
times. So: every fused region of the program is launched once, forward and backward, on
inputs of its graph's example shapes, before the step; the ranks then agree (for each
kernel and shape class, the choice of the lowest rank that tuned it, gathered with one
`all_gather_object`), and tuning freezes: a shape class met later (another microbatch
size) takes the default launch, untimed. Where launches are not tuned (CPU, Triton's
interpreter, AUTOHYBRID_AUTOTUNE=0) nothing runs and no collective is added.

    >>> pretune([program.runnable.gm], device)   # every rank, before its first step
"""
from __future__ import annotations

import logging
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx

from ..codegen import triton as tgen
from ..graph import VAL

__all__ = ["bind_sizes", "fused_calls", "pretune", "program_graphs", "tuning_active"]

#: whether launches are tuned on a device (codegen/triton.py)
tuning_active = tgen.tuning_active

_log = logging.getLogger("autohybrid.kernels")


def program_graphs(program: Any) -> list[fx.GraphModule]:
    """The graph modules a RankProgram runs: its rewritten graph and, under pipeline
    parallelism, its stages' graphs."""
    graphs = [program.runnable.gm]
    if program.pipeline is not None:
        graphs += [stage.gm for stage in program.pipeline.stages]
    return graphs


def bind_sizes(captured: Any, batch: Sequence[torch.Tensor]) -> dict:
    """Each symbolic size of the captured graph's user inputs (its last placeholders:
    the inputs, then the targets) → its size in `batch` (this rank's first microbatch)."""
    placeholders = [n for n in captured.gm.graph.nodes if n.op == "placeholder"]
    user = placeholders[len(placeholders) - len(batch):] if batch else []
    bound: dict = {}
    for node, tensor in zip(user, batch):
        val = node.meta.get(VAL)
        if not isinstance(val, torch.Tensor) or val.dim() != tensor.dim():
            continue
        for size, actual in zip(val.shape, tensor.shape):
            expr = getattr(getattr(size, "node", None), "expr", None)
            if expr is not None and getattr(expr, "is_Symbol", False):
                bound[expr] = int(actual)
    return bound


def fused_calls(graphs: Iterable[fx.GraphModule], sizes: dict | None = None
                ) -> list[tuple[str, list[torch.Tensor]]]:
    """(region key, its inputs as meta tensors) of every fused region node in `graphs`
    and their submodules (recomputed regions), once per key and shapes; a symbolic size
    takes its value in `sizes` (`bind_sizes`), else its example value."""
    seen, out = set(), []
    target = torch.ops.autohybrid.fused_region.default
    for gm in graphs:
        for module in gm.modules():
            graph = getattr(module, "graph", None)
            if not isinstance(graph, fx.Graph):
                continue
            for node in graph.nodes:
                if node.op != "call_function" or node.target is not target:
                    continue
                inputs, key = node.args[0], node.args[1]
                vals = [getattr(n, "meta", {}).get(VAL) for n in inputs]
                if any(not isinstance(v, torch.Tensor) for v in vals):
                    continue
                shapes = [_hint(v.shape, sizes or {}) for v in vals]
                if any(s is None for s in shapes):
                    continue   # a size with no example value: tuned, untimed, in the step
                ident = (key, tuple(map(tuple, shapes)), tuple(v.dtype for v in vals))
                if ident not in seen:
                    seen.add(ident)
                    out.append((key, [torch.empty(s, dtype=v.dtype, device="meta")
                                      for s, v in zip(shapes, vals)]))
    return out


def _hint(shape: Sequence, sizes: dict) -> list[int] | None:
    """`shape` with each symbolic size replaced by its value under `sizes`, else its
    example value (None: one has neither)."""
    out = []
    for size in shape:
        if not isinstance(size, torch.SymInt):
            out.append(int(size))
            continue
        node = getattr(size, "node", None)
        expr = getattr(node, "expr", None)
        if expr is not None and sizes:
            value = expr.xreplace(sizes)
            if not getattr(value, "free_symbols", None):   # every symbol bound
                out.append(int(value))
                continue
        hint = getattr(node, "hint", None)
        if hint is None:
            return None
        out.append(int(hint))
    return out


def pretune(graphs: Iterable[fx.GraphModule], device: torch.device, captured: Any = None,
            batch: Sequence[torch.Tensor] = (), group: dist.ProcessGroup | None = None,
            agree: bool = True) -> int:
    """Tune every fused region of `graphs` on `device` (forward and the backward of every
    float input) at the sizes `batch` (this rank's first microbatch) gives the symbols of
    `captured`'s inputs, agree with the other ranks of `group` (the default group; a
    collective: every rank calls it where tuning is active, which is alike on every rank
    of one device type; `agree=False`: no collective, for a program one rank may run
    alone, a forward under dp) and freeze tuning. Returns how many regions were launched
    (0 where launches are not tuned here)."""
    if not tgen.tuning_active(device):
        return 0
    calls = fused_calls(graphs, bind_sizes(captured, batch) if captured is not None else {})
    tgen.freeze_tuning(False)   # (a model compiled after another one's first step)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for key, metas in calls:
            inputs = [_example(m, device, generator) for m in metas]
            outs = torch.ops.autohybrid.fused_region(inputs, key)
            if any(t.is_floating_point() for t in inputs):
                grads = [torch.ones_like(o) for o in outs]
                torch.ops.autohybrid.fused_region_backward(inputs, grads, key, None)
    if agree:
        _agree(group)
    tgen.freeze_tuning()
    _log.info("tuned %d fused regions before the first step", len(calls))
    return len(calls)


def _example(meta: torch.Tensor, device: torch.device,
             generator: torch.Generator) -> torch.Tensor:
    if meta.dtype.is_floating_point:
        return torch.rand(meta.shape, dtype=meta.dtype, device=device, generator=generator)
    if meta.dtype == torch.bool:
        return torch.zeros(meta.shape, dtype=torch.bool, device=device)
    return torch.zeros(meta.shape, dtype=meta.dtype, device=device)


def _agree(group: dist.ProcessGroup | None) -> None:
    """Every rank takes, for each kernel and shape class, the choice of the lowest rank
    that tuned it (ranks of other pipeline stages tune other kernels)."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    views: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(views, tgen.tuning_choices(), group=group)
    agreed: dict = {}
    for choices in views:
        for key, config in choices.items():
            agreed.setdefault(key, config)
    changed = tgen.install_choices(agreed)
    if changed:
        _log.info("took %d launch choices from lower ranks", changed)
