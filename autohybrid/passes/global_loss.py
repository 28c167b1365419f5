"""Pass: make the loss decomposable over the batch, so shards give eager's exact loss.

A loss such as `cross_entropy(reduction="mean", ignore_index=-100)` divides by a count
that depends on the whole batch. This pass rewrites the loss's final reduction to a sum
and adds a second output, the denominator eager divides by, so that for any split of the
batch into shards (data-parallel ranks, microbatches)

    loss(global batch) = Σ numerator(shard) / Σ denominator(shard).

The rewrite follows the loss back through scalar epilogues (multiplication or division by
a constant, views, dtype casts) to one of the reductions in `_MEAN_RULES`. `ctx.notes
["loss_kind"]` (`RankProgram.loss_kind`) becomes "mean" (numerator/denominator), "sum" (numerators add) or
"opaque" (a loss this pass does not understand: allowed only when the batch is not split).

The identity needs more than a splittable reduction: every value the reduction sums must
be per-sample. When the batch is split (dp > 1 or microbatches) that is proven over the
whole graph's dataflow (passes/batch_flow.py: per-token MoE dispatch, masks built from
the batch's shape and the like are proven; batch statistics, sorts or scans across the
batch, capacity-limited routing and whatever is not understood are refused, naming the
node), and buffers updated in place must not depend on the batch; nor may what the graph
does besides its values (passes/batch_effects.py: gradients scaled by batch counts,
running statistics, writes into parameters and buffers), refused naming the module.

A loss `main + term`, `term` without a batch dim (a model's regularizer, Hugging Face's
MoE load-balancing loss over the whole batch's routing), splits too: `main` as above, and
each shard's numerator becomes `numerator + denominator · term` (kind "mean"; "sum":
`numerator + term / shards`), so the shards' numerators add up to eager's loss and each
shard back-propagates the term weighted by its share of the denominator. Statistics of
the whole batch in the term (sums over the samples, the batch's size) are added over dp
first (passes/batch_stats.py); with several microbatches the runtime adds them up in a
forward without autograd before the step's (ops/batch_sum.WholeBatch).

A loss adding several reductions of per-sample values, each with its own denominator
(Hugging Face's question answering `(start_loss + end_loss) / 2`, BERT pre-training's
masked-LM + next-sentence losses, an auxiliary mean beside the cross-entropy), is read as
Σ scaleₖ · addendₖ through additions, subtractions and scaling by numbers (`_addends`).
The first reduction of per-sample values is `main`; every other one is rewritten to
sum / count like `main`'s (`_rewrite`), and those sums and counts become whole-batch
statistics of the term, added over the shards as above — the term is then that addend's
whole-batch value on every shard, as eager computes it.

Example::

    gm = global_loss(gm, ctx)
    numerator, denominator = gm(*args)          # per shard
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from ..errors import PlanError
from ..graph import (AH_PASS, AH_ROLE, VAL, op_name, output_node, placeholders, schema_args,
                     propagate_fake, source_line)
from .batch_effects import describe, split_batch_effect
from .batch_flow import REP, SPLIT, UNKNOWN, BatchFlow, Flow
from .batch_stats import globalize, loss_terms, reads_statistics, whole_batch_problem
from .manager import PassContext

aten = torch.ops.aten
_TERM_WEIGHT = torch.ops.autohybrid.term_weight.default

#: Scalar epilogue ops that commute with the sum over shards.
_EPILOGUE = {"aten.mul.Tensor", "aten.mul.Scalar", "aten.div.Tensor", "aten.div.Scalar",
             "aten.clone.default", "aten.alias.default", "aten.view.default",
             "aten.reshape.default", "aten._to_copy.default", "aten.to.dtype",
             "aten.squeeze.default", "aten.detach.default"}
#: Losses that take `reduction` (1 = mean, 2 = sum) and average over every element.
_ELEMENTWISE_LOSSES = {"aten.mse_loss.default", "aten.l1_loss.default",
                       "aten.smooth_l1_loss.default", "aten.huber_loss.default",
                       "aten.binary_cross_entropy.default",
                       "aten.binary_cross_entropy_with_logits.default",
                       "aten.soft_margin_loss.default", "aten.kl_div.default"}
#: Losses over class indices whose mean divides by the (weighted) count of kept targets.
_CLASS_LOSSES = {"aten.cross_entropy_loss.default", "aten.nll_loss.default",
                 "aten.nll_loss_nd.default", "aten.nll_loss2d.default"}
_MEAN, _SUM = 1, 2


def global_loss(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    out = output_node(gm)
    outputs = list(out.args[0])
    index = ctx.notes.get("loss_output_index", len(outputs) - 1)
    loss = outputs[index]
    stats = ctx.notes.get("stats_output_index")   # per-sample statistics (sample_stats.py)
    per_sample = outputs[stats] if stats is not None else None
    reduction = _find_reduction(loss)
    graph = gm.graph
    created: list[fx.Node] = []
    shards = ctx.plan.mesh.dp * ctx.plan.num_microbatches
    whole = term = flows = None   # loss = main + term, term the same on every shard
    whole_batch = False           # the term reads statistics of the whole batch
    if reduction is None and shards > 1:
        split = _main_and_terms(gm, loss)
        if split is not None:
            whole, loss, term = _rebuild(gm, split, created)
            outputs[index] = whole
            out.args = (tuple(outputs),)
            _erase_unused(graph, split.replaced)
            reduction = _find_reduction(loss)
            new, flows = _global_term(gm, ctx, term)
            created += new
            whole_batch = bool(new)
    mixed = reduction is not None and not _has_batch_dim(reduction.args[0], _batch_symbols(gm))
    if shards > 1 and reduction is not None and not mixed:
        flows = flows or _flows(gm, assume=True)
        _refuse_sample_mixing(gm, whole or loss, reduction, shards, per_sample, flows)
        # sizes of the batch the proof took as equal: checked on every batch (batch_spec)
        ctx.notes["batch_equalities"] = tuple(flows.sizes.assumed)
    if reduction is None or mixed:
        kind, denominator = "opaque", None
    else:
        position = whole.args.index(loss) if whole is not None else None
        kind, denominator, _ = _rewrite(gm, reduction, created)
        # the rewrite replaces the loss node when it is the mean
        loss = out.args[0][index] if whole is None else whole.args[position]
    if kind == "opaque":
        why = (f" (its final reduction {reduction.name!r} reduces {reduction.args[0].name!r}, "
               "which has no batch dimension left: samples were combined before it, e.g. "
               "by .mean(0))") if mixed else ""
        if shards > 1:
            raise PlanError(
                f"the loss ends in node {loss.name!r} ({op_name(loss)}, `{source_line(loss)}`), "
                f"which autohybrid cannot split over {shards} batch shards exactly{why}. Use a "
                "mean or sum reduction (F.cross_entropy, F.nll_loss, F.mse_loss, .mean(), .sum(),"
                " ...) of per-sample values, possibly scaled by a constant, or run with dp=1 and "
                "one microbatch")
    if denominator is None:
        with graph.inserting_before(out):
            denominator = graph.call_function(aten.scalar_tensor.default, (1.0,),
                                              {"dtype": loss.meta[VAL].dtype})
        created.append(denominator)
    if term is not None:   # each shard's numerator + its share of the term
        with graph.inserting_before(out):
            weight = denominator
            if kind == "mean" and whole_batch:   # (ops/batch_sum.py: under microbatches)
                weight = graph.call_function(_TERM_WEIGHT, (denominator,))
                created.append(weight)
            share = (graph.call_function(aten.mul.Tensor, (term, weight))
                     if kind == "mean" else
                     graph.call_function(aten.mul.Tensor, (term, 1.0 / shards)))
            loss = graph.call_function(aten.add.Tensor, (loss, share))
        created += [share, loss]
    for node in created:
        node.meta[AH_PASS] = "global_loss"
    propagate_fake(gm, created)
    outputs[index] = loss
    outputs.append(denominator)
    out.args = (tuple(outputs),)
    if whole is not None:   # (`loss += term` would add in place into the new numerator)
        graph.erase_node(whole)
    ctx.notes["loss_kind"] = kind
    return gm


@dataclass
class _Split:
    """The loss as `main_scale · main + Σ scale · addend` (`_main_and_terms`)."""

    main: fx.Node
    main_scale: float
    #: (addend, scale, reduction): `reduction` the addend's own reduction of per-sample
    #: values (rewritten to sum / count, its statistics added over the shards), or None:
    #: the addend has no batch dim (a regularizer, a whole-batch statistic)
    terms: list[tuple[fx.Node, float, fx.Node | None]]
    #: the additions and scalings the rebuilt loss replaces (erased once unused)
    replaced: list[fx.Node]


_SCALES = {"aten.mul.Tensor": False, "aten.mul.Scalar": False, "aten.div.Tensor": True,
           "aten.div.Scalar": True}


def _operands(node: fx.Node) -> list[tuple[fx.Node, float]] | None:
    """[(a, 1), (b, ±1)] for a tensor addition or subtraction (alpha 1), [(x, factor)] for
    a scaling of x by a number, else None."""
    if node.op != "call_function":
        return None
    terms = loss_terms(node)
    if terms is not None:
        return [(terms[0], 1.0), (terms[1], 1.0)]
    name = op_name(node)
    if name == "aten.sub.Tensor" and schema_args(node).get("alpha", 1) == 1 \
            and all(isinstance(a, fx.Node) for a in node.args[:2]) and len(node.args) == 2:
        return [(node.args[0], 1.0), (node.args[1], -1.0)]
    factor = node.args[1] if len(node.args) == 2 and not node.kwargs else None
    if name in _SCALES and isinstance(node.args[0], fx.Node) \
            and isinstance(factor, (int, float)) and not isinstance(factor, bool) and factor:
        return [(node.args[0], 1.0 / factor if _SCALES[name] else float(factor))]
    return None


def _addends(node: fx.Node, scale: float, inner: list[fx.Node]) -> list[tuple[fx.Node, float]]:
    """`node` as Σ scale · addend through tensor additions and subtractions and scalings
    by numbers of such a sum (`(a + b) / 2`); an addend is whatever is neither, or is
    read elsewhere too (a mean with its own scaling stays one addend). The additions and
    scalings passed through go to `inner`, readers after what they read."""
    operands = _operands(node)
    if operands is None:
        return [(node, scale)]
    if len(operands) == 1:     # a scaling: of a sum, distributed; of an addend, kept
        (x, factor), = operands
        below = _addends(x, scale * factor, inner) if len(x.users) == 1 else []
        if len(below) < 2:
            return [(node, scale)]
        inner.append(node)
        return below
    out = []
    for x, sign in operands:
        out += _addends(x, scale * sign, inner) if len(x.users) == 1 else [(x, scale * sign)]
    inner.append(node)
    return out


def _main_and_terms(gm: fx.GraphModule, loss: fx.Node) -> _Split | None:
    """The loss as main + terms (`_Split`) when it adds a reduction of per-sample values
    (`main`, the first such addend) to addends that are each either another reduction of
    per-sample values, or a 0-dim value without a batch dim (a regularizer, a
    load-balancing loss over the whole batch's routing); else None. Each reduction must
    be its own and read by its addend alone: rewriting it to a sum changes every reader."""
    if len(loss.users) != 1:
        return None
    inner: list[fx.Node] = []
    parts = _addends(loss, 1.0, inner)
    if len(parts) < 2:
        return None
    batch = _batch_symbols(gm)
    reductions: list[fx.Node | None] = []
    for node, _ in parts:
        reduction = _find_reduction(node)
        if reduction is not None and _has_batch_dim(reduction.args[0], batch):
            if not _read_once(node, reduction):
                return None
            reductions.append(reduction)
        elif isinstance(node.meta.get(VAL), torch.Tensor) and node.meta[VAL].dim() == 0 \
                and not _has_batch_dim(node, batch):
            reductions.append(None)
        else:
            return None
    batched = [r for r in reductions if r is not None]
    if not batched or len(set(batched)) != len(batched):
        return None
    first = reductions.index(batched[0])
    terms = [(node, scale, r) for k, ((node, scale), r) in enumerate(zip(parts, reductions))
             if k != first]
    return _Split(parts[first][0], parts[first][1], terms, inner)


def _read_once(addend: fx.Node, reduction: fx.Node) -> bool:
    """Whether every node from `reduction` up to `addend` (its scalar epilogue) has one
    reader: the next of them, and for `addend` the loss's addition."""
    node = addend
    while len(node.users) == 1:
        if node is reduction:
            return True
        node = node.args[0]
    return False


def _rebuild(gm: fx.GraphModule, split: _Split, created: list[fx.Node]
             ) -> tuple[fx.Node, fx.Node, fx.Node]:
    """(main' + term, main', term): each of `split`'s reductions of per-sample values
    among the terms rewritten to its sum over its count (`_rewrite`), every addend
    scaled, the terms added up (new nodes, fake values filled, in `created`)."""
    graph, out = gm.graph, output_node(gm)
    new: list[fx.Node] = []

    def call(op, *args) -> fx.Node:
        with graph.inserting_before(out):
            node = graph.call_function(op, args)
        new.append(node)
        return node

    pieces = []
    for node, scale, reduction in split.terms:
        if reduction is not None:
            kind, denominator, summed = _rewrite(gm, reduction, created)
            node = summed if node is reduction else node
            if kind == "mean":
                node = call(aten.div.Tensor, node, denominator)
        pieces.append(node if scale == 1.0 else call(aten.mul.Tensor, node, scale))
    term = pieces[0]
    for piece in pieces[1:]:
        term = call(aten.add.Tensor, term, piece)
    main = split.main if split.main_scale == 1.0 else call(aten.mul.Tensor, split.main,
                                                          split.main_scale)
    whole = call(aten.add.Tensor, main, term)
    propagate_fake(gm, [*created, *new])
    created += new
    return whole, main, term


def _erase_unused(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """Erase `nodes` (a dead chain, readers before what they read) that nothing reads."""
    for node in reversed(nodes):   # `_addends` lists a node after what it reads
        if not node.users:
            graph.erase_node(node)


def whole_batch_term(gm: fx.GraphModule, loss_index: int) -> bool:
    """Whether the loss (output `loss_index`) is main + terms computed from statistics of
    the whole batch, which global_loss adds up over the shards (the planner prices the
    forward that adds them up under microbatches: runtime/whole_batch.py): a second
    reduction of per-sample values (its sum and count), or a term reading sums over the
    samples."""
    loss = output_node(gm).args[0][loss_index]
    if _find_reduction(loss) is not None:
        return False
    split = _main_and_terms(gm, loss)
    if split is None:
        return False
    if any(reduction is not None for _, _, reduction in split.terms):
        return True
    flows = _flows(gm)
    return any(reads_statistics(gm, node, flows) for node, _, _ in split.terms)


def _global_term(gm: fx.GraphModule, ctx: PassContext, term: fx.Node
                 ) -> tuple[list[fx.Node], BatchFlow]:
    """Make `term` the whole batch's value on every shard (batch_stats.globalize), or
    raise PlanError saying why it cannot be; the nodes created (fake values filled) and
    the flows of the graph with them (the sample-mixing check reads them again)."""
    flows = _flows(gm, assume=True)
    created = globalize(gm, term, flows, "dp")
    propagate_fake(gm, created)
    where = f"the loss term {term.name!r} (`{source_line(term)}`)"
    if created and ctx.plan.num_microbatches > 1:
        problem = whole_batch_problem(gm, ctx.plan)
        if problem is not None:
            raise PlanError(
                f"{where} is computed from statistics of the whole batch (sums over every "
                f"sample, e.g. a load-balancing loss over the batch's routing), which the "
                f"runtime adds up over the {ctx.plan.num_microbatches} microbatches in a "
                f"forward before the step's; {problem}")
    flows = _flows(gm, assume=True) if created else flows   # (new nodes: no flows yet)
    flow = flows.flow(term)
    if flow.kind != REP:
        culprit = flow.culprit if flow.kind == UNKNOWN else term
        why = flow.why if flow.kind == UNKNOWN else f"it is {flow.kind}"
        raise PlanError(
            f"{where} is added to the loss but not proven the whole batch's value on every "
            f"shard: node {culprit.name!r} ({op_name(culprit)}, `{source_line(culprit)}`): "
            f"{why}. What splits: a mean or sum of per-sample values (a second loss, an "
            "auxiliary loss per token), a value without a batch dim (a regularizer), sums "
            "over the samples combined in any way (a load-balancing loss); otherwise run "
            "with dp=1 and one microbatch")
    return created, flows


def _refuse_sample_mixing(gm: fx.GraphModule, loss: fx.Node, reduction: fx.Node,
                          shards: int, per_sample: fx.Node | None = None,
                          flows: BatchFlow | None = None) -> None:
    """PlanError unless every value the loss's final reduction reads is per-sample.

    Shards add up to the whole batch's loss only if each sample's contribution depends
    on that sample alone: the values the final reduction sums must be, for any split of
    the batch, the concatenation of the shards' values (`x - x.mean(0)`, batch
    statistics, a sort across the batch that changes values, capacity-limited routing
    break that). passes/batch_flow.py proves it over the graph's dataflow (per-token MoE
    dispatch and masks built from the batch's shape are proven; what it cannot prove is
    refused); buffers updated in place must not depend on the batch either (training
    BatchNorm gets global statistics from sync_batch_norm). `flows`: the graph's, when
    the caller has them.
    """
    flows = flows or _flows(gm)
    effect = split_batch_effect(gm, flows)
    if effect is not None:
        raise PlanError(describe(effect, shards))
    problem = sample_mixing(gm, loss, reduction, flows, per_sample)
    if problem is None:
        return
    node, why = problem
    raise PlanError(
        f"node {node.name!r} ({op_name(node)}, `{source_line(node)}`) combines the samples "
        f"of a batch before the loss's final reduction, as far as autohybrid can prove "
        f"({why}), so {shards} batch shards would not give eager's result on the whole "
        "batch. Compute per-sample values and reduce them once at the end of the loss, or "
        "run with dp=1 and one microbatch")


def _flows(gm: fx.GraphModule, assume: bool = False) -> BatchFlow:
    """The graph's batch flows; `assume`: proofs may rest on per-sample sizes of the
    batch being equal (`flows.sizes.assumed`, checked on every batch by the runtime)."""
    from .sync_batch_norm import training_batch_norms

    return BatchFlow(gm, _batch_symbols(gm), training_batch_norms(gm), assume=assume)


def sample_mixing(gm: fx.GraphModule, loss: fx.Node, reduction: fx.Node,
                  flows: BatchFlow | None = None, per_sample: fx.Node | None = None
                  ) -> tuple[fx.Node, str] | None:
    """(node, why) where per-sample dataflow into the loss's final `reduction` (or into
    a buffer's new value, or into another output) is not proven, else None. The output
    `per_sample` (per-sample statistics) must be one row per sample along dim 0, in
    batch order: the shards' rows, joined, are the whole batch's."""
    flows = flows or _flows(gm)
    name = op_name(reduction)
    if name in _ELEMENTWISE_LOSSES or name in _CLASS_LOSSES:
        flow = flows.per_element_loss(reduction)
    else:
        flow = flows.flow(schema_args(reduction)["self"])
    if flow.kind == UNKNOWN:
        return flow.culprit, flow.why
    if not flow.batched or flow.ptr is not None:
        return reduction, (f"the values it reduces are {flow.kind}, not one per sample"
                           if flow.ptr is None else "it reduces sample indices")
    for op, buffer, new in flows.mutations:
        if isinstance(new, Flow) and new.kind == UNKNOWN:
            return new.culprit, f"{new.why}; it updates {buffer.name!r} in place"
        if not isinstance(new, Flow) or new.kind != REP:
            return op, f"it updates {buffer.name!r} in place with a value that depends on the batch"
    out = output_node(gm)
    for value in out.args[0]:
        if isinstance(value, fx.Node) and value.op != "placeholder" and \
                isinstance(value.meta.get(VAL), torch.Tensor) and value is not loss:
            f = flows.flow(value)
            if value is per_sample and f.kind == SPLIT and f.dim == 0 and f.outer == 1 \
                    and f.ptr is None:
                continue
            if value is per_sample and f.kind != UNKNOWN:
                return value, ("the per-sample statistics it outputs are not one row per "
                               "sample in batch order")
            if f.kind != REP:
                return (f.culprit if f.kind == UNKNOWN else value), (
                    f.why if f.kind == UNKNOWN else
                    "the graph outputs (a buffer's new value) a value that depends on the "
                    "batch")
    return None


def _batch_symbols(gm: fx.GraphModule) -> set:
    """The symbols in dim 0 of the model inputs and targets: the batch."""
    out: set = set()
    for node in placeholders(gm):
        val = node.meta.get(VAL)
        if node.meta.get(AH_ROLE) in ("input", "target") and isinstance(val, torch.Tensor) \
                and val.dim() > 0 and isinstance(val.shape[0], torch.SymInt):
            out |= val.shape[0].node.expr.free_symbols
    return out


def _has_batch_dim(node: fx.Node, batch: set) -> bool:
    """Whether `node`'s value still has a dim of the batch (True when that is unknown).

    A final sum or mean splits over shards only if it reduces per-sample values; a tensor
    without a batch dim (`x.mean(0)`) already combines samples of one shard.
    """
    val = node.meta.get(VAL)
    if not batch or not isinstance(val, torch.Tensor):
        return True
    return any(isinstance(size, torch.SymInt) and size.node.expr.free_symbols & batch
               for size in val.shape)


def _find_reduction(loss: fx.Node) -> fx.Node | None:
    """The reduction the loss ends in, seen through scalar epilogues; None if unknown."""
    node = loss
    while node.op == "call_function":
        name = op_name(node)
        if name.startswith(("aten.mul", "aten.div")) and name in _EPILOGUE:
            if isinstance(node.args[1], fx.Node):  # scaled by a tensor: may depend on data
                return None
            node = node.args[0]
        elif name in _EPILOGUE:
            node = node.args[0]
        else:
            return node if _is_reduction(node) else None
    return None


def _set_args(node: fx.Node, kwargs: dict) -> None:
    node.args = tuple(kwargs[a.name] for a in node.target._schema.arguments
                      if not a.kwarg_only and a.name in kwargs)
    node.kwargs = {a.name: kwargs[a.name] for a in node.target._schema.arguments
                   if a.kwarg_only and a.name in kwargs}


def _is_reduction(node: fx.Node) -> bool:
    name = op_name(node)
    if name in ("aten.mean.default", "aten.sum.default"):
        return True
    if name in ("aten.mean.dim", "aten.sum.dim_IntList"):
        kw = schema_args(node)
        dims = kw.get("dim")
        rank = kw["self"].meta[VAL].dim()
        return dims is None or len(dims) == 0 or sorted(d % rank for d in dims) == list(range(rank))
    if name in _ELEMENTWISE_LOSSES or name in _CLASS_LOSSES:
        return schema_args(node).get("reduction", _MEAN) in (_MEAN, _SUM)
    return False


def _rewrite(gm: fx.GraphModule, node: fx.Node, created: list[fx.Node]
             ) -> tuple[str, fx.Node | None, fx.Node]:
    """Turn the mean reduction `node` into a sum; return the kind, the denominator and
    the sum (`node`, or the node replacing it)."""
    name, graph = op_name(node), gm.graph
    kw = schema_args(node)
    if name in ("aten.sum.default", "aten.sum.dim_IntList"):
        return "sum", None, node
    if name in _ELEMENTWISE_LOSSES or name in _CLASS_LOSSES:
        if kw.get("reduction", _MEAN) == _SUM:
            return "sum", None, node
        kw["reduction"] = _SUM
        _set_args(node, kw)
        node.meta[AH_PASS] = "global_loss"
    else:  # mean over every element
        with graph.inserting_before(node):
            summed = graph.call_function(aten.sum.default, (kw["self"],))
        summed.meta.update(node.meta)
        node.replace_all_uses_with(summed)
        graph.erase_node(node)
        created.append(summed)
        node = summed
    with graph.inserting_before(output_node(gm)):
        if name in _CLASS_LOSSES:
            denominator = _class_count(graph, kw, node.meta[VAL].dtype, created)
        else:
            first = kw["self"]
            count = graph.call_function(aten.sym_numel.default, (first,))
            denominator = graph.call_function(aten.scalar_tensor.default, (count,),
                                              {"dtype": node.meta[VAL].dtype})
            created += [count, denominator]
    return "mean", denominator, node


def _class_count(graph: fx.Graph, kw: dict, dtype: torch.dtype,
                 created: list[fx.Node]) -> fx.Node:
    """Σ weight[target] over targets != ignore_index (or their number), as eager divides."""
    target = kw["target"]
    weight, ignore = kw.get("weight"), kw.get("ignore_index", -100)

    def call(op, *args, **kwargs) -> fx.Node:
        node = graph.call_function(op, args, kwargs)
        created.append(node)
        return node

    if target.meta[VAL].is_floating_point():  # class probabilities: mean over samples
        ones = call(aten.ones_like.default, call(aten.select.int, target, 1, 0), dtype=dtype)
        return call(aten.sum.default, ones)
    keep = call(aten.ne.Scalar, target, ignore)
    if weight is None:
        return call(aten.sum.default, keep, dtype=dtype)
    safe = call(aten.where.ScalarOther, keep, target, 0)
    picked = call(aten.index.Tensor, weight, [safe])
    kept = call(aten.mul.Tensor, picked, keep)
    return call(aten.sum.default, kept)
