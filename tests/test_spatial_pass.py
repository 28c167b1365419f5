"""The spatial_parallel pass on one process (fake process groups): where it puts halo
exchanges, gathers and synchronized BatchNorm, what it leaves replicated, what it
refuses; and the Plan's spatial axis (groups, JSON). That the rewritten graphs train
like eager on real ranks is tests/test_spatial_parallel.py."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autohybrid as ah
from autohybrid.capture import capture
from autohybrid.graph import op_name
from autohybrid.plan import Mesh, Plan, RankPlacement, spatial_groups
from autohybrid.rewrite import rewrite


class _Net(nn.Module):
    """conv(pad 1) → BN → relu → max pool(pad 1) → conv(k 5, stride 2) → dropout →
    conv → adaptive pool → linear."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.c1, self.bn = nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.pool = nn.MaxPool2d(3, stride=1, padding=1)
        self.c2, self.c3 = nn.Conv2d(4, 4, 5, stride=2, padding=2), nn.Conv2d(4, 4, 3)
        self.drop, self.fc = nn.Dropout(dropout), nn.Linear(4, 3)

    def forward(self, x):
        x = self.pool(F.relu(self.bn(self.c1(x))))
        x = self.c3(self.drop(self.c2(x)))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def _program(model: nn.Module, spatial: tuple[int, ...], dp: int = 1, rank: int = 1,
             shape=(4, 2, 13, 11)):
    x, y = torch.randn(*shape), torch.randint(0, 3, (shape[0],))
    tp = 1
    for n in spatial:
        tp *= n
    plan = ah.plan(model, ah.Cluster.local(tp * dp), (x,), loss_fn=F.cross_entropy,
                   example_targets=(y,),
                   constraints=ah.Constraints(tp=tp, dp=dp, pp=1, spatial=spatial))
    cap = capture(model, (x,), F.cross_entropy, example_targets=(y,))
    return plan, rewrite(cap, plan, rank, fake_groups=True).runnable.gm


def _ops(gm, name: str) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if op_name(n) == name]


def test_windows_fetch_halos_batch_norm_syncs_over_tiles_and_the_classifier_is_gathered():
    plan, gm = _program(_Net(), (2,))
    assert plan.mesh.spatial == (2,) and plan.shardings == () and plan.executable
    assert plan.mesh.describe() == "pp1×dp1×spatial2"
    fetches = _ops(gm, "autohybrid.halo_fetch.default")
    # c1, the pool, c2, c3: each reads its halo along H over "tp"; c1's input is split
    assert len(fetches) == 4 and all(f.args[1] == 2 and f.args[8] == "tp" for f in fetches)
    assert [f.args[9] for f in fetches] == [0.0, float("-inf"), 0.0, 0.0]
    assert len(_ops(gm, "autohybrid.spatial_split.default")) == 1
    for conv in _ops(gm, "aten.conv2d.default"):
        assert conv.args[4][0] == 0   # no padding along the tiled H: the halo holds it
        assert op_name(conv.args[1]) == "autohybrid.tp_copy.default"  # weight grad summed
    (bn,) = _ops(gm, "autohybrid.sync_batch_norm.default")
    assert bn.args[4] == "tp" and not _ops(gm, "aten.batch_norm.default")
    (gather,) = _ops(gm, "autohybrid.spatial_gather.default")
    assert [op_name(u) for u in gather.users] == ["aten.adaptive_avg_pool2d.default"]
    # rank 1 of 2 holds rows 3, 4 of c3's 5 output rows (H 13 → 13 → 13 → 7 → 5, W 11
    # → 11 → 11 → 6 → 4); dropout with p = 0 draws no mask: it ran on the tile
    assert tuple(gather.args[0].meta["val"].shape[2:]) == (2, 4)


def test_two_dimensional_tiles_fetch_along_h_then_w_and_dp_syncs_over_both():
    plan, gm = _program(_Net(), (2, 2), dp=2, rank=5)
    assert plan.mesh.describe() == "pp1×dp2×spatial2×2"
    fetches = _ops(gm, "autohybrid.halo_fetch.default")
    assert [(f.args[1], f.args[8]) for f in fetches[:2]] == [(2, "tile_h"), (3, "tile_w")]
    (bn,) = _ops(gm, "autohybrid.sync_batch_norm.default")
    assert bn.args[4] == "dp_tp"
    gathers = _ops(gm, "autohybrid.spatial_gather.default")
    assert [(g.args[1], g.args[3]) for g in gathers] == [(3, "tile_w"), (2, "tile_h")]


def test_dropout_runs_on_the_whole_activation_and_small_outputs_stay_replicated():
    # dropout: eager's mask is drawn for the whole tensor, so its input is gathered
    _, gm = _program(_Net(dropout=0.5), (2,))
    gathers = _ops(gm, "autohybrid.spatial_gather.default")
    assert [op_name(u) for u in gathers[0].users] == ["aten.dropout.default"]
    assert len(gathers) == 2 and len(_ops(gm, "autohybrid.spatial_split.default")) == 2
    # 4 tiles of H = 5: c2's output has 3 rows, fewer than the tiles: c2 on, replicated
    _, gm = _program(_Net(), (4,), shape=(4, 2, 5, 11))
    assert len(_ops(gm, "autohybrid.halo_fetch.default")) == 2   # c1 and the pool
    (gather,) = _ops(gm, "autohybrid.spatial_gather.default")
    assert [op_name(u) for u in gather.users] == ["aten.conv2d.default"]


def test_a_model_with_nothing_to_tile_is_refused_before_it_runs():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    with pytest.raises(ah.PlanError, match="no convolution or pooling"):
        ah.plan(model, ah.Cluster.local(2), (x,), loss_fn=F.cross_entropy,
                example_targets=(y,), constraints=ah.Constraints(tp=2, spatial=(2,)))


def test_spatial_groups_and_the_plan_file():
    mesh = Mesh(dp=2, tp=4, spatial=(2, 2))
    groups = spatial_groups(mesh)
    assert groups["tile_h"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["tile_w"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["dp_tp"] == [list(range(8))]
    assert spatial_groups(Mesh(tp=2, spatial=(2,))) == {}   # "tp" itself is the tiles
    plan = _plan(Mesh(tp=2, spatial=(2,)))
    assert Plan.from_json(plan.to_json()) == plan
    old = json.loads(_plan(Mesh(tp=2)).to_json())
    del old["mesh"]["spatial"]   # a plan file written before the field existed
    assert Plan.from_dict(old).mesh.spatial == ()
    with pytest.raises(ah.PlanError, match="pipeline"):
        _plan(Mesh(pp=2, tp=2, spatial=(2,)))
    with pytest.raises(ah.PlanError, match="recompute"):
        _plan(Mesh(tp=2, spatial=(2,)), recompute="full")


def _plan(mesh: Mesh, **kw) -> Plan:
    return Plan(model_hash="test", cluster="test", cluster_hash="test", mesh=mesh,
                placement=tuple(RankPlacement(rank=r, node=0, device=r)
                                for r in range(mesh.world_size)),
                global_batch=mesh.dp * 2, microbatch_size=2, num_microbatches=1, **kw)


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(2, 4, 3, padding=1), nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(F.adaptive_avg_pool2d(F.relu(self.conv(x)), 1).flatten(1))


def test_a_tilings_costs_are_the_rewritten_graphs_by_hand():
    """SpatialCosts prices the graph the pass makes for a middle tile. conv 3×3 padding
    1 on (2, 2, 16, 12) float32 images in 4 tiles along H: tile 2 computes rows 8..11
    and receives 1 input row from each neighbour, 2 × (12 · 2 channels) × 2 samples × 4
    bytes = 384 bytes (no backward halo: the image needs no gradient); the weight's (288
    bytes) and the bias's (16) gradients are summed over the tiles; the adaptive pool
    gathers the (2, 4, 16, 12) activation, 6144 bytes; the conv's FLOPs are a quarter."""
    from autohybrid.search import pricing
    from autohybrid.search.space import profile
    from autohybrid.spatial_costs import SpatialCosts

    x, y = torch.randn(2, 2, 16, 12), torch.randint(0, 3, (2,))
    cap = capture(_Tiny(), (x,), F.cross_entropy, y)
    costs = SpatialCosts(cap, (x,))
    assert costs.applies and costs.tilings(4) == [(4,), (2, 2)] and costs.tilings(1) == []
    tiled = costs((4,))
    found = sorted((c.kind, c.direction, c.axis, c.nbytes(2, None))
                   for layer in tiled.layers for c in layer.collectives)
    assert found == [("all_gather", "forward", "tp", 6144.0),
                     ("all_reduce", "backward", "tp", 16.0),
                     ("all_reduce", "backward", "tp", 288.0),
                     ("halo", "forward", "tp", 384.0)], found
    whole = profile(cap.gm, cap.dim_roles)
    def conv(p):
        return sum(layer.values(2, None)["mm_replicated"] + layer.values(2, None)["mm_sharded"]
                   for layer in p.layers if layer.name == "model.conv")
    assert conv(tiled) == conv(whole) / 4 == 2 * 2 * 4 * 16 * 12 * 2 * 9 / 4
    # priced: every parameter whole on each rank, the halo and sums as communication
    cluster = ah.Cluster.local(4)
    layout = pricing.Layout(Mesh(tp=4, spatial=(4,)), 2, 1)
    priced = pricing.price(tiled, cluster, layout, None, "float32", 4, "sgd", 2)
    params = sum(p.numel() for p in _Tiny().parameters()) * 4
    assert priced.prediction.memory.params == params
    assert priced.prediction.comm_s > 0
    # a graph with no window to tile has no tilings; one too small for the tiles says why
    dense = capture(nn.Sequential(nn.Linear(8, 3)), (torch.randn(2, 8),), F.cross_entropy, y)
    assert SpatialCosts(dense).tilings(4) == []
    small = SpatialCosts(capture(_Tiny(), (torch.randn(2, 2, 3, 3),), F.cross_entropy, y))
    assert "no convolution or pooling" in small((4,))
