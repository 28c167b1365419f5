"""Pass: sequence parallelism on the tp axis (Megatron-SP), after tensor_parallel.

Between tensor-parallel regions every tp rank computes the same thing on the whole
sequence: norms, dropout, residual adds. With the Plan's `sp`, those regions work on this
rank's slice of the sequence instead:

- each g (`tp_reduce` of a row-parallel linear or of the vocabulary-parallel embedding)
  becomes `sp_reduce_scatter` along the sequence dim: the sum, scattered by sequence;
- each f (`tp_copy` before a column-parallel linear) becomes `sp_gather`: the whole
  sequence for the linear, its gradient reduce-scattered back;
- per-token ops between them (element-wise, norms over the hidden dims, reductions that
  keep the sequence, views that keep it, dropout — with eager's mask, ops/dropout.py)
  run on the slice; a replicated operand that spans the sequence (position embeddings)
  is sliced (`tp_split`), and parameters read there (norm weights, row biases) — and any
  other replicated operand that needs a gradient — go through `tp_copy`, whose backward
  sums their per-slice gradients over the tp group (without it the gradient would be
  partial, and the tp_gather / tp_reduce it reaches would drop the other slices' shares);
- an op that needs the whole sequence otherwise gets it from `tp_gather` (its consumer
  computes the same on every rank, so the gradient is sliced back), as do graph outputs;
- `sym_size` of a sliced value along the sequence reads the full length (× tp).

The sequence must divide by tp at run time (`sp_reduce_scatter` says so otherwise).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..capture import _dim_roles
from ..cost.compute import grad_nodes
from ..graph import AH_PASS, AH_ROLE, VAL, fake_mode, new_node, op_name, output_node, refresh_fake
from ..ops import dropout, tensor_parallel  # noqa: F401  (registers the ops)
from ..search.sharding import _ELEMENTWISE_PREFIXES, _follow, reduced_dim
from .manager import PassContext

aten = torch.ops.aten
ah_ops = torch.ops.autohybrid
AXIS = "tp"
_NORMS = {"aten.layer_norm.default", "aten.rms_norm.default",
          "aten.native_layer_norm.default"}
_REDUCTIONS = {"aten.mean.dim", "aten.sum.dim_IntList", "aten.amax.default",
               "aten.amin.default", "aten.var.correction", "aten.std.correction"}


def sequence_parallel(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if ctx.plan.mesh.tp == 1 or not ctx.plan.mesh.sp:
        return gm
    seq = {s for s, role in _dim_roles(gm).items() if role == "seq"}
    if not seq:
        return gm  # no sequence dim (e.g. an MLP on vectors): nothing to slice
    _SequenceRewriter(gm, seq, ctx.plan.mesh.tp, ctx.coords[2]).run()
    return gm


class _SequenceRewriter:
    def __init__(self, gm: fx.GraphModule, seq: set, tp: int, rank: int):
        self.gm, self.graph, self.seq, self.tp, self.rank = gm, gm.graph, seq, tp, rank
        self.sliced: dict[fx.Node, int] = {}   # value → its sequence dim (this rank's slice)
        self.wrapped: dict[fx.Node, fx.Node] = {}
        self.whole: dict[fx.Node, fx.Node] = {}
        self.mode = fake_mode(gm)
        self.needs_grad = grad_nodes(gm)  # values autograd computes gradients of

    # ---------------------------------------------------------------- helpers
    def seq_dim(self, node: fx.Node) -> int | None:
        val = node.meta.get(VAL) if isinstance(node, fx.Node) else None
        if not isinstance(val, torch.Tensor):
            return None
        dims = [d for d, s in enumerate(val.shape)
                if isinstance(s, torch.SymInt) and s.node.expr.free_symbols & self.seq]
        return dims[0] if len(dims) == 1 else None

    def call(self, op, args, kwargs=None, *, like: fx.Node | None = None) -> fx.Node:
        return new_node(self.graph, op, args, kwargs, pass_name="sequence_parallel",
                        mode=self.mode, like=like)

    def fake(self, node: fx.Node) -> None:
        refresh_fake(node, self.mode)

    def gathered(self, x: fx.Node, before: fx.Node) -> fx.Node:
        """The whole sequence of sliced `x` for a replicated consumer."""
        if x not in self.whole:
            with self.graph.inserting_before(before):
                self.whole[x] = self.call(ah_ops.tp_gather.default, (x, self.sliced[x], AXIS),
                                          like=before)
        return self.whole[x]

    def summed_grad(self, param: fx.Node, before: fx.Node) -> fx.Node:
        """`param` through f: its gradients from every sequence slice are summed."""
        if param not in self.wrapped:
            with self.graph.inserting_before(before):
                self.wrapped[param] = self.call(ah_ops.tp_copy.default, (param, AXIS),
                                                like=before)
        return self.wrapped[param]

    # ---------------------------------------------------------------- driver
    def run(self) -> None:
        for node in list(self.graph.nodes):
            if node.op != "call_function" or node.meta.get(AH_PASS) == "sequence_parallel":
                continue
            self._rewrite(node)
        out = output_node(self.gm)
        values = [self.gathered(v, out) if v in self.sliced else v for v in out.args[0]]
        out.args = (tuple(values),)

    def _rewrite(self, node: fx.Node) -> None:
        target = node.target
        if target is ah_ops.tp_reduce.default and self.seq_dim(node.args[0]) is not None:
            d = self.seq_dim(node.args[0])
            with self.graph.inserting_before(node):
                scattered = self.call(ah_ops.sp_reduce_scatter.default, (node.args[0], d, AXIS),
                                      like=node)
            node.replace_all_uses_with(scattered)
            self.graph.erase_node(node)
            self.sliced[scattered] = d
            return
        inputs = [a for a in node.all_input_nodes if a in self.sliced]
        if not inputs:
            return
        if target is ah_ops.tp_copy.default:
            x = node.args[0]
            with self.graph.inserting_before(node):
                full = self.call(ah_ops.sp_gather.default, (x, self.sliced[x], AXIS), like=node)
            node.replace_all_uses_with(full)
            self.graph.erase_node(node)
            return
        if op_name(node) == "aten.sym_size.int" and node.args[1] == self.sliced[node.args[0]]:
            with self.graph.inserting_after(node):
                length = self.graph.call_function(operator.mul, (node, self.tp))
            length.meta[AH_PASS] = "sequence_parallel"
            length.meta[VAL] = node.meta[VAL]
            node.replace_all_uses_with(length, delete_user_cb=lambda u: u is not length)
            return
        d = self._follows(node, inputs[0])
        if d is None:
            for a in inputs:
                node.replace_input_with(a, self.gathered(a, node))
            self.fake(node)
            return
        if op_name(node) == "aten.dropout.default":
            self._dropout(node, d)
            return
        self._local_operands(node, d)
        self._local_view_sizes(node, d)
        self.fake(node)
        self.sliced[node] = d

    def _follows(self, node: fx.Node, src: fx.Node) -> int | None:
        """The sequence dim of `node`'s output when it works token by token, else None."""
        d = self.sliced[src]
        name = op_name(node)
        if name in _NORMS:
            return d if d < src.meta[VAL].dim() - len(node.args[1]) else None
        if name in _REDUCTIONS:
            return reduced_dim(node, src.meta[VAL].dim(), d)
        moved = _follow(node, src, d)
        return moved if isinstance(moved, int) and moved == self.seq_dim(node) else None

    def _local_operands(self, node: fx.Node, d: int) -> None:
        """Replicated operands of a per-token op: parameters get f (summed gradients);
        tensors spanning the sequence are sliced; any other operand that needs a gradient
        (a value computed from parameters, e.g. Gemma's `1 + weight`) gets f too — its
        gradient on this rank covers only this slice of the sequence, and the
        tp_gather / tp_reduce it flows back to needs the sum (their contracts)."""
        out = node.meta[VAL]
        combines = op_name(node).startswith(_ELEMENTWISE_PREFIXES) or op_name(node) in _NORMS \
            or op_name(node) == "aten.cat.default"
        for a in node.all_input_nodes:
            if a in self.sliced or not isinstance(a.meta.get(VAL), torch.Tensor):
                continue
            if a.meta.get(AH_ROLE) == "param":
                node.replace_input_with(a, self.summed_grad(a, node))
                continue
            val = a.meta[VAL]
            dim = d - (out.dim() - val.dim()) if isinstance(out, torch.Tensor) else -1
            if combines and dim >= 0 and val.shape[dim] != 1:
                with self.graph.inserting_before(node):
                    piece = self.call(ah_ops.tp_split.default, (a, dim, AXIS), like=node)
                node.replace_input_with(a, piece)
            elif a in self.needs_grad:
                node.replace_input_with(a, self.summed_grad(a, node))

    def _local_view_sizes(self, node: fx.Node, d: int) -> None:
        """A view of a sliced value: its sequence size argument becomes the slice's."""
        if op_name(node) not in ("aten.view.default", "aten.reshape.default",
                                 "aten._unsafe_view.default", "aten.expand.default"):
            return
        shape = list(node.args[1])
        size = shape[d]
        if isinstance(size, int):
            if size != -1:
                shape[d] = size // self.tp
        else:
            with self.graph.inserting_before(node):
                local = self.graph.call_function(operator.floordiv, (size, self.tp))
            local.meta[AH_PASS] = "sequence_parallel"
            with self.mode:
                local.meta[VAL] = size.meta[VAL] // self.tp
            shape[d] = local
        node.args = (node.args[0], shape, *node.args[2:])

    def _dropout(self, node: fx.Node, d: int) -> None:
        """Dropout on the slice with eager's mask of the whole sequence."""
        x, p = node.args[0], node.args[1]
        train = node.args[2] if len(node.args) > 2 else True
        full = []
        with self.graph.inserting_before(node):
            for i, size in enumerate(x.meta[VAL].shape):
                if isinstance(size, torch.SymInt):
                    size = self.call(aten.sym_size.int, (x, i), like=node)
                    if i == d:
                        size = self.graph.call_function(operator.mul, (size, self.tp))
                        size.meta[AH_PASS] = "sequence_parallel"
                        size.meta[VAL] = size.args[0].meta[VAL] * self.tp
                full.append(size)
            both = self.call(ah_ops.sharded_dropout.default,
                             (x, p, train, full, d, self.rank, self.tp), like=node)
            out = self.call(operator.getitem, (both, 0), like=node)
        node.replace_all_uses_with(out)
        self.graph.erase_node(node)
        self.sliced[out] = d
