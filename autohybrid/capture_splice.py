"""Build the graph a full export gives from exports of p and 2·p blocks of a model.

Owns the graph surgery behind capture per distinct block (capture_blocks.py decides when
it is safe). Given `ep1` (the model exported with its first p blocks) and `ep2` (with its
first 2·p), the full model with q·p blocks is: the placeholders and nodes before the
blocks (P), unit 0 and unit 1 of ep2 (U0, U1), q − 2 copies of U1, and the nodes after
the blocks (S). A copy of U1 for unit j reads unit j − 1 where U1 reads U0, and unit j's
parameters and buffers where U1 reads unit 1's. Names follow torch.fx's counters: a node
`linear_5` of U1 is `linear_{5 + (j-1)·d}` in unit j, where d is how many names of that
base a unit takes (measured between U0 and U1, and between ep1's and ep2's S); the
`nn_module_stack` and placeholder names get the unit's block indices. Fake values of the
copies are computed afresh (views alias their own inputs). Every rule is checked on ep1
and ep2 first — what does not follow it raises Refused, and capture exports the full
model instead. It never touches the model.
"""
from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.export.graph_signature import OutputKind, TensorArgument

from .capture_probe import Refused
from .graph import MODULE_STACK, VAL, fake_mode, refresh_fake

_COUNTER = re.compile(r"^(.*)_(\d+)$")


def _split(name: str) -> tuple[str, int]:
    m = _COUNTER.match(name)
    return (m[1], int(m[2])) if m else (name, 0)


def _join(base: str, num: int) -> str:
    return base if num == 0 else f"{base}_{num}"


class _Units:
    """Block indices in names, module paths and parameter names, grouped p to a unit."""

    def __init__(self, list_path: str, p: int):
        self.p = p
        self.path = re.compile(rf"({re.escape(list_path)}\.)(\d+)(?=\.|$)")
        self.token = re.compile(rf"({re.escape(list_path.replace('.', '_'))}_)(\d+)(?=_|$)")
        self.fqn = re.compile(rf"^{re.escape(list_path)}\.(\d+)\.")

    def of_target(self, target: str | None) -> int | None:
        m = self.fqn.match(target or "")
        return None if m is None else int(m[1]) // self.p

    def of_node(self, node: fx.Node) -> int | None:
        units = {int(m[2]) // self.p for path, _ in (node.meta.get(MODULE_STACK) or {}).values()
                 for m in [self.path.match(path or "")] if m}
        if len(units) > 1:
            raise Refused(f"node {node.name} is in two units {sorted(units)}")
        return units.pop() if units else None

    def shift(self, text: str, units: int) -> str:
        """`text` with its first block index moved by `units` units."""
        bump = lambda m: f"{m[1]}{int(m[2]) + units * self.p}"  # noqa: E731
        return self.token.sub(bump, self.path.sub(bump, text, count=1), count=1)

    def stack(self, meta: dict, units: int) -> dict | None:
        stack = meta.get(MODULE_STACK)
        if stack is None:
            return None
        return {self.shift(k, units): (self.shift(path, units), ty)
                for k, (path, ty) in stack.items()}


def _cut(items: list, unit: Callable[[Any], int | None], units: int) -> list[list]:
    """`items` as [before, unit 0, ..., unit units-1, after]; Refused when not that shape."""
    tags = [unit(x) for x in items]
    inside = [i for i, t in enumerate(tags) if t is not None]
    lo, hi = (inside[0], inside[-1] + 1) if inside else (len(items), len(items))
    if any(t is None for t in tags[lo:hi]) or tags[lo:hi] != sorted(tags[lo:hi]) \
            or any(t >= units for t in tags[lo:hi]):
        raise Refused("block parameters, buffers or nodes are not grouped block by block")
    return [items[:lo], *[[x for x in items[lo:hi] if unit(x) == j] for j in range(units)],
            items[hi:]]


def _key(spec: Any) -> tuple:
    return (spec.kind, getattr(spec.arg, "name", None), spec.target, getattr(spec, "persistent", None))


def _move(spec: Any, units: _Units, by: int, name: str | None = None) -> Any:
    arg = TensorArgument(name=name if name is not None else units.shift(spec.arg.name, by))
    return dataclasses.replace(spec, arg=arg, target=units.shift(spec.target, by))


def _specs(specs1: list, specs2: list, units: _Units) -> list[list]:
    """[before, U0, U1, after] of ep2's specs, checked against ep1's and unit to unit."""
    a1, u0_1, b1 = _cut(specs1, lambda s: units.of_target(s.target), 1)
    a2, u0, u1, b2 = _cut(specs2, lambda s: units.of_target(s.target), 2)
    same = lambda xs, ys: [_key(x) for x in xs] == [_key(y) for y in ys]  # noqa: E731
    if not (same(a1, a2) and same(u0_1, u0) and same(b1, b2)):
        raise Refused("the graph signature outside the blocks changes with the number of blocks")
    if not same(u1, [_move(s, units, 1) for s in u0]):
        raise Refused("unit 1's parameters and buffers are not unit 0's renamed")
    if any(not isinstance(s.arg, TensorArgument) for s in u0):
        raise Refused("a block input that is not a tensor")
    return [a2, u0, u1, b2]


def _shifts(pairs: list[tuple[fx.Node, fx.Node]], what: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for a, b in pairs:
        (base, n), (base_b, m) = _split(a.name), _split(b.name)
        if a.op != b.op or a.target != b.target or base != base_b \
                or out.setdefault(base, m - n) != m - n:
            raise Refused(f"{what}: {a.name} ({a.target}) and {b.name} ({b.target}) do not match")
    return out


def _moves(pairs: list[tuple[fx.Node, fx.Node]], what: str) -> dict[fx.Node, int]:
    """How far each name of ep2 moved from ep1's (one unit more)."""
    out = {}
    for a, b in pairs:
        (base, n), (base_b, m) = _split(a.name), _split(b.name)
        if a.op != b.op or a.target != b.target or base != base_b or \
                a.meta.get(MODULE_STACK) != b.meta.get(MODULE_STACK):
            raise Refused(f"{what}: {a.name} ({a.target}) and {b.name} ({b.target}) differ")
        out[b] = m - n
    return out


def splice(ep1: Any, ep2: Any, list_path: str, p: int, q: int) -> SimpleNamespace:
    """The exported program (graph_module, graph_signature, constants) of q units."""
    units = _Units(list_path, p)
    g1, g2 = ep1.graph_module.graph, ep2.graph_module.graph
    if set(ep1.constants) != set(ep2.constants):
        raise Refused("the blocks hold tensor constants")
    ins = _specs(ep1.graph_signature.input_specs, ep2.graph_signature.input_specs, units)
    muts = [[s for s in ep.graph_signature.output_specs if s.kind == OutputKind.BUFFER_MUTATION]
            for ep in (ep1, ep2)]
    outs = _specs(*muts, units)
    users = [s for s in ep2.graph_signature.output_specs if s.kind != OutputKind.BUFFER_MUTATION]
    c1 = [n for n in g1.nodes if n.op not in ("placeholder", "output")]
    c2 = [n for n in g2.nodes if n.op not in ("placeholder", "output")]
    pre, u0, u1, post = _cut(c2, units.of_node, 2)
    if len(u0) != len(u1) or not u0 or len(c1) != len(pre) + len(u0) + len(post):
        raise Refused("unit 0 and unit 1 differ in size")
    if any(n.op == "get_attr" or "unbacked_bindings" in n.meta for n in u0 + u1):
        raise Refused("a block holds a submodule call or a data-dependent size")
    if [(n.name, n.target) for n in c1[len(pre):len(pre) + len(u0)]] != \
            [(n.name, n.target) for n in u0]:
        raise Refused("unit 0 changes with the number of blocks")
    d = _shifts(list(zip(u0, u1)), "unit 0 and unit 1")
    for a, b in zip(u0, u1):
        if units.stack(a.meta, 1) != b.meta.get(MODULE_STACK):
            raise Refused(f"module paths of {b.name} are not those of {a.name} moved one unit")
    # names before and after the blocks may count names made inside them (torch.export
    # hoists the sym_size nodes of the inputs to the top at the end): one step per unit
    moves = _moves(list(zip(c1[:len(pre)], pre)), "the nodes before the blocks")
    moves.update(_moves(list(zip(c1[len(pre) + len(u0):], post)), "the nodes after the blocks"))
    if any(d.get(_split(n.name)[0], moves[n]) != moves[n] for n in post):
        raise Refused("names after the blocks do not move by a unit's count")
    return _Builder(ep2, units, q, ins, (pre, u0, u1, post), (d, moves)).build(outs, users)


class _Builder:
    """Emits the q-unit graph from ep2's parts (checked by `splice`)."""

    def __init__(self, ep2: Any, units: _Units, q: int, ins: list[list], parts: tuple,
                 shifts: tuple[dict, dict]):
        self.ep2, self.units, self.q, self.ins = ep2, units, q, ins
        self.pre, self.u0, self.u1, self.post = parts
        self.d, self.e = shifts
        self.mode = fake_mode(ep2.graph_module)
        self.graph = fx.Graph()
        self.graph._codegen = ep2.graph_module.graph._codegen
        self.env: dict[fx.Node, fx.Node] = {}            # ep2 node → node as it is
        self.phs = {n.name: n for n in ep2.graph_module.graph.nodes if n.op == "placeholder"}
        self.unit_ph: list[dict[str, fx.Node]] = []       # per unit: U1 name → new placeholder
        self.unit_nodes: list[dict[fx.Node, fx.Node]] = []  # per unit: U1 node → new node
        self.index0 = {n: i for i, n in enumerate(self.u0)}
        self.specs: list = []

    def _emit(self, template: fx.Node, name: str, args: tuple, kwargs: dict,
              stack_units: int, fresh: bool) -> fx.Node:
        if template.op == "placeholder":
            node = self.graph.placeholder(name)
        else:
            node = self.graph.create_node(template.op, template.target, args, kwargs, name=name)
        if node.name != name:
            raise Refused(f"torch.fx named {name} as {node.name}")
        node.meta = dict(template.meta)
        if stack_units and MODULE_STACK in node.meta:
            node.meta[MODULE_STACK] = self.units.stack(template.meta, stack_units)
        if fresh and node.op == "placeholder":
            val = template.meta[VAL]
            with self.mode:
                node.meta[VAL] = torch.empty_strided(
                    val.shape, val.stride(), dtype=val.dtype, device=val.device,
                    requires_grad=val.requires_grad)
        elif fresh and node.op == "call_function":
            refresh_fake(node, self.mode)
        return node

    def _copy(self, template: fx.Node, lookup: Callable[[fx.Node], fx.Node], name: str,
              stack_units: int) -> fx.Node:
        args, kwargs = fx.node.map_arg((template.args, template.kwargs), lookup)
        return self._emit(template, name, args, kwargs, stack_units, fresh=True)

    def _placeholders(self) -> None:
        before, s0, s1, after = self.ins
        for spec in before:
            self._keep(self.phs[spec.arg.name])
        for j in range(self.q):
            made: dict[str, fx.Node] = {}
            for spec0, spec1 in zip(s0, s1):
                if j < 2:
                    made[spec1.arg.name] = self._keep(self.phs[(spec0, spec1)[j].arg.name])
                    self.specs.append((spec0, spec1)[j])
                    continue
                moved = _move(spec1, self.units, j - 1)
                made[spec1.arg.name] = self._emit(self.phs[spec1.arg.name], moved.arg.name,
                                                  (), {}, 0, fresh=True)
                self.specs.append(moved)
            self.unit_ph.append(made)
        for spec in after:
            self._keep(self.phs[spec.arg.name])
        self.specs = [*before, *self.specs, *after]

    def _keep(self, node: fx.Node, name: str | None = None) -> fx.Node:
        """`node` as ep2 has it (renamed to `name`), reading the new graph's nodes."""
        args = fx.node.map_arg((node.args, node.kwargs), lambda a: self.env[a])
        new = self._emit(node, name or node.name, *args, 0, False)
        self.env[node] = new
        return new

    def _lookup(self, unit: int) -> Callable[[fx.Node], fx.Node]:
        """Where U1's (or, unit = q, S's) inputs are in the new graph, for unit `unit`."""
        s0, s1 = self.ins[1], self.ins[2]
        ph_unit = {s.arg.name: (-1, s1[i].arg.name) for i, s in enumerate(s0)}
        ph_unit.update({s.arg.name: (0, s.arg.name) for s in s1})

        def lookup(node: fx.Node) -> fx.Node:
            if node.name in ph_unit and node.op == "placeholder":
                back, name = ph_unit[node.name]
                return self.unit_ph[unit + back][name]
            if node in self.index0:
                return self.unit_nodes[unit - 1][self.u1[self.index0[node]]]
            if unit < self.q and node in self.unit_nodes[unit]:
                return self.unit_nodes[unit][node]
            if node in self.env and (node.op == "placeholder" or node in self.pre_set
                                     or node in self.post_set):
                return self.env[node]
            raise Refused(f"{node.name} is read across units in a way a copy cannot follow")
        return lookup

    def build(self, outs: list[list], users: list) -> SimpleNamespace:
        self.pre_set, self.post_set = set(self.pre), set(self.post)
        self._placeholders()
        for node in self.pre:
            base, num = _split(node.name)
            self._keep(node, _join(base, num + (self.q - 2) * self.e[node]))
        for j in range(self.q):
            if j < 2:
                nodes = (self.u0, self.u1)[j]
                self.unit_nodes.append({t: self._keep(n) for t, n in zip(self.u1, nodes)})
                continue
            self.unit_nodes.append({})
            lookup = self._lookup(j)
            for t in self.u1:
                base, num = _split(t.name)
                self.unit_nodes[j][t] = self._copy(t, lookup, _join(base, num + (j - 1) * self.d[base]),
                                                   j - 1)
        lookup = self._lookup(self.q - 1)  # S reads unit q-1 where ep2's S read unit 1
        for t in self.post:
            base, num = _split(t.name)
            new = self._copy(t, lookup, _join(base, num + (self.q - 2) * self.e[t]), 0)
            self.env[t] = new
        return self._finish(outs, users, lookup)

    def _finish(self, outs: list[list], users: list, lookup) -> SimpleNamespace:
        """The output node and output specs: mutations before, per unit, after; user outputs."""
        old_out = next(n for n in reversed(self.ep2.graph_module.graph.nodes) if n.op == "output")
        by_name = {n.name: n for n in self.ep2.graph_module.graph.nodes}
        before, m0, m1, after = outs
        specs, results = [], []
        for spec in before:
            results.append(lookup(by_name[spec.arg.name]))
            specs.append(spec)
        for j in range(self.q):
            for spec0, spec1 in zip(m0, m1):
                new = self.unit_nodes[j].get(by_name[spec1.arg.name])
                if new is None:
                    raise Refused(f"buffer mutation {spec1.target} is not computed in its block")
                results.append(new)
                specs.append(spec0 if j == 0 else _move(spec1, self.units, j - 1, new.name))
        for spec in [*after, *users]:
            if not isinstance(spec.arg, TensorArgument):
                raise Refused(f"an output that is not a tensor ({spec.arg})")
            results.append(lookup(by_name[spec.arg.name]))
            specs.append(dataclasses.replace(spec, arg=TensorArgument(name=results[-1].name)))
        out = self.graph.output(tuple(results))
        out.meta = dict(old_out.meta)
        gm = fx.GraphModule(self.ep2.graph_module, self.graph)
        signature = SimpleNamespace(input_specs=self.specs, output_specs=specs)
        return SimpleNamespace(graph_module=gm, graph_signature=signature,
                               constants=self.ep2.constants)
