"""Sharded dropout and sharded SDPA drop exactly the elements eager PyTorch drops.

Single process: the `ways` ranks of a tp group are simulated by calling the op with
index 0..ways-1, resetting `torch.manual_seed` before each call as every rank starts from
the same seed. The concatenated shards' outputs and input gradients must EQUAL (bit for
bit, float64) eager `F.dropout` / `F.scaled_dot_product_attention` on the full tensors
under the same seed, and the generator must end where eager leaves it. The cases cannot
pass vacuously: they assert that elements were dropped, that the shards' masks differ,
and that the obvious shard-sized draw gives a different answer. The premise (how eager
draws the mask on CPU) is tested on its own, so a torch upgrade that changes it fails
there first.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode

from autohybrid.errors import RuntimeFailure
from autohybrid.ops.dropout import sharded_dropout, sharded_sdpa

D = torch.float64
AH = torch.ops.autohybrid
SEED = 1234
SHAPE = (4, 8, 12)


def _rand(*shape, seed: int = 0, dtype: torch.dtype = D) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_()


def _equal(what: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    if not torch.equal(actual, expected):
        diff = (actual.double() - expected.double()).abs().nan_to_num().max().item()
        raise AssertionError(f"{what}: not bit-identical (max |diff| {diff})")


def _eager_dropout(x, gy, p):
    """Eager dropout of the full tensor: (out, input grad, generator state afterwards)."""
    xf = _leaf(x)
    torch.manual_seed(SEED)
    y = F.dropout(xf, p)
    state = torch.get_rng_state()
    y.backward(gy)
    return y.detach(), xf.grad, state


def _sharded_dropout(x, gy, p, dim, ways, train=True):
    """Every simulated rank's (out, mask, input grad, generator state afterwards)."""
    ranks = []
    for index, (xs, gs) in enumerate(zip(x.chunk(ways, dim), gy.chunk(ways, dim))):
        xs = _leaf(xs)
        torch.manual_seed(SEED)
        out, mask = sharded_dropout(xs, p, train, list(x.shape), dim, index, ways)
        state = torch.get_rng_state()
        out.backward(gs)
        ranks.append((out.detach(), mask, xs.grad, state))
    return ranks


# ============================================================== the premise

@pytest.mark.timeout(60)
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_eager_cpu_dropout_is_one_full_bernoulli(p):
    """F.dropout on CPU == x * empty_like(x).bernoulli_(1 - p).div_(1 - p), same seed."""
    x = _rand(*SHAPE, seed=1)
    torch.manual_seed(SEED)
    y = F.dropout(x, p)
    torch.manual_seed(SEED)
    noise = torch.empty_like(x).bernoulli_(1 - p)
    _equal("F.dropout vs bernoulli_", y, x * noise.div(1 - p))
    assert 0 < int((y == 0).sum()) < y.numel()
    # the draw consumes the generator according to the numel: a shard-sized draw leaves it
    # elsewhere, which is why the op draws the whole tensor
    after_full = torch.get_rng_state()
    torch.manual_seed(SEED)
    torch.empty(x.numel() // 2, dtype=D).bernoulli_(1 - p)
    assert not torch.equal(torch.get_rng_state(), after_full)


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((str(func), tuple(args[0].shape) if args and
                           isinstance(args[0], torch.Tensor) else ()))
        return func(*args, **(kwargs or {}))


@pytest.mark.timeout(60)
def test_eager_cpu_sdpa_dropout_is_math_and_one_bernoulli_on_the_weights():
    b, h, t, e = 2, 4, 5, 3
    q, k, v = (_rand(b, h, t, e, seed=s) for s in (1, 2, 3))
    rec = _Recorder()
    with rec:
        F.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True)
    draws = [shape for name, shape in rec.calls if "bernoulli" in name or "rand" in name
             or "native_dropout" in name or "flash" in name]
    assert draws == [(b, h, t, t)], rec.calls


# ============================================================== sharded_dropout

@pytest.mark.timeout(60)
@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("ways", [2, 4])
@pytest.mark.parametrize("dim", [0, 1, 2])
def test_sharded_dropout_equals_eager(dim, ways, p):
    x, gy = _rand(*SHAPE, seed=1), _rand(*SHAPE, seed=2)
    y, gx, state = _eager_dropout(x, gy, p)
    ranks = _sharded_dropout(x, gy, p, dim, ways)
    _equal("forward", torch.cat([r[0] for r in ranks], dim), y)
    _equal("input gradient", torch.cat([r[2] for r in ranks], dim), gx)
    _equal("mask", torch.cat([r[1] for r in ranks], dim), y != 0)
    for index, rank in enumerate(ranks):
        assert rank[1].dtype == torch.bool
        assert torch.equal(rank[3], state), f"rank {index} left the generator elsewhere"
    # not vacuous: elements were dropped and kept, the shards' masks differ, and drawing only
    # a shard-sized mask (plain dropout on the shard, same seed) drops other elements
    dropped = int((y == 0).sum())
    assert 0 < dropped < y.numel()
    masks = [r[1] for r in ranks]
    assert any(not torch.equal(masks[0], m) for m in masks[1:])
    torch.manual_seed(SEED)
    naive = F.dropout(x.chunk(ways, dim)[1], p)
    assert not torch.equal(naive, ranks[1][0])


@pytest.mark.timeout(60)
def test_sharded_dropout_float32_and_negative_dim():
    x, gy = _rand(*SHAPE, seed=3, dtype=torch.float32), _rand(*SHAPE, seed=4,
                                                                dtype=torch.float32)
    y, gx, _ = _eager_dropout(x, gy, 0.1)  # p = 0.1: x * (m / 0.9) != x * m / 0.9 here
    ranks = _sharded_dropout(x, gy, 0.1, -1, 4)
    _equal("forward", torch.cat([r[0] for r in ranks], -1), y)
    _equal("input gradient", torch.cat([r[2] for r in ranks], -1), gx)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("p, train", [(0.0, True), (0.5, False)])
def test_sharded_dropout_identity(p, train):
    x, gy = _rand(*SHAPE, seed=1), _rand(*SHAPE, seed=2)
    torch.manual_seed(SEED)
    before = torch.get_rng_state()
    for index, (xs, gs) in enumerate(zip(x.chunk(2, 1), gy.chunk(2, 1))):
        xs = _leaf(xs)
        out, mask = sharded_dropout(xs, p, train, list(SHAPE), 1, index, 2)
        out.backward(gs)
        _equal("identity forward", out, xs.detach())
        _equal("identity gradient", xs.grad, gs)
        assert out.data_ptr() != xs.data_ptr(), "the op must return a copy, not an alias"
        assert bool(mask.all())
    assert torch.equal(torch.get_rng_state(), before), "p = 0 / eval must not draw"


@pytest.mark.timeout(60)
def test_sharded_dropout_p1_is_eager_zeros():
    x = torch.tensor([[-1.0, float("inf")], [2.0, -3.0]], dtype=D)
    torch.manual_seed(SEED)
    y = F.dropout(x, 1.0)
    before = torch.get_rng_state()
    outs = []
    for index in range(2):
        torch.manual_seed(SEED)
        out, mask = sharded_dropout(x[:, index:index + 1], 1.0, True, [2, 2], 1, index, 2)
        assert not bool(mask.any())
        outs.append(out)
    got = torch.cat(outs, 1)
    assert torch.equal(got.isnan(), y.isnan()) and bool(y.isnan().any())
    _equal("p = 1", got.nan_to_num(), y.nan_to_num())
    assert torch.equal(got.signbit(), y.signbit())  # -1 * 0 = -0., as eager
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.timeout(60)
def test_sharded_dropout_traces_with_make_fx():
    def f(x):
        full = [x.shape[0], x.shape[1] * 2, x.shape[2]]  # SymInts when symbolic
        return AH.sharded_dropout(x, 0.5, True, full, 1, 1, 2)[0]

    gm = make_fx(f, tracing_mode="symbolic")(_rand(4, 4, 12))
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert AH.sharded_dropout.default in targets
    assert not any("bernoulli" in str(t) for t in targets)
    x = _rand(*SHAPE, seed=5)
    torch.manual_seed(SEED)
    y = F.dropout(x, 0.5)
    torch.manual_seed(SEED)
    _equal("traced graph on rank 1", gm(x.chunk(2, 1)[1]), y.chunk(2, 1)[1])

    def joint(x):  # forward + backward: the backward uses the saved mask, never redraws
        out = AH.sharded_dropout(x, 0.5, True, [4, 8, 12], 1, 0, 2)[0]
        return torch.autograd.grad(out.sum(), x)

    jm = make_fx(joint)(_leaf(_rand(4, 4, 12)))
    names = [str(n.target) for n in jm.graph.nodes if n.op == "call_function"]
    assert names.count("autohybrid.sharded_dropout.default") == 1
    assert not any("bernoulli" in n or "dropout" in n and "autohybrid" not in n for n in names)


@pytest.mark.timeout(60)
def test_sharded_dropout_under_fake_tensor_mode():
    with FakeTensorMode():
        x = torch.empty(4, 2, 12, dtype=D)
        out, mask = sharded_dropout(x, 0.1, True, [4, 8, 12], 1, 3, 4)
        assert out.shape == x.shape and out.dtype == D
        assert mask.shape == x.shape and mask.dtype == torch.bool
        with pytest.raises(RuntimeFailure):
            sharded_dropout(x, 0.1, True, [4, 6, 12], 1, 0, 4)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("full, dim, index, ways, p, match", [
    ([4, 6, 12], 1, 0, 4, 0.5, "dim 1 should be 8, got 6"),      # not ways x shard
    ([4, 8, 10], 1, 0, 4, 0.5, "dim 2 should be 12, got 10"),    # another dim differs
    ([5, 8, 12], 1, 0, 4, 0.5, "dim 0 should be 4, got 5"),
    ([4, 8], 1, 0, 4, 0.5, "has 2 dims"),
    ([4, 8, 12], 1, 4, 4, 0.5, "index 4"),
    ([4, 8, 12], 3, 0, 4, 0.5, "dim 3 is out of range"),
    ([4, 8, 12], 1, 0, 4, 1.5, r"not in \[0, 1\]"),
    ([4, 6, 12], 1, 0, 4, 0.0, "dim 1 should be 8"),             # checked even when p = 0
])
def test_sharded_dropout_rejects_bad_shapes(full, dim, index, ways, p, match):
    x = _rand(4, 2, 12)
    with pytest.raises(RuntimeFailure, match=match):
        sharded_dropout(x, p, True, full, dim, index, ways)


# ============================================================== sharded_sdpa

B, H, T, E = 2, 8, 6, 4


def _sdpa_case(name):
    if name == "causal":
        return {"is_causal": True}
    if name == "float_mask":
        return {"attn_mask": _rand(T, T, seed=9)}
    if name == "bool_mask_neg_scale":
        gen = torch.Generator().manual_seed(10)
        return {"attn_mask": torch.rand(B, 1, T, T, generator=gen) > 0.3, "scale": -0.3}
    return {}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["causal", "float_mask", "bool_mask_neg_scale", "plain"])
@pytest.mark.parametrize("ways", [2, 4])
def test_sharded_sdpa_equals_eager(ways, case):
    p, kw = 0.3, _sdpa_case(case)
    q, k, v = (_rand(B, H, T, E, seed=s) for s in (1, 2, 3))
    gy = _rand(B, H, T, E, seed=4)
    qf, kf, vf = _leaf(q), _leaf(k), _leaf(v)
    torch.manual_seed(SEED)
    y = F.scaled_dot_product_attention(qf, kf, vf, dropout_p=p, **kw)
    state = torch.get_rng_state()
    y.backward(gy)
    h = H // ways
    outs, masks, grads = [], [], []
    for index in range(ways):
        heads = slice(index * h, (index + 1) * h)
        qs, ks, vs = _leaf(q[:, heads]), _leaf(k[:, heads]), _leaf(v[:, heads])
        torch.manual_seed(SEED)
        out, mask = sharded_sdpa(qs, ks, vs, kw.get("attn_mask"), p, kw.get("is_causal", False),
                                 kw.get("scale"), H, index, ways)
        assert torch.equal(torch.get_rng_state(), state), f"rank {index}: generator elsewhere"
        out.backward(gy[:, heads])
        outs.append(out.detach())
        masks.append(mask)
        grads.append((qs.grad, ks.grad, vs.grad))
    _equal("forward", torch.cat(outs, 1), y.detach())
    for i, (name, full) in enumerate((("q", qf), ("k", kf), ("v", vf))):
        _equal(f"grad {name}", torch.cat([g[i] for g in grads], 1), full.grad)
    # not vacuous: weights were dropped, the shards' masks differ, and without dropout (or
    # with a shard-sized draw) the answer differs
    mask = torch.cat(masks, 1)
    assert mask.shape == (B, H, T, T) and 0 < int((~mask).sum()) < mask.numel()
    assert not torch.equal(masks[0], masks[1])
    no_drop = F.scaled_dot_product_attention(q, k, v, **kw)
    assert not torch.allclose(no_drop, y.detach())
    torch.manual_seed(SEED)
    naive = F.scaled_dot_product_attention(q[:, h:2 * h], k[:, h:2 * h], v[:, h:2 * h],
                                           dropout_p=p, **kw)
    assert not torch.allclose(naive, outs[1])


@pytest.mark.timeout(60)
def test_sharded_sdpa_float_mask_gradient_sums_to_eager():
    q, k, v = (_rand(B, H, T, E, seed=s) for s in (1, 2, 3))
    mask = _rand(T, T, seed=9)
    mf = _leaf(mask)
    torch.manual_seed(SEED)
    F.scaled_dot_product_attention(q, k, v, attn_mask=mf, dropout_p=0.3).sum().backward()
    total = torch.zeros_like(mask)
    for index in range(2):
        ms = _leaf(mask)
        heads = slice(index * H // 2, (index + 1) * H // 2)
        torch.manual_seed(SEED)
        sharded_sdpa(q[:, heads], k[:, heads], v[:, heads], ms, 0.3, False, None, H, index,
                     2)[0].sum().backward()
        total += ms.grad  # the tp all-reduce of a replicated mask's gradient
    torch.testing.assert_close(total, mf.grad, rtol=1e-12, atol=1e-12)
    assert float(mf.grad.abs().sum()) > 0


@pytest.mark.timeout(60)
def test_sharded_sdpa_traces():
    q = _rand(B, H // 2, T, E)
    gm = make_fx(lambda q, k, v: AH.sharded_sdpa(q, k, v, None, 0.3, True, None, H, 1, 2)[0]
                 )(q, q, q)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert AH.sharded_sdpa.default in targets
    with FakeTensorMode():
        qf = torch.empty(B, H // 2, T, E, dtype=D)
        vf = torch.empty(B, H // 2, T, 7, dtype=D)
        out, mask = sharded_sdpa(qf, qf, vf, None, 0.3, True, None, H, 0, 2)
        assert out.shape == (B, H // 2, T, 7) and out.dtype == D
        assert mask.shape == (B, H // 2, T, T) and mask.dtype == torch.bool


@pytest.mark.timeout(60)
def test_sharded_sdpa_rejects_bad_inputs():
    q = _rand(B, H // 2, T, E)
    with pytest.raises(RuntimeFailure, match="dim 1 should be 8, got 6"):
        sharded_sdpa(q, q, q, None, 0.3, False, None, 6, 0, 2)
    with pytest.raises(RuntimeFailure, match="4-D"):
        sharded_sdpa(q[0], q[0], q[0], None, 0.3, False, None, H, 0, 2)
    with pytest.raises(RuntimeFailure, match="not both"):
        sharded_sdpa(q, q, q, _rand(T, T), 0.3, True, None, H, 0, 2)
    with pytest.raises(RuntimeFailure, match="no grouped-query"):
        sharded_sdpa(q, q[:, :1], q[:, :1], None, 0.3, False, None, H, 0, 2)
