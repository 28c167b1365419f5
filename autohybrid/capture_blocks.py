"""Capture once per distinct block: export a few blocks, replicate them to the whole model.

Owns the decision to capture a model block by block, and the checks that make it safe.
torch.export traces every layer; for GPT-3 (96 identical blocks) that is most of the
planning time. Here the model's longest ModuleList of blocks is found and a cheap fake
forward (capture_probe.py) records what every block does. When the record is periodic —
blocks i and i − p trace alike for every i ≥ 2p, p dividing the depth and at least
`MIN_UNITS` units — the model is exported with its first k·p and its first (k + 1)·p
blocks only (k = 2, or 5 where torch.export's names need longer to settle) and
capture_splice.py builds the graph a full export gives (same ops, node order and
names, placeholders, module paths, graph hash). Everything else falls back to the full
export, silently except for a line on the `autohybrid.capture` logger
(`AUTOHYBRID_LOG=capture`): a model without such a list, hooks, an instance-level forward,
blocks sharing parameters with anything, ops between blocks, blocks that differ in a
non-periodic way, a part before or after the blocks that changes with the depth, or any
rule of the splice that the two small exports do not follow, and a model with too few
blocks for the two small exports to cost less than the full one (`WORTH`).
`AUTOHYBRID_CAPTURE=full` forces the full export (tests, bisecting), `=blocks` the
block capture wherever the blocks allow it (tests of small models). It must not change the model (blocks removed
for the small exports are put back, even on errors).

Example::

    >>> ep = export_by_blocks(wrapper, args, dynamic)   # None: export the whole model
"""
from __future__ import annotations

import collections
import contextlib
import logging
import os
import time
from typing import Any, Iterator

import torch
import torch.nn as nn
from torch.nn.modules import module as _module

from .capture_probe import Refused, Trace, probe
from .capture_splice import KEPT_TRIES, splice

#: environment variable: "full" exports the whole model, anything else allows blocks
CAPTURE_ENV = "AUTOHYBRID_CAPTURE"
#: fewest repeats of the block pattern worth replicating (below, the larger small export
#: is the full one)
MIN_UNITS = KEPT_TRIES[0] + 2
#: the two small exports (k and k + 1 units, 2k + 1 in all) must hold at most 1/WORTH of
#: the blocks: each export pays a fixed cost (tracing the code around the blocks, setting
#: up torch.export) besides its blocks, so two small exports of more blocks than that
#: cost as much as the full one. Measured (2-core CPU, llama at 32 wide): block capture
#: over full export 1.31 at 5 blocks, 0.96 at 8, 0.82 at 10, 0.72 at 12, 0.54 at 20.
#: `AUTOHYBRID_CAPTURE=blocks` replicates wherever the blocks allow (tests).
WORTH = 2

log = logging.getLogger("autohybrid.capture")

_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks",
                 "_global_backward_hooks", "_global_backward_pre_hooks")


def block_list(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The model's longest ModuleList with at least MIN_UNITS entries, and its name."""
    best = None
    for name, m in model.named_modules():
        if name and isinstance(m, nn.ModuleList) and len(m) >= MIN_UNITS \
                and (best is None or len(m) > len(best[1])):
            best = (name, m)
    return best


def _check_model(model: nn.Module, blocks: nn.ModuleList) -> None:
    """Refused for hooks, instance-level forwards, repeated or shared blocks and tensors."""
    if any(getattr(_module, h, None) for h in _GLOBAL_HOOKS):
        raise Refused("global module hooks are registered")
    for name, m in model.named_modules(remove_duplicate=False):
        if any(getattr(m, h, None) for h in _HOOKS):
            raise Refused(f"module {name or '<root>'} has hooks")
        if "forward" in m.__dict__:
            raise Refused(f"module {name or '<root>'} has its own forward attribute")
    if len({id(b) for b in blocks}) != len(blocks):
        raise Refused("the same block object appears twice")
    uses = collections.Counter(
        id(t) for _, t in [*model.named_parameters(remove_duplicate=False),
                           *model.named_buffers(remove_duplicate=False)])
    for i, block in enumerate(blocks):
        for name, t in [*block.named_parameters(remove_duplicate=False),
                        *block.named_buffers(remove_duplicate=False)]:
            if uses[id(t)] > 1:
                raise Refused(f"tensor {name} of block {i} is shared (tied parameters)")


def _structure(block: nn.Module) -> tuple:
    """What must be equal for two blocks to be one kind, besides how they trace."""
    mods = []
    for name, m in block.named_modules(remove_duplicate=False):
        params = tuple((k, type(p), tuple(p.shape), p.dtype, p.requires_grad, p.device.type)
                       for k, p in m._parameters.items() if p is not None)
        buffers = tuple((k, tuple(b.shape), b.dtype, b.device.type,
                         k in m._non_persistent_buffers_set)
                        for k, b in m._buffers.items() if b is not None)
        mods.append((name, type(m), m.training, params, buffers))
    return tuple(mods)


def _period(trace: Trace, blocks: nn.ModuleList) -> int:
    """The smallest p with block i ≅ block i − p for all i ≥ 2p (p divides the depth)."""
    if any(trace.gaps):
        raise Refused("torch calls between blocks")
    n = len(blocks)
    keys = [(_structure(b), tuple(rec)) for b, rec in zip(blocks, trace.blocks)]
    for p in range(1, n // MIN_UNITS + 1):
        if n % p == 0 and all(keys[i] == keys[i - p] for i in range(2 * p, n)) \
                and all(len(trace.blocks[i]) == len(trace.blocks[i + p]) for i in range(p)):
            return p
    raise Refused(f"the {n} blocks do not repeat with a period of at most {n // MIN_UNITS}")


@contextlib.contextmanager
def _first(blocks: nn.ModuleList, count: int) -> Iterator[None]:
    """`blocks` holds only its first `count` entries inside the context."""
    saved = blocks._modules
    blocks._modules = collections.OrderedDict(list(saved.items())[:count])
    try:
        yield
    finally:
        blocks._modules = saved


def _export(wrapper: nn.Module, args: tuple, dynamic: tuple) -> Any:
    return torch.export.export(wrapper, args, dynamic_shapes=(dynamic,), strict=False)


def _splice(wrapper: nn.Module, args: tuple, dynamic: tuple, blocks: nn.ModuleList,
            list_path: str, trace: Trace, p: int, kept: int) -> Any:
    """Export `kept` and `kept + 1` units of p blocks and build the full graph from them."""
    with _first(blocks, (kept + 1) * p):
        small = probe(wrapper, blocks, list_path, args)
        if small.prefix != trace.prefix or small.suffix != trace.suffix:
            raise Refused("the code before or after the blocks depends on their number")
        ep_b = _export(wrapper, args, dynamic)
    with _first(blocks, kept * p):
        ep_a = _export(wrapper, args, dynamic)
    spliced = splice(ep_a, ep_b, list_path, p, len(blocks) // p, kept)
    return _as_exported_program(spliced, ep_b, wrapper)


def _as_exported_program(spliced: Any, ep_b: Any, wrapper: nn.Module) -> Any:
    """The spliced graph as a torch.export ExportedProgram of the whole model (so it can
    be saved and loaded like a full export's): the state dict is the model's own tensors,
    symbol ranges and call signature are the small export's (the same inputs)."""
    from torch.export.exported_program import ExportedProgram
    from torch.export.graph_signature import InputKind

    state = {}
    for spec in spliced.graph_signature.input_specs:
        if spec.kind == InputKind.PARAMETER:
            state[spec.target] = wrapper.get_parameter(spec.target)
        elif spec.kind == InputKind.BUFFER and spec.persistent:
            state[spec.target] = wrapper.get_buffer(spec.target)
    gm = spliced.graph_module
    return ExportedProgram(root=gm, graph=gm.graph, graph_signature=spliced.graph_signature,
                           state_dict=state, range_constraints=dict(ep_b.range_constraints),
                           module_call_graph=ep_b.module_call_graph,
                           constants=dict(spliced.constants), verifiers=ep_b.verifiers)


def export_by_blocks(wrapper: nn.Module, args: tuple, dynamic: tuple) -> Any | None:
    """`wrapper`'s exported program built from p and 2p of its blocks, or None.

    `wrapper.model` is the user's model; `args` and `dynamic` are what the full export
    would get. None means: export the whole model (the reason is logged).
    """
    mode = os.environ.get(CAPTURE_ENV, "").strip().lower()
    if mode == "full":
        return None
    model = wrapper.model
    found = block_list(model)
    if found is None:
        log.info("full export of %s: no ModuleList of %d or more blocks",
                 type(model).__name__, MIN_UNITS)
        return None
    path, blocks = found
    worth = 1 if mode == "blocks" else WORTH
    if len(blocks) < worth * (2 * KEPT_TRIES[0] + 1):
        log.info("full export of %s: %d blocks, fewer than %d times the %d the smallest "
                 "block capture exports", type(model).__name__, len(blocks), worth,
                 2 * KEPT_TRIES[0] + 1)
        return None
    list_path = f"model.{path}"
    start = time.perf_counter()
    try:
        _check_model(model, blocks)
        trace = probe(wrapper, blocks, list_path, args)
        probed = time.perf_counter()
        p = _period(trace, blocks)
        out = None
        for kept in KEPT_TRIES:
            if worth * (2 * kept + 1) * p > len(blocks):
                raise Refused(f"{len(blocks)} blocks: exporting {kept} and {kept + 1} units "
                              f"of {p} block(s) costs about what the full export does")
            try:
                out = _splice(wrapper, args, dynamic, blocks, list_path, trace, p, kept)
                break
            except Refused as exc:
                if kept == KEPT_TRIES[-1] or "out of step" not in str(exc):
                    raise
                log.info("%s; trying %d units", exc, KEPT_TRIES[-1])
    except Refused as exc:
        log.info("full export of %s: %s", type(model).__name__, exc)
        return None
    except Exception as exc:  # noqa: BLE001 — any failure here: the full export decides
        log.info("full export of %s: block capture failed: %s: %s", type(model).__name__,
                 type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return None
    log.info("captured %s: %d blocks of %s as %d units of %d block(s) from exports of %d "
             "and %d blocks in %.2f s (probe of all blocks %.2f s)", type(model).__name__,
             len(blocks), path, len(blocks) // p, p, kept * p, (kept + 1) * p,
             time.perf_counter() - start, probed - start)
    return out
