"""What a training graph does besides computing its values that a split batch would change.

passes/batch_flow.py proves each value the loss reads per-sample, which is what a split
batch needs of the values. Some ops also act outside their output value, through the
whole batch they see, and a shard (a data-parallel rank's slice, a microbatch) sees
only its own samples:

- gradients scaled by a statistic of the batch: `nn.Embedding(scale_grad_by_freq=True)`
  (and `nn.EmbeddingBag`) divide each row's gradient by how often its id occurs in the
  batch; a shard counts only its own ids;
- running statistics kept by an op whose schema does not declare the write:
  `aten.instance_norm` with `track_running_stats=True` averages its statistics over the
  batch's instances (training BatchNorm is handled apart: sync_batch_norm over dp, and
  microbatching it is refused by the planner);
- writes into a parameter or buffer from values of the batch: `nn.Embedding(max_norm=…)`
  renormalizes in place the rows the batch looks up (`aten.embedding_renorm_`), a buffer
  counting ids with `index_put_`, a running mean updated with `add_`, also inside a
  `torch.no_grad()` region: each shard would write its own.

`split_batch_effect` finds the first of these that depends on the batch and says what it
does and how to fix it; global_loss refuses such a plan when it splits the batch, so the
planner (runtime/dry_run.PassTrial) goes on to a plan that keeps the batch whole.
Writes of batch-independent values (a counter's `add_(1)`) are accepted here; a
`no_grad` region that writes in place is refused by batch_flow whatever it writes (this
module only names the module and the fix when what it writes depends on the batch).
It only reads the graph and the flows; it never changes either.

Example::

    flows = BatchFlow(gm, batch_symbols)
    effect = split_batch_effect(gm, flows)   # None, or (node, what it does, the fix)
"""
from __future__ import annotations

from typing import Iterator, NamedTuple

import torch
import torch.fx as fx

from ..capture import _WRAPPER_PREFIX
from ..graph import AH_BUFFER, AH_PARAM, AH_ROLE, module_path, op_name, schema_args
from .batch_flow import REP, BatchFlow, Flow

_REGIONS = ("wrap_with_set_grad_enabled", "wrap_with_autocast")
_KEEP_WHOLE = ("keep the batch whole: pin dp=1 and one microbatch "
               "(ah.Constraints(dp=1, num_microbatches=1); the planner's own choice does)")


class Effect(NamedTuple):
    """An op whose effect beyond its value depends on the batch."""

    node: fx.Node   # the op (inside a region: the op in the region's graph)
    module: str     # the module path that called it ("" at the top)
    what: str       # what it does with the batch
    fix: str        # what the user can change


def split_batch_effect(gm: fx.GraphModule, flows: BatchFlow) -> Effect | None:
    """The first op of `gm` whose gradient scaling or in-place write depends on the batch
    (see the module docstring), or None."""
    for node in gm.graph.nodes:
        effect = _scaled_gradient(node, flows) or _running_statistics(node, flows)
        if effect is not None:
            return effect
    for op, written, new in _writes(gm, flows):
        if isinstance(new, Flow) and new.kind == REP:
            continue
        role = written.meta.get(AH_ROLE)
        if role not in ("param", "buffer"):
            continue
        state = written.meta.get(AH_PARAM if role == "param" else AH_BUFFER, written.name)
        role = "parameter" if role == "param" else role
        if op_name(op) == "aten.embedding_renorm_.default":
            return Effect(op, _module(op), f"renormalizes in place (max_norm) the rows of "
                          f"{role} {state!r} that the batch looks up; each shard would "
                          "renormalize only the rows its own samples read",
                          "build the embedding without max_norm (renormalize the table "
                          "outside the model, e.g. after each optimizer step)")
        return Effect(op, _module(op), f"writes in place into {role} {state!r} a value that "
                      "depends on the batch; each shard would write its own",
                      "move the update outside the model (compute it from the whole batch "
                      "after the step)")
    return None


def describe(effect: Effect, shards: int) -> str:
    """The refusal message for a plan that splits the batch into `shards` shards."""
    node = effect.node
    where = f"module {effect.module!r}" if effect.module else "the model's top module"
    return (f"{where} (node {node.name!r}, {op_name(node)}) {effect.what}, so {shards} "
            f"batch shards (data-parallel ranks × microbatches) would not train as eager "
            f"does on the whole batch. Either {effect.fix}, or {_KEEP_WHOLE}")


def _module(node: fx.Node) -> str:
    return module_path(node).removeprefix(_WRAPPER_PREFIX)


def _scaled_gradient(node: fx.Node, flows: BatchFlow) -> Effect | None:
    name = op_name(node)
    if name == "aten.embedding.default" or name.startswith("aten.embedding_bag."):
        kw = schema_args(node)
        ids = kw.get("indices")
        if kw.get("scale_grad_by_freq") and flows.flow(ids).kind != REP:
            return Effect(node, _module(node), "scales each row's gradient by how often its "
                          "id occurs in the batch (scale_grad_by_freq=True); each shard "
                          "would count only its own ids", "build it with "
                          "scale_grad_by_freq=False")
    return None


def updates_running_statistics(node: fx.Node) -> bool:
    """Whether `node` writes running statistics its schema does not declare as written
    (`aten.instance_norm` in training with `track_running_stats=True`; training
    `aten.batch_norm` is left to sync_batch_norm and the planner)."""
    if op_name(node) != "aten.instance_norm.default":
        return False
    kw = schema_args(node)
    tracked = kw.get("running_mean") is not None or kw.get("running_var") is not None
    return bool(tracked and kw.get("use_input_stats"))


def _running_statistics(node: fx.Node, flows: BatchFlow) -> Effect | None:
    if updates_running_statistics(node) and \
            flows.flow(schema_args(node)["input"]).kind != REP:
        return Effect(node, _module(node), "updates its running statistics with the mean "
                      "over the batch's instances (track_running_stats=True in training); "
                      "each shard would average its own", "build it with "
                      "track_running_stats=False")
    return None


def _region(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.HigherOrderOperator) and \
        node.target.name() in _REGIONS


def _writes(gm: fx.GraphModule, flows: BatchFlow) -> Iterator[tuple[fx.Node, fx.Node, object]]:
    """(op, the graph input it writes, the flow written) for every in-place write into a
    graph input, those inside `no_grad` / autocast regions included."""
    yield from ((op, w, new) for op, w, new in flows.mutations if not _region(op))
    for node in gm.graph.nodes:
        if not _region(node):
            continue
        index = next((i for i, a in enumerate(node.args)
                      if isinstance(a, fx.Node) and a.op == "get_attr"), None)
        if index is None:
            continue
        region = gm.get_submodule(node.args[index].target)
        args = list(node.args[index + 1:])
        inner = BatchFlow(region, flows.sizes.batch, flows.per_sample,
                          inputs=[flows.flow(a) for a in args])
        inputs = [n for n in region.graph.nodes if n.op == "placeholder"]
        for op, written, new in inner.mutations:
            outer = args[inputs.index(written)] if written in inputs else None
            if isinstance(outer, fx.Node) and outer.op == "placeholder":
                yield op, outer, new
