"""Per-op shardings on the tp axis: which nodes split, where collectives join the pieces.

The starting assignment is Megatron's: a linear whose input is replicated is
column-parallel (output sharded on its feature dim) when its sharded output flows into a
row-parallel linear, an attention core, or the loss before anything needs it whole; a
linear whose input is sharded on the contracted dim is row-parallel (partial output,
all-reduced: Megatron's g; backward all-reduces the column-parallel inputs: f). The
embedding is vocabulary-parallel (partial, all-reduced), the LM head column-parallel with a
vocabulary-parallel cross-entropy (three all-reduces of one value per token, never the
logits). Shard dims are followed through views, transposes and splits; where a sharded
value meets an op that needs it whole along the shard dim, an all-gather joins it.

Linear-like ops are `aten.linear` (weight out × in) and `aten.addmm` / `aten.mm` /
`aten.matmul` with a 2-D parameter as the right operand (weight in × out, Hugging Face's
Conv1D). Position embeddings (indices built from `arange`) stay replicated, as in Megatron,
and so do embeddings whose whole table the vocabulary-parallel embedding cannot stand in
for (`scale_grad_by_freq=True`, `max_norm`: `whole_table_embeddings`), with every linear
that shares their weight (a tied LM head); each tp rank then computes them as eager does.

Convolutions (one group, not transposed) are linear-like with their features on dim 1:
column = filters (weight dim 0), row = channels (weight dim 1). A channel shard passes
through per-channel ops — activations, pools and resizes, reductions over other dims,
and batch norms (their weight and bias split with it: `channel_norms`) — so a conv →
BatchNorm → ReLU → conv pair splits as Megatron's MLP does.

Generic linears: a linear-like op Megatron's rules leave replicated (its output does not
reach a row linear, an attention or the loss) is an open decision — column-parallel, with
whatever resharding its consumers then need, or replicated. `choose_layout` takes the
cheapest consistent choice under a per-token cost (`Rates`: compute, memory-bound ops and
tp-link transfers of forward and backward), starting from Megatron's assignment.

Fused projections: a column linear whose output the graph takes apart along the feature
dim — `split` / `chunk`, slices that tile it (`qkv[..., :q]`, `qkv[..., q:q + kv]`, ...)
or a view into (count, ...) whose count dim is unbound — is split block by block (each rank
holds its shard of every block), so each piece is an ordinary column-parallel output. A
sharded value whose local shard is such a concatenation is *blocked* (`layout.blocks`); an
op that would misread it (a row linear, a split into other pieces, a replicated operand
sliced contiguously) needs it whole instead.

Every layout carries a proof of its gradient semantics (search/tp_gradients.py): each
collective's backward contract holds for its consumers (`tp_gather` / `tp_reduce` need the
gradient of their output replicated — the same on every tp rank — and so do replicated
parameters, whose gradients tp never sums). A layout whose gradients the proof cannot
establish is never returned: `megatron_layout` replicates the column linears whose sharding
makes a gradient partial and recomputes (`layout.replicated_for_gradients` says which, and
why).

Placements use DTensor's vocabulary: "replicate", "shard(d)", "partial". The result is
independent of the tp degree (divisibility is checked by the planner; vocabularies that do
not divide are padded), so it is computed once per graph.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import sympy
import torch
import torch.fx as fx

from ..cost.compute import nbytes_expr, sym_expr
from ..graph import AH_PARAM, AH_ROLE, VAL, op_name, schema_args

R = "replicate"
P = "partial"

_VIEWS = {"aten.view.default", "aten.reshape.default", "aten._unsafe_view.default",
          "aten.flatten.using_ints", "aten.unflatten.int"}
_TRANSPOSES = {"aten.transpose.int", "aten.permute.default", "aten.t.default"}
_SPLITS = {"aten.split.Tensor", "aten.split_with_sizes.default", "aten.chunk.default",
           "aten.unbind.int"}
#: The class loss a vocabulary-parallel cross-entropy replaces (computed from logits; an
#: nll_loss reads log-probabilities, whose log-softmax needs the whole vocabulary anyway).
_CLASS_LOSSES = {"aten.cross_entropy_loss.default"}
#: Ops besides the element-wise ones whose operands line up dim by dim with the output
#: (the tp pass slices their replicated operands that span the shard dim).
_BROADCASTING = {"aten.cat.default", "aten.where.self"}
_ELEMENTWISE_PREFIXES = ("aten.add.", "aten.sub.", "aten.mul.", "aten.div.", "aten.gelu.",
                         "aten.silu.", "aten.relu.", "aten.tanh.", "aten.sigmoid.",
                         "aten.dropout.", "aten.neg.", "aten.pow.", "aten.exp.",
                         "aten.clone.", "aten._to_copy.", "aten.to.", "aten.contiguous.",
                         "aten.cos.", "aten.sin.", "aten.rsqrt.", "aten.sqrt.",
                         "aten.alias.", "aten.detach.", "aten.type_as.",
                         "aten.leaky_relu.", "aten.hardtanh.", "aten.elu.", "aten.relu6.",
                         "aten.hardswish.", "aten.hardsigmoid.", "aten.mish.")


def param_key(node: fx.Node) -> str:
    """A parameter's canonical name (tied weights share one), else the node's name."""
    return node.meta.get(AH_PARAM, node.name)


def shard(dim: int) -> str:
    return f"shard({dim})"


def shard_dim(placement: str) -> int | None:
    return int(placement[6:-1]) if placement.startswith("shard(") else None


@dataclass
class Collective:
    node: str
    kind: str            # "all_reduce" | "all_gather" | "halo" (a neighbour exchange)
    direction: str       # "forward" | "backward"
    nbytes: sympy.Expr
    axis: str = "tp"     # the mesh axis whose group it spans (plan.spatial_groups)


@dataclass(frozen=True)
class LinearParts:
    """A linear-like op: `x @ W(+ b)`; the weight dims that column / row parallelism split."""

    x: fx.Node
    weight: fx.Node
    bias: fx.Node | None
    column_dim: int   # weight dim of the output features
    row_dim: int      # weight dim of the input features
    feature: int = -1  # the features' dim in x and the output: -1, or 1 (channels) for a conv

    def feature_dim(self, value: torch.Tensor) -> int:
        """The features' dim of `value` (x or the output), counted from 0."""
        return self.feature % value.dim()


#: Convolutions whose weight (out channels × in channels × kernel) splits like a linear's:
#: by output channels (filter parallelism, column) or input channels (channel parallelism,
#: row), with args (input, weight, bias, stride, padding, dilation, ...)
CONV_OPS = {"aten.conv1d.default", "aten.conv2d.default", "aten.conv3d.default",
            "aten.conv1d.padding", "aten.conv2d.padding", "aten.conv3d.padding",
            "aten.convolution.default"}
#: Pools and resizes, channel by channel: their output keeps a shard of the batch or
#: channel dims (→ the number of pooled dims trailing)
_POOLS = {f"aten.{kind}_pool{d}d{suffix}": d
          for kind in ("max", "avg", "adaptive_avg", "adaptive_max") for d in (1, 2, 3)
          for suffix in (".default", "_with_indices.default")}
_POOLS.update({f"aten.upsample_{kind}{d}d.{overload}": d
               for kind, ds in (("nearest", (1, 2, 3)), ("linear", (1,)), ("bilinear", (2,)),
                                ("bicubic", (2,)), ("trilinear", (3,)))
               for d in ds for overload in ("vec", "default")})   # resizing, channel by channel
#: Batch normalization, channel by channel: an input split by channels (dim 1) normalizes
#: on its shard with its shard of the weight and bias (the statistics are per channel);
#: autohybrid's sync_batch_norm (dp > 1) returns (out, mean, invstd, unbiased var)
BATCH_NORMS = {"aten.batch_norm.default", "autohybrid.sync_batch_norm.default"}
#: Reductions over listed dims: a shard on a dim they keep moves to its place
_DIM_REDUCTIONS = {"aten.mean.dim", "aten.sum.dim_IntList", "aten.amax.default",
                   "aten.amin.default"}


def _conv_parts(node: fx.Node) -> LinearParts | None:
    """A convolution with a parameter weight, one group and not transposed (a grouped or
    depthwise conv ties its channels to its filters: it stays whole)."""
    name, args = op_name(node), node.args
    weight = args[1] if len(args) > 1 else None
    value = _val(weight)
    if not (isinstance(weight, fx.Node) and weight.meta.get(AH_ROLE) == "param"
            and value is not None and value.dim() >= 3):
        return None
    values = schema_args(node)
    if name == "aten.convolution.default" and values.get("transposed"):
        return None
    if values.get("groups", 1) != 1:
        return None
    x = _val(args[0])
    if x is None or x.dim() != value.dim():   # batched input: (N, C, spatial...)
        return None
    bias = values.get("bias")
    return LinearParts(args[0], weight, bias if isinstance(bias, fx.Node) else None, 0, 1,
                       feature=1)


def linear_parts(node: fx.Node) -> LinearParts | None:
    """`node` as a linear with a parameter weight, else None (e.g. activation @ activation)."""
    if node.op != "call_function":
        return None
    name, args = op_name(node), node.args
    if name == "aten.linear.default":
        bias = args[2] if len(args) > 2 and isinstance(args[2], fx.Node) else None
        return LinearParts(args[0], args[1], bias, 0, 1)
    if name in CONV_OPS:
        return _conv_parts(node)
    if name == "aten.addmm.default":
        bias, x, weight = args[0], args[1], args[2]
    elif name in ("aten.mm.default", "aten.matmul.default"):
        bias, x, weight = None, args[0], args[1]
    else:
        return None
    value = _val(weight)
    if not (isinstance(weight, fx.Node) and weight.meta.get(AH_ROLE) == "param"
            and value is not None and value.dim() == 2):
        return None
    return LinearParts(x, weight, bias if isinstance(bias, fx.Node) else None, 1, 0)


def is_position_embedding(node: fx.Node, budget: int = 16) -> bool:
    """An embedding looked up with indices computed from `arange` (positions), not data."""
    frontier = [node.args[1]]
    while frontier and budget > 0:
        current = frontier.pop()
        budget -= 1
        if not isinstance(current, fx.Node) or current.op != "call_function":
            continue
        if op_name(current).startswith("aten.arange"):
            return True
        frontier.extend(current.all_input_nodes)
    return False


def whole_table_embeddings(gm: fx.GraphModule) -> set[str]:
    """Parameter keys of embedding tables that must stay whole on every tp rank: looked up
    with `scale_grad_by_freq=True` (gradients scaled by the batch's id counts) or with
    `max_norm` (`embedding_renorm_` of the rows read, in place, before the lookup)."""
    out = set()
    for node in gm.graph.nodes:
        name = op_name(node)
        if name == "aten.embedding.default" and schema_args(node).get("scale_grad_by_freq"):
            out.add(param_key(node.args[0]))
        elif name == "aten.embedding_renorm_.default":
            table = node.args[0]
            if op_name(table) == "aten.detach.default":
                table = table.args[0]
            if table.op == "placeholder":
                out.add(param_key(table))
    return out


def params_read_elsewhere(gm: fx.GraphModule) -> set[str]:
    """Parameter keys read by an op that would not read them split: anything but a linear
    or convolution (as its weight or bias), an embedding (its table), a batch norm (its
    weight or bias) or a metadata check. Such a parameter stays whole on every tp rank,
    with the layers that use it: a model adding `λ · fc.weight.pow(2).sum()` to its
    output, split, would penalize its tp rank's shard only — a silently wrong loss."""
    out = set()
    for node in gm.graph.nodes:
        if node.op != "placeholder" or node.meta.get(AH_ROLE) != "param":
            continue
        for user in node.users:
            parts = linear_parts(user)
            name = op_name(user)
            if (parts is not None and node in (parts.weight, parts.bias)) or _is_check(user) \
                    or (name == "aten.embedding.default" and user.args[0] is node
                        and node not in user.args[1:]) \
                    or (name in BATCH_NORMS and node in user.args[1:3]
                        and user.args[0] is not node):
                continue
            out.add(param_key(node))
            break
    return out


@dataclass
class TensorParallelLayout:
    """Placements of every node and the collectives the tp axis needs, per node name."""

    placements: dict[str, str] = field(default_factory=dict)
    linear_roles: dict[str, str] = field(default_factory=dict)   # "column" | "row" | "replicate"
    param_placements: dict[str, str] = field(default_factory=dict)  # by canonical name
    collectives: list[Collective] = field(default_factory=list)
    kv_linears: set[str] = field(default_factory=set)   # key/value-only projections (GQA)
    kv_params: set[str] = field(default_factory=set)    # their weights and biases
    vocab_params: set[str] = field(default_factory=set)  # split by vocabulary rows (padded)
    vocab_linears: set[str] = field(default_factory=set)  # output layers over the vocabulary
    vocab: int | None = None                             # the vocabulary size they split
    open: list[str] = field(default_factory=list)        # generic linears: cost decides
    shard_sizes: dict[str, int] = field(default_factory=dict)  # param → size of split dim
    #: sharded value → full sizes of the blocks its shard concatenates (fused projections)
    blocks: dict[str, tuple[int, ...]] = field(default_factory=dict)
    fused_params: dict[str, tuple[int, ...]] = field(default_factory=dict)  # param → blocks
    fused_kv_params: set[str] = field(default_factory=set)  # fused ones computing k / v too
    open_params: dict[str, str] = field(default_factory=dict)  # param → its open linear
    #: column linears replicated because their sharding broke a gradient contract → why
    replicated_for_gradients: dict[str, str] = field(default_factory=dict)
    #: replicated node → (origin op, operand) of the partial gradient it would receive;
    #: empty for every layout megatron_layout returns (the proof holds)
    partial_grads: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: batch norms run on channel shards (their input split by channels)
    channel_norms: set[str] = field(default_factory=set)
    #: parameter → the linears reading it, where they would split it differently (a
    #: weight tied between a column and a row linear): megatron_layout replicates them
    tied_conflicts: dict[str, list[str]] = field(default_factory=dict)

    def is_sharded(self, node: fx.Node) -> bool:
        return self.placements.get(node.name, R) != R


def _val(node) -> torch.Tensor | None:
    if isinstance(node, fx.Node):
        val = node.meta.get(VAL)
        return val if isinstance(val, torch.Tensor) else None
    return None


def _flows_to_consumer_that_shards(node: fx.Node, dim: int, blocks: tuple[int, ...] = (),
                                   budget: int = 64) -> bool:
    """Does a value sharded on `dim` (with `blocks`) reach a row linear, attention or the
    loss first?"""
    frontier, seen = [(node, dim, blocks)], set()
    while frontier and budget > 0:
        current, d, b = frontier.pop()
        budget -= 1
        for user in current.users:
            if user in seen:
                continue
            seen.add(user)
            name = op_name(user)
            if _is_check(user) or _is_norm_statistic(user):
                continue   # (a norm's statistics update its running ones: no activation)
            parts = linear_parts(user)
            if parts is not None and parts.x is current:
                return d == parts.feature_dim(_val(current)) and not b
            if name in _CLASS_LOSSES or name == "aten.scaled_dot_product_attention.default":
                return not b
            moved = follow_blocked(user, current, d, b)
            if moved is None:
                return False
            frontier.append((user, *moved))
    return False


def _is_check(node: fx.Node) -> bool:
    """Metadata assertions export leaves in the graph: no output, no data movement."""
    return op_name(node).startswith(("aten._assert", "aten.sym_constrain"))


def _follow(user: fx.Node, src: fx.Node, dim: int):
    """Where the shard dim of `src` lands in `user`'s output (None: user needs it whole)."""
    name = op_name(user)
    if user.target is operator.getitem:
        return 0 if _is_norm_statistic(user) else dim
    if name in _VIEWS:
        return _view_dim(_val(src), _val(user), dim, user)
    if name in _TRANSPOSES:
        rank = _val(src).dim()
        if name == "aten.t.default":
            order = [1, 0]
        elif name == "aten.transpose.int":
            a, b = (x % rank for x in user.args[1:3])
            order = list(range(rank))
            order[a], order[b] = order[b], order[a]
        else:
            order = [x % rank for x in user.args[1]]
        return order.index(dim)
    if name in _SPLITS:
        position = 1 if name == "aten.unbind.int" else 2
        along = user.args[position] if len(user.args) > position else 0
        along %= _val(src).dim()
        if name == "aten.unbind.int":
            if along == dim:
                return None
            return dim - 1 if along < dim else dim
        return dim
    if name in ("aten.slice.Tensor", "aten.cat.default", "aten.repeat_interleave.self_int",
                "aten.select.int", "aten.unsqueeze.default", "aten.squeeze.dim"):
        along = user.args[1] if len(user.args) > 1 else 0
        rank = _val(src).dim() + (1 if name == "aten.unsqueeze.default" else 0)
        along = along % rank if isinstance(along, int) else 0
        if name == "aten.repeat_interleave.self_int":
            along = (user.args[2] if len(user.args) > 2 else 0) % rank
            return dim
        if name == "aten.unsqueeze.default":
            return dim + 1 if along <= dim else dim
        if along == dim:
            return None
        if name in ("aten.select.int", "aten.squeeze.dim"):
            return dim - 1 if along < dim else dim
        return dim
    if name in ("aten.expand.default",) or name.startswith(_ELEMENTWISE_PREFIXES):
        out = _val(user)
        if out is None:
            return None
        return dim + (out.dim() - _val(src).dim())
    if name in BATCH_NORMS and user.args[0] is src:
        return 1 if dim == 1 else None
    if name in _POOLS and user.args[0] is src:
        return dim if dim < _val(src).dim() - _POOLS[name] else None
    if name in _DIM_REDUCTIONS and user.args[0] is src:
        return reduced_dim(user, _val(src).dim(), dim)
    return None


def reduced_dim(user: fx.Node, rank: int, dim: int) -> int | None:
    """Where dim `dim` lands in a reduction's output (None: it is reduced)."""
    values = schema_args(user)
    dims = values.get("dim")
    if dims is None or (isinstance(dims, (list, tuple)) and not dims):
        return None   # over every dim
    dims = {int(d) % rank for d in (dims if isinstance(dims, (list, tuple)) else [dims])}
    if dim in dims:
        return None
    return dim if values.get("keepdim") else dim - sum(d < dim for d in dims)


def view_span(src: torch.Tensor, out: torch.Tensor, dim: int) -> list[int] | None:
    """The dims of `out` that dim `dim` of `src` becomes under a view (None: merged away)."""
    before = sympy.Mul(*[sym_expr(s) for s in src.shape[:dim]])
    width = sym_expr(src.shape[dim])
    running = sympy.Integer(1)
    for k, size in enumerate(out.shape):
        if running == before:
            span, covered = [], sympy.Integer(1)
            for j in range(k, out.dim()):
                span.append(j)
                covered = covered * sym_expr(out.shape[j])
                if covered == width:
                    return span
            return span
        running = running * sym_expr(size)
    return None


def _view_dim(src: torch.Tensor, out: torch.Tensor, dim: int,
              view: fx.Node | None = None) -> int | None:
    """The dim of `out` where a shard on `src` dim `dim` lands.

    A view that splits the shard dim into several (hidden → heads × head_dim, or
    fused qkv → 3 × heads × head_dim) keeps the shard on the outermost of them, except a
    dim the graph later takes apart (unbind/select/split along it: the fused count)."""
    span = view_span(src, out, dim)
    if span is None:
        return None
    for j in span[:-1]:
        if view is None or not _taken_apart(view, j):
            return j
    return span[-1]


_TAKE_APART = {"aten.unbind.int", "aten.select.int", "aten.split.Tensor",
               "aten.split_with_sizes.default", "aten.chunk.default"}


def _taken_apart(node: fx.Node, dim: int, budget: int = 8) -> bool:
    """Is dim `dim` of `node` later unbound, selected or split (through transposes)?"""
    frontier = [(node, dim)]
    while frontier and budget > 0:
        current, d = frontier.pop()
        budget -= 1
        for user in current.users:
            name = op_name(user)
            if name in _TAKE_APART:
                position = 1 if name in ("aten.unbind.int", "aten.select.int") else 2
                along = user.args[position] if len(user.args) > position else 0
                if along % _val(current).dim() == d:
                    return True
            elif name in _TRANSPOSES or name in ("aten.contiguous.default", "aten.clone.default"):
                moved = _follow(user, current, d)
                if moved is not None:
                    frontier.append((user, moved))
    return False


# ------------------------------------------------------------------ fused blocks
_SPLIT_PIECES = {"aten.split.Tensor", "aten.split_with_sizes.default", "aten.chunk.default"}


def _static(size) -> int | None:
    """A dim size as an int, None when symbolic."""
    return None if isinstance(size, torch.SymInt) else int(size)


def _slice_range(node: fx.Node, size: int) -> tuple[int, int] | None:
    """The [start, end) an `aten.slice.Tensor` node takes of a dim of `size` (step 1
    only; None otherwise or when a bound is symbolic)."""
    args = list(node.args) + [None] * (5 - len(node.args))
    start, end, step = args[2], args[3], args[4]
    start = node.kwargs.get("start", start)
    end = node.kwargs.get("end", end)
    step = node.kwargs.get("step", step)
    if (step or 1) != 1 or isinstance(start, (fx.Node, torch.SymInt)) or \
            isinstance(end, (fx.Node, torch.SymInt)):
        return None
    start, end = 0 if start is None else int(start), size if end is None else int(end)
    start, end = (start + size if start < 0 else start), (end + size if end < 0 else end)
    return max(0, min(start, size)), max(0, min(end, size))


def _along(node: fx.Node, src: fx.Node) -> int | None:
    """The dim a slice / split / chunk node works along (normalized), else None."""
    name = op_name(node)
    if name not in _SPLIT_PIECES and name != "aten.slice.Tensor":
        return None
    val = _val(src)
    if val is None:
        return None
    along = node.args[1 if name == "aten.slice.Tensor" else 2] \
        if len(node.args) > (1 if name == "aten.slice.Tensor" else 2) else \
        node.kwargs.get("dim", 0)
    return along % val.dim() if isinstance(along, int) else None


def _split_pieces(node: fx.Node, dim: int) -> tuple[int, ...] | None:
    """Sizes along `dim` of the pieces a split / chunk node returns (None: symbolic)."""
    pieces = node.meta.get(VAL)
    if not isinstance(pieces, (list, tuple)):
        return None
    sizes = tuple(_static(p.shape[dim]) for p in pieces)
    return None if None in sizes else sizes


def _tiling(src: fx.Node, dim: int) -> tuple[int, ...] | None:
    """Block sizes when the slices of `src` along `dim` tile it exactly ([0, a), [a, b),
    ... [z, size)), else None."""
    size = _static(_val(src).shape[dim])
    if size is None:
        return None
    ranges = set()
    for user in src.users:
        if op_name(user) == "aten.slice.Tensor" and _along(user, src) == dim:
            r = _slice_range(user, size)
            if r is None:
                return None
            ranges.add(r)
    ordered = sorted(ranges)
    if len(ordered) < 2 or ordered[0][0] != 0 or ordered[-1][1] != size:
        return None
    if any(a[1] != b[0] for a, b in zip(ordered, ordered[1:])) or \
            any(a >= b for a, b in ordered):
        return None
    return tuple(b - a for a, b in ordered)


def _block_ranges(blocks: tuple[int, ...]) -> list[tuple[int, int]]:
    out, start = [], 0
    for size in blocks:
        out.append((start, start + size))
        start += size
    return out


def fused_blocks(node: fx.Node, dim: int, budget: int = 16) -> tuple[int, ...]:
    """Full sizes of the blocks the graph takes dim `dim` of `node` apart into (() when
    it does not): a split / chunk along it, slices that tile it, or a view into
    (count, ...) whose count dim is unbound — looked for through ops that keep the dim."""
    frontier = [(node, dim)]
    while frontier and budget > 0:
        current, d = frontier.pop()
        budget -= 1
        val = _val(current)
        if val is None or _static(val.shape[d]) is None:
            continue
        for user in current.users:
            if _along(user, current) == d:
                pieces = _split_pieces(user, d) if op_name(user) in _SPLIT_PIECES \
                    else _tiling(current, d)
                if pieces is not None and len(pieces) > 1:
                    return pieces
                continue
            if op_name(user) in _VIEWS and _val(user) is not None:
                span = view_span(val, _val(user), d)
                if span and len(span) > 1 and _taken_apart(user, span[0]):
                    count = _static(_val(user).shape[span[0]])
                    size = _static(val.shape[d])
                    if count and size and size % count == 0:
                        return (size // count,) * count
            moved = _follow(user, current, d)
            if isinstance(moved, int):
                frontier.append((user, moved))
    return ()


def follow_blocked(user: fx.Node, src: fx.Node, dim: int, blocks: tuple[int, ...]
                   ) -> tuple[int, tuple[int, ...]] | None:
    """(dim, blocks) of `user`'s output shard when `src` is sharded on `dim` with local
    shard `blocks` (() = one contiguous shard); None when `user` needs `src` whole.

    Taking a blocked value apart is local only along its own blocks (each piece is then
    an ordinary shard); a view that splits the shard dim keeps a contiguous shard on its
    outermost part, or — for a blocked value — on the part after an unbound count of
    equal blocks; an op that changes the size of the shard dim keeps no blocks."""
    val, out = _val(src), _val(user)
    name = op_name(user)
    if _along(user, src) == dim:
        size = _static(val.shape[dim])
        if name in _SPLIT_PIECES:
            pieces = _split_pieces(user, dim)
            return (dim, ()) if blocks and pieces == blocks else None
        r = _slice_range(user, size) if size is not None else None
        if r == (0, size):
            return dim, blocks
        return (dim, ()) if blocks and r in _block_ranges(blocks) else None
    if name in _VIEWS and out is not None:
        span = view_span(val, out, dim)
        moved = _view_dim(val, out, dim, user)
        if span is None or moved is None:
            return None
        if len(span) == 1:
            same = _static(out.shape[moved]) == _static(val.shape[dim])
            return (moved, blocks if same else ()) if same or not blocks else None
        if moved == span[0]:
            return None if blocks else (moved, ())
        count = math.prod(_static(out.shape[j]) or 0 for j in span[:span.index(moved)])
        size = _static(val.shape[dim])
        equal = (size // count,) * count if count and size and size % count == 0 else None
        return (moved, ()) if blocks and blocks == equal else None
    moved = _follow(user, src, dim)
    if not isinstance(moved, int):
        return None
    if blocks and out is not None and moved < out.dim() and \
            _static(out.shape[moved]) != _static(val.shape[dim]):
        return None  # e.g. repeat_interleave: the blocks no longer line up
    return moved, blocks


def propagate_layout(gm: fx.GraphModule, choices: dict[str, str],
                     forced: dict[str, str] | None = None) -> TensorParallelLayout:
    """One pass of Megatron's rules (unproven): `forced` linears are kept replicated."""
    forced = forced or {}
    layout = TensorParallelLayout()
    place = layout.placements
    whole = whole_table_embeddings(gm) | params_read_elsewhere(gm)
    splits: dict[str, dict[str, str]] = {}    # param → linear → how that linear splits it
    for node in gm.graph.nodes:
        if node.op != "call_function":
            place[node.name] = R
            continue
        name = op_name(node)
        ins = node.all_input_nodes  # lists too (cat, broadcast_tensors)
        if node.target is operator.getitem:
            place[node.name] = place.get(node.args[0].name, R)
            if _is_norm_statistic(node) and place[node.name] != R:
                place[node.name] = shard(0)   # a per-channel statistic of channel shards
            if node.args[0].name in layout.blocks:
                layout.blocks[node.name] = layout.blocks[node.args[0].name]
            continue
        if _is_check(node):
            place[node.name] = R
            continue
        parts = linear_parts(node)
        if parts is not None:
            if param_key(parts.weight) in whole or (
                    parts.bias is not None and param_key(parts.bias) in whole):
                _whole_linear(node, parts, layout)
            else:
                _linear(node, parts, layout, choices.get(node.name), node.name in forced)
            for key, split in _param_splits(node, parts, layout).items():
                splits.setdefault(key, {})[node.name] = split
            continue
        if name == "aten.embedding.default":
            place[node.name] = R
            if is_position_embedding(node) or param_key(node.args[0]) in whole:
                continue
            weight = node.args[0]
            layout.param_placements[param_key(weight)] = shard(0)
            _mark_vocab(layout, weight, 0)
            layout.collectives.append(Collective(node.name, "all_reduce", "forward",
                                                 nbytes_expr(_val(node))))
            continue
        sharded = [a for a in ins if shard_dim(place.get(a.name, R)) is not None]
        if not sharded:
            place[node.name] = R
            continue
        if name in BATCH_NORMS and _channel_split(node, layout) and not any(
                isinstance(p, fx.Node) and param_key(p) in whole for p in node.args[1:3]):
            _channel_norm(node, layout)
            continue
        if name in _CLASS_LOSSES and not layout.blocks.get(node.args[0].name):
            place[node.name] = R  # vocabulary-parallel loss: per-token max, sum, target logit
            shape = list(_val(node.args[0]).shape)   # (N, C, d1, ...): classes on dim 1
            tokens = sympy.Mul(*[sym_expr(s) for s in shape[:1] + shape[2:]])
            layout.collectives.append(Collective(node.name, "all_reduce", "forward",
                                                 3 * tokens * 4))
            _mark_vocab_head(layout, node.args[0])
            continue
        if name == "aten.scaled_dot_product_attention.default":
            moved = _attention(node, layout)
        elif name in _CLASS_LOSSES:
            moved = None  # blocked logits: the loss reads them whole
        else:
            moved = _combine(node, sharded, layout)
        if moved is None:  # needs the whole tensor: all-gather the sharded input(s)
            for a in sharded:
                layout.collectives.append(Collective(node.name, "all_gather", "forward",
                                                     nbytes_expr(_val(a))))
            place[node.name] = R
        else:
            place[node.name] = shard(moved[0])
            if moved[1]:
                layout.blocks[node.name] = moved[1]
    mark_key_value_projections(gm, layout)
    layout.tied_conflicts = {key: list(users) for key, users in splits.items()
                             if len(set(users.values())) > 1}
    return layout


def _param_splits(node: fx.Node, parts: LinearParts,
                  layout: TensorParallelLayout) -> dict[str, str]:
    """How linear `node` reads its weight and bias under `layout`: whole (R) or the
    placement of its shard. A parameter several linears read (tied, or a module called
    more than once) must be read alike by all: it has one placement on each rank."""
    role = layout.linear_roles.get(node.name)
    out = {param_key(parts.weight): (shard(parts.row_dim) if role == "row"
                                     else shard(parts.column_dim) if role == "column" else R)}
    if parts.bias is not None:
        out[param_key(parts.bias)] = shard(0) if role == "column" else R
    return out


def _is_norm_statistic(node: fx.Node) -> bool:
    """getitem i ≥ 1 of a sync_batch_norm: a per-channel statistic, (C,)."""
    return (node.target is operator.getitem and isinstance(node.args[0], fx.Node)
            and op_name(node.args[0]) == "autohybrid.sync_batch_norm.default"
            and node.args[1] >= 1)


def _channel_split(node: fx.Node, layout: TensorParallelLayout) -> bool:
    """A batch norm whose input is split by channels (dim 1), in one contiguous shard."""
    x = node.args[0]
    return (shard_dim(layout.placements.get(x.name, R)) == 1 and not layout.blocks.get(x.name)
            and _val(x) is not None and _val(x).dim() >= 2)


def _channel_norm(node: fx.Node, layout: TensorParallelLayout) -> None:
    """Normalize on the channel shard: weight and bias split with it (the pass slices
    the running statistics, or gathers the shard's batch statistics to update them)."""
    layout.placements[node.name] = shard(1)
    layout.channel_norms.add(node.name)
    channels = int(_val(node.args[0]).shape[1])
    for p in node.args[1:3]:
        if isinstance(p, fx.Node) and p.meta.get(AH_ROLE) == "param":
            layout.param_placements[param_key(p)] = shard(0)
            layout.shard_sizes[param_key(p)] = channels


def _attention(node: fx.Node, layout: TensorParallelLayout) -> tuple[int, tuple] | None:
    """Attention runs on this rank's heads when query, key and value are all split on the
    heads dim (one contiguous shard each); otherwise it needs them whole."""
    for a in node.args[:3]:
        if not isinstance(a, fx.Node) or shard_dim(layout.placements.get(a.name, R)) != 1 \
                or layout.blocks.get(a.name):
            return None
    return 1, ()


def _combine(node: fx.Node, sharded: list[fx.Node], layout: TensorParallelLayout
             ) -> tuple[int, tuple[int, ...]] | None:
    """(dim, blocks) of `node`'s output shard, or None when it needs its inputs whole:
    every sharded operand must land on the same output dim with the same blocks and the
    full size there (a sharded operand broadcast along its shard dim cannot be split);
    a blocked output cannot take a replicated operand spanning its shard dim (the slice
    `tp_split` cuts is contiguous, the blocked shard is not)."""
    found = {follow_blocked(node, a, shard_dim(layout.placements[a.name]),
                            layout.blocks.get(a.name, ())) for a in sharded}
    if len(found) != 1 or None in found:
        return None
    moved, blocks = found.pop()
    out = _val(node)
    name = op_name(node)
    broadcasting = name.startswith(_ELEMENTWISE_PREFIXES) or name in _BROADCASTING
    if out is None or moved >= out.dim() or not broadcasting:
        return moved, blocks
    for a in node.all_input_nodes:
        val = _val(a)
        if val is None:
            continue
        if a in sharded:
            if _static(val.shape[shard_dim(layout.placements[a.name])]) != \
                    _static(out.shape[moved]):
                return None  # broadcast along its shard dim
            continue
        dim = moved - (out.dim() - val.dim())
        if blocks and dim >= 0 and _static(val.shape[dim]) != 1:
            return None
    return moved, blocks


def _mark_vocab(layout: TensorParallelLayout, weight: fx.Node, dim: int) -> None:
    layout.vocab_params.add(param_key(weight))
    layout.vocab = int(_val(weight).shape[dim])


def mark_vocab_linear(layout: TensorParallelLayout, node: fx.Node, parts: LinearParts) -> None:
    """Column linear `node` computes logits over a vocabulary: weight and bias split by
    vocabulary rows, padded to a multiple of tp."""
    layout.vocab_linears.add(node.name)
    _mark_vocab(layout, parts.weight, parts.column_dim)
    if parts.bias is not None:
        layout.vocab_params.add(param_key(parts.bias))


def _mark_vocab_head(layout: TensorParallelLayout, logits: fx.Node, budget: int = 16) -> None:
    """The column linear producing the logits a vocabulary-parallel loss reads."""
    frontier = [logits]
    while frontier and budget > 0:
        node = frontier.pop()
        budget -= 1
        if not isinstance(node, fx.Node) or node.op != "call_function":
            continue
        parts = linear_parts(node)
        if parts is not None:
            if layout.linear_roles.get(node.name) == "column":
                mark_vocab_linear(layout, node, parts)
            continue
        frontier.extend(a for a in node.all_input_nodes if shard_dim(
            layout.placements.get(a.name, R)) is not None)


def _attention_sources(value: fx.Node, budget: int = 64) -> set[fx.Node]:
    """The linears an attention operand comes from, through views and elementwise ops."""
    found, frontier, seen = set(), [value], set()
    while frontier and budget > 0:
        node = frontier.pop()
        budget -= 1
        if node in seen or node.op != "call_function":
            continue
        seen.add(node)
        if linear_parts(node) is not None:
            found.add(node)
            continue
        frontier.extend(a for a in node.all_input_nodes
                        if a.meta.get(AH_ROLE) not in ("param", "buffer", "constant"))
    return found


def mark_key_value_projections(gm: fx.GraphModule, layout: TensorParallelLayout) -> None:
    """Linears feeding only attention keys/values: with fewer KV heads than tp ranks they
    are replicated over tp / kv_heads ranks (grouped-query attention), not split tp ways."""
    for node in gm.graph.nodes:
        if op_name(node) != "aten.scaled_dot_product_attention.default":
            continue
        queries = _attention_sources(node.args[0])
        for source in _attention_sources(node.args[1]) | _attention_sources(node.args[2]):
            if source.name in layout.blocks:  # fused q | k | v: its blocks split tp ways
                layout.fused_kv_params.update(param_key(a) for a in source.args[1:3]
                                              if isinstance(a, fx.Node))
                continue
            if source not in queries and layout.linear_roles.get(source.name) == "column":
                layout.kv_linears.add(source.name)
                layout.kv_params.update(param_key(a) for a in source.args[1:3]
                                        if isinstance(a, fx.Node))


def _whole_linear(node: fx.Node, parts: LinearParts, layout: TensorParallelLayout) -> None:
    """A linear sharing a whole-table embedding's weight, or whose weight or bias another
    op reads (`params_read_elsewhere`): replicated, its input gathered."""
    if shard_dim(layout.placements.get(parts.x.name, R)) is not None:
        layout.collectives.append(Collective(node.name, "all_gather", "forward",
                                             nbytes_expr(_val(parts.x))))
    layout.linear_roles[node.name] = "replicate"
    layout.placements[node.name] = R


def _linear(node: fx.Node, parts: LinearParts, layout: TensorParallelLayout,
            choice: str | None, forced: bool = False) -> None:
    x, weight, bias = parts.x, parts.weight, parts.bias
    place = layout.placements
    out = _val(node)
    x_dim = shard_dim(place.get(x.name, R))
    x_blocked = bool(layout.blocks.get(x.name))
    feature = parts.feature_dim(out)
    if x_dim is not None and x_dim == parts.feature_dim(_val(x)) and not x_blocked:
        # row-parallel: partial → all-reduce
        layout.linear_roles[node.name] = "row"
        layout.param_placements[param_key(weight)] = shard(parts.row_dim)
        layout.shard_sizes[param_key(weight)] = int(_val(weight).shape[parts.row_dim])
        place[node.name] = R
        layout.collectives.append(Collective(node.name, "all_reduce", "forward",
                                             nbytes_expr(out)))
        return
    if x_dim is not None:  # sharded elsewhere: gather, then decide as for a replicated input
        layout.collectives.append(Collective(node.name, "all_gather", "forward",
                                             nbytes_expr(_val(x))))
    features = _static(out.shape[feature])
    splittable = not forced and features is not None and features > 1
    blocks = fused_blocks(node, feature) if splittable and parts.feature == -1 else ()
    megatron = splittable and _flows_to_consumer_that_shards(node, feature, blocks)
    if splittable and not megatron:
        layout.open.append(node.name)
    if megatron or (splittable and choice == "column"):
        layout.linear_roles[node.name] = "column"
        layout.param_placements[param_key(weight)] = shard(parts.column_dim)
        layout.shard_sizes[param_key(weight)] = int(_val(weight).shape[parts.column_dim])
        if not megatron:
            layout.open_params[param_key(weight)] = node.name
        if bias is not None:
            layout.param_placements[param_key(bias)] = shard(0)
        place[node.name] = shard(feature)
        if blocks:
            layout.blocks[node.name] = blocks
            for p in (weight, bias):
                if p is not None:
                    layout.fused_params[param_key(p)] = blocks
        # Megatron's f: one backward all-reduce per distinct input (q, k, v share theirs)
        already = any(c.direction == "backward" and c.node == x.name for c in layout.collectives)
        if not already and (x.op != "placeholder" or x.meta.get(AH_ROLE) != "input"):
            layout.collectives.append(Collective(x.name, "all_reduce", "backward",
                                                 nbytes_expr(_val(x))))
        return
    layout.linear_roles[node.name] = "replicate"
    place[node.name] = R
