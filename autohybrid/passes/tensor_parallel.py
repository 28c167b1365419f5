"""Pass: rewrite one rank's graph for tensor parallelism (the Plan's tp shardings).

The layout is search/sharding.py's, recomputed on this graph with the Plan's choices for
the generic linears (a linear whose weight the Plan splits is column-parallel), so the
planner and the pass agree by construction. On rank r of the tp group:

- parameters the layout splits become this rank's shard (`ShardSpec`: the split dim,
  fused projections taken chunk by chunk — q, k, v of a fused qkv — vocabularies padded
  to a multiple of tp, key/value heads replicated when tp exceeds them, their replicas'
  gradients summed by `tp_replicated`);
- a column-parallel linear reads its input through `tp_copy` (Megatron's f: identity,
  backward all-reduce); a row-parallel linear computes its partial product, `tp_reduce`
  (g: all-reduce, backward identity) sums it, then its bias is added once;
- views, reshapes, expands and splits of split values get their local sizes;
- the vocabulary-parallel embedding and cross-entropy (ops/vocab_parallel.py) replace
  embedding and the class loss, so the logits are never gathered for the loss;
- dropout of a split value, and attention with dropout, draw the mask eager draws for
  the whole tensor and keep this rank's slice (ops/dropout.py): with the same seed on
  every rank a tp run drops exactly the elements eager drops (data-parallel ranks draw
  for their own samples, so with dp > 1 the masks are per data shard);
- where a split value meets an op that needs it whole, `tp_gather` joins it (trimming
  vocabulary padding); a replicated operand combined with a split one is sliced
  (`tp_split`); split graph outputs are gathered.

`ctx.notes["param_shards"]` maps each split parameter's canonical name to its ShardSpec;
the runtime slices parameters and gathers them back (full_state_dict) with it.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..errors import PlanError
from ..graph import (AH_PASS, AH_ROLE, VAL, fake_mode, new_node, op_name, output_node,
                     refresh_fake, source_line)
from ..ops import tensor_parallel as tp_ops  # noqa: F401  (registers autohybrid::tp_*)
from ..ops import dropout, vocab_parallel  # noqa: F401  (registers the ops they define)
from ..search.sharding import (R, TensorParallelLayout, _CLASS_LOSSES, _ELEMENTWISE_PREFIXES,
                               _SPLITS, _VIEWS,
                               _follow, _taken_apart, linear_parts, megatron_layout,
                               param_key, shard_dim, view_span)
from .manager import PassContext

aten = torch.ops.aten
ah_ops = torch.ops.autohybrid
AXIS = "tp"
#: Ops besides the element-wise ones whose operands line up dim by dim with the output.
_COMBINING = {"aten.cat.default", "aten.where.self", "aten.scaled_dot_product_attention.default"}


# ------------------------------------------------------------------ parameter shards
@dataclass(frozen=True)
class ShardSpec:
    """Which part of a full parameter one tp rank holds.

    The parameter's `dim` (full size `size`) holds `chunks` equal blocks (3 for a fused
    qkv projection); each block is padded to `padded` / `chunks` and split into `ways`
    equal shards; this rank holds shard `index` of every block, concatenated.
    """

    dim: int
    size: int
    padded: int
    chunks: int
    ways: int
    index: int

    @property
    def shard_size(self) -> int:
        return self.padded // self.ways

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the full parameter (a new tensor)."""
        return self.local_from(lambda index: full[index], full.dim())

    def local_from(self, read, ndim: int) -> torch.Tensor:
        """This rank's shard from `read(index)`, which returns `full[index]` for a tuple
        of slices: only the rows (or columns) this rank holds are read (sharded
        materialization reads them from the seeded initialization, autohybrid/init.py)."""
        block = self.size // self.chunks
        width = self.padded // self.chunks // self.ways
        lo = self.index * width
        out = []
        for c in range(self.chunks):  # this rank's piece of each block; padding is zeros
            start, stop = c * block + min(lo, block), c * block + min(lo + width, block)
            index = [slice(None)] * ndim
            index[self.dim] = slice(start, stop)
            piece = read(tuple(index))
            pad = width - (stop - start)
            if pad:
                shape = list(piece.shape)
                shape[self.dim] = pad
                piece = torch.cat([piece, piece.new_zeros(shape)], self.dim)
            out.append(piece)
        return torch.cat(out, self.dim).clone()

    def gather(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The full parameter from every shard index's tensor, in index order."""
        per_chunk = [s.chunk(self.chunks, self.dim) for s in shards]
        blocks = [torch.cat([p[c] for p in per_chunk], self.dim) for c in range(self.chunks)]
        block = self.size // self.chunks
        return torch.cat([b.narrow(self.dim, 0, block) for b in blocks], self.dim)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# ------------------------------------------------------------------ the pass
def tensor_parallel(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    tp = ctx.plan.mesh.tp
    if tp == 1:
        return gm
    layout = _plan_layout(gm, ctx)
    rewriter = _Rewriter(gm, layout, tp, ctx.coords[2])
    rewriter.run()
    ctx.notes["param_shards"] = rewriter.specs
    ctx.notes["tp_layout"] = layout
    return gm


def _plan_layout(gm: fx.GraphModule, ctx: PassContext) -> TensorParallelLayout:
    """This graph's layout with the Plan's choices for open (generic) linears."""
    split = {s.node for s in ctx.plan.shardings if s.placement.startswith("shard(")}
    choices = {}
    for node in gm.graph.nodes:
        parts = linear_parts(node)
        if parts is not None and param_key(parts.weight) in split:
            choices[node.name] = "column"
    return megatron_layout(gm, choices)


class _Rewriter:
    def __init__(self, gm: fx.GraphModule, layout: TensorParallelLayout, tp: int, rank: int):
        self.gm, self.graph, self.layout = gm, gm.graph, layout
        self.tp, self.rank = tp, rank
        self.place = dict(layout.placements)
        self.specs: dict[str, ShardSpec] = {}
        self.copies: dict[fx.Node, fx.Node] = {}
        self.gathered: dict[fx.Node, fx.Node] = {}
        self.kv_ways = self._kv_ways()
        # value → (dim, unpadded full size) for values whose split dim carries padding
        self.padded: dict[fx.Node, tuple[int, int]] = {}
        self.full = {n.name: n.meta.get(VAL) for n in gm.graph.nodes}  # before rewriting
        self.mode = fake_mode(gm)

    # ---------------------------------------------------------------- helpers
    def _kv_ways(self) -> int:
        from ..search.space import _heads
        heads, kv_heads = _heads(self.gm)
        return min(self.tp, kv_heads) if kv_heads else self.tp

    def sharded(self, node) -> int | None:
        if not isinstance(node, fx.Node):
            return None
        return shard_dim(self.place.get(node.name, R))

    def call(self, op, args, kwargs=None, *, like: fx.Node | None = None) -> fx.Node:
        return new_node(self.graph, op, args, kwargs, pass_name="tensor_parallel",
                        mode=self.mode, like=like)

    def fake(self, node: fx.Node) -> None:
        refresh_fake(node, self.mode)

    def copy_of(self, x: fx.Node, before: fx.Node) -> fx.Node:
        """x through Megatron's f (one per distinct input)."""
        if x not in self.copies:
            with self.graph.inserting_before(before):
                self.copies[x] = self.call(ah_ops.tp_copy.default, (x, AXIS), like=before)
        return self.copies[x]

    def gather(self, x: fx.Node, before: fx.Node) -> fx.Node:
        """The whole of split value x (padding trimmed)."""
        if x not in self.gathered:
            dim = self.sharded(x)
            with self.graph.inserting_before(before):
                whole = self.call(ah_ops.tp_gather.default, (x, dim, AXIS), like=before)
                if x in self.padded:
                    pdim, size = self.padded[x]
                    whole = self.call(aten.slice.Tensor, (whole, pdim, 0, size), like=before)
            self.place[whole.name] = R
            self.gathered[x] = whole
        return self.gathered[x]

    # ---------------------------------------------------------------- driver
    def run(self) -> None:
        self._shard_parameters()
        for node in list(self.graph.nodes):
            if node.op != "call_function":
                continue
            if node.meta.get(AH_PASS) == "tensor_parallel":
                continue
            self._rewrite(node)
        out = output_node(self.gm)
        values = list(out.args[0])
        for i, v in enumerate(values):
            if self.sharded(v) is not None:
                values[i] = self.gather(v, out)
        out.args = (tuple(values),)

    def _shard_parameters(self) -> None:
        layout, tp = self.layout, self.tp
        chunks = self._fused_chunks()
        for node in self.graph.nodes:
            if node.op != "placeholder" or node.meta.get(AH_ROLE) != "param":
                continue
            key = param_key(node)
            dim = shard_dim(layout.param_placements.get(key, R))
            if dim is None:
                continue
            full = node.meta[VAL]
            size = int(full.shape[dim])
            ways = self.kv_ways if key in layout.kv_params else tp
            parts = chunks.get(key, 1)
            if key in layout.vocab_params:
                padded = _round_up(size, ways)
            else:
                padded = size
                if size % (ways * parts):
                    raise PlanError(
                        f"tensor parallelism: dim {dim} of parameter {key!r} (size {size}, "
                        f"{parts} fused block(s)) does not split over {ways} ranks; choose a tp "
                        "degree that divides it")
            index = self.rank // (tp // ways)
            spec = ShardSpec(dim, size, padded, parts, ways, index)
            self.specs[key] = spec
            shape = list(full.shape)
            shape[dim] = spec.shard_size
            with self.mode:
                node.meta[VAL] = torch.empty(shape, dtype=full.dtype, device=full.device)
            if ways < tp:  # replicas' gradients sum (grouped-query attention, tp > kv heads)
                users = list(node.users)
                with self.graph.inserting_after(node):
                    joined = self.call(ah_ops.tp_replicated.default, (node, ways, AXIS))
                for user in users:
                    user.replace_input_with(node, joined)

    def _fused_chunks(self) -> dict[str, int]:
        """Column linears whose output is taken apart into equal blocks (fused qkv)."""
        out = {}
        for node in self.graph.nodes:
            if self.layout.linear_roles.get(node.name) != "column":
                continue
            parts = linear_parts(node)
            count = _blocks(node, node.meta[VAL].dim() - 1)
            if count > 1:
                for p in (parts.weight, parts.bias):
                    if p is not None:
                        out[param_key(p)] = count
        return out

    # ---------------------------------------------------------------- per node
    def _rewrite(self, node: fx.Node) -> None:
        name = op_name(node)
        role = self.layout.linear_roles.get(node.name)
        if name.startswith("aten._assert_tensor_metadata") and \
                any(self.sharded(a) is not None for a in node.all_input_nodes):
            self.graph.erase_node(node)  # checks the full shape; the shard's differs
            return
        if role in ("column", "row"):
            self._linear(node, role)
            return
        if role == "replicate" or linear_parts(node) is not None:
            self._gather_inputs(node)
            self.fake(node)
            return
        if name == "aten.embedding.default" and \
                param_key(node.args[0]) in self.layout.vocab_params:
            self._embedding(node)
            return
        if name in _CLASS_LOSSES and self.sharded(node.args[0]) is not None:
            self._class_loss(node)
            return
        if name == "aten.dropout.default" and self.sharded(node.args[0]) is not None \
                and node.args[0] not in self.padded:
            self._dropout(node)
            return
        if name == "aten.scaled_dot_product_attention.default" and _sdpa_dropout(node) > 0:
            self._split_replicated_operands(node, self.sharded(node))
            self._attention_dropout(node)
            return
        out_dim = self.sharded(node)
        if out_dim is None:
            self._gather_inputs(node)
        else:
            self._split_replicated_operands(node, out_dim)
            self._local_sizes(node, out_dim)
        self.fake(node)
        self._track_padding(node)

    def _gather_inputs(self, node: fx.Node) -> None:
        for a in node.all_input_nodes:
            if self.sharded(a) is not None:
                node.replace_input_with(a, self.gather(a, node))

    def _linear(self, node: fx.Node, role: str) -> None:
        parts = linear_parts(node)
        x = parts.x
        if role == "column":
            if self.sharded(x) is not None:  # split elsewhere: join first
                x = self.gather(x, node)
            node.replace_input_with(parts.x, self.copy_of(x, node))
            self.fake(node)
            if node.name in self.layout.vocab_linears:
                spec = self.specs[param_key(parts.weight)]
                if spec.padded != spec.size:
                    self.padded[node] = (node.meta[VAL].dim() - 1, spec.size)
            return
        # row: partial product, all-reduce, then the bias once
        bias = parts.bias
        if bias is None:
            self.fake(node)
            with self.graph.inserting_after(node):
                reduced = self.call(ah_ops.tp_reduce.default, (node, AXIS), like=node)
            node.replace_all_uses_with(reduced, delete_user_cb=lambda u: u is not reduced)
            return
        product = aten.linear.default if op_name(node) == "aten.linear.default" \
            else aten.mm.default  # addmm(bias, x, w)
        with self.graph.inserting_before(node):
            partial = self.call(product, (x, parts.weight), like=node)
            reduced = self.call(ah_ops.tp_reduce.default, (partial, AXIS), like=node)
            total = self.call(aten.add.Tensor, (reduced, bias), like=node)
        node.replace_all_uses_with(total)
        self.graph.erase_node(node)

    def _embedding(self, node: fx.Node) -> None:
        weight, ids = node.args[0], node.args[1]
        padding_idx = node.args[2] if len(node.args) > 2 else -1
        if padding_idx not in (-1, None):
            raise PlanError(
                f"tensor parallelism: embedding {node.name!r} (`{source_line(node)}`) has "
                f"padding_idx={padding_idx}; the vocabulary-parallel embedding supports none. "
                "Build the embedding without padding_idx or pin tp=1")
        spec = self.specs[param_key(weight)]
        start = spec.index * spec.shard_size
        with self.graph.inserting_before(node):
            partial = self.call(ah_ops.vocab_parallel_embedding.default,
                                (ids, weight, start, AXIS), like=node)
            reduced = self.call(ah_ops.tp_reduce.default, (partial, AXIS), like=node)
        node.replace_all_uses_with(reduced)
        self.graph.erase_node(node)

    def _class_loss(self, node: fx.Node) -> None:
        from .global_loss import _kwargs
        kw = _kwargs(node)
        logits, target = kw["self"], kw["target"]
        dim = self.sharded(logits)
        needs_whole = (kw.get("weight") is not None or target.meta[VAL].is_floating_point()
                       or dim != logits.meta[VAL].dim() - 1 or logits.meta[VAL].dim() != 2)
        if needs_whole:  # class weights, probabilities, class dim not last: join the logits
            self._gather_inputs(node)
            self.fake(node)
            return
        size = self.padded.get(logits, (dim, None))[1] or int(logits.meta[VAL].shape[dim]) * self.tp
        start = self.rank * int(logits.meta[VAL].shape[dim])
        smoothing = float(kw.get("label_smoothing", 0.0) or 0.0)
        reduction = kw.get("reduction", 1)
        ignore = kw.get("ignore_index", -100)
        with self.graph.inserting_before(node):
            wanted = node.meta[VAL].dtype
            if logits.meta[VAL].dtype != wanted:  # under autocast the loss runs in fp32
                logits = self.call(aten._to_copy.default, (logits,), {"dtype": wanted},
                                   like=node)
            both = self.call(ah_ops.vocab_parallel_cross_entropy.default,
                             (logits, target, start, size, ignore, smoothing, AXIS), like=node)
            loss = self.call(operator.getitem, (both, 0), like=node)
            if reduction in (1, 2):
                loss = self.call(aten.sum.default, (loss,), like=node)
            if reduction == 1:
                keep = self.call(aten.ne.Scalar, (target, ignore), like=node)
                count = self.call(aten.sum.default, (keep,), {"dtype": loss.meta[VAL].dtype},
                                  like=node)
                loss = self.call(aten.div.Tensor, (loss, count), like=node)
        node.replace_all_uses_with(loss)
        self.graph.erase_node(node)

    def _full_shape(self, x: fx.Node, before: fx.Node) -> list:
        """The full shape of split value `x` as graph arguments (sizes of symbolic dims
        read from `x`, which tp never splits; static ones from the capture)."""
        shape = []
        for i, size in enumerate(self.full[x.name].shape):
            if isinstance(size, torch.SymInt):
                with self.graph.inserting_before(before):
                    shape.append(self.call(aten.sym_size.int, (x, i), like=before))
            else:
                shape.append(int(size))
        return shape

    def _dropout(self, node: fx.Node) -> None:
        """Dropout of a split value: eager's full-tensor mask, this rank's slice of it."""
        x, p = node.args[0], node.args[1]
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        dim = self.sharded(x)
        ways = self._numel_ratio(x)
        index = self.rank // (self.tp // ways)
        full = self._full_shape(x, node)
        with self.graph.inserting_before(node):
            both = self.call(ah_ops.sharded_dropout.default,
                             (x, p, train, full, dim, index, ways), like=node)
            out = self.call(operator.getitem, (both, 0), like=node)
        self.place[out.name] = self.place[node.name]
        node.replace_all_uses_with(out)
        self.graph.erase_node(node)

    def _attention_dropout(self, node: fx.Node) -> None:
        """Attention with dropout on this rank's heads, eager's full mask sliced on heads."""
        from .global_loss import _kwargs
        kw = _kwargs(node)
        if kw.get("enable_gqa"):
            raise PlanError(f"tensor parallelism: attention {node.name!r} "
                            f"(`{source_line(node)}`) uses enable_gqa with dropout; repeat the "
                            "key/value heads before attention or set dropout_p=0")
        heads = int(self.full[node.name].shape[1])
        ways = self._numel_ratio(node.args[0])
        index = self.rank // (self.tp // ways)
        with self.graph.inserting_before(node):
            both = self.call(ah_ops.sharded_sdpa.default,
                             (kw["query"], kw["key"], kw["value"], kw.get("attn_mask"),
                              kw["dropout_p"], kw.get("is_causal", False), kw.get("scale"),
                              heads, index, ways), like=node)
            out = self.call(operator.getitem, (both, 0), like=node)
        self.place[out.name] = self.place[node.name]
        node.replace_all_uses_with(out)
        self.graph.erase_node(node)

    def _split_replicated_operands(self, node: fx.Node, out_dim: int) -> None:
        """Slice replicated operands that span the split dim (broadcast ones need not)."""
        name = op_name(node)
        if not (name.startswith(_ELEMENTWISE_PREFIXES) or name in _COMBINING):
            return
        out = node.meta[VAL]
        if not isinstance(out, torch.Tensor):
            return
        attention = op_name(node) == "aten.scaled_dot_product_attention.default"
        mask = (node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")) \
            if attention else None
        for a in node.all_input_nodes:
            val = a.meta.get(VAL)
            if self.sharded(a) is not None or not isinstance(val, torch.Tensor):
                continue
            if attention and a is not mask:
                continue  # q, k, v arrive split; only a mask can be replicated
            dim = out_dim - (out.dim() - val.dim())
            if dim < 0 or val.shape[dim] == 1:
                continue
            with self.graph.inserting_before(node):
                piece = self.call(ah_ops.tp_split.default, (a, dim, AXIS), like=node)
            node.replace_input_with(a, piece)

    def _local_sizes(self, node: fx.Node, out_dim: int) -> None:
        """Shape arguments of views, expands and splits, made local."""
        name = op_name(node)
        src = node.args[0]
        if name in ("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default"):
            shape = list(node.args[1])
            if isinstance(shape[out_dim], int) and shape[out_dim] != -1:  # -1 infers it
                if src in self.padded:  # the padded vocabulary dim, kept whole by the view
                    shape[out_dim] = int(src.meta[VAL].shape[self.sharded(src)])
                else:
                    shape[out_dim] //= self._numel_ratio(src)
            node.args = (src, shape, *node.args[2:])
        elif name == "aten.unflatten.int":
            dim, sizes = node.args[1] % self.full[src.name].dim(), list(node.args[2])
            if dim <= out_dim < dim + len(sizes) and isinstance(sizes[out_dim - dim], int):
                sizes[out_dim - dim] //= self._numel_ratio(src)
            node.args = (src, dim, sizes, *node.args[3:])
        elif name == "aten.expand.default":
            local = src.meta[VAL]
            shape = list(node.args[1])
            offset = len(shape) - local.dim()
            src_dim = self.sharded(src)
            if isinstance(shape[src_dim + offset], int) and shape[src_dim + offset] != -1:
                shape[src_dim + offset] = int(local.shape[src_dim])
            ways = self._numel_ratio(src)
            nxt = src_dim + offset + 1
            if ways < self.tp and nxt < len(shape) and isinstance(shape[nxt], int) \
                    and local.shape[src_dim + 1] == 1:
                # key/value heads replicated over tp / ways ranks: each rank expands its
                # key/value head to fewer query heads
                shape[nxt] = shape[nxt] * ways // self.tp
            node.args = (src, shape, *node.args[2:])
        elif name in ("aten.split.Tensor", "aten.split_with_sizes.default"):
            along = (node.args[2] if len(node.args) > 2 else 0) % self.full[src.name].dim()
            if along == self.sharded(src):
                ratio = self._numel_ratio(src)
                sizes = node.args[1]
                sizes = [s // ratio for s in sizes] if isinstance(sizes, (list, tuple)) \
                    else sizes // ratio
                node.args = (src, sizes, *node.args[2:])

    def _numel_ratio(self, node: fx.Node) -> int:
        """Elements of the full value over those of this rank's (static dims only: tp
        never splits batch or sequence)."""
        full, local = self.full[node.name], node.meta[VAL]
        whole = math.prod(int(s) for s in full.shape if not isinstance(s, torch.SymInt))
        mine = math.prod(int(s) for s in local.shape if not isinstance(s, torch.SymInt))
        return max(1, whole // mine)

    def _track_padding(self, node: fx.Node) -> None:
        """Views and element-wise ops of padded logits keep the padding (same dim size)."""
        for a in node.all_input_nodes:
            if a in self.padded and self.sharded(node) is not None:
                self.padded[node] = (self.sharded(node), self.padded[a][1])
                return


def _sdpa_dropout(node: fx.Node) -> float:
    """The dropout probability of an attention node (0 when absent)."""
    if len(node.args) > 4:
        return float(node.args[4])
    return float(node.kwargs.get("dropout_p", 0.0))


def _blocks(node: fx.Node, dim: int, budget: int = 16) -> int:
    """How many equal blocks the graph takes dim `dim` of `node` apart into (1: none):
    a split/chunk along it, or a view into (count, ...) whose count dim is unbound."""
    frontier = [(node, dim)]
    while frontier and budget > 0:
        current, d = frontier.pop()
        budget -= 1
        val = current.meta.get(VAL)
        for user in current.users:
            name = op_name(user)
            if name in ("aten.split.Tensor", "aten.chunk.default",
                        "aten.split_with_sizes.default"):
                along = (user.args[2] if len(user.args) > 2 else 0) % val.dim()
                if along == d:
                    sizes = {str(o.shape[d]) for o in user.meta[VAL]}
                    return len(user.meta[VAL]) if len(sizes) == 1 else 1
                continue
            if name in _VIEWS:
                span = view_span(val, user.meta[VAL], d)
                if span and len(span) > 1 and _taken_apart(user, span[0]):
                    return int(user.meta[VAL].shape[span[0]])
            moved = _follow(user, current, d)
            if isinstance(moved, int):
                frontier.append((user, moved))
    return 1
