"""Collective matmul (ops/collective_matmul.py, passes/collective_matmul.py).

Ops: on 2 and 4 gloo ranks (float64), `cm_gather_linear` equals `sp_gather` followed by
each linear, and `cm_linear_reduce_scatter` equals a linear followed by
`sp_reduce_scatter`, forward values and every gradient (input, weights, biases), for
chunk counts that divide the sequence slice and that do not, with the sequence on dim 0
and dim 1. Each rank's inputs differ, so a chunk written at the wrong rows, a missing
reduction or a wrong backward changes the answer.

Trace: under torch.profiler on 2 ranks, each chunk's collective is issued before the
matmul it overlaps and completes before the matmul that reads it (forward: all-gather
c+1 issued before chunk c's matmul; backward: reduce-scatter c issued before chunk c+1's
matmul, and the weight gradients computed before the reduce-scatters are waited for).

Training: gpt-tiny (AdamW) and llama-tiny (SGD, full recomputation; q/k/v and gate/up
share one chunked gather) compiled with `Constraints(tp=2, sp=True,
collective_matmul=True)` train 3 steps to eager's losses, gradients and parameters; the
plan lists every block and the graphs hold the chunked ops instead of the block's sp
collectives. The plan-space matrix (tests/test_matrix.py) runs half its sp cases of the
attention models with collective matmul (`Case.chunked`).

Planning: the cost model chooses it per layer where the hidden transfer outweighs the
chunks' latency (a slow link and big matmuls) and not on a fast link with small ones.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import autohybrid as ah
from _limits import guard
from _pool import launch as pool_launch
from autohybrid.ops import groups
from autohybrid.ops.collective_matmul import bounds, cm_gather_linear, cm_linear_reduce_scatter
from autohybrid.ops.tensor_parallel import sp_gather, sp_reduce_scatter
from autohybrid.plan import ChunkedLayer

LAUNCH_TIMEOUT_S = guard(90)
D = torch.float64


def _rand(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=D, generator=torch.Generator().manual_seed(seed))


def _leaves(*ts):
    return [t.detach().clone().requires_grad_() for t in ts]


def _close(what, actual, expected):
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-11,
                               msg=lambda m: f"{what}: {m}")


def _gather_case(rank: int, world: int, dim: int, chunks: int, local: int) -> None:
    hidden, outs = 6, (5, 3)
    shape = [2, 2]
    shape[dim] = local
    x = _rand(*shape, hidden, seed=10 + rank)
    ws = [_rand(o, hidden, seed=20 + i) for i, o in enumerate(outs)]
    bs = [_rand(outs[0], seed=30), None]
    grads = [_rand(*[s * world if i == dim else s for i, s in enumerate(shape)], o,
                   seed=40 + rank + 7 * i) for i, o in enumerate(outs)]
    # reference: the unchunked ops
    xr, w0, w1, b0 = _leaves(x, *ws, bs[0])
    full = sp_gather(xr, dim, "tp")
    ref = [F.linear(full, w0, b0), F.linear(full, w1)]
    torch.autograd.backward(ref, grads)
    xc, v0, v1, c0 = _leaves(x, *ws, bs[0])
    got = cm_gather_linear(xc, [v0, v1], [c0], [True, False], dim, "tp", chunks)
    assert len(got) == 3
    for i in range(2):
        _close(f"output {i}", got[i], ref[i])
    _close("gathered input", got[2], full.movedim(dim, 0))
    torch.autograd.backward(got[:2], grads)
    for name, a, b in (("x", xc, xr), ("w0", v0, w0), ("w1", v1, w1), ("b0", c0, b0)):
        _close(f"grad {name}", a.grad, b.grad)


def _scatter_case(rank: int, world: int, dim: int, chunks: int, local: int) -> None:
    hidden, out = 4, 7
    shape = [2, 2]
    shape[dim] = local * world
    x = _rand(*shape, hidden, seed=50 + rank)
    w = _rand(out, hidden, seed=60 + rank)       # each rank holds other rows of the weight
    grad_shape = list(shape)
    grad_shape[dim] = local
    grad = _rand(*grad_shape, out, seed=70 + rank)
    xr, wr = _leaves(x, w)
    ref = sp_reduce_scatter(F.linear(xr, wr), dim, "tp")
    ref.backward(grad)
    xc, wc = _leaves(x, w)
    got = cm_linear_reduce_scatter(xc, wc, dim, "tp", chunks)
    _close("output", got, ref)
    got.backward(grad)
    _close("grad x", xc.grad, xr.grad)
    _close("grad w", wc.grad, wr.grad)


def _cases(rank: int, world: int) -> str:
    groups.bind("tp", dist.group.WORLD)
    try:
        for dim in (0, 1):
            for chunks, local in ((2, 4), (3, 4), (8, 3), (1, 2)):
                _gather_case(rank, world, dim, chunks, local)
                _scatter_case(rank, world, dim, chunks, local)
    finally:
        groups.clear()
    return f"ok:{rank}"


@pytest.mark.procs
@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 4])
def test_chunked_ops_equal_the_unchunked_collective_and_linear(world):
    results = pool_launch(_cases, world, args=(world,),
                        timeout_s=LAUNCH_TIMEOUT_S)
    assert results == [f"ok:{r}" for r in range(world)]


def test_chunk_bounds_cover_the_slice_once():
    assert bounds(10, 4) == [(0, 3), (3, 3), (6, 2), (8, 2)]
    assert bounds(3, 8) == [(0, 1), (1, 1), (2, 1)]       # at most one chunk per row
    assert bounds(5, 1) == [(0, 5)]


# ------------------------------------------------------------------ trace: interleaving
def _events(prof, rank_thread: int | None = None) -> list:
    """(name, start_us, end_us, thread) of the profiler's events, by start."""
    out = [(e.name, e.time_range.start, e.time_range.end, e.thread)
           for e in prof.events()]
    return sorted(out, key=lambda e: e[1])


def _trace_case(rank: int, world: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    groups.bind("tp", dist.group.WORLD)
    try:
        chunks, local, hidden = 4, 8, 64
        x = _rand(2, local, hidden, seed=rank).requires_grad_()
        w = _rand(hidden, hidden, seed=5).requires_grad_()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            y = cm_gather_linear(x, [w], [], [False], 1, "tp", chunks)[0]
            z = cm_linear_reduce_scatter(y, w, 1, "tp", chunks)
            z.sum().backward()
        events = _events(prof)
        main = next(e[3] for e in events if e[0] == "autohybrid::cm_gather_linear")
        mine = [e for e in events if e[3] == main]

        def between(op):
            lo, hi = next((e[1], e[2]) for e in mine if e[0] == op)
            return [e for e in mine if lo <= e[1] and e[2] <= hi]

        def kinds(op, issue, compute):
            """Issues and top-level matmuls inside `op`, in order."""
            return ["issue" if e[0] == issue else "mm" for e in between(op)
                    if e[0] in (issue, compute)]

        ag, rs = "c10d::_allgather_base_", "c10d::_reduce_scatter_base_"
        n = chunks
        # forward gather: chunk c+1's all-gather issued before chunk c's matmul
        got = kinds("autohybrid::cm_gather_linear", ag, "aten::linear")
        assert got == ["issue"] + ["issue", "mm"] * (n - 1) + ["mm"], got
        # … and chunk c's transfer (on gloo's worker thread) done before its matmul starts
        lo, hi = next((e[1], e[2]) for e in mine if e[0] == "autohybrid::cm_gather_linear")
        transfers = [e for e in events if e[0] == "gloo:all_gather" and lo <= e[1] <= hi]
        linears = [e for e in between("autohybrid::cm_gather_linear") if e[0] == "aten::linear"]
        assert len(transfers) == len(linears) == n
        # (gloo runs two issued all-gathers on two worker threads, which may finish in
        # either order: the k-th matmul starts once k + 1 transfers are done)
        done = sorted(t[2] for t in transfers)
        assert all(end <= m[1] for end, m in zip(done, linears)), (transfers, linears)
        # forward reduce-scatter: chunk c's reduce-scatter issued before chunk c+1's matmul
        got = kinds("autohybrid::cm_linear_reduce_scatter", rs, "aten::linear")
        assert got == ["mm", "issue"] * n, got
        # backward of the gather: the input gradient chunk by chunk, each reduce-scattered
        # before the next is multiplied; then the weight gradient, while they travel
        got = kinds("autohybrid::cm_gather_linear_backward", rs, "aten::matmul")
        assert got == ["mm", "issue"] * n + ["mm"], got
        # backward of the reduce-scatter: the output gradient gathered one chunk ahead of
        # the input-gradient matmuls; the weight gradient last
        got = kinds("autohybrid::cm_linear_reduce_scatter_backward", ag, "aten::matmul")
        assert got == ["issue"] + ["issue", "mm"] * (n - 1) + ["mm", "mm"], got
    finally:
        groups.clear()
    return f"ok:{rank}"


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_profiler_trace_interleaves_chunk_transfers_with_their_matmuls():
    results = pool_launch(_trace_case, 2, args=(2,),
                        timeout_s=LAUNCH_TIMEOUT_S)
    assert results == ["ok:0", "ok:1"]


# ------------------------------------------------------------------ training
def _train_rank(rank: int, world: int) -> list[str]:
    from _equiv import OPTIMIZERS, Failures, train_and_compare, zoo_batches, zoo_loss, \
        zoo_model

    from autohybrid.ops.collective_matmul import (cm_gather_linear_op,
                                                  cm_linear_reduce_scatter_op)

    fails = Failures()
    for name, optimizer, recompute in (("gpt-tiny", "adamw", None),
                                       ("llama-tiny", "sgd", "full")):
        case = f"{name}/{optimizer}/tp2+sp+cm recompute={recompute}"
        compiled, _ = train_and_compare(
            fails, case, zoo_model(name), zoo_batches(name, 4), world,
            loss_fn=zoo_loss(name), optimizer=OPTIMIZERS[optimizer],
            constraints=ah.Constraints(dp=1, tp=2, pp=1, sp=True, collective_matmul=True,
                                       recompute=recompute))
        plan = compiled.plan
        layers = {e.layer for e in plan.collective_matmul_layers}
        fails.check(f"{case}: plan lists every block and the head ({layers})",
                    plan.collective_matmul and layers == {"model.blocks.0", "model.blocks.1",
                                                          "model.lm_head"})
        gm = compiled.graphs["train"]
        nodes = [n for sub in gm.modules() if isinstance(sub, torch.fx.GraphModule)
                 for n in sub.graph.nodes]
        gathers = [n for n in nodes if n.target is cm_gather_linear_op]
        scatters = [n for n in nodes if n.target is cm_linear_reduce_scatter_op]
        widths = sorted(len(n.args[1]) for n in gathers)
        # per block: attention's input (gpt: one qkv linear; llama: q, k, v) and the MLP's
        # (gpt: fc; llama: gate and up), and its two row-parallel outputs; the head's input
        want = [1] * 5 if name == "gpt-tiny" else [1, 2, 2, 3, 3]
        fails.check(f"{case}: chunked gathers of widths {widths}", widths == want)
        fails.check(f"{case}: {len(scatters)} chunked reduce-scatters", len(scatters) == 4)
    return fails


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_training_with_collective_matmul_matches_eager():
    from _equiv import report

    results = pool_launch(_train_rank, 2, args=(2,),
                        timeout_s=LAUNCH_TIMEOUT_S * 2)
    assert not any(results), report(results)


# ------------------------------------------------------------------ planning
def _gpt(hidden: int, layers: int = 2):
    from autohybrid.models.gpt import GPT

    return GPT(layers=layers, hidden=hidden, heads=8, vocab=512, seq=256)


@pytest.mark.slow
def test_cost_model_chooses_chunking_per_layer_where_it_pays():
    """On a slow link (the CPU preset across nodes' figures, here 2 ranks on 2 nodes) a
    wide GPT's blocks hide most of their tp transfers behind their matmuls: the planner
    chunks them, records the chunk count per layer, and predicts less exposed tp time
    than with collective matmul pinned off; on a fast link with tiny matmuls it does
    not chunk, since each chunk pays the latency again."""
    model = _gpt(1024).to("meta")
    x = (torch.zeros(8, 256, dtype=torch.long, device="meta"),)
    slow = ah.Cluster.preset("cpu", nodes=2, devices_per_node=1)
    pinned = dict(dp=1, tp=2, pp=1, sp=True)
    on = ah.plan(model, slow, x, constraints=ah.Constraints(**pinned))
    off = ah.plan(model, slow, x, constraints=ah.Constraints(**pinned,
                                                              collective_matmul=False))
    chunked = {e.layer: e.chunks for e in on.collective_matmul_layers}
    assert on.collective_matmul and {"model.blocks.0", "model.blocks.1"} <= set(chunked)
    assert all(k >= 2 for k in chunked.values())
    assert not off.collective_matmul and not off.collective_matmul_layers
    assert on.predicted.exposed_comm_s < off.predicted.exposed_comm_s
    small = ah.plan(_gpt(64).to("meta"), ah.Cluster.local(2),
                    (torch.zeros(2, 16, dtype=torch.long, device="meta"),),
                    constraints=ah.Constraints(**pinned))
    assert not small.collective_matmul


def test_collective_matmul_needs_sequence_parallelism():
    with pytest.raises(ah.PlanError, match="needs tp > 1 and sp"):
        ah.Constraints(tp=2, sp=False, collective_matmul=True)
    model = _gpt(64).to("meta")
    x = (torch.zeros(2, 16, dtype=torch.long, device="meta"),)
    plan = ah.plan(model, ah.Cluster.local(2), x,
                   constraints=ah.Constraints(tp=2, sp=True, collective_matmul=True))
    assert plan.collective_matmul and plan.collective_matmul_layers
    assert ah.Plan.from_json(plan.to_json()) == plan
    with pytest.raises(ah.PlanError, match="needs tp > 1 and sp=True"):
        dataclasses.replace(plan, mesh=dataclasses.replace(plan.mesh, sp=False))
    with pytest.raises(ah.PlanError, match="at least 2"):
        dataclasses.replace(plan, collective_matmul_layers=(
            ChunkedLayer("model.blocks.0", 1),))
