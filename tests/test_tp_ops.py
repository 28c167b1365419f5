"""Tensor/sequence-parallel and vocabulary-parallel ops equal the single-process computation.

Multi-rank tests run their cases inside one `ah.launch` (gloo, 2 or 4 ranks, float64):
every rank binds the "tp" axis to the world group, computes the sharded version with the
`autohybrid::` ops and, independently, the full computation on the whole tensors, and
asserts that forward values and input gradients agree. Each rank returns a tag that the
parent checks, so a rank cannot skip its checks; the data are chosen so that a missing
collective (or a wrong backward) would give a different answer, and the tests assert that
too. The trace tests check the fake impls: output shapes, and which ops a joint trace holds.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import autohybrid as ah
from _limits import guard
from _pool import launch as pool_launch
from autohybrid.errors import RuntimeFailure
from autohybrid.ops import groups
from autohybrid.ops.tensor_parallel import (sp_gather, sp_reduce_scatter, tp_copy, tp_gather,
                                            tp_reduce, tp_split)
from autohybrid.ops.vocab_parallel import vocab_parallel_cross_entropy, vocab_parallel_embedding

LAUNCH_TIMEOUT_S = guard(90)
D = torch.float64
AH = torch.ops.autohybrid


def _launch(fn, world: int, *args) -> None:
    results = pool_launch(_bound_rank, world, args=(fn, world, *args),
                        timeout_s=LAUNCH_TIMEOUT_S)
    assert results == [f"{fn.__name__}:{r}" for r in range(world)]


def _bound_rank(rank: int, fn, world: int, *args) -> str:
    groups.bind("tp", dist.group.WORLD)
    try:
        fn(rank, world, *args)
    finally:
        groups.clear()
    return f"{fn.__name__}:{rank}"


def _rand(*shape, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, dtype=D, generator=torch.Generator().manual_seed(seed))


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_()


def _close(what: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-12,
                               msg=lambda m: f"{what}: {m}")


def _differs(what: str, a: torch.Tensor, b: torch.Tensor) -> None:
    assert not torch.allclose(a, b), f"{what}: the test would pass without the collective"


def _all_gather(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Plain torch.distributed gather (not the op under test), for checking results."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim)


# ============================================================== f / g / gather (Megatron)

def _megatron_rank(rank: int, world: int) -> None:
    x, w1, w2 = _rand(6, 8, seed=1), _rand(4 * world, 8, seed=2), _rand(8, 4 * world, seed=3)
    gy = _rand(6, 8, seed=4)
    # reference: the full MLP
    xf, w1f, w2f = _leaf(x), _leaf(w1), _leaf(w2)
    yf = F.gelu(xf @ w1f.T) @ w2f.T
    yf.backward(gy)
    # column-parallel w1 (rows split), row-parallel w2 (columns split): f ... g
    xs, w1s, w2s = _leaf(x), _leaf(w1.chunk(world, 0)[rank]), _leaf(w2.chunk(world, 1)[rank])
    partial = F.gelu(tp_copy(xs, "tp") @ w1s.T) @ w2s.T
    y = tp_reduce(partial, "tp")
    y.backward(gy)
    _close("mlp output", y, yf)
    _close("mlp d(x)", xs.grad, xf.grad)
    _close("mlp d(w1 shard)", w1s.grad, w1f.grad.chunk(world, 0)[rank])
    _close("mlp d(w2 shard)", w2s.grad, w2f.grad.chunk(world, 1)[rank])
    _differs("mlp partial output", partial, yf)
    xo = _leaf(x)  # this rank's own contribution to d(x), without tp_copy's all-reduce
    (F.gelu(xo @ w1s.detach().T) @ w2s.detach().T).backward(gy)
    _differs("mlp d(x) of this rank alone", xo.grad, xf.grad)
    # tp_reduce's backward passes the gradient through unchanged
    p = _leaf(_rand(3, 5, seed=10 + rank))
    tp_reduce(p, "tp").backward(gy[:3, :5])
    _close("tp_reduce d(partial)", p.grad, gy[:3, :5])
    partials = [_rand(3, 5, seed=10 + r) for r in range(world)]
    _close("tp_reduce sum", tp_reduce(p, "tp"), sum(partials))
    _differs("tp_reduce partial", p, sum(partials))
    # column-parallel linear then gather on the last dim equals the full linear
    gz = _rand(6, 4 * world, seed=5)
    xf2, w1f2 = _leaf(x), _leaf(w1)
    zf = xf2 @ w1f2.T
    zf.backward(gz)
    xs2, w1s2 = _leaf(x), _leaf(w1.chunk(world, 0)[rank])
    z = tp_gather(tp_copy(xs2, "tp") @ w1s2.T, -1, "tp")
    z.backward(gz)
    _close("column linear + gather", z, zf)
    _close("column linear + gather d(x)", xs2.grad, xf2.grad)
    _close("column linear + gather d(w shard)", w1s2.grad, w1f2.grad.chunk(world, 0)[rank])


@pytest.mark.procs
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_copy_reduce_gather_match_full_mlp(world):
    """tp_copy → column-parallel → row-parallel → tp_reduce equals the full MLP (values,
    d(x), weight-shard grads); tp_copy → column shard → tp_gather equals the full linear."""
    _launch(_megatron_rank, world)


# ============================================================== split / gather

def _split_gather_rank(rank: int, world: int) -> None:
    full = _rand(2 * world, 3 * world, 4 * world, seed=1)
    for dim in (0, 1, 2, -1):
        for x in (full, full.transpose(0, 1)):  # contiguous and not
            gy = _rand(*x.shape, seed=2)
            xs = _leaf(x)
            s = tp_split(xs, dim, "tp")
            assert s.is_contiguous()
            _close(f"tp_split dim {dim}", s, x.chunk(world, dim)[rank])
            _differs(f"tp_split dim {dim} vs the next rank", s, x.chunk(world, dim)[rank - 1])
            g = tp_gather(s, dim, "tp")
            assert g.is_contiguous()
            _close(f"split→gather dim {dim}", g, x)
            g.backward(gy)
            _close(f"split→gather dim {dim} d(x)", xs.grad, gy)
            # tp_split alone: backward gathers every rank's slice gradient
            xs = _leaf(x)
            (tp_split(xs, dim, "tp") * gy.chunk(world, dim)[rank]).sum().backward()
            _close(f"tp_split dim {dim} d(x)", xs.grad, gy)
            # tp_gather alone: backward keeps this rank's slice of the replicated gradient
            shard = _leaf(x.chunk(world, dim)[rank])
            tp_gather(shard, dim, "tp").backward(gy)
            _close(f"tp_gather dim {dim} d(shard)", shard.grad, gy.chunk(world, dim)[rank])
    bad = torch.zeros(3, world + 1, dtype=D)
    for op in (tp_split, sp_reduce_scatter):
        with pytest.raises(RuntimeFailure, match=f"does not divide by the {world} ranks"):
            op(bad, 1, "tp")
        with FakeTensorMode() as mode, pytest.raises(RuntimeFailure, match="does not divide"):
            op(mode.from_tensor(bad), 1, "tp")


@pytest.mark.procs
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_split_gather_round_trips(world):
    """tp_split/tp_gather on every dim (contiguous or not): values and gradients; a size
    that does not divide raises RuntimeFailure, for real and in fake mode."""
    _launch(_split_gather_rank, world)


# ============================================================== sequence parallelism

def _sequence_parallel_rank(rank: int, world: int) -> None:
    for dim in (0, 1):
        # reduce-scatter of per-rank partials; backward all-gathers per-rank gradients
        parts = [_rand(2 * world, 3, seed=20 + r).movedim(0, dim) for r in range(world)]
        grads = [_rand(2, 3, seed=40 + r).movedim(0, dim) for r in range(world)]
        p = _leaf(parts[rank])
        out = sp_reduce_scatter(p, dim, "tp")
        assert out.is_contiguous()
        _close(f"sp_reduce_scatter dim {dim}", out, sum(parts).chunk(world, dim)[rank])
        _differs(f"sp_reduce_scatter dim {dim}", out, parts[rank].chunk(world, dim)[rank])
        out.backward(grads[rank])
        _close(f"sp_reduce_scatter dim {dim} d(partial)", p.grad, torch.cat(grads, dim))
        # all-gather of shards; backward reduce-scatters per-rank gradients
        shards = [_rand(2, 3, seed=60 + r).movedim(0, dim) for r in range(world)]
        upstream = [_rand(2 * world, 3, seed=80 + r).movedim(0, dim) for r in range(world)]
        x = _leaf(shards[rank])
        g = sp_gather(x, dim, "tp")
        _close(f"sp_gather dim {dim}", g, torch.cat(shards, dim))
        g.backward(upstream[rank])
        expected = sum(upstream).chunk(world, dim)[rank]
        _close(f"sp_gather dim {dim} d(shard)", x.grad, expected)
        _differs(f"sp_gather dim {dim} d(shard) vs tp_gather's slice", x.grad,
                 upstream[rank].chunk(world, dim)[rank])
    # a sequence-parallel MLP: gather the sequence, column → row parallel, reduce-scatter
    s, h, f = 2 * world, 6, 4 * world
    x, w1, w2, gy = (_rand(s, 3, h, seed=1), _rand(f, h, seed=2), _rand(h, f, seed=3),
                     _rand(s, 3, h, seed=4))
    xf, w1f, w2f = _leaf(x), _leaf(w1), _leaf(w2)
    yf = F.gelu(xf @ w1f.T) @ w2f.T
    yf.backward(gy)
    xs, w1s, w2s = _leaf(x.chunk(world, 0)[rank]), _leaf(w1.chunk(world, 0)[rank]), \
        _leaf(w2.chunk(world, 1)[rank])
    y = sp_reduce_scatter(F.gelu(sp_gather(xs, 0, "tp") @ w1s.T) @ w2s.T, 0, "tp")
    y.backward(gy.chunk(world, 0)[rank])
    _close("sp mlp output", y, yf.chunk(world, 0)[rank])
    _close("sp mlp d(x shard)", xs.grad, xf.grad.chunk(world, 0)[rank])
    _close("sp mlp d(w1 shard)", w1s.grad, w1f.grad.chunk(world, 0)[rank])
    _close("sp mlp d(w2 shard)", w2s.grad, w2f.grad.chunk(world, 1)[rank])


@pytest.mark.procs
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_pairs(world):
    """sp_reduce_scatter/sp_gather on dims 0 and 1 with per-rank partials and gradients,
    and a sequence-parallel MLP equal to the full one (values and all gradients)."""
    _launch(_sequence_parallel_rank, world)


# ============================================================== vocabulary parallelism

VOCAB = 13


def _vocab_rank(rank: int, world: int, padded: int) -> None:
    vl = padded // world
    start = rank * vl
    # cross-entropy: pad columns hold large garbage, which must not count
    logits = _rand(3, 5, padded, seed=1)
    logits[..., VOCAB:] = 1e3
    gl = _rand(3, 5, seed=2)
    for ignore_index in (-100, 4):
        target = torch.randint(0, VOCAB, (3, 5), generator=torch.Generator().manual_seed(3))
        target[0, 0], target[0, 1], target[0, 2] = VOCAB - 1, 0, 4
        target[1, 2] = target[2, 0] = ignore_index
        ignored = target == ignore_index
        assert ignored.any() and not ignored.all()
        losses = {}
        for eps in (0.0, 0.1):
            full = _leaf(logits[..., :VOCAB])
            ref = F.cross_entropy(full.reshape(-1, VOCAB), target.reshape(-1), reduction="none",
                                  ignore_index=ignore_index, label_smoothing=eps).view(3, 5)
            ref.backward(gl)
            shard = _leaf(logits[..., start:start + vl])
            loss, lse = vocab_parallel_cross_entropy(shard, target, start, VOCAB, ignore_index,
                                                     eps, "tp")
            loss.backward(gl)
            case = f"cross-entropy eps={eps} ignore_index={ignore_index}"
            assert loss.dtype == D and loss.shape == target.shape
            _close(f"{case} loss", loss, ref)
            _close(f"{case} lse", lse, torch.logsumexp(logits[..., :VOCAB], -1))
            assert (loss[ignored] == 0).all() and (loss[~ignored] > 0).all()
            assert shard.grad.abs().sum() > 0
            grad = _all_gather(shard.grad, -1)
            _close(f"{case} d(logits)", grad[..., :VOCAB], full.grad)
            assert (grad[..., VOCAB:] == 0).all(), f"{case}: gradient in pad columns"
            assert (grad[ignored] == 0).all(), f"{case}: gradient for ignored tokens"
            losses[eps] = loss.detach()
        _differs("label smoothing", losses[0.0], losses[0.1])
    # embedding: partial rows, summed by tp_reduce, equal F.embedding on the real rows
    weight = _rand(padded, 6, seed=5)
    weight[VOCAB:] = 1e3
    ids = torch.randint(0, VOCAB, (4, 7), generator=torch.Generator().manual_seed(6))
    ids[0, :3] = torch.tensor([0, VOCAB - 1, VOCAB - 1])
    gy = _rand(4, 7, 6, seed=7)
    wf = _leaf(weight[:VOCAB])
    ref = F.embedding(ids, wf)
    ref.backward(gy)
    ws = _leaf(weight[start:start + vl])
    partial = vocab_parallel_embedding(ids, ws, start, "tp")
    _differs("embedding partial", partial, ref)
    _close("embedding partials summed", _all_gather(partial.detach().unsqueeze(0), 0).sum(0),
           ref)
    out = tp_reduce(partial, "tp")
    _close("embedding", out, ref)
    out.backward(gy)
    grad = _all_gather(ws.grad, 0)
    _close("embedding d(weight)", grad[:VOCAB], wf.grad)
    assert (grad[VOCAB:] == 0).all() and ws.grad.abs().sum() > 0


@pytest.mark.procs
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world,padded", [(4, 16), (2, 14)])
def test_vocab_parallel_matches_full(world, padded):
    """Vocabulary 13 padded to `padded` over `world` ranks: per-token losses, lse and the
    gathered d(logits) equal F.cross_entropy's (label smoothing 0 and 0.1, ignore_index
    -100 and a real class), zero in pad columns; embedding partials sum to F.embedding and
    the weight-shard grads concatenate to the full weight grad."""
    _launch(_vocab_rank, world, padded)


# ============================================================== tracing

def _all_ops(x, ids, weight, logits, target):
    a = tp_gather(tp_copy(x, "tp"), 1, "tp")
    b = tp_split(tp_reduce(x, "tp"), 0, "tp")
    c = sp_gather(sp_reduce_scatter(x, 0, "tp"), 1, "tp")
    e = vocab_parallel_embedding(ids, weight, 0, "tp")
    loss, lse = vocab_parallel_cross_entropy(logits, target, 0, 5, -100, 0.1, "tp")
    return a, b, c, e, loss, lse


def _trace_inputs():
    return (torch.randn(4, 6, dtype=D), torch.randint(0, 8, (3, 2)), torch.randn(8, 5, dtype=D),
            torch.randn(3, 8, dtype=D), torch.randint(0, 5, (3,)))


def _check_fake_shapes(n: int) -> None:
    with FakeTensorMode() as mode:
        outs = _all_ops(*(mode.from_tensor(t) for t in _trace_inputs()))
    assert [tuple(o.shape) for o in outs] == [(4, 6 * n), (4 // n, 6), (4 // n, 6 * n),
                                              (3, 2, 5), (3,), (3,)]
    for x in (_trace_inputs()[0], _trace_inputs()[0].requires_grad_()):
        gm = make_fx(_all_ops, tracing_mode="fake")(x, *_trace_inputs()[1:])
        targets = {node.target for node in gm.graph.nodes}
        for op in ("tp_copy", "tp_reduce", "tp_gather", "tp_split", "sp_reduce_scatter",
                   "sp_gather", "vocab_parallel_embedding", "vocab_parallel_cross_entropy"):
            assert getattr(AH, op).default in targets, op


def _joint(x):
    y = tp_gather(tp_copy(x, "tp"), 0, "tp") * 2
    z = sp_reduce_scatter(sp_gather(x, 1, "tp"), 1, "tp") * 3
    return torch.autograd.grad((y.sum() + z.sum(),), (x,))[0]


def _check_joint_trace() -> None:
    gm = make_fx(_joint, tracing_mode="fake")(torch.randn(4, 6, dtype=D, requires_grad=True))
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    for fwd, bwd in (("tp_copy", "tp_reduce"), ("tp_gather", "tp_split"),
                     ("sp_gather", "sp_reduce_scatter")):
        assert ops.count(getattr(AH, fwd).default) >= 1, fwd
        assert getattr(AH, bwd).default in ops, f"backward of {fwd}"
    # sp_reduce_scatter forward + sp_gather's backward; sp_gather forward + its backward
    assert ops.count(AH.sp_reduce_scatter.default) == 2
    assert ops.count(AH.sp_gather.default) == 2


def _trace_rank(rank: int, world: int) -> None:
    _check_fake_shapes(world)
    _check_joint_trace()


@pytest.mark.timeout(60)
def test_ops_trace_with_axis_bound_to_no_group():
    """symbolic_trace records the ops; fake mode and make_fx give the shapes of a 1-rank
    axis and hold every op (forward and the partner ops of the joint backward)."""
    groups.bind("tp", None)
    try:
        gm = torch.fx.symbolic_trace(_all_ops)
        names = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
        assert {"autohybrid.tp_copy.default", "autohybrid.sp_gather.default",
                "autohybrid.vocab_parallel_cross_entropy.default"} <= names
        _check_fake_shapes(1)
        _check_joint_trace()
    finally:
        groups.clear()


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_ops_trace_with_a_two_rank_group():
    """Inside a 2-rank launch, fake impls use the size of the bound group."""
    _launch(_trace_rank, 2)


@pytest.mark.timeout(60)
def test_no_group_is_identity_and_unbound_axis_fails_when_run():
    """A None group: every collective is a copy (new contiguous storage) and gradients
    pass through; an unbound axis raises groups.get's RuntimeFailure when run, while the
    fake impls that need no axis size still trace."""
    x = _leaf(_rand(4, 6).T)
    groups.bind("tp", None)
    try:
        for op, args in ((tp_copy, ()), (tp_reduce, ()), (tp_gather, (1,)), (tp_split, (0,)),
                         (sp_reduce_scatter, (1,)), (sp_gather, (0,))):
            x.grad = None
            y = op(x, *args, "tp")
            assert y.is_contiguous() and y.untyped_storage().data_ptr() != \
                x.untyped_storage().data_ptr()
            _close(f"{op} forward", y, x)
            y.backward(torch.full_like(y, 2.0))
            _close(f"{op} backward", x.grad, torch.full_like(x, 2.0))
    finally:
        groups.clear()
    with pytest.raises(RuntimeFailure, match="no process group bound"):
        tp_copy(x, "tp")
    with pytest.raises(RuntimeFailure, match="no process group bound"):
        vocab_parallel_cross_entropy(x, torch.zeros(6, dtype=torch.long), 0, 4, -100, 0.0, "tp")
    with FakeTensorMode() as mode:
        assert tp_copy(mode.from_tensor(x), "tp").shape == x.shape
