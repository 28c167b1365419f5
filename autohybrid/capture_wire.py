"""A captured graph as bytes, and back: how one rank's capture serves the others.

Owns the wire format (torch.export's own serializer for the graph, without the model's
weights) and the fingerprint a loaded graph is checked against. It does not decide who
captures or move the bytes: runtime/capture_share.py does.

Why: every rank of a job compiles the same model, and exporting it costs seconds (per
rank, on cores the ranks share); loading torch.export's serialized form costs a tenth
of that. What travels: the exported program (graph, signature, symbolic shapes, node
meta such as `nn_module_stack` and stack traces), its tensor constants, and what the
exporting ShapeEnv knows of the graph's symbols beyond that (`_facts`: every symbol's
value range, the guards and deferred asserts export recorded); what does not: parameters
and buffers, which the loading rank takes from its own model (they are placeholders of
the graph, never baked into it). The loaded graph is checked: its `fingerprint` (graph
hash, module paths and stack traces of every node, placeholder roles, dim roles, symbol
ranges) must equal the sender's, else `WireMismatch`.

Why the ShapeEnv's facts travel: torch.export's serializer writes the ranges of its
`range_constraints` only, the symbols of the inputs' *sizes*, and no guards. An example
input that is a view (`ids[:, :-1]`, a batch sliced from a longer sequence) is exported
with a symbolic *stride* too, which the loaded ShapeEnv then knew a hint for but no range:
the first fake kernel a pass reran on an expression holding it (tensor_parallel at the
loss's `reshape(-1, V)` under tp 2 + sp) failed with torch's "vr must not be None for
symbol s48", where the exporting process had the range (and the guards, e.g. that the
stride is not the row length, from which a kernel proves facts statically). `loads`
gives the loaded ShapeEnv the sender's ranges and records its guards again, so passes
reason on a loaded graph as on the exported one.

    >>> data = dumps(cap)                        # on the capturing rank
    >>> ep, method, expected = loads(data, wrapper)  # on any rank: wrapper holds its model
"""
from __future__ import annotations

import hashlib
import pickle
from typing import Any

import sympy
import torch
import torch.nn as nn
from torch.export.graph_signature import InputKind

from .errors import CaptureError
from .graph import MODULE_STACK, STACK_TRACE, VAL, fake_mode

_FORMAT = 2   # 2: the ShapeEnv's facts travel (`_facts`)


class WireMismatch(CaptureError):
    """A loaded graph is not the one that was sent (or cannot be loaded here)."""


def fingerprint(cap: Any) -> str:
    """What a loaded capture must share with the sent one: the graph hash (ops, wiring,
    shapes, dtypes, placeholder roles), every node's module stack and stack trace, the
    names of parameters, buffers and constants, which symbols are batch or sequence, and
    the value range of every symbol the graph's values mention (`symbol_ranges`)."""
    digest = hashlib.sha256(cap.hash.encode())
    for node in cap.gm.graph.nodes:
        stack = node.meta.get(MODULE_STACK) or {}
        digest.update(repr((node.name, tuple((k, v[0], _type_name(v[1]))
                                             for k, v in stack.items()),
                            node.meta.get(STACK_TRACE))).encode())
    digest.update(repr((cap.param_fqns, cap.buffer_fqns, sorted(cap.constants),
                        cap.mutated_buffers, cap.user_outputs, cap.method,
                        sorted((str(s), r) for s, r in cap.dim_roles.items()))).encode())
    digest.update(repr(sorted(symbol_ranges(cap.gm).items())).encode())
    return digest.hexdigest()


def symbol_ranges(gm: Any) -> dict[str, tuple[int | None, int | None] | None]:
    """{symbol: (lowest, highest) value, None where unbounded} of every symbol in the
    sizes, strides and offsets of `gm`'s fake values and in its symbolic values, as its
    ShapeEnv knows them; a symbol it knows no range for maps to None."""
    env = _shape_env(gm)
    ranges = env.var_to_range if env is not None else {}
    out: dict[str, tuple[int | None, int | None] | None] = {}
    for sym in _symbols(gm):
        vr = ranges.get(sym)
        out[str(sym)] = None if vr is None else (_bound(vr.lower), _bound(vr.upper))
    return out


def _symbols(gm: Any) -> set:
    """The free symbols of every fake value's sizes, strides and storage offset, and of
    every symbolic int, float or bool value, in `gm`."""
    found: set = set()

    def visit(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            for v in (*value.shape, *value.stride(), value.storage_offset()):
                visit(v)
        elif isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            found.update(value.node.expr.free_symbols)
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v)

    for node in gm.graph.nodes:
        visit(node.meta.get(VAL))
    return found


def _bound(value: Any) -> int | None:
    """A range's end as an int, None for ±∞ (torch's int_oo, sympy's oo)."""
    try:
        return int(value) if value.is_finite else None
    except (AttributeError, TypeError):
        return None


def _shape_env(gm: Any) -> Any:
    return getattr(fake_mode(gm), "shape_env", None)


def _facts(cap: Any) -> dict[str, Any]:
    """What the sender's ShapeEnv knows of the graph's symbols beyond torch.export's
    serialized form: their ranges, the guards export recorded on them (in order, each
    with its size_oblivious flag) and the runtime asserts it deferred."""
    env = _shape_env(cap.gm)
    if env is None:
        return {"ranges": {}, "guards": [], "asserts": []}
    return {"ranges": symbol_ranges(cap.gm),
            "guards": [(g.expr, bool(getattr(g, "size_oblivious", False)))
                       for g in env.guards],
            "asserts": [r.expr for rs in env.deferred_runtime_asserts.values() for r in rs]}


def _restore(ep: Any, facts: dict[str, Any]) -> None:
    """Teach the loaded graph's ShapeEnv what the sender's knew (`_facts`): every symbol
    it knows no range for gets the sender's, and the sender's guards and deferred asserts
    are recorded again, in order, as torch records them (so that what a pass's fake
    kernel can prove statically is what it proves on the exported graph). Raises
    `WireMismatch` where a fact does not hold for this graph's symbols."""
    from torch.utils._sympy.numbers import int_oo

    env = _shape_env(ep.graph_module)
    if env is None:
        return
    symbols = {str(s): s for s in _symbols(ep.graph_module)}
    for name, sym in symbols.items():
        known = facts["ranges"].get(name)
        if sym not in env.var_to_range and known is not None:
            low, high = known
            env.constrain_symbol_range(sym, compiler_min=-int_oo if low is None else low,
                                       compiler_max=int_oo if high is None else high)
    unknown = sorted(name for name, sym in symbols.items() if sym not in env.var_to_range)
    if unknown:
        raise WireMismatch(f"the loaded graph's ShapeEnv knows no value range for "
                           f"{', '.join(unknown)}, nor did the sender send one")
    hints = dict(getattr(env, "backed_var_to_val", None) or getattr(env, "var_to_val", {}))
    for expr, oblivious in facts["guards"]:
        expr = _here(expr, symbols)
        if expr is None:
            continue
        if expr.xreplace(hints) is not sympy.true:
            raise WireMismatch(f"the sender's shape guard {expr} does not hold for this "
                               f"rank's example sizes")
        env.evaluate_expr(expr, size_oblivious=oblivious)
    for expr in facts["asserts"]:
        expr = _here(expr, symbols)
        if expr is not None:
            env.guard_or_defer_runtime_assert(expr, "recorded by the exporting process")


def _here(expr: Any, symbols: dict[str, Any]) -> Any:
    """`expr` (unpickled from the sender) over this graph's symbols of the same names;
    None when it names a symbol no value of the graph holds (a fact about a value export
    traced and dropped, which no pass can meet)."""
    if any(str(s) not in symbols for s in expr.free_symbols):
        return None
    return expr.xreplace({s: symbols[str(s)] for s in expr.free_symbols})


def _type_name(t: Any) -> str:
    """A module type in a stack entry: a class (fresh export) or its name (loaded)."""
    return f"{t.__module__}.{t.__qualname__}" if isinstance(t, type) else str(t)


def dumps(cap: Any) -> bytes:
    """`cap` (a CapturedGraph holding its exported program) as bytes for `loads`."""
    from torch._export.serde.serialize import serialize

    if cap.exported is None:
        raise WireMismatch("this capture holds no exported program to send")
    artifact = serialize(cap.exported, serialize_state_dict=False,
                         serialize_constants=True, serialize_example_inputs=False)
    return pickle.dumps({"format": _FORMAT, "torch": torch.__version__,
                         "program": artifact.exported_program,
                         "constants": artifact.constants, "method": cap.method,
                         "state": _state_targets(cap.exported),
                         "shape_facts": _facts(cap),
                         "fingerprint": fingerprint(cap)})


def loads(data: bytes, wrapper: nn.Module) -> tuple[Any, str, str]:
    """(exported program, capture method, expected fingerprint) from `dumps`' bytes; the
    parameters and buffers are `wrapper`'s own (the model + loss module the capture
    exported, on this rank)."""
    from torch._export.serde.serialize import SerializedArtifact, deserialize

    payload = pickle.loads(data)
    if payload.get("format") != _FORMAT or payload.get("torch") != torch.__version__:
        raise WireMismatch(f"the graph was sent by torch {payload.get('torch')} "
                           f"(format {payload.get('format')}); this rank runs torch "
                           f"{torch.__version__} (format {_FORMAT})")
    state = {}
    for is_param, target in payload["state"]:
        try:
            state[target] = (wrapper.get_parameter(target) if is_param
                             else wrapper.get_buffer(target))
        except AttributeError as exc:
            raise WireMismatch(f"this rank's model has no {target[len('model.'):]}") from exc
    artifact = SerializedArtifact(payload["program"], state, payload["constants"], b"")
    try:
        ep = deserialize(artifact)
    except Exception as exc:  # noqa: BLE001 — any failure: the rank exports itself
        raise WireMismatch(f"torch.export could not load the graph: {type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc
    try:
        _restore(ep, payload["shape_facts"])
    except WireMismatch:
        raise
    except Exception as exc:  # noqa: BLE001 — torch refused a fact: the rank exports itself
        raise WireMismatch(f"the loaded graph's ShapeEnv could not take the sender's shape "
                           f"facts: {type(exc).__name__}: {exc}") from exc
    return ep, payload["method"], payload["fingerprint"]


def _state_targets(ep: Any) -> list[tuple[bool, str]]:
    """(is a parameter, target) of what the exported program reads from its state dict:
    parameters and persistent buffers."""
    return [(spec.kind == InputKind.PARAMETER, spec.target)
            for spec in ep.graph_signature.input_specs
            if spec.kind == InputKind.PARAMETER or
            (spec.kind == InputKind.BUFFER and spec.persistent)]
