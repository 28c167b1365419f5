"""Build the graph a full export gives from exports of k·p and (k + 1)·p blocks of a model.

Owns the graph surgery behind capture per distinct block (capture_blocks.py decides when
it is safe). Given `ep_a` (the model exported with its first k units of p blocks) and
`ep_b` (with its first k + 1), the full model with q units is: the nodes before the
blocks, units 0..k of ep_b as they are, q − k − 1 copies of unit k, and the nodes after
the blocks. A copy for unit j reads unit j − 1 where the template reads unit k − 1, and
unit j's parameters and buffers where it reads unit k's. Names follow torch.fx's
counters: a node `linear_12` of the template is `linear_{12 + (j − k)·d}` in unit j,
where d is how many names of that base a unit takes — measured between units k − 1 and
k, and required to be the same between units k − 2 and k − 1. (torch.export spends names
on symbolic-size nodes it drops later; Hugging Face GPT-2 and Llama do so in units 0 and
2 only, so they need k = 5; the zoo's GPT and Llama are in step from unit 0, k = 2.)
Names before and after the blocks move by what they moved from ep_a to ep_b, once per
unit. The `nn_module_stack` and placeholder names get the unit's block indices. A copy
shares the fake value (`meta["val"]`: shape with the same symbols, stride, dtype) of the
node it copies — computing it again costs what the export costs, and fake values are
read for their metadata, never for storage identity. Every rule is checked on ep_a and
ep_b first — what does not follow it raises Refused, and capture exports the full model
instead. It never touches the model.
"""
from __future__ import annotations

import dataclasses
import itertools
import re
from types import SimpleNamespace
from typing import Any, Callable

import torch.fx as fx
from torch.export.graph_signature import ExportGraphSignature, OutputKind, TensorArgument

from .capture_probe import Refused
from .graph import MODULE_STACK

_COUNTER = re.compile(r"^(.*)_(\d+)$")
#: how many units the smaller export holds, tried in this order: the larger export's units
#: 0..kept are used as they are and its last is the template of every copy (a larger
#: count lets torch.export's naming settle, see the module docstring)
KEPT_TRIES = (2, 5)


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
    return (spec.kind, getattr(spec.arg, "name", None), spec.target,
            getattr(spec, "persistent", None))


def _move(spec: Any, units: _Units, by: int, name: str | None = None) -> Any:
    arg = TensorArgument(name=name if name is not None else units.shift(spec.arg.name, by))
    return dataclasses.replace(spec, arg=arg, target=units.shift(spec.target, by))


def _spec_groups(specs_a: list, specs_b: list, units: _Units, kept: int) -> list[list[list]]:
    """`_specs` for each run of one kind (parameters, then buffers, ...): export lists all
    parameters before any buffer, so the blocks' are grouped within each kind."""
    def runs(specs: list) -> list[list]:
        return [list(g) for _, g in itertools.groupby(specs, key=lambda s: s.kind)]

    runs_a, runs_b = runs(specs_a), runs(specs_b)
    if [r[0].kind for r in runs_a] != [r[0].kind for r in runs_b]:
        raise Refused("the graph signature changes with the number of blocks")
    return [_specs(a, b, units, kept) for a, b in zip(runs_a, runs_b)]


def _specs(specs_a: list, specs_b: list, units: _Units, kept: int) -> list[list]:
    """[before, unit 0, ..., unit K, after] of ep_b's specs, checked against ep_a's."""
    cut_a = _cut(specs_a, lambda s: units.of_target(s.target), kept)
    cut_b = _cut(specs_b, lambda s: units.of_target(s.target), kept + 1)
    same = lambda xs, ys: [_key(x) for x in xs] == [_key(y) for y in ys]  # noqa: E731
    if not (same(cut_a[0], cut_b[0]) and same(cut_a[-1], cut_b[-1])
            and all(same(x, y) for x, y in zip(cut_a[1:-1], cut_b[1:-1]))):
        raise Refused("the graph signature outside the blocks changes with the number of blocks")
    if not same(cut_b[-2], [_move(s, units, 1) for s in cut_b[-3]]):
        raise Refused(f"unit {kept}'s parameters and buffers are not unit {kept - 1}'s renamed")
    if any(not isinstance(s.arg, TensorArgument) for s in cut_b[-2]):
        raise Refused("a block input that is not a tensor")
    return cut_b


def _shifts(pairs: list[tuple[fx.Node, fx.Node]], what: str) -> dict[str, int]:
    """How many names of each base one unit takes (the same for every node of a base)."""
    out: dict[str, int] = {}
    for a, b in pairs:
        (base, n), (base_b, m) = _split(a.name), _split(b.name)
        if a.op != b.op or a.target != b.target or base != base_b:
            raise Refused(f"{what}: {a.name} ({a.target}) and {b.name} ({b.target}) differ")
        if out.setdefault(base, m - n) != m - n:
            raise Refused(f"{what}: {a.name} and {b.name} are named out of step")
    return out


def _moves(pairs: list[tuple[fx.Node, fx.Node]], what: str) -> dict[fx.Node, int]:
    """How far each name of ep_b moved from ep_a's (one unit more)."""
    out = {}
    for a, b in pairs:
        (base, n), (base_b, m) = _split(a.name), _split(b.name)
        if a.op != b.op or a.target != b.target or base != base_b or \
                a.meta.get(MODULE_STACK) != b.meta.get(MODULE_STACK):
            raise Refused(f"{what}: {a.name} ({a.target}) and {b.name} ({b.target}) differ")
        out[b] = m - n
    return out


def _compute(ep: Any) -> list[fx.Node]:
    return [n for n in ep.graph_module.graph.nodes if n.op not in ("placeholder", "output")]


def splice(ep_a: Any, ep_b: Any, list_path: str, p: int, q: int, kept: int) -> SimpleNamespace:
    """The exported program (graph_module, graph_signature, constants) of q units, from
    ep_a (`kept` units of p blocks) and ep_b (kept + 1 units)."""
    units = _Units(list_path, p)
    if q < kept + 2:
        raise Refused(f"{q} units: the small export is the full one")
    if set(ep_a.constants) != set(ep_b.constants):
        raise Refused("the blocks hold tensor constants")
    ins = _spec_groups(ep_a.graph_signature.input_specs, ep_b.graph_signature.input_specs,
                       units, kept)
    muts = [[s for s in ep.graph_signature.output_specs if s.kind == OutputKind.BUFFER_MUTATION]
            for ep in (ep_a, ep_b)]
    outs = _specs(*muts, units, kept)
    users = [s for s in ep_b.graph_signature.output_specs
             if s.kind != OutputKind.BUFFER_MUTATION]
    cut_a = _cut(_compute(ep_a), units.of_node, kept)
    cut_b = _cut(_compute(ep_b), units.of_node, kept + 1)
    if len({len(u) for u in cut_b[1:-1] + cut_a[1:-1]}) != 1 or not cut_b[1] \
            or len(cut_a[0]) != len(cut_b[0]) or len(cut_a[-1]) != len(cut_b[-1]):
        raise Refused("units differ in size")
    prev, last = cut_b[-3], cut_b[-2]
    if any(n.op == "get_attr" or "unbacked_bindings" in n.meta for n in last):
        raise Refused("a block holds a submodule call or a data-dependent size")
    if any([n.name for n in x] != [n.name for n in y] for x, y in zip(cut_a[1:-1], cut_b[1:-1])):
        raise Refused("the first units change with the number of blocks")
    d = _shifts(list(zip(prev, last)), f"units {kept - 1} and {kept}")
    # the last three units must take names in step (torch.export spends names on
    # symbolic-size nodes it drops later, in some of the first units only)
    if _shifts(list(zip(cut_b[-4], prev)), f"units {kept - 2} and {kept - 1}") != d:
        raise Refused(f"torch.export names units {kept - 2}, {kept - 1} and {kept} out of step")
    for a, b in zip(prev, last):
        if units.stack(a.meta, 1) != b.meta.get(MODULE_STACK):
            raise Refused(f"module paths of {b.name} are not those of {a.name} moved one unit")
    # names before and after the blocks may count names made inside them (torch.export
    # hoists the sym_size nodes of the inputs to the top at the end): one step per unit
    moves = _moves(list(zip(cut_a[0], cut_b[0])), "the nodes before the blocks")
    moves.update(_moves(list(zip(cut_a[-1], cut_b[-1])), "the nodes after the blocks"))
    if any(d.get(_split(n.name)[0], moves[n]) != moves[n] for n in cut_b[-1]):
        raise Refused("names after the blocks do not move by a unit's count")
    return _Builder(ep_b, units, q, kept, ins, cut_b, (d, moves)).build(outs, users)


class _Builder:
    """Emits the q-unit graph from ep_b's parts (checked by `splice`)."""

    def __init__(self, ep_b: Any, units: _Units, q: int, kept: int, ins: list[list[list]],
                 parts: list[list], shifts: tuple[dict, dict]):
        self.ep_b, self.units, self.q, self.kept_units, self.ins = ep_b, units, q, kept, ins
        self.pre, self.kept, self.post = parts[0], parts[1:-1], parts[-1]
        self.last = self.kept[-1]              # the template of every copy
        self.d, self.e = shifts
        self.graph = fx.Graph()
        self.graph._codegen = ep_b.graph_module.graph._codegen
        self.env: dict[fx.Node, fx.Node] = {}            # ep_b node → node as it is
        self.phs = {n.name: n for n in ep_b.graph_module.graph.nodes if n.op == "placeholder"}
        self.unit_ph: list[dict[str, fx.Node]] = []       # per unit: template name → placeholder
        self.unit_nodes: list[dict[fx.Node, fx.Node]] = []  # per unit: template node → node
        self.index_prev = {n: i for i, n in enumerate(self.kept[-2])}
        self.specs: list = []

    def _emit(self, template: fx.Node, name: str, args: tuple, kwargs: dict,
              stack_units: int) -> fx.Node:
        if template.op == "placeholder":
            node = self.graph.placeholder(name)
        else:
            node = self.graph.create_node(template.op, template.target, args, kwargs, name=name)
        if node.name != name:
            raise Refused(f"torch.fx named {name} as {node.name}")
        node.meta = dict(template.meta)
        if stack_units and MODULE_STACK in node.meta:
            node.meta[MODULE_STACK] = self.units.stack(template.meta, stack_units)
        return node

    def _copy(self, template: fx.Node, lookup: Callable[[fx.Node], fx.Node], name: str,
              stack_units: int) -> fx.Node:
        args, kwargs = fx.node.map_arg((template.args, template.kwargs), lookup)
        return self._emit(template, name, args, kwargs, stack_units)

    def _placeholders(self) -> None:
        """Parameters and buffers: for each kind, before the blocks, unit by unit, after."""
        self.unit_ph = [{} for _ in range(self.q)]
        for before, *kept, after in self.ins:
            for spec in before:
                self._keep(self.phs[spec.arg.name])
                self.specs.append(spec)
            for j in range(self.q):
                for i, template in enumerate(kept[-1]):
                    if j <= self.kept_units:
                        node = self._keep(self.phs[kept[j][i].arg.name])
                        self.specs.append(kept[j][i])
                    else:
                        moved = _move(template, self.units, j - self.kept_units)
                        node = self._emit(self.phs[template.arg.name], moved.arg.name, (), {}, 0)
                        self.specs.append(moved)
                    self.unit_ph[j][template.arg.name] = node
            for spec in after:
                self._keep(self.phs[spec.arg.name])
                self.specs.append(spec)

    def _keep(self, node: fx.Node, name: str | None = None) -> fx.Node:
        """`node` as ep_b has it (renamed to `name`), reading the new graph's nodes."""
        args = fx.node.map_arg((node.args, node.kwargs), lambda a: self.env[a])
        new = self._emit(node, name or node.name, *args, 0)
        self.env[node] = new
        return new

    def _lookup(self, unit: int) -> Callable[[fx.Node], fx.Node]:
        """Where the template's (or the suffix's) inputs are for unit `unit` (> kept)."""
        prev = [s for group in self.ins for s in group[-3]]
        last = [s for group in self.ins for s in group[-2]]
        ph_unit = {s.arg.name: (-1, last[i].arg.name) for i, s in enumerate(prev)}
        ph_unit.update({s.arg.name: (0, s.arg.name) for s in last})

        def lookup(node: fx.Node) -> fx.Node:
            if node.op == "placeholder" and node.name in ph_unit:
                back, name = ph_unit[node.name]
                return self.unit_ph[unit + back][name]
            if node in self.index_prev:
                return self.unit_nodes[unit - 1][self.last[self.index_prev[node]]]
            if node in self.unit_nodes[unit]:
                return self.unit_nodes[unit][node]
            if node in self.env and (node.op == "placeholder" or node in self.outside):
                return self.env[node]
            raise Refused(f"{node.name} is read across units in a way a copy cannot follow")
        return lookup

    def build(self, outs: list[list], users: list) -> SimpleNamespace:
        """The new graph: placeholders, before, units (kept, then copies), after, output."""
        self.outside = set(self.pre) | set(self.post)
        self._placeholders()
        copies = self.q - self.kept_units - 1
        for node in self.pre:
            base, num = _split(node.name)
            self._keep(node, _join(base, num + copies * self.e[node]))
        for j in range(self.q):
            if j <= self.kept_units:
                self.unit_nodes.append({t: self._keep(n) for t, n in zip(self.last, self.kept[j])})
                continue
            self.unit_nodes.append({})
            lookup = self._lookup(j)
            for t in self.last:
                base, num = _split(t.name)
                name = _join(base, num + (j - self.kept_units) * self.d[base])
                self.unit_nodes[j][t] = self._copy(t, lookup, name, j - self.kept_units)
        lookup = self._lookup(self.q - 1)  # the suffix reads unit q-1 where ep_b's read kept
        for t in self.post:
            base, num = _split(t.name)
            self.env[t] = self._copy(t, lookup, _join(base, num + copies * self.e[t]), 0)
        return self._finish(outs, users, lookup)

    def _finish(self, outs: list[list], users: list, lookup) -> SimpleNamespace:
        """The output node and output specs: mutations before, per unit, after; user outputs."""
        nodes = self.ep_b.graph_module.graph.nodes
        old_out = next(n for n in reversed(nodes) if n.op == "output")
        by_name = {n.name: n for n in nodes}
        before, *kept, after = outs
        specs, results = [], []
        for spec in before:
            results.append(lookup(by_name[spec.arg.name]))
            specs.append(spec)
        for j in range(self.q):
            for i, template in enumerate(kept[-1]):
                spec = kept[j][i] if j <= self.kept_units else template
                new = self.unit_nodes[j].get(by_name[template.arg.name])
                if new is None:
                    raise Refused(f"buffer mutation {spec.target} is not computed in its block")
                if j <= self.kept_units and new.name != spec.arg.name:
                    raise Refused(f"buffer mutation {spec.target} is out of place in its unit")
                results.append(new)
                specs.append(spec if j <= self.kept_units else
                             _move(template, self.units, j - self.kept_units, new.name))
        for spec in [*after, *users]:
            if not isinstance(spec.arg, TensorArgument):
                raise Refused(f"an output that is not a tensor ({spec.arg})")
            results.append(lookup(by_name[spec.arg.name]))
            specs.append(dataclasses.replace(spec, arg=TensorArgument(name=results[-1].name)))
        out = self.graph.output(tuple(results))
        out.meta = dict(old_out.meta)
        gm = fx.GraphModule(self.ep_b.graph_module, self.graph)
        signature = ExportGraphSignature(input_specs=list(self.specs), output_specs=list(specs))
        return SimpleNamespace(graph_module=gm, graph_signature=signature,
                               constants=self.ep_b.constants)
