"""Errors that name the culprit: which pass, graph node and model module an exception from
torch (or from a bug of ours) came out of, and what to do about it.

The passes' runner (passes/manager.py) and the compiled model's steps (compiled.py) wrap
any exception that is not already an AutohybridError with these: `PassFailure` for a
pass, `StepFailure` for running a rewritten graph. The node is found from the
exception's traceback — the innermost frame of a pass holding an `fx.Node` in a local
variable, or the line of an fx GraphModule's generated code that was running — and its
module path and source line come from the node's meta (`nn_module_stack`, stack trace).
Nothing here decides anything; it only reads tracebacks and graphs.

    >>> try:
    ...     run_pass(gm)
    ... except Exception as exc:
    ...     raise PassFailure.of(exc, "tensor_parallel") from exc
"""
from __future__ import annotations

import linecache
import re
import traceback
from typing import Any

import torch.fx as fx

from .errors import PlanError, RuntimeFailure
from .graph import module_path, op_name, source_line

_ASSIGNED = re.compile(r"^\s*(\w+)\s*=")


def describe(node: fx.Node) -> str:
    """`node 'mul_3' (aten.mul.Tensor) in module model.layers.0.self_attn.rotary_emb
    (`emb = torch.cat(...)`)` — as much of that as the node's meta knows."""
    text = f"node {node.name!r} ({op_name(node)})"
    path = module_path(node)
    if path:
        text += f" in module {path}"
    line = user_line(node)
    if line:
        text += f" ({line})"
    return text


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in \S+\n\s*(.*)')


def user_line(node: fx.Node) -> str:
    """`file.py:12: `code`` of the innermost frame of the model's own code (not torch's,
    nor autohybrid's capture wrapper) recorded for `node`; else the last source line."""
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    for filename, lineno, code in reversed(frames):
        if "site-packages" in filename or "/torch/" in filename \
                or filename.endswith("autohybrid/capture.py"):
            continue
        return f"{filename}:{lineno}: `{code.strip()}`"
    line = source_line(node)
    return f"`{line}`" if line else ""


def _reason(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:400]}"


def node_in_traceback(exc: BaseException) -> fx.Node | None:
    """The fx.Node the innermost frame holding one was working on (a pass's loop var)."""
    found = None
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        local = frame.f_locals
        candidates = [local.get("node"), local.get("n"),
                      *[v for v in local.values() if isinstance(v, fx.Node)]]
        node = next((c for c in candidates if isinstance(c, fx.Node)), None)
        if node is not None:
            found = node
    return found


def running_node(exc: BaseException) -> fx.Node | None:
    """The node of an fx GraphModule's generated code whose line raised, innermost."""
    found = None
    for frame, lineno in traceback.walk_tb(exc.__traceback__):
        gm = frame.f_locals.get("self")
        if not isinstance(gm, fx.GraphModule) or frame.f_code.co_name != "forward":
            continue
        match = _ASSIGNED.match(linecache.getline(frame.f_code.co_filename, lineno))
        if match is None:
            continue
        node = next((n for n in gm.graph.nodes if n.name == match.group(1)), None)
        if node is not None:
            found = node
    return found


class PassFailure(PlanError):
    """A pass raised something that is not an AutohybridError (torch, or a bug of ours)."""

    def __init__(self, message: str, pass_name: str, node: str | None, module: str | None):
        super().__init__(message)
        self.pass_name, self.node, self.module = pass_name, node, module

    def __reduce__(self):  # sent between ranks (runtime/groups.from_rank_zero)
        return type(self), (str(self), self.pass_name, self.node, self.module)

    @classmethod
    def of(cls, exc: BaseException, pass_name: str) -> "PassFailure":
        node = node_in_traceback(exc)
        where = f" at {describe(node)}" if node is not None else ""
        message = (f"pass {pass_name!r} failed{where}: {_reason(exc)}\n"
                   f"  what to do: pin a plan without what this pass rewrites (e.g. "
                   f"constraints=ah.Constraints(tp=1) for tensor_parallel, pp=1 for "
                   f"pipeline_split), or switch the pass off to bisect "
                   f"(AUTOHYBRID_DISABLE_PASSES={pass_name}), and report the model")
        return cls(message, pass_name, node.name if node is not None else None,
                   module_path(node) if node is not None else None)


class StepFailure(RuntimeFailure):
    """Running a rewritten graph raised something that is not an AutohybridError."""

    def __init__(self, message: str, node: str | None, module: str | None):
        super().__init__(message)
        self.node, self.module = node, module

    def __reduce__(self):
        return type(self), (str(self), self.node, self.module)

    @classmethod
    def of(cls, exc: BaseException, what: str, plan: Any = None) -> "StepFailure":
        node = running_node(exc)
        where = f" at {describe(node)}" if node is not None else ""
        made_by = node.meta.get("ah_pass") if node is not None else None
        layout = f" under plan {plan.mesh.describe()}" if plan is not None else ""
        hint = (f"the node was inserted by pass {made_by!r}: switch it off to bisect "
                f"(AUTOHYBRID_DISABLE_PASSES={made_by}) or pin another plan"
                if made_by else "pin another plan (constraints=ah.Constraints(...)) or "
                "switch passes off to bisect (AUTOHYBRID_DISABLE_PASSES=overlap,fusion)")
        message = (f"{what} failed{layout}{where}: {_reason(exc)}\n  what to do: {hint}, "
                   "and report the model")
        return cls(message, node.name if node is not None else None,
                   module_path(node) if node is not None else None)
