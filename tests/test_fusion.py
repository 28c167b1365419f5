"""The fusion pass (passes/fusion.py): which regions it fuses, what it never fuses, and
that training through the fused kernels equals eager training.

Graphs: in a GPT block the residual add joins the layer norm after it (the GELU after
the fc linear stays alone: one op saves nothing); in a Llama block each RMS norm (pow,
mean, add eps, rsqrt, mul) is one region, with the residual add before it, SiLU joins the
product with the up projection, and the rotary embedding's mul, mul, add are one region.
No region holds a matmul, attention, an embedding or a collective, and no path leaves a
region through one and comes back (checked by brute force on the graphs before fusion,
at tp = 1, tp = 2 and tp = 2 with sp, under a fake process group as in the dry run). The
regions are the same on two runs and on both tp ranks; bytes fused < bytes unfused for
each; the pass runs last, inside checkpointed submodules and on every pipeline stage,
and AUTOHYBRID_DISABLE_PASSES=fusion switches it off.

Equivalence: gpt-tiny compiled with the pass on, in float64, the fused regions run as
Triton kernels in the interpreter (TRITON_INTERPRET=1, set before the ranks start, in
fresh processes), 3 steps under SGD and AdamW against eager (loss, gathered gradients,
parameters after each step; tests/_equiv.py), on 1 rank and at tp = 2.
"""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import autohybrid as ah
from _limits import guard
from _equiv import (OPTIMIZERS, Failures, lm_loss, report, train_and_compare, zoo_batches,
                    zoo_loss, zoo_model)
from autohybrid.capture import capture
from autohybrid.graph import op_name, verify
from autohybrid.passes import ORDER, REGISTRY, PassContext, passes_for, run_passes
from autohybrid.passes.fusion import BARRIER_OPS, find_regions, region_bytes
from autohybrid.passes.recompute import checkpoint_region

FUSED = "autohybrid.fused_region.default"
TP2 = ah.Constraints(dp=1, tp=2, pp=1, sp=False)
TP2_SP = ah.Constraints(dp=1, tp=2, pp=1, sp=True)


# ============================================================================ helpers
@functools.lru_cache(maxsize=None)
def _captured(name: str, world: int, constraints: ah.Constraints | None, kind: str):
    model = zoo_model(name)
    inputs, targets = ah.models.example_batch(name, 8, dtype=torch.float64)
    cap = capture(model, inputs, zoo_loss(name), targets, with_loss=kind == "train")
    plan = ah.plan(model, ah.Cluster.local(world), inputs, constraints=constraints)
    return cap, plan


def _rewrite(name: str, constraints: ah.Constraints | None = None, world: int = 1,
             rank: int = 0, fusion: bool = True, kind: str = "train"):
    """(graph after the passes, ctx) of `name`'s train graph for `rank`; with tp > 1 the
    passes run under a fake process group (no processes), as the dry run does them."""
    cap, plan = _captured(name, world, constraints, kind)
    passes = [(n, fn) for n, fn in passes_for(kind) if n != "fusion"]
    passes += [("fusion", REGISTRY["fusion"])] if fusion else []     # last, as in ORDER
    ctx = PassContext(plan=plan, rank=rank, coords=plan.mesh.coords(rank),
                      graph_kind=kind)
    if kind == "train":
        ctx.notes["loss_output_index"] = cap.user_outputs[0]
    if plan.mesh.tp == 1:
        return run_passes(cap.gm, ctx, passes), ctx
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autohybrid.ops import groups
    from autohybrid.runtime.groups import build_mesh
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        build_mesh(plan, "cpu")
        return run_passes(cap.gm, ctx, passes), ctx
    finally:
        groups.clear()
        dist.destroy_process_group()


def _ops(gm: fx.GraphModule) -> list[str]:
    return [op_name(n) for n in gm.graph.nodes if n.op == "call_function"]


def _region_ops(ctx) -> list[tuple[str, ...]]:
    return [tuple(o.split(".")[1] for o in r.ops) for r in ctx.notes["fusion"]]


def _crossing(members: list[fx.Node]) -> fx.Node | None:
    """A node outside `members` on a path from one member to another (brute force: the
    descendants of the members that are also ancestors of a member), else None."""
    inside = set(members)
    below: set[fx.Node] = set()
    stack = [u for m in members for u in m.users if u not in inside]
    while stack:
        n = stack.pop()
        if n not in below:
            below.add(n)
            stack.extend(n.users)
    above: set[fx.Node] = set()
    stack = [a for m in members for a in m.all_input_nodes if a not in inside]
    while stack:
        n = stack.pop()
        if n not in above:
            above.add(n)
            stack.extend(n.all_input_nodes)
    both = [n for n in members[0].graph.nodes if n in below and n in above]
    return both[0] if both else None


def _check_never_across(gm: fx.GraphModule, ctx) -> int:
    """Every region of `gm` (the graph before fusion) holds only element-wise or row
    reduction ATen ops and no path leaves it and comes back; they are the regions the
    pass fused (`ctx` of the run with fusion). The number of regions."""
    regions = find_regions(gm)
    assert regions
    for members in regions:
        for m in members:
            target = m.target
            assert isinstance(target, torch._ops.OpOverload) and target.namespace == "aten", m
            assert op_name(m) not in BARRIER_OPS, m
        outside = _crossing(members)
        assert outside is None, (f"{[m.name for m in members]} fused across "
                                 f"{outside.name} ({op_name(outside)})")
    assert [tuple(m.name for m in r) for r in regions] == \
        [r.nodes for r in ctx.notes["fusion"]]
    return len(regions)


# ============================================================================ the regions
@pytest.mark.timeout(60)
def test_fusion_runs_last_by_default_and_can_be_switched_off(monkeypatch):
    assert ORDER[-1] == "fusion"
    assert passes_for("train")[-1][0] == passes_for("forward")[-1][0] == "fusion"
    cap, plan = _captured("gpt-tiny", 1, None, "train")
    ctx = PassContext(plan=plan, rank=0, coords=(0, 0, 0))
    ctx.notes["loss_output_index"] = cap.user_outputs[0]
    gm = run_passes(cap.gm, ctx, passes_for("train"))
    assert FUSED in _ops(gm) and ctx.notes["fusion"]
    verify(gm, "fusion")
    monkeypatch.setenv("AUTOHYBRID_DISABLE_PASSES", "fusion")
    gm, ctx = _rewrite("gpt-tiny")
    assert FUSED not in _ops(gm) and "fusion" not in ctx.notes


@pytest.mark.timeout(60)
def test_gpt_block_fuses_each_residual_add_with_the_layer_norm_after_it():
    """(embedding sum + ln1), per block (attention residual + ln2), (mlp residual + next
    ln1 / ln_f); the fc's GELU stays alone, every linear and attention stays."""
    before, _ = _rewrite("gpt-tiny", fusion=False)
    gm, ctx = _rewrite("gpt-tiny")
    assert _region_ops(ctx) == [("add", "layer_norm")] * 5
    ops = _ops(gm)
    assert ops.count(FUSED) == 5
    assert "aten.layer_norm.default" not in ops
    assert ops.count("aten.gelu.default") == 2                  # one op: nothing to save
    for kept in ("aten.linear.default", "aten.scaled_dot_product_attention.default",
                 "aten.embedding.default", "aten.cross_entropy_loss.default"):
        assert ops.count(kept) == _ops(before).count(kept), kept
    # the first block's ln2 region reads the residual stream (the previous region's
    # output), the attention projection's output and ln2's weight and bias
    second = [n for n in gm.graph.nodes if op_name(n) == FUSED][1]
    reads = [(op_name(a), a.op) for a in second.args[0]]
    assert reads == [("getitem", "call_function"), ("aten.linear.default", "call_function"),
                     ("p_model_blocks_0_ln2_weight", "placeholder"),
                     ("p_model_blocks_0_ln2_bias", "placeholder")]
    assert op_name(second.args[0][0].args[0]) == FUSED
    # add + ln2 of a block gives 2 outputs (the residual stream, the normed), ln_f only one
    assert [(r.num_inputs, r.num_outputs) for r in ctx.notes["fusion"]] == \
        [(4, 2), (4, 2), (4, 2), (4, 2), (4, 1)]


def _region_with(ctx, *names: str) -> tuple[str, ...]:
    """The node names of the one region that holds all of `names`."""
    found = [r.nodes for r in ctx.notes["fusion"] if set(names) <= set(r.nodes)]
    assert len(found) == 1, (names, [r.nodes for r in ctx.notes["fusion"]])
    return found[0]


@pytest.mark.timeout(60)
def test_llama_block_fuses_rms_norm_silu_times_up_and_rotary():
    before, _ = _rewrite("llama-tiny", fusion=False)
    gm, ctx = _rewrite("llama-tiny")
    by_name = {n.name: n for n in before.graph.nodes}
    # every RMS norm: pow → mean → add eps → rsqrt → mul in one region, with the
    # residual add that feeds it (all but the first, which reads the embedding)
    norms = [n for n in before.graph.nodes if op_name(n) == "aten.rsqrt.default"]
    assert len(norms) == 5
    for i, rsqrt in enumerate(norms):
        mean = rsqrt.args[0].args[0]
        power = mean.args[0]
        x = power.args[0]
        scale = next(u for u in rsqrt.users if op_name(u) == "aten.mul.Tensor")
        region = _region_with(ctx, power.name, mean.name, rsqrt.args[0].name, rsqrt.name,
                              scale.name)
        assert (x.name in region) == (i > 0), (i, x.name, region)   # the residual add
        assert op_name(x) == ("aten.add.Tensor" if i > 0 else "aten.embedding.default")
    # SiLU(gate) * up: one region of two ops per block
    silus = [n for n in before.graph.nodes if op_name(n) == "aten.silu.default"]
    for silu in silus:
        (product,) = silu.users
        assert _region_with(ctx, silu.name, product.name) == (silu.name, product.name)
    # rotary: q·cos + rotate_half(q)·sin (mul, mul, add) for q and k in each block
    cos = next(n for n in before.graph.nodes if op_name(n) == "aten.cos.default")
    for mul_cos in cos.users:
        (add,) = mul_cos.users
        mul_sin = next(a for a in add.all_input_nodes if a is not mul_cos)
        assert _region_with(ctx, mul_cos.name, mul_sin.name, add.name)
    assert len(cos.users) == 2
    ops = _ops(gm)
    assert "aten.silu.default" not in ops and "aten.rsqrt.default" not in ops
    assert ops.count("aten.linear.default") == _ops(before).count("aten.linear.default")
    assert "aten.neg.default" in ops        # rotate_half's neg feeds a cat: alone, unfused


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,constraints,world",
                         [("gpt-tiny", None, 1), ("llama-tiny", None, 1),
                          ("gpt-tiny", TP2, 2), ("llama-tiny", TP2, 2),
                          ("gpt-tiny", TP2_SP, 2)],
                         ids=["gpt", "llama", "gpt-tp2", "llama-tp2", "gpt-tp2-sp"])
def test_nothing_is_fused_across_a_matmul_or_a_collective(name, constraints, world):
    before, _ = _rewrite(name, constraints, world, fusion=False)
    gm, ctx = _rewrite(name, constraints, world)
    count = _check_never_across(before, ctx)
    collectives = [o for o in _ops(before) if o.startswith("autohybrid.")]
    assert (len(collectives) > 0) == (world > 1)
    # every collective and matmul of the graph is still a node of its own
    for o in set(collectives) | {"aten.linear.default"}:
        assert _ops(gm).count(o) == _ops(before).count(o), o
    assert _ops(gm).count(FUSED) == count


class _MatmulBetween(nn.Module):
    """exp feeds a matmul and, with the matmul's result, a product: exp and the product
    may not share a kernel (the path through the matmul leaves and comes back)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        a = x.exp()
        b = a @ self.w
        return (a * b).softmax(-1) + 1.0


@pytest.mark.timeout(60)
def test_a_matmul_between_two_element_wise_ops_splits_them():
    x = torch.randn(4, 8)
    cap = capture(_MatmulBetween(), (x,), with_loss=False)
    regions = [[op_name(m).split(".")[1] for m in r] for r in find_regions(cap.gm)]
    assert regions == [["mul", "softmax", "add"]]     # exp alone stays unfused


@pytest.mark.timeout(60)
def test_regions_are_the_same_on_every_run_and_every_tp_rank():
    summary = lambda ctx: [(r.nodes, r.key) for r in ctx.notes["fusion"]]
    _, first = _rewrite("llama-tiny")
    _, second = _rewrite("llama-tiny")
    assert summary(first) == summary(second)
    _, rank0 = _rewrite("gpt-tiny", TP2, 2, rank=0)
    _, rank1 = _rewrite("gpt-tiny", TP2, 2, rank=1)
    assert summary(rank0) == summary(rank1) and summary(rank0)


@pytest.mark.timeout(60)
def test_a_region_is_fused_only_when_it_moves_fewer_bytes():
    """The block's add + ln2 at batch 8, seq 16, hidden 32, float64: fused, the kernel
    reads the residual, the attention output, the norm's weight and bias and writes the
    sum and the normed; unfused the add reads two and writes one, then the norm reads it
    again. Single ops (GELU) save nothing and are never fused."""
    before, _ = _rewrite("gpt-tiny", fusion=False)
    _, ctx = _rewrite("gpt-tiny")
    act, vec = 8 * 16 * 32 * 8, 32 * 8
    region = ctx.notes["fusion"][1]
    assert region.ops == ("aten.add.Tensor", "aten.layer_norm.default")
    assert (region.bytes_fused, region.bytes_unfused) == (4 * act + 2 * vec,
                                                          5 * act + 2 * vec)
    assert all(r.bytes_fused < r.bytes_unfused for r in ctx.notes["fusion"])
    members = [n for n in before.graph.nodes if n.name in region.nodes]
    fused, unfused = region_bytes(members)
    assert str(fused).count("s") and str(unfused).count("s")    # symbolic in batch, seq
    # with a cost model that never sees a saving, nothing is fused
    assert not find_regions(before, profitable=lambda members: False)
    gelu = [n for n in before.graph.nodes if op_name(n) == "aten.gelu.default"]
    assert all(n.name not in r.nodes for n in gelu for r in ctx.notes["fusion"])


@pytest.mark.timeout(60)
def test_fusion_reaches_into_checkpointed_regions_and_pipeline_stages():
    gm, ctx = _rewrite("gpt-tiny", ah.Constraints(recompute="full"))
    calls = [n for n in gm.graph.nodes if n.target is checkpoint_region]
    assert len(calls) == 2
    for call in calls:   # each block's attention residual + ln2; the block's ends are
        sub = getattr(gm, call.args[0].target)     # cut: ln1 and the mlp residual alone
        assert _ops(sub).count(FUSED) == 1
        assert _ops(sub).count("aten.layer_norm.default") == 1
    assert FUSED not in _ops(gm)       # nothing spans a checkpointed region's boundary
    assert [r.graph for r in ctx.notes["fusion"]] == ["rank/ah_recompute_0",
                                                       "rank/ah_recompute_1"]
    _, ctx = _rewrite("gpt-tiny", ah.Constraints(pp=2, dp=1, tp=1, schedule="1f1b"), 2)
    stages = ctx.notes["pipeline"].stages
    assert all(FUSED in _ops(s.gm) for s in stages)
    assert {r.graph for r in ctx.notes["fusion"]} >= {"stage0", "stage1"}
    gm, ctx = _rewrite("gpt-tiny", kind="forward")
    assert _ops(gm).count(FUSED) == 5


@pytest.mark.timeout(120)
@pytest.mark.parametrize("constraints", [None, ah.Constraints(recompute="full")],
                         ids=["plain", "checkpointed"])
def test_inlined_regions_are_the_unfused_graph_again(constraints):
    """`inline_regions` (what a CPU rank without Triton's interpreter runs: the regions'
    eager path would recompute them in backward) leaves no region, in checkpointed
    submodules too, the unfused graph's ops, and its outputs and gradients."""
    from autohybrid.passes.fusion import inline_regions

    gm, _ = _rewrite("gpt-tiny", constraints)
    ref, _ = _rewrite("gpt-tiny", constraints, fusion=False)
    everything = lambda g: [o for m in g.modules() if isinstance(m, fx.GraphModule)  # noqa: E731
                            for o in _ops(m) if o != "getitem"]
    regions = everything(gm).count(FUSED)
    assert regions > 0 and inline_regions(gm) == regions
    assert FUSED not in everything(gm)
    assert sorted(everything(gm)) == sorted(everything(ref))
    torch.manual_seed(0)
    shape = lambda v: [d if isinstance(d, int) else d.node.hint for d in v.shape]  # noqa: E731
    args = [torch.randn(shape(v), dtype=v.dtype, requires_grad=True) if v.is_floating_point()
            else torch.randint(0, 64, shape(v), dtype=v.dtype)
            for v in (n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder")]
    floats = [a for a in args if a.requires_grad]

    def run(g):
        outs = [o for o in torch.utils._pytree.tree_leaves(g(*args))
                if isinstance(o, torch.Tensor) and o.is_floating_point()]
        return outs, torch.autograd.grad(sum(o.sum() for o in outs), floats,
                                         allow_unused=True)
    (got, got_grads), (want, want_grads) = run(gm), run(ref)
    assert len(got) == len(want) > 0
    for a, b in zip(got + list(got_grads), want + list(want_grads)):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=0)


# ============================================================================ equivalence
def _count_launches() -> list[bool]:
    """Record every fused-kernel launch (its `interpret` flag) in this process."""
    from autohybrid.codegen import triton as tgen
    launched: list[bool] = []
    original = tgen.launch

    def launch(*args, **kwargs):
        launched.append(bool(args[-1] if len(args) >= 6 else kwargs.get("interpret")))
        return original(*args, **kwargs)

    tgen.launch = launch
    return launched


def _fake_tuning(rank: int) -> dict[str, int]:
    """Launch tuning on in the interpreter (a fresh spawned rank: nothing to undo) with a
    stand-in timer that prefers other tiles on each rank and counts where it was called:
    inside `pretune` (compiled.py's, before a program's first run) or anywhere else."""
    import autohybrid.compiled as compiled_module
    from autohybrid.codegen import triton as tgen

    counts = {"pretune": 0, "elsewhere": 0}
    inside = [False]

    def timer(fn, config):
        counts["pretune" if inside[0] else "elsewhere"] += 1
        fn()
        return float(config[0] if rank % 2 == 0 else -config[0])

    original = compiled_module.pretune

    def pretune(*args, **kwargs):
        inside[0] = True
        try:
            return original(*args, **kwargs)
        finally:
            inside[0] = False

    tgen.TUNE_IN_INTERPRETER = True
    tgen.time_launch = timer
    compiled_module.pretune = pretune
    return counts


def _interpreted_rank(rank: int, world: int, constraints: ah.Constraints | None
                      ) -> tuple[list[str], dict]:
    import os
    from autohybrid.codegen import triton as tgen
    fails = Failures()
    tuning = _fake_tuning(rank)
    fails.check(f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r}",
                os.environ.get("TRITON_INTERPRET") == "1")
    launched = _count_launches()
    batches = zoo_batches("gpt-tiny", 8)
    for optimizer in ("sgd", "adamw"):
        case = f"gpt-tiny/{optimizer}/world{world}"
        compiled, ref = train_and_compare(
            fails, case, zoo_model("gpt-tiny"), batches, world, loss_fn=lm_loss,
            optimizer=OPTIMIZERS[optimizer], constraints=constraints)
        fails.check(f"{case}: plan tp={compiled.plan.mesh.tp}",
                    compiled.plan.mesh.tp == (constraints.tp if constraints else 1))
        fused = _ops(compiled.graphs["train"]).count(FUSED)
        fails.check(f"{case}: {fused} fused nodes", fused == 5)
        keys = {r.key for r in compiled.programs["train"].fused_regions}
        fails.check(f"{case}: kernels {[k.key for k in compiled.kernels]} vs regions {keys}",
                    {k.key for k in compiled.kernels} == keys and len(keys) >= 2)
    fails.check(f"{len(launched)} kernel launches, interpreted: {set(launched)}",
                len(launched) > 0 and all(launched))
    # launches tuned before the first step (and the forward's first run), never inside
    fails.check(f"timed launches: {tuning}", tuning["pretune"] > 0 and tuning["elsewhere"] == 0)
    return list(fails), tgen.tuning_choices()


@pytest.mark.procs
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world,constraints", [(1, None), (2, TP2)], ids=["1rank", "tp2"])
def test_gpt_trains_like_eager_through_interpreted_fused_kernels(monkeypatch, world,
                                                                 constraints):
    monkeypatch.setenv("TRITON_INTERPRET", "1")   # fresh processes read it before triton
    results = ah.launch(_interpreted_rank, ah.Cluster.local(world),
                        args=(world, constraints), timeout_s=guard(220), start_method="spawn")
    assert not any(fails for fails, _ in results), report([fails for fails, _ in results])
    # every rank launches each kernel with the same tiles, though each rank's own timer
    # prefers others (rank 0's choice, agreed before the first step)
    choices = [c for _, c in results]
    assert choices[0] and all(c == choices[0] for c in choices), choices
