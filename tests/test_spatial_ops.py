"""Spatial parallelism's ops (autohybrid/ops/spatial.py) equal the one-process computation.

Process-free: the partition arithmetic on hand-computed cases, the exchange routes on
many sizes (every needed row arrives exactly once, only needed rows travel), the ops on a
one-rank axis, their fake shapes. Multi-process (gloo, 2 and 4 ranks, float64): one
launch per world size runs every case, each rank returning its tiles of the outputs and
gradients; the test process compares them, reassembled, with the full computation.
"""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from _limits import guard
from _pool import launch as pool_launch
from autohybrid.errors import RuntimeFailure
from autohybrid.ops import groups
from autohybrid.ops.batch_norm import sync_batch_norm
from autohybrid.ops.spatial import (_Routes, conv_output_size, halo_fetch, halo_return,
                                    spatial_gather, spatial_split, tile_bounds,
                                    window_input_range)

D = torch.float64


def _rand(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=D, generator=torch.Generator().manual_seed(seed))


def _close(what: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-12,
                               msg=lambda m: f"{what}: {m}")


# ============================================================== arithmetic

def test_tile_bounds_are_balanced_in_rank_order():
    assert tile_bounds(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert tile_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert tile_bounds(7, 2) == [(0, 4), (4, 7)]
    assert tile_bounds(3, 4) == [(0, 1), (1, 2), (2, 3), (3, 3)]
    assert tile_bounds(5, 1) == [(0, 5)]
    with pytest.raises(RuntimeFailure, match="parts >= 1"):
        tile_bounds(5, 0)


def test_window_input_range_hand_cases():
    # kernel 1: the same rows
    assert window_input_range(2, 5, 1) == (2, 5)
    # kernel 3, padding 1: one row either side (row -1 is padding)
    assert window_input_range(0, 5, 3, 1, 1) == (-1, 6)
    # kernel 5, padding 2, at the end of 9 rows: rows 9, 10 are padding
    assert window_input_range(6, 9, 5, 1, 2) == (4, 11)
    # kernel 7, padding 3
    assert window_input_range(2, 4, 7, 1, 3) == (-1, 7)
    # stride 2, kernel 3, padding 1: outputs 2, 3 read rows 3..5 and 5..7
    assert window_input_range(2, 4, 3, 2, 1) == (3, 8)
    # dilation 2, kernel 5, padding 4: output 0 reads -4, -2, 0, 2, 4; output 2 up to 6
    assert window_input_range(0, 3, 5, 1, 4, 2) == (-4, 7)
    # kernel 7, dilation 2, no padding: span 13
    assert window_input_range(1, 2, 7, 1, 0, 2) == (1, 14)
    # stride 2, kernel 2 (non-overlapping pooling)
    assert window_input_range(1, 3, 2, 2, 0) == (2, 6)
    # an empty output range reads nothing
    assert window_input_range(3, 3, 5, 2, 1) == (5, 5)


def test_conv_output_size_matches_torch():
    assert conv_output_size(11, 3, 1, 1) == 11
    assert conv_output_size(11, 3, 2, 1) == 6
    assert conv_output_size(13, 7, 1, 3, 2) == 7
    assert conv_output_size(10, 2, 2) == 5
    for size, k, s, p, d in itertools.product((7, 10, 13), (1, 3, 5, 7), (1, 2), (0, 1, 3),
                                              (1, 2)):
        if p <= k // 2 and conv_output_size(size, k, s, p, d) > 0:
            out = F.conv1d(torch.zeros(1, 1, size), torch.zeros(1, 1, k), stride=s, padding=p,
                           dilation=d)
            assert out.shape[-1] == conv_output_size(size, k, s, p, d), (size, k, s, p, d)


def test_routes_deliver_each_needed_row_once_and_only_needed_rows():
    """For many sizes and windows: what rank p sends q is what q receives from p; a rank's
    received rows, in rank order, are exactly its needed in-range rows; a rank sends only
    rows some other rank's window reads (never its whole tile when a halo suffices)."""
    for size, n, k, s, p, d in itertools.product((5, 9, 13), (2, 3, 4), (1, 3, 5, 7), (1, 2),
                                                 (0, 2, 3), (1, 2)):
        out = conv_output_size(size, k, s, p, d)
        if out < n:
            continue
        routes = [_Routes(r, n, size, out, k, s, p, d) for r in range(n)]
        for a, b in itertools.product(range(n), repeat=2):
            assert routes[a].send[b] == routes[b].recv[a]
        for r, rt in enumerate(routes):
            got = [row for lo, hi in rt.recv for row in range(lo, hi)]
            assert got == list(range(max(rt.in_lo, 0), min(rt.in_hi, size)))
            assert rt.pad_lo + len(got) + rt.pad_hi == rt.in_hi - rt.in_lo
        if k == 1 and s == 1 and p == 0:
            assert not any(rt.crosses for rt in routes)
    # 4 tiles of 3 rows, kernel 3: a rank sends each neighbour one row, nobody else anything
    rt = _Routes(1, 4, 12, 12, 3, 1, 1, 1)
    assert [hi - lo for lo, hi in rt.send] == [1, 3, 1, 0]
    # kernel 7, dilation 2 on tiles of 3: rows come from two ranks away
    rt = _Routes(0, 4, 12, 12, 7, 1, 6, 2)
    assert [hi - lo for lo, hi in rt.recv] == [3, 3, 3, 0]


def test_one_rank_axis_is_padding_and_identity():
    """A None group: halo_fetch pads (zeros or -inf) and a conv on the slab equals the
    padded conv, with the same input gradient; split and gather are copies; fake shapes."""
    groups.bind("sh", None)
    try:
        x = _rand(2, 3, 9, 7, seed=1).requires_grad_()
        w = _rand(4, 3, 5, 3, seed=2)
        out = conv_output_size(9, 5, 2, 2, 2)
        slab = halo_fetch(x, 2, 9, out, 5, 2, 2, 2, "sh", 0.0)
        assert slab.shape == (2, 3, 13, 7) and (slab[:, :, :2] == 0).all()
        y = F.conv2d(slab, w, stride=2, padding=(0, 1), dilation=2)
        ref = F.conv2d(x, w, stride=2, padding=(2, 1), dilation=2)
        _close("conv on the slab", y, ref)
        gy = _rand(*ref.shape, seed=3)
        _close("d(x)", torch.autograd.grad(y, x, gy)[0], torch.autograd.grad(ref, x, gy)[0])
        slab = halo_fetch(x, -2, 9, 9, 3, 1, 1, 1, "sh", float("-inf"))
        assert slab.shape == (2, 3, 11, 7) and (slab[:, :, [0, -1]] == float("-inf")).all()
        g = _rand(2, 3, 11, 7, seed=4)
        _close("halo_return", halo_return(g, 2, 9, 9, 3, 1, 1, 1, "sh"), g[:, :, 1:-1])
        _close("spatial_split", spatial_split(x, 3, "sh"), x)
        _close("spatial_gather", spatial_gather(x, 2, 9, "sh"), x)
        with pytest.raises(RuntimeFailure, match="holds 9 rows along dim 2"):
            spatial_gather(x, 2, 10, "sh")
        with pytest.raises(RuntimeFailure, match="holds 9 rows along dim 2"):
            halo_fetch(x, 2, 10, 10, 3, 1, 1, 1, "sh", 0.0)
        plain = x.detach()
        with FakeTensorMode() as mode:
            fx = mode.from_tensor(plain)
            assert halo_fetch(fx, 2, 9, out, 5, 2, 2, 2, "sh", 0.0).shape == (2, 3, 13, 7)
            assert spatial_gather(fx, 3, 7, "sh").shape == x.shape
    finally:
        groups.clear()


def _joint(x):
    t = spatial_split(x, 2, "sh")
    y = F.conv1d(halo_fetch(t, 2, 9, 9, 3, 1, 1, 1, "sh", 0.0), torch.ones(2, 3, 3, dtype=D))
    g = spatial_gather(y, 2, 9, "sh")
    return torch.autograd.grad(g.sum(), x)[0]


def test_joint_trace_holds_the_partner_ops():
    """make_fx of forward + backward: each op's backward is its partner op (halo_fetch ↔
    halo_return, spatial_split ↔ spatial_gather), so a joint graph holds only
    autohybrid:: nodes for the communication."""
    from torch.fx.experimental.proxy_tensor import make_fx
    groups.bind("sh", None)
    try:
        gm = make_fx(_joint, tracing_mode="fake")(torch.randn(2, 3, 9, dtype=D,
                                                              requires_grad=True))
        ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        ah = torch.ops.autohybrid
        # split, fetch, gather; then gather's backward (split), the fetch's (halo_return)
        # and split's (gather)
        for op, count in ((ah.halo_fetch, 1), (ah.halo_return, 1), (ah.spatial_split, 2),
                          (ah.spatial_gather, 2)):
            assert ops.count(op.default) == count, (op, ops)
    finally:
        groups.clear()


# ============================================================== multi-rank cases

def _case(op, shape, k, s, p, d, dims, world=None):
    return dict(op=op, shape=shape, k=k, s=s, p=p, d=d, dims=dims, world=world)


def _window_cases(world: int) -> list[dict]:
    """(op, input shape, kernel, stride, padding, dilation, tiled dims → axis); sizes that
    do not divide by the tiles; every output tile non-empty."""
    h = ((2, "sh"),)
    cases = [_case("conv1d", (2, 3, 13), k, 1, k // 2, 1, h) for k in (1, 3, 5, 7)]
    cases += [_case("conv1d", (2, 3, 13), 3, 2, 1, 1, h),
              _case("conv1d", (2, 3, 13), 5, 1, 0, 2, h),
              _case("conv1d", (2, 3, 13), 7, 1, 3, 2, h),
              _case("conv1d", (2, 3, 13), 7, 2, 0, 1, h),
              _case("conv1d", (2, 3, 14), 3, 2, 0, 2, h)]
    cases += [_case("conv2d", (2, 3, 11, 9), k, 1, k // 2, 1, h) for k in (1, 3, 5, 7)]
    cases += [_case("conv2d", (2, 3, 11, 9), 5, 2, 2, 1, h),
              _case("conv2d", (2, 3, 11, 9), 7, 1, 3, 2, h),
              _case("conv2d", (2, 3, 11, 9), 3, 2, 0, 2, h)]
    cases += [_case("conv3d", (1, 2, 5, 11, 6), 3, 1, 1, 1, ((3, "sh"),)),
              _case("conv3d", (1, 2, 7, 11, 6), 3, 2, 0, 2, ((3, "sh"),)),
              _case("conv3d", (1, 2, 7, 5, 6), 5, 1, 2, 1, ((2, "sh"),))]
    cases += [_case("max_pool2d", (2, 3, 11, 7), 3, 2, 1, 1, h),
              _case("max_pool2d", (2, 3, 11, 7), 3, 1, 1, 2, h),
              _case("max_pool2d", (2, 3, 10, 7), 2, 2, 0, 1, h),
              _case("avg_pool2d", (2, 3, 11, 7), 3, 2, 1, 1, h),
              _case("avg_pool2d", (2, 3, 11, 7), 5, 1, 2, 1, h)]
    if world == 4:   # 2 × 2 mesh: H over "sh", W over "sw"
        hw = ((2, "sh"), (3, "sw"))
        cases += [_case("conv2d", (2, 3, 11, 9), k, 1, k // 2, 1, hw, 4) for k in (1, 3, 7)]
        cases += [_case("conv2d", (2, 3, 11, 9), 5, 2, 2, 1, hw, 4),
                  _case("conv2d", (2, 3, 13, 11), 7, 1, 3, 2, hw, 4),
                  _case("max_pool2d", (2, 3, 11, 9), 3, 2, 1, 1, hw, 4),
                  _case("avg_pool2d", (2, 3, 11, 9), 3, 1, 1, 1, hw, 4)]
    return cases


def _mesh(rank: int, world: int, two_d: bool) -> dict[str, tuple[int, int]]:
    """Bind the spatial axes; {axis: (this rank's index, axis size)}. On a 2 × 2 mesh rank
    = 2·i + j: "sh" joins the ranks of one j (tiles of H), "sw" those of one i."""
    if not two_d:
        groups.bind("sh", dist.group.WORLD)
        return {"sh": (rank, world)}
    cols = [dist.new_group([j, 2 + j]) for j in range(2)]
    rows = [dist.new_group([2 * i, 2 * i + 1]) for i in range(2)]
    i, j = divmod(rank, 2)
    groups.bind("sh", cols[j])
    groups.bind("sw", rows[i])
    groups.bind("shw", dist.group.WORLD)
    return {"sh": (i, 2), "sw": (j, 2)}


def _tile(x: torch.Tensor, dims, where) -> torch.Tensor:
    """This rank's tile of a full tensor: along each tiled dim, its tile_bounds slice."""
    for dim, axis in dims:
        index, parts = where[axis]
        lo, hi = tile_bounds(x.shape[dim], parts)[index]
        x = x.narrow(dim, lo, hi - lo)
    return x.contiguous()


def _params(case) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if not case["op"].startswith("conv"):
        return None, None
    nd = len(case["shape"]) - 2
    c = case["shape"][1]
    return _rand(4, c, *[case["k"]] * nd, seed=11), _rand(4, seed=12)


def _apply(case, x, w, b, pads) -> torch.Tensor:
    k, s, d = case["k"], case["s"], case["d"]
    if case["op"].startswith("conv"):
        return getattr(F, case["op"])(x, w, b, stride=s, padding=pads, dilation=d)
    if case["op"] == "max_pool2d":
        return F.max_pool2d(x, k, s, pads, d)
    return F.avg_pool2d(x, k, s, pads)   # count_include_pad: zero rows count


def _out_shape(case) -> list[int]:
    shape = list(case["shape"])
    if case["op"].startswith("conv"):
        shape[1] = 4
    return [*shape[:2], *(conv_output_size(n, case["k"], case["s"], case["p"], case["d"])
                          for n in shape[2:])]


def _window_on_tiles(case, where) -> dict:
    """Run one case on this rank's tile: halo_fetch along each tiled dim, then the op with
    no padding along them; the output tile and the gradients (input tile, partial
    weight and bias) for this rank's tile of a fixed upstream gradient."""
    x = _tile(_rand(*case["shape"], seed=10), case["dims"], where).requires_grad_()
    w, b = _params(case)
    w, b = (None, None) if w is None else (w.requires_grad_(), b.requires_grad_())
    k, s, p, d = case["k"], case["s"], case["p"], case["d"]
    pad_value = float("-inf") if case["op"] == "max_pool2d" else 0.0
    out_full = _out_shape(case)
    slab = x
    for dim, axis in case["dims"]:
        slab = halo_fetch(slab, dim, case["shape"][dim], out_full[dim], k, s, p, d, axis,
                          pad_value)
    tiled = {dim for dim, _ in case["dims"]}
    pads = tuple(0 if dim in tiled else p for dim in range(2, len(case["shape"])))
    y = _apply(case, slab, w, b, pads)
    gy = _tile(_rand(*out_full, seed=13), case["dims"], where)
    assert y.shape == gy.shape, (case, y.shape, gy.shape)
    y.backward(gy)
    result = {"y": y.detach(), "dx": x.grad}
    if w is not None:
        result.update(dw=w.grad, db=b.grad)
    plain = x.detach()
    with FakeTensorMode() as mode:   # the fake impl gives this rank's slab shape
        fake = mode.from_tensor(plain)
        for dim, axis in case["dims"]:
            fake = halo_fetch(fake, dim, case["shape"][dim], out_full[dim], k, s, p, d,
                              axis, pad_value)
    result["fake_slab"] = tuple(fake.shape), tuple(slab.shape)
    return result


def _batch_norm_on_tiles(shape, dims, axis, where) -> dict:
    """sync_batch_norm over the spatial axis on this rank's tile (training mode)."""
    x = _tile(_rand(*shape, seed=20), dims, where).requires_grad_()
    w = _rand(shape[1], seed=21).requires_grad_()
    b = _rand(shape[1], seed=22).requires_grad_()
    y, mean, _invstd, var = sync_batch_norm(x, w, b, 1e-5, axis)
    y.backward(_tile(_rand(*shape, seed=23), dims, where))
    return {"y": y.detach(), "dx": x.grad, "dw": w.grad, "db": b.grad, "mean": mean,
            "var": var}


class _Chain(torch.nn.Module):
    """conv → BatchNorm → relu → conv stride 2 → flatten → linear, on (2, 3, 11, 6)."""

    def __init__(self):
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.c1 = torch.nn.Conv2d(3, 4, 3, padding=1).double()
            self.bn = torch.nn.BatchNorm2d(4).double()
            self.c2 = torch.nn.Conv2d(4, 5, 3, stride=2, padding=1).double()
            self.fc = torch.nn.Linear(5 * 6 * 3, 7).double()

    def forward(self, x):
        h = F.relu(self.bn(self.c1(x)))
        return self.fc(self.c2(h).flatten(1))


CHAIN_INPUT = (2, 3, 11, 6)


def _chain_on_tiles(dims, bn_axis: str) -> dict:
    """The chain with the activation tiled along `dims` ((dim, axis) pairs): split, halo,
    conv, BN synced over `bn_axis`, relu, halo, conv stride 2, gather, linear. The loss
    and every gradient."""
    m = _Chain()
    x = _rand(*CHAIN_INPUT, seed=30).requires_grad_()
    t = x
    for dim, axis in dims:
        t = spatial_split(t, dim, axis)
    tiled = {dim for dim, _ in dims}

    def conv(t, layer, stride):
        for dim, axis in dims:
            size = CHAIN_INPUT[dim]
            t = halo_fetch(t, dim, size, conv_output_size(size, 3, stride, 1), 3, stride, 1,
                           1, axis, 0.0)
        pads = tuple(0 if dim in tiled else 1 for dim in (2, 3))
        return F.conv2d(t, layer.weight, layer.bias, stride=stride, padding=pads)

    t, _, _, _ = sync_batch_norm(conv(t, m.c1, 1), m.bn.weight, m.bn.bias, m.bn.eps, bn_axis)
    t = conv(F.relu(t), m.c2, 2)
    for dim, axis in reversed(dims):
        t = spatial_gather(t, dim, conv_output_size(CHAIN_INPUT[dim], 3, 2, 1), axis)
    y = m.fc(t.flatten(1))
    loss = (y * _rand(*y.shape, seed=31)).sum()
    loss.backward()
    return {"loss": loss.detach(), "dx": x.grad,
            **{name: p.grad for name, p in m.named_parameters()}}


def _errors(world: int) -> list[str]:
    """The RuntimeFailures a misuse gets on a real group."""
    seen = []
    x = torch.zeros(1, 1, 3, dtype=D)
    with pytest.raises(RuntimeFailure, match=f"fewer than the {world} ranks"):
        halo_fetch(x, 2, 3 * world, world - 1, 3, 1, 1, 1, "sh", 0.0)
    seen.append("empty output tile")
    with pytest.raises(RuntimeFailure, match="holds 3 rows along dim 2"):
        halo_fetch(x, 2, 4 * world, 4 * world, 3, 1, 1, 1, "sh", 0.0)   # every tile: 4
    seen.append("wrong tile")
    return seen


def _adjoint(where) -> dict:
    """halo_return is halo_fetch's adjoint (<fetch(x), g> = <x, return(g)> summed over the
    ranks), and its own backward is halo_fetch with zero padding (kernel 7, dilation 2:
    rows from two ranks away)."""
    args = (2, 13, 13, 7, 1, 6, 2, "sh")
    x = _tile(_rand(2, 3, 13, seed=50), ((2, "sh"),), where)
    slab = halo_fetch(x, *args, 0.0)
    g = _rand(*slab.shape, seed=51 + where["sh"][0]).requires_grad_()
    back = halo_return(g, *args)
    v = _tile(_rand(2, 3, 13, seed=52), ((2, "sh"),), where)
    (dg,) = torch.autograd.grad(back, g, v)
    return {"dots": ((slab * g).sum().detach(), (x * back).sum().detach()),
            "dg": (dg, halo_fetch(v, *args, 0.0))}


def _spatial_rank(rank: int, world: int) -> dict:
    out = {}
    try:
        where = _mesh(rank, world, two_d=False)
        for i, case in enumerate(_window_cases(world)):
            if case["world"] is None:
                out[f"window{i}"] = _window_on_tiles(case, where)
        out["bn"] = _batch_norm_on_tiles((4, 3, 11, 5), ((2, "sh"),), "sh", where)
        out["chain"] = _chain_on_tiles(((2, "sh"),), "sh")
        out["errors"] = _errors(world)
        out["adjoint"] = _adjoint(where)
        x = _tile(_rand(2, 13, 3, seed=40), ((1, "sh"),), where)
        out["gathered"] = spatial_gather(x, 1, 13, "sh")
        if world == 4:
            where = _mesh(rank, world, two_d=True)
            for i, case in enumerate(_window_cases(world)):
                if case["world"] == 4:
                    out[f"window{i}"] = _window_on_tiles(case, where)
            out["bn2d"] = _batch_norm_on_tiles((4, 3, 11, 9), ((2, "sh"), (3, "sw")), "shw",
                                               where)
            out["where2d"] = where
            out["chain2d"] = _chain_on_tiles(((2, "sh"), (3, "sw")), "shw")
    finally:
        groups.clear()
    return out


# ============================================================== checks in the test process

def _assemble(parts: list[torch.Tensor], dims, wheres) -> torch.Tensor:
    """The full tensor from every rank's tile (each rank's `where` places its tile)."""
    def key(r):
        return tuple(wheres[r][axis][0] for _dim, axis in dims)
    blocks = {key(r): parts[r] for r in range(len(parts))}
    def join(prefix, level):
        if level == len(dims):
            return blocks[prefix]
        dim, axis = dims[level]
        n = wheres[0][axis][1]
        return torch.cat([join((*prefix, i), level + 1) for i in range(n)], dim)
    return join((), 0)


def _reference_window(case) -> dict:
    x = _rand(*case["shape"], seed=10).requires_grad_()
    w, b = _params(case)
    w, b = (None, None) if w is None else (w.requires_grad_(), b.requires_grad_())
    nd = len(case["shape"]) - 2
    y = _apply(case, x, w, b, (case["p"],) * nd)
    y.backward(_rand(*_out_shape(case), seed=13))
    ref = {"y": y.detach(), "dx": x.grad}
    if w is not None:
        ref.update(dw=w.grad, db=b.grad)
    return ref


def _check_window_cases(results: list[dict], world: int) -> int:
    checked = 0
    one_d = [{"sh": (r, world)} for r in range(world)]
    two_d = [results[r].get("where2d") for r in range(world)]
    for i, case in enumerate(_window_cases(world)):
        wheres = one_d if case["world"] is None else two_d
        got = [results[r][f"window{i}"] for r in range(world)]
        ref = _reference_window(case)
        what = f"{case['op']} {case['shape']} k={case['k']} s={case['s']} p={case['p']} " \
               f"d={case['d']} tiled {case['dims']}"
        for r in range(world):
            fake, real = got[r]["fake_slab"]
            assert fake == real, f"{what}: fake slab {fake} != {real} on rank {r}"
        for key in ("y", "dx"):
            _close(f"{what} {key}", _assemble([g[key] for g in got], case["dims"], wheres),
                   ref[key])
        for key in ("dw", "db"):
            if key in ref:
                _close(f"{what} {key}", sum(g[key] for g in got), ref[key])
        checked += 1
    return checked


def _check_batch_norm(got: list[dict], shape, dims, wheres) -> None:
    x = _rand(*shape, seed=20).requires_grad_()
    w = _rand(shape[1], seed=21).requires_grad_()
    b = _rand(shape[1], seed=22).requires_grad_()
    y = F.batch_norm(x, None, None, w, b, training=True, eps=1e-5)
    y.backward(_rand(*shape, seed=23))
    what = f"BatchNorm tiled {dims}"
    _close(f"{what} y", _assemble([g["y"] for g in got], dims, wheres), y.detach())
    _close(f"{what} dx", _assemble([g["dx"] for g in got], dims, wheres), x.grad)
    _close(f"{what} dw", sum(g["dw"] for g in got), w.grad)
    _close(f"{what} db", sum(g["db"] for g in got), b.grad)
    for g in got:
        _close(f"{what} mean", g["mean"], x.detach().mean((0, 2, 3)))
        _close(f"{what} var", g["var"], x.detach().var((0, 2, 3), unbiased=True))


def _check_chain(got: list[dict]) -> None:
    m = _Chain()
    x = _rand(*CHAIN_INPUT, seed=30).requires_grad_()
    y = m(x)
    loss = (y * _rand(*y.shape, seed=31)).sum()
    loss.backward()
    replicated = {"loss", "dx", "fc.weight", "fc.bias"}   # same on every rank
    for g in got:
        _close("chain loss", g["loss"], loss.detach())
        _close("chain d(x)", g["dx"], x.grad)
        for name in ("fc.weight", "fc.bias"):
            _close(f"chain d({name})", g[name], dict(m.named_parameters())[name].grad)
    for name, p in m.named_parameters():
        if name not in replicated:   # partial sums over the tiles
            _close(f"chain d({name})", sum(g[name] for g in got), p.grad)


@pytest.mark.procs
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
def test_spatial_ops_on_tiles_equal_one_process(world):
    """On `world` gloo ranks: halo_fetch + conv1d/2d/3d, max/avg pooling (kernels 1-7,
    stride 2, dilation 2, uneven tiles; H×W tiles on a 2 × 2 mesh) give the full op's
    output and input, weight and bias gradients; BatchNorm over tiles equals the whole
    batch's; a conv → BN → relu → conv → gather → linear chain (H tiles; H×W on 4) equals
    eager in loss and every gradient; halo_return is the adjoint; uneven spatial_gather;
    misuse raises RuntimeFailure."""
    results = pool_launch(_spatial_rank, world, args=(world,), timeout_s=guard(70))
    assert _check_window_cases(results, world) == len(_window_cases(world))
    one_d = [{"sh": (r, world)} for r in range(world)]
    _check_batch_norm([r["bn"] for r in results], (4, 3, 11, 5), ((2, "sh"),), one_d)
    if world == 4:
        _check_batch_norm([r["bn2d"] for r in results], (4, 3, 11, 9),
                          ((2, "sh"), (3, "sw")), [r["where2d"] for r in results])
    _check_chain([r["chain"] for r in results])
    if world == 4:
        _check_chain([r["chain2d"] for r in results])
    dots = [r["adjoint"]["dots"] for r in results]
    _close("<fetch(x), g> vs <x, return(g)>", sum(a for a, _ in dots), sum(b for _, b in dots))
    for r in results:
        _close("halo_return's backward", *r["adjoint"]["dg"])
        assert r["errors"] == ["empty output tile", "wrong tile"]
        _close("spatial_gather of uneven tiles", r["gathered"], _rand(2, 13, 3, seed=40))
