"""Hand-written PyTorch counterparts of autohybrid's layouts, written as users write them.

They exist so that `ah.bench` (and benchmarks/runtime_overhead.py) can put autohybrid's
step time beside what a careful user gets from PyTorch's own parallel APIs on the same
layout — an honest comparison needs the same mesh, the same split and the same work:

    layout (Plan)           baseline                  what torch does
    dp, ZeRO 0              DDP                       all-reduce of gradient buckets
    dp, ZeRO 1              DDP + ZeroRedundancyOpt   optimizer state of 1/dp of the params
    dp, ZeRO 2              FSDP2 no reshard          `fully_shard(reshard_after_forward=
                                                      False)`: gathered params kept until
                                                      backward ends (SHARD_GRAD_OP)
    dp, ZeRO 3              FSDP2                     resharded after forward (blocks)
    tp (zoo GPT / Llama)    DTensor                   `parallelize_module`, Megatron layout,
                                                      vocabulary-parallel embedding and head
                                                      with `loss_parallel()`
    pp (zoo GPT / Llama)    pipelining                `pipeline()` split at the plan's stage
                                                      boundaries, ScheduleGPipe/Schedule1F1B
    dp × tp, ZeRO 2 / 3     FSDP2+DTensor             DTensor tp on the mesh's "tp" axis,
                                                      FSDP2 over its "dp" axis

Every baseline object has `train_step(inputs, targets) -> loss` taking the same global
batch on every rank and returning the global batch's loss on every rank (the all-reduce
or broadcast that costs is part of the step, as it is of autohybrid's `train_step`).
`choose(plan, model)` says which baseline fits a plan, or why none does (a pure function:
no processes). Nothing here imports autohybrid's runtime: the baselines are plain torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from .errors import AutohybridError

#: DDP's default bucket size; autohybrid's plans default to the same
BUCKET_MB = 25.0
#: ZeRO stage → the name of torch's counterpart (pure dp)
DP_BASELINES = {0: "DDP", 1: "DDP+ZeroRedundancyOpt", 2: "FSDP2 no reshard", 3: "FSDP2"}
#: pipeline schedules a hand-written `torch.distributed.pipelining` run reproduces
PIPELINE_SCHEDULES = ("gpipe", "1f1b")

LossFn = Callable[[Any, Any], torch.Tensor]


class BaselineError(AutohybridError):
    """A baseline was asked for a model or layout it cannot reproduce."""


@dataclass(frozen=True)
class Optim:
    """An optimizer as a class and its keyword arguments: a picklable factory
    (`Optim(torch.optim.SGD, {"lr": 0.1})(params)`), and what ZeroRedundancyOptimizer needs
    (it takes the class and arguments, not a factory)."""

    cls: type
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __call__(self, params) -> torch.optim.Optimizer:
        return self.cls(params, **self.kwargs)


@dataclass(frozen=True)
class Choice:
    """Which baseline a plan gets: `name` (e.g. "DDP"), or `reason` why none (name "n/a");
    `note`: how an available baseline still differs from the plan."""

    name: str
    reason: str = ""
    note: str = ""

    @property
    def available(self) -> bool:
        return not self.reason


# ---------------------------------------------------------------------- which baseline
def choose(plan: Any, model: nn.Module) -> Choice:
    """The hand-written counterpart of `plan`'s layout for `model`, or why there is none.

    Pure: reads the plan's mesh, ZeRO stage, schedule and precision and the model's
    module names; starts nothing."""
    choice = _choose_layout(plan, model)
    if choice.available and plan.recompute != "none":
        return Choice(choice.name, note=f"the baseline does not recompute (the plan: "
                                        f"recompute={plan.recompute})")
    return choice


def _choose_layout(plan: Any, model: nn.Module) -> Choice:
    mesh = plan.mesh
    if plan.dtype not in ("float32", "float64"):
        return Choice("n/a", f"mixed precision ({plan.dtype}) is not reproduced by the "
                             "hand-written baselines, which train in the model's dtype")
    if mesh.sp:
        return Choice("n/a", "sequence parallelism: the hand-written DTensor baseline splits "
                             "tensors only (no SequenceParallel layout matching autohybrid's)")
    if mesh.pp > 1:
        if mesh.dp > 1 or mesh.tp > 1:
            return Choice("n/a", f"pipeline composed with dp/tp ({mesh.describe()}): "
                                 "no hand-written pipelining × DDP/DTensor baseline")
        return _choose_pipeline(plan, model)
    if mesh.tp > 1:
        problem = tp_problem(model, mesh.tp)
        if problem:
            return Choice("n/a", problem)
        if mesh.dp == 1:
            return Choice("DTensor")
        if plan.zero in (2, 3):
            return Choice("FSDP2+DTensor")
        return Choice("n/a", f"dp×tp with ZeRO {plan.zero}: DDP does not take DTensor "
                             "parameters; torch's 2-D composition is FSDP2 + DTensor, the "
                             "counterpart of ZeRO 2/3")
    if mesh.dp > 1:
        return Choice(DP_BASELINES[plan.zero])
    return Choice("n/a", "a single rank: nothing to parallelize (eager is the baseline)")


def _choose_pipeline(plan: Any, model: nn.Module) -> Choice:
    if plan.schedule not in PIPELINE_SCHEDULES or plan.virtual_stages != 1:
        return Choice("n/a", f"schedule {plan.schedule!r} with {plan.virtual_stages} stage(s) "
                             f"per rank: the hand-written pipeline covers "
                             f"{' and '.join(PIPELINE_SCHEDULES)} with one stage per rank")
    if _tied(model):
        return Choice("n/a", "tied weights: torch.distributed.pipelining's pipeline() does "
                             "not tie parameters across stages (build the model untied)")
    if not plan.stage_boundaries:
        return Choice("n/a", "the plan records no stage boundaries to split at")
    return Choice("pipelining")


def _tied(model: nn.Module) -> bool:
    return len(list(model.named_parameters(remove_duplicate=False))) > \
        len(list(model.parameters()))


def _kind(model: nn.Module) -> str | None:
    return getattr(model, "kind", None) if hasattr(model, "blocks") else None


# ---------------------------------------------------------------------- tensor parallel
def tp_problem(model: nn.Module, tp: int) -> str:
    """Why the DTensor baseline cannot split `model` `tp` ways ("" when it can)."""
    kind = _kind(model)
    if kind not in ("gpt", "llama"):
        return (f"tensor parallelism of a {type(model).__name__}: the hand-written DTensor "
                "baseline knows the module names of the zoo GPT and Llama only")
    attn = model.blocks[0].attn if len(model.blocks) else None
    heads = [attn.heads] + ([attn.kv_heads] if kind == "llama" else [])
    if attn is None or any(h % tp for h in heads):
        return f"attention heads {heads} are not divisible by tp={tp}"
    return ""


def _qkv_rows_by_rank(hidden: int, tp: int) -> torch.Tensor:
    """Row order of a fused qkv weight whose contiguous Shard(0) chunk r holds q, k, v of
    rank r's heads — autohybrid's ShardSpec(chunks=3) layout. ColwiseParallel shards the
    fused rows contiguously, which would give rank 0 all of q and half of k."""
    part = hidden // tp
    order = [c * hidden + r * part + i for r in range(tp) for c in range(3) for i in range(part)]
    return torch.tensor(order)


def _block_styles(kind: str, i: int) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    col, row = ColwiseParallel, RowwiseParallel
    if kind == "gpt":
        layers = {"attn.qkv": col, "attn.proj": row, "mlp.fc": col, "mlp.proj": row}
    else:
        layers = {"attn.wq": col, "attn.wk": col, "attn.wv": col, "attn.wo": row,
                  "mlp.gate": col, "mlp.up": col, "mlp.down": row}
    return {f"blocks.{i}.{name}": style() for name, style in layers.items()}


def parallelize_dtensor(model: nn.Module, mesh: Any) -> None:
    """Megatron tp of a zoo GPT or Llama with DTensor; the math equals the unsplit model's.

    - GPT attn.qkv, mlp.fc / Llama wq, wk, wv, gate, up: ColwiseParallel (weight and bias
      Shard(0), input Replicate, local output). GPT's fused qkv rows are first permuted so
      that rank r's contiguous shard is [q_r, k_r, v_r] (a re-parametrization: same
      function, and SGD/AdamW commute with it); each attention then sees its local heads
      (heads //= tp, as torchtitan does), so the model's views stay unchanged.
    - GPT attn.proj, mlp.proj / Llama wo, down: RowwiseParallel (weight Shard(1), bias
      Replicate, all-reduce of the partial output, local output).
    - tok_emb: RowwiseParallel(input_layouts=Replicate()) — weight Shard(0) over the
      vocabulary (masked lookup, all-reduce): the vocabulary-parallel embedding.
    - lm_head: ColwiseParallel(output_layouts=Shard(-1), use_local_output=False) — logits
      split over the vocabulary for `loss_parallel()`'s cross-entropy (never gathered).
      A head tied to tok_emb is re-tied afterwards (parallelize_module gives each module a
      new DTensor parameter; both are Shard(0) on the same mesh, the same local shard).
    - position embedding, norms: replicated plain tensors (as autohybrid keeps them).
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    tp = mesh.size()
    problem = tp_problem(model, tp)
    if problem:
        raise BaselineError(f"parallelize_dtensor: {problem}")
    kind, tied = _kind(model), _tied(model)
    plan = {"tok_emb": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i, block in enumerate(model.blocks):
        attn = block.attn
        if kind == "gpt":
            with torch.no_grad():
                order = _qkv_rows_by_rank(attn.hidden, tp)
                attn.qkv.weight.copy_(attn.qkv.weight[order])
                attn.qkv.bias.copy_(attn.qkv.bias[order])
            attn.hidden //= tp
        else:
            attn.kv_heads //= tp
        attn.heads //= tp
        plan.update(_block_styles(kind, i))
    parallelize_module(model, mesh, plan)
    if tied:
        model.lm_head.weight = model.tok_emb.weight  # re-tie


def _global_mean(loss: torch.Tensor, group: Any = None) -> torch.Tensor:
    """The global batch's loss from equal slices' mean losses, on every rank."""
    loss = loss.detach().clone()
    dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=group)
    return loss


class DTensorTP:
    """Megatron tp with DTensor (`parallelize_dtensor`) on a 1-D mesh of every rank; the
    loss is `loss_fn` under `loss_parallel()` on vocabulary-split logits."""

    def __init__(self, model: nn.Module, loss_fn: LossFn, optimizer: Callable,
                 device: torch.device | str = "cpu"):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),),
                                mesh_dim_names=("tp",))
        model.to(device)
        parallelize_dtensor(model, mesh)
        self.model, self.loss_fn = model, loss_fn
        self.optimizer = optimizer(model.parameters())
        self.rank = dist.get_rank()

    def train_step(self, inputs: tuple, targets: Any) -> torch.Tensor:
        from torch.distributed.tensor.parallel import loss_parallel

        self.optimizer.zero_grad(set_to_none=True)
        logits = self.model(*_as_tuple(inputs))
        with loss_parallel():
            loss = self.loss_fn(logits, targets)
            loss.backward()
        self.optimizer.step()
        return loss.to_local().detach()  # replicated: every rank holds the global loss

    step = train_step  # the name benchmarks/ use


# ---------------------------------------------------------------------- data parallel
def _blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated layers FSDP2 wraps one by one (zoo transformers' `blocks`, else none:
    the root alone)."""
    return list(getattr(model, "blocks", ()) or ())


def torch_dp(stage: int, model: nn.Module, optimizer: Optim, *, mesh: Any = None,
             bucket_mb: float = BUCKET_MB) -> tuple[nn.Module, torch.optim.Optimizer]:
    """torch's counterpart of ZeRO `stage` for `model`, as users write it: (module,
    optimizer). `mesh`: the 1-D DeviceMesh FSDP2 shards over (default: every rank)."""
    if stage not in DP_BASELINES:
        raise BaselineError(f"torch_dp: ZeRO stage must be 0–3, got {stage!r}")
    if stage < 2:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
        if stage == 0:
            return ddp, optimizer(ddp.parameters())
        return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=optimizer.cls,
                                            **optimizer.kwargs)
    from torch.distributed.fsdp import fully_shard

    # FSDP2's default (None) reshards the blocks after forward, not the root (whose
    # parameters backward needs first); False keeps every gathered block until backward ends
    reshard = None if stage == 3 else False
    for block in _blocks(model):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model, optimizer(model.parameters())


def _no_sync(module: nn.Module, last: bool):
    """Skip the gradient sync of every microbatch but the last (DDP's `no_sync`, FSDP2's
    `set_requires_gradient_sync`), as autohybrid accumulates microbatches."""
    import contextlib

    if last:
        return contextlib.nullcontext()
    if hasattr(module, "no_sync"):
        return module.no_sync()
    if hasattr(module, "set_requires_gradient_sync"):
        @contextlib.contextmanager
        def unsynced():
            module.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                module.set_requires_gradient_sync(True)
        return unsynced()
    return contextlib.nullcontext()


class TorchDataParallel:
    """One step of torch's dp counterpart of ZeRO `stage` on this rank's slice of the
    global batch, in `microbatches` gradient-accumulation steps (the loss of each scaled
    by 1/microbatches, the gradients synchronized in the last)."""

    def __init__(self, stage: int, model: nn.Module, loss_fn: LossFn, optimizer: Optim, *,
                 microbatches: int = 1, bucket_mb: float = BUCKET_MB,
                 device: torch.device | str = "cpu"):
        model.to(device)
        self.model, self.optimizer = torch_dp(stage, model, optimizer, bucket_mb=bucket_mb)
        self.loss_fn, self.microbatches = loss_fn, microbatches
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device(device)

    def train_step(self, inputs: tuple, targets: Any) -> torch.Tensor:
        inputs = tuple(_slice(x, self.rank, self.world) for x in _as_tuple(inputs))
        targets = _slice(targets, self.rank, self.world)
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        m = self.microbatches
        for k in range(m):
            with _no_sync(self.model, last=k == m - 1):
                loss = self.loss_fn(self.model(*(_slice(x, k, m) for x in inputs)),
                                    _slice(targets, k, m)) / m
                loss.backward()
            total += loss.detach()
        self.optimizer.step()
        return _global_mean(total)

    step = train_step  # the name benchmarks/ use


def _as_tuple(inputs: Any) -> tuple:
    """A model's positional inputs: one tensor or a tuple of them."""
    return inputs if isinstance(inputs, tuple) else (inputs,)


def _slice(x: Any, index: int, parts: int) -> Any:
    """Part `index` of `parts` equal parts of a batch along dim 0."""
    if not isinstance(x, torch.Tensor):
        raise BaselineError(f"baselines slice tensors along the batch; got {type(x).__name__}")
    if x.shape[0] % parts:
        raise BaselineError(f"a batch of {x.shape[0]} does not split into {parts} equal parts")
    return x.chunk(parts)[index]


class FSDPTensorParallel:
    """dp × tp the way torchtitan composes them: DTensor tp (`parallelize_dtensor`) on the
    "tp" axis of a 2-D DeviceMesh (dp, tp), then FSDP2 over its "dp" axis (ZeRO 3, or 2
    without resharding after forward); each dp row trains on its slice of the batch."""

    def __init__(self, stage: int, model: nn.Module, loss_fn: LossFn, optimizer: Optim,
                 dp: int, tp: int, device: torch.device | str = "cpu"):
        from torch.distributed.device_mesh import init_device_mesh

        if stage not in (2, 3):
            raise BaselineError(f"FSDP2+DTensor is the counterpart of ZeRO 2/3, not {stage}")
        mesh = init_device_mesh(torch.device(device).type, (dp, tp),
                                mesh_dim_names=("dp", "tp"))
        model.to(device)
        parallelize_dtensor(model, mesh["tp"])
        self.model, self.optimizer = torch_dp(stage, model, optimizer, mesh=mesh["dp"])
        self.loss_fn, self.dp = loss_fn, dp
        self.dp_rank = mesh["dp"].get_local_rank()
        self.dp_group = mesh["dp"].get_group()
        self.rank = dist.get_rank()

    def train_step(self, inputs: tuple, targets: Any) -> torch.Tensor:
        from torch.distributed.tensor.parallel import loss_parallel

        inputs = tuple(_slice(x, self.dp_rank, self.dp) for x in _as_tuple(inputs))
        targets = _slice(targets, self.dp_rank, self.dp)
        self.optimizer.zero_grad(set_to_none=True)
        logits = self.model(*inputs)
        with loss_parallel():
            loss = self.loss_fn(logits, targets)
            loss.backward()
        self.optimizer.step()
        return _global_mean(loss.to_local(), self.dp_group)


# ---------------------------------------------------------------------- pipeline parallel
def split_spec(boundaries: tuple[str, ...]) -> dict:
    """autohybrid's layer names ('model.blocks.4', 'model.lm_head') as pipeline() split
    points (the module's own names: 'blocks.4', 'lm_head')."""
    from torch.distributed.pipelining import SplitPoint

    return {b.removeprefix("model."): SplitPoint.BEGINNING for b in boundaries}


def equal_boundaries(layers: int, pp: int) -> tuple[str, ...]:
    """pipeline()'s usual split: pp equal runs of blocks (`layers % pp == 0`)."""
    if layers % pp:
        raise BaselineError(f"{layers} blocks do not split into {pp} equal runs")
    return tuple(f"model.blocks.{k * layers // pp}" for k in range(1, pp))


class HandPipeline:
    """torch.distributed.pipelining as a user writes it: pipeline() split at `boundaries`
    (autohybrid's layer names), one stage per rank, `schedule` "1f1b" or "gpipe" over `m`
    microbatches, the optimizer over the stage's parameters. The last stage's loss (the
    mean of the microbatches' losses: equal microbatches) is broadcast to every rank."""

    def __init__(self, model: nn.Module, boundaries: tuple[str, ...], rank: int, pp: int,
                 m: int, example: torch.Tensor, loss_fn: LossFn, optimizer: Callable, *,
                 schedule: str = "1f1b", device: torch.device | str = "cpu"):
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, pipeline

        if schedule not in PIPELINE_SCHEDULES:
            raise BaselineError(f"HandPipeline: schedule must be one of {PIPELINE_SCHEDULES}, "
                                f"got {schedule!r}")
        if len(boundaries) != pp - 1:
            raise BaselineError(f"HandPipeline: {pp} stages need {pp - 1} boundaries, got "
                                f"{list(boundaries)}")
        self.rank, self.pp, self.device = rank, pp, torch.device(device)
        model.to(device)
        example = example.to(device)
        pipe = pipeline(model, mb_args=(_slice(example, 0, m),),
                        split_spec=split_spec(boundaries))
        self.stage = pipe.build_stage(rank, self.device)
        kind = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
        self.schedule = kind(self.stage, m, loss_fn=loss_fn)
        self.optimizer = optimizer(self.stage.submod.parameters())

    def train_step(self, inputs: Any, targets: Any) -> torch.Tensor:
        tokens = _as_tuple(inputs)[0]
        self.optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        if self.rank == 0:
            self.schedule.step(tokens)
        elif self.rank == self.pp - 1:
            self.schedule.step(target=targets, losses=losses)
        else:
            self.schedule.step()
        self.optimizer.step()
        loss = (torch.stack([l.detach() for l in losses]).mean() if losses
                else torch.zeros((), device=self.device))
        dist.broadcast(loss, src=self.pp - 1)
        return loss

    step = train_step  # the name benchmarks/ use


# ---------------------------------------------------------------------- from a plan
def build(choice: Choice, plan: Any, model: nn.Module, loss_fn: LossFn, optimizer: Optim,
          example_inputs: tuple, device: torch.device | str = "cpu") -> Any:
    """The baseline object `choice` names for `plan`, on this rank (call on every rank)."""
    if not choice.available:
        raise BaselineError(f"no baseline for this plan: {choice.reason}")
    mesh = plan.mesh
    if choice.name == "DTensor":
        return DTensorTP(model, loss_fn, optimizer, device)
    if choice.name == "FSDP2+DTensor":
        return FSDPTensorParallel(plan.zero, model, loss_fn, optimizer, mesh.dp, mesh.tp,
                                  device)
    if choice.name == "pipelining":
        return HandPipeline(model, tuple(plan.stage_boundaries), dist.get_rank(), mesh.pp,
                            plan.num_microbatches, example_inputs[0], loss_fn, optimizer,
                            schedule=plan.schedule, device=device)
    if choice.name in DP_BASELINES.values():
        return TorchDataParallel(plan.zero, model, loss_fn, optimizer,
                                 microbatches=plan.num_microbatches, bucket_mb=plan.bucket_mb,
                                 device=device)
    raise BaselineError(f"unknown baseline {choice.name!r}")
