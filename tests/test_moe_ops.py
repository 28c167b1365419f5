"""`autohybrid::moe_experts` equals the experts loop it replaces, on one rank and over ep ranks.

The reference is Hugging Face's eager experts loop written out token by token (float64).
One rank: values and every gradient (tokens, routing weights, both expert weights), for
each activation, the "no expert" sentinel and an expert no token reaches; backward with
forward's saved rows and with them recomputed. Expert parallelism (2 and 4 gloo ranks in
one launch per case): every rank holds its shard of the tokens and its slice of the
experts, and must give the rows and token gradients of its shard and the whole batch's
gradients of its experts, as the reference on the whole batch does — with routes spread,
all sent to one rank's experts (the others receive nothing) and uneven per expert, in one
chunk and in several (the dispatch of one chunk overlapping the experts of the last).
Expert tensor parallelism (2 and 4 ranks): every rank holds the same tokens and a slice of
each expert's intermediate size, and must give the whole output, token and router-weight
gradients, and its slice's share of the weight gradients.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from _limits import guard
from _pool import launch as pool_launch
from autohybrid.errors import RuntimeFailure
from autohybrid.ops import groups, moe
from autohybrid.ops.moe import moe_experts

D = torch.float64
H, INTER = 6, 5
LAUNCH_TIMEOUT_S = guard(90)


def _reference(x, idx, w, gate_up, down, act: str):
    fn = {"silu": F.silu, "gelu": F.gelu, "relu": torch.relu,
          "gelu_tanh": lambda g: F.gelu(g, approximate="tanh")}[act]
    rows = []
    for t in range(x.shape[0]):
        row = torch.zeros_like(x[t])
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            if e < gate_up.shape[0]:
                gate, up = (gate_up[e] @ x[t]).split(down.shape[-1])
                row = row + w[t, j] * (down[e] @ (fn(gate) * up))
        rows.append(row)
    return torch.stack(rows)


def _inputs(tokens: int, experts: int, k: int, routes: str, seed: int = 0,
            inter: int = INTER):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, dtype=D, generator=gen)
    if routes == "spread":
        idx = torch.randint(0, experts, (tokens, k), generator=gen)
    elif routes == "one":          # every route to expert 0 (rank 0's)
        idx = torch.zeros(tokens, k, dtype=torch.long)
    else:                          # "skewed": mostly the last expert, a few elsewhere
        idx = torch.full((tokens, k), experts - 1, dtype=torch.long)
        idx[::3, 0] = torch.randint(0, experts, (len(range(0, tokens, 3)),), generator=gen)
    w = torch.rand(tokens, k, dtype=D, generator=gen)
    gate_up = torch.randn(experts, 2 * inter, H, dtype=D, generator=gen)
    down = torch.randn(experts, H, inter, dtype=D, generator=gen)
    return x, idx, w, gate_up, down


def _leaves(*ts):
    return [t.detach().clone().requires_grad_() for t in ts]


def _close(what, actual, expected):
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-11,
                               msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("act", moe.ACTIVATIONS)
def test_one_rank_equals_the_experts_loop(act):
    x, idx, w, gate_up, down = _inputs(10, 4, 2, "spread", seed=3)
    idx[0, 1] = 4                       # the sentinel: no expert
    idx[idx == 1] = 2                   # expert 1 gets no token
    gy = torch.randn(10, H, dtype=D, generator=torch.Generator().manual_seed(9))
    a = _leaves(x, w, gate_up, down)
    b = _leaves(x, w, gate_up, down)
    out = moe_experts(a[0], idx, a[1], a[2], a[3], 4, act, "")
    ref = _reference(b[0], idx, b[1], b[2], b[3], act)
    _close("output", out, ref)
    grads = torch.autograd.grad(out, a, gy)
    expected = torch.autograd.grad(ref, b, gy)
    for name, g, e in zip(("x", "weights", "gate_up", "down"), grads, expected):
        _close(f"grad {name}", g, e)
    assert grads[2][1].abs().sum() == 0 and grads[1][0, 1] == 0


def test_backward_recomputes_what_forward_did_not_leave(monkeypatch):
    class Forgetful:            # a forward that left nothing, as a traced one
        value = property(lambda self: None, lambda self, v: None)
    monkeypatch.setattr(moe, "_LEFT", Forgetful())
    x, idx, w, gate_up, down = _inputs(9, 4, 2, "skewed", seed=4)
    a = _leaves(x, w, gate_up, down)
    b = _leaves(x, w, gate_up, down)
    out = moe_experts(a[0], idx, a[1], a[2], a[3], 4, "silu", "")
    ref = _reference(b[0], idx, b[1], b[2], b[3], "silu")
    gy = torch.ones_like(out)
    for g, e in zip(torch.autograd.grad(out, a, gy), torch.autograd.grad(ref, b, gy)):
        _close("gradient", g, e)


def test_activation_checkpointing_frees_and_recomputes_the_saved_rows():
    """Forward's rows for backward (the received rows, gate/up projections, expert outputs)
    are saved tensors — backward does not run forward again — so under
    torch.utils.checkpoint they are packed, dropped, and the recomputation restores them,
    gradients unchanged; without autograd recording they live as long as the output."""
    from torch.utils.checkpoint import checkpoint

    x, idx, w, gate_up, down = _inputs(9, 4, 2, "spread", seed=5)
    packed = []

    def pack(t):
        packed.append(tuple(t.shape))
        return t
    a = _leaves(x, w, gate_up, down)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        moe_experts(a[0], idx, a[1], a[2], a[3], 4, "silu", "")
    # x, idx, weights, gate_up, down + the routing's order, tokens, local, xe, h, ys
    assert len(packed) == 11 and (18, 2 * INTER) in packed, packed
    with torch.no_grad():     # nothing records: the rows go with the output
        out = moe_experts(a[0], idx, a[1], a[2], a[3], 4, "silu", "")
        assert moe._LEFT.value is not None
        del out
    assert moe._LEFT.value is None
    a = _leaves(x, w, gate_up, down)
    b = _leaves(x, w, gate_up, down)
    out = checkpoint(lambda *t: moe_experts(t[0], idx, t[1], t[2], t[3], 4, "silu", ""),
                     *a, use_reentrant=False)
    ref = _reference(b[0], idx, b[1], b[2], b[3], "silu")
    gy = torch.ones_like(out)
    for g, e in zip(torch.autograd.grad(out, a, gy), torch.autograd.grad(ref, b, gy)):
        _close("gradient", g, e)


def test_bad_routes_and_shapes_are_refused():
    x, idx, w, gate_up, down = _inputs(4, 4, 2, "spread")
    with pytest.raises(RuntimeFailure, match=r"indices must lie in \[0, 4\]"):
        moe_experts(x, idx + 5, w, gate_up, down, 4, "silu", "")
    with pytest.raises(RuntimeFailure, match="need 4 local experts"):
        moe_experts(x, idx, w, gate_up[:2], down[:2], 4, "silu", "")
    with pytest.raises(RuntimeFailure, match="activation 'tanh'"):
        moe_experts(x, idx, w, gate_up, down, 4, "tanh", "")


def test_fake_gives_the_token_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x, idx, w = torch.empty(7, H), torch.zeros(7, 2, dtype=torch.long), torch.empty(7, 2)
        out = moe_experts(x, idx, w, torch.empty(4, 2 * INTER, H), torch.empty(4, H, INTER),
                          4, "silu", "")
    assert out.shape == (7, H)


# ------------------------------------------------------------------ expert parallelism

def _ep_rank(rank: int, world: int, experts: int, routes: str, chunks: int = 1) -> str:
    groups.bind("ep", dist.group.WORLD)
    try:
        per = 5 + rank                              # uneven token counts per rank
        sizes = [5 + r for r in range(world)]
        x, idx, w, gate_up, down = _inputs(sum(sizes), experts, 2, routes, seed=11)
        idx[1, 1] = experts                         # a sentinel route
        gy = torch.randn(sum(sizes), H, dtype=D, generator=torch.Generator().manual_seed(5))
        lo = sum(sizes[:rank])
        mine = slice(lo, lo + per)
        local = experts // world
        own = slice(rank * local, (rank + 1) * local)
        full = _leaves(x, w, gate_up, down)
        ref = _reference(full[0], idx, full[1], full[2], full[3], "silu")
        ref_grads = torch.autograd.grad(ref, full, gy)
        part = _leaves(x[mine], w[mine], gate_up[own], down[own])
        out = moe_experts(part[0], idx[mine], part[1], part[2], part[3], experts, "silu",
                          "ep", chunks)
        _close("output", out, ref[mine])
        grads = torch.autograd.grad(out, part, gy[mine])
        _close("grad x", grads[0], ref_grads[0][mine])
        _close("grad weights", grads[1], ref_grads[1][mine])
        _close("grad gate_up", grads[2], ref_grads[2][own])
        _close("grad down", grads[3], ref_grads[3][own])
        if routes == "one" and rank > 0:     # nothing reached this rank's experts
            assert grads[2].abs().sum() == 0
    finally:
        groups.clear()
    return f"ok:{rank}"


@pytest.mark.procs
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world, experts", [(2, 4), (4, 8)])
def test_expert_parallel_equals_the_whole_batch(world, experts):
    for routes, chunks in (("spread", 1), ("one", 1), ("skewed", 1), ("spread", 3),
                           ("one", 2), ("skewed", 9)):
        # chunks: each chunk's rows travel while the one before is computed; 9 is more
        # chunks than a rank has tokens (5 to 8): some chunks empty, as many on every rank
        results = pool_launch(_ep_rank, world, args=(world, experts, routes, chunks),
                              timeout_s=LAUNCH_TIMEOUT_S)
        assert results == [f"ok:{r}" for r in range(world)]


# ------------------------------------------------------------------ expert tensor parallelism

def _tp_rank(rank: int, world: int) -> str:
    """Every rank: the same tokens and routes, slice `rank` of each expert's intermediate
    size (gate rows, up rows, down columns); routes spread, then all to one expert."""
    groups.bind("tp", dist.group.WORLD)
    try:
        for routes in ("spread", "one"):
            _tp_case(rank, world, routes)
    finally:
        groups.clear()
    return f"ok:{rank}"


def _tp_case(rank: int, world: int, routes: str) -> None:
    inter, experts = 4 * world, 4
    x, idx, w, gate_up, down = _inputs(9, experts, 2, routes, seed=3, inter=inter)
    idx[2, 0] = experts                         # a sentinel route
    gy = torch.randn(9, H, dtype=D, generator=torch.Generator().manual_seed(7))
    full = _leaves(x, w, gate_up, down)
    ref = _reference(full[0], idx, full[1], full[2], full[3], "gelu")
    ref_grads = torch.autograd.grad(ref, full, gy)
    width = inter // world
    cols = slice(rank * width, (rank + 1) * width)
    rows = torch.cat([torch.arange(inter)[cols], inter + torch.arange(inter)[cols]])
    part = _leaves(x, w, gate_up[:, rows], down[:, :, cols])
    out = moe_experts(part[0], idx, part[1], part[2], part[3], experts, "gelu", "", 1, "tp")
    _close(f"{routes}: output", out, ref)
    grads = torch.autograd.grad(out, part, gy)
    _close(f"{routes}: grad x", grads[0], ref_grads[0])
    _close(f"{routes}: grad weights", grads[1], ref_grads[1])
    _close(f"{routes}: grad gate_up", grads[2], ref_grads[2][:, rows])
    _close(f"{routes}: grad down", grads[3], ref_grads[3][:, :, cols])


@pytest.mark.procs
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_experts_equal_the_whole_experts(world):
    """Expert tensor parallelism: each rank's slice of every expert, the output and the
    token and router-weight gradients summed over the ranks: the whole experts' values."""
    results = pool_launch(_tp_rank, world, args=(world,), timeout_s=LAUNCH_TIMEOUT_S)
    assert results == [f"ok:{r}" for r in range(world)]


def test_tensor_parallel_experts_is_decided_in_one_place():
    """tp splits the experts (under ep: each rank's) where its ranks share the tokens
    (no sp), and tp divides every layer's intermediate size."""
    assert moe.tensor_parallel_experts(2, False, [8, 16])
    assert not moe.tensor_parallel_experts(1, False, [8])
    assert not moe.tensor_parallel_experts(2, True, [8])       # sp: own tokens per rank
    assert not moe.tensor_parallel_experts(4, False, [8, 6])   # 4 does not divide 6
    with pytest.raises(RuntimeFailure, match="intermediate size"):
        moe_experts(torch.randn(3, H), torch.zeros(3, 1, dtype=torch.long),
                    torch.ones(3, 1), torch.randn(2, 6, H), torch.randn(2, H, 4), 2,
                    "silu", "", 1, "tp")


def test_chunks_split_the_tokens_evenly():
    assert moe.chunk_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert moe.chunk_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]   # as many everywhere
    assert moe.chunk_bounds(0, 2) == [(0, 0), (0, 0)]
