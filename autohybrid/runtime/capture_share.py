"""Capture once per job (opt-in): rank 0 exports the model, every rank loads that graph.

Owns the exchange at `ah.compile` time (called by compiled.py on every rank, where the
default process group spans the job). It does not trace (capture.py) nor define the
bytes (capture_wire.py).

Off unless `AUTOHYBRID_CAPTURE_SHARE=1`: measured on the 2-core CI machine (torch 2.13,
warm ranks, llama-tiny's training graph), loading the serialized graph costs 0.85 of an
export (1.43 s against 1.67 s; torch's deserializer re-parses every symbolic shape) and
rank 0 adds its export and the serialization (0.53 s) before anyone can load, so on N
ranks sharing costs E + D + N·L of CPU against N·E for every rank exporting at once, and
more wall time (the other ranks wait for rank 0). The multi-process suite spent 12% less
CPU with it off (1647 s against 1873 s). Each rank's own export is memoized
(capture_cache.py), so a process exports a model once either way. On GPUs ranks never
share (below). It stays for a job whose export is far slower than its load.

Why every rank, rank 0 too, runs the *loaded* graph when sharing: a graph carries its
symbolic-shape environment, and
what that environment can prove (that a batch dim is symbolic, a size divides) decides
some rewrites, e.g. the loss form (passes/global_loss.py). A loaded graph's environment
is rebuilt from the bytes (capture_wire.py sends the exporting one's symbol ranges and
guards, which torch's serialized form omits) and is not the exporting object itself;
ranks that ran different rewrites would train with different losses. So all ranks run the same bytes, or all export for themselves.

The steps, each a collective over the default group:

1. every rank sends the portable digest of its capture's inputs (model structure and
   code, loss, example shapes, devices, torch version; capture_cache.portable_digest)
   and where its memoized copy came from. The devices count with their index: a graph
   names the device its ops create tensors on, so on GPUs (cuda:0, cuda:1, ...) every
   rank traces its own; on CPU ranks share. Digests that differ, or any rank without one (a part
   with no fingerprint), or `AUTOHYBRID_CAPTURE_CACHE=0`: every rank captures on its
   own, as before (a model that differs across ranks is then caught by the plan's
   model-hash check). All ranks holding a copy of the same origin: each uses its own.
2. otherwise rank 0 captures (or takes its memo) and broadcasts the serialized graph,
   or what its capture raised, which every rank then raises (groups.from_rank_zero);
3. every rank loads it (`capture.capture_from`, fingerprint-checked) and they agree:
   if any rank could not load it, all export for themselves (rank 0 keeps its own
   export), so no job mixes loaded and exported graphs; else each memoizes the loaded
   one.

`AUTOHYBRID_CAPTURE_SHARE=1` turns it on; unset or 0, every rank exports for itself.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable

import torch.distributed as dist
import torch.nn as nn

from ..capture import CapturedGraph, capture, capture_digest, capture_from, memoize
from ..capture_wire import dumps
from .groups import all_ranks_arrived, from_rank_zero

_log = logging.getLogger("autohybrid.capture")


def enabled() -> bool:
    return os.environ.get("AUTOHYBRID_CAPTURE_SHARE", "0") not in ("", "0")


def capture_once(model: nn.Module, example_inputs: Any, loss_fn: Callable | None = None,
                 example_targets: Any = None, *, with_loss: bool = True,
                 autocast: Any = None) -> CapturedGraph:
    """`capture(...)` with the same arguments, exported once for the whole job (see the
    module docstring); a collective: every rank of the default group calls it."""
    args = (model, example_inputs, loss_fn, example_targets)
    kwargs = dict(with_loss=with_loss, autocast=autocast)
    if not enabled() or not dist.is_initialized() or dist.get_world_size() == 1:
        return capture(*args, **kwargs)
    digest, origin = capture_digest(*args, **kwargs)
    views: list[Any] = [None] * dist.get_world_size()
    all_ranks_arrived()  # under the compile bound, not a step's
    dist.all_gather_object(views, (digest, origin))
    digests = {d for d, _ in views}
    if None in digests or len(digests) > 1:
        _log.info("each rank captures: %s", "a rank's model has no portable fingerprint"
                  if None in digests else "the ranks' models or inputs differ")
        return capture(*args, **kwargs)
    origins = {o for _, o in views}
    if len(origins) == 1 and None not in origins:
        return capture(*args, **kwargs)   # every rank memoized the same graph
    kind, payload = from_rank_zero(lambda: _serialized(args, kwargs))
    loaded: CapturedGraph | None = None
    problem = None
    if kind == "graph":
        try:
            loaded = capture_from(payload, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 — any failure: every rank exports itself
            problem = f"{type(exc).__name__}: {exc}"
    else:
        problem = payload
    problems: list[Any] = [None] * dist.get_world_size()
    all_ranks_arrived()  # under the compile bound, not a step's
    dist.all_gather_object(problems, problem)
    failed = [(rank, p) for rank, p in enumerate(problems) if p is not None]
    if failed:   # (no rank memoized the loaded graph: all run their own exports)
        _log.info("each rank captures: rank %d could not use rank 0's graph: %s", *failed[0])
        return capture(*args, **kwargs)
    assert loaded is not None
    memoize(loaded, *args, **kwargs)
    return loaded


def _serialized(args: tuple, kwargs: dict) -> tuple[str, Any]:
    """Rank 0's capture as ("graph", bytes), or ("skip", why) when it cannot be sent (a
    capture that fails raises, on every rank: from_rank_zero)."""
    cap = capture(*args, **kwargs)
    try:
        return "graph", dumps(cap)
    except Exception as exc:  # noqa: BLE001 — a graph torch cannot serialize: no sharing
        return "skip", f"rank 0 could not serialize its graph: {type(exc).__name__}: {exc}"
