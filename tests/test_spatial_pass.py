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
    plan = ah.plan(model, ah.Cluster.local(2), (x,), loss_fn=F.cross_entropy,
                   example_targets=(y,), constraints=ah.Constraints(tp=2, spatial=(2,)))
    assert not plan.executable
    assert "no convolution or pooling" in " ".join(plan.not_executable_because)


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
