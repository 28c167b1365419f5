"""What a batch must be for a captured graph, checked before a step runs on it.

`BatchSpec.of(captured)` reads the graph's input and target placeholders and its
embeddings; `spec.problem(inputs, targets)` says what does not fit (None: it fits), in a
message naming the tensor, what was compiled and the fix:

- each tensor's kind (floating, integer, bool; floating dtypes exactly) and dims, the
  static sizes, one size per symbolic dim of the graph;
- token ids of an embedding fed from the batch within [0, rows), and positions made by
  `arange(length)` for an embedding (GPT's learned positions) within its rows;
- any other shape the graph cannot take (a target of the wrong length, a sequence longer
  than a rotary table): the captured graph run once on meta tensors of the new shapes,
  per new shape signature, so the error names the node before real work starts.

Checks per step are a few comparisons and one min/max over each token tensor; the meta
run happens once per shape signature (none for the example's shapes). This module reads
CapturedGraph and imports nothing that runs a model; the runtime calls it
(compiled.py) and it raises nothing itself.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import sympy
import torch
import torch.fx as fx

from .capture import CapturedGraph
from .graph import AH_ROLE, VAL, module_path

_EMBEDDING = torch.ops.aten.embedding.default
_ARANGES = (torch.ops.aten.arange.default, torch.ops.aten.arange.start)


@dataclass(frozen=True)
class _Slot:
    """One tensor of the batch as captured: its name, dtype and sizes (int or symbol)."""

    what: str
    dtype: torch.dtype
    sizes: tuple[Any, ...]


@dataclass(frozen=True)
class _Lookup:
    """An embedding of `rows` rows indexed by batch tensor `slot`, or by arange(`length`)."""

    module: str
    rows: int
    slot: int | None = None
    length: Any = None


@dataclass
class BatchSpec:
    slots: list[_Slot]
    lookups: list[_Lookup]
    graph: CapturedGraph = field(repr=False)
    #: shape signatures the graph ran on (meta), with the problem found (None: fits)
    tried: dict[tuple, str | None] = field(default_factory=dict)
    #: whether the graph runs on meta tensors at all (tried with the example's shapes)
    meta_ok: bool | None = None

    @classmethod
    def of(cls, cap: CapturedGraph) -> "BatchSpec":
        placeholders = [n for n in cap.gm.graph.nodes if n.op == "placeholder"
                        and n.meta.get(AH_ROLE) in ("input", "target")]
        counters = {"input": 0, "target": 0}
        slots, index = [], {}
        for node in placeholders:
            role = node.meta[AH_ROLE]
            name = "inputs" if role == "input" else "targets"
            val = node.meta.get(VAL)
            index[node] = len(slots)
            slots.append(_Slot(f"{name}[{counters[role]}]", val.dtype,
                               tuple(_size(s) for s in val.shape)))
            counters[role] += 1
        spec = cls(slots, _lookups(cap.gm, index), cap)
        spec.tried[spec._example_key()] = None
        return spec

    def _example_key(self) -> tuple:
        return tuple(tuple(s) for s in self.graph.example_shapes)

    def problem(self, tensors: Sequence[torch.Tensor], equal: Sequence[tuple] = ()
                ) -> str | None:
        """What does not fit in the batch `tensors` (inputs then targets), or None.
        `equal`: pairs of sizes the plan's split of the batch was proven for equal
        (RankProgram.batch_equalities)."""
        if len(tensors) != len(self.slots):
            return None  # counted by the caller, which names inputs and targets
        binding: dict[Any, int] = {}
        bound_by: dict[Any, str] = {}   # symbol → the tensor and dim that bound it
        for slot, t in zip(self.slots, tensors):
            why = _slot_problem(slot, t, binding, bound_by)
            if why:
                return why
        why = _equality_problem(equal, binding, bound_by)
        why = why or self._lookup_problem(tensors, binding)
        return why or self._shape_problem(tensors)

    def _lookup_problem(self, tensors: Sequence[torch.Tensor], binding: dict) -> str | None:
        for lookup in self.lookups:
            if lookup.slot is not None:
                t = tensors[lookup.slot]
                if t.numel() == 0:
                    continue
                low, high = (int(v) for v in torch.aminmax(t))
                if low < 0 or high >= lookup.rows:
                    bad = low if low < 0 else high
                    return (f"{self.slots[lookup.slot].what} holds id {bad}, outside "
                            f"[0, {lookup.rows}) of the embedding {lookup.module} "
                            f"({lookup.rows} rows): give ids below {lookup.rows} (the "
                            "vocabulary), or build the model with a larger one")
            else:
                length = _evaluate(lookup.length, binding)
                if length is not None and length > lookup.rows:
                    return (f"the batch's sequence length {length} exceeds the "
                            f"{lookup.rows} positions of {lookup.module}: give sequences "
                            f"of at most {lookup.rows}, or build the model with more")
        return None

    def _shape_problem(self, tensors: Sequence[torch.Tensor]) -> str | None:
        key = tuple(tuple(t.shape) for t in tensors)
        if key in self.tried:
            return self.tried[key]
        if self.meta_ok is None:  # a graph meta tensors cannot run proves nothing
            shapes = self._example_key()
            example = [torch.empty(s, dtype=slot.dtype, device="meta")
                       for slot, s in zip(self.slots, shapes)]
            self.meta_ok = (len(shapes) == len(self.slots)
                            and _meta_run(self.graph, self.slots, example) is None)
        self.tried[key] = _meta_run(self.graph, self.slots, tensors) if self.meta_ok else None
        return self.tried[key]


def _size(s: Any) -> Any:
    if isinstance(s, torch.SymInt):
        expr = s.node.expr
        return int(expr) if expr.is_number else expr
    return int(s)


def _lookups(gm: fx.GraphModule, index: dict[fx.Node, int]) -> list[_Lookup]:
    out = []
    for node in gm.graph.nodes:
        if node.target is not _EMBEDDING or len(node.args) < 2:
            continue
        weight, ids = node.args[0], node.args[1]
        rows = getattr(weight.meta.get(VAL), "shape", (None,))[0] if isinstance(
            weight, fx.Node) else None
        if not isinstance(rows, int) or not isinstance(ids, fx.Node):
            continue
        where = module_path(node) or node.name
        if ids in index:
            out.append(_Lookup(where, rows, slot=index[ids]))
        elif ids.target in _ARANGES and _arange_from_zero(ids):
            end = ids.args[-1] if ids.target is _ARANGES[1] else ids.args[0]
            val = end.meta.get(VAL) if isinstance(end, fx.Node) else end
            if isinstance(val, (torch.SymInt, int)):
                out.append(_Lookup(where, rows, length=_size(val)))
    return out


def _arange_from_zero(node: fx.Node) -> bool:
    return node.target is _ARANGES[0] or (len(node.args) >= 2 and node.args[0] == 0)


def _slot_problem(slot: _Slot, t: torch.Tensor, binding: dict, bound_by: dict
                  ) -> str | None:
    got, want = t.dtype, slot.dtype
    if got.is_floating_point != want.is_floating_point or (got == torch.bool) != (
            want == torch.bool) or (want.is_floating_point and got != want):
        return (f"{slot.what} has dtype {str(got).removeprefix('torch.')} but the model was "
                f"compiled with {str(want).removeprefix('torch.')} there: pass "
                f"{slot.what.split('[')[0]} as in example_inputs / example_targets "
                f"(e.g. .to(torch.{str(want).removeprefix('torch.')}))")
    shape = tuple(t.shape)
    compiled = tuple(s if isinstance(s, int) else "*" for s in slot.sizes)
    if len(shape) != len(slot.sizes):
        return (f"{slot.what} has shape {shape} ({len(shape)} dims) but the model was "
                f"compiled for {len(slot.sizes)} dims {compiled} (* any size): pass it "
                "shaped as in the example")
    for d, (size, want_size) in enumerate(zip(shape, slot.sizes)):
        if isinstance(want_size, int):
            if d > 0 and size != want_size:  # (dim 0: a rank's shard is smaller)
                return (f"{slot.what} has size {size} in dim {d} (shape {shape}) where the "
                        f"model was compiled for {want_size} (shape {compiled}, * any size)")
            continue
        if want_size in binding and binding[want_size] != size:
            batch = ("; dim 0 of every input and target is the batch, one sample a row"
                     if d == 0 else "")
            return (f"{slot.what} has size {size} in dim {d} (shape {shape}) but the graph "
                    f"needs it equal to {bound_by[want_size]}, {binding[want_size]} (one "
                    f"symbolic size in the captured graph{batch}): pass tensors of "
                    "matching sizes")
        binding[want_size] = size
        bound_by.setdefault(want_size, f"dim {d} of {slot.what}")
    return None


def _equality_problem(equal: Sequence[tuple], binding: dict, bound_by: dict) -> str | None:
    """Where two sizes the plan was proven for equal differ (or cannot be told)."""
    for a, b in equal:
        values = (_evaluate(a, binding), _evaluate(b, binding))
        if values[0] is not None and values[0] == values[1]:
            continue
        names = " and ".join(
            ", ".join(f"{bound_by.get(x, x)}" for x in sorted(e.free_symbols, key=str))
            for e in (a, b))
        return (f"the batch's sizes {a} and {b} ({names}) are {values[0]} and {values[1]}, "
                "but the plan splits the batch on the proof that they are equal (the model "
                "picks the rows of one by positions counted in the other, as Hugging "
                "Face's multiple-choice models pick their mask's rows by the ids' "
                "positions): pass tensors whose sizes agree, or pin dp=1 and one "
                "microbatch")
    return None


def _evaluate(expr: Any, binding: dict) -> int | None:
    if isinstance(expr, int):
        return expr
    values = {s: v for s, v in binding.items() if isinstance(s, sympy.Symbol)}
    if not expr.free_symbols <= set(values):
        return None
    return int(expr.subs(values))


def _meta_run(cap: CapturedGraph, slots: list[_Slot], tensors: Sequence[torch.Tensor]
              ) -> str | None:
    """Run the captured graph on meta tensors of these shapes: the error it raises (a
    shape the graph cannot take) as a message, None when it runs (or cannot run on meta
    at all: then the real step is the check)."""
    args = []
    batch = iter(tensors)
    for node in cap.gm.graph.nodes:
        if node.op != "placeholder":
            continue
        if node.meta.get(AH_ROLE) in ("input", "target"):
            t = next(batch)
            args.append(torch.empty(t.shape, dtype=t.dtype, device="meta"))
        else:
            val = node.meta.get(VAL)
            if not isinstance(val, torch.Tensor) or not all(isinstance(s, int)
                                                            for s in val.shape):
                return None
            args.append(torch.empty(val.shape, dtype=val.dtype, device="meta"))
    try:
        with torch.no_grad():
            cap.gm(*args)
    except Exception as exc:  # torch's shape checks raise many types
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        shapes = ", ".join(f"{s.what} {tuple(t.shape)}" for s, t in zip(slots, tensors))
        example = ", ".join(f"{s.what} {tuple(e)}" for s, e in zip(slots, cap.example_shapes))
        return (f"the batch ({shapes}) does not fit the compiled model (example: {example}): "
                f"{type(exc).__name__}: {first.rstrip('.')}. Pass inputs and targets shaped as the "
                "model and loss_fn expect (check them in eager: "
                "loss_fn(model(*inputs), targets))")
    return None
