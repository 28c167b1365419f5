"""The one graph format: keys of `node.meta`, small helpers and `verify(gm)`.

Every graph autohybrid handles is a torch.fx GraphModule in ATen training IR, as
`torch.export.export` produces it, with parameters, buffers and constants lifted to
placeholders. This module owns the names of the meta keys any pass may read or write and
the checks that a graph still has the format. It imports nothing else from autohybrid.
"""
from __future__ import annotations

import contextlib
import contextvars
import hashlib
import math
import operator
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.fx as fx

# node.meta keys ------------------------------------------------------------------------
VAL = "val"                      # FakeTensor (or SymInt / tuple) the node produces
MODULE_STACK = "nn_module_stack"  # {key: (module path, module type)} set by torch.export
STACK_TRACE = "stack_trace"      # user source lines that produced the node
AH_PASS = "ah_pass"              # name of the autohybrid pass that created the node
AH_ROLE = "ah_role"              # on placeholders: "param" | "buffer" | "constant" | "input" | "target"
AH_PARAM = "ah_param"            # on param placeholders: canonical name (tied parameters share it)
AH_BUFFER = "ah_buffer"          # on buffer placeholders: the buffer's name in the model

#: Ops that only re-describe memory (no FLOPs, no new storage in the common case).
VIEW_OPS = frozenset({
    "aten.view.default", "aten.reshape.default", "aten._unsafe_view.default",
    "aten.transpose.int", "aten.permute.default", "aten.t.default", "aten.expand.default",
    "aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.dims", "aten.split.Tensor",
    "aten.split_with_sizes.default", "aten.slice.Tensor", "aten.select.int",
    "aten.alias.default", "aten.detach.default", "aten.flatten.using_ints",
    "aten.unflatten.int", "aten.chunk.default", "aten.unbind.int", "aten.contiguous.default",
    "aten.sym_size.int", "aten.sym_numel.default", "aten.view_as.default",
    "aten.expand_as.default", "aten.dropout.default",
})

#: Python functions torch.export leaves in a graph for arithmetic on symbolic sizes
#: (e.g. `x.view(-1, x.size(-1))` gives `operator.mul` of two SymInts); as torch's own
#: export verifier allows them.
SYM_SIZE_OPS = frozenset({
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv,
    operator.mod, operator.pow, operator.neg, operator.abs, operator.eq, operator.ne,
    operator.lt, operator.le, operator.gt, operator.ge, operator.and_, operator.or_,
    operator.not_, math.ceil, math.floor, math.trunc, round, torch.sym_int, torch.sym_float,
    torch.sym_max, torch.sym_min, torch.sym_not, torch.sym_sqrt, torch.sym_sum, torch.sym_ite,
})


def op_name(node: fx.Node) -> str:
    """`aten.linear.default` for an OpOverload target, else the target's qualified name."""
    target = node.target
    if isinstance(target, str):
        return target
    try:
        return _OP_NAMES[target]
    except KeyError:
        pass
    except TypeError:  # an unhashable target
        return getattr(target, "__qualname__", repr(target))
    if isinstance(target, torch._ops.OpOverload):
        name = f"{target.namespace}.{target._schema.name.split('::')[-1]}.{target._overloadname}"
    else:
        name = getattr(target, "__qualname__", repr(target))
    _OP_NAMES[target] = name
    return name


#: op_name per target (the passes ask for it millions of times while planning)
_OP_NAMES: dict = {}


def schema_args(node: fx.Node) -> dict:
    """An op node's arguments by schema name, defaults filled in (positions as keys for a
    target without a schema)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return {i: a for i, a in enumerate(node.args)}
    out = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            out[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
    return out


def module_path(node: fx.Node) -> str:
    """The dotted path of the innermost module that produced `node` ("" for the top)."""
    stack = node.meta.get(MODULE_STACK) or {}
    if not stack:
        return ""
    path, _ = list(stack.values())[-1]
    return path


def source_line(node: fx.Node) -> str:
    """The last user source line recorded for `node`, or ""."""
    trace = (node.meta.get(STACK_TRACE) or "").strip().splitlines()
    return trace[-1].strip() if trace else ""


def is_param(node: Any) -> bool:
    """Whether `node` is a parameter's placeholder."""
    return isinstance(node, fx.Node) and node.op == "placeholder" \
        and node.meta.get(AH_ROLE) == "param"


def placeholders(gm: fx.GraphModule, role: str | None = None) -> list[fx.Node]:
    nodes = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return [n for n in nodes if role is None or n.meta.get(AH_ROLE) == role]


def output_node(gm: fx.GraphModule) -> fx.Node:
    return next(n for n in reversed(gm.graph.nodes) if n.op == "output")


def graph_hash(gm: fx.GraphModule) -> str:
    """A hash of the graph's structure: ops, argument wiring, shapes and dtypes.

    Equal for two captures of the same model code and configuration, different when a
    layer, a size or a dtype changes. Independent of parameter values and of the device
    (a plan made on the meta device serves the model on CPU or on any GPU of any rank).
    """
    digest = hashlib.sha256()
    for node in gm.graph.nodes:
        val = node.meta.get(VAL)
        shape = tuple(str(s) for s in val.shape) if isinstance(val, torch.Tensor) else None
        dtype = str(val.dtype) if isinstance(val, torch.Tensor) else None
        args = fx.node.map_arg((node.args, node.kwargs), lambda a: f"%{a.name}")
        digest.update(repr((node.op, node.name, op_name(node), _stable(args), shape, dtype,
                            node.meta.get(AH_ROLE))).encode())
    return digest.hexdigest()[:16]


def _stable(obj: Any) -> Any:
    if isinstance(obj, (list, tuple)):
        return tuple(_stable(o) for o in obj)
    if isinstance(obj, dict):
        return tuple(sorted((k, _stable(v)) for k, v in obj.items()))
    if isinstance(obj, torch.device):  # e.g. arange(..., device=...): not part of the model
        return "device"
    if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
        return str(obj)
    if isinstance(obj, torch.SymInt):
        return str(obj)
    return obj if isinstance(obj, (int, float, str, bool, type(None))) else type(obj).__name__


def fake_mode(gm: fx.GraphModule):
    """The FakeTensorMode of `gm`'s fake values (what passes compute new values under)."""
    from torch._guards import detect_fake_mode

    vals = [n.meta[VAL] for n in gm.graph.nodes if isinstance(n.meta.get(VAL), torch.Tensor)]
    return detect_fake_mode(vals)


#: the values `refresh_fake` computed inside `shared_fake_values()`, by op and inputs
_SHARED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("autohybrid_fake_values",
                                                                     default=None)


@contextlib.contextmanager
def shared_fake_values() -> Iterator[None]:
    """Within it, `refresh_fake` gives a node the value computed for an earlier node of
    the same op on inputs of the same metadata (shape, strides, offset, dtype, device,
    requires_grad; symbolic sizes by expression; other arguments by value), under the
    same fake mode, grad mode and autocast state, instead of dispatching again.

    Why: a pass recomputes the fake value of most nodes it touches, and on symbolic
    sizes one fake dispatch costs milliseconds (sympy); a model of 96 identical blocks
    asks the same question 96 times. A fake op's result depends on nothing else, so
    the shared value is what the dispatch would give, except its identity (a view
    shares the first node's input's storage); no pass reads fake storages. Not shared:
    mutating ops, ops other than OpOverloads (getitem is cheap) and results with
    data-dependent (unbacked) sizes, which are new symbols per node."""
    token = _SHARED.set({})
    try:
        yield
    finally:
        _SHARED.reset(token)


def draws_random(node: fx.Node) -> bool:
    """Whether `node` draws from the random generator: an op tagged nondeterministic_seeded,
    except a dropout (or attention's dropout) with p = 0 or in eval mode."""
    if torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    name = getattr(node.target, "__name__", "")
    if "scaled_dot_product" in name:   # (q, k, v, mask, dropout_p, ...)
        p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
        return p != 0.0
    if name.startswith(("native_dropout", "dropout")):   # (x, p, train)
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        return p != 0.0 and train is not False
    return True


def refresh_fake(node: fx.Node, mode) -> None:
    """Recompute `meta["val"]` of call_function `node` from its inputs' values (shared
    with an identical earlier computation inside `shared_fake_values()`)."""
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), _fake_arg)
    shared = _SHARED.get()
    key = _fake_key(node.target, args, kwargs, mode) if shared is not None else None
    if key is not None and key in shared:
        node.meta[VAL] = shared[key]
        return
    with mode:
        node.meta[VAL] = node.target(*args, **kwargs)
    if key is not None:
        from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
        if not free_unbacked_symbols(node.meta[VAL]):
            shared[key] = node.meta[VAL]


def _fake_arg(a: fx.Node) -> Any:
    """An argument's fake value; for a `get_attr` (a higher-order op's body, e.g. a
    `torch.no_grad()` region), the submodule itself."""
    if a.op == "get_attr":
        owner = a.graph.owning_module
        if owner is not None:
            return operator.attrgetter(a.target)(owner)
    return a.meta.get(VAL)


def _fake_key(target: Any, args: Any, kwargs: Any, mode) -> tuple | None:
    """What an OpOverload's fake result depends on (None: not shared)."""
    if not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable:
        return None
    try:
        frozen = _frozen((args, kwargs))
    except TypeError:  # an argument that is not hashable: not shared
        return None
    state = (torch.is_grad_enabled(),
             *((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
               for d in ("cpu", "cuda")))
    return (target, id(mode), state, frozen)


def _frozen(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return ("T", _sizes(obj.shape), _sizes(obj.stride()), _size(obj.storage_offset()),
                obj.dtype, obj.device, obj.requires_grad, obj.layout)
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, *(_frozen(o) for o in obj))
    if isinstance(obj, dict):
        return ("dict", *((k, _frozen(v)) for k, v in obj.items()))
    if isinstance(obj, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("S", type(obj).__name__, obj.node.expr)
    hash(obj)
    return (type(obj).__name__, obj)


def _size(s: Any) -> Any:
    return s.node.expr if isinstance(s, torch.SymInt) else s


def _sizes(sizes: Iterable) -> tuple:
    return tuple(_size(s) for s in sizes)


def new_node(graph: fx.Graph, op: Any, args: Iterable, kwargs: dict | None, *,
             pass_name: str, mode, like: fx.Node | None = None) -> fx.Node:
    """A call_function node created by `pass_name` at the graph's insertion point, with
    its fake value and (from `like`) the module stack and source line of the node it
    stands for."""
    node = graph.call_function(op, tuple(args), kwargs or {})
    node.meta[AH_PASS] = pass_name
    if like is not None:
        for key in (MODULE_STACK, STACK_TRACE):
            if key in like.meta:
                node.meta[key] = like.meta[key]
    refresh_fake(node, mode)
    return node


def lazy_graph_module(root: Any, graph: fx.Graph) -> fx.GraphModule:
    """A GraphModule of `graph` whose Python code is generated when it first runs (or its
    code is read), not at every `recompile()`: the passes recompile after each rewrite
    and the planner's trial never runs the result, and generating the code of a large
    graph costs ~0.1 s each time (torch.fx's private `_LazyGraphModule`, in torch since
    2.2; a plain GraphModule where it is missing)."""
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:   # pragma: no cover (torch without it)
        return fx.GraphModule(root, graph)
    return _LazyGraphModule(root, graph)


def propagate_fake(gm: fx.GraphModule, nodes: Iterable[fx.Node]) -> None:
    """Fill `meta["val"]` of `nodes` (new nodes a pass created) from their inputs' values."""
    mode = fake_mode(gm)
    for node in nodes:
        if node.op == "call_function":
            refresh_fake(node, mode)


class NodeOrder:
    """Positions of `gm`'s nodes, to compare them while a pass edits the graph: numbered
    once, and again only when asked about a node added since (insertions and erasures
    keep the other nodes' order, so their old numbers still compare them)."""

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self.position: dict[fx.Node, int] = {}

    def of(self, nodes: Iterable[fx.Node]) -> Callable[[fx.Node], int]:
        """The position function, valid for comparing `nodes` with each other."""
        if any(n not in self.position for n in nodes):
            self.position = {n: i for i, n in enumerate(self.gm.graph.nodes)}
        return self.position.__getitem__


class GraphFormatError(AssertionError):
    """`verify` found a graph that is not in the one format (a bug in a pass)."""


def verify(gm: fx.GraphModule, pass_name: str = "capture", received: int = 0) -> None:
    """Check the invariants every pass must keep; raise GraphFormatError naming the node.

    - the fx graph lints (def-before-use, one output);
    - every call_function target is an ATen/prim/autohybrid OpOverload or `operator.getitem`
      (or an autohybrid op function, or arithmetic on symbolic sizes: `SYM_SIZE_OPS`);
    - every placeholder has a role and a fake value (the first `received` of a pipeline
      stage's graph, values another stage sends, carry their producer's meta and no
      role); every tensor-producing node has a fake value;
    - every node a pass created says which pass (`meta["ah_pass"]`).
    """
    try:
        gm.graph.lint()
    except Exception as exc:  # fx raises RuntimeError with its own message
        raise GraphFormatError(f"after pass {pass_name!r}: graph does not lint: {exc}") from exc
    placeholders = 0
    for node in gm.graph.nodes:
        where = f"after pass {pass_name!r}, node {node.name!r} ({op_name(node)})"
        if node.op == "placeholder":
            placeholders += 1
            if node.meta.get(AH_ROLE) is None and placeholders > received:
                raise GraphFormatError(f"{where}: placeholder without meta['{AH_ROLE}']")
            if node.meta.get(VAL) is None:
                raise GraphFormatError(f"{where}: placeholder without a fake value")
        elif node.op == "call_function":
            target = node.target
            ok = (isinstance(target, (torch._ops.OpOverload, torch._ops.HigherOrderOperator))
                  or target is operator.getitem or target in SYM_SIZE_OPS
                  or getattr(target, "__module__", "").startswith("autohybrid.ops"))
            if not ok:
                raise GraphFormatError(f"{where}: target {target!r} is not an ATen or autohybrid op")
            returns_nothing = (isinstance(target, torch._ops.OpOverload)
                               and not target._schema.returns)
            if node.meta.get(VAL) is None and not returns_nothing:
                raise GraphFormatError(f"{where}: no fake value in meta['{VAL}']")
        elif node.op in ("call_module", "call_method"):
            raise GraphFormatError(f"{where}: {node.op} nodes are not part of the ATen format")
