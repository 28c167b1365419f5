"""Runs this rank's pipeline stages with torch.distributed.pipelining's schedules.

The pipeline_split pass cut the rank-local graph into `StageGraph`s; this module wraps
the ones this rank runs (Plan.stage_ranks: one, or v looped, or two V-shaped) as
`PipelineStage`s and drives them with the Plan's schedule:

    gpipe → ScheduleGPipe              1f1b → Schedule1F1B
    interleaved → ScheduleInterleaved1F1B   looped-bfs → ScheduleLoopedBFS
    zero-bubble → ScheduleInterleavedZeroBubble
    zbv → ScheduleZBVZeroBubble        dualpipev → ScheduleDualPipeV

Stages are built in torch's static mode: their input and output shapes per microbatch
come from the split's symbolic shapes evaluated at the batch's sizes, so nothing runs to
infer them (a shape inference run would draw random numbers and issue tp collectives).
They are rebuilt when a batch brings new microbatch shapes.

The loss: the last stage returns the loss numerator and denominator of its microbatch
(passes/global_loss.py). The schedule back-propagates the numerator unscaled
(scale_grads=False); after the step the numerator and denominator totals are summed over
the pp group (only the last stage has them) and the dp group, the gradients of parameters
that several stages read (tied embedding and output weights) are summed over the ranks
holding those stages, and the dp reducer sums the gradients over dp and scales them by
1 / Σ denominators: exactly the gradients of eager's loss on the whole batch.

The dp gradient buckets are launched while the schedule runs (runtime/reducer.py,
`arm_pipeline`): the stages are `_Stage`s, which count this rank's backward steps
(`backward_done`, what the reducer's launch events record) and report each
weight-gradient step of the zero-bubble schedules to `grad_listener` (the reducer),
since torch accumulates those gradients without firing the parameters' hooks.

Two gaps of torch's split backward (input step, then weight step; the zero-bubble
schedules) are closed in `_Stage`: a stage output computed from parameters alone (no
received activation that needs a gradient upstream: BART's decoder embeddings in a stage
that forwards the encoder's output) would lose its parameters' gradients on every stage
but the first (`_param_only_grads` adds them in the input step), and the input gradients
it sends back are made contiguous (autograd.grad returns them in the layout the first
op's backward made; gloo and NCCL send contiguous tensors only).
"""
from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Any, Sequence

import sympy
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import pipelining as tpp

from ..capture import CapturedGraph
from ..errors import AutohybridError, PlanError
from ..features import PIPELINE_SCHEDULES, check_pipelining
from ..graph import VAL
from ..ops.zero import release_gathered
from ..plan import Plan
from ..program import PipelineSplit, StageGraph
from . import whole_batch
from .split_backward import split_is_safe
from .timeouts import new_group

log = logging.getLogger(__name__)

#: schedule → its class (None where this torch lacks it: features.check_pipelining says so)
SCHEDULE_CLASSES = {name: getattr(tpp, cls, None) for name, cls in PIPELINE_SCHEDULES.items()}
_MULTI_STAGE = ("interleaved", "looped-bfs", "zero-bubble", "zbv", "dualpipev")


class StageModule(nn.Module):
    """One stage graph as the nn.Module a PipelineStage drives.

    forward(*received, **batch): `received` are the previous stage's values (the first
    stage: the model's inputs), `batch` the microbatch's inputs and targets as `b0, b1, …`.
    Its parameters are registered, so `parameters()` (used by the zero-bubble schedules'
    split backward) yields exactly what the stage reads.
    """

    def __init__(self, stage: StageGraph, state_args: Sequence[Any], batch_base: int,
                 is_last: bool, program: CapturedGraph, release: bool = False):
        super().__init__()
        self.graph_module = stage.gm
        self.program = program  # for its autocast (mixed precision)
        self.is_last = is_last
        self.release = release  # ZeRO-3: gathered parameters are not kept for backward
        self._local: list[tuple[str, Any]] = []
        for i in stage.local_placeholders:
            if i < batch_base:
                value = state_args[i]
                if isinstance(value, nn.Parameter):
                    name = f"p{len(self._parameters)}"
                    if not any(value is p for p in self._parameters.values()):
                        self.register_parameter(name, value)
                self._local.append(("state", value))
            else:
                self._local.append(("batch", f"b{i - batch_base}"))

    def forward(self, *received: torch.Tensor, **batch: torch.Tensor) -> tuple:
        args = [*received] + [v if kind == "state" else batch[v] for kind, v in self._local]
        with release_gathered(self.release and torch.is_grad_enabled()), \
                self.program.autocast_context(args):
            outs = tuple(self.graph_module(*args))
        if self.is_last:
            return outs
        # sent tensors must be contiguous (the receive buffers are) and not views (the
        # zero-bubble backward detaches stage outputs in place); a value forwarded to a
        # later stage is a new tensor, not this stage's input
        received_ids = {id(t) for t in received}
        return tuple(t.clone(memory_format=torch.contiguous_format)
                     if t._is_view() or id(t) in received_ids else t.contiguous() for t in outs)


class _Stage(tpp.PipelineStage):
    """A PipelineStage that counts its runner's backward steps and reports its
    weight-gradient steps (zero-bubble schedules) to the runner's `grad_listener`.

    torch's weight step (`backward_weight_one_chunk`) accumulates with
    `torch.autograd.grad` and `weight.grad += dw` (pipelining/_backward.py,
    `stage_backward_weight`) on every stage but the first, so no post-accumulate-grad hook
    fires; on the first stage it runs the full backward, which fires them. The listener's
    `weight_step(params)` mutes the hooks inside and reports every parameter of the stage
    once after the step, the same way in both cases.

    A stage whose graph torch's split backward would get wrong (`_split_safe`,
    runtime/split_backward.py: a parameter group's weight step running through another
    group's nodes) runs its backward whole in the input step instead and leaves the
    weight step no parameter group."""

    def __init__(self, *args: Any, runner: "PipelineRunner", **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._runner = runner
        self._safe: bool | None = None   # `_split_safe(self)`, once known

    def backward_one_chunk(self, *args: Any, **kwargs: Any):
        out = super().backward_one_chunk(*args, **kwargs)
        self._runner.backward_done += 1
        return out

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict,
                                   last_backward: bool = False, *args: Any, **kwargs: Any):
        if backward_type == "input" and not _split_safe(self, bwd_kwargs):
            # torch's weight step would run nodes twice (runtime/split_backward.py): the
            # whole backward now, as 1F1B runs it, and no parameter group left for later
            outputs, output_grads = bwd_kwargs["stage_output"], bwd_kwargs["output_grads"]
            if output_grads is None and isinstance(outputs, tuple) and len(outputs) == 1:
                outputs = outputs[0]   # the last stage's loss (torch's full step takes it bare)
            grads, _ = super().backward_maybe_with_nosync(
                "full", {**bwd_kwargs, "stage_output": outputs}, last_backward, *args, **kwargs)
            return tuple(g.contiguous() if isinstance(g, torch.Tensor) else g
                         for g in grads), []
        if backward_type == "input":  # the split backward's input step (zero-bubble)
            _param_only_grads(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"],
                              bwd_kwargs["input_values"], list(self.submod.parameters()))
        grads, param_groups = super().backward_maybe_with_nosync(
            backward_type, bwd_kwargs, last_backward, *args, **kwargs)
        # the input gradients go to the previous stage as they are, and the send needs them
        # contiguous: the input step's come from autograd.grad in whatever layout the
        # first op's backward made (nn.MultiheadAttention's cross-attention: the grad of
        # the encoder output `memory` arrives transposed), not through AccumulateGrad
        grads = tuple(g.contiguous() if isinstance(g, torch.Tensor) else g for g in grads)
        return grads, param_groups

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any):
        listener = self._runner.grad_listener
        with (listener.weight_step(self.submod.parameters()) if listener is not None
              else nullcontext()):
            out = super().backward_weight_one_chunk(*args, **kwargs)
            self._runner.backward_done += 1
        return out


def _split_safe(stage: _Stage, bwd_kwargs: dict) -> bool:
    """Whether torch's split backward is right for `stage`'s graph (decided at its first
    input step; the graph is the same for every microbatch)."""
    if stage._safe is None:
        stage._safe = split_is_safe(bwd_kwargs["stage_output"], bwd_kwargs["input_values"],
                                    stage.submod.parameters())
        if not stage._safe:
            log.info("stage %d: a parameter's gradient paths run through other parameters' "
                     "layers; its backward runs whole in the input step "
                     "(runtime/split_backward.py)", stage.stage_index)
    return stage._safe


def _param_only_grads(outputs: Sequence[Any], output_grads: Sequence[Any] | None,
                      inputs: Sequence[Any], params: list[nn.Parameter]) -> None:
    """Accumulate the parameter gradients that flow through stage outputs computed from
    parameters (and the batch) alone, without a received activation that needs a gradient
    upstream: BART's decoder embeddings (tied weights, learned positions) in a stage that
    also forwards the encoder's output.

    torch's split backward (`stage_backward_input` / `stage_backward_weight`, the
    zero-bubble schedules) computes a parameter's gradient in the weight step from the
    gradients saved at the nodes where its paths meet the stage inputs' (pipelining/
    _backward.py, `get_param_groups`); a path reaching an output without meeting them
    has no such node, and its gradient was silently dropped (torch works around it for
    the first stage only, by a full backward). Such an output's graph joins no input's,
    so no node of it is in a saved parameter group: its gradients are computed here, in
    the input step, once, before the graph is freed."""
    from torch.distributed.pipelining._backward import (
        _get_grad_fn_or_grad_acc, construct_reverse_graph, reverse_closure)

    valid = []
    for i, out in enumerate(outputs):
        if not isinstance(out, torch.Tensor) or (not out.requires_grad and out.grad_fn is None):
            continue
        grad = torch.ones_like(out) if output_grads is None else output_grads[i]
        fn = _get_grad_fn_or_grad_acc(out)
        if grad is not None and fn is not None:
            valid.append((out, grad, fn))
    if not valid:
        return
    reverse = construct_reverse_graph([fn for _, _, fn in valid])
    roots = [fn for fn in (_get_grad_fn_or_grad_acc(t) for t in inputs
                           if isinstance(t, torch.Tensor) and t.requires_grad)
             if fn is not None]
    reached, _ = reverse_closure(roots, set(), reverse)
    alone = [(out, grad) for out, grad, fn in valid if fn not in reached]
    wanted = [p for p in params if p.requires_grad]
    if not alone or not wanted:
        return
    grads = torch.autograd.grad([o for o, _ in alone], wanted, [g for _, g in alone],
                                retain_graph=True, allow_unused=True)
    with torch.no_grad():
        for param, grad in zip(wanted, grads):
            if grad is None:
                continue
            if param.grad is None:
                param.grad = grad
            else:
                param.grad += grad


class PipelineRunner:
    """This rank's stages and the schedule over them (one per microbatch shape)."""

    def __init__(self, plan: Plan, split: PipelineSplit, program: CapturedGraph,
                 state: dict[str, torch.Tensor], pp_rank: int,
                 pp_group: dist.ProcessGroup | None, device: torch.device,
                 shared_groups: dict[str, dist.ProcessGroup] | None = None):
        check_pipelining(plan.schedule)   # torch's private pipelining members we use
        if program.mutated_buffers:
            raise PlanError(
                "pipeline parallelism cannot run a model whose forward updates buffers ("
                + ", ".join(f for _, f in program.mutated_buffers[:3]) + ", e.g. BatchNorm "
                "running statistics): the stages would each update their own copy; use pp=1")
        self.plan, self.split, self.program, self.state = plan, split, program, state
        self.shared_groups = shared_groups or {}
        self.pp_rank, self.pp_group, self.device = pp_rank, pp_group, device
        ranks = plan.stage_ranks()
        self.stage_ids = [s for s, r in enumerate(ranks) if r == pp_rank]
        state_args = program.flat_args(state, (), ())
        self.batch_base = len(state_args)
        last = plan.num_stages - 1
        release = plan.zero == 3 and plan.mesh.dp > 1
        self.modules = {s: StageModule(split.stages[s], state_args, self.batch_base, s == last,
                                       program, release)
                        for s in self.stage_ids}
        self.has_last = last in self.stage_ids
        self._schedules: dict[tuple, Any] = {}
        self._numerators: list[torch.Tensor] = []
        self._denominators: list[torch.Tensor] = []
        self._loss_scale: float | None = None
        self._outputs = (program.user_outputs[0], program.user_outputs[-1])
        #: the graph output of per-sample statistics (sample_stats.py), if it has one,
        #: and each microbatch's, on the last stage, in microbatch order
        self._stats_output = (program.user_outputs[1] if len(program.user_outputs) == 3
                              else None)
        self._stats: list[torch.Tensor] = []
        #: dtype of the loss the last stage computes (known on every rank)
        self.loss_dtype = split.stages[last].sent_vals[self._outputs[0]].dtype
        #: backward steps (full, input- or weight-gradient) run in the current step
        self.backward_done = 0
        #: told of weight-gradient steps (`weight_step(params)`: the dp reducer) or None
        self.grad_listener: Any = None
        #: a loss term over whole-batch sums, added up before the step (whole_batch.py);
        #: decided from every stage, so every rank runs the forward that adds them
        self.whole_batch = plan.num_microbatches > 1 and whole_batch.has_batch_sums(
            [stage.gm for stage in split.stages])

    def sum_shared_grads(self, holders: dict[str, torch.Tensor] | None = None) -> None:
        """Sum the gradients of parameters read by stages on several pp ranks (tied
        embedding and output weights) over those ranks: each holds its stages' part.
        `holders`: where the gradients are when not on the parameters (ZeRO shards)."""
        for name, group in self.shared_groups.items():
            param = (holders or self.state)[name]
            if not param.requires_grad:  # frozen: no gradient, as in eager (on every rank)
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            elif not param.grad.is_contiguous():
                # a zero-bubble weight step assigns autograd's result as it comes (a head
                # reading `weight.t()` leaves it transposed) while the embedding's stage
                # has it row-major; the all-reduce sums storage, not indices
                param.grad = param.grad.contiguous()
            dist.all_reduce(param.grad, group=group)

    # ------------------------------------------------------------------ schedules
    def _loss(self, output: tuple, target: Any) -> torch.Tensor:
        numerator, denominator = (output[i] for i in self._outputs)
        if self._stats_output is not None:
            self._stats.append(output[self._stats_output].detach())
        self._numerators.append(numerator.detach())
        self._denominators.append(denominator.detach())
        return numerator if self._loss_scale is None else numerator * self._loss_scale

    def schedule_key(self, inputs: Sequence[torch.Tensor],
                     targets: Sequence[torch.Tensor]) -> tuple:
        """What names the schedule a batch runs under (its microbatch shapes), the same on
        every dp rank."""
        return self._key(self._microbatches([*inputs, *targets]))

    @staticmethod
    def _key(micro: list[list[torch.Tensor]]) -> tuple:
        return tuple((tuple(t.shape), t.dtype) for t in micro[0])

    def _schedule(self, micro: list[list[torch.Tensor]]):
        key = self._key(micro)
        if key not in self._schedules:
            self._schedules[key] = self._build(micro[0])
        return self._schedules[key]

    def _build(self, first: list[torch.Tensor]):
        env = _symbol_values(self.program, self.split, first)
        stages = []
        for s in self.stage_ids:
            graph = self.split.stages[s]
            if s == 0:
                inputs = tuple(first[: len(self.split.input_placeholders)])
            else:
                previous = self.split.stages[s - 1]
                inputs = _metas(graph.received_vals, previous.sent_requires_grad, env)
            outputs = _metas(graph.sent_vals, graph.sent_requires_grad, env)
            stages.append(_Stage(
                self.modules[s], s, self.plan.num_stages, self.device, input_args=inputs,
                output_args=outputs, group=self.pp_group, runner=self))
        cls = SCHEDULE_CLASSES[self.plan.schedule]
        m = self.plan.num_microbatches
        if self.plan.schedule in _MULTI_STAGE:
            return cls(stages, n_microbatches=m, loss_fn=self._loss, scale_grads=False)
        return cls(stages[0], n_microbatches=m, loss_fn=self._loss, scale_grads=False)

    # ------------------------------------------------------------------ running
    def forward_backward(self, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor],
                         loss_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One schedule step on this rank's batch; (Σ numerators, Σ denominators) of the
        microbatches on the last stage's rank, zeros elsewhere. `loss_scale` multiplies
        what is back-propagated (fp16 loss scaling), not the numerators returned."""
        batch = [*inputs, *targets]
        micro = self._microbatches(batch)
        schedule = self._schedule(micro)
        self._numerators, self._denominators, self._stats = [], [], []
        self._loss_scale = loss_scale
        self.backward_done = 0
        kwargs = {f"b{j}": t for j, t in enumerate(batch)}
        dummy = torch.zeros(batch[0].shape[0], device=self.device)  # the loss reads no target
        sums = None
        if self.whole_batch:
            sums = whole_batch.sums_first(lambda: self._forward_all(micro), len(micro))
        with whole_batch.step(sums, len(micro)):
            schedule.step(*inputs, target=dummy, return_outputs=False, **kwargs)
        if self.has_last:
            numerator = torch.stack([n.double() for n in self._numerators]).sum()
            denominator = torch.stack([d.double() for d in self._denominators]).sum()
        else:
            numerator = denominator = torch.zeros((), dtype=torch.float64, device=self.device)
        return numerator, denominator

    def _forward_all(self, micro: list[list[torch.Tensor]]) -> torch.Tensor | None:
        """Every microbatch through this rank's stages, forward only, stage by stage in
        order and within a stage microbatch by microbatch (a rank's forwards in the order
        a schedule with one stage per rank runs them); activations sent to other ranks
        without waiting (a rank holding several stages receives the later ones' inputs
        only after sending all of its earlier stage's). The sum of the microbatches' loss
        denominators on the last stage's rank, else None."""
        env = _symbol_values(self.program, self.split, micro[0])
        ranks, last = self.plan.stage_ranks(), self.plan.num_stages - 1
        kept: dict[tuple[int, int], tuple] = {}   # outputs for this rank's next stage
        sending: list[tuple[Any, torch.Tensor]] = []
        denominator = None
        for s in self.stage_ids:
            graph = self.split.stages[s]
            for m, batch in enumerate(micro):
                if s == 0:
                    values = tuple(batch[: len(self.split.input_placeholders)])
                elif ranks[s - 1] == self.pp_rank:
                    values = kept.pop((s - 1, m))
                else:
                    grads = (False,) * len(graph.received_vals)
                    values = tuple(torch.empty(meta.shape, dtype=meta.dtype, device=self.device)
                                   for meta in _metas(graph.received_vals, grads, env))
                    for t in values:
                        dist.recv(t, group=self.pp_group, group_src=ranks[s - 1])
                values = self.modules[s](*values, **{f"b{j}": t for j, t in enumerate(batch)})
                if s == last:
                    den = values[self._outputs[1]].detach()
                    denominator = den if denominator is None else denominator + den
                elif ranks[s + 1] == self.pp_rank:
                    kept[(s, m)] = values
                else:
                    for t in values:
                        t = t.contiguous()
                        sending.append((dist.isend(t, group=self.pp_group,
                                                   group_dst=ranks[s + 1]), t))
        for work, _ in sending:
            work.wait()
        return denominator

    def sample_stats(self, batch: int) -> torch.Tensor | None:
        """The per-sample statistics of this rank's last step (its `batch` samples), from
        the last stage's rank to every rank of the pp group; None without them."""
        if self._stats_output is None:
            return None
        if self.has_last:
            stats = torch.cat(self._stats).contiguous()
        else:
            stats = torch.empty((batch, 3), dtype=torch.float32, device=self.device)
        if self.pp_group is not None:
            last = self.plan.stage_ranks()[self.plan.num_stages - 1]
            dist.broadcast(stats, group=self.pp_group, group_src=last)
        return stats

    def forward(self, inputs: Sequence[torch.Tensor]) -> Any:
        """Forward only, the whole batch at once: each stage in turn on its rank (the
        activations sent point to point), the last stage's outputs sent to every rank of
        the pp group. No schedule: inference has no backward to interleave."""
        inputs = list(inputs)
        env = _symbol_values(self.program, self.split, inputs)
        kwargs = {f"b{j}": t for j, t in enumerate(inputs)}
        ranks, last = self.plan.stage_ranks(), self.plan.num_stages - 1
        values: tuple = ()
        for s in self.stage_ids:
            graph = self.split.stages[s]
            if s == 0:
                values = tuple(inputs[: len(self.split.input_placeholders)])
            elif ranks[s - 1] != self.pp_rank:
                grads = (False,) * len(graph.received_vals)
                values = tuple(torch.empty(m.shape, dtype=m.dtype, device=self.device)
                               for m in _metas(graph.received_vals, grads, env))
                for t in values:
                    dist.recv(t, group=self.pp_group, group_src=ranks[s - 1])
            values = self.modules[s](*values, **kwargs)
            if s < last and ranks[s + 1] != self.pp_rank:
                for t in values:
                    dist.send(t.contiguous(), group=self.pp_group, group_dst=ranks[s + 1])
        box = [tree_map(values, lambda t: t.detach().cpu()) if self.has_last else None]
        if self.pp_group is not None:
            dist.broadcast_object_list(box, group=self.pp_group, group_src=ranks[last])
        outs = list(tree_map(box[0], lambda t: t.to(self.device)))
        user = [outs[i] for i in self.program.user_outputs]
        return user[0] if len(user) == 1 else tuple(user)

    def _microbatches(self, batch: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        m = self.plan.num_microbatches
        for i, t in enumerate(batch):
            if t.shape[0] % m:
                raise AutohybridError(
                    f"pipeline parallelism needs equal microbatches: this rank's batch of "
                    f"{t.shape[0]} samples (tensor {i}) does not split into the plan's {m} "
                    f"microbatches; give a multiple of {m * self.plan.mesh.dp} samples")
        split = [torch.tensor_split(t, m) for t in batch]
        return [[parts[k] for parts in split] for k in range(m)]


def merge_stages(local: dict[str, Any], canonical: dict[str, str], owned: set[str],
                 pp_group: dist.ProcessGroup, pp: int, device: torch.device) -> dict[str, Any]:
    """`local` with every parameter entry taken from a pp rank whose stages own it (keys
    map to canonical parameter names by `canonical`; other entries stay); every rank of
    the pp group must call it."""
    mine = {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v)
            for k, v in local.items() if canonical.get(k) in owned}
    pieces: list[Any] = [None] * pp
    dist.all_gather_object(pieces, mine, group=pp_group)
    out = dict(local)
    for piece in reversed(pieces):
        out.update({k: (v.to(device) if isinstance(v, torch.Tensor) else v)
                    for k, v in piece.items()})
    return out


def shared_grad_groups(plan: Plan, split: PipelineSplit) -> dict[str, dist.ProcessGroup]:
    """For each parameter that stages on several pp ranks read: the process group of those
    ranks at this rank's (dp, tp) coordinate. Every rank creates every group, in the same
    order (torch requires it); a rank keeps the ones it belongs to."""
    if not dist.is_initialized():
        return {}
    stage_rank = plan.stage_ranks()
    by_ranks: dict[tuple[int, ...], list[str]] = {}
    for name, stages in sorted(split.shared_params.items()):
        ranks = tuple(sorted({stage_rank[s] for s in stages}))
        if len(ranks) > 1:
            by_ranks.setdefault(ranks, []).append(name)
    mesh, me, out = plan.mesh, dist.get_rank(), {}
    for pp_ranks, names in sorted(by_ranks.items()):
        for d in range(mesh.dp):
            for t in range(mesh.tp):
                members = [plan.placement[(p * mesh.dp + d) * mesh.tp + t].rank
                           for p in pp_ranks]
                group = new_group(members)  # with the collective bound
                if me in members:
                    out.update({name: group for name in names})
    return out


# ---------------------------------------------------------------------- shapes
def _symbol_values(program: CapturedGraph, split: PipelineSplit,
                   first: list[torch.Tensor]) -> dict[sympy.Symbol, int]:
    """The graph's size symbols at this microbatch (from its inputs' and targets' shapes)."""
    phs = [n for n in program.gm.graph.nodes if n.op == "placeholder"]
    env: dict[sympy.Symbol, int] = {}
    for index, tensor in zip(split.batch_placeholders, first):
        val = phs[index].meta.get(VAL)
        for size, actual in zip(getattr(val, "shape", ()), tensor.shape):
            if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                env[size.node.expr] = int(actual)
    return env


def _size(size: Any, env: dict[sympy.Symbol, int]) -> int:
    if isinstance(size, torch.SymInt):
        return int(sympy.sympify(size.node.expr).xreplace(env))
    return int(size)


def _metas(vals: Sequence[Any], requires_grad: Sequence[bool],
           env: dict[sympy.Symbol, int]) -> tuple[torch.Tensor, ...]:
    """Meta tensors with the shapes of `vals` at this microbatch (contiguous)."""
    out = []
    for val, grad in zip(vals, requires_grad):
        t = torch.empty([_size(s, env) for s in val.shape], dtype=val.dtype, device="meta")
        out.append(t.requires_grad_(grad and t.is_floating_point()))
    return tuple(out)


def tree_map(obj: Any, fn) -> Any:
    """`fn` applied to every tensor of nested tuples, lists and dicts."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(tree_map(o, fn) for o in obj)
    if isinstance(obj, dict):
        return {k: tree_map(v, fn) for k, v in obj.items()}
    return obj
