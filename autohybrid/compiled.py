"""The compiled model users hold: `train_step`, `__call__`, gathered state, `explain`.

`__init__` is the compile pipeline for one rank, each step a call to the module that owns
it: capture (capture.py) → plan (planning.py) → rewrite (rewrite.py: the passes, a
frozen RankProgram per graph kind) → runtime state (runtime/). api.py sits above it and
checks user input; the runtime/ modules it drives know nothing about it.

Built on every rank from the same model, cluster and options. It owns the captured
graphs, the rewritten per-rank graphs, the mesh and the executor. Parameters the tp axis
does not split are the model's own, trained in place as with DDP; those it splits are
replaced by this rank's shards (runtime/tp_state.py), which the optimizer steps and
`full_state_dict` / `full_grads` gather back. With ZeRO (Plan.zero ≥ 1, dp > 1) the
optimizer steps instead the flat dp shards of what this rank trains (runtime/zero.py);
ZeRO 1/2 all-gather the whole parameters after each optimizer step (a step post-hook),
ZeRO-3 keeps only the shards.
"""
from __future__ import annotations

from typing import Any, Callable

import dataclasses

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from .ops import groups as ops_groups
from .blame import StepFailure
from .capture import CapturedGraph, _WithLoss, as_tuple, capture
from .sample_stats import StatsLoss
from .checks import build_optimizer
from .cluster import Cluster
from .errors import (AutohybridError, CaptureError, InputError, RuntimeFailure,
                     TrainingArgumentError)
from .plan import Constraints, NodeSharding, Plan
from .planning import (check_plan_fits_model, make_plan, optimizer_kind,
                       refuse_split_batch_norm)
from .program import RankProgram
from .rewrite import rewrite
from .runtime import gathered
from .runtime.executor import Executor, check_same_plan
from .data.fit import fit_data
from .runtime.fit import FitResult, build_scheduler, fit
from .runtime.failures import record_step
from .runtime.capture_share import capture_once
from .runtime.comm_device import bind as bind_comm_device
from .runtime.device_check import from_env as check_collective_devices
from .runtime.pretune import pretune, program_graphs, tuning_active
from .passes.fusion import inline_where_eager
from .runtime.safetensors_io import export_safetensors, import_safetensors
from .runtime.checkpoint_state import (guard_optimizer_load, hook_whole_loads, load_compiled,
                                       save_compiled)
from .runtime.groups import all_ranks_arrived, build_mesh, ensure_initialized, from_rank_zero
from .runtime.placement import cuda_device
from .runtime.timeouts import first_steps, step_bound
from .runtime.pipeline import PipelineRunner, shared_grad_groups
from .runtime.tp_state import ShardedParameters
from .init import replace_parameters
from .runtime.materialize import Materializer, retarget_device
from .runtime.precision import loss_scaler, refuse_nonfinite_loss
from .batch_spec import BatchSpec
from .runtime.batch_agreement import Agreement, runs_no_collective, start_agreement
from .runtime.selfcheck import check_mode, make_check
from .runtime.zero import ZeroShards


class CompiledModel:
    def __init__(self, model: nn.Module, cluster: Cluster, example_inputs: tuple, *,
                 loss_fn: Callable | None, example_targets: Any,
                 optimizer_factory: Callable | None, plan: Plan | None,
                 constraints: Constraints | None, global_batch: int | None,
                 autocast: torch.dtype | None = None,
                 grad_scaler: torch.amp.GradScaler | bool | None = None,
                 init_seed: int | None = None, check: str | None = None,
                 scheduler_factory: Callable | None = None):
        ensure_initialized(cluster.world_size)
        first_steps()  # compile and the first step: the long bound (runtime/timeouts.py)
        self.scheduler_factory = scheduler_factory
        self._set_up(model, cluster, loss_fn, example_inputs, optimizer_factory, autocast,
                     grad_scaler, init_seed)
        named = self._capture_at_compile(example_targets)                    # capture
        self.optimizer = (build_optimizer(optimizer_factory,
                                          list(self._trained_params().values()))
                          if optimizer_factory and self.materializer is None else None)
        self.plan = plan = self._plan(named, plan, constraints, global_batch)  # plan
        #: check=...: the first step against eager (its copy taken before any sharding)
        self._check = make_check(check_mode(check, plan, _param_bytes(model),
                                            cluster.device.memory_bytes),
                                 model, plan, self.rank, init_seed, autocast)
        refuse_split_batch_norm(plan, (self._train or self._forward_capture()).gm)
        check_same_plan(plan.hash())
        self.mesh = build_mesh(plan, cluster.device_type)
        self._groups = ops_groups.snapshot()  # bound again whenever this model runs
        self.coords = plan.mesh.coords(self.rank)
        if self._train is not None:                                            # rewrite
            self._rewrite("train", self._train)
        elif plan.mesh.tp > 1 or plan.mesh.pp > 1:
            # shards and stages from the forward graph until the first train_step
            self._rewrite(self._forward_kind(), self._forward_capture())
        self._layout_from = next(iter(self.programs), None)
        self._build_state(self.programs.get(self._layout_from), named)       # runtime state
        if optimizer_factory and (self.sharded is not None or self._owned is not None
                                  or self.zero is not None or self.materializer is not None):
            self._make_optimizer()  # this rank's part
        if self.scheduler is None and self.optimizer is not None and scheduler_factory:
            self.scheduler = build_scheduler(scheduler_factory, self.optimizer)
        if self._check is not None and self._train is not None:
            self._check.refuse_unless_comparable(self._train.gm, plan.mesh.dp,
                                                 plan.num_microbatches)
        if self.optimizer is not None:
            guard_optimizer_load(self.optimizer, self._optimizer_named())
        #: model.load_state_dict(...) after compile reaches this rank's shards too
        self._load_hook = hook_whole_loads(self)

    # ------------------------------------------------------------------ set-up helpers
    def _set_up(self, model: nn.Module, cluster: Cluster, loss_fn: Callable | None,
                example_inputs: tuple, optimizer_factory: Callable | None,
                autocast: torch.dtype | None, grad_scaler: Any, init_seed: int | None) -> None:
        """The model on this rank's device and the (still empty) per-rank state."""
        self.model, self.cluster, self.loss_fn = model, cluster, loss_fn
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self._move_to_device()
        # a meta model is materialized shard by shard (runtime/materialize.py)
        self.materializer = (Materializer(model, init_seed, self.device)
                             if _on_meta(model) else None)
        self.example_inputs = tuple(t.to(self.device) for t in example_inputs)
        self._forward_captures: dict[bool, CapturedGraph] = {}
        self._train: CapturedGraph | None = None
        #: per-sample statistics in the training graph (record_sample_stats), the last
        #: step's (N, 3) or None
        self._stats, self._stats_fn = False, None
        self._loss_in_use = loss_fn          # use_loss
        self._train_stale = False   # _train was captured with another loss than _train_loss
        self.last_sample_stats: torch.Tensor | None = None
        self.sharded: ShardedParameters | None = None  # this rank's shards (tp > 1)
        self._owned: set[str] | None = None  # parameters of this rank's stages (pp > 1)
        self.zero: ZeroShards | None = None  # this rank's dp shards (ZeRO ≥ 1, dp > 1)
        self._runners: dict[str, PipelineRunner] = {}
        #: mixed precision: the graphs run under autocast to this dtype (capture.py)
        self.autocast = autocast
        self.scaler = loss_scaler(autocast, grad_scaler)
        self.optimizer_factory = optimizer_factory
        #: the LR scheduler on `optimizer` (ah.compile's scheduler=), stepped after each
        #: optimizer step; built again with every optimizer compile builds (None: none)
        self.scheduler: Any = None
        self.graphs: dict[str, fx.GraphModule] = {}
        #: this rank's programs by kind: "train", "forward_train", "forward_eval"
        self.programs: dict[str, RankProgram] = {}
        #: the program that gave this rank's shards and stages: "train", a forward kind
        #: until the training graph is captured, None without tp and pp
        self._layout_from: str | None = None
        self.executor: Executor | None = None
        self.found_inf = False  # the last step's gradients overflowed (fp16): it was skipped
        self._batch_specs: dict[int, BatchSpec] = {}  # what a batch must be, per graph
        #: train_steps completed (a skipped fp16 step counts): what a checkpoint records
        self.step = 0
        self._stepped = False  # a train_step completed (runtime/timeouts.step_bound)
        self._pretuned: set[str] = set()  # programs whose fused kernels were tuned
        #: (the training program, whether its graphs call no collective): _deferrable
        self._local_program: tuple[Any, bool] | None = None
        record_step(0)

    def _capture_at_compile(self, example_targets: Any) -> CapturedGraph:
        """Capture what compile needs now; returns the graph the plan is made on and names.

        With example_targets only the training graph (model + loss), which the plan is
        made on and names; the forward without targets is captured when compiled(inputs)
        first runs (some models cannot run without their targets: T5 derives its decoder
        inputs from labels). Without them the forward graph, which the plan is made on;
        the training graph comes from the first train_step's batch and then gives the
        shards and stages (_adopt_train_layout). The plan names a graph in the model's
        own precision (as ah.plan, also on meta devices, captures it); under mixed
        precision the programs run under autocast. Each rank exports each graph once
        (memoized; AUTOHYBRID_CAPTURE_SHARE=1: once for the job, loaded by every rank,
        runtime/capture_share.py)."""
        model, inputs, autocast = self.model, self.example_inputs, self.autocast
        if example_targets is None:
            named = capture_once(model, inputs, with_loss=False)
            if autocast is None:
                self._forward_captures[model.training] = named
            return named
        targets = tuple(t.to(self.device) for t in as_tuple(example_targets))
        self._train = capture_once(model, inputs, self._train_loss, targets, autocast=autocast)
        return (self._train if autocast is None
                else capture_once(model, inputs, self.loss_fn, targets))

    def _plan(self, named: CapturedGraph, plan: Plan | None, constraints: Constraints | None,
              global_batch: int | None) -> Plan:
        """The plan searched on the captured graphs (planning.py), or the given one checked
        against them."""
        if plan is None:  # searched once, on rank 0 (the search is deterministic)
            kind = optimizer_kind(self.optimizer)
            return from_rank_zero(lambda: make_plan(
                named, self._train, self.model, self.cluster, self.example_inputs,
                global_batch, self.autocast, constraints, kind, executable_only=True))
        # a plan made without targets names the forward graph: captured if so
        forward = lambda: capture(self.model, self.example_inputs, with_loss=False)  # noqa: E731
        check_plan_fits_model(plan, named, self.cluster,
                              other=forward if named.with_loss else None)
        return plan

    def _build_state(self, program: RankProgram | None, graph: CapturedGraph) -> None:
        """This rank's stages, tp shards, whole parameters of a meta model, ZeRO shards and
        executor, from the program the layout comes from (None: no program yet, neither
        tp nor pp; `graph` names the parameters and buffers the programs read)."""
        plan, model, mesh = self.plan, self.model, self.mesh
        hooks = []
        if self.executor is not None:  # built again (_adopt_train_layout)
            self.executor.reducer.remove()
            hooks = self.executor.microbatch_hooks
        self.sharded = self.zero = self._owned = None
        dp_group = mesh.get_group("dp") if mesh is not None and plan.mesh.dp > 1 else None
        state = graph.default_state(model)
        if plan.mesh.pp > 1:
            self._owned = program.stage_params()
        zero3 = plan.zero == 3 and plan.mesh.dp > 1
        if plan.mesh.tp > 1 or plan.mesh.ep > 1:
            axes = {axis: (ops_groups.get(axis) if mesh is not None and size > 1 else None,
                           size) for axis, size in (("tp", plan.mesh.tp), ("ep", plan.mesh.ep))}
            self.sharded = ShardedParameters(model, program.param_shards, axes,
                                             None if zero3 else self._tp_shard)
            self.sharded.into_state(state)
        if self.materializer is not None and not zero3:  # this rank's whole parameters
            split = self.sharded.specs if self.sharded is not None else {}
            whole = {n for n in self._trained_params() if n not in split}
            self.materializer.into_model(model, {n for n in whole
                                                 if model.get_parameter(n).is_meta})
            state.update({n: model.get_parameter(n) for n in whole if n in state})
        trained = self._trained_params()
        edp = (ops_groups.get("edp") if mesh is not None and plan.mesh.ep > 1 else None)
        expert_names = [name for name, spec in (self.sharded.specs.items()
                                                if self.sharded is not None else ())
                        if spec.axis == "ep" and name in trained]
        if plan.zero and plan.mesh.dp > 1:
            within = (edp, plan.mesh.dp // plan.mesh.ep, self.coords[1] // plan.mesh.ep)
            self.zero = ZeroShards(plan.zero, trained, dp_group, plan.mesh.dp,
                                   self.coords[1], int(plan.bucket_mb * 2**20),
                                   self._zero_shard, {n: within for n in expert_names})
            if zero3:  # the graphs read the shards (passes/zero.py)
                state.update(self.zero.shards)
        experts = {id(trained[name]): edp for name in expert_names} if edp else None
        self.executor = Executor(plan, self.rank, self.coords[1], dp_group,
                                 _full_state(model, state), list(trained.values()), self.zero,
                                 self.scaler, param_groups=experts)
        self.executor.microbatch_hooks = hooks

    def _make_optimizer(self) -> None:
        """The optimizer over this rank's part (and the scheduler on it, afresh)."""
        params = self._optimizer_params()
        if not params:
            # a pipeline stage of weightless layers (pools, activations, a flatten) trains
            # nothing on this rank: no optimizer (torch's refuse an empty parameter list),
            # no scheduler, nothing to step; its checkpoint holds no optimizer state
            self.optimizer = self.scheduler = None
            return
        self.optimizer = build_optimizer(self.optimizer_factory, params)
        guard_optimizer_load(self.optimizer, self._optimizer_named())
        if self.zero is not None and self.zero.stage < 3:
            self.optimizer.register_step_post_hook(lambda *_: self.zero.gather_params())
        if self.scheduler_factory is not None:
            self.scheduler = build_scheduler(self.scheduler_factory, self.optimizer)

    def _adopt_train_layout(self, program: RankProgram) -> None:
        """The training graph, captured at the first train_step, gives the shards and
        stages: the forward graph the compile-time ones came from is no valid source of the
        training layout (a vocabulary-parallel loss splits the output layer the forward
        keeps whole). Nothing has trained yet, so this rank's state is built again from
        the model's values (the seeded ones of a meta model), the optimizer steps the new
        tensors (the same optimizer object: schedulers made on it stay valid), and the
        forward programs are rewritten for the new shards when next called."""
        self._layout_from = "train"
        if self.sharded is None and self._owned is None:
            return
        same = ((self.sharded is None or program.param_shards == self.sharded.specs)
                and (self._owned is None or program.stage_params() == self._owned))
        if same:
            return
        old = self._optimizer_named()
        self._build_state(program, self._train)
        for kind in [k for k in self.programs if k != "train"]:
            del self.programs[kind], self.graphs[kind]
        self._runners.clear()
        if self.optimizer is None:
            return
        new = self._optimizer_named()
        swap = {id(p): new[name] for name, p in old.items() if name in new}
        groups = self.optimizer.param_groups
        if (old.keys() == new.keys() and not self.optimizer.state
                and all(id(p) in swap for g in groups for p in g["params"])):
            for g in groups:
                g["params"] = [swap[id(p)] for p in g["params"]]
        else:  # other parameters (stages) or state: a new optimizer over this rank's part
            self._make_optimizer()

    def _pass_plan(self, cap: CapturedGraph) -> Plan:
        """The plan the passes rewrite `cap` with: a forward graph rewritten after the
        training graph gave the shards splits (column-wise) the parameters the training
        layout splits, so that both programs read the same shards."""
        if cap.with_loss or self.sharded is None or self._layout_from != "train":
            return self.plan
        split = {s.node for s in self.plan.shardings if s.placement.startswith("shard(")}
        extra = tuple(NodeSharding(name, f"shard({spec.dim})")
                      for name, spec in sorted(self.sharded.specs.items()) if name not in split)
        if not extra:
            return self.plan
        return dataclasses.replace(self.plan, shardings=self.plan.shardings + extra)

    def _tp_shard(self, name: str, spec) -> torch.Tensor | None:
        """This rank's tp shard of a meta model's parameter (None: not this rank's)."""
        if self.materializer is None or (self._owned is not None and name not in self._owned):
            return None
        return self.materializer.tp_local(name, spec)

    def _zero_shard(self, name: str) -> torch.Tensor:
        """This rank's ZeRO-3 flat chunk of a meta model's parameter."""
        spec = self.sharded.specs.get(name) if self.sharded is not None else None
        return self.materializer.zero_shard(name, self.plan.mesh.dp, self.coords[1], spec)

    def _move_to_device(self) -> None:
        if self.cluster.device_type == "cuda":  # cuda:LOCAL_RANK, checked and current
            self.device = cuda_device(self.cluster.devices_per_node, self.rank)
            if not _on_meta(self.model):  # (a meta model is materialized on the device)
                self.model.to(self.device)
        else:
            self.device = torch.device("cpu")
        bind_comm_device(self.device)  # the runtime's own collective tensors live here
        check_collective_devices()  # AUTOHYBRID_CHECK_COLLECTIVE_DEVICES=1: against it

    def _trained_params(self) -> dict[str, nn.Parameter]:
        """The parameters this rank trains by canonical name: the model's own, or its
        tp shards of split ones; with pipeline parallelism only those its stages read."""
        named = list(self.model.named_parameters())
        if self.sharded is not None:
            named = list(zip([n for n, _ in named], self.sharded.parameters(self.model)))
        return {name: p for name, p in named if self._owned is None or name in self._owned}

    def _optimizer_params(self) -> list[nn.Parameter]:
        """What the optimizer steps: the trained parameters, or their ZeRO shards."""
        return list(self._optimizer_named().values())

    def _optimizer_named(self) -> dict[str, nn.Parameter]:
        if self.zero is not None:
            return dict(self.zero.shards)
        return self._trained_params()

    # ------------------------------------------------------------------ pipeline
    def _runner(self, kind: str) -> PipelineRunner | None:
        """This rank's pipeline stages for the program `kind` (None without pp)."""
        if self.plan.mesh.pp == 1:
            return None
        if kind not in self._runners:
            program = self.programs[kind]
            owned = program.stage_params()
            if owned != self._owned:
                raise RuntimeFailure(
                    f"the {kind} graph puts other parameters on this rank's pipeline stages "
                    f"than the {self._layout_from} graph the stages were made from "
                    f"({sorted(owned ^ self._owned)[:3]}): this plan cannot run the model's "
                    "forward on the training layout's stages; call compiled(inputs) under a "
                    "plan without pipeline parallelism (Constraints(pp=1))")
            pp_group = self.mesh.get_group("pp") if self.mesh is not None else None
            shared = shared_grad_groups(self.plan, program.pipeline) if kind == "train" else {}
            self._runners[kind] = PipelineRunner(
                self.plan, program.pipeline, program.runnable, self.executor.state,
                self.coords[0], pp_group, self.device, shared)
        return self._runners[kind]

    def _forward_kind(self) -> str:
        return f"forward_{'train' if self.model.training else 'eval'}"

    def _capture(self, *args: Any, collective: bool = False, **kwargs: Any) -> CapturedGraph:
        """`capture(self.model, ...)` after compile: a meta model whose parameters are
        partly materialized is captured on its meta parameters, as at compile (the
        programs are pointed at this device when rewritten). `collective=True` where
        every rank captures at the same point (a train_step; a forward that runs
        collectives, under tp or pp): exported once for the job (capture_once)."""
        take = capture_once if collective else capture
        if self.materializer is None:
            return take(self.model, *args, **kwargs)
        current = dict(self.model.named_parameters())
        meta = {id(p): self.materializer.meta[name] for name, p in current.items()
                if not p.is_meta}
        back = {id(self.materializer.meta[name]): p for name, p in current.items()
                if not p.is_meta}
        replace_parameters(self.model, meta)
        try:
            return take(self.model, *args, **kwargs)
        finally:
            replace_parameters(self.model, back)

    def _forward_capture(self) -> CapturedGraph:
        """The forward graph without targets (in the model's current train/eval mode),
        captured when first needed."""
        mode = self.model.training
        if mode not in self._forward_captures:
            try:
                # under dp alone a forward runs no collective: a rank may run it alone
                collective = self.plan.mesh.tp > 1 or self.plan.mesh.pp > 1
                self._forward_captures[mode] = self._capture(
                    self.example_inputs, with_loss=False, autocast=self.autocast,
                    collective=collective)
            except CaptureError as exc:
                if self._train is None:
                    raise
                raise CaptureError(
                    "compiled(inputs) runs the model on its inputs alone, and this model "
                    "cannot run without its targets: it was captured with them for training "
                    "(train_step works), but not without (an encoder-decoder such as T5 "
                    "derives its decoder inputs from labels). Call train_step(inputs, "
                    f"targets) to train it; compiled(inputs) is not available for it.\n"
                    f"The capture without targets: {exc}") from exc
        return self._forward_captures[mode]

    def _rewrite(self, kind: str, cap: CapturedGraph) -> RankProgram:
        """Run the passes on `cap`'s graph (autohybrid/rewrite.py, on this job's groups);
        the result is this rank's program for `kind`. Every rank rewrites its own graph,
        on its real groups; the search's trial (rank 0's program on fake groups) is not
        reused. (Reusing it once trained a GRU under tp2 with wrong gradients; the cause,
        a pass specializing the capture's batch symbol, is fixed in passes/manager.py.)"""
        padded = frozenset() if cap.with_loss or self.sharded is None else frozenset(
            name for name, spec in self.sharded.specs.items() if spec.padded != spec.size)
        program = rewrite(cap, self._pass_plan(cap), self.rank,
                          example_inputs=self.example_inputs, padded_params=padded)
        if self.materializer is not None:  # captured on meta, runs on this device
            retarget_device(program.gm, self.device)
            for stage in program.pipeline.stages if program.pipeline is not None else ():
                retarget_device(stage.gm, self.device)
        if program.fused_regions:  # on CPU the op's eager path would recompute them
            inline_where_eager(program_graphs(program), self.device)
        # the layout made from a forward graph gives way to the training graph's
        adopt = cap.with_loss and self._layout_from not in (None, "train")
        if self.sharded is not None and not adopt:
            self.sharded.check_same(program.param_shards, kind)
        if adopt:
            self._adopt_train_layout(program)
        self.graphs[kind], self.programs[kind] = program.gm, program
        return program

    def _inputs(self, inputs: Any, what: str, expected: int | None) -> tuple:
        tensors = as_tuple(inputs)
        if expected is not None and len(tensors) != expected:
            raise AutohybridError(f"{what}: expected {expected} tensor(s) as in the example, got "
                                  f"{len(tensors)}")
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise AutohybridError(f"{what}[{i}] must be a tensor, got {type(t).__name__}")
        return tuple(t.to(self.device) for t in tensors)

    # ------------------------------------------------------------------ training
    def forward_backward(self, inputs: Any, targets: Any = None, *, local: bool = False) -> torch.Tensor:
        """Forward and backward of the global batch; gradients summed over dp, not stepped."""
        ops_groups.restore(self._groups)
        inputs = self._inputs(inputs, "inputs", len(self.example_inputs))
        targets = self._inputs(targets, "targets", None)
        # a stale graph: checked once captured again
        agreement = self._check_batch(None if self._train_stale else self._train,
                                      (*inputs, *targets), local, defer=self._deferrable())
        if self._train is None or self._train_stale:
            if not targets and self.loss_fn is not None:
                raise AutohybridError("train_step needs targets when a loss_fn is given")
            # Capture from this rank's first microbatch of the real batch (inputs and
            # targets must agree in batch size for losses that check it).
            shard = self.executor.local_slice if not local else (lambda ts, w: list(ts))
            first = [self.executor.microbatches(shard(ts, what), what)[0]
                     for ts, what in ((inputs, "inputs"), (targets, "targets"))]
            self._train = self._capture(tuple(first[0]), self._train_loss, tuple(first[1]),
                                        autocast=self.autocast, collective=True)
            self._train_stale = False
            self._rewrite("train", self._train)
            if self.programs["train"].batch_equalities:   # what the split was proven on
                self._check_batch(self._train, (*inputs, *targets), local=True)
        if len(targets) != self._train.num_targets:
            raise AutohybridError(f"targets: expected {self._train.num_targets} tensor(s), got "
                                  f"{len(targets)}")
        for p in [*self._trained_params().values(), *self._optimizer_params()]:
            p.grad = None
        train = self.programs["train"]
        self._pretune("train", train, (inputs, targets), local)
        result = self.executor.forward_backward(
            train.runnable, train.loss_kind, inputs, targets, local, self._runner("train"),
            before_backward=agreement.settle if agreement is not None
            and not agreement.settled else None)
        self.found_inf = result.found_inf
        self.last_sample_stats = result.stats
        return result.loss

    @property
    def _train_loss(self) -> Any:
        """What the training graph is captured with: the loss function in use
        (use_loss), with per-sample statistics when asked for (record_sample_stats)."""
        loss = self._loss_in_use
        return StatsLoss(loss, self._stats_fn) if self._stats else loss

    def record_sample_stats(self, stats_fn: Callable | None = None, *,
                            enabled: bool = True) -> None:
        """From the next train_step on, the training graph also computes every sample's
        loss, correctness and target-class probability in its forward pass
        (autohybrid/sample_stats.py: a classifier's by default, or `stats_fn(logits,
        targets) -> (loss, correct, prob)`), and `last_sample_stats` holds them after
        each step: an (N, 3) float tensor over the global batch, in its order (with
        `local=True`, the dp ranks' batches one after another), on every rank.
        `enabled=False` stops. Every rank calls it at the same point."""
        wanted = (bool(enabled), stats_fn if enabled else None)
        if wanted != (self._stats, self._stats_fn):
            self._stats, self._stats_fn = wanted
            self._train_loss_changed()

    def use_loss(self, loss_fn: Callable | None) -> None:
        """Train with `loss_fn` from the next train_step on (None: the one compiled
        with), e.g. sample_stats.RemedyLoss, whose targets pack a teacher's logits and
        weights. The plan stays; every rank calls it at the same point."""
        loss = self.loss_fn if loss_fn is None else loss_fn
        if loss != self._loss_in_use:   # RemedyLoss compares by value, functions by identity
            self._loss_in_use = loss
            self._train_loss_changed()

    def _train_loss_changed(self) -> None:
        """The training graph is captured again at the next step, from its batch; the
        old one still says what the shards are (load) until then."""
        self.last_sample_stats = None
        if self._train is not None:
            self._train_stale = True
            for cache in (self.programs, self.graphs, self._runners):
                cache.pop("train", None)
            self._pretuned.discard("train")

    def _pretune(self, kind: str, program: Any, batch: tuple, local: bool) -> None:
        """Before a program's first run (and its collectives): tune its fused kernels at
        this rank's first microbatch's sizes, the ranks agreeing (runtime/pretune.py)."""
        if kind in self._pretuned:
            return
        self._pretuned.add(kind)
        if not tuning_active(self.device):   # CPU, the interpreter: launches not tuned
            return
        shard = self.executor.local_slice if not local else (lambda ts, w: list(ts))
        try:
            first = [self.executor.microbatches(shard(ts, what), what)[0] if ts else []
                     for ts, what in zip(batch, ("inputs", "targets"))]
        except AutohybridError:   # the step says what is wrong; tune at example sizes
            first = [[], []]
        # every rank runs a train_step, and a forward under tp or pp (its collectives);
        # under dp alone a rank may run the forward alone: it tunes without agreeing
        agree = kind == "train" or self.plan.mesh.tp > 1 or self.plan.mesh.pp > 1
        pretune(program_graphs(program), self.device, program.captured,
                [*first[0], *first[1]], agree=agree)

    def train_step(self, inputs: Any, targets: Any = None, *, local: bool = False,
                   max_grad_norm: float | None = None) -> torch.Tensor:
        """One optimizer step on the global batch; returns eager's loss of that batch.

        With fp16 loss scaling, a step whose gradients overflowed on any rank is skipped
        (no clipping, no optimizer or scheduler step) on every rank and the scale backs
        off, as `GradScaler.step` / `update` do (and Hugging Face's Trainer skips the
        scheduler)."""
        try:
            if self._check is not None and not self._check.done:
                return self._checked_step(inputs, targets, local, max_grad_norm)
            loss = self.forward_backward(inputs, targets, local=local)
            refuse_nonfinite_loss(loss, self.found_inf, self.step)
            return self._step(loss, max_grad_norm)
        except AutohybridError:
            raise
        except Exception as exc:  # torch's: name the node, its module and what to do
            raise StepFailure.of(exc, "train_step", self.plan) from exc

    def _check_batch(self, cap: CapturedGraph | None, batch: tuple, local: bool,
                     defer: bool = False) -> Agreement | None:
        """The batch fits the graph `cap` (batch_spec.py; None: not captured yet) and,
        unless `local`, every rank passed the same one (runtime/batch_agreement.py).
        `defer`: the check is issued and settled by the caller (before any collective)."""
        problem = None
        if cap is not None:
            spec = self._batch_specs.get(id(cap))
            if spec is None:
                spec = self._batch_specs[id(cap)] = BatchSpec.of(cap)
            equal = next((p.batch_equalities for p in self.programs.values()
                          if p.captured is cap), ())
            problem = spec.problem(batch, equal)
        if local:
            if problem:
                raise InputError(problem)
            return None
        return start_agreement(batch, problem, self.step, self.device, defer=defer)

    def _deferrable(self) -> bool:
        """Whether this step's batch check may run during its first forward: the training
        program is rewritten and tuned (no capture or tuning collective comes first), the
        plan is dp alone below ZeRO-3 and the graphs call no collective, so the step's
        first collective is a gradient bucket's, after that forward."""
        if self._train is None or self._train_stale or "train" not in self._pretuned:
            return False
        mesh = self.plan.mesh
        if mesh.tp > 1 or mesh.pp > 1 or self.plan.zero >= 3 or self._check is not None \
                and not self._check.done:
            return False
        program = self.programs.get("train")
        if program is None:
            return False
        if self._local_program is None or self._local_program[0] is not program:
            self._local_program = (program, runs_no_collective(program_graphs(program)))
        return self._local_program[1]

    def _step(self, loss: torch.Tensor, max_grad_norm: float | None) -> torch.Tensor:
        if not self.found_inf:
            if max_grad_norm is not None:
                self.clip_grad_norm_(max_grad_norm)
            if self.optimizer is not None:
                self.optimizer.step()
            if self.scheduler is not None:  # after the optimizer, as eager loops do
                self.scheduler.step()
        if self.scaler is not None:
            self.scaler.update(self.found_inf)
        self.step += 1
        record_step(self.step)  # the launcher names a failed rank's last step from it
        if not self._stepped:  # every rank past its first step: the step bound from now
            self._stepped = True
            all_ranks_arrived()
            step_bound()
        return loss

    def _checked_step(self, inputs: Any, targets: Any, local: bool,
                      max_grad_norm: float | None) -> torch.Tensor:
        """The first step under check=True: compared with eager before anything steps."""
        if local:
            raise AutohybridError("check=True compares the first step on the global batch "
                                  "with eager: call the first train_step without local=True")
        rng = self._check.rng_state()
        if self._check.per_stage:
            self._check.before_step(self.executor.state,
                                    [n for n, _ in self.model.named_buffers()])
        loss = self.forward_backward(inputs, targets, local=local)
        self._check.refuse_unless_comparable(self._train.gm, self.plan.mesh.dp,
                                             self.plan.num_microbatches)
        xs, ys = self._inputs(inputs, "inputs", None), self._inputs(targets, "targets", None)
        if self._check.per_stage:  # no rank gathers more than its own stages
            self._check.verify(loss, self._train, gathered.stage_full(self, grads=False),
                               gathered.stage_full(self, grads=True), list(gathered.trained_names(self)),
                               (xs, ys), rng)
            return self._step(loss, max_grad_norm)

        def eager_loss(ref: nn.Module) -> torch.Tensor:  # what the train graph captured
            with self._train.autocast_context(xs):
                return _WithLoss(ref, self._loss_in_use, len(xs))(*xs, *ys)

        self._check.verify(loss, self.full_grads(), eager_loss, rng)
        return self._step(loss, max_grad_norm)

    @property
    def loss_scale(self) -> float | None:
        """The current fp16 loss scale (None without loss scaling)."""
        return self.scaler.scale if self.scaler is not None else None

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients by their global norm (across all shards); returns the norm
        (runtime/gathered.py; every rank calls it)."""
        return gathered.clip_grad_norm(self, max_norm, norm_type)

    def local_slice(self, batch: Any) -> Any:
        """This rank's data-parallel shard of a global batch (tensor or tuple of tensors)."""
        out = self.executor.local_slice(as_tuple(batch), "batch")
        return out[0] if isinstance(batch, torch.Tensor) else tuple(out)

    def fit(self, loader: Any, *, steps: int | None = None, epochs: int | None = None,
            save_every: int | None = None, save_dir: Any = None, resume: bool = False,
            keep_last: int | None = None, max_grad_norm: float | None = None,
            log_every: int | None = 10, sampler: Any = None, shuffle: Any = None,
            distill: Any = None, impact: Any = None, batch_size: int | None = None,
            stats_fn: Callable | None = None) -> FitResult:
        """Train on `loader`'s (inputs, targets) batches until `self.step` reaches
        `steps` or `epochs` epochs are done, checkpointing under `save_dir` (every rank
        calls it; runtime/fit.py).

        With `sampler=ah.data.HidingSampler(...)`, `shuffle=ah.data.PartialShuffle(...)`,
        `distill=ah.data.Distillation(...)` and/or `impact=ah.data.ImpactFactors(...)`
        (data/remedies.py), `loader` is the dataset (a map-style dataset or a tuple
        (inputs, targets) of tensors), `epochs` is required, `batch_size` is the global
        batch (the sampler's by default), `stats_fn` computes the per-sample statistics
        (record_sample_stats) and `save_every` counts epochs (data/fit.py)."""
        if any(part is not None for part in (sampler, shuffle, distill, impact)):
            if steps is not None:
                raise TrainingArgumentError(
                    "fit(sampler=/shuffle=/distill=/impact=): these work epoch by epoch: "
                    "give epochs=, not steps=")
            return fit_data(self, loader, epochs=epochs, sampler=sampler, shuffle=shuffle,
                            distill=distill, impact=impact, batch_size=batch_size,
                            stats_fn=stats_fn, save_every=save_every, save_dir=save_dir,
                            resume=resume, keep_last=keep_last,
                            max_grad_norm=max_grad_norm, log_every=log_every)
        if batch_size is not None or stats_fn is not None:
            raise TrainingArgumentError(
                "fit: batch_size= and stats_fn= go with sampler=, shuffle= or distill= (a "
                "loader brings its own batches)")
        return fit(self, loader, steps=steps, epochs=epochs, save_every=save_every,
                   save_dir=save_dir, resume=resume, keep_last=keep_last,
                   max_grad_norm=max_grad_norm, log_every=log_every)

    # ------------------------------------------------------------------ forward only
    def __call__(self, inputs: Any) -> Any:
        ops_groups.restore(self._groups)
        cap = self._forward_capture()
        kind = self._forward_kind()
        program = self.programs.get(kind) or self._rewrite(kind, cap)
        tensors = self._inputs(inputs, "inputs", len(self.example_inputs))
        self._check_batch(cap, tensors, local=False)
        self._pretune(kind, program, (tensors, []), local=False)
        try:
            with torch.no_grad():
                return self.executor.forward(program.runnable, tensors, self._runner(kind))
        except AutohybridError:
            raise
        except Exception as exc:  # torch's: name the node, its module and what to do
            raise StepFailure.of(exc, "the forward", self.plan) from exc

    # ------------------------------------------------------------------ state
    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.model.named_parameters())

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer, whole, as `model.state_dict()` names them (split
        parameters gathered from the tp group, ZeRO shards from the dp group, stages from
        the pp group: every rank must call it; runtime/gathered.py)."""
        return gathered.full_state_dict(self)

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        """The gradients of the last step, whole, keyed like `model.named_parameters()`
        (every rank must call it; runtime/gathered.py)."""
        return gathered.full_grads(self)

    def save(self, directory: Any, *, extra: dict | None = None,
             keep_last: int | None = None) -> Any:
        """Write a checkpoint of this training state under `directory` (every rank calls
        it): `directory/step-<N>` (N = self.step), sharded (each rank writes what it
        holds, in parallel), atomic (visible only when complete), with a manifest (the
        plan, the graph hash, versions, sizes and checksums); `keep_last` prunes older
        ones; `extra` (JSON) comes back from `load`. runtime/checkpoint.py."""
        return save_compiled(self, directory, extra, keep_last)

    def load(self, path: Any, *, strict: bool = True) -> dict:
        """Restore the training state from a checkpoint (its directory, or a save
        directory: its latest complete one) saved under any plan, resharded on the load:
        parameters, buffers, optimizer state and settings, scheduler, loss scaler, step,
        every rank's random generators; returns the `extra` saved with it. Every rank
        calls it. A checkpoint of another model, or a damaged one, is refused by name;
        `strict=False` accepts one of another graph whose tensors all match."""
        if self._train is None and (self.plan.mesh.tp > 1 or self.plan.mesh.pp > 1):
            raise AutohybridError(
                "load before the first train_step needs the training graph (under tp or pp "
                "it decides the shards and stages the checkpoint is read into): compile "
                "with example_targets, or call load after the first train_step")
        return load_compiled(self, path, strict)

    def export_safetensors(self, directory: Any) -> Any:
        """The whole trained model as `directory/model.safetensors` (every rank calls it,
        rank 0 writes): Hugging Face names and config.json for a transformers model, so
        from_pretrained(directory) reads it. runtime/safetensors_io.py."""
        return export_safetensors(self, directory)

    def load_safetensors(self, path: Any, *, strict: bool = True) -> None:
        """Weights from safetensors (a file, or a directory save_pretrained wrote) into
        this rank's shards, each rank reading only its slices; every rank calls it."""
        import_safetensors(self, path, strict)


    @property
    def kernels(self) -> list:
        """The generated kernels (`ops.fused.KernelInfo`) of this rank's programs: one per
        distinct region the fusion pass fused (passes/fusion.py), in the order it first
        fused them; empty when the pass is off or fused nothing."""
        keys: dict[str, None] = {}
        for program in self.programs.values():
            for region in program.fused_regions:
                keys.setdefault(region.key, None)
        if not keys:
            return []
        from .ops import fused
        by_key = {k.key: k for k in fused.kernels()}
        return [by_key[key] for key in keys if key in by_key]

    @property
    def reducer_events(self):
        return list(self.executor.reducer.events)

    def explain(self) -> str:
        from .report.text import explain
        return explain(self)

    def profile(self, batches: Any, steps: int | None = None, **kwargs: Any):
        """Train `steps` steps on `batches` under torch.profiler; every rank's measured
        Timeline (runtime/profile.py `profile_steps`; call on every rank)."""
        from .runtime.profile import profile_steps
        return profile_steps(self, batches, steps, **kwargs)


def _param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _on_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def _full_state(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    full = dict(state)
    for name, p in model.named_parameters():
        full.setdefault(name, p)
    for name, b in model.named_buffers():
        full.setdefault(name, b)
    return full
