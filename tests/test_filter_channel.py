"""Filter and channel parallelism: convolutions split by channels on the tp axis.

A convolution (one group, not transposed) is split like a linear: column = filter
parallelism (its output channels, weight dim 0, and its bias), row = channel parallelism
(its input channels, weight dim 1; the partial sums all-reduced, the bias added once). A
filter-split conv whose output reaches a channel-split conv through per-channel ops
(activations, pools, a residual add) needs no collective between them (Megatron's
pairing); a BatchNorm between them runs on the channel shard too (its statistics are
per channel: weight and bias split, the shard's batch statistics gathered to update the
whole running statistics on every rank); a grouped (depthwise) conv or anything else
that needs every channel gets its input gathered and runs whole. With dp > 1 it is
data × filter.

Process-free: the layout and the rewritten graph. On gloo ranks, float64, SGD and AdamW:
losses, gathered gradients and parameters + buffers equal eager's after every step
(tests/_equiv.py), and the forward output; each case also checks that its convolutions
really are split (so a plan that silently kept them whole could not pass).
"""
from __future__ import annotations

import collections

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autohybrid as ah
from _limits import guard
from _pool import launch as pool_launch
from _equiv import OPTIMIZERS, Failures, report, train_and_compare, zoo_loss, zoo_model
from autohybrid.capture import capture
from autohybrid.errors import PlanError
from autohybrid.graph import op_name
from autohybrid.rewrite import rewrite
from autohybrid.search.sharding import param_key
from autohybrid.search.tp_gradients import megatron_layout
from test_spatial_parallel import (CLASSES, Audio1d, Cnn2d, Cnn3d, NativeCnn, _batches,
                                   _hf_resnet, _logits_loss, _resnet_batches)

LAUNCH_TIMEOUT_S = guard(240)


class Chain(nn.Module):
    """conv 3×3 → leaky relu → max pool → conv 5×5 (bias) → relu → conv 1×1 groups 2
    (whole: its input is c2's sum) → mean over H, W → linear."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.c2 = nn.Conv2d(8, 8, 5, padding=2)
        self.grouped = nn.Conv2d(8, 8, 1, groups=2)
        self.fc = nn.Linear(8, CLASSES)

    def forward(self, x):
        x = self.c2(self.pool(F.leaky_relu(self.c1(x), 0.1)))
        return self.fc(self.grouped(F.relu(x)).mean((2, 3)))


def _cosmoflow() -> nn.Module:
    torch.manual_seed(0)
    return ah.models.cosmoflow(channels=[4, 8], in_channels=2, image_size=12, hidden=8,
                               outputs=CLASSES).double()


def _conv_weights(model: nn.Module) -> set[str]:
    return {f"{name}.weight" for name, m in model.named_modules()
            if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) and m.groups == 1}


def _split_convs(compiled, model_convs: set[str]) -> dict[str, int]:
    """conv weight → the dim this rank's shard splits (0: filters, 1: channels)."""
    shards = compiled.programs["train"].param_shards
    return {k: spec.dim for k, spec in shards.items() if k in model_convs}


# ============================================================================ the layout
def _layout(model: nn.Module, shape):
    x, y = torch.randn(*shape), torch.randint(0, CLASSES, (shape[0],))
    cap = capture(model, (x,), F.cross_entropy, example_targets=(y,))
    return cap, megatron_layout(cap.gm), (x, y)


def test_a_filter_split_conv_feeds_a_channel_split_conv_with_no_collective_between():
    cap, layout, _ = _layout(Chain(), (2, 3, 8, 8))
    convs = {n.name: n for n in cap.gm.graph.nodes if op_name(n) == "aten.conv2d.default"}
    roles = {name: layout.linear_roles.get(name, "not a linear") for name in convs}
    assert sorted(roles.values()) == ["column", "not a linear", "row"], roles
    assert layout.param_placements["c1.weight"] == "shard(0)"       # filters
    assert layout.param_placements["c1.bias"] == "shard(0)"
    assert layout.param_placements["c2.weight"] == "shard(1)"       # channels
    assert "c2.bias" not in layout.param_placements                 # added once, whole
    assert "grouped.weight" not in layout.param_placements          # groups=2: whole
    # the activation and the pool between them keep the channel shard
    pool = next(n for n in cap.gm.graph.nodes if "max_pool2d" in op_name(n))
    assert layout.placements[pool.name] == "shard(1)"
    forward = [(c.node, c.kind) for c in layout.collectives if c.direction == "forward"]
    row = next(name for name, role in roles.items() if role == "row")
    # c2's sum, then the classifier's vocabulary-parallel loss; nothing gathered
    assert forward == [(row, "all_reduce"), ("cross_entropy_loss", "all_reduce")], forward
    assert not layout.partial_grads


def test_the_rewritten_graph_splits_weights_and_adds_the_row_bias_after_the_sum():
    model = Chain()
    x, y = torch.randn(2, 3, 8, 8), torch.randint(0, CLASSES, (2,))
    plan = ah.plan(model, ah.Cluster.local(2), (x,), loss_fn=F.cross_entropy,
                   example_targets=(y,), constraints=ah.Constraints(tp=2, dp=1, pp=1, sp=False))
    cap = capture(model, (x,), F.cross_entropy, example_targets=(y,))
    program = rewrite(cap, plan, 1, fake_groups=True)
    gm = program.runnable.gm
    shards = {k: (s.dim, s.shard_size) for k, s in program.param_shards.items()}
    assert shards["c1.weight"] == (0, 4) and shards["c2.weight"] == (1, 4), shards
    convs = [n for n in gm.graph.nodes if op_name(n) == "aten.conv2d.default"]
    assert [tuple(n.meta["val"].shape[:2]) for n in convs] == [(2, 4), (2, 8), (2, 8)]
    row = convs[1]
    assert row.args[2] is None                                       # no bias in the partial
    reduce_ = next(iter(row.users))
    assert op_name(reduce_) == "autohybrid.tp_reduce.default"
    # the bias as (C, 1, 1), added to the sum (by an add, or the fused region holding it)
    bias = [n for n in gm.graph.nodes if op_name(n) == "aten.view.default"
            and n.args[1] == [-1, 1, 1]]
    assert len(bias) == 1 and param_key(bias[0].args[0]) == "c2.bias", bias
    assert set(bias[0].users) & set(reduce_.users), (bias[0].users, reduce_.users)
    ops = collections.Counter(op_name(n) for n in gm.graph.nodes)
    assert ops["autohybrid.tp_reduce.default"] == 1
    assert ops["autohybrid.tp_gather.default"] == 0


def test_transposed_and_grouped_convs_stay_whole_and_channels_tp_does_not_divide_are_refused():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.c2 = nn.Conv2d(3, 6, 3), nn.Conv2d(6, 4, 3)
            self.up = nn.ConvTranspose2d(4, 4, 2, stride=2)
            self.fc = nn.Linear(4, CLASSES)

        def forward(self, x):
            return self.fc(self.up(self.c2(F.relu(self.c1(x)))).mean((2, 3)))

    cap, layout, (x, y) = _layout(Odd(), (2, 3, 9, 9))
    assert layout.param_placements.get("c1.weight") == "shard(0)"
    assert layout.param_placements.get("c2.weight") == "shard(1)"
    assert "up.weight" not in layout.param_placements
    with pytest.raises(PlanError, match=r"tp=4 does not divide the split dim \(6\) of c1.weight"):
        ah.plan(Odd(), ah.Cluster.local(4), (x,), loss_fn=F.cross_entropy, example_targets=(y,),
                constraints=ah.Constraints(tp=4, dp=1, pp=1, sp=False))


# ============================================================================ against eager
def _launch(fn, world: int, *args):
    return pool_launch(fn, world, args=(world, *args), timeout_s=LAUNCH_TIMEOUT_S)


def _assert_no_failures(results) -> None:
    assert not any(results), report(results)


def _ours(tp: int, dp: int):
    """(name, build, batches, loss kwargs, must split filters and channels): every model
    at tp 2 (dp 1 and 2); at tp 4 those whose channels 4 divides (Cnn2d's and Cnn3d's 6
    do not: tp 4 is refused for them, test above)."""
    torch.manual_seed(0)
    ce = dict(loss_fn=F.cross_entropy)
    models = [
        ("chain", lambda: Chain().double(), _batches((4, 3, 10, 9)), ce, True),
        ("cnn2d", lambda: Cnn2d().double(), _batches((4, 3, 19, 23)), ce, True),
        ("cnn3d", lambda: Cnn3d().double(), _batches((4, 2, 13, 11, 9)), ce, True),
        ("cosmoflow", _cosmoflow, _batches((4, 2, 12, 12, 12)), ce, True),
        ("resnet-tiny", lambda: zoo_model("resnet-tiny"), _resnet_batches(16),
         dict(loss_fn=zoo_loss("resnet-tiny")), True),
    ]
    if tp == 4:
        return [m for m in models if m[0] in ("chain", "cosmoflow")]
    return models if dp == 1 else [m for m in models if m[0] != "cnn2d"]


def _foreign():
    hf = dict(loss_fn=_logits_loss, eager_loss=lambda m, i, t: _logits_loss(m(*i), t))
    ce = dict(loss_fn=F.cross_entropy)
    return [("hf-resnet", _hf_resnet, _batches((4, 3, 32, 32)), hf, True),
            ("native-cnn", lambda: NativeCnn().double(), _batches((4, 3, 18, 18)), ce, True),
            ("audio-1d", lambda: Audio1d().double(), _batches((4, 2, 37)), ce, True)]


def _filter_channel_rank(rank: int, world: int, meshes: tuple, foreign: bool) -> list[str]:
    fails = Failures()
    for dp, tp in meshes:
        for m, (name, build, batches, loss, pairs) in enumerate(
                _foreign() if foreign else _ours(tp, dp)):
            optimizer = ("sgd", "adamw")[(m + dp) % 2]
            torch.manual_seed(0)
            model = build()
            convs = _conv_weights(model)
            case = f"{name}/{optimizer}/dp{dp}×tp{tp}"
            compiled, ref = train_and_compare(
                fails, case, model, batches, world, optimizer=OPTIMIZERS[optimizer],
                constraints=ah.Constraints(dp=dp, tp=tp, pp=1, sp=False), **loss)
            split = _split_convs(compiled, convs)
            dims = set(split.values())
            fails.check(f"{case}: convolutions split {split}",
                        dims == {0, 1} if pairs else 0 in dims)
            (x,), _ = batches[0]
            out = compiled((x,))
            expected = ref(x)
            out, expected = (getattr(v, "logits", v) for v in (out, expected))
            fails.close(f"{case} forward", out, expected.detach())
            compiled.model.eval()   # running statistics: sliced on channel shards
            ref.eval()
            out, expected = (getattr(v, "logits", v) for v in (compiled((x,)), ref(x)))
            fails.close(f"{case} eval forward", out, expected.detach())
            fails.check(f"{case}: no eval program", "forward_eval" in compiled.programs)
            fails.check(f"{case}: explain() does not count the split convolutions",
                        f"convolutions split by filters: {list(split.values()).count(0)}, "
                        f"by channels: {list(split.values()).count(1)}" in compiled.explain())
    return fails


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_filter_and_channel_parallel_cnns_match_eager_on_two_ranks():
    """Our CNNs (kernels 1, 3, 5, 7, stride 2, dilation 2, odd image sizes, 2-D and 3-D,
    residual blocks, BatchNorm), the zoo's CosmoFlow and resnet-tiny under tp 2."""
    _assert_no_failures(_launch(_filter_channel_rank, 2, ((1, 2),), False))


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_data_x_filter_and_tp4_match_eager_on_four_ranks():
    """dp 2 × tp 2 (data × filter) on the 3-D CNN, CosmoFlow, resnet-tiny and the chain;
    tp 4 on CosmoFlow and the chain."""
    _assert_no_failures(_launch(_filter_channel_rank, 4, ((2, 2), (1, 4)), False))


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_models_we_did_not_write_match_eager_under_filter_and_channel_parallelism():
    """Hugging Face ResNet (tiny config), a torch.nn-only CNN with a depthwise conv and an
    Upsample, a 1-D CNN with BatchNorm1d, under tp 2."""
    pytest.importorskip("transformers")
    _assert_no_failures(_launch(_filter_channel_rank, 2, ((1, 2),), True))


def test_the_report_view_names_split_channels_and_spatial_halos():
    """The report's layer view (report/graphview.py, what `autohybrid report` draws):
    the conv layers say how tp splits them, and a spatial plan's layers list their halo
    exchanges."""
    from autohybrid.report.graphview import coarse_view
    model = Chain()
    x, y = torch.randn(2, 3, 8, 8), torch.randint(0, CLASSES, (2,))
    cap = capture(model, (x,), F.cross_entropy, example_targets=(y,))
    views = {}
    for name, constraints in (("tp", ah.Constraints(tp=2, dp=1, pp=1, sp=False)),
                              ("spatial", ah.Constraints(tp=2, pp=1, spatial=(2,)))):
        plan = ah.plan(model, ah.Cluster.local(2), (x,), loss_fn=F.cross_entropy,
                       example_targets=(y,), constraints=constraints)
        views[name] = {g.name: g for g in coarse_view(rewrite(cap, plan, 0,
                                                              fake_groups=True)).groups}
    assert views["tp"]["c1"].sharding == "out-channels", views["tp"]["c1"]
    assert views["tp"]["c2"].sharding == "in-channels", views["tp"]["c2"]
    assert dict(views["tp"]["c2"].collectives).get("tp_reduce") == 1
    halos = {name: dict(g.collectives).get("halo_fetch", 0)
             for name, g in views["spatial"].items()}
    assert halos["c1"] == halos["c2"] == halos["pool"] == 1, halos


class ConvBn(nn.Module):
    """conv → BatchNorm → relu → conv → BatchNorm (no affine) → mean → linear."""

    def __init__(self):
        super().__init__()
        self.c1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.c2, self.bn2 = nn.Conv2d(8, 4, 3, padding=1), nn.BatchNorm2d(4, affine=False)
        self.fc = nn.Linear(4, CLASSES)

    def forward(self, x):
        x = self.bn2(self.c2(F.relu(self.bn1(self.c1(x)))))
        return self.fc(x.mean((2, 3)))


def test_batch_norm_between_the_pair_runs_on_the_channel_shard():
    cap, layout, (x, y) = _layout(ConvBn(), (2, 3, 8, 8))
    norms = [n for n in cap.gm.graph.nodes if op_name(n) == "aten.batch_norm.default"]
    assert layout.placements[norms[0].name] == "shard(1)"
    assert layout.placements[norms[1].name] == "replicate"        # after c2's sum
    assert layout.param_placements["bn1.weight"] == layout.param_placements["bn1.bias"] \
        == "shard(0)"
    assert layout.param_placements["c1.weight"] == "shard(0)"
    assert layout.param_placements["c2.weight"] == "shard(1)"
    assert [c.kind for c in layout.collectives if c.direction == "forward"
            and c.node != "cross_entropy_loss"] == ["all_reduce"]   # c2's sum alone
    for dp in (1, 2):
        model = ConvBn()
        plan = ah.plan(model, ah.Cluster.local(2 * dp), (x,), loss_fn=F.cross_entropy,
                       example_targets=(y,),
                       constraints=ah.Constraints(tp=2, dp=dp, pp=1, sp=False))
        program = rewrite(cap, plan, 1, fake_groups=True)
        gm = program.runnable.gm
        assert program.param_shards["bn1.weight"].shard_size == 4
        syncs = [n for n in gm.graph.nodes if op_name(n) == "autohybrid.sync_batch_norm.default"]
        assert len(syncs) == (1 if dp == 1 else 2), syncs           # dp 2: bn2 synced too
        assert syncs[0].meta["val"][0].shape[1] == 4                  # bn1's channel shard
        # the running statistics: updated whole, from the shard's statistics gathered
        update = next(n for n in gm.graph.nodes
                      if op_name(n) == "autohybrid.update_running_stats.default"
                      and "bn1" in str(n.args[0]))
        assert all(op_name(a).startswith("autohybrid.tp_gather") for a in update.args[2:4])
        assert update.args[0].meta["val"].shape == (8,)
