"""A captured graph as bytes, and back: how one rank's capture serves the others.

Owns the wire format (torch.export's own serializer for the graph, without the model's
weights) and the fingerprint a loaded graph is checked against. It does not decide who
captures or move the bytes: runtime/capture_share.py does.

Why: every rank of a job compiles the same model, and exporting it costs seconds (per
rank, on cores the ranks share); loading torch.export's serialized form costs a tenth
of that. What travels: the exported program (graph, signature, symbolic shapes, node
meta such as `nn_module_stack` and stack traces) and its tensor constants; what does
not: parameters and buffers, which the loading rank takes from its own model (they are
placeholders of the graph, never baked into it). The loaded graph is checked: its
`fingerprint` (graph hash, module paths and stack traces of every node, placeholder
roles, dim roles) must equal the sender's, else `WireMismatch`.

    >>> data = dumps(cap)                        # on the capturing rank
    >>> ep, method, expected = loads(data, wrapper)  # on any rank: wrapper holds its model
"""
from __future__ import annotations

import hashlib
import pickle
from typing import Any

import torch
import torch.nn as nn
from torch.export.graph_signature import InputKind

from .errors import CaptureError
from .graph import MODULE_STACK, STACK_TRACE, graph_hash

_FORMAT = 1


class WireMismatch(CaptureError):
    """A loaded graph is not the one that was sent (or cannot be loaded here)."""


def fingerprint(cap: Any) -> str:
    """What a loaded capture must share with the sent one: the graph hash (ops, wiring,
    shapes, dtypes, placeholder roles), every node's module stack and stack trace, the
    names of parameters, buffers and constants, and which symbols are batch or sequence."""
    digest = hashlib.sha256(cap.hash.encode())
    for node in cap.gm.graph.nodes:
        stack = node.meta.get(MODULE_STACK) or {}
        digest.update(repr((node.name, tuple((k, v[0], _type_name(v[1]))
                                             for k, v in stack.items()),
                            node.meta.get(STACK_TRACE))).encode())
    digest.update(repr((cap.param_fqns, cap.buffer_fqns, sorted(cap.constants),
                        cap.mutated_buffers, cap.user_outputs, cap.method,
                        sorted((str(s), r) for s, r in cap.dim_roles.items()))).encode())
    return digest.hexdigest()


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
    return ep, payload["method"], payload["fingerprint"]


def _state_targets(ep: Any) -> list[tuple[bool, str]]:
    """(is a parameter, target) of what the exported program reads from its state dict:
    parameters and persistent buffers."""
    return [(spec.kind == InputKind.PARAMETER, spec.target)
            for spec in ep.graph_signature.input_specs
            if spec.kind == InputKind.PARAMETER or
            (spec.kind == InputKind.BUFFER and spec.persistent)]
