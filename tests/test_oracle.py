"""The ParaDL oracle (cost/oracle.py, ah.oracle, `autohybrid oracle`): every strategy's
numbers checked against hand arithmetic on a tiny CNN, the limits on p, halo sizes, the
CLI. Process-free.

The tiny CNN (per sample, 8x8 RGB input, no biases):
  L0 conv 3→4, k3 s1 p1: x = 3·8·8 = 192, y = 4·8·8 = 256, w = 4·3·3·3 = 108,
     FLOPs 2·256·27 = 13824; halo x: 2 rows of 3·8 = 48, dy: 2 rows of 4·8 = 64
  L1 conv 4→8, k3 s2 p1: x = 256, y = 8·4·4 = 128, w = 8·4·9 = 288,
     FLOPs 2·128·36 = 9216; halo x: 1 row of 4·8 = 32, dy: 1 row of 8·4 = 32
  L2 linear 128→10: x = 128, y = 10, w = 1280, FLOPs 2·10·128 = 2560
On a device of 1e12 FLOP/s at the 0.8 matmul efficiency: FW = FLOPs / 8e11, BW = 2 FW.
Σ(FW+BW) = 3·25600/8e11 = 9.6e-8 s; Σ|w| = 1676; Σ(|x|+|y|) = 448 + 384 + 138 = 970;
Σ|y| = 394; Σ|x| = 576. Links: intra α 1e-6 s, 1e11 B/s; inter α 1e-5 s, 1e10 B/s.
D = 1024, B = 32, δ = 4: I = D/B = 32 iterations.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn

import autohybrid as ah
from autohybrid.cli import main
from autohybrid.cost.cnn_layers import halo_rows
from autohybrid.errors import InputError
from autohybrid.hardware import DeviceSpec, LinkSpec

A_I, B_I, A_E, B_E = 1e-6, 1e-11, 1e-5, 1e-10
D, B, I = 1024, 32, 32
FWBW = 9.6e-8
W, ACTS, YS, XS = 1676, 970, 394, 576


def tiny_cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False),
                         nn.Conv2d(4, 8, 3, stride=2, padding=1, bias=False), nn.Flatten(),
                         nn.Linear(128, 10, bias=False)).to("meta")


def cluster(nodes: int, per_node: int) -> ah.Cluster:
    base = ah.Cluster.preset("dgx-a100-80gb", nodes=nodes, devices_per_node=per_node)
    return dataclasses.replace(
        base, device=DeviceSpec("round", {"float32": 1e12}, 2**36, 1e12, "test"),
        intra_link=LinkSpec("in", 1 / B_I, A_I, "test"),
        inter_link=LinkSpec("out", 1 / B_E, A_E, "test") if nodes > 1 else base.inter_link)


def run(c: ah.Cluster, **kw):
    x = torch.empty(2, 3, 8, 8, device="meta")
    return ah.oracle(tiny_cnn(), c, (x,), dataset_size=D, global_batch=B, **kw)


@pytest.fixture(scope="module")
def p16():
    return run(cluster(2, 8))


def test_layers_from_the_graph(p16):
    got = [(l.x, l.y, l.w, l.in_channels, l.out_channels, l.halo_x, l.halo_dy)
           for l in p16.layers]
    assert got == [(192, 256, 108, 3, 4, 48, 64), (256, 128, 288, 4, 8, 32, 32),
                   (128, 10, 1280, 128, 10, 0, 0)]
    assert [l.fw_s for l in p16.layers] == pytest.approx([13824 / 8e11, 9216 / 8e11,
                                                         2560 / 8e11])


def test_serial_and_data(p16):
    s = p16["serial"]
    assert s.compute_s == pytest.approx(1024 * 9.6e-8) and s.comm_s == 0
    assert s.memory_bytes == 4 * (32 * 970 + 2 * 1676)
    d = p16["data"]
    assert d.applies and d.compute_s == pytest.approx(1024 / 16 * 9.6e-8)
    # ring all-reduce of 1676·4 bytes over 16 ranks on two nodes (inter-node link)
    assert d.comm_s == pytest.approx(32 * (2 * 15 * 1e-5 + 2 * 15 / 16 * 6704 * 1e-10))
    assert d.memory_bytes == 4 * (32 / 16 * 970 + 2 * 1676)


def test_spatial(p16):
    s = p16["spatial"]
    assert s.applies and s.limit == "p ≤ min spatial size (1's 4x4) = 16"
    data = 32 * (2 * 15 * 1e-5 + 2 * 15 / 16 * 6704 * 1e-10)
    halo = 32 * ((2e-5 + 32 * (48 + 64) * 4 * 1e-10) + (2e-5 + 32 * (32 + 32) * 4 * 1e-10))
    assert s.comm_s == pytest.approx(data + halo)
    assert s.memory_bytes == pytest.approx(4 * (32 * (970 / 16 + 48 + 64 + 32 + 32)
                                                + 2 * 1676))


def test_filter_and_channel_on_four_ranks():
    r = run(cluster(1, 4))
    # per layer, all-gather (3α...) + all-reduce: 3(p−1)(α + B|y|δβ/p), inside one node
    expected = 32 * 3 * 3 * (3 * 1e-6 + 32 * 394 * 4 * 1e-11 / 4)
    for name, own in (("filter", 394), ("channel", 576)):
        s = r[name]
        assert s.compute_s == pytest.approx(1024 / 4 * 9.6e-8)
        assert s.comm_s == pytest.approx(expected)
        assert s.memory_bytes == pytest.approx(4 * (32 * (970 - own + own / 4)
                                                    + 2 * 1676 / 4))
    assert r["filter"].applies  # min F = 4
    assert r["channel"].broken == "p ≤ min C (0) = 3 (p = 4)"


def test_pipeline_on_three_ranks():
    r = run(cluster(1, 3), segments=8)
    s = r["pipeline"]
    assert s.applies and r.segments == 8
    # one layer per stage: max FW = L0's 13824/8e11, max BW its double
    assert s.compute_s == pytest.approx(1024 * (3 + 8 - 1) / 8 * 3 * 13824 / 8e11)
    # largest boundary: L0's output, (B/S)·256·4 bytes
    assert s.comm_s == pytest.approx(2 * 1024 * (3 + 8 - 2) / 32
                                     * (1e-6 + 32 / 8 * 256 * 4 * 1e-11))
    assert s.memory_bytes == 4 * (32 * 448 + 2 * 108)
    default = run(cluster(1, 3))
    assert default.segments == 12  # min(B, 4p)


def test_data_filter_and_data_spatial_on_two_nodes_of_four():
    r = run(cluster(2, 4))
    f = r["data×filter"]
    assert f.split == (2, 4) and f.applies
    inner = 32 * 3 * 3 * (3 * 1e-6 + 16 * 394 * 4 * 1e-11 / 4)  # B/p1 = 16 samples
    across = 32 * (2 * 1e-5 + 2 / 2 * (1676 / 4 * 4) * 1e-10)  # |w|/p2 over p1 = 2
    assert f.comm_s == pytest.approx(inner + across)
    assert f.compute_s == pytest.approx(1024 / 8 * 9.6e-8)
    assert f.memory_bytes == pytest.approx(4 * (16 * (970 - 394 + 394 / 4) + 2 * 1676 / 4))
    s = r["data×spatial"]
    halo = 32 * ((2e-6 + 16 * 112 * 4 * 1e-11) + (2e-6 + 16 * 64 * 4 * 1e-11))
    grads = 32 * (2 * 7 * 1e-5 + 2 * 7 / 8 * 6704 * 1e-10)  # all 8 ranks' gradients
    assert s.comm_s == pytest.approx(halo + grads)


def test_limits_named(p16):
    assert p16["filter"].broken == "p ≤ min F (0) = 4 (p = 16)"
    assert p16["pipeline"].broken == "p ≤ layers = 3 (p = 16)"
    assert p16["data×filter"].broken == "p2 ≤ min F (0) = 4 (p2 = 8)"
    small = ah.oracle(tiny_cnn(), cluster(2, 8), (torch.empty(2, 3, 8, 8, device="meta"),),
                      dataset_size=64, global_batch=8, strategy="data")
    assert [s.strategy for s in small.strategies] == ["data"]
    assert small["data"].broken == "p ≤ B = 8 (p = 16)" and small.ranking == ()
    ranked = [s.strategy for s in p16.ranking]
    assert set(ranked) == {"serial", "data", "spatial", "data×spatial"}
    totals = [s.total_s for s in p16.ranking]
    assert totals == sorted(totals)
    text = p16.table()
    assert "filter does not apply: p ≤ min F (0) = 4 (p = 16)" in text
    with pytest.raises(InputError, match="unknown oracle strategy"):
        run(cluster(1, 2), strategy="tensor")


@pytest.mark.parametrize("kernel,stride,padding,dilation,rows", [
    (1, 1, 0, 1, (0, 0)), (3, 1, 1, 1, (2, 2)), (5, 1, 2, 1, (4, 4)), (7, 1, 3, 1, (6, 6)),
    (3, 2, 1, 1, (1, 1)), (7, 2, 3, 1, (5, 3)), (3, 1, 2, 2, (4, 4))])
def test_halo_rows(kernel, stride, padding, dilation, rows):
    assert halo_rows(kernel, stride, padding, dilation) == rows
    # brute force: an interior tile of output rows [o0, o1) over a long input
    o0, o1, reach = 10, 14, dilation * (kernel - 1)
    need = {o * stride - padding + dilation * j for o in range(o0, o1) for j in range(kernel)}
    own = set(range(o0 * stride, o1 * stride))
    assert len(need - own) == rows[0]
    dy = {o for o in range(0, 40) for j in range(kernel)
          if o * stride - padding + dilation * j in own}
    assert len(dy - set(range(o0, o1))) == rows[1]
    assert reach >= 0


def test_cli_prints_table_ranking_and_broken_limits(capsys):
    code = main(["oracle", "cosmoflow-tiny", "--cluster", "dgx-a100-80gb", "--nodes", "2",
                 "--global-batch", "8", "--dataset-size", "64"])
    out = capsys.readouterr().out
    assert code == 0
    assert "ParaDL oracle: cosmoflow-tiny on dgx-a100-80gb (p = 16)" in out
    assert "data does not apply: p ≤ B = 8 (p = 16)" in out
    assert "data×filter does not apply: p1 ≤ B = 8 (p1 = 2)" not in out
    assert "data×filter does not apply: p2 ≤ min F (features.0) = 4 (p2 = 8)" in out
    assert "ranking by total time: " in out
    # a 3-D conv's halo row: the other two spatial dims times the channels
    assert main(["oracle", "cosmoflow-tiny", "--strategy", "tensor"]) == 2
    assert main(["oracle", "cosmoflow-tiny", "--nodes", "2", "--global-batch", "8",
                 "--dataset-size", "64", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["p"] == 16 and "data" not in data["ranking"]
    assert {r["strategy"]: r["applies"] for r in data["strategies"]}["spatial"] is True


def test_conv3d_halo_rows_span_the_other_spatial_dims():
    model = ah.models.preset("cosmoflow-tiny", device="meta")
    (x,), _ = ah.models.example_batch("cosmoflow-tiny", 2, device="meta")
    r = ah.oracle(model, cluster(1, 2), (x,), dataset_size=8, strategy="spatial")
    convs = [(l.halo_x, l.halo_dy, l.spatial) for l in r.layers if l.op == "conv"]
    # 4→4 on 16³: 2 rows of 16·16·4 each way; 4→8 on 8³: 2 rows of 8·8·4 in, 8·8·8 out
    assert convs == [(2048, 2048, (16, 16, 16)), (512, 1024, (8, 8, 8))]
    assert r.global_batch == 2  # the example batch
