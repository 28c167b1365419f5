"""Dry run at scale: build one rank's program for a large cluster inside one process.

The model lives on the meta device and each mesh axis is bound to torch's fake process
group of its size (`FakeProcessGroup`, no default group is created): no memory is
allocated and no message is sent, but every pass runs exactly as on rank `rank` of the
real job (autohybrid/rewrite.py: the one `rewrite` ah.compile, the report and `autohybrid
inspect` use). The same rewrite is how a plan proves executable (trial.py `PassTrial`:
the search tries candidates best first and drops those a pass rejects); the dry run
keeps the program of its own plan's trial. It then checks that program against the Plan:

- per-rank parameter bytes: Σ over the rewritten graph's parameter placeholders (tied
  parameters once) of their elements × the plan dtype's bytes, against the planner's
  prediction before ZeRO sharding, `ModelProfile.local_params(layers, tp, ep, ...)` ×
  dtype bytes (search/pricing.py; the Plan's `predicted.memory.params` is that divided by
  dp under ZeRO-3, which is checked too). Element counts are compared, so a model
  captured in float32 still checks a bfloat16 plan; built in the plan dtype the graph's
  own bytes (`graph_param_bytes`) agree as well;
- every parameter placeholder's fake shape against its ShardSpec (whole when not split);
- the collectives the passes inserted (autohybrid ops, counted by name) against the
  planner's tp layout: a `tp_copy` per distinct input of a column-parallel linear (the
  backward all-reduce the planner prices), a `tp_reduce` per row-parallel linear and per
  vocabulary-parallel embedding, a `vocab_parallel_embedding` per split embedding, a
  `vocab_parallel_cross_entropy` per class loss on split logits, a `tp_gather` per
  all-gather the planner prices (none for Megatron layouts), a `tp_replicated` per key /
  value parameter replicated over tp (grouped-query attention with tp > KV heads), a
  `moe_experts` per MoE layer whose experts ep or tp splits (its all-to-alls or
  all-reduces; whole experts only compute). A whole-batch loss term's `batch_sum` over
  dp is not the tp layout's and is not counted.

Pipeline parallelism has no pass yet, so plans with pp > 1 are refused; plans with
sequence parallelism are refused too, as the collective counts checked here are those of
tp without sp (the sp pass is checked by the equivalence and graph tests). When no plan is given, the dry run
searches one from the training graph (its `model_hash` is that graph's hash: the dry run
does not capture the forward graph, which only `ah.compile`'s plan check needs),
preferring plans the runtime can execute and falling back to any plan when none fits.

Run it for GPT-3 175B on 1024 A100s (128 DGX nodes, tp 8, global batch 1536)::

    python -m autohybrid.runtime.dry_run --model gpt3-175b --nodes 128 --rank 517

A real process group in this process is never touched: the dry run refuses to start
when one exists, creates none, and restores the axis bindings when done.
"""
from __future__ import annotations

import argparse
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from ..capture import CapturedGraph, as_tuple, capture
from ..cluster import Cluster
from ..cost.memory import dtype_bytes, training_state
from ..errors import AutohybridError, NoPlanFitsError, NotExecutableError, PlanError
from ..graph import AH_PARAM, VAL, is_param, op_name, schema_args
from ..passes.expert_parallel import moe_nodes
from ..passes.fusion import inline_where_eager
from ..plan import Constraints, Plan
from ..planning import make_plan
from ..program import RankProgram
from ..rewrite import rewrite
from ..search.sharding import _CLASS_LOSSES, TensorParallelLayout, linear_parts
from ..search.space import ModelProfile
from ..search.space import profile as model_profile
from ..search.tp_choice import Rates
from ..trial import PassTrial
from .pretune import program_graphs

#: The autohybrid ops that talk over the tp axis, as counted in a rank's program.
COLLECTIVES = ("tp_copy", "tp_reduce", "tp_gather", "tp_split", "tp_replicated",
               "vocab_parallel_embedding", "vocab_parallel_cross_entropy",
               "sp_reduce_scatter", "sp_gather")
#: ops counted as the collective they carry: the chunked ones (passes/collective_matmul.py)
#: and the wait of a collective the overlap pass split (its start is not counted)
STANDS_FOR = {"cm_gather_linear": "sp_gather", "cm_linear_reduce_scatter": "sp_reduce_scatter",
              **{f"{op}_wait": op for op in ("tp_reduce", "tp_gather", "sp_gather",
                                             "sp_reduce_scatter")}}
SPLIT_STARTS = {f"{op}_start" for op in ("tp_reduce", "tp_gather", "sp_gather",
                                         "sp_reduce_scatter")}
#: autohybrid ops that only compute (passes/fusion.py's generated kernels, the weight of
#: a whole-batch loss term): not counted
COMPUTE_ONLY = {"fused_region", "term_weight"}
#: collectives over dp, which the planner's tp layout does not list (a whole-batch loss
#: term's sums: passes/batch_stats.py): not counted
DP_ONLY = {"batch_sum"}


@dataclass
class DryRunReport:
    """Rank `rank`'s program for `plan` and how it compares with the Plan's predictions."""

    plan: Plan
    plan_note: str                     # how the plan was obtained (and whether executable)
    rank: int
    coords: tuple[int, int, int]       # (pp, dp, tp)
    param_elements: int                # this rank's parameter elements (tied once)
    param_bytes: int                   # param_elements × plan dtype bytes
    graph_param_bytes: int             # at the dtype the graph was captured in
    predicted_param_elements: float    # planner: local_params(all layers, tp, ep)
    predicted_param_bytes: int         # before ZeRO sharding
    predicted_memory_params: int       # plan.predicted.memory.params (ZeRO-3 divides it)
    expected_memory_params: int        # training_state(param_elements, ...).params
    collectives: dict[str, int]
    expected_collectives: dict[str, int]
    shape_mismatches: list[str]        # placeholders whose shape is not their ShardSpec's
    largest_param: tuple[str, tuple[int, ...]]   # (canonical name, local shape)
    largest_full_param: tuple[str, tuple[int, ...]]
    timings: dict[str, float]
    program: RankProgram = field(repr=False)
    local_shapes: dict[str, tuple[int, ...]] = field(repr=False, default_factory=dict)

    @property
    def gm(self) -> fx.GraphModule:
        return self.program.gm

    @property
    def bytes_match(self) -> bool:
        return (self.param_elements == round(self.predicted_param_elements)
                and self.expected_memory_params == self.predicted_memory_params)

    @property
    def collectives_match(self) -> bool:
        return self.collectives == self.expected_collectives

    @property
    def ok(self) -> bool:
        return self.bytes_match and self.collectives_match and not self.shape_mismatches

    def summary(self) -> str:
        p, g = self.plan, 2**30
        lines = [
            f"dry run of rank {self.rank} (pp, dp, tp = {self.coords}) on {p.cluster}",
            f"  plan: {p.mesh.describe()}, microbatch {p.microbatch_size}×"
            f"{p.num_microbatches}, zero{p.zero}, recompute={p.recompute}, {p.dtype}, "
            f"{p.optimizer} — {self.plan_note}",
            f"  parameters on this rank: {self.param_elements:,} elements = "
            f"{self.param_bytes:,} B ({self.param_bytes / g:.2f} GiB) at {p.dtype}",
            f"  planner's prediction before ZeRO: {self.predicted_param_elements:,.0f} "
            f"elements = {self.predicted_param_bytes:,} B  "
            f"[{'equal' if self.bytes_match else 'DIFFERENT'}]",
            f"  plan.predicted.memory.params (zero{p.zero}): {self.predicted_memory_params:,}"
            f" B; from this rank's elements: {self.expected_memory_params:,} B",
            f"  largest parameter here: {self.largest_param[0]} {self.largest_param[1]} "
            f"(whole: {self.largest_full_param[0]} {self.largest_full_param[1]})",
            "  collectives (graph / plan): " + ", ".join(
                f"{k} {self.collectives.get(k, 0)}/{self.expected_collectives.get(k, 0)}"
                for k in sorted(set(self.collectives) | set(self.expected_collectives)))
            + f"  [{'equal' if self.collectives_match else 'DIFFERENT'}]",
            f"  parameter shapes vs ShardSpecs: "
            f"{'all equal' if not self.shape_mismatches else self.shape_mismatches}",
            "  times: " + ", ".join(f"{k} {v:.2f} s" for k, v in self.timings.items()),
        ]
        return "\n".join(lines)


def dry_run(model: nn.Module, cluster: Cluster, example_inputs: Any,
            loss_fn: Callable | None = None, example_targets: Any = None, *,
            plan: Plan | None = None, rank: int = 0, global_batch: int | None = None,
            dtype: torch.dtype | str | None = None, constraints: Constraints | None = None,
            optimizer: str = "adam") -> DryRunReport:
    """Build rank `rank`'s training program for `cluster` in this process and check it.

    `model` should live on the meta device (any device works; nothing runs). Without
    `plan`, one is searched with `global_batch`, `dtype`, `constraints` and `optimizer`
    (executable plans first, else the best plan that fits).
    """
    if dist.is_initialized():
        raise AutohybridError("dry_run needs a process without a process group: it "
                              "initializes a fake one of the plan's world size")
    timings: dict[str, float] = {}
    start = time.perf_counter()
    inputs = as_tuple(example_inputs)
    train = capture(model, inputs, loss_fn, example_targets)
    timings["capture"] = time.perf_counter() - start

    start = time.perf_counter()
    note = "given"
    trial = PassTrial(train, rank=rank, keep=True)  # its program of the chosen plan is ours
    if plan is None:
        args = (train, train, model, cluster, inputs, global_batch, dtype, constraints,
                optimizer)
        try:
            plan = make_plan(*args, executable_only=True, trial=trial)
            note = "searched: executable by the runtime today"
        except (NoPlanFitsError, NotExecutableError) as exc:
            plan = make_plan(*args, executable_only=False, trial=trial)
            why = "; ".join(plan.not_executable_because) or "executable"
            note = (f"searched: no executable plan ({type(exc).__name__}), best plan that "
                    f"fits ({why}) — the dry run checks its tp program")
    _check_plan(plan, cluster, rank)
    profile = model_profile(train.gm, train.dim_roles, Rates.of(cluster))
    program = trial.kept(plan)
    passes = sum(program.pass_seconds.values()) if program is not None else 0.0
    timings["plan"] = time.perf_counter() - start - passes
    if program is None:
        program = rewrite(train, plan, rank, fake_groups=True)
    if program.fused_regions:  # as the runtime runs them on this cluster's device
        inline_where_eager(program_graphs(program), torch.device(cluster.device_type))
    timings["passes"] = sum(program.pass_seconds.values())

    start = time.perf_counter()
    report = _check(train, program, profile, note, timings)
    timings["check"] = time.perf_counter() - start
    return report


def _check_plan(plan: Plan, cluster: Cluster, rank: int) -> None:
    if plan.world_size != cluster.world_size:
        raise PlanError(f"the plan has {plan.world_size} ranks, the cluster "
                        f"{cluster.world_size}")
    if not 0 <= rank < plan.world_size:
        raise PlanError(f"rank {rank} is outside the plan's {plan.world_size} ranks")
    if plan.mesh.pp > 1 or plan.mesh.sp:
        raise PlanError(f"the dry run checks tensor-parallel programs: {plan.mesh.describe()} "
                        "uses pipeline or sequence parallelism (pipelines have no pass yet; "
                        "sp's collectives are checked by the graph tests); pin pp=1, sp=False")


def _params(gm: fx.GraphModule) -> dict[str, fx.Node]:
    """Parameter placeholders by canonical name (a tied parameter once)."""
    out: dict[str, fx.Node] = {}
    for node in gm.graph.nodes:
        if is_param(node):
            out.setdefault(node.meta.get(AH_PARAM, node.name), node)
    return out


def _check(train: CapturedGraph, program: RankProgram, profile: ModelProfile, note: str,
           timings: dict[str, float]) -> DryRunReport:
    gm, plan, rank = program.gm, program.plan, program.rank
    full = {k: tuple(int(s) for s in n.meta[VAL].shape) for k, n in _params(train.gm).items()}
    local_nodes = _params(gm)
    local = {k: tuple(int(s) for s in n.meta[VAL].shape) for k, n in local_nodes.items()}
    specs = program.param_shards
    mismatches = []
    for key, shape in full.items():
        want = specs[key].local_shape(shape) if key in specs else tuple(shape)
        if local.get(key) != want:
            mismatches.append(f"{key}: {local.get(key)} != {want}")
    elements = sum(math.prod(s) for s in local.values())
    graph_bytes = sum(math.prod(local[k]) * local_nodes[k].meta[VAL].element_size()
                      for k in local)
    width = dtype_bytes(plan.dtype)
    mesh = plan.mesh
    predicted = profile.local_params(profile.layers, mesh.tp, mesh.ep,
                                     profile.expert_tp(mesh.tp, mesh.sp))
    expected_memory = training_state(elements, plan.dtype, plan.optimizer, plan.zero,
                                     plan.mesh.dp).params
    counts = Counter()
    for sub in gm.modules():  # recomputed regions are submodules
        if not isinstance(sub, fx.GraphModule):
            continue
        for node in sub.graph.nodes:
            if node.op == "call_function" and op_name(node).startswith("autohybrid."):
                name = op_name(node).split(".")[1]
                if name == "moe_experts" and not moe_exchanges(node):
                    continue   # experts whole on every rank: compute only
                if name not in SPLIT_STARTS | COMPUTE_ONLY | DP_ONLY:
                    counts[STANDS_FOR.get(name, name)] += 1
    biggest = lambda shapes: max(shapes.items(), key=lambda kv: (math.prod(kv[1]), kv[0]))
    return DryRunReport(
        plan=plan, plan_note=note, rank=rank, coords=plan.mesh.coords(rank),
        param_elements=elements, param_bytes=elements * width, graph_param_bytes=graph_bytes,
        predicted_param_elements=predicted, predicted_param_bytes=round(predicted * width),
        predicted_memory_params=plan.predicted.memory.params,
        expected_memory_params=expected_memory,
        collectives=dict(counts),
        expected_collectives=expected_collectives(
            train.gm, profile.layout, plan.mesh.tp, profile.kv_heads,
            len(moe_nodes(train.gm)) if mesh.ep > 1 or profile.expert_tp(mesh.tp, mesh.sp)
            else 0),
        shape_mismatches=mismatches, largest_param=biggest(local),
        largest_full_param=biggest(full), timings=timings, program=program,
        local_shapes=local)


def moe_exchanges(node: fx.Node) -> bool:
    """Whether a `moe_experts` node communicates: its experts split over ep (all-to-all)
    or over tp (all-reduce: expert tensor parallelism)."""
    kw = schema_args(node)
    return bool(kw.get("axis")) or bool(kw.get("tp_axis"))


def expected_collectives(gm: fx.GraphModule, layout: TensorParallelLayout, tp: int,
                         kv_heads: int | None = None, moe: int = 0) -> dict[str, int]:
    """The autohybrid ops rank programs should hold for the planner's tp `layout` of the
    captured graph `gm` (see the module docstring), and `moe` MoE layers whose experts
    exchange tokens or sums (ep, expert tensor parallelism); empty when tp is 1 and
    `moe` is 0."""
    out: Counter = Counter({"moe_experts": moe})
    if tp == 1:
        return {k: v for k, v in out.items() if v}
    nodes = {n.name: n for n in gm.graph.nodes}
    inputs = {linear_parts(nodes[name]).x for name, role in layout.linear_roles.items()
              if role == "column"}
    out["tp_copy"] = len(inputs)
    for c in layout.collectives:
        name = op_name(nodes[c.node])
        if c.kind == "all_gather":
            out["tp_gather"] += 1
        elif c.direction == "backward":
            continue  # a column linear's input: counted above
        elif name == "aten.embedding.default":
            out["vocab_parallel_embedding"] += 1
            out["tp_reduce"] += 1
        elif name in _CLASS_LOSSES:
            out["vocab_parallel_cross_entropy"] += 1
        else:
            out["tp_reduce"] += 1  # row-parallel linear
    if kv_heads and min(tp, kv_heads) < tp:
        out["tp_replicated"] += len(layout.kv_params)
    return {k: v for k, v in out.items() if v}


# ---------------------------------------------------------------------- command line
def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over (batch, seq, vocab) logits."""
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             targets.reshape(-1))


def run_preset(name: str = "gpt3-175b", cluster: Cluster | None = None, *, rank: int = 517,
               global_batch: int = 1536, tp: int = 8, seq: int | None = None,
               dtype: torch.dtype = torch.bfloat16) -> DryRunReport:
    """The dry run of a language-model preset (built on meta in `dtype`), tp pinned,
    pp=1, sp=False, ZeRO 2 (the optimizer state and gradients sharded over dp, the tp
    program's parameters whole on each rank); the inputs are one sequence (batch and
    sequence are symbolic)."""
    from ..models import presets

    config = presets.get_preset(name)
    model = config.build(device="meta", dtype=dtype)
    if cluster is None:
        cluster = Cluster.preset("dgx-a100-80gb", nodes=128)
    seq = seq or config.kwargs.get("seq", 2048)
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    return dry_run(model, cluster, (ids,), lm_loss, (ids,), rank=rank,
                   global_batch=global_batch,
                   constraints=Constraints(tp=tp, pp=1, sp=False, zero=2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt3-175b")
    parser.add_argument("--cluster", default="dgx-a100-80gb")
    parser.add_argument("--nodes", type=int, default=128)
    parser.add_argument("--rank", type=int, default=517)
    parser.add_argument("--global-batch", type=int, default=1536)
    parser.add_argument("--tp", type=int, default=8)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    report = run_preset(args.model, Cluster.preset(args.cluster, nodes=args.nodes),
                        rank=args.rank, global_batch=args.global_batch, tp=args.tp)
    print(report.summary())
    print(f"  total {time.perf_counter() - start:.2f} s; {'OK' if report.ok else 'MISMATCH'}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
