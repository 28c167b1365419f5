"""Plain-text reports: a Plan summary (CLI, `ah.plan`) and `compiled.explain()`."""
from __future__ import annotations

from typing import Any

import torch.fx as fx

from ..graph import op_name
from ..plan import Plan

_GiB = 2**30


def format_plan(plan: Plan) -> str:
    """A Plan as a few readable lines: mesh, batch split, predictions, alternatives."""
    p, m = plan.predicted, plan.predicted.memory
    lines = [
        f"plan for {plan.cluster}",
        f"  mesh            {plan.mesh.describe()}  ({plan.world_size} ranks, model graph "
        f"{plan.model_hash})",
        f"  batch           global {plan.global_batch} = dp {plan.mesh.dp} × microbatch "
        f"{plan.microbatch_size} × {plan.num_microbatches} microbatches",
        f"  dtype           {plan.dtype}, optimizer state {plan.optimizer}, ZeRO {plan.zero}, "
        f"recompute {plan.recompute}",
        f"  gradient sync   {plan.collective_algorithm} all-reduce in {plan.bucket_mb:g} MB "
        "buckets, " + ("after the pipeline's step" if plan.mesh.pp > 1
                       else "launched during backward"),
        f"  step time       {p.step_time_s * 1e3:.2f} ms predicted (compute "
        f"{p.compute_s * 1e3:.2f} ms, communication {p.comm_s * 1e3:.2f} ms of which "
        f"{p.exposed_comm_s * 1e3:.2f} ms exposed), MFU {p.mfu * 100:.1f} %",
        f"  memory / rank   {m.total / _GiB:.3f} GiB of {p.device_memory_bytes / _GiB:.1f} GiB "
        f"(parameters {m.params / _GiB:.3f}, gradients {m.grads / _GiB:.3f}, optimizer "
        f"{m.optimizer / _GiB:.3f}, activations {m.activations / _GiB:.3f})",
    ]
    if plan.mesh.pp > 1:
        lines.append(f"  pipeline        {plan.schedule}, {plan.num_stages} stages "
                     f"({plan.virtual_stages} per rank on pp ranks {list(plan.stage_ranks())}); "
                     f"stages start at {', '.join(plan.stage_boundaries)}; predicted bubble "
                     f"{p.bubble_fraction * 100:.1f} % of the step")
    if plan.mesh.spatial:
        tiles = " × ".join(map(str, plan.mesh.spatial))
        lines.append(f"  spatial tiles   {tiles} tiles of every activation along dims "
                     f"{list(range(2, 2 + len(plan.mesh.spatial)))} on the tp axis; halos "
                     "exchanged before each convolution and pooling, BatchNorm statistics over "
                     "the tiles and dp, parameters whole on every rank")
    if has_experts_choice(plan):
        lines.append(f"  experts         {experts_text(plan)}")
    if not plan.executable:
        lines.append("  NOT EXECUTABLE: " + "; ".join(plan.not_executable_because))
    if plan.alternatives:
        lines.append("  alternatives (why they lost):")
        for alt in plan.alternatives:
            lines.append(f"    - {alt.summary.split(' |')[0]}: {alt.reason}")
    return "\n".join(lines)


def has_experts_choice(plan: Plan) -> bool:
    """Whether the plan (or one of its alternatives) splits a MoE model's experts."""
    return plan.mesh.ep > 1 or any(a.constraints is not None and (a.constraints.ep or 1) > 1
                                   for a in plan.alternatives)


def experts_text(plan: Plan) -> str:
    """Why the plan splits a MoE model's experts the way it does: against the best listed
    alternative with the other choice of expert parallelism."""
    ep = plan.mesh.ep
    if ep > 1 and plan.experts_stacked:
        what = (f"computed over ep = {ep} of the {plan.mesh.dp} dp ranks: the experts are "
                f"separate parameters (a hand-written loop, folded into one MoE op) that "
                f"every rank holds; each rank computes 1/{ep} of every MoE layer's experts "
                f"for the tokens sent to it by all-to-all and back, in {plan.moe_chunks} "
                f"chunk(s) per MoE layer and microbatch; their gradients are summed over "
                f"all {plan.mesh.dp} dp ranks (zeros where a rank did not compute the expert)")
    elif ep > 1:
        what = (f"split over ep = {ep} of the {plan.mesh.dp} dp ranks: each "
                f"rank holds 1/{ep} of every MoE layer's experts and sends each token to its "
                f"experts' ranks and back by all-to-all, in {plan.moe_chunks} chunk(s) per "
                f"MoE layer and microbatch (a chunk's exchange beside the previous chunk's "
                f"experts; what stays exposed is priced); expert gradients are summed over the "
                f"{plan.mesh.dp // ep} rank(s) holding the same experts")
    else:
        what = ("not split over ep (ep = 1): each rank computes every expert for its own "
                "tokens, no all-to-all")
    if plan.mesh.tp > 1 and not plan.mesh.sp and plan.experts_stacked:
        what += (f"; the {plan.mesh.tp} tp ranks share their tokens, and each computes every "
                 f"expert whole (separate parameters: no expert tensor parallelism)")
    elif plan.mesh.tp > 1 and not plan.mesh.sp:
        what += (f"; the {plan.mesh.tp} tp ranks share their tokens, and each computes its "
                 f"slice of every {'local ' if ep > 1 else ''}expert's intermediate size "
                 f"where tp divides it (expert tensor parallelism)")
    other = next((a for a in plan.alternatives if a.constraints is not None
                  and ((a.constraints.ep or 1) > 1) != (ep > 1)), None)
    if other is None:
        return what
    return (f"{what}; the best plan {'without' if ep > 1 else 'with'} expert parallelism "
            f"({other.summary.split(' |')[0]}) lost: {other.reason}")


def explain(compiled: Any) -> str:
    """What a compiled model does on this rank and why."""
    plan = compiled.plan
    lines = [format_plan(plan), f"this rank: {compiled.rank} at (pp, dp, tp) = {compiled.coords}"]
    for r in plan.placement:
        lines.append(f"  rank {r.rank} → node {r.node}, device {r.device}, (pp, dp, tp) = "
                     f"{plan.mesh.coords(r.rank)}")
    for kind, gm in compiled.graphs.items():
        created: dict[str, int] = {}
        for node in gm.graph.nodes:
            name = node.meta.get("ah_pass")
            if name:
                created[name] = created.get(name, 0) + 1
        graphs = [m for m in gm.modules() if isinstance(m, fx.GraphModule)]  # + recompute regions
        collectives = sorted({op_name(n) for g in graphs for n in g.graph.nodes
                              if n.op == "call_function" and "autohybrid" in op_name(n)})
        program = compiled.programs.get(kind)
        loss_kind = getattr(program, "loss_kind", None) or "-"
        lines.append(f"graph {kind!r}: {len(gm.graph.nodes)} nodes; nodes created by passes "
                     f"{created or 'none'}; autohybrid ops {collectives or 'none'}; "
                     f"loss kind {loss_kind}")
    sharded = getattr(compiled, "sharded", None)
    if plan.mesh.spatial:
        for kind, gm in compiled.graphs.items():
            ops = [op_name(n) for n in gm.graph.nodes]
            count = {k: ops.count(f"autohybrid.{k}.default")
                     for k in ("halo_fetch", "sync_batch_norm", "spatial_gather")}
            lines.append(f"spatial parallelism: the {kind!r} graph has {count['halo_fetch']} "
                         f"halo exchanges, {count['sync_batch_norm']} BatchNorms synced over "
                         f"the tiles and {count['spatial_gather']} gathers where an op needs "
                         "the whole activation; no parameter is split")
    elif sharded is not None:
        mine = sum(p.numel() for p in compiled._trained_params().values())
        whole = sum(p.numel() for p in compiled.model.parameters())
        padded = sorted(n for n, s in sharded.specs.items() if s.padded != s.size)
        fused = sorted(n for n, s in sharded.specs.items() if s.chunks > 1)
        params = dict(compiled.model.named_parameters())
        convs = [s.dim for n, s in sharded.specs.items() if n in params and params[n].dim() >= 3]
        lines.append(f"tensor parallelism: {len(sharded.specs)} parameters split over tp = "
                     f"{plan.mesh.tp}{' with sequence parallelism' if plan.mesh.sp else ''}; "
                     f"this rank holds {mine:,} of {whole:,} parameter elements"
                     + (f"; convolutions split by filters: {convs.count(0)}, by channels: "
                        f"{convs.count(1)}" if convs else "")
                     + (f"; vocabulary padded: {padded}" if padded else "")
                     + (f"; fused projections split block by block: {fused}" if fused else ""))
    split = next((p.pipeline for p in compiled.programs.values() if p.pipeline is not None),
                 None)
    if split is not None:
        ranks = plan.stage_ranks()
        mine = [s.index for s in split.stages if ranks[s.index] == compiled.coords[0]]
        lines.append(f"pipeline stages (this rank runs {mine}):")
        lines += [f"  {stage.describe()}" for stage in split.stages]
        if split.shared_params:
            lines.append(f"  gradients summed across stages (tied weights): {split.shared_params}")
    zero = getattr(compiled, "zero", None)
    if zero is not None:
        held = zero.held_bytes()
        gathers = max((p.zero_gathers for p in compiled.programs.values()), default=0)
        how = {1: "optimizer state sharded; gradients reduce-scattered in the last backward, "
                  "parameters all-gathered after each step",
               2: "optimizer state and gradients sharded (buckets reduce-scattered every "
                  "microbatch); parameters all-gathered after each step",
               3: f"parameters, gradients and optimizer state sharded: "
                  f"{gathers} per-layer gathers in the graph, gradients reduce-scattered in "
                  "backward"}
        lines.append(f"ZeRO-{zero.stage} over dp = {plan.mesh.dp}: {how[zero.stage]}; this "
                     f"rank's shards hold {held['shards']:,} bytes")
    reducer = compiled.executor.reducer
    sizes = [sum(p.numel() * p.element_size() for p in b.params) for b in reducer.buckets]
    when = ("after the schedule's step" if plan.mesh.pp > 1
            and not compiled.executor.pipeline_overlap
            else "during the schedule, as each bucket's gradients become final (from the "
            "second step)" if plan.mesh.pp > 1
            else "as each bucket's gradients become ready")
    verb = "reduce-scattered" if reducer.shards is not None else "all-reduced"
    if sizes:
        lines.append(f"gradient buckets: {len(sizes)} (bytes {sizes}), {verb} over dp = "
                     f"{plan.mesh.dp} {when}")
    return "\n".join(lines)
