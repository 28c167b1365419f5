"""ZeRO 1–3 on the data-parallel axis equals eager training and holds the bytes the
memory model predicts.

Equivalence: gpt-tiny at dp 2 under ZeRO 1, 2 and 3 with SGD and AdamW, clipping on,
2 microbatches (ZeRO-2 reduces every microbatch); then ZeRO composed with tp (+sp), pp
(1F1B, zero-bubble ×2, GPipe) and full recomputation on 4 ranks. Each case trains the
compiled model and an eager float64 copy for 3 steps and compares the loss, the gathered
gradients and the gathered parameters after every step (tests/_equiv.py).

Structure: optimizer-state, gradient and parameter bytes per rank, counted on the live
tensors, against `cost.memory.training_state` at dp 2 and dp 4; the ZeRO-3 graph (one
gather per layer, shard-shaped parameter placeholders); and the release of gathered
parameters after use (a saved weight is gathered again in backward, not kept).
"""
from __future__ import annotations

import contextlib
import dataclasses
import weakref

import pytest
import torch

import autohybrid as ah
from _limits import guard
from _pool import launch as pool_launch
from _equiv import (OPTIMIZERS, Failures, compare_training, default_eager_loss, lm_loss,
                    report, train_and_compare, zoo_batches, zoo_loss, zoo_model)
from autohybrid.capture import capture
from autohybrid.cost.memory import training_state
from autohybrid.ops import groups
from autohybrid.ops import zero as zero_ops
from autohybrid.ops.zero import (chunk, release_gathered, zero_gather,
                                 zero_gather_start_op, zero_gather_wait_op)
from autohybrid.passes import PassContext, passes_for, run_passes
from autohybrid.search.layers import segment

LAUNCH_TIMEOUT_S = guard(300)
C = ah.Constraints


def _launch(fn, world: int, *args):
    return pool_launch(fn, world, args=(world, *args),
                     timeout_s=LAUNCH_TIMEOUT_S)


# ============================================================================ bytes
def _bytes_model():
    """A GPT whose blocks dominate its parameters (so per-layer transients are small)."""
    torch.manual_seed(0)
    return ah.models.gpt(layers=4, hidden=64, heads=4, vocab=64, seq=16).double()


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _measure_bytes(world: int) -> dict[int, dict[str, int]]:
    """Per ZeRO stage, this rank's bytes: parameters the graphs read, gradients held
    after each microbatch (the most of them), AdamW state after a step; and the padding
    slack (Σ over parameters of dp·c − n elements)."""
    out = {}
    model = _bytes_model()
    inputs, targets = ah.models.example_batch(model, 4 * world, seed=1, dtype=torch.float64)
    for zero in range(4):
        compiled = ah.compile(_bytes_model(), ah.Cluster.local(world), inputs,
                              loss_fn=lm_loss, example_targets=targets,
                              optimizer=OPTIMIZERS["adamw"],
                              constraints=C(dp=world, tp=1, pp=1, zero=zero,
                                            num_microbatches=2, bucket_mb=0.01))
        trained = compiled._trained_params()
        shards = compiled.zero.optimizer_params() if compiled.zero is not None else []
        held: list[int] = []
        compiled.executor.microbatch_hooks.append(lambda m: held.append(_tensor_bytes(
            [p.grad for p in trained.values()] + [s.grad for s in shards])))
        compiled.train_step(inputs, targets)
        state = compiled.executor.state
        optimizer = [t for s in compiled.optimizer.state.values() for k, t in s.items()
                     if k != "step"]
        out[zero] = {
            "params": _tensor_bytes(state[name] for name in trained),
            "grads": max(held),
            "optimizer": _tensor_bytes(optimizer),
            "count": sum(p.numel() for p in trained.values()),
            "slack": sum(chunk(p.numel(), world) * world - p.numel() for p in trained.values()),
        }
    return out


def _bytes_rank(rank: int, world: int) -> dict:
    return _measure_bytes(world)


@pytest.mark.procs
@pytest.mark.timeout(400)
@pytest.mark.parametrize("world", [2, 4])
def test_state_bytes_fall_as_the_memory_model_predicts(world):
    """ZeRO-k divides by dp what the memory model says it does: optimizer state from
    stage 1, gradients (held between microbatches) from 2, parameters at 3 — within the
    padding of each parameter's flat shard (at most dp − 1 elements)."""
    measured = _launch(_bytes_rank, world)[0]
    width = 8  # float64
    for zero, m in measured.items():
        want = training_state(m["count"], "float64", "adam", zero, world)
        slack = m["slack"] * width
        assert want.params <= m["params"] <= want.params + slack / (world if zero < 3 else 1), \
            (zero, m, want)
        assert want.grads <= m["grads"] <= want.grads + slack, (zero, m, want)
        assert want.optimizer <= m["optimizer"] <= want.optimizer + 2 * slack, (zero, m, want)
    full = measured[0]
    for zero, kinds in ((1, ["optimizer"]), (2, ["optimizer", "grads"]),
                        (3, ["optimizer", "grads", "params"])):
        for kind in kinds:
            ratio = measured[zero][kind] / full[kind]
            assert 1 / world <= ratio < 1 / world + 0.02, (zero, kind, ratio)


# ============================================================================ equivalence
def _zero_rank(rank: int, world: int, cases) -> list[str]:
    fails = Failures()
    for name, optimizer, constraints in cases:
        # cases pinning small buckets gather every bucket by broadcasts (the way gloo runs
        # the large gathers of real models: ops/groups.all_gather_single), the rest by
        # gloo's all-gather (tiny models' buckets)
        broadcast = constraints.bucket_mb is not None
        with _broadcast_gathers(0 if broadcast else 1 << 40):
            _zero_case(fails, rank, world, name, optimizer, constraints)
    return fails


@contextlib.contextmanager
def _broadcast_gathers(from_bytes: int):
    before = groups.BROADCAST_GATHER_BYTES
    groups.BROADCAST_GATHER_BYTES = from_bytes
    try:
        yield
    finally:
        groups.BROADCAST_GATHER_BYTES = before


def _zero_case(fails, rank, world, name, optimizer, constraints) -> None:
    batches = zoo_batches(name, 8, steps=3)
    case = f"{name}/{optimizer}/{constraints}"
    compiled, _ = train_and_compare(fails, case, zoo_model(name), batches, world,
                                    loss_fn=zoo_loss(name), optimizer=OPTIMIZERS[optimizer],
                                    constraints=constraints, max_grad_norm=1.0)
    fails.check(f"{case}: ZeRO-{compiled.plan.zero}, shards "
                f"{compiled.zero is not None}", compiled.zero is not None
                and compiled.zero.stage == constraints.zero)
    if constraints.bucket_mb is not None and constraints.zero < 3:
        # parameters of a bucket's size are gathered straight into their storage
        fails.check(f"{case}: parameters gathered in place "
                    f"{sorted(compiled.zero._padded)}", len(compiled.zero._padded) >= 4)
    # every gather a start issued was waited for (found by its buffer) and none is
    # left in flight after the step
    fails.check(f"{case}: gathers left pending {len(zero_ops._PENDING)}",
                not zero_ops._PENDING)


@pytest.mark.procs
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
def test_zero_1_2_3_match_eager_at_dp2():
    # AdamW's with 10 KB buckets: ZeRO-1/2's larger parameters gathered in place, and
    # every gather by broadcasts (_zero_rank)
    cases = [("gpt-tiny", optimizer, C(dp=2, tp=1, pp=1, zero=zero, num_microbatches=2,
                                       bucket_mb=0.01 if optimizer == "adamw" else None))
             for zero in (1, 2, 3) for optimizer in ("sgd", "adamw")]
    results = _launch(_zero_rank, 2, cases)
    assert not any(results), report(results)


@pytest.mark.procs
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
def test_zero_composes_with_tp_sp_pp_and_recompute():
    cases = [
        ("gpt-tiny", "adamw", C(dp=2, tp=2, pp=1, sp=True, zero=3, num_microbatches=2)),
        ("llama-tiny", "sgd", C(dp=2, tp=2, pp=1, zero=2, num_microbatches=2)),
        ("gpt-tiny", "sgd", C(dp=2, tp=1, pp=2, zero=3, schedule="1f1b", num_microbatches=2)),
        ("llama-tiny", "adamw", C(dp=2, tp=1, pp=2, zero=2, schedule="zero-bubble",
                                  virtual_stages=2, num_microbatches=2)),
        ("mlp-tiny", "adamw", C(dp=2, tp=1, pp=2, zero=1, schedule="gpipe",
                                num_microbatches=2)),
        ("gpt-tiny", "adamw", C(dp=4, tp=1, pp=1, zero=3, recompute="full",
                                num_microbatches=1)),
        # ZeRO-1 over the dp groups of a dp2×tp2 mesh (not the world): broadcasts from
        # each group's own global ranks
        ("gpt-tiny", "adamw", C(dp=2, tp=2, pp=1, zero=1, num_microbatches=2,
                                bucket_mb=0.01)),
    ]
    results = _launch(_zero_rank, 4, cases)
    assert not any(results), report(results)


# ============================================================================ the graph
def _rewrite(name: str, zero: int, dp: int = 2, **plan_fields):
    torch.manual_seed(0)
    model = ah.models.preset(name)
    inputs, targets = ah.models.example_batch(name, 4)
    cap = capture(model, inputs, lm_loss, targets)
    plan = ah.plan(model, ah.Cluster.local(dp), inputs, constraints=C(dp=dp, tp=1, pp=1,
                                                                      zero=zero))
    plan = dataclasses.replace(plan, **plan_fields)
    ctx = PassContext(plan=plan, rank=0, coords=plan.mesh.coords(0))
    ctx.notes["loss_output_index"] = cap.user_outputs[0]
    # without the overlap pass: it moves the gathers' starts up, out of their layers
    passes = [(name, fn) for name, fn in passes_for("train") if name != "overlap"]
    return cap, run_passes(cap.gm, ctx, passes), ctx


@pytest.mark.timeout(60)
def test_zero3_graph_gathers_each_layer_once_from_shard_placeholders():
    cap, gm, ctx = _rewrite("gpt-tiny", 3, gather_min_mb=0.0)
    gathers = [n for n in gm.graph.nodes if n.target is zero_gather_wait_op]
    layers = segment(gm)
    with_params = [layer for layer in layers if layer.params()]
    assert len(gathers) == len(with_params) == ctx.notes["zero_gathers"]
    for layer in with_params:  # each layer reads its parameters through its one gather
        gather = next(n for n in layer.nodes if n.target is zero_gather_wait_op)
        start = gather.args[0]
        assert start.target is zero_gather_start_op and start.args[0] == gather.args[1]
        assert not [a for n in layer.nodes if n not in (gather, start)
                    for a in n.all_input_nodes if a.meta.get("ah_role") == "param"]
        users = {u for item in gather.users for u in item.users}
        assert users <= set(layer.nodes)
    # the tied embedding/head weight is gathered by both layers that read it
    tied = [u.target for n in gm.graph.nodes if n.op == "placeholder"
            and n.meta.get("ah_param") == "tok_emb.weight" for u in n.users]
    assert sorted(map(str, tied)) == sorted(map(str, [zero_gather_start_op,
                                                      zero_gather_wait_op] * 2))
    whole = {n.meta["ah_param"]: n.meta["val"] for n in cap.gm.graph.nodes
             if n.op == "placeholder" and n.meta.get("ah_role") == "param"}
    for node in gm.graph.nodes:  # parameters arrive as flat dp shards
        if node.op == "placeholder" and node.meta.get("ah_role") == "param":
            n = whole[node.meta["ah_param"]].numel()
            assert tuple(node.meta["val"].shape) == (chunk(n, 2),)
    assert all(n.args[5] is None for n in gathers)  # the gradients' own dtype
    _, gm_bf16, _ = _rewrite("gpt-tiny", 3, grad_reduce_dtype="bfloat16")
    waits = [n for n in gm_bf16.graph.nodes if n.target is zero_gather_wait_op]
    assert waits and all(n.args[5] == "bfloat16" for n in waits)  # reduce-scattered so
    _, gm1, _ = _rewrite("gpt-tiny", 1)
    _, gm2, _ = _rewrite("gpt-tiny", 2)
    for g in (gm1, gm2):  # ZeRO 1/2 leave the graph alone (the reducer shards)
        assert not [n for n in g.graph.nodes if n.meta.get("ah_pass") == "zero"]


def _gathered_names(gm) -> list[list[str]]:
    return [[p.meta["ah_param"] for p in n.args[1]] for n in gm.graph.nodes
            if n.target is zero_gather_wait_op]


@pytest.mark.timeout(60)
def test_zero3_small_layers_share_a_neighbours_gather():
    """The planner sets `gather_min_mb` to the dp link's latency × bandwidth (about 48 KiB
    for local gloo). With 4 KiB (gpt-tiny's fp32 blocks are ~50 KiB, its embedding 12
    KiB, its position table 2 KiB, its final norm 256 B): the position table joins the
    embedding's gather, the final norm the last block's; the big layers keep their own.
    Not across a stage boundary, not under full recomputation."""
    _, gm, ctx = _rewrite("gpt-tiny", 3)
    assert ctx.plan.gather_min_mb == pytest.approx(50e-6 * 1e9 / 2**20)
    assert len(_gathered_names(gm)) == 2        # as the pricing counts (tests/test_plan.py)
    small = 4096 / 2**20
    cap, gm, ctx = _rewrite("gpt-tiny", 3, gather_min_mb=small)
    blocks = [[f"blocks.{i}.{p}" for p in ("ln1.weight", "ln1.bias", "attn.qkv.weight",
              "attn.qkv.bias", "attn.proj.weight", "attn.proj.bias", "ln2.weight",
              "ln2.bias", "mlp.fc.weight", "mlp.fc.bias", "mlp.proj.weight",
              "mlp.proj.bias")] for i in range(2)]
    assert _gathered_names(gm) == [["tok_emb.weight", "pos_emb.weight"], blocks[0],
                                   blocks[1] + ["ln_f.weight", "ln_f.bias"],
                                   ["tok_emb.weight"]]
    assert ctx.notes["zero_gathers"] == 4
    # the gathered parameters still reach exactly the nodes that read them
    for gather in (n for n in gm.graph.nodes if n.target is zero_gather_wait_op):
        for item in gather.users:
            assert item.users
    # a stage boundary at the final norm: it starts a gather (in its stage), which the
    # head joins; full recomputation merges nothing
    _, gm_b, _ = _rewrite("gpt-tiny", 3, gather_min_mb=small, stage_boundaries=("model.ln_f",))
    assert _gathered_names(gm_b)[-2:] == [blocks[1], ["ln_f.weight", "ln_f.bias",
                                                      "tok_emb.weight"]]
    _, gm_r, ctx_r = _rewrite("gpt-tiny", 3, gather_min_mb=small, recompute="full")
    assert ctx_r.notes["zero_gathers"] == 6, _gathered_names(gm_r)


@pytest.mark.timeout(60)
def test_gathered_parameters_are_released_after_use_and_gathered_again(monkeypatch):
    """Weights gathered for matmuls die once forward is done (autograd keeps a handle to
    their layer's shards, not the weights); without the hooks autograd keeps them. In
    backward a layer is gathered again once for all its saved weights, and that copy is
    dropped when the layer's own backward (the reduce-scatter) has run; gathering it
    again also issues the gather of the layer before it (asynchronously: backward needs
    it next). The forward's last gather is kept for backward instead. The gradients are
    the same either way."""
    from autohybrid.ops import groups
    torch.manual_seed(0)
    shards = [torch.randn(12, dtype=torch.float64, requires_grad=True) for _ in range(4)]
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    groups.bind("dp", None)
    calls = []                                   # (shards gathered, asynchronously)
    real_start = zero_ops.gather_start
    monkeypatch.setattr(zero_ops, "gather_start", lambda shards, group, async_op=False: (
        calls.append((len(shards), async_op)) or real_start(shards, group, async_op)))
    layers = []

    class Layer(zero_ops._Layer):  # the objects behind the saved handles
        def __init__(self, *args):
            super().__init__(*args)
            layers.append(self)
    monkeypatch.setattr(zero_ops, "_Layer", Layer)

    def forward():
        w1, w2 = zero_gather(shards[:2], [[3, 4], [3, 4]], "dp")         # layer 1
        y = torch.ops.aten.mm.default(x, w1) * torch.ops.aten.mm.default(x, w2)
        (w3,) = zero_gather(shards[2:3], [[4, 3]], "dp")                 # layer 2
        y = torch.ops.aten.mm.default(y, w3)
        (w4,) = zero_gather(shards[3:], [[3, 4]], "dp")                  # layer 3 (last)
        return torch.ops.aten.mm.default(y, w4), [weakref.ref(w) for w in (w1, w2, w3, w4)]

    grads = []
    for release in (True, False):
        calls.clear()
        layers.clear()
        with release_gathered(release):
            z, refs = forward()
        alive = [r() is not None for r in refs]
        assert alive == ([False, False, False, True] if release else [True] * 4)
        assert len(layers) == 3 * release
        if release:
            assert [layer._whole is None for layer in layers] == [True, True, False]
        grads.append(torch.autograd.grad(z.square().sum(), (x, *shards)))
        forward_starts = [(2, True), (1, True), (1, True)]
        # with release, backward gathers layer 2 again, which issues layer 1's gather
        assert calls == forward_starts + ([(1, False), (2, True)] if release else []), calls
        assert all(layer._whole is None and layer._pending is None for layer in layers)
    torch.testing.assert_close(grads[0], grads[1])


# ============================================================================ two models
def _two_models_rank(rank: int, world: int) -> list[str]:
    """A tp2 model, then a dp2 ZeRO-3 model compiled in the same process: each keeps
    running on its own groups (the axis → group table is bound per model)."""
    fails = Failures()
    batches = zoo_batches("gpt-tiny", 8, steps=2)
    models = {}
    for key, constraints in (("tp2", C(dp=1, tp=2, pp=1, sp=False)),
                             ("zero3", C(dp=2, tp=1, pp=1, zero=3))):
        compiled, ref = train_and_compare(fails, key, zoo_model("gpt-tiny"), batches[:1], world,
                                          loss_fn=lm_loss, optimizer=OPTIMIZERS["sgd"],
                                          constraints=constraints)
        models[key] = (compiled, ref)
    for key, (compiled, ref) in models.items():  # the first model after the second's compile
        compare_training(fails, f"{key} again", compiled, ref,
                         OPTIMIZERS["sgd"](list(ref.parameters())), batches[1:],
                         default_eager_loss(lm_loss))
    return fails


@pytest.mark.procs
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
def test_two_compiled_models_in_one_process_keep_their_own_groups():
    results = _launch(_two_models_rank, 2)
    assert not any(results), report(results)


@pytest.mark.timeout(60)
def test_the_scatter_layout_and_its_inverse_over_ragged_shapes():
    """scatter_layout writes each gradient once into its `(dp, c)` columns, zero-padded
    (as the definition: padded to dp·c, viewed (dp, c), columns side by side); a
    gathered `(dp, Σc)` buffer is written back whole by copy_gathered, into contiguous
    and non-contiguous targets alike."""
    from autohybrid.ops.zero import copy_gathered, scatter_layout

    def definition(grads, dp):
        columns = []
        for g in grads:
            flat = g.reshape(-1)
            c = chunk(flat.numel(), dp)
            padded = torch.cat([flat, flat.new_zeros(dp * c - flat.numel())])
            columns.append(padded.view(dp, c))
        return torch.cat(columns, dim=1).reshape(-1)

    generator = torch.Generator().manual_seed(0)
    shapes = [(7,), (3, 5), (2, 2, 2), (0,), (1,), (16,), (6, 4)]
    for dp in (1, 2, 3, 4, 8):
        for start in range(len(shapes)):
            grads = [torch.randn(s, generator=generator) for s in shapes[start:] + shapes[:2]]
            grads.append(torch.randn(4, 6, generator=generator).t())   # non-contiguous
            flat = scatter_layout(grads, dp)
            assert torch.equal(flat, definition(grads, dp)), (dp, start)
            targets = [torch.full_like(g, float("nan")) for g in grads[:-1]]
            targets.append(torch.full((4, 6), float("nan")).t())     # non-contiguous
            copy_gathered(flat, [chunk(g.numel(), dp) for g in grads], targets)
            for got, want in zip(targets, grads):
                assert torch.equal(got, want), (dp, start)


# ============================================================================ gathers
def _gathers_rank(rank: int, world: int) -> list[str]:
    """all_gather_single against its definition (every rank's input, in group-rank order)
    by each path (gloo's all-gather, broadcasts), over the world and over two groups of
    non-adjacent ranks, synchronous and not, in place (the input is this rank's row) and
    not; counting the broadcasts issued."""
    import torch.distributed as dist
    fails = Failures()
    odd_even = [dist.new_group([r for r in range(world) if r % 2 == k]) for k in (0, 1)]
    calls = []
    broadcast = dist.broadcast

    def counted(*args, **kwargs):
        calls.append(kwargs.get("src"))
        return broadcast(*args, **kwargs)

    dist.broadcast = counted
    try:
        for name, group, members in (("world", None, list(range(world))),
                                     ("odd/even", odd_even[rank % 2],
                                      [r for r in range(world) if r % 2 == rank % 2])):
            for by_broadcast in (False, True):
                for async_op in (False, True):
                    for in_place in (False, True):
                        n = 5
                        want = torch.cat([torch.arange(n) + 100.0 * r for r in members])
                        out = torch.full((n * len(members),), float("nan"))
                        mine = torch.arange(n) + 100.0 * rank
                        me = members.index(rank)
                        if in_place:
                            out[me * n:(me + 1) * n] = mine
                            mine = out[me * n:(me + 1) * n]
                        calls.clear()
                        with _broadcast_gathers(0 if by_broadcast else 1 << 40):
                            work = groups.all_gather_single(out, mine, group=group,
                                                            async_op=async_op)
                        if async_op:
                            work.wait()
                        case = f"{name} broadcast={by_broadcast} async={async_op} " \
                               f"in_place={in_place}"
                        fails.check(f"{case}: {out.tolist()} != {want.tolist()}",
                                    torch.equal(out, want))
                        fails.check(f"{case}: broadcasts from {calls}",
                                    calls == (members if by_broadcast else []))
    finally:
        dist.broadcast = broadcast
    # ZeRO's gather of shards of two dtypes: in the promoted one, as torch.cat gives
    shards = [torch.arange(3, dtype=torch.float32) + 10 * rank,
              torch.arange(2, dtype=torch.float64) - 10 * rank]
    flat, work = zero_ops.gather_start(shards, None if world == 1 else dist.group.WORLD)
    want = torch.cat([torch.cat([torch.arange(3.0) + 10 * r, torch.arange(2.0) - 10 * r])
                      for r in range(world)]).double()
    fails.check(f"mixed dtypes: {flat.dtype} {flat.tolist()}",
                flat.dtype == torch.float64 and torch.equal(flat, want))
    return fails


@pytest.mark.procs
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
def test_all_gathers_equal_their_definition_by_either_path_on_gloo():
    results = _launch(_gathers_rank, 4)
    assert not any(results), report(results)
