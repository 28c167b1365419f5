"""Pass: rewrite one rank's graph for tensor parallelism (the Plan's tp shardings).

The layout is search/sharding.py's, recomputed on this graph with the Plan's choices for
the generic linears (a linear whose weight the Plan splits is column-parallel), so the
planner and the pass agree by construction. On rank r of the tp group:

- parameters the layout splits become this rank's shard (`ShardSpec`: the split dim,
  fused projections taken block by block — q, k, v of a fused qkv, gate and up of a fused
  gate_up, whether the graph splits, chunks or slices them apart, blocks of unequal sizes
  too — vocabularies padded to a multiple of tp, key/value heads replicated when tp
  exceeds them, their replicas' gradients summed by `tp_replicated`);
- a column-parallel linear reads its input through `tp_copy` (Megatron's f: identity,
  backward all-reduce); a row-parallel linear computes its partial product, `tp_reduce`
  (g: all-reduce, backward identity) sums it, then its bias is added once; convolutions
  (one group, not transposed) split the same way by channels: column = filter
  parallelism (output channels), row = channel parallelism (input channels, the partial
  sums all-reduced), a filter-split conv feeding a channel-split one through per-channel
  ops (activations, pools, BatchNorm) with no collective between them; a BatchNorm on
  channel shards normalizes there (weight and bias split; in training a sync_batch_norm
  whose statistics are gathered to update the whole running ones, in eval reading its
  slice of them);
- views, reshapes, expands and splits of split values get their local sizes;
- the vocabulary-parallel embedding and cross-entropy (ops/vocab_parallel.py) replace
  embedding and the class loss, so the logits are never gathered for the loss;
- dropout of a split value, and attention with dropout, draw the mask eager draws for
  the whole tensor and keep this rank's slice (ops/dropout.py): with the same seed on
  every rank a tp run drops exactly the elements eager drops (data-parallel ranks draw
  for their own samples, so with dp > 1 the masks are per data shard);
- where a split value meets an op that needs it whole, `tp_gather` joins it (trimming
  vocabulary padding); a replicated operand combined with a split one is sliced
  (`tp_split`); split graph outputs are gathered;
- gradient contracts (search/tp_gradients.py): the layout comes proven — every tp_gather
  and tp_reduce receives a replicated gradient — and the pass refuses, naming the node,
  a replicated operand needing a gradient that it would broadcast into a split op (the
  one source of partial gradients), so a plan that would train wrongly never runs.

`ctx.notes["param_shards"]` (`RankProgram.param_shards`) maps each split parameter's
canonical name to its ShardSpec (program.py); the runtime slices parameters and gathers
them back (full_state_dict) with it.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..capture import _WRAPPER_PREFIX
from ..cost.compute import grad_nodes
from ..errors import PlanError
from ..graph import (AH_PASS, AH_ROLE, VAL, fake_mode, module_path, new_node, op_name,
                     output_node, propagate_fake, refresh_fake, schema_args, source_line)
from ..program import ShardSpec
from ..ops import tensor_parallel as tp_ops  # noqa: F401  (registers autohybrid::tp_*)
from ..ops import dropout, vocab_parallel  # noqa: F401  (registers the ops they define)
from ..search.sharding import (R, TensorParallelLayout, _CLASS_LOSSES, _along, _slice_range,
                               linear_parts, mark_vocab_linear, param_key, shard_dim)
from ..search.tp_gradients import megatron_layout, sliced_operand
from .manager import PassContext
from .sync_batch_norm import replace_batch_norm, training_batch_norms

aten = torch.ops.aten
ah_ops = torch.ops.autohybrid
AXIS = "tp"


# ------------------------------------------------------------------ parameter shards
def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# ------------------------------------------------------------------ the pass
def tensor_parallel(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    tp = ctx.plan.mesh.tp
    if tp == 1 or ctx.plan.mesh.spatial:   # spatial: the tp axis holds tiles (spatial_parallel)
        return gm
    layout = _plan_layout(gm, ctx)
    if _sync_channel_norms(gm, layout):
        layout = _plan_layout(gm, ctx)
    rewriter = _Rewriter(gm, layout, tp, ctx.coords[2])
    rewriter.run()
    ctx.notes["param_shards"] = {**ctx.notes.get("param_shards", {}), **rewriter.specs}
    ctx.notes["tp_layout"] = layout
    return gm


def _plan_layout(gm: fx.GraphModule, ctx: PassContext) -> TensorParallelLayout:
    """This graph's layout with the Plan's choices for open (generic) linears; an open
    linear the Plan splits whose features (or fused blocks) `tp` does not divide is
    replicated instead (the planner skips only Megatron's linears for divisibility)."""
    split = {s.node for s in ctx.plan.shardings if s.placement.startswith("shard(")}
    choices = {}
    for node in gm.graph.nodes:
        parts = linear_parts(node)
        if parts is not None and param_key(parts.weight) in split:
            choices[node.name] = "column"
    layout = megatron_layout(gm, choices)
    tp = ctx.plan.mesh.tp
    undivided = {linear for key, linear in layout.open_params.items()
                 if key not in ctx.padded_params and any(b % tp for b in
                                                         layout.fused_params.get(
                     key, (layout.shard_sizes.get(key, 0),)))}
    if undivided:
        layout = megatron_layout(gm, {k: v for k, v in choices.items() if k not in undivided})
    _pad_as_in_training(gm, layout, ctx.padded_params)
    return layout


def _sync_channel_norms(gm: fx.GraphModule, layout: TensorParallelLayout) -> bool:
    """Training batch norms on channel shards become `sync_batch_norm` over "dp" (with
    dp = 1: this rank's batch), whose per-channel statistics the rewrite gathers over tp
    to update the whole running statistics, the same on every tp rank. (With dp > 1 the
    sync_batch_norm pass has replaced them already.) Whether any was replaced."""
    created = []
    for node in training_batch_norms(gm):
        if node.name in layout.channel_norms:
            # (marked as the sync_batch_norm pass's nodes: the rewrite below still visits
            # them, as it does that pass's with dp > 1)
            created += replace_batch_norm(gm, node, "dp", "sync_batch_norm")
    propagate_fake(gm, created)
    return bool(created)


def _pad_as_in_training(gm: fx.GraphModule, layout: TensorParallelLayout,
                        padded: frozenset[str]) -> None:
    """A forward graph's column linears over the vocabulary the training graph padded
    (its vocabulary-parallel loss told it; this graph has no loss): padded alike, so
    both programs read the same shards, and their output gathered without the padding."""
    for node in gm.graph.nodes:
        parts = linear_parts(node)
        if parts is None or param_key(parts.weight) not in padded \
                or layout.linear_roles.get(node.name) != "column":
            continue
        mark_vocab_linear(layout, node, parts)


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
        self.needs_grad = {n.name for n in grad_nodes(gm)}
        self.captured_inputs = {n.name: self._input_shapes(n) for n in gm.graph.nodes}
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
        """Recompute `node`'s fake value from its (rewritten) inputs. A replicated op whose
        inputs kept their captured shapes keeps its captured value when its fake kernel
        cannot run again (aten.lstm in float32 calls numel() on symbolic sizes)."""
        try:
            refresh_fake(node, self.mode)
        except RuntimeError:
            if self.sharded(node) is not None or self._input_shapes(node) != \
                    self.captured_inputs.get(node.name):
                raise

    @staticmethod
    def _input_shapes(node: fx.Node) -> list:
        return [(tuple(v.shape), v.dtype) if isinstance(v := a.meta.get(VAL), torch.Tensor)
                else None for a in node.all_input_nodes]

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
            blocks = chunks.get(key, (size,))
            if key in layout.vocab_params:
                padded = _round_up(size, ways)
            else:
                padded = size
                if any(b % ways for b in blocks):
                    raise PlanError(
                        f"tensor parallelism: dim {dim} of parameter {key!r} (size {size}, "
                        f"fused blocks {list(blocks)}) does not split over the {ways} ranks of "
                        f"mesh axis {AXIS!r}; choose a tp degree that divides every block")
            index = self.rank // (tp // ways)
            equal = len(set(blocks)) == 1
            spec = ShardSpec(dim, size, padded, len(blocks), ways, index,
                             () if equal else tuple(blocks))
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

    def _fused_chunks(self) -> dict[str, tuple[int, ...]]:
        """Parameters of column linears whose output is taken apart into blocks (fused
        qkv / gate_up: split, chunk or slices), with the blocks' full sizes."""
        if self.layout.fused_kv_params and self.kv_ways < self.tp:
            name = sorted(self.layout.fused_kv_params)[0]
            raise PlanError(
                f"tensor parallelism: the fused projection {name!r} computes attention keys "
                f"and values for fewer key/value heads than the {self.tp} ranks of mesh axis "
                f"{AXIS!r}; its key/value blocks cannot be split that far. Choose tp <= the "
                "number of key/value heads")
        return dict(self.layout.fused_params)

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
        if node.name in self.layout.channel_norms:
            self._channel_norm(node)
            return
        if role == "replicate" or linear_parts(node) is not None:
            self._gather_inputs(node)
            self.fake(node)
            return
        if name == "aten.embedding.default" and \
                param_key(node.args[0]) in self.layout.vocab_params:
            self._embedding(node)
            return
        if name in _CLASS_LOSSES and self.sharded(node.args[0]) is not None \
                and node.args[0].name not in self.layout.blocks:
            self._class_loss(node)
            return
        if name == "aten.dropout.default" and self.sharded(node.args[0]) is not None \
                and node.args[0] not in self.padded:
            self._dropout(node)
            return
        if name == "aten.scaled_dot_product_attention.default" and _sdpa_dropout(node) > 0 \
                and self.sharded(node) is not None:
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

    def _channel_norm(self, node: fx.Node) -> None:
        """A batch norm on this rank's channels: its weight and bias are shards already;
        an eval-mode one reads its slice of the running statistics (a training one is a
        sync_batch_norm, whose statistics outputs are split and gathered where used)."""
        if op_name(node) == "aten.batch_norm.default":
            args = list(node.args)
            for i in (3, 4):   # running_mean, running_var
                if isinstance(args[i], fx.Node) and self.sharded(args[i]) is None:
                    with self.graph.inserting_before(node):
                        args[i] = self.call(ah_ops.tp_split.default, (args[i], 0, AXIS),
                                            like=node)
            node.args = tuple(args)
        self.fake(node)

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
        with self.graph.inserting_before(node):
            if parts.feature == -1:
                product = aten.linear.default if op_name(node) == "aten.linear.default" \
                    else aten.mm.default  # addmm(bias, x, w)
                partial = self.call(product, (x, parts.weight), like=node)
            else:   # a convolution: the same op without its bias
                args, kwargs = list(node.args), dict(node.kwargs)
                if len(args) > 2:
                    args[2] = None
                else:
                    kwargs["bias"] = None
                partial = self.call(node.target, tuple(args), kwargs, like=node)
            reduced = self.call(ah_ops.tp_reduce.default, (partial, AXIS), like=node)
            if parts.feature != -1:   # the bias per channel: (C, 1, ...) against (N, C, ...)
                spatial = node.meta[VAL].dim() - 2
                bias = self.call(aten.view.default, (bias, [-1] + [1] * spatial))
            total = self.call(aten.add.Tensor, (reduced, bias), like=node)
        node.replace_all_uses_with(total)
        self.graph.erase_node(node)

    def _embedding(self, node: fx.Node) -> None:
        weight, ids = node.args[0], node.args[1]
        args = dict(zip(("padding_idx", "scale_grad_by_freq", "sparse"), node.args[2:]))
        args = {**args, **node.kwargs}
        padding_idx = args.get("padding_idx", -1)  # global row; the op keeps its grad zero
        # max_norm: F.embedding renormalizes the rows it reads in place first (global ids)
        readers = [weight, *(u for u in weight.users if op_name(u) == "aten.detach.default")]
        args["max_norm"] = any(op_name(u) == "aten.embedding_renorm_.default"
                               for r in readers for u in r.users)
        for flag in ("scale_grad_by_freq", "sparse", "max_norm"):
            if args.get(flag):
                where = module_path(node).removeprefix(_WRAPPER_PREFIX) or node.name
                has, fix = (("max_norm", "without max_norm") if flag == "max_norm"
                            else (f"{flag}=True", f"with {flag}=False"))
                raise PlanError(
                    f"tensor parallelism: embedding {where!r} (`{source_line(node)}`) has "
                    f"{has}, which the vocabulary-parallel embedding on mesh axis "
                    f"{AXIS!r} does not compute; build it {fix} or pin tp=1")
        spec = self.specs[param_key(weight)]
        start = spec.index * spec.shard_size
        with self.graph.inserting_before(node):
            partial = self.call(ah_ops.vocab_parallel_embedding.default,
                                (ids, weight, start, AXIS, -1 if padding_idx is None
                                 else int(padding_idx)), like=node)
            reduced = self.call(ah_ops.tp_reduce.default, (partial, AXIS), like=node)
        node.replace_all_uses_with(reduced)
        self.graph.erase_node(node)

    def _class_loss(self, node: fx.Node) -> None:
        kw = schema_args(node)
        logits, target = kw["self"], kw["target"]
        dim = self.sharded(logits)
        nd = logits.meta[VAL].dim()
        needs_whole = (kw.get("weight") is not None or target.meta[VAL].is_floating_point()
                       or nd < 2 or dim != 1)
        if needs_whole:  # class weights, probabilities, split off the class dim: join them
            self._gather_inputs(node)
            self.fake(node)
            return
        local = int(logits.meta[VAL].shape[dim])
        size = self.padded.get(logits, (dim, None))[1] or local * self.tp
        start = self.rank * local
        smoothing = float(kw.get("label_smoothing", 0.0) or 0.0)
        reduction = kw.get("reduction", 1)
        ignore = kw.get("ignore_index", -100)
        with self.graph.inserting_before(node):
            wanted = node.meta[VAL].dtype
            if logits.meta[VAL].dtype != wanted:  # under autocast the loss runs in fp32
                logits = self.call(aten._to_copy.default, (logits,), {"dtype": wanted},
                                   like=node)
            rows = target
            if nd > 2:   # (N, C, d1, ...) logits, (N, d1, ...) targets: rows of C classes
                shape = self._shape_args(target)
                logits = self.call(aten.permute.default,
                                   (logits, [0, *range(2, nd), 1]), like=node)
                logits = self.call(aten.reshape.default, (logits, [-1, local]), like=node)
                rows = self.call(aten.reshape.default, (target, [-1]), like=node)
            both = self.call(ah_ops.vocab_parallel_cross_entropy.default,
                             (logits, rows, start, size, ignore, smoothing, AXIS), like=node)
            loss = self.call(operator.getitem, (both, 0), like=node)
            if reduction == 0 and nd > 2:   # per element, in the targets' shape
                loss = self.call(aten.reshape.default, (loss, shape), like=node)
            if reduction in (1, 2):
                loss = self.call(aten.sum.default, (loss,), like=node)
            if reduction == 1:
                keep = self.call(aten.ne.Scalar, (target, ignore), like=node)
                count = self.call(aten.sum.default, (keep,), {"dtype": loss.meta[VAL].dtype},
                                  like=node)
                loss = self.call(aten.div.Tensor, (loss, count), like=node)
        node.replace_all_uses_with(loss)
        self.graph.erase_node(node)

    def _shape_args(self, x: fx.Node) -> list:
        """`x`'s shape as graph arguments (symbolic sizes read from `x` by sym_size nodes
        inserted at the current point, static ones as numbers)."""
        return [self.call(aten.sym_size.int, (x, i)) if isinstance(size, torch.SymInt)
                else int(size) for i, size in enumerate(x.meta[VAL].shape)]

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
        kw = schema_args(node)
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
        """Slice replicated operands that span the split dim (tp_split); a replicated
        operand broadcast along it must not need a gradient (it would be partial: each
        rank's share of a sum over its shard — the layout's proof excludes this)."""
        for a in node.all_input_nodes:
            if self.sharded(a) is not None or not isinstance(a.meta.get(VAL), torch.Tensor):
                continue
            if not sliced_operand(node, a, out_dim):
                self._check_gradient_contract(node, a)
                continue
            dim = out_dim - (node.meta[VAL].dim() - a.meta[VAL].dim())
            with self.graph.inserting_before(node):
                piece = self.call(ah_ops.tp_split.default, (a, dim, AXIS), like=node)
            node.replace_input_with(a, piece)

    def _check_gradient_contract(self, node: fx.Node, operand: fx.Node) -> None:
        """Refuse (before anything runs) a replicated operand that needs a gradient and
        is broadcast into split op `node`: its gradient would be partial, and the tp_gather
        or tp_reduce it flows back to would lose the other ranks' shares."""
        if operand.name not in self.needs_grad:
            return
        where = module_path(node).removeprefix(_WRAPPER_PREFIX) or "the top module"
        raise PlanError(
            f"tensor parallelism: replicated operand {operand.name!r} of split op "
            f"{node.name!r} (module {where}, `{source_line(node)}`) needs a gradient but is "
            f"broadcast along the shard dim on mesh axis {AXIS!r}: each rank's gradient "
            "would be only its shard's share, and no collective's backward sums it. The "
            "layout should have replicated this region (a bug in the sharding search); "
            "pin tp=1 and report the model")

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
        elif name == "aten.slice.Tensor" and _along(node, src) == self.sharded(src):
            # a block of a fused projection: this rank's part of it (sizes divide by ways)
            size = int(self.full[src.name].shape[self.sharded(src)])
            start, end = _slice_range(node, size)
            ratio = self._numel_ratio(src)
            node.args = (src, node.args[1], start // ratio, end // ratio)
        elif name in ("aten.split.Tensor", "aten.split_with_sizes.default"):
            along = (node.args[2] if len(node.args) > 2 else 0) % self.full[src.name].dim()
            if along == self.sharded(src):
                ratio = self._numel_ratio(src)
                sizes = node.args[1]
                sizes = [s // ratio for s in sizes] if isinstance(sizes, (list, tuple)) \
                    else sizes // ratio
                node.args = (src, sizes, *node.args[2:])

    def _numel_ratio(self, node: fx.Node) -> int:
        """Elements of the full value over those of this rank's, over the dims static in
        both (tp never splits batch or sequence; an op's fake kernel may make a symbolic
        batch concrete — aten.lstm does — so a dim symbolic on either side is skipped:
        issue 17 E7). Key/value heads replicated over tp / kv ranks make this more than
        the split dim's ratio (their expand shrinks the query-group dim too)."""
        full, local = self.full[node.name], node.meta[VAL]
        if full.dim() != local.dim():
            raise PlanError(
                f"tensor parallelism: node {node.name!r} (`{source_line(node)}`) changed rank "
                f"under the tp rewrite ({tuple(full.shape)} → {tuple(local.shape)}); pin tp=1 "
                "and report the model")
        whole = mine = 1
        for a, b in zip(full.shape, local.shape):
            if not isinstance(a, torch.SymInt) and not isinstance(b, torch.SymInt):
                whole, mine = whole * int(a), mine * int(b)
        return max(1, whole // mine) if mine else 1

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
