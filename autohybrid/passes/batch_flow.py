"""Which values of a graph keep the samples of a batch apart: a dataflow proof.

Data parallelism and microbatching run the training graph on shards of the batch and add
the shards' loss numerators (passes/global_loss.py). That gives eager's loss on the whole
batch exactly when every value the loss's final reduction reads is *per-sample*: for any
split of the batch into contiguous shards, the value computed on the whole batch is the
concatenation of the values computed on the shards. This module proves that, node by
node, in one forward walk over the graph, or names the node where the proof fails.

Each value gets a `Flow`:

- ``rep``: the same on every shard as on the whole batch (parameters, constants, masks
  built from the sequence length, ...). Its shape has no batch-sized dim.
- ``split(d)``: dim `d` (of size b·c, b a batch symbol, c free of it) is the batch: the
  whole batch's value is the concatenation along `d` of the shards' values, each
  sample owning one contiguous block of c. Model inputs and targets are split(0).
- ``perm(d, π)``: dim `d` holds the rows of a split space in the order of the batch-wide
  sort π (MoE dispatch: tokens grouped by expert); row r is a fixed function of the
  source row π(r) and of replicated values. Orders differ between shard and batch, but
  each row's value does not, so a perm value may be used only where order cannot matter:
  rows sent back to their source positions by π's inverse, row-wise computations, or a
  final sum.
- ``counts(π, E)`` / ``offsets(π, E)``: the number of rows per group (and its running
  sum) of the integer keys π sorted, keys known to lie in [0, E). These combine the
  samples (they count over the whole batch) and are accepted in one place only: as the
  group offsets of a grouped matmul over rows sorted by π, where row r then belongs to
  group key(π(r)) — a function of its own source row.
- ``partial``: a sum over the shard's samples whose sum over the shards is the whole
  batch's (a sum over the batch dim; `histc` with a fixed range of batched values; a
  batch-size expression of degree one in the batch, `scalar_tensor(b·T)`). Accepted only
  as the input of `autohybrid::batch_sum`, which adds the shards' partial sums over dp
  and is rep (passes/global_loss.py inserts it for whole-batch statistics in a loss).
- ``unknown``: not proven; carries the node where the proof failed and why.

Integer values may also be *pointers*: `ptr` names the space their values index
(``("split", N)`` for the rows of a split dim of size N, ``("perm", π, N)`` for π's
sorted rows). A pointer of a row points into rows of the same sample, so gathering
`x[ptr]` from the space it points into keeps samples apart, while arithmetic on pointer
values (other than floor division by a divisor of the per-sample block) does not
(`torch.arange(batch)` is a pointer: its values are shard-local positions).

Python numbers are rep, ``batch-size`` (an expression of the batch symbols: usable as
a size, refused as a value, so `x / x.shape[0]` is refused) or unknown (read from data).

The rules, by kind of op (anything else: rep when all its inputs are rep, else unknown):
element-wise ops with broadcasting (the split dims must line up); views and reshapes (the
batch dim may merge with the dims after it; merged with dims before it, as
nn.MultiheadAttention's [seq·batch, features], it is split with an `outer` factor: rows
interleaved, each one sample's, fine for row-wise ops until a view separates it again);
`torch.no_grad()` / autocast regions are analysed inside; reductions,
scans, sorts, softmax and the like along other dims; the batch dim of a reduction, scan,
`cat` or `select` is refused (a `cat` ignores operands of no elements: a key/value
cache's first update onto `torch.tensor([])`). Matrix products keep a split dim that is
not contracted; attention keeps a leading dim of query, key, value and mask alike;
convolution, pooling, group/instance norm keep dim 0, layer/RMS norm the dims before the
normalized ones;
RNNs keep their batch dim; embeddings and gathers from a replicated table keep the index
layout; `x[ptr]` gathers rows through a pointer into x's own batch dim (causal masks in
Hugging Face models index position ids with `arange(batch)`); ops that read only their
inputs' shapes (`new_ones`, `zeros_like`, ...) are constant along the batch. For MoE
dispatch: sorting the flattened keys along the batch gives perm values; `inv[perm] =
arange(N)` (an index_put with a permutation) and `out[perm] = rows` send perm rows back
to split ones; `histc` / `bincount` of π's keys with one bin per key value, its
`cumsum`, and a grouped matmul over π's rows with those offsets follow the rule above;
`torch.where(mask)` over a batch-split mask gives perm values of the selection (each
picked row its own sample's, the batch coordinate a pointer into the split dim, the
count a new batch-sized symbol), so a hand-written loop over experts gathering its
tokens by them and adding its outputs back with `index_add_` is per-sample.
Capacity-limited routing (a token's slot depends on the tokens before it in the batch,
`cumsum` along the batch) and batch statistics stay unknown; sums over the batch are
partial, rep once `autohybrid::batch_sum` adds them over the shards (a load-balancing
loss term: passes/batch_stats.py). In-place writes update the value written and mark its other
aliases unknown when the write changes how they depend on the batch.

Each rule claims rep / split / perm only when the op's semantics give it for every split
of the batch and every parameter value (so gradients, derivatives of the same identity,
split as well); the graph's shapes are cross-checked (a value whose batch-sized dims are
not its flow's is unknown). Training-mode BatchNorm is accepted as per-sample:
`sync_batch_norm` gives it the global batch's statistics over dp, and microbatching a
BatchNorm model is refused elsewhere (search/planner.py, compiled.py).
"""
from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any, Callable, Iterable

import sympy
import torch
import torch.fx as fx

from ..graph import AH_ROLE, SYM_SIZE_OPS, VAL, op_name, schema_args

REP, SPLIT, PERM, COUNTS, OFFSETS, BSIZE, PARTIAL, UNKNOWN = (
    "rep", "split", "perm", "counts", "offsets", "batch-size", "partial", "unknown")


@dataclasses.dataclass(frozen=True)
class Flow:
    """How one value depends on the batch (see the module docstring)."""

    kind: str
    dim: int = -1
    perm: fx.Node | None = None      # perm / counts / offsets: the sort π
    ptr: tuple | None = None         # pointer values: the space they index
    iota: bool = False               # values are their own position along `dim`
    bijective: bool = False          # ptr: a permutation of its whole space
    const: bool = False              # split: equal, batch-independent slices along dim
    bound: int | None = None         # integer values in [0, bound)
    groups: int = 0                  # counts / offsets: number of groups
    outer: Any = 1                   # split: the batch is interleaved below this factor
    culprit: fx.Node | None = None   # unknown: where the proof failed
    why: str = ""

    @property
    def batched(self) -> bool:
        return self.kind in (SPLIT, PERM)

    def layout(self) -> tuple:
        return (self.kind, self.dim, self.perm, self.outer)

    def moved(self, dim: int, **content: Any) -> "Flow":
        """The same layout at `dim`, with only the `content` given."""
        return Flow(self.kind, dim, self.perm, outer=self.outer, **content)


_REP = Flow(REP)
_BSIZE = Flow(BSIZE)


def unknown(node: fx.Node, why: str) -> Flow:
    return Flow(UNKNOWN, culprit=node, why=why)


class _Fail(Exception):
    """A rule could not prove its node per-sample (the reason is the message)."""


# ---------------------------------------------------------------------------- symbols
class _Sizes:
    """Symbolic size arithmetic against the batch symbols (cached)."""

    def __init__(self, batch: set, assume: bool = False):
        self.batch = frozenset(batch)
        self._factor: dict = {}
        #: whether `assume_eq` may take two sizes as equal that the graph does not relate
        self.assume = assume
        #: (a, b): per-sample sizes taken as equal (`assume_eq`), to check on each batch
        self.assumed: list[tuple[Any, Any]] = []

    def add_batch(self, symbols: Iterable) -> None:
        """Count `symbols` as batch-sized too (the rows a selection over the batch picks:
        as many per shard as its own samples give, adding up over the shards)."""
        self.batch = self.batch | frozenset(symbols)
        self._factor.clear()

    @staticmethod
    def expr(size: Any) -> Any:
        if isinstance(size, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return size.node.expr
        if isinstance(size, bool):
            return sympy.Integer(int(size))
        if isinstance(size, int):
            return sympy.Integer(size)
        return sympy.Float(size) if isinstance(size, float) else size

    def has_batch(self, size: Any) -> bool:
        e = self.expr(size)
        return bool(getattr(e, "free_symbols", set()) & self.batch)

    def factor(self, size: Any):
        """c when `size` is b·c with b a batch symbol and c free of the batch; else None."""
        e = self.expr(size)
        if e not in self._factor:
            out = None
            for b in self.batch:
                if b in getattr(e, "free_symbols", ()):
                    q = sympy.cancel(e / b)
                    num, den = sympy.fraction(q)
                    if not ((num.free_symbols | den.free_symbols) & self.batch) and den == 1:
                        out = q
                    break
            self._factor[e] = out
        return self._factor[e]

    def eq(self, a: Any, b: Any) -> bool:
        a, b = self.expr(a), self.expr(b)
        return a == b or sympy.expand(a - b) == 0

    def assume_eq(self, a: Any, b: Any) -> bool:
        """Whether sizes `a` = b·c and `b` = b·d (one batch symbol) may be taken as equal
        on condition that c = d on every batch, which the runtime then checks before the
        step (`assumed`; batch_spec.py): both per-sample blocks are sizes of the batch's
        tensors the graph leaves unrelated (the choices of a multiple-choice model's ids
        and of its mask, each its own symbol). Only where `assume` was asked for."""
        if not self.assume:
            return False
        c, d = self.factor(a), self.factor(b)
        if c is None or d is None:
            return False
        if self.expr(a).free_symbols & self.batch != self.expr(b).free_symbols & self.batch:
            return False
        symbols = getattr(c, "free_symbols", set()) | getattr(d, "free_symbols", set())
        if not symbols or any(not str(x).startswith("s") for x in symbols):
            return False   # two different numbers, or a size the batch does not give
        if (c, d) not in self.assumed:
            self.assumed.append((c, d))
        return True

    def batch_dims(self, shape) -> list[int]:
        return [i for i, s in enumerate(shape) if self.has_batch(s)]

    def additive(self, size: Any) -> bool:
        """Whether the number `size` is proportional to the batch: scaling every batch
        symbol by t scales it by t (`2·b·T`; not `b·b`, `b + 1`), so the shards' values
        add up to the whole batch's."""
        e = self.expr(size)
        symbols = getattr(e, "free_symbols", set()) & self.batch
        if not symbols:
            return False
        # torch's int → float conversion (sym_float) keeps the value
        e = e.replace(lambda x: getattr(x.func, "__name__", "") == "ToFloat",
                      lambda x: x.args[0])
        t = sympy.Symbol("_scale", positive=True)
        return sympy.expand(e.xreplace({b: t * b for b in symbols}) - t * e) == 0

    def divisible(self, size: Any, k: int) -> bool:
        """Whether the per-sample block of `size` (b·c) is a multiple of k for any c."""
        c = self.factor(size)
        if c is None or k <= 0:
            return False
        q = sympy.expand(c / k)
        try:
            poly = sympy.Poly(q, *sorted(q.free_symbols, key=str)) if q.free_symbols else None
        except sympy.PolynomialError:
            return False
        coeffs = poly.coeffs() if poly is not None else [q]
        return all(getattr(x, "is_integer", False) for x in coeffs)


def _val(a: Any) -> Any:
    return a.meta.get(VAL) if isinstance(a, fx.Node) else a


def _shape(a: Any) -> tuple:
    v = _val(a)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else ()


def _rank(a: Any) -> int:
    return len(_shape(a))


def _flat(args: Any) -> Iterable[Any]:
    if isinstance(args, (list, tuple)):
        for a in args:
            yield from _flat(a)
    elif isinstance(args, dict):
        for a in args.values():
            yield from _flat(a)
    else:
        yield args


def _norm(dim: int, rank: int) -> int:
    return dim % rank if rank else 0


def _packet(name: str) -> str:
    return name.rsplit(".", 1)[0]


# ---------------------------------------------------------------------------- op tables
#: element-wise ops torch does not tag `pointwise`
_POINTWISE = {# aliases torch does not tag (torch.multiply in ConvBERT's attention)
              "aten.multiply", "aten.divide", "aten.subtract", "aten.negative",
              "aten.absolute", "aten.fix", "aten.greater", "aten.greater_equal",
              "aten.less", "aten.less_equal", "aten.not_equal", "aten.arccos",
              "aten.arcsin", "aten.arctan", "aten.arctan2", "aten.arccosh", "aten.arcsinh",
              "aten.arctanh", "aten.special_expit", "aten.special_erf", "aten.special_erfc",
              "aten.special_expm1", "aten.special_exp2", "aten.special_log1p",
              "aten.__and__", "aten.__or__", "aten.__xor__", "aten.__lshift__",
              "aten.__rshift__", "aten.bitwise_and", "aten.bitwise_or", "aten.bitwise_xor",
              "aten.bitwise_not", "aten.logical_and", "aten.logical_or", "aten.logical_not",
              "aten.logical_xor", "aten.floor_divide", "aten.remainder", "aten.fmod",
              "aten.to", "aten._to_copy", "aten.dropout", "aten.feature_dropout",
              "aten.alpha_dropout", "aten.native_dropout", "aten.bernoulli",
              "aten.masked_fill", "aten.masked_fill_", "aten.where", "aten.contiguous",
              "aten.alias", "aten.detach", "aten.clone", "aten.lift_fresh_copy",
              "aten.fill", "aten.clamp", "aten.clamp_min", "aten.clamp_max",
              "aten.nan_to_num", "aten.lerp", "aten.addcmul", "aten.addcdiv",
              "aten.threshold", "aten.hardtanh", "aten.softplus", "aten.gelu", "aten.silu",
              "aten.mish", "aten.elu", "aten.leaky_relu", "aten.relu6", "aten.hardswish",
              "aten.hardsigmoid", "aten.glu_jvp", "aten.isnan", "aten.isinf",
              "aten.isfinite", "aten.real", "aten.imag", "aten.conj", "aten.resolve_conj",
              "aten.resolve_neg", "aten.positive", "aten.square", "aten.xlogy",
              "aten.special_xlog1py", "aten.logit", "aten.prelu", "aten.rrelu",
              "aten.celu", "aten.selu", "aten.softshrink", "aten.hardshrink",
              "aten.tanhshrink", "aten.logsigmoid", "aten.log_sigmoid"}
#: element-wise ops that keep pointer values (they copy them)
_COPIES = {"aten.to", "aten._to_copy", "aten.contiguous", "aten.alias", "aten.detach",
           "aten.clone", "aten.lift_fresh_copy"}
#: ops that only read their inputs' metadata: the output is constant along any batch dim
_FACTORIES = {"aten.new_ones", "aten.new_zeros", "aten.new_empty", "aten.new_full",
              "aten.new_empty_strided", "aten.zeros", "aten.ones", "aten.empty",
              "aten.full", "aten.empty_strided", "aten.zeros_like", "aten.ones_like",
              "aten.empty_like", "aten.full_like", "aten.scalar_tensor",
              "aten.empty_permuted"}
#: random factories: fresh values per element (shape-only, but not constant)
_RANDOM = {"aten.rand", "aten.randn", "aten.rand_like", "aten.randn_like",
           "aten.randint", "aten.randint_like", "aten.normal", "aten.randperm"}
#: ops without a result that matters here (checks, shape queries)
_META = {"aten._assert_tensor_metadata", "aten._assert_scalar", "aten._assert_async",
         "aten.sym_constrain_range_for_size", "aten.sym_constrain_range",
         "aten._functional_sym_constrain_range_for_size"}
_SIZE_QUERIES = {"aten.sym_size", "aten.sym_numel", "aten.sym_stride",
                 "aten.sym_storage_offset"}
_VIEWS = {"aten.view", "aten.reshape", "aten._unsafe_view", "aten.flatten",
          "aten.unflatten", "aten.view_as", "aten.reshape_as", "aten._reshape_alias"}
#: reductions over `dim` (None / [] = all dims): name → (dim argument, keepdim argument)
_REDUCTIONS = {"aten.sum": ("dim", "keepdim"), "aten.mean": ("dim", "keepdim"),
               "aten.amax": ("dim", "keepdim"), "aten.amin": ("dim", "keepdim"),
               "aten.prod": ("dim", "keepdim"), "aten.var": ("dim", "keepdim"),
               "aten.std": ("dim", "keepdim"), "aten.var_mean": ("dim", "keepdim"),
               "aten.std_mean": ("dim", "keepdim"), "aten.logsumexp": ("dim", "keepdim"),
               "aten.any": ("dim", "keepdim"), "aten.all": ("dim", "keepdim"),
               "aten.norm": ("dim", "keepdim"), "aten.linalg_vector_norm": ("dim", "keepdim"),
               "aten.max": ("dim", "keepdim"), "aten.min": ("dim", "keepdim"),
               "aten.argmax": ("dim", "keepdim"), "aten.argmin": ("dim", "keepdim"),
               "aten.nansum": ("dim", "keepdim"), "aten.count_nonzero": ("dim", None),
               "aten.median": ("dim", "keepdim"), "aten.mode": ("dim", "keepdim"),
               "aten.kthvalue": ("dim", "keepdim"), "aten.aminmax": ("dim", "keepdim")}
#: ops along one dim that keep the shape (or change that dim only)
_ALONG = {"aten.softmax", "aten._softmax", "aten.log_softmax", "aten._log_softmax",
          "aten.cumsum", "aten.cumprod", "aten.logcumsumexp", "aten.cummax",
          "aten.cummin", "aten.topk", "aten.glu", "aten.diff", "aten.renorm",
          "aten._safe_softmax", "aten.special_softmax", "aten.special_log_softmax"}
_SORTS = {"aten.sort", "aten.argsort", "aten.msort"}
_MATMULS = {"aten.mm", "aten.bmm", "aten.matmul", "aten.addmm", "aten.baddbmm",
            "aten.addbmm", "aten.mv", "aten.addmv", "aten.dot", "aten.vdot", "aten.outer",
            "aten.ger", "aten.linear", "aten.einsum"}
_ATTENTION = {"aten.scaled_dot_product_attention",
              "aten._scaled_dot_product_flash_attention_for_cpu",
              "aten._scaled_dot_product_efficient_attention",
              "aten._scaled_dot_product_flash_attention",
              "aten._scaled_dot_product_cudnn_attention",
              "aten._scaled_dot_product_fused_attention_overrideable"}
#: per-sample over dim 0, parameters replicated
_LEADING = {"aten.conv1d", "aten.conv2d", "aten.conv3d", "aten.convolution",
            "aten._convolution", "aten.conv_transpose1d", "aten.conv_transpose2d",
            "aten.conv_transpose3d", "aten.group_norm", "aten.native_group_norm",
            "aten.instance_norm", "aten.max_pool1d", "aten.max_pool2d", "aten.max_pool3d",
            "aten.max_pool2d_with_indices", "aten.max_pool3d_with_indices",
            "aten.avg_pool1d", "aten.avg_pool2d", "aten.avg_pool3d",
            "aten.adaptive_avg_pool1d", "aten.adaptive_avg_pool2d",
            "aten.adaptive_avg_pool3d", "aten._adaptive_avg_pool2d",
            "aten.adaptive_max_pool1d", "aten.adaptive_max_pool2d",
            "aten.upsample_nearest2d", "aten.upsample_bilinear2d", "aten.pixel_shuffle",
            "aten.pixel_unshuffle", "aten.im2col", "aten.col2im"}
_LAYER_NORMS = {"aten.layer_norm", "aten.native_layer_norm", "aten.rms_norm",
                "aten._fused_rms_norm"}
_BATCH_NORMS = {"aten.batch_norm", "aten.native_batch_norm",
                "aten._native_batch_norm_legit_functional", "aten._native_batch_norm_legit",
                "aten._native_batch_norm_legit_no_training", "aten.cudnn_batch_norm",
                "aten._batch_norm_impl_index"}
_RNNS = {"aten.lstm", "aten.gru", "aten.rnn_tanh", "aten.rnn_relu"}
_CLASS_LOSSES = {"aten.cross_entropy_loss", "aten.nll_loss", "aten.nll_loss_nd",
                 "aten.nll_loss2d"}
_ELEMENTWISE_LOSSES = {"aten.mse_loss", "aten.l1_loss", "aten.smooth_l1_loss",
                       "aten.huber_loss", "aten.binary_cross_entropy",
                       "aten.binary_cross_entropy_with_logits", "aten.soft_margin_loss",
                       "aten.kl_div"}
_GROUPED_MM = {"aten._grouped_mm.default", "transformers.grouped_mm_fallback.default"}
#: ops whose output size depends on values: per-sample only when everything is rep
_DATA_SHAPED = {"aten.nonzero", "aten.masked_select", "aten.unique", "aten._unique",
                "aten._unique2", "aten.unique_consecutive", "aten.unique_dim",
                "aten.argwhere", "aten.nonzero_static"}


# ---------------------------------------------------------------------------- analysis
class BatchFlow:
    """The flows of every node of `gm` (`flows[node]`; a tuple for multi-output ops)."""

    def __init__(self, gm: fx.GraphModule, batch: set, per_sample: Iterable[fx.Node] = (),
                 inputs: list[Flow] | None = None, sizes: _Sizes | None = None,
                 assume: bool = False):
        """`assume`: a proof may rest on per-sample sizes of the batch being equal
        (`_Sizes.assume_eq`; `sizes.assumed` lists them for the runtime to check);
        `sizes`: a region's analysis, with its graph's assumptions."""
        self.gm = gm
        self.sizes = sizes if sizes is not None else _Sizes(batch, assume)
        self._inputs = list(inputs) if inputs is not None else None
        self.per_sample = set(per_sample)
        self.flows: dict[fx.Node, Any] = {}
        self.sorts: dict[fx.Node, tuple[fx.Node, bool]] = {}  # π → (keys, ascending)
        self.mutations: list[tuple[fx.Node, fx.Node, Any]] = []  # (op, placeholder, flow)
        self._alias = _Aliases()
        self.input_symbols: set = set()
        for node in gm.graph.nodes:
            val = node.meta.get(VAL)
            if node.op == "placeholder" and isinstance(val, torch.Tensor):
                for size in val.shape:
                    self.input_symbols |= getattr(self.sizes.expr(size), "free_symbols", set())
        for node in gm.graph.nodes:
            self._visit(node)

    # ------------------------------------------------------------------ helpers
    def flow(self, a: Any) -> Flow:
        """The flow of an argument (constants are rep; a tuple node is not a value)."""
        if isinstance(a, fx.Node):
            f = self.flows.get(a)
            if f is None:
                return unknown(a, "not analysed")
            return f if isinstance(f, Flow) else unknown(a, "a tuple used as a value")
        if isinstance(a, (list, tuple)):
            fs = [self.flow(x) for x in a]
            bad = [f for f in fs if f.kind != REP]
            return bad[0] if bad else _REP
        return _REP

    def _visit(self, node: fx.Node) -> None:
        if node.op == "placeholder":
            self.flows[node] = self._placeholder(node)
            return
        if node.op == "get_attr":
            self.flows[node] = _REP
            return
        if node.op == "output":
            return
        if node.op != "call_function":
            ins = [self.flow(a) for a in node.all_input_nodes]
            self.flows[node] = _REP if all(f.kind == REP for f in ins) else unknown(
                node, f"{node.op} {node.target} is not analysed")
            return
        try:
            self._partial_only_summed(node)
            result = self._rule(node)
        except _Fail as exc:
            result = unknown(node, str(exc))
        result = self._check_shapes(node, result)
        self.flows[node] = result
        self._alias.add(node)
        written = _written_arg(node)
        if written is not None:
            self._mutate(node, written, result)

    def _partial_only_summed(self, node: fx.Node) -> None:
        """A partial sum goes into `autohybrid::batch_sum` and nowhere else (the shards'
        values of anything else computed from it need not add up to the batch's)."""
        if op_name(node) == "autohybrid.batch_sum.default":
            return
        for a in node.all_input_nodes:
            f = self.flows.get(a)
            if isinstance(f, Flow) and f.kind == PARTIAL:
                raise _Fail(f"it computes with {a.name!r}, which is {_describe(f)}")

    def _placeholder(self, node: fx.Node) -> Flow:
        if self._inputs is not None:  # a subgraph: its arguments' flows, in order
            return self._inputs.pop(0) if self._inputs else unknown(node, "no argument")
        val = node.meta.get(VAL)
        if node.meta.get(AH_ROLE) in ("input", "target") and isinstance(val, torch.Tensor) \
                and val.dim() > 0:
            if self.sizes.factor(val.shape[0]) is not None and \
                    self.sizes.batch_dims(val.shape) == [0]:
                return Flow(SPLIT, 0)
            return unknown(node, "its batch dim 0 is not symbolic")
        return _REP

    def _check_shapes(self, node: fx.Node, result: Any) -> Any:
        """A value's flow must agree with where its shape has batch-sized dims."""
        val = node.meta.get(VAL)
        if isinstance(result, tuple):
            vals = val if isinstance(val, (list, tuple)) else [None] * len(result)
            return tuple(self._check_one(node, f, v) for f, v in zip(result, vals))
        return self._check_one(node, result, val)

    def _check_one(self, node: fx.Node, f: Flow, val: Any) -> Flow:
        if f.kind == UNKNOWN:
            return f
        if not isinstance(val, torch.Tensor):
            if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)) and \
                    f.kind == REP and self.sizes.has_batch(val):
                return _BSIZE
            return f
        dims = self.sizes.batch_dims(val.shape)
        if f.kind in (REP, COUNTS, OFFSETS, BSIZE, PARTIAL):
            if dims:
                return unknown(node, "its shape depends on the batch size in a way not "
                                     "analysed")
            return f
        if dims != [f.dim] or self.sizes.factor(val.shape[f.dim]) is None:
            return unknown(node, f"its batch-sized dims {dims} are not its batch dim "
                                 f"{f.dim} alone")
        return f

    def _mutate(self, node: fx.Node, written: fx.Node, new: Any) -> None:
        """`node` wrote `new` into `written` in place: update it and its aliases."""
        if not isinstance(new, Flow):
            return
        old = self.flows.get(written, _REP)
        same = isinstance(old, Flow) and old.layout() == new.layout() and old.ptr == new.ptr
        for alias in self._alias.members(written):
            if alias is node or alias not in self.flows:
                continue
            if alias is written or new.kind == UNKNOWN:
                self.flows[alias] = new
            elif isinstance(self.flows[alias], Flow):
                prev = self.flows[alias]
                self.flows[alias] = (dataclasses.replace(prev, const=False, bound=None,
                                                         iota=False)
                                     if same else unknown(node, f"it writes in place into "
                                                        f"{written.name!r}, changing how "
                                                        f"its alias {alias.name!r} depends "
                                                        "on the batch"))
            if alias.op == "placeholder":
                self.mutations.append((node, alias, new))

    # ------------------------------------------------------------------ dispatch
    def _rule(self, node: fx.Node) -> Any:
        target = node.target
        name = op_name(node)
        packet = _packet(name)
        if target is operator.getitem:
            src = self.flows.get(node.args[0])
            if isinstance(src, tuple):
                return src[node.args[1]]
            return self.flow(node.args[0])
        if isinstance(target, torch._ops.HigherOrderOperator):
            return self._higher_order(node)
        if target in SYM_SIZE_OPS or packet in _SIZE_QUERIES:
            return self._scalar(node)
        if packet in _META:
            return _REP
        if packet in ("aten._local_scalar_dense", "aten.item"):
            return self._all_rep(node)
        if name in _GROUPED_MM:
            return self._grouped_mm(node)
        if not isinstance(target, torch._ops.OpOverload):
            return self._all_rep(node)
        rule = _RULES.get(packet)
        if rule is not None:
            return rule(self, node)
        if name == "aten.where.default":   # torch.where(cond): nonzero, not element-wise
            return _selection(self, node)
        if torch.Tag.pointwise in target.tags or packet in _POINTWISE:
            return self._pointwise(node)
        return self._all_rep(node)

    def _higher_order(self, node: fx.Node) -> Any:
        """Regions torch.export keeps as submodules (`torch.no_grad()`, autocast): the
        submodule's graph analysed with the flows of its arguments."""
        if node.target.name() not in ("wrap_with_set_grad_enabled", "wrap_with_autocast"):
            return self._all_rep(node)
        index, sub = next(((i, a) for i, a in enumerate(node.args)
                           if isinstance(a, fx.Node) and a.op == "get_attr"), (None, None))
        if sub is None:
            return self._all_rep(node)
        module = self.gm.get_submodule(sub.target)
        sizes = _Sizes(self.sizes.batch, self.sizes.assume)
        sizes.assumed = self.sizes.assumed   # (what the region assumes, its graph does)
        inner = BatchFlow(module, self.sizes.batch, self.per_sample,
                          inputs=[self.flow(a) for a in node.args[index + 1:]], sizes=sizes)
        if inner.mutations:
            raise _Fail("a region that writes its inputs in place")
        outs = next(n for n in module.graph.nodes if n.op == "output").args[0]
        outs = outs if isinstance(outs, (list, tuple)) else (outs,)
        return tuple(inner.flow(o) for o in outs)

    def _scalar(self, node: fx.Node) -> Flow:
        """A Python number: rep, batch-size dependent, or unknown (computed from values of
        the batch, e.g. the size of a value whose size depends on data)."""
        val = node.meta.get(VAL)
        batchy = isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)) and \
            self.sizes.has_batch(val)
        if _is_size_query(node):
            f = self.flow(node.args[0])
            expr = self.sizes.expr(val)
            if not getattr(expr, "free_symbols", set()) <= self.input_symbols \
                    and f.kind != REP:
                return f if f.kind == UNKNOWN else unknown(
                    node, "the size of a value that depends on the data of the batch")
            return _BSIZE if batchy else _REP
        for a in node.all_input_nodes:
            f = self.flow(a)
            if f.kind == UNKNOWN:
                return f
            if f.kind not in (REP, BSIZE):
                raise _Fail(f"it computes a number from {a.name!r}, which is "
                            f"{_describe(f)}")
        return _BSIZE if batchy else _REP

    def _all_rep(self, node: fx.Node) -> Any:
        """An op without a rule: rep when every input is; else not proven."""
        for a in node.all_input_nodes:
            f = self.flows.get(a) or unknown(a, "not analysed")
            for g in (f if isinstance(f, tuple) else (f,)):
                if g.kind == UNKNOWN:
                    return g
                if g.kind != REP:
                    raise _Fail(f"{op_name(node)} has no rule keeping samples apart and reads "
                                f"{a.name!r}, which depends on the batch ({g.kind})")
        val = node.meta.get(VAL)
        if isinstance(val, (list, tuple)):
            return tuple(_REP for _ in val)
        return _REP

    def _scalars_rep(self, node: fx.Node, allowed: Iterable[str] = ()) -> None:
        """Refuse a batch-size-dependent Python number used as a value."""
        allowed = set(allowed)
        for key, a in schema_args(node).items():
            if key in allowed:
                continue
            for x in _flat(a):
                if isinstance(x, fx.Node) and not isinstance(x.meta.get(VAL), torch.Tensor):
                    f = self.flow(x)
                    if f.kind == UNKNOWN:
                        raise _Fail(f"it reads {x.name!r}, a number computed from the batch")
                    if f.kind == BSIZE:
                        raise _Fail(f"it computes with {x.name!r}, a number that depends on "
                                    "the batch size")

    def _first_unknown(self, flows: Iterable[Flow]) -> Flow | None:
        return next((f for f in flows if f.kind == UNKNOWN), None)

    # ------------------------------------------------------------------ layouts
    def _combine(self, items: list[tuple[Any, Flow]], out_shape: tuple,
                 copies: bool = False) -> Flow:
        """The flow of an element-wise combination (right-aligned broadcasting) of `items`
        (argument, flow) into `out_shape`."""
        n = len(out_shape)
        layout: Flow | None = None
        consts = []
        values = []
        for arg, f in items:
            if f.kind == UNKNOWN:
                return f
            if f.kind in (COUNTS, OFFSETS, BSIZE, PARTIAL):
                raise _Fail(f"it computes with {getattr(arg, 'name', arg)!r}, which is "
                            f"{_describe(f)}")
            if f.kind == REP:
                continue
            shape = _shape(arg)
            e = f.dim + n - len(shape)
            if e < 0 or not self.sizes.eq(shape[f.dim], out_shape[e]):
                raise _Fail("its operands' batch dims do not line up")
            g = dataclasses.replace(f, dim=e)
            (consts if f.kind == SPLIT and f.const else values).append(g)
        for g in values:
            if layout is None:
                layout = g
            elif layout.layout() != g.layout():
                raise _Fail("it combines values whose batch dims do not line up"
                            + (" (rows in another order)" if PERM in (g.kind, layout.kind)
                               else ""))
        if layout is None and consts:
            layout = consts[0]
            for g in consts[1:]:
                if g.layout() != layout.layout():
                    raise _Fail("its operands' batch dims do not line up")
            return Flow(SPLIT, layout.dim, const=True)
        if layout is None:
            return _REP
        for g in consts:
            if g.dim != layout.dim:
                raise _Fail("its operands' batch dims do not line up")
        pointers = [g for g in values if g.ptr is not None]
        if pointers:
            if not copies or len(values) != 1:
                raise _Fail("it computes with sample indices (values that differ between a "
                            "shard and the whole batch)")
            return dataclasses.replace(layout, const=False)
        if copies and len(values) == 1:
            return dataclasses.replace(layout, const=False)
        return layout.moved(layout.dim)

    def _pointwise(self, node: fx.Node) -> Any:
        packet = _packet(op_name(node))
        self._scalars_rep(node)
        out = node.meta.get(VAL)
        kw = schema_args(node)
        if packet == "aten.floor_divide" or (packet == "aten.div" and
                                             kw.get("rounding_mode") == "floor"):
            f = self.flow(kw.get("self"))
            if f.ptr is not None:
                return self._ptr_divide(f, kw.get("other"))
        args = _tensor_args(node)
        if op_name(node) == "aten.to.other":  # the other tensor gives the dtype only
            args = args[:1]
        tensors = [(a, self.flow(a)) for a in args]
        copies = packet in _COPIES
        if isinstance(out, (list, tuple)):  # native_dropout: (output, mask)
            f = self._combine(tensors, tuple(out[0].shape), copies)
            return tuple(f for _ in out)
        f = self._combine(tensors, tuple(out.shape), copies)
        if copies and len(tensors) == 1:
            src = tensors[0][1]
            if src.bound is not None and out.dtype.is_floating_point and \
                    src.bound > _exact_ints(out.dtype):
                f = dataclasses.replace(f, bound=None)
        return f

    def _ptr_divide(self, f: Flow, k: Any) -> Flow:
        if not isinstance(k, int) or f.ptr[0] != "split" or not self.sizes.divisible(f.ptr[1], k):
            raise _Fail("it computes with sample indices (values that differ between a "
                        "shard and the whole batch)")
        return dataclasses.replace(f, ptr=("split", sympy.expand(f.ptr[1] / k)),
                                   iota=False, bijective=False)

    def _from_shape(self, node: fx.Node, shape: tuple, const: bool = True) -> Flow:
        """A value whose content does not depend on the batch but whose shape may."""
        dims = self.sizes.batch_dims(shape)
        if not dims:
            return _REP
        if len(dims) == 1 and self.sizes.factor(shape[dims[0]]) is not None:
            return Flow(SPLIT, dims[0], const=const)
        raise _Fail("its shape has several batch-sized dims")


# ---------------------------------------------------------------------------- rules
_RULES: dict[str, Callable[[BatchFlow, fx.Node], Any]] = {}


def _rule(*names: str):
    def register(fn):
        for name in names:
            _RULES[name] = fn
        return fn
    return register


def _names(*groups: Iterable[str]) -> list[str]:
    return [n for g in groups for n in g]


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    return [a for a in _flat((node.args, node.kwargs))
            if isinstance(a, fx.Node) and isinstance(a.meta.get(VAL), torch.Tensor)]


def _is_size_query(node: fx.Node) -> bool:
    return _packet(op_name(node)) in _SIZE_QUERIES


def _describe(f: Flow) -> str:
    if f.kind == COUNTS:
        return "a count over the whole batch (e.g. tokens per expert)"
    if f.kind == OFFSETS:
        return "a running count over the whole batch"
    if f.kind == BSIZE:
        return "a number that depends on the batch size"
    if f.kind == PARTIAL:
        return "a sum over this shard's samples only (a statistic of the whole batch)"
    return f.kind


def _exact_ints(dtype: torch.dtype) -> int:
    """The integers a float dtype holds exactly (from 0)."""
    return {torch.float16: 2**11, torch.bfloat16: 2**8, torch.float32: 2**24,
            torch.float64: 2**53}.get(dtype, 2**31)


@_rule(*_names(_FACTORIES, _RANDOM))
def _factory(self: BatchFlow, node: fx.Node) -> Flow:
    packet = _packet(op_name(node))
    if packet == "aten.scalar_tensor":
        value = schema_args(node).get("s")
        if isinstance(value, fx.Node) and self.flow(value).kind == BSIZE:
            if not self.sizes.additive(value.meta.get(VAL)):
                raise _Fail(f"it computes with {value.name!r}, a number that depends on the "
                            "batch size other than in proportion to it")
            return Flow(PARTIAL)
    self._scalars_rep(node, ("size", "stride", "self", "n"))  # fill values, bounds: rep
    if packet == "aten.randperm" and self.sizes.has_batch(node.meta[VAL].shape[0]):
        raise _Fail("a random permutation of the batch")
    return self._from_shape(node, tuple(node.meta[VAL].shape), const=packet in _FACTORIES)


@_rule("aten.uniform", "aten.uniform_", "aten.normal_", "aten.bernoulli_",
       "aten.exponential", "aten.exponential_", "aten.geometric_", "aten.log_normal_",
       "aten.cauchy_", "aten.random_", "aten.random")
def _random_fill(self: BatchFlow, node: fx.Node) -> Flow:
    """Fresh random values in the shape of `self` (probabilities from tensors: element-wise)."""
    self._scalars_rep(node)
    others = [a for a in _tensor_args(node) if a is not node.args[0]]
    if others:
        return self._combine([(a, self.flow(a)) for a in others],
                             tuple(node.meta[VAL].shape))
    return self._from_shape(node, tuple(node.meta[VAL].shape), const=False)


@_rule("aten.arange")
def _arange(self: BatchFlow, node: fx.Node) -> Flow:
    kw = schema_args(node)
    start, end, step = kw.get("start", 0), kw.get("end"), kw.get("step", 1)
    for a in (start, step):
        if self.flow(a).kind != REP:
            raise _Fail("arange with a start or step that depends on the batch")
    f = self.flow(end)
    if f.kind == UNKNOWN:
        return f
    if f.kind == REP:
        return _REP
    size = node.meta[VAL].shape[0]
    if start == 0 and step == 1 and self.sizes.factor(size) is not None:
        return Flow(SPLIT, 0, ptr=("split", self.sizes.expr(size)), iota=True)
    raise _Fail("arange over a length that depends on the batch size")


@_rule(*_VIEWS)
def _view(self: BatchFlow, node: fx.Node) -> Flow:
    """In row-major order a split value is [outer elements] × [b·c batch rows] × [inner];
    a view keeps it split where some output dim e holds the batch block: prod(out[:e]) ×
    (the outer part of out[e]) = the outer elements. A dim the batch shares with the dims
    before it (nn.MultiheadAttention's [seq·batch, features]) is split with `outer`:
    rows interleaved, each still one sample's; views back separate it again."""
    x = node.args[0]
    f = self.flow(x)
    if not f.batched:
        return f
    expr = self.sizes.expr
    ins, outs = _shape(x), tuple(node.meta[VAL].shape)
    before = math.prod([expr(s) for s in ins[:f.dim]], start=sympy.Integer(1)) * f.outer
    acc = sympy.Integer(1)
    for e, size in enumerate(outs):
        if self.sizes.has_batch(size):
            outer = _polynomial(sympy.cancel(before / acc), self.sizes.batch)
            c = self.sizes.factor(size)
            inner = _polynomial(sympy.cancel(c / outer), self.sizes.batch) \
                if outer is not None and c is not None else None
            if inner is None:
                break
            keep = self.sizes.eq(size, ins[f.dim]) and self.sizes.eq(outer, f.outer)
            if f.kind == PERM and not (keep and outer == 1):
                raise _Fail("it regroups rows sorted across the batch")
            return dataclasses.replace(f, dim=e, outer=outer, iota=f.iota and keep,
                                       const=f.const and keep)
        acc = acc * expr(size)
    raise _Fail("it reshapes the batch dim so that samples interleave with the dims after "
                "it")


def _polynomial(q: Any, batch: frozenset) -> Any:
    """q when it is a polynomial free of the batch symbols (an integer size), else None."""
    num, den = sympy.fraction(sympy.together(q))
    if den != 1 or (num.free_symbols & batch):
        return None
    if not num.free_symbols:
        return num if num.is_integer and num > 0 else None
    return num


@_rule("aten.transpose", "aten.swapaxes", "aten.swapdims", "aten.t", "aten.permute",
       "aten.movedim", "aten.numpy_T", "aten.adjoint", "aten.mT", "aten.mH")
def _permute_dims(self: BatchFlow, node: fx.Node) -> Flow:
    x = node.args[0]
    f = self.flow(x)
    if not f.batched:
        return f
    rank = _rank(x)
    packet = _packet(op_name(node))
    kw = schema_args(node)
    order = list(range(rank))
    if packet in ("aten.transpose", "aten.swapaxes", "aten.swapdims"):
        a = _norm(kw.get("dim0", kw.get("axis0", 0)), rank)
        b = _norm(kw.get("dim1", kw.get("axis1", 1)), rank)
        order[a], order[b] = order[b], order[a]
    elif packet == "aten.numpy_T":
        order = order[::-1]
    elif packet in ("aten.t", "aten.adjoint", "aten.mT", "aten.mH"):
        if rank >= 2:
            order[-1], order[-2] = order[-2], order[-1]
    elif packet == "aten.permute":
        order = [_norm(d, rank) for d in kw["dims"]]
    else:  # movedim
        src = kw["source"] if isinstance(kw["source"], (list, tuple)) else [kw["source"]]
        dst = kw["destination"] if isinstance(kw["destination"], (list, tuple)) \
            else [kw["destination"]]
        src, dst = [_norm(s, rank) for s in src], [_norm(d, rank) for d in dst]
        rest = [d for d in range(rank) if d not in src]
        order = [None] * rank
        for s, d in zip(src, dst):
            order[d] = s
        it = iter(rest)
        order = [o if o is not None else next(it) for o in order]
    return dataclasses.replace(f, dim=order.index(f.dim))


@_rule("aten.unsqueeze")
def _unsqueeze(self: BatchFlow, node: fx.Node) -> Flow:
    x, dim = node.args[0], node.args[1]
    f = self.flow(x)
    if not f.batched:
        return f
    d = _norm(dim, _rank(x) + 1)
    return dataclasses.replace(f, dim=f.dim + (1 if d <= f.dim else 0))


@_rule("aten.squeeze")
def _squeeze(self: BatchFlow, node: fx.Node) -> Flow:
    x = node.args[0]
    f = self.flow(x)
    if not f.batched:
        return f
    ins = _shape(x)
    kw = schema_args(node)
    dims = kw.get("dim", None)
    if dims is None:
        gone = [i for i, s in enumerate(ins) if isinstance(s, int) and s == 1]
    else:
        dims = dims if isinstance(dims, (list, tuple)) else [dims]
        gone = [_norm(d, len(ins)) for d in dims
                if isinstance(ins[_norm(d, len(ins))], int) and ins[_norm(d, len(ins))] == 1]
    if f.dim in gone:
        raise _Fail("it squeezes the batch dim")
    return dataclasses.replace(f, dim=f.dim - sum(1 for g in gone if g < f.dim))


@_rule("aten.expand", "aten.expand_as", "aten.broadcast_to", "aten.expand_copy")
def _expand(self: BatchFlow, node: fx.Node) -> Flow:
    x = node.args[0]
    f = self.flow(x)
    outs = tuple(node.meta[VAL].shape)
    if f.kind == UNKNOWN:
        return f
    if f.kind == REP:
        return self._from_shape(node, outs)
    if not f.batched:
        raise _Fail(f"it expands {x.name!r}, which is {_describe(f)}")
    e = f.dim + len(outs) - _rank(x)
    if not self.sizes.eq(outs[e], _shape(x)[f.dim]):
        raise _Fail("its batch dim does not line up")
    return dataclasses.replace(f, dim=e)


@_rule("aten.broadcast_tensors")
def _broadcast_tensors(self: BatchFlow, node: fx.Node) -> tuple:
    """Each input expanded to the common shape."""
    outs = node.meta[VAL]
    res = []
    for x, out in zip(node.args[0], outs):
        f = self.flow(x)
        shape = tuple(out.shape)
        if f.kind == REP:
            res.append(self._from_shape(node, shape))
        elif f.batched:
            e = f.dim + len(shape) - _rank(x)
            if not self.sizes.eq(shape[e], _shape(x)[f.dim]):
                raise _Fail("its batch dims do not line up")
            res.append(dataclasses.replace(f, dim=e))
        elif f.kind == UNKNOWN:
            res.append(f)
        else:
            raise _Fail(f"it broadcasts {x.name!r}, which is {_describe(f)}")
    return tuple(res)


@_rule("aten.slice", "aten.narrow", "aten.slice_copy")
def _slice(self: BatchFlow, node: fx.Node) -> Flow:
    x = node.args[0]
    f = self.flow(x)
    kw = schema_args(node)
    dim = _norm(kw.get("dim", 0), _rank(x))
    if not f.batched or dim != f.dim:
        self._scalars_rep(node)
        return f if f.kind != REP else self._all_rep(node)
    if self.sizes.eq(node.meta[VAL].shape[dim], _shape(x)[dim]) and kw.get("step", 1) == 1:
        return f
    raise _Fail("it takes a part of the batch dim (some samples, not each sample)")


@_rule("aten.select")
def _select(self: BatchFlow, node: fx.Node) -> Flow:
    x, dim = node.args[0], node.args[1]
    f = self.flow(x)
    self._scalars_rep(node)
    if not f.batched:
        return f if f.kind != REP else self._all_rep(node)
    d = _norm(dim, _rank(x))
    if d == f.dim:
        raise _Fail("it picks one sample of the batch dim")
    return dataclasses.replace(f, dim=f.dim - (1 if d < f.dim else 0), iota=False)


@_rule("aten.split", "aten.split_with_sizes", "aten.chunk", "aten.unbind",
       "aten.tensor_split", "aten.unsafe_split", "aten.unsafe_chunk",
       "aten.unsafe_split_with_sizes", "aten.hsplit", "aten.vsplit")
def _split(self: BatchFlow, node: fx.Node) -> Any:
    x = node.args[0]
    f = self.flow(x)
    outs = node.meta[VAL]
    kw = schema_args(node)
    rank = _rank(x)
    dim = _norm(kw.get("dim", 0), rank)
    if not f.batched:
        if f.kind == REP:
            self._scalars_rep(node)
        return tuple(f for _ in outs)
    if dim == f.dim:
        raise _Fail("it splits the batch dim")
    self._scalars_rep(node)
    g = dataclasses.replace(f, dim=f.dim - (1 if _packet(op_name(node)) == "aten.unbind"
                                            and dim < f.dim else 0), iota=False)
    return tuple(g for _ in outs)


@_rule("aten.cat", "aten.concat", "aten.concatenate", "aten.stack")
def _cat(self: BatchFlow, node: fx.Node) -> Flow:
    tensors = list(node.args[0])
    stack = _packet(op_name(node)) == "aten.stack"
    outs = tuple(node.meta[VAL].shape)
    dim = _norm(schema_args(node).get("dim", 0), len(outs))
    if not stack:   # empty operands add nothing (a key/value cache's first update)
        tensors = [t for t in tensors if not _empty_operand(t, dim)] or tensors[:1]
    flows = [self.flow(t) for t in tensors]
    bad = self._first_unknown(flows)
    if bad is not None:
        return bad
    if all(f.kind == REP for f in flows):
        return _REP
    layouts = []
    for t, f in zip(tensors, flows):
        if not f.batched:  # a replicated operand cannot have the batch-sized dim
            raise _Fail(f"it concatenates {t.name!r}, which is {_describe(f)}, with "
                        "batched values")
        if f.ptr is not None:
            raise _Fail("it concatenates sample indices")
        e = f.dim + (1 if stack and dim <= f.dim else 0)
        layouts.append(f.moved(e, const=f.const))
    ref = next((g for g in layouts if not g.const), layouts[0])
    for g in layouts:
        if g.dim != ref.dim or (not g.const and g.layout() != ref.layout()):
            raise _Fail("its operands' batch dims do not line up")
    if not stack and ref.dim == dim:
        raise _Fail("it concatenates along the batch dim (samples would reorder)")
    return ref.moved(ref.dim, const=all(g.const for g in layouts))


def _empty_operand(t: Any, dim: int) -> bool:
    """Whether `t` adds nothing to a `cat` along `dim`: a 1-D tensor of no elements (cat
    skips it whatever the dim, as Hugging Face's cache layers start from
    `torch.tensor([])`) or one statically 0 long along `dim`."""
    val = t.meta.get(VAL) if isinstance(t, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return False
    shape = tuple(val.shape)
    if shape == (0,):
        return True
    return len(shape) > dim and isinstance(shape[dim], int) and shape[dim] == 0


@_rule("aten.repeat")
def _repeat(self: BatchFlow, node: fx.Node) -> Flow:
    x, repeats = node.args[0], list(node.args[1])
    f = self.flow(x)
    outs = tuple(node.meta[VAL].shape)
    if f.kind == REP:
        return self._from_shape(node, outs)
    if not f.batched:
        return f if f.kind == UNKNOWN else self._all_rep(node)
    e = f.dim + len(outs) - _rank(x)
    if repeats[e] != 1:
        raise _Fail("it repeats the batch dim")
    return dataclasses.replace(f, dim=e, iota=False)


@_rule("aten.repeat_interleave")
def _repeat_interleave(self: BatchFlow, node: fx.Node) -> Flow:
    kw = schema_args(node)
    x = kw.get("self", kw.get("repeats"))
    f = self.flow(x)
    if op_name(node) != "aten.repeat_interleave.self_int" or not isinstance(kw["repeats"], int):
        return self._all_rep(node)
    if not f.batched:
        return f if f.kind != REP else self._all_rep(node)
    dim = kw.get("dim")
    if dim is None and _rank(x) != 1:
        raise _Fail("it flattens the batch")
    dim = 0 if dim is None else _norm(dim, _rank(x))
    if f.kind == PERM and dim == f.dim:
        raise _Fail("it repeats rows sorted across the batch")
    # each row is repeated in place: a sample's block stays contiguous
    return dataclasses.replace(f, iota=False)


@_rule("aten.flip", "aten.roll", "aten.triu", "aten.tril", "aten.rot90", "aten.diagonal",
       "aten.diag_embed", "aten.fliplr", "aten.flipud")
def _local_dims(self: BatchFlow, node: fx.Node) -> Flow:
    """Ops that move elements within some dims: the batch dim must be none of them."""
    x = node.args[0]
    f = self.flow(x)
    if not f.batched:
        return f if f.kind != REP else self._all_rep(node)
    rank = _rank(x)
    packet = _packet(op_name(node))
    kw = schema_args(node)
    if packet in ("aten.triu", "aten.tril"):
        touched = [rank - 2, rank - 1]
    elif packet in ("aten.flip", "aten.roll", "aten.rot90"):
        dims = kw.get("dims", [])
        touched = [_norm(d, rank) for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
        if packet == "aten.roll" and not touched:
            touched = list(range(rank))
    elif packet == "aten.fliplr":
        touched = [1]
    elif packet == "aten.flipud":
        touched = [0]
    else:
        raise _Fail(f"{packet} of a batched value is not analysed")
    if f.dim in touched:
        raise _Fail("it moves elements along the batch dim")
    return dataclasses.replace(f, iota=False)


@_rule("aten.pad", "aten.constant_pad_nd", "aten.reflection_pad1d", "aten.reflection_pad2d",
       "aten.replication_pad1d", "aten.replication_pad2d", "aten.reflection_pad3d",
       "aten.replication_pad3d")
def _pad(self: BatchFlow, node: fx.Node) -> Flow:
    x = node.args[0]
    f = self.flow(x)
    kw = schema_args(node)
    if "value" in kw and self.flow(kw["value"]).kind != REP:
        raise _Fail("it pads with a value that depends on the batch")
    if not f.batched:
        return f if f.kind != REP else self._all_rep(node)
    pad = list(kw.get("pad", kw.get("padding", [])))
    rank = _rank(x)
    k = rank - 1 - f.dim  # pad pairs start at the last dim
    if 2 * k + 1 < len(pad) and (pad[2 * k] != 0 or pad[2 * k + 1] != 0):
        raise _Fail("it pads the batch dim")
    return dataclasses.replace(f, iota=False, const=False)


def _reduced(self: BatchFlow, node: fx.Node, x: Any, dims: Any, keepdim: bool,
             what: str = "reduces", additive: bool = False) -> Flow:
    f = self.flow(x)
    rank = _rank(x)
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        dims = list(range(rank))
    dims = dims if isinstance(dims, (list, tuple)) else [dims]
    dims = [_norm(d, rank) for d in dims]
    if f.kind == UNKNOWN:
        return f
    if f.kind == REP:
        return _REP
    if not f.batched:
        raise _Fail(f"it {what} {x.name!r}, which is {_describe(f)}")
    if f.ptr is not None:
        raise _Fail("it reduces sample indices")
    if f.dim in dims:
        if additive:   # a sum: the shards' sums add up to the whole batch's
            return Flow(PARTIAL)
        raise _Fail(f"it {what} over the batch dim (a statistic of the whole batch)")
    return f.moved(f.dim if keepdim else f.dim - sum(1 for d in dims if d < f.dim))


@_rule(*_REDUCTIONS)
def _reduction(self: BatchFlow, node: fx.Node) -> Any:
    packet = _packet(op_name(node))
    kw = schema_args(node)
    self._scalars_rep(node)
    x = kw.get("self", kw.get("input"))
    dim_key, keep_key = _REDUCTIONS[packet]
    dims = kw.get(dim_key)
    keepdim = bool(kw.get(keep_key, False)) if keep_key else False
    if packet in ("aten.max", "aten.min") and "other" in kw:  # element-wise max/min
        return self._pointwise(node)
    f = _reduced(self, node, x, dims, keepdim,
                 additive=packet in ("aten.sum", "aten.nansum")
                 and not isinstance(node.meta[VAL], (list, tuple)))
    out = node.meta[VAL]
    indices = packet in ("aten.max", "aten.min", "aten.kthvalue", "aten.median", "aten.mode",
                         "aten.argmax", "aten.argmin")
    bound = None
    if indices and isinstance(dims, int):
        size = _shape(x)[_norm(dims, _rank(x))]
        bound = size if isinstance(size, int) else None
    g = dataclasses.replace(f, bound=bound) if f.kind != UNKNOWN else f
    if isinstance(out, (list, tuple)):  # (values, indices) or (a, b)
        return (f,) + tuple(g if indices else f for _ in out[1:])
    return g if indices else f


@_rule(*_ALONG)
def _along(self: BatchFlow, node: fx.Node) -> Any:
    packet = _packet(op_name(node))
    kw = schema_args(node)
    x = kw.get("self", kw.get("input"))
    f = self.flow(x)
    rank = _rank(x)
    dim = _norm(kw.get("dim", -1), rank)
    out = node.meta[VAL]
    many = isinstance(out, (list, tuple))
    if f.kind == COUNTS and packet == "aten.cumsum":
        return self._offsets(node, f)
    extra = [kw[k] for k in ("prepend", "append") if isinstance(kw.get(k), fx.Node)]
    self._scalars_rep(node, ("prepend", "append"))
    flows = [f] + [self.flow(e) for e in extra]
    bad = self._first_unknown(flows)
    if bad is not None:
        return tuple(bad for _ in out) if many else bad
    if all(g.kind == REP for g in flows):
        return tuple(_REP for _ in out) if many else _REP
    for g in flows:
        if not (g.batched or g.kind == REP):
            raise _Fail(f"it reads a value that is {_describe(g)}")
        if g.ptr is not None:
            raise _Fail("it computes with sample indices")
    lay = self._combine([(x, f)] + list(zip(extra, flows[1:])), _shape(x))
    if lay.dim == dim:
        raise _Fail(f"{packet.split('.')[-1]} runs along the batch dim (each position "
                    "would see other samples)")
    f = lay.moved(lay.dim)
    if many:  # (values, indices)
        size = _shape(x)[dim]
        bound = size if isinstance(size, int) else None
        return (f, dataclasses.replace(f, bound=bound)) + tuple(f for _ in out[2:])
    return f


@_rule(*_SORTS)
def _sort(self: BatchFlow, node: fx.Node) -> Any:
    packet = _packet(op_name(node))
    kw = schema_args(node)
    x = kw["self"]
    f = self.flow(x)
    rank = _rank(x)
    dim = _norm(kw.get("dim", -1 if packet != "aten.msort" else 0), rank)
    out = node.meta[VAL]
    many = isinstance(out, (list, tuple))
    size = _shape(x)[dim] if rank else 1
    if f.kind == UNKNOWN:
        return (f, f) if many else f
    if f.kind == REP:
        return (_REP, _REP) if many else _REP
    if not f.batched:
        raise _Fail(f"it sorts {x.name!r}, which is {_describe(f)}")
    if f.dim != dim:
        if f.ptr is not None:
            raise _Fail("it sorts sample indices")
        g = f.moved(f.dim)
        idx = dataclasses.replace(g, bound=size if isinstance(size, int) else None)
        return (dataclasses.replace(g, bound=f.bound), idx) if many else idx
    # a sort along the batch: a batch-wide permutation π of the rows of a 1-D value
    if rank != 1 or f.kind != SPLIT or f.ptr is not None or f.outer != 1:
        raise _Fail("it sorts along the batch dim (orders samples against each other)")
    self.sorts[node] = (x, not kw.get("descending", False))
    space = ("split", self.sizes.expr(size))
    indices = Flow(PERM, 0, node, ptr=space, bijective=True)
    if not many:  # argsort
        return indices
    return Flow(PERM, 0, node, bound=f.bound), indices


def _strip(node: Any) -> Any:
    """`node` through the ops that keep its values (casts, copies, same-shape views)."""
    while isinstance(node, fx.Node) and node.op == "call_function":
        packet = _packet(op_name(node))
        if packet in _COPIES or packet in ("aten.type_as",) or (
                packet in _VIEWS and _shape(node) == _shape(node.args[0])):
            node = node.args[0]
        else:
            break
    return node


def _keys_of(self: BatchFlow, x: Any) -> fx.Node | None:
    """The ascending sort π whose keys `x` holds (its sorted values or its input)."""
    base = _strip(x)
    if isinstance(base, fx.Node) and base.target is operator.getitem and base.args[1] == 0 \
            and base.args[0] in self.sorts:
        pi = base.args[0]
        return pi if self.sorts[pi][1] else None
    for pi, (keys, ascending) in self.sorts.items():
        if ascending and _strip(keys) is base:
            return pi
    return None


@_rule("aten.histc", "aten.bincount")
def _histogram(self: BatchFlow, node: fx.Node) -> Flow:
    kw = schema_args(node)
    x = kw["self"]
    f = self.flow(x)
    if f.kind == REP:
        return self._all_rep(node)
    if f.kind == UNKNOWN:
        return f
    pi = _keys_of(self, x)
    if _packet(op_name(node)) == "aten.histc":
        bins, lo, hi = kw.get("bins", 100), kw.get("min", 0), kw.get("max", 0)
        one_per_key = bins >= 2 and lo == 0 and hi == bins - 1
    else:
        bins = kw.get("minlength", 0)
        one_per_key = kw.get("weights") is None and isinstance(bins, int) and bins >= 1
    if pi is None or not one_per_key or f.bound is None or f.bound > bins:
        if _packet(op_name(node)) == "aten.histc" and isinstance(lo, (int, float)) and \
                isinstance(hi, (int, float)) and lo < hi and f.batched and f.ptr is None:
            return Flow(PARTIAL)   # counts in fixed bins: the shards' counts add up
        raise _Fail("it counts values over the whole batch (only the per-group counts of "
                    "keys sorted across the batch, one bin per key, are understood)")
    return Flow(COUNTS, perm=pi, groups=bins)


def _offsets(self: BatchFlow, node: fx.Node, counts: Flow) -> Flow:
    kw = schema_args(node)
    if _norm(kw.get("dim", 0), 1) != 0:
        raise _Fail("cumsum of counts along another dim")
    return Flow(OFFSETS, perm=counts.perm, groups=counts.groups)


BatchFlow._offsets = _offsets


def _grouped_mm(self: BatchFlow, node: fx.Node) -> Flow:
    x, w = node.args[0], node.args[1]
    offs = node.args[2] if len(node.args) > 2 else node.kwargs.get("offs")
    rest = list(node.args[3:]) + [v for k, v in node.kwargs.items() if k != "offs"]
    fx_, fw, fo = self.flow(x), self.flow(w), self.flow(offs)
    for f in (fx_, fw, fo):
        if f.kind == UNKNOWN:
            return f
    if fx_.kind == REP and fo.kind == REP:
        return self._all_rep(node)
    if any(isinstance(r, fx.Node) and self.flow(r).kind != REP for r in rest):
        raise _Fail("grouped matmul with a bias that depends on the batch")
    if (fx_.kind == PERM and fx_.dim == 0 and fx_.ptr is None and _rank(x) == 2
            and fw.kind == REP and _rank(w) == 3 and fo.kind == OFFSETS
            and fo.perm is fx_.perm and _shape(w)[0] == fo.groups):
        # rows sorted by π's keys, offsets = running counts of those keys: row r is in
        # group key(π(r)), a function of its own source row
        return Flow(PERM, 0, fx_.perm)
    raise _Fail("grouped matmul whose groups are not the keys its rows were sorted by")


BatchFlow._grouped_mm = _grouped_mm


@_rule("autohybrid.batch_sum")
def _batch_sum(self: BatchFlow, node: fx.Node) -> Flow:
    """ops/batch_sum.py: the shards' partial sums added over the batch's ranks: the whole
    batch's value on every rank. Only partial sums qualify: the sum over the ranks of a
    value each holds whole (rep) would count it once per rank."""
    f = self.flow(node.args[0])
    if f.kind == UNKNOWN:
        return f
    if f.kind != PARTIAL:
        raise _Fail(f"it adds {node.args[0].name!r} over the batch's ranks, which is "
                    f"{_describe(f)}, not a sum over the shard's samples")
    return _REP


@_rule("autohybrid.term_weight")
def _term_weight(self: BatchFlow, node: fx.Node) -> Flow:
    """ops/batch_sum.py: the loss denominator's share the whole-batch term is weighted by
    (its input's value, or under microbatches the rank's whole denominator over their
    count): flows as its input."""
    return self.flow(node.args[0])


@_rule("autohybrid.moe_experts")
def _moe_experts(self: BatchFlow, node: fx.Node) -> Flow:
    """ops/moe.py: output row t is a function of rows t of the tokens, routes and
    weights (and of the replicated expert weights), whatever the other rows are."""
    kw = schema_args(node)
    rows = [self.flow(kw[name]) for name in ("x", "top_k_index", "top_k_weights")]
    weights = [self.flow(kw[name]) for name in ("gate_up", "down")]
    for f in rows + weights:
        if f.kind == UNKNOWN:
            return f
    if all(f.kind == REP for f in rows + weights):
        return self._all_rep(node)
    if any(f.kind != REP for f in weights):
        raise _Fail("expert weights that depend on the batch")
    x = rows[0]
    if x.kind != SPLIT or x.dim != 0 or any(f.layout() != x.layout() for f in rows[1:]):
        raise _Fail("tokens, routes and routing weights whose rows are not the same "
                    "samples' (each must be split along dim 0 alike)")
    return x.moved(0)


@_rule("aten.index")
def _index(self: BatchFlow, node: fx.Node) -> Flow:
    x, indices = node.args[0], list(node.args[1])
    return _gather(self, node, x, indices)


@_rule("aten.index_select")
def _index_select(self: BatchFlow, node: fx.Node) -> Flow:
    x, dim, index = node.args[0], node.args[1], node.args[2]
    d = _norm(dim, _rank(x))
    return _gather(self, node, x, [None] * d + [index])


def _index_shape(xs: tuple, indices: list) -> tuple[tuple, int, list[int], bool]:
    """(shape of x[indices], where the broadcast index dims start, the indexed dims,
    whether those are adjacent)."""
    positions = [k for k, i in enumerate(indices) if i is not None]
    index_shape = tuple(torch.broadcast_shapes(*[_val(indices[k]).shape for k in positions]))
    contiguous = positions == list(range(positions[0], positions[-1] + 1))
    rest = [xs[k] for k in range(len(xs)) if k not in positions]
    if contiguous:
        p = positions[0]
        return xs[:p] + index_shape + tuple(xs[positions[-1] + 1:]), p, positions, True
    return index_shape + tuple(rest), 0, positions, False


def _gather(self: BatchFlow, node: fx.Node, x: Any, indices: list) -> Flow:
    """x[indices] (advanced indexing)."""
    fx_ = self.flow(x)
    flows = [self.flow(i) if i is not None else None for i in indices]
    for f in [fx_] + [f for f in flows if f is not None]:
        if f.kind == UNKNOWN:
            return f
    xs = _shape(x)
    out_shape, offset, positions, contiguous = _index_shape(xs, indices)
    tensors = [(indices[k], flows[k]) for k in positions]
    if any(_val(i).dtype in (torch.bool, torch.uint8) for i, _ in tensors):
        if fx_.kind == REP and all(f.kind == REP for _, f in tensors):
            return _REP
        raise _Fail("boolean-mask indexing of a batched value (its size depends on data)")
    if fx_.kind == REP and all(f.kind == REP for _, f in tensors):
        return _REP
    if not (fx_.batched or fx_.kind == REP):
        raise _Fail(f"it indexes {x.name!r}, which is {_describe(fx_)}")
    r = len(out_shape) - (len(xs) - len(positions))
    index_shape = out_shape[offset:offset + r]
    for k, (i, f) in zip(positions, tensors):
        if f.kind not in (REP, SPLIT, PERM):
            raise _Fail(f"it indexes by {i.name!r}, which is {_describe(f)}")
        if fx_.batched and k == fx_.dim:
            if fx_.outer != 1:
                raise _Fail("it picks rows of a batch dim interleaved with another dim")
            want = (("split", self.sizes.expr(xs[k])) if fx_.kind == SPLIT
                    else ("perm", fx_.perm, self.sizes.expr(xs[k])))
            if f.ptr is None or not (_same_space(self.sizes, f.ptr, want)
                                     or f.ptr[0] == want[0] == "split"
                                     and self.sizes.assume_eq(f.ptr[-1], want[-1])):
                raise _Fail("it picks rows of the batch dim by an index that is not a "
                            "sample's own position (it would mix samples)")
        elif f.ptr is not None:
            raise _Fail("it uses sample indices to index a dim that is not their batch dim")
    # the layout of the broadcast index positions (their pointers were checked above)
    plain = [(i, f.moved(f.dim, const=f.const)) for i, f in tensors]
    space = self._combine(plain, tuple(index_shape))
    if fx_.batched and fx_.dim not in positions:
        if space.kind != REP:
            raise _Fail("it indexes a batched value with a batched index along another dim")
        d = fx_.dim
        rest = [k for k in range(len(xs)) if k not in positions]
        if contiguous:
            e = d if d < positions[0] else d - len(positions) + r
        else:
            e = r + rest.index(d)
        return fx_.moved(e, ptr=fx_.ptr, bound=fx_.bound)
    if space.kind == REP:
        return _REP
    return space.moved(offset + space.dim, ptr=fx_.ptr, bound=fx_.bound,
                       const=fx_.kind == REP and space.const)


def _same_space(sizes: _Sizes, a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and (a[0] == "split" or a[1] is b[1]) and sizes.eq(a[-1], b[-1])


@_rule("aten.index_put", "aten.index_put_", "aten._index_put_impl", "aten._index_put_impl_")
def _index_put(self: BatchFlow, node: fx.Node) -> Flow:
    kw = schema_args(node)
    dst, indices, values = kw["self"], list(kw["indices"]), kw["values"]
    return _scatter_rows(self, node, dst, indices, values, bool(kw.get("accumulate", False)))


@_rule("aten.index_add", "aten.index_add_", "aten.index_copy", "aten.index_copy_")
def _index_add(self: BatchFlow, node: fx.Node) -> Flow:
    kw = schema_args(node)
    dst, dim, index = kw["self"], kw["dim"], kw["index"]
    src = kw.get("source")
    if self.flow(kw.get("alpha", 1)).kind != REP:
        raise _Fail("it scales by a number that depends on the batch")
    d = _norm(dim, _rank(dst))
    accumulate = _packet(op_name(node)).startswith("aten.index_add")
    return _scatter_rows(self, node, dst, [None] * d + [index], src, accumulate)


def _scatter_rows(self: BatchFlow, node: fx.Node, dst: Any, indices: list, values: Any,
                  accumulate: bool) -> Flow:
    """dst[indices] = values (or +=)."""
    fd, fv = self.flow(dst), self.flow(values)
    flows = [self.flow(i) if i is not None else None for i in indices]
    for f in [fd, fv] + [f for f in flows if f is not None]:
        if f.kind == UNKNOWN:
            return f
    positions = [k for k, i in enumerate(indices) if i is not None]
    if fd.kind == REP and fv.kind == REP and all(flows[k].kind == REP for k in positions):
        return _REP
    shape = _shape(dst)
    batch = self.sizes.batch_dims(shape)
    if len(positions) == 1 and batch == [positions[0]] and flows[positions[0]].ptr is not None:
        # rows sent back to their own positions: dst[ptr[r]] = values[r]
        d = positions[0]
        fi = flows[d]
        if not _same_space(self.sizes, fi.ptr, ("split", self.sizes.expr(shape[d]))):
            raise _Fail("it writes rows through an index into another space")
        if _rank(indices[d]) != 1:
            raise _Fail("it writes rows through a multi-dim index")
        v_dim = d  # values: the index's positions at dim d, dst's other dims
        if fv.kind == SPLIT and fv.iota and fi.kind == PERM and _rank(values) == 1:
            content = dict(ptr=("perm", fi.perm, self.sizes.expr(shape[d])))
        elif fv.batched and fv.layout() == fi.moved(v_dim).layout() \
                or fv.kind == SPLIT and fv.const and fv.dim == v_dim:
            content = dict(ptr=fv.ptr, bound=fv.bound)
        elif fv.kind == REP and _rank(values) < _rank(dst) - d:  # the same row everywhere
            content = {}
        else:
            raise _Fail("the rows it writes are not in the order of their index")
        if accumulate:
            if not (fd.kind == SPLIT and fd.dim == d and fd.ptr is None and fd.outer == 1):
                raise _Fail("it accumulates rows into a value whose rows are not the "
                            "batch's")
            if content.get("ptr") is not None:
                raise _Fail("it adds up sample indices")
            return Flow(SPLIT, d)
        if not fi.bijective:
            raise _Fail("it writes rows through an index that may repeat or miss rows "
                        "(the last write would depend on other samples)")
        return Flow(SPLIT, d, **content)
    # values written at replicated positions of other dims: x[..., idx] = values
    if fd.batched and fd.dim not in positions and all(
            flows[k].kind == REP for k in positions):
        sel_shape = _index_shape(shape, indices)[0]
        selected = _gather(self, node, dst, indices)
        if fv.kind != REP:
            if not (fv.batched and fv.ptr is None and self._combine(
                    [(values, fv)], sel_shape).layout() == selected.layout()):
                raise _Fail("the values it writes do not line up with the batch dim")
        return fd.moved(fd.dim)
    if fd.kind == REP:
        raise _Fail("it writes values that depend on the batch into a replicated tensor")
    raise _Fail("it scatters values along the batch dim")


@_rule("aten.gather", "aten.scatter", "aten.scatter_", "aten.scatter_add",
       "aten.scatter_add_", "aten.scatter_reduce", "aten.scatter_reduce_",
       "aten.take_along_dim")
def _gather_dim(self: BatchFlow, node: fx.Node) -> Flow:
    kw = schema_args(node)
    x = kw.get("self", kw.get("input"))
    dim = kw.get("dim")
    self._scalars_rep(node)
    tensors = _tensor_args(node)
    flows = [self.flow(t) for t in tensors]
    bad = self._first_unknown(flows)
    if bad is not None:
        return bad
    if all(f.kind == REP for f in flows):
        return _REP
    if any(f.ptr is not None for f in flows):
        raise _Fail("it gathers or scatters by sample indices")
    if dim is None:
        raise _Fail("take_along_dim over the flattened tensor")
    rank = _rank(x)
    lay = self._combine(list(zip(tensors, flows)), tuple(node.meta[VAL].shape))
    if lay.kind != REP and lay.dim == _norm(dim, rank):
        raise _Fail("it gathers or scatters along the batch dim")
    if any(f.kind == REP and _rank(t) == rank and self.sizes.batch_dims(_shape(t)) == []
           for t, f in zip(tensors, flows)) and lay.kind != REP:
        raise _Fail("it gathers or scatters a batched value with a replicated one")
    return lay.moved(lay.dim)


@_rule("aten.embedding", "aten.one_hot", "aten.embedding_bag", "aten._embedding_bag")
def _lookup(self: BatchFlow, node: fx.Node) -> Any:
    packet = _packet(op_name(node))
    kw = schema_args(node)
    self._scalars_rep(node)
    if packet == "aten.one_hot":
        table, idx = None, kw["self"]
    else:
        table, idx = kw["weight"], kw["indices"]
    fi = self.flow(idx)
    ft = self.flow(table) if table is not None else _REP
    for f in (fi, ft):
        if f.kind == UNKNOWN:
            return f
    if ft.kind != REP:
        raise _Fail("it looks up rows of a table that depends on the batch")
    if fi.ptr is not None:
        raise _Fail("it uses sample indices as table rows")
    if packet in ("aten.embedding_bag", "aten._embedding_bag"):
        return self._all_rep(node)
    if fi.kind == REP:
        return _REP
    if not fi.batched:
        raise _Fail(f"it looks up {idx.name!r}, which is {_describe(fi)}")
    return fi.moved(fi.dim)


def _contract(self: BatchFlow, node: fx.Node, operands: list[tuple[Any, list]],
              out_rank: int) -> Flow:
    """A product whose operand dims map to output dims (None: contracted)."""
    layout = None
    for arg, mapping in operands:
        f = self.flow(arg)
        if f.kind == UNKNOWN:
            return f
        if f.kind == REP:
            continue
        if not f.batched:
            raise _Fail(f"it multiplies {getattr(arg, 'name', arg)!r}, which is "
                        f"{_describe(f)}")
        if f.ptr is not None:
            raise _Fail("it multiplies sample indices")
        e = mapping[f.dim]
        if e is None:
            raise _Fail("it contracts over the batch dim (sums over samples)")
        g = f.moved(e, const=f.const)
        if layout is None or (layout.const and not g.const):
            if layout is not None and layout.dim != e:
                raise _Fail("its operands' batch dims do not line up")
            layout = g
        elif g.dim != layout.dim or (not g.const and g.layout() != layout.layout()):
            raise _Fail("its operands' batch dims do not line up (each would be a batch "
                        "dim of the product)")
    if layout is None:
        return _REP
    return layout.moved(layout.dim)


def _matmul_maps(ra: int, rb: int) -> tuple[list, list, int]:
    if ra == 1 and rb == 1:
        return [None], [None], 0
    if ra == 1:
        n = rb - 1
        return [None], [*range(rb - 2), None, n - 1], n
    if rb == 1:
        n = ra - 1
        return [*range(ra - 2), n - 1, None], [None], n
    n = max(ra, rb)
    a = [i + n - ra for i in range(ra - 2)] + [n - 2, None]
    b = [j + n - rb for j in range(rb - 2)] + [None, n - 1]
    return a, b, n


@_rule(*_MATMULS)
def _matmul(self: BatchFlow, node: fx.Node) -> Flow:
    packet = _packet(op_name(node))
    kw = schema_args(node)
    self._scalars_rep(node)
    out_rank = _rank(node)
    if packet == "aten.linear":
        x, w, b = kw["input"], kw["weight"], kw.get("bias")
        rx = _rank(x)
        ops_ = [(x, list(range(rx - 1)) + [None]), (w, [None] * _rank(w))]
        if b is not None:
            ops_.append((b, [None] * _rank(b)))
        return _contract(self, node, ops_, out_rank)
    if packet == "aten.einsum":
        return _einsum(self, node, kw["equation"], list(kw["tensors"]))
    if packet in ("aten.outer", "aten.ger"):
        return _contract(self, node, [(node.args[0], [0]), (node.args[1], [1])], 2)
    if packet in ("aten.dot", "aten.vdot"):
        return _contract(self, node, [(node.args[0], [None]), (node.args[1], [None])], 0)
    if packet in ("aten.mm", "aten.bmm", "aten.matmul", "aten.mv"):
        a, b = node.args[0], node.args[1]
        ma, mb, _ = _matmul_maps(_rank(a), _rank(b))
        return _contract(self, node, [(a, ma), (b, mb)], out_rank)
    # addmm / baddbmm / addbmm / addmv: (input, m1, m2)
    bias, a, b = kw["self"], node.args[1], node.args[2]
    if packet == "aten.addbmm":
        ma, mb = [None, 0, None], [None, None, 1]
    else:
        ma, mb, _ = _matmul_maps(_rank(a), _rank(b))
    rbias = _rank(bias)
    mbias = [i + out_rank - rbias for i in range(rbias)]
    return _contract(self, node, [(a, ma), (b, mb), (bias, mbias)], out_rank)


def _einsum(self: BatchFlow, node: fx.Node, equation: str, tensors: list) -> Flow:
    eq = equation.replace(" ", "")
    if "..." in eq or "->" not in eq:
        return _all_or_fail(self, node, "einsum with '...' or an implicit output")
    ins, out = eq.split("->")
    specs = ins.split(",")
    operands = [(t, [out.index(c) if c in out else None for c in spec])
                for t, spec in zip(tensors, specs)]
    return _contract(self, node, operands, len(out))


def _all_or_fail(self: BatchFlow, node: fx.Node, what: str) -> Any:
    try:
        return self._all_rep(node)
    except _Fail:
        raise _Fail(f"{what} of a batched value is not analysed") from None


@_rule(*_ATTENTION)
def _attention(self: BatchFlow, node: fx.Node) -> Any:
    """query [*, L, E], key [*, S, E], value [*, S, Ev], mask [*, L, S] -> [*, L, Ev]:
    the leading dims line up (broadcast); S and E are attended / contracted over."""
    kw = schema_args(node)
    q, k, v = kw["query"], kw["key"], kw["value"]
    mask = kw.get("attn_mask", kw.get("attn_bias"))
    self._scalars_rep(node)
    n = _rank(q)

    def leading(t, tail):
        r = _rank(t)
        return [i + n - r for i in range(r - 2)] + tail

    operands = [(q, leading(q, [n - 2, None])), (k, leading(k, [None, None])),
                (v, leading(v, [None, n - 1]))]
    if isinstance(mask, fx.Node):
        operands.append((mask, leading(mask, [n - 2, None])))
    f = _contract(self, node, operands, n)
    if f.batched and f.dim == n - 1:
        raise _Fail("attention with the batch in the value's feature dim")
    out = node.meta[VAL]
    if isinstance(out, (list, tuple)) and f.kind == UNKNOWN:
        return tuple(f for _ in out)
    if isinstance(out, (list, tuple)):  # (output, logsumexp, ...)
        return tuple(f if isinstance(o, torch.Tensor) and f.batched
                     and self.sizes.batch_dims(o.shape) == [f.dim] else _REP for o in out)
    return f


@_rule(*_LEADING)
def _leading(self: BatchFlow, node: fx.Node) -> Any:
    x = node.args[0]
    f = self.flow(x)
    if _packet(op_name(node)) != "aten.native_group_norm":  # its N is the batch size
        self._scalars_rep(node)
    params = [a for a in _tensor_args(node) if a is not x]
    for p in params:
        g = self.flow(p)
        if g.kind == UNKNOWN:
            return g
        if g.kind != REP:
            raise _Fail(f"its weights {p.name!r} depend on the batch")
    out = node.meta[VAL]
    many = isinstance(out, (list, tuple))
    if f.kind == UNKNOWN or f.kind == REP:
        return tuple(f for _ in out) if many else f
    if not (f.kind == SPLIT and f.dim == 0 and f.ptr is None):
        raise _Fail("it works over dims other than a leading batch dim")
    g = f.moved(0)
    return tuple(g for _ in out) if many else g


@_rule(*_LAYER_NORMS)
def _layer_norm(self: BatchFlow, node: fx.Node) -> Any:
    kw = schema_args(node)
    x = kw["input"]
    f = self.flow(x)
    self._scalars_rep(node)
    for key in ("weight", "bias"):
        if isinstance(kw.get(key), fx.Node):
            g = self.flow(kw[key])
            if g.kind == UNKNOWN:
                return g
            if g.kind != REP:
                raise _Fail("its weights depend on the batch")
    out = node.meta[VAL]
    many = isinstance(out, (list, tuple))
    if f.batched:
        if f.ptr is not None or f.dim >= _rank(x) - len(kw["normalized_shape"]):
            raise _Fail("it normalizes over the batch dim")
        f = f.moved(f.dim)
    elif f.kind not in (REP, UNKNOWN):
        raise _Fail(f"it normalizes a value that is {_describe(f)}")
    return tuple(f for _ in out) if many else f


@_rule(*_BATCH_NORMS)
def _batch_norm(self: BatchFlow, node: fx.Node) -> Any:
    kw = schema_args(node)
    x = kw["input"]
    f = self.flow(x)
    training = kw.get("training", False)
    params = [kw.get(k) for k in ("weight", "bias", "running_mean", "running_var")]
    for p in params:
        if isinstance(p, fx.Node):
            g = self.flow(p)
            if g.kind == UNKNOWN:
                return g
            if g.kind != REP:
                raise _Fail("its statistics or weights depend on the batch")
    out = node.meta[VAL]
    many = isinstance(out, (list, tuple))
    if f.kind in (REP, UNKNOWN):
        return tuple(f for _ in out) if many else f
    if not (f.kind == SPLIT and f.dim == 0 and f.outer == 1):
        raise _Fail("batch norm whose batch is not dim 0")
    if training and node not in self.per_sample:
        raise _Fail("batch norm in training mode computes statistics of the whole batch")
    g = Flow(SPLIT, 0)
    if not many:
        return g
    return tuple(g if isinstance(o, torch.Tensor) and self.sizes.batch_dims(o.shape)
                 else _REP for o in out)


@_rule(*_RNNS)
def _rnn(self: BatchFlow, node: fx.Node) -> Any:
    kw = schema_args(node)
    name = op_name(node)
    if not name.endswith(".input"):
        return self._all_rep(node)
    x = kw["input"]
    hx = kw["hx"] if isinstance(kw["hx"], (list, tuple)) else [kw["hx"]]
    params = kw["params"]
    batch_first = kw["batch_first"]
    f = self.flow(x)
    for p in params:
        g = self.flow(p)
        if g.kind == UNKNOWN:
            return g
        if g.kind != REP:
            raise _Fail("its weights depend on the batch")
    flows = [f] + [self.flow(h) for h in hx]
    bad = self._first_unknown(flows)
    out = node.meta[VAL]
    if bad is not None:
        return tuple(bad for _ in out)
    if all(g.kind == REP for g in flows):
        return tuple(_REP for _ in out)
    d = 0 if batch_first else 1
    if not (f.kind == SPLIT and f.dim == d and f.ptr is None and _rank(x) == 3
            and f.outer == 1):
        raise _Fail("RNN input whose batch is not its batch dim")
    for h, g in zip(hx, flows[1:]):
        if not (g.kind == SPLIT and g.dim == 1 and g.ptr is None and g.outer == 1):
            raise _Fail("RNN state whose batch is not its dim 1")
    return (Flow(SPLIT, d),) + tuple(Flow(SPLIT, 1) for _ in out[1:])


@_rule(*_names(_CLASS_LOSSES, _ELEMENTWISE_LOSSES))
def _loss(self: BatchFlow, node: fx.Node) -> Flow:
    kw = schema_args(node)
    per_sample = self.per_element_loss(node)
    if kw.get("reduction", 1) == 0:
        return per_sample
    if per_sample.kind == UNKNOWN:
        return per_sample
    if per_sample.kind == REP:
        return _REP
    if kw.get("reduction", 1) == 2 and per_sample.batched and per_sample.ptr is None:
        return Flow(PARTIAL)   # a sum over the shard's samples, as `sum` over the batch dim
    raise _Fail("a loss reduced over the batch before the final reduction")


def per_element_loss(self: BatchFlow, node: fx.Node) -> Flow:
    """The flow of a loss node's values before its reduction (reduction='none')."""
    packet = _packet(op_name(node))
    kw = schema_args(node)
    self._scalars_rep(node)
    if packet in _ELEMENTWISE_LOSSES:
        try:
            return self._combine([(a, self.flow(a)) for a in (kw["self"], kw["target"])],
                                 tuple(torch.broadcast_shapes(_shape(kw["self"]),
                                                              _shape(kw["target"]))))
        except _Fail as exc:
            return unknown(node, str(exc))
    x, target = kw["self"], kw["target"]
    weight = kw.get("weight")
    if isinstance(weight, fx.Node):
        g = self.flow(weight)
        if g.kind != REP:
            return g if g.kind == UNKNOWN else unknown(node, "its class weights depend on "
                                                             "the batch")
    fx_, ft = self.flow(x), self.flow(target)
    for f in (fx_, ft):
        if f.kind == UNKNOWN:
            return f
    rx = _rank(x)
    class_dim = 1 if rx >= 2 else 0
    if fx_.batched and fx_.dim == class_dim:
        return unknown(node, "its class dim is the batch dim")
    # input dims without the class dim line up with the target's dims
    mapping = [i if i < class_dim else i - 1 for i in range(rx)]
    mapping[class_dim] = None
    if _val(target).is_floating_point():  # class probabilities: same shape as input
        operands = [(x, mapping), (target, mapping)]
    else:
        operands = [(x, mapping), (target, list(range(_rank(target))))]
    try:
        return _contract(self, node, operands, max(rx - 1, 0))
    except _Fail as exc:
        return unknown(node, str(exc))


BatchFlow.per_element_loss = per_element_loss


@_rule("aten.type_as", "aten.view_as_real", "aten.view_as_complex")
def _type_as(self: BatchFlow, node: fx.Node) -> Flow:
    f = self.flow(node.args[0])
    return f


@_rule("aten.copy", "aten.copy_")
def _copy(self: BatchFlow, node: fx.Node) -> Flow:
    kw = schema_args(node)
    src = kw["src"]
    f = self.flow(src)
    out = tuple(node.meta[VAL].shape)
    if f.kind == UNKNOWN:
        return f
    if f.kind == REP:
        return self._from_shape(node, out)
    return self._combine([(src, f)], out, copies=True)


@_rule("aten.fill", "aten.fill_", "aten.zero", "aten.zero_")
def _fill(self: BatchFlow, node: fx.Node) -> Flow:
    kw = schema_args(node)
    value = kw.get("value", 0)
    f = self.flow(value)
    if f.kind != REP:
        raise _Fail("it fills with a value that depends on the batch")
    return self._from_shape(node, tuple(node.meta[VAL].shape))


def _selection(self: BatchFlow, node: fx.Node) -> Any:
    """torch.where(cond): the coordinates of cond's true elements, one index tensor per
    dim, in row-major order. Over a batch split along dim d, a shard picks the true
    elements of its own samples: each picked row belongs to the sample of its coordinate
    d, which points into that dim's rows (a hand-written MoE's tokens per expert,
    `torch.where(mask[e])`). The rows come in an order the shard's samples give, and
    their count is data's (a new symbol, counted as batch-sized: the shards' counts add
    up), so they are a perm value of the selection (order may not matter; a pointer that
    may repeat or miss rows: sending values back only by adding)."""
    cond = node.args[0]
    f = self.flow(cond)
    rank = _rank(cond)
    if f.kind == UNKNOWN:
        return (f,) * rank
    if f.kind == REP:
        return self._all_rep(node)
    if f.kind != SPLIT or f.ptr is not None or f.outer != 1:
        raise _Fail("its output size depends on the values of the whole batch")
    vals = node.meta[VAL]
    self.sizes.add_batch(s.node.expr for t in vals for s in t.shape
                         if isinstance(s, torch.SymInt) and s.node.expr.free_symbols
                         and not self.sizes.has_batch(s))
    shape = _shape(cond)
    return tuple(Flow(PERM, 0, node, ptr=("split", self.sizes.expr(shape[j])))
                 if j == f.dim else
                 Flow(PERM, 0, node, bound=shape[j] if isinstance(shape[j], int) else None)
                 for j in range(rank))


@_rule(*_DATA_SHAPED)
def _data_shaped(self: BatchFlow, node: fx.Node) -> Any:
    try:
        return self._all_rep(node)
    except _Fail:
        raise _Fail("its output size depends on the values of the whole batch") from None


# ---------------------------------------------------------------------------- aliases
def _written_arg(node: fx.Node) -> fx.Node | None:
    """The argument an in-place op writes (None for functional ops)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return None
    for i, arg in enumerate(schema.arguments):
        info = arg.alias_info
        if info is not None and info.is_write:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            if isinstance(value, fx.Node):
                return value
    return None


class _Aliases:
    """Which nodes may share storage (views of each other, in-place results)."""

    def __init__(self):
        self.parent: dict[fx.Node, fx.Node] = {}
        self.groups: dict[fx.Node, list[fx.Node]] = {}

    def find(self, n: fx.Node) -> fx.Node:
        while self.parent.get(n, n) is not n:
            n = self.parent[n]
        return n

    def union(self, a: fx.Node, b: fx.Node) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra is rb:
            return
        self.parent[rb] = ra
        group = self.groups.setdefault(ra, [ra])
        group.extend(self.groups.pop(rb, [rb]))

    def add(self, node: fx.Node) -> None:
        for src in _alias_sources(node):
            self.union(src, node)

    def members(self, node: fx.Node) -> list[fx.Node]:
        if node not in self.parent:
            return [node]
        return list(self.groups.get(self.find(node), [node]))


def _alias_sources(node: fx.Node) -> list[fx.Node]:
    if node.target is operator.getitem:
        src = node.args[0]
        return [a for a in _alias_sources(src)] if isinstance(src, fx.Node) and \
            src.op == "call_function" else []
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns:
        return []
    out_sets = set()
    for ret in schema.returns:
        if ret.alias_info is not None:
            out_sets |= set(ret.alias_info.before_set) | set(ret.alias_info.after_set)
    maybe = torch.Tag.maybe_aliasing_or_mutating in getattr(node.target, "tags", ())
    found = []
    for i, arg in enumerate(schema.arguments):
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        if not isinstance(value, fx.Node):
            continue
        info = arg.alias_info
        if info is not None and (set(info.before_set) & out_sets or info.is_write):
            found.append(value)
        elif maybe and i == 0:
            found.append(value)
    return found
