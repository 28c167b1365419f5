"""The costed model the search walks: per-layer profiles under tensor parallelism.

`profile(gm, dim_roles)` segments the graph into layers (search/layers.py), applies the
tp layout (search/sharding.py) and sums, per distinct layer signature, what scales with
tp (sharded FLOPs, bytes, saved activations, parameters) and what does not, as compiled
functions of (microbatch, sequence). The planner then prices any (tp, sp, recompute,
stage) choice from these sums without touching the graph again.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Callable

import sympy
import torch
import torch.fx as fx

from ..capture_moe_loop import stacked_experts
from ..cost.compute import (MATMUL_OPS, MOE_EXPERTS, _tensors, bytes_moved, extra_saved_bytes,
                            forward_flops, grad_nodes, nbytes_expr, numel_expr, saved_nodes,
                            size_function, sym_expr)
from ..graph import AH_PARAM, AH_ROLE, VAL, VIEW_OPS, is_param, op_name
from ..ops.moe import tensor_parallel_experts
from .layers import Layer, segment
from .sharding import R, TensorParallelLayout, param_key
from .tp_gradients import megatron_layout
from .tp_choice import Rates, choose_layout

#: Order of the per-layer quantities evaluated together (one compiled function per layer).
FIELDS = ("mm_sharded", "mm_replicated", "other_sharded", "other_replicated",
          "bytes_sharded", "bytes_replicated", "saved_sharded", "saved_replicated",
          "attention_flops", "attention_saved", "attention_scores", "input_bytes", "mm_kv",
          "mm_vocab", "moe_routed", "moe_flops", "moe_routes", "moe_tokens", "moe_bytes")


@dataclass(frozen=True)
class Collective:
    kind: str          # "all_reduce" | "all_gather" | "halo"
    direction: str     # "forward" | "backward"
    nbytes: Callable[[int, int], float]
    axis: str = "tp"   # the mesh axis whose group it spans


@dataclass(frozen=True)
class Gemm:
    """One GEMM of a layer, for the shape-aware price (cost/gemm.py): which FLOP sum it
    belongs to (`field`, one of _MATMUL_FIELDS) and which dimension tensor parallelism
    splits ("n": output columns, a column-parallel, key/value or vocabulary linear; "k": the
    reduced dim, a row-parallel linear; "count": the batch of a batched GEMM, its heads;
    "none")."""

    field: str
    split: str
    kind: str = "gemm"   # "attention": a fused attention kernel (cost/gemm.py)


@dataclass
class LayerProfile:
    name: str
    signature: str
    params: tuple[tuple[str, int, str], ...]   # (canonical name, numel, tp|kv|vocab|none)
    num_ops: int
    values: Callable[[int, int], dict[str, float]]
    collectives: list[Collective] = field(default_factory=list)
    #: whether sequence parallelism splits this layer's replicated ops (False in a model
    #: with no sequence region: no row-parallel linear or vocabulary-parallel embedding
    #: whose sum sp would scatter, as in a CNN: passes/sequence_parallel.py)
    sp_region: bool = True
    gemms: tuple[Gemm, ...] = ()
    #: (microbatch, sequence) → one (count, m, n, k) per entry of `gemms`, unsplit
    gemm_shapes: Callable[[int, int], list[tuple[float, float, float, float]]] | None = None


def split_ways(split: str, tp: int, kv_heads: int | None = None,
               vocab: int | None = None, ep: int = 1, expert_tp: bool = False) -> float:
    """Over how many ranks a value marked `split` ("tp", "kv", "vocab", "none"; "expert":
    a MoE layer's expert weights, split over ep, and over tp too where `expert_tp`:
    `ModelProfile.expert_tp`) is divided: its size over the size one rank holds."""
    if split == "expert":
        return ep * (tp if expert_tp else 1)
    if split == "kv" and kv_heads:
        return min(tp, kv_heads)  # more ranks than KV heads: KV heads are replicated
    if split == "vocab" and vocab:
        return vocab / -(-vocab // tp)  # padded to a multiple of tp: ceil(V / tp) rows each
    return tp if split in ("tp", "kv", "vocab") else 1


def local_params(layers: list[LayerProfile], tp: int, kv_heads: int | None = None,
                 vocab: int | None = None, ep: int = 1, expert_tp: bool = False) -> float:
    """Parameters one tp (and ep) rank holds for `layers` (a tied parameter counted once;
    padded vocabulary rows counted)."""
    unique = {name: (count, split) for layer in layers for name, count, split in layer.params}
    return sum(count / split_ways(split, tp, kv_heads, vocab, ep, expert_tp)
               for count, split in unique.values())


_MATMUL_FIELDS = ("mm_sharded", "mm_kv", "mm_vocab", "mm_replicated")
_OTHER_FIELDS = ("other_sharded", "other_replicated")


@dataclass
class ModelProfile:
    layers: list[LayerProfile]
    layout: TensorParallelLayout
    param_count: int              # unique parameters (tied weights once)
    heads: int | None             # attention heads, for tp divisibility (None: no attention)
    kv_heads: int | None
    vocab: int | None = None      # vocabulary of the vocabulary-parallel layers
    experts: tuple[int, ...] = ()  # experts of each MoE layer (autohybrid::moe_experts)
    expert_inter: tuple[int, ...] = ()  # each MoE layer's intermediate size
    #: some MoE layer's experts are separate parameters, stacked in the graph (a folded
    #: hand-written loop: capture_moe_loop.py), which tensor parallelism leaves whole
    experts_stacked: bool = False

    def expert_tp(self, tp: int, sp: bool) -> bool:
        """Whether tp splits every expert's intermediate size (expert tensor parallelism:
        ops.moe.tensor_parallel_experts, as passes/expert_parallel.py asks)."""
        return bool(self.experts) and not self.experts_stacked \
            and tensor_parallel_experts(tp, sp, self.expert_inter)

    def local_params(self, layers: list[LayerProfile], tp: int, ep: int = 1,
                     expert_tp: bool = False) -> float:
        return local_params(layers, tp, self.kv_heads, self.vocab, ep, expert_tp)

    def expert_params(self, layers: list[LayerProfile], ep: int,
                      expert_tp: bool = False, tp: int = 1) -> float:
        """Of `local_params`, the experts' slices one ep rank holds (summed over "edp"),
        over tp too where `expert_tp`."""
        unique = {name: count for layer in layers for name, count, split in layer.params
                  if split == "expert"}
        return sum(unique.values()) / split_ways("expert", tp, ep=ep, expert_tp=expert_tp)

    def tp_problem(self, tp: int) -> str | None:
        """Why the tp layout cannot split `tp` ways (None: it can)."""
        if self.heads and self.heads % tp:
            return f"tp={tp} does not divide {self.heads} attention heads"
        if self.kv_heads and self.kv_heads % min(tp, self.kv_heads):
            return f"tp={tp} does not divide {self.kv_heads} key/value heads"
        layout = self.layout
        if self.kv_heads and tp > self.kv_heads and layout.fused_kv_params:
            return (f"tp={tp} exceeds the {self.kv_heads} key/value heads of the fused "
                    f"projection {sorted(layout.fused_kv_params)[0]}")
        for name, size in sorted(layout.shard_sizes.items()):
            if name in layout.vocab_params or name in layout.kv_params:
                continue
            if name in layout.open_params:
                continue  # a generic linear the cost chose to split: the pass replicates it
            blocks = layout.fused_params.get(name, (size,))
            if any(b % tp for b in blocks):
                what = f"the split dim ({size})" if len(blocks) == 1 else \
                    f"the fused blocks {list(blocks)} of the split dim"
                return f"tp={tp} does not divide {what} of {name}"
        return None

    def forward_flops(self, batch: int, seq: int | None, matmul_only: bool = False) -> float:
        """FLOPs of one forward pass over `batch` samples (the whole model, unsplit)."""
        fields = _MATMUL_FIELDS if matmul_only else _MATMUL_FIELDS + _OTHER_FIELDS
        return sum(values[f] for values in (layer.values(batch, seq) for layer in self.layers)
                   for f in fields)

    def step_flops(self, batch: int, seq: int | None) -> float:
        """Model FLOPs of one training step: forward + backward (twice the forward)."""
        return 3.0 * self.forward_flops(batch, seq)


def profile(gm: fx.GraphModule, dim_roles: dict[sympy.Symbol, str],
            rates: Rates | None = None,
            layout: TensorParallelLayout | None = None) -> ModelProfile:
    """The costed model; `rates` (from the cluster) decide the generic linears' shardings
    (search/tp_choice.py), None keeps Megatron's assignment alone. A given `layout` is
    used as it is (spatial_costs.py: nothing split, the graph's own collectives)."""
    if layout is None:
        layout = choose_layout(gm, rates) if rates is not None else megatron_layout(gm)
    batch, seq = sympy.symbols("batch seq", positive=True, integer=True)
    subs = {s: (batch if role == "batch" else seq) for s, role in dim_roles.items()}
    subs.update(data_dependent_sizes(gm, subs))
    compiled: dict[str, tuple] = {}
    layers = []
    needs_grad = grad_nodes(gm)
    saved_anywhere = {s for n in gm.graph.nodes for s in saved_nodes(n, needs_grad)}
    sp_region = has_sequence_region(gm, layout, dim_roles)
    for layer in segment(gm):
        if layer.signature not in compiled:
            compiled[layer.signature] = _compile_layer(layer, layout, subs, batch, seq,
                                                       needs_grad, saved_anywhere)
        values, collectives, num_ops, gemms, gemm_shapes = compiled[layer.signature]
        layers.append(LayerProfile(layer.name, layer.signature, _layer_params(layer, layout),
                                   num_ops, values, collectives, sp_region, gemms,
                                   gemm_shapes))
    unique = {n.meta.get(AH_PARAM, n.name): n.meta[VAL].numel() for n in gm.graph.nodes
              if is_param(n)}
    heads, kv_heads = _heads(gm)
    moe = [n for n in gm.graph.nodes if op_name(n) == MOE_EXPERTS]
    return ModelProfile(layers, layout, sum(unique.values()), heads, kv_heads, layout.vocab,
                        tuple(int(n.args[5]) for n in moe),
                        tuple(int(n.args[4].meta[VAL].shape[-1]) for n in moe),
                        any(stacked_experts(n) for n in moe))


def data_dependent_sizes(gm: fx.GraphModule, subs: dict) -> dict[sympy.Symbol, sympy.Expr]:
    """A price for each data-dependent (unbacked) size of `gm`: the rows `nonzero`,
    `masked_select`, `unique` and the like return (a hand-written MoE's `torch.where` over
    its routing mask, per expert, where capture_moe_loop.py could not fold the loop into
    the MoE op) are at most the elements of their input (of its boolean mask, where it has
    one: `x[mask]`), and that is what they are priced at — the largest they can be, so
    such a layer is priced high (a MoE loop: every expert as if it received every route)
    rather than not at all. A size with no tensor input (from `.item()`) is priced at 1.
    `subs` maps the batch and sequence symbols; the bounds are in those terms."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    out: dict[sympy.Symbol, sympy.Expr] = {}
    for node in gm.graph.nodes:
        val = node.meta.get(VAL)
        if val is None:
            continue
        new = [u for u in free_unbacked_symbols(val) if u not in out]
        if not new:
            continue
        inputs = [a.meta[VAL] for a in node.all_input_nodes
                  if isinstance(a.meta.get(VAL), torch.Tensor)]
        masks = [t for t in inputs if t.dtype == torch.bool]
        inputs = masks or inputs   # x[mask]: at most the mask's elements, not x's
        bound = sympy.Integer(1)
        if inputs:
            sizes = [numel_expr(t).xreplace({**subs, **out}) for t in inputs]
            bound = sizes[0] if len(sizes) == 1 else sympy.Max(*sizes)
        out.update({u: bound for u in new})
    return out


def has_sequence_region(gm: fx.GraphModule, layout: TensorParallelLayout,
                        dim_roles: dict) -> bool:
    """Whether sequence parallelism has anything to split: the inputs have a sequence dim
    (an image's dim 1 is its channels) and its regions start where a row-parallel
    linear's or a vocabulary-parallel embedding's sum is reduced
    (passes/sequence_parallel.py turns that reduction into a reduce-scatter)."""
    if "seq" not in dim_roles.values():
        return False
    if any(role == "row" for role in layout.linear_roles.values()):
        return True
    return any(op_name(n) == "aten.embedding.default" and isinstance(n.args[0], fx.Node)
               and param_key(n.args[0]) in layout.vocab_params for n in gm.graph.nodes)


def _layer_params(layer: Layer, layout: TensorParallelLayout) -> tuple[tuple[str, int, bool], ...]:
    experts = {a for n in layer.nodes if op_name(n) == MOE_EXPERTS for a in n.args[3:5]}

    def split(p: fx.Node) -> str:
        if p in experts:
            return "expert"
        if param_key(p) in layout.kv_params:
            return "kv"
        if param_key(p) in layout.vocab_params:
            return "vocab"
        return "tp" if layout.param_placements.get(param_key(p), R) != R else "none"
    return tuple((param_key(p), p.meta[VAL].numel(), split(p)) for p in layer.params())


def _compile_layer(layer: Layer, layout: TensorParallelLayout, subs: dict, batch, seq,
                   needs_grad: set[fx.Node], saved_anywhere: set[fx.Node]):
    sums = {name: [] for name in FIELDS}
    saved: dict[str, fx.Node] = {}
    num_ops = 0
    members = set(layer.nodes)
    gemms, shapes = [], []
    for node in layer.nodes:
        name = op_name(node)
        if name not in VIEW_OPS and node.target is not operator.getitem:
            num_ops += 1
        role = layout.linear_roles.get(node.name)
        sharded = layout.is_sharded(node) or role in ("column", "row")
        part = "sharded" if sharded else "replicated"
        mm = name in MATMUL_OPS
        if node.name in layout.kv_linears:
            field_name = "mm_kv"
        elif node.name in layout.vocab_linears:
            field_name = "mm_vocab"
        else:
            field_name = f"{'mm' if mm else 'other'}_{part}"
        sums[field_name].append(forward_flops(node))
        shape = gemm_shape(node)
        if shape is not None:
            split = "k" if role == "row" else "n" if role == "column" or field_name in (
                "mm_kv", "mm_vocab") else "count" if sharded else "none"
            kind = "attention" if name == "aten.scaled_dot_product_attention.default" \
                else "gemm"
            gemms.append(Gemm(field_name, split, kind))
            shapes.extend(shape)
        sums[f"bytes_{part}"].append(bytes_moved(node))
        if name == MOE_EXPERTS:   # the rows its all-to-alls move under expert parallelism
            x, index = node.args[0].meta[VAL], node.args[1].meta[VAL]
            sums["moe_routed"].append(numel_expr(index) * sym_expr(x.shape[-1])
                                      * x.element_size())
            sums["moe_flops"].append(forward_flops(node))
            sums["moe_routes"].append(numel_expr(index))   # tokens × top-k
            # the tokens' bytes, which expert tensor parallelism all-reduces
            sums["moe_tokens"].append(numel_expr(x) * x.element_size())
            sums["moe_bytes"].append(bytes_moved(node))
        if name == "aten.scaled_dot_product_attention.default":
            sums["attention_flops"].append(forward_flops(node))
            q, k = node.args[0].meta[VAL], node.args[1].meta[VAL]  # (B, H, Tq, D), (B, H, Tk, D)
            sums["attention_scores"].append(numel_expr(q) / sym_expr(q.shape[-1])
                                            * sym_expr(k.shape[-2]))
        for s in saved_nodes(node, needs_grad):
            # a value saved by ops of several layers is counted once: by the layer that
            # computes it (graph inputs: by the layer that saves them)
            external = s not in members
            if s.meta.get(AH_ROLE) in ("param", "buffer", "constant") or \
                    (external and s.op != "placeholder"):
                continue
            saved.setdefault(s.name, s)
            if name == "aten.scaled_dot_product_attention.default" and s is node:
                sums["attention_saved"].extend(nbytes_expr(t) for t in _tensors(s.meta[VAL]))
        if node in saved_anywhere:
            saved.setdefault(node.name, node)
        if needs_grad is None or node in needs_grad:
            sums[f"saved_{part}"].append(extra_saved_bytes(node))
    for s in saved.values():
        part = "sharded" if layout.is_sharded(s) else "replicated"
        sums[f"saved_{part}"].extend(nbytes_expr(t) for t in _tensors(s.meta.get(VAL)))
    inputs = {a for n in layer.nodes for a in n.all_input_nodes
              if a not in members and a.meta.get(AH_ROLE) not in ("param", "buffer", "constant")
              and isinstance(a.meta.get(VAL), torch.Tensor)}
    sums["input_bytes"] = [nbytes_expr(a.meta[VAL]) for a in inputs]
    exprs = [sympy.Add(*terms).xreplace(subs) if terms else sympy.Integer(0)
             for terms in sums.values()]
    fn = size_function((batch, seq), exprs)

    def values(b: int, s: int | None) -> dict[str, float]:
        return dict(zip(FIELDS, (float(v) for v in fn(b, s if s is not None else 1))))

    gemm_shapes = None
    if gemms:
        shape_fn = size_function((batch, seq), [sympy.sympify(e).xreplace(subs)
                                                for e in shapes])

        def gemm_shapes(b: int, s: int | None) -> list[tuple[float, float, float, float]]:
            flat = [float(v) for v in shape_fn(b, s if s is not None else 1)]
            return [tuple(flat[i:i + 4]) for i in range(0, len(flat), 4)]

    collectives = []
    names = {n.name for n in layer.nodes}
    for c in layout.collectives:
        if c.node in names:
            f = size_function((batch, seq), c.nbytes.xreplace(subs))
            collectives.append(Collective(c.kind, c.direction,
                                          lambda b, s, f=f: float(f(b, s or 1)), c.axis))
    return values, collectives, num_ops, tuple(gemms), gemm_shapes


def gemm_shape(node: fx.Node) -> tuple[sympy.Expr, sympy.Expr, sympy.Expr, sympy.Expr] | None:
    """(count, m, n, k) of a GEMM op — `count` GEMMs of an (m × k) by (k × n) product —
    as sympy expressions; None for other ops (convolutions are not priced by tiles). Fused
    attention (q: B, H, Tq, D; k: B, H, Tk, D) is B·H heads of Tq queries, with k = 2·Tk:
    its two GEMMs' FLOPs, 4·B·H·Tq·Tk·D."""
    name = op_name(node)
    out = node.meta.get(VAL)
    if not isinstance(out, torch.Tensor) or out.dim() == 0:
        return None
    args = [a.meta.get(VAL) if isinstance(a, fx.Node) else a for a in node.args]
    if name == "aten.scaled_dot_product_attention.default":
        q, key = args[0], args[1]
        if not isinstance(q, torch.Tensor) or q.dim() < 2 or not isinstance(key, torch.Tensor):
            return None
        queries, dim = sym_expr(q.shape[-2]), sym_expr(q.shape[-1])
        return numel_expr(q) / (queries * dim), queries, dim, 2 * sym_expr(key.shape[-2])
    if name == "aten.linear.default":
        k = sym_expr(args[1].shape[-1])
    elif name == "aten.addmm.default":
        k = sym_expr(args[2].shape[0])
    elif name in ("aten.mm.default", "aten.bmm.default", "aten.matmul.default",
                  "aten.baddbmm.default"):
        a, b = args[1:3] if name == "aten.baddbmm.default" else args[:2]
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or \
                a.dim() < 2 or b.dim() < 2:
            return None
        k = sym_expr(a.shape[-1])
    else:
        return None
    n = sym_expr(out.shape[-1])
    rows = numel_expr(out) / n
    batched = name in ("aten.bmm.default", "aten.baddbmm.default") or (
        name == "aten.matmul.default" and out.dim() > 2 and isinstance(args[1], torch.Tensor)
        and args[1].dim() > 2)
    if batched:  # (count, m, n): the leading dims are the batch of GEMMs
        m = sym_expr(out.shape[-2])
        return rows / m, m, n, k
    return sympy.Integer(1), rows, n, k


def _heads(gm: fx.GraphModule) -> tuple[int | None, int | None]:
    """Query and key/value head counts of the first attention (sdpa args are B, H, T, D)."""
    for node in gm.graph.nodes:
        if op_name(node) == "aten.scaled_dot_product_attention.default":
            q, k = node.args[0].meta[VAL], node.args[1].meta[VAL]
            kv = k.shape[1]
            source = node.args[1]
            # GQA expands kv heads before attention: look through expand/reshape for the count
            while op_name(source) in ("aten.reshape.default", "aten.view.default",
                                      "aten.expand.default", "aten.slice.Tensor",
                                      "aten.unsqueeze.default", "aten.clone.default"):
                source = source.args[0]
                shape = source.meta[VAL].shape
                if len(shape) >= 2 and isinstance(shape[1], int):
                    kv = min(kv, shape[1])
            return int(q.shape[1]), int(kv)
    return None, None
