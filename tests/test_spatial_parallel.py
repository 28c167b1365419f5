"""Spatial parallelism through `ah.compile` equals single-process eager training.

`ah.Constraints(tp=n, pp=1, spatial=(n,))`: the tp mesh axis tiles every activation
along its first spatial dim (dim 2 of N, C, H, W or N, C, D, H, W) into n tiles and
exchanges halos before each window op; `spatial=(a, b)` (a × b = tp) tiles dims 2 and 3
into a × b tiles; with dp > 1 it is data × spatial. Every rank trains the compiled model
and an eager float64 copy on the whole batch and compares losses, gathered gradients and
parameters + buffers (BatchNorm's running statistics) after every step
(tests/_equiv.py), under plain SGD and AdamW, alternating along the models and from one
launch to the next; then the gathered forward output. The models: a 2-D CNN with every
kind of window (3×3, 5×5 stride 2, 7×7 dilated, 1×1, a padded max pool, a residual
block with a strided 1×1 shortcut) on images whose sides no tile count divides; a 3-D
CNN on (13, 11, 9) volumes; the zoo's resnet-tiny. Each launch runs every case of its
world size (one launch at 2 ranks, two at 4). And, process-free, the constraint's
validation and a spatial plan's JSON round trip and description.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autohybrid as ah
from _limits import guard
from _pool import launch as pool_launch
from _equiv import OPTIMIZERS, Failures, report, train_and_compare, zoo_loss, zoo_model
from autohybrid.graph import op_name

D = torch.float64
LAUNCH_TIMEOUT_S = guard(200)
CLASSES = 5


def _launch(fn, world: int, *args):
    return pool_launch(fn, world, args=(world, *args), timeout_s=LAUNCH_TIMEOUT_S)


def _assert_no_failures(results) -> None:
    assert not any(results), report(results)


def _pinned(dp: int, spatial: tuple[int, ...]) -> ah.Constraints:
    return ah.Constraints(tp=math.prod(spatial), dp=dp, pp=1, spatial=spatial)


def _spatial_of(plan: ah.Plan) -> tuple[int, ...]:
    """The plan's spatial tiling (the mesh's tile counts; () for none)."""
    return plan.mesh.spatial


# ============================================================================ models
class BasicBlock(nn.Module):
    """ResNet's basic block, stride 2, with a 1×1 stride-2 downsample shortcut."""

    def __init__(self, cin: int, cout: int, conv: type, bn: type):
        super().__init__()
        self.conv1 = conv(cin, cout, 3, stride=2, padding=1, bias=False)
        self.bn1 = bn(cout)
        self.conv2 = conv(cout, cout, 3, padding=1, bias=False)
        self.bn2 = bn(cout)
        self.down = nn.Sequential(conv(cin, cout, 1, stride=2, bias=False), bn(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.down(x))


class Cnn2d(nn.Module):
    """conv 3×3 → BN → relu → residual block (stride 2) → conv 5×5 stride 2 → relu →
    conv 7×7 dilation 2 (padding 5: shrinks by 2) → conv 1×1 → max pool 3 stride 2
    padding 1 → adaptive average pool → linear. Rows: 19 → 19 → 10 → 5 → 3 → 3 → 2;
    37 → 37 → 19 → 10 → 8 → 8 → 4; 23 → 23 → 12 → 6 → 4 → 4 → 2."""

    def __init__(self, cin: int = 3, width: int = 4, classes: int = CLASSES):
        super().__init__()
        self.stem = nn.Conv2d(cin, width, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(width)
        self.block = BasicBlock(width, 6, nn.Conv2d, nn.BatchNorm2d)
        self.conv5 = nn.Conv2d(6, 6, 5, stride=2, padding=2)
        self.conv7 = nn.Conv2d(6, 6, 7, padding=5, dilation=2)
        self.conv1 = nn.Conv2d(6, 8, 1)
        self.pool = nn.MaxPool2d(3, stride=2, padding=1)
        self.avg = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, classes)

    def forward(self, x):
        x = self.block(F.relu(self.bn(self.stem(x))))
        x = self.conv1(self.conv7(F.relu(self.conv5(x))))
        return self.fc(torch.flatten(self.avg(self.pool(x)), 1))


class Cnn3d(nn.Module):
    """conv 3³ → BN → relu → max pool 3 stride 2 padding 1 → conv 3³ → relu → residual
    block (stride 2) → adaptive average pool → linear. Depth 13 → 13 → 7 → 7 → 4,
    height 11 → 11 → 6 → 6 → 3, width 9 → 9 → 5 → 5 → 3."""

    def __init__(self, cin: int = 2, width: int = 4, classes: int = CLASSES):
        super().__init__()
        self.stem = nn.Conv3d(cin, width, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm3d(width)
        self.pool = nn.MaxPool3d(3, stride=2, padding=1)
        self.conv = nn.Conv3d(width, width, 3, padding=1)
        self.block = BasicBlock(width, 6, nn.Conv3d, nn.BatchNorm3d)
        self.avg = nn.AdaptiveAvgPool3d(1)
        self.fc = nn.Linear(6, classes)

    def forward(self, x):
        x = self.pool(F.relu(self.bn(self.stem(x))))
        x = self.block(F.relu(self.conv(x)))
        return self.fc(torch.flatten(self.avg(x), 1))


def _batches(shape: tuple[int, ...], steps: int = 2, seed: int = 100):
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(seed + step)
        x = torch.randn(*shape, generator=g, dtype=D)
        y = torch.randint(0, CLASSES, (shape[0],), generator=g)
        out.append(((x,), y))
    return out


def _resnet_batches(image: int, steps: int = 2):
    return [ah.models.example_batch("resnet-tiny", 4, seed=100 + step, dtype=D,
                                    image_size=image) for step in range(steps)]


def _models(tiles: int):
    """(name, model, batches, loss, whole): `whole` when each model's rows stay ≥ the tile
    count at every layer, so every layer runs on tiles (resnet-tiny's 16×16 images end
    at 2×2: at 4 tiles along H it gets 32×32, and at 16×16 its last stage has fewer rows
    than tiles, where the graph must fall back to replicated layers and stay exact)."""
    torch.manual_seed(0)
    cnn2d = Cnn2d().double()
    torch.manual_seed(0)
    cnn3d = Cnn3d().double()
    hw = (19, 23) if tiles <= 2 else (37, 23)
    image = 16 if tiles <= 2 else 32
    out = [("cnn2d", cnn2d, _batches((4, 3, *hw)), F.cross_entropy, True),
           ("cnn3d", cnn3d, _batches((4, 2, 13, 11, 9)), F.cross_entropy, True),
           ("resnet-tiny", zoo_model("resnet-tiny"), _resnet_batches(image),
            zoo_loss("resnet-tiny"), True)]
    if tiles > 2:
        out.append(("resnet-tiny@16x16", zoo_model("resnet-tiny"), _resnet_batches(16),
                    zoo_loss("resnet-tiny"), False))
    return out


_WINDOWS = (nn.Conv2d, nn.Conv3d, nn.MaxPool2d, nn.MaxPool3d)
_BATCH_NORMS = (nn.BatchNorm2d, nn.BatchNorm3d)


def _kernel_over_one(m: nn.Module) -> bool:
    k = m.kernel_size
    return any(n > 1 for n in ((k,) if isinstance(k, int) else k))


# ============================================================================ equivalence
def _spatial_rank(rank: int, world: int, cases: tuple, turn: int) -> list[str]:
    """Each (dp, spatial) case trains each model 2 steps, AdamW or plain SGD alternating
    along the models and cases; checks the plan, that no parameter is split, that the
    training graph tiles the input once per tiled dim and gathers once before the
    adaptive pool (so every layer between runs on tiles: a halo fetch per tiled dim for
    every window wider than 1, a synced BatchNorm for each), and the gathered forward
    output."""
    fails = Failures()
    for c, (dp, spatial) in enumerate(cases):
        tp, dims = math.prod(spatial), len(spatial)
        for m, (name, model, batches, loss, whole) in enumerate(_models(spatial[0])):
            optimizer = ("adamw", "sgd")[(turn + c + m) % 2]
            layout = f"dp{dp}×spatial{'x'.join(map(str, spatial))}"
            case = f"{name}/{optimizer}/{layout}"
            windows = sum(isinstance(x, _WINDOWS) and _kernel_over_one(x)
                          for x in model.modules())
            norms = sum(isinstance(x, _BATCH_NORMS) for x in model.modules())
            compiled, ref = train_and_compare(
                fails, case, model, batches, world, loss_fn=loss,
                optimizer=OPTIMIZERS[optimizer], constraints=_pinned(dp, spatial))
            plan = compiled.plan
            mesh = plan.mesh
            fails.check(f"{case}: plan is {mesh.describe()} spatial={_spatial_of(plan)}",
                        (mesh.tp, mesh.dp, mesh.pp, mesh.sp) == (tp, dp, 1, False)
                        and _spatial_of(plan) == spatial)
            fails.check(f"{case}: parameters split under spatial parallelism: "
                        f"{sorted(compiled.programs['train'].param_shards)}",
                        not compiled.programs["train"].param_shards)
            ops = collections.Counter(op_name(n) for n in compiled.graphs["train"].graph.nodes)
            count = {k: ops[f"autohybrid.{k}.default"] for k in
                     ("spatial_split", "spatial_gather", "halo_fetch", "sync_batch_norm")}
            if whole:
                fails.check(f"{case}: not every layer on tiles: {count} for {windows} "
                            f"windows, {norms} BatchNorms, {dims} tiled dims",
                            count["spatial_split"] == count["spatial_gather"] == dims
                            and count["halo_fetch"] >= windows * dims
                            and count["sync_batch_norm"] == norms)
            else:
                fails.check(f"{case}: no halo exchange in the training graph: {count}",
                            count["halo_fetch"] > 0 and count["spatial_gather"] > 0)
            (x,), _ = batches[0]
            fails.close(f"{case} forward", compiled((x,)), ref(x).detach())
    return fails


@pytest.mark.procs
@pytest.mark.timeout(400)
@pytest.mark.parametrize("world,cases,turn", [
    (2, ((1, (2,)),), 0),
    (4, ((1, (4,)), (1, (2, 2))), 1),
    (4, ((2, (2,)),), 1),
], ids=["spatial2", "spatial4+spatial2x2", "dp2xspatial2"])
def test_spatial_and_dp_x_spatial_match_eager(world, cases, turn):
    """2 tiles along H; 4 tiles along H and 2 × 2 tiles over H × W; data × spatial: 2
    replicas of 2 tiles. The 2-D CNN's images are 19 × 23 (2 tiles) or 37 × 23 (4),
    sides no tile count divides; the 3-D CNN's volumes 13 × 11 × 9; resnet-tiny's 16 × 16
    images (32 × 32 at 4 tiles along H; 16 × 16 there too, its last stage replicated)."""
    _assert_no_failures(_launch(_spatial_rank, world, cases, turn))


#: a 3-D CNN's batch whose activations outgrow MEMORY_LIMIT unless tp splits them (the
#: batch of 2 splits over dp 2 at most)
VOLUMES = (2, 2, 24, 16, 16)
MEMORY_LIMIT = 600_000


def _small_memory_cluster(world: int) -> ah.Cluster:
    cluster = ah.Cluster.local(world)
    return dataclasses.replace(cluster, device=dataclasses.replace(
        cluster.device, memory_bytes=MEMORY_LIMIT))


def _volume_batches(steps: int = 2):
    return _batches(VOLUMES, steps)


def _zero_rank(rank: int, world: int) -> list[str]:
    """dp2 × spatial2 with each ZeRO stage: the optimizer state (1), the gradients (2) and
    the parameters (3) sharded over dp, while the tiles' gradients are summed over tp.
    Then the planner's own choice for a 3-D CNN whose activations do not fit one rank's
    memory otherwise (test_the_planner_splits_activations_of_3d_cnns_that_do_not_fit_otherwise)."""
    fails = Failures()
    for optimizer in ("sgd", "adamw"):
        torch.manual_seed(0)
        case = f"cnn3d{VOLUMES[2:]}/{optimizer}/planner's choice under {MEMORY_LIMIT} bytes"
        compiled, _ = train_and_compare(
            fails, case, Cnn3d().double(), _volume_batches(), world, loss_fn=F.cross_entropy,
            optimizer=OPTIMIZERS[optimizer], cluster=_small_memory_cluster(world))
        fails.check(f"{case}: the plan {compiled.plan.mesh.describe()} does not split "
                    "the activations", compiled.plan.mesh.tp > 1)
    for zero in (1, 2, 3):
        for optimizer in ("sgd", "adamw"):
            torch.manual_seed(0)
            case = f"cnn3d/{optimizer}/dp2×spatial2/zero{zero}"
            compiled, _ = train_and_compare(
                fails, case, Cnn3d().double(), _batches((4, 2, 13, 11, 9)), world,
                loss_fn=F.cross_entropy, optimizer=OPTIMIZERS[optimizer],
                constraints=ah.Constraints(tp=2, dp=2, pp=1, spatial=(2,), zero=zero))
            fails.check(f"{case}: plan has zero {compiled.plan.zero}",
                        compiled.plan.zero == zero and compiled.plan.mesh.spatial == (2,))
    return fails


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_data_x_spatial_with_zero_matches_eager():
    """ZeRO 1, 2 and 3 under dp2 × spatial2 (the planner may choose them): SGD and AdamW
    against eager."""
    _assert_no_failures(_launch(_zero_rank, 4))


def test_the_planner_splits_activations_of_3d_cnns_that_do_not_fit_otherwise():
    """Unpinned, on 4 ranks of small memory. Cnn3d on a batch of 2 volumes: dp splits it
    2 ways at most and pp is refused (BatchNorm), so every plan splits the activations
    within tp — by tiles or by channels (convolutions and BatchNorms on channel shards);
    the planner picks the fastest that fits, a hybrid with dp 2, and prices spatial ones
    beside it (the choice trains like eager: _zero_rank). CosmoFlow (no BatchNorm; its
    dense layers hold most parameters) under a limit no untiled plan fits: the planner
    tiles it (examples/cnn_spatial.py trains that case against eager)."""
    torch.manual_seed(0)
    model = Cnn3d().double()
    (x,), y = _volume_batches(steps=1)[0]
    plan = ah.plan(model, _small_memory_cluster(4), (x,), loss_fn=F.cross_entropy,
                   example_targets=y, executable_only=True)
    assert plan.executable and plan.mesh.dp == 2 and plan.mesh.tp == 2, plan.summary()
    assert plan.predicted.memory_per_rank_bytes <= MEMORY_LIMIT
    assert any("spatial" in a.summary for a in plan.alternatives), plan.summary()
    torch.manual_seed(0)
    cosmoflow = ah.models.cosmoflow(channels=[4, 8, 8], in_channels=4, image_size=24,
                                    hidden=16, outputs=4).double()
    g = torch.Generator().manual_seed(0)
    volumes = torch.randn(2, 4, 24, 24, 24, generator=g, dtype=D)
    targets = torch.randn(2, 4, generator=g, dtype=D)
    small = dataclasses.replace(ah.Cluster.local(4), device=dataclasses.replace(
        ah.Cluster.local(4).device, memory_bytes=950_000))
    kwargs = dict(loss_fn=F.mse_loss, example_targets=targets, executable_only=True,
                  optimizer="none")
    with pytest.raises(ah.NoPlanFitsError):
        ah.plan(cosmoflow, small, (volumes,), constraints=ah.Constraints(spatial=()), **kwargs)
    tiled = ah.plan(cosmoflow, small, (volumes,), **kwargs)
    assert tiled.mesh.spatial and tiled.executable, tiled.summary()


# ============================================================================ models we did not write
def _hf_resnet() -> nn.Module:
    """Hugging Face ResNet (tiny config, basic blocks): embedder conv 7×7 stride 2 + max
    pool, two stages, a pooler and a classifier; returns a ModelOutput with `.logits`."""
    from transformers import ResNetConfig, ResNetForImageClassification
    config = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 12],
                          depths=[1, 1], layer_type="basic", num_labels=CLASSES)
    return ResNetForImageClassification(config).double()


def _hf_convnext() -> nn.Module:
    """Hugging Face ConvNeXt (tiny config): a 2×2 patchify conv, depthwise 7×7 convs,
    LayerNorm over channels after a permute to channels-last (not tileable: gathered)."""
    from transformers import ConvNextConfig, ConvNextForImageClassification
    config = ConvNextConfig(num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], num_stages=2,
                            patch_size=2, num_labels=CLASSES, drop_path_rate=0.0)
    return ConvNextForImageClassification(config).double()


class NativeCnn(nn.Module):
    """torch.nn modules only: a depthwise conv (groups=8), GELU/SiLU, an average pool, an
    Upsample (not tileable: gathered, then tiled again), an adaptive max pool."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.GELU(),
            nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.AvgPool2d(2), nn.SiLU(),
            nn.Conv2d(8, 8, 3, padding=1), nn.Upsample(scale_factor=2),
            nn.Conv2d(8, 6, 3, padding=1), nn.AdaptiveMaxPool2d(1), nn.Flatten(),
            nn.Linear(6, CLASSES))

    def forward(self, x):
        return self.net(x)


class Audio1d(nn.Module):
    """A 1-D CNN over (N, C, L) signals: conv 5, BatchNorm1d, strided conv, max pool."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv1d(2, 8, 5, padding=2)
        self.bn = nn.BatchNorm1d(8)
        self.c2 = nn.Conv1d(8, 8, 3, stride=2, padding=1)
        self.pool = nn.MaxPool1d(3, 2, 1)
        self.fc = nn.Linear(8, CLASSES)

    def forward(self, x):
        x = self.pool(F.relu(self.c2(F.relu(self.bn(self.c1(x))))))
        return self.fc(x.mean(-1))


def _logits_loss(out, y):
    return F.cross_entropy(out.logits, y)


def _foreign_rank(rank: int, world: int) -> list[str]:
    """Each model, SGD then AdamW, 2 tiles along dim 2, against eager; every model's
    training graph must really tile (a split and halo fetches), no parameter is split."""
    fails = Failures()
    models = [("hf-resnet", _hf_resnet, (4, 3, 32, 32), True),
              ("hf-convnext", _hf_convnext, (4, 3, 32, 32), True),
              ("native-cnn", lambda: NativeCnn().double(), (4, 3, 18, 18), False),
              ("audio-1d", lambda: Audio1d().double(), (4, 2, 37), False)]
    for name, build, shape, hf in models:
        for optimizer in ("sgd", "adamw"):
            torch.manual_seed(0)
            model = build()
            loss = dict(loss_fn=_logits_loss,
                        eager_loss=lambda m, i, t: _logits_loss(m(*i), t)) if hf else \
                dict(loss_fn=F.cross_entropy)
            case = f"{name}/{optimizer}/spatial2"
            compiled, _ = train_and_compare(fails, case, model, _batches(shape), world,
                                            optimizer=OPTIMIZERS[optimizer],
                                            constraints=_pinned(1, (2,)), **loss)
            ops = collections.Counter(op_name(n) for n in compiled.graphs["train"].graph.nodes)
            count = {k: ops[f"autohybrid.{k}.default"] for k in
                     ("spatial_split", "halo_fetch", "spatial_gather")}
            fails.check(f"{case}: the training graph does not tile: {count}",
                        count["spatial_split"] > 0 and count["halo_fetch"] > 0
                        and count["spatial_gather"] > 0)
            fails.check(f"{case}: parameters split: "
                        f"{sorted(compiled.programs['train'].param_shards)}",
                        not compiled.programs["train"].param_shards)
    return fails


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_models_we_did_not_write_match_eager_under_spatial():
    """Hugging Face ResNet and ConvNeXt from tiny configs, a torch.nn-only CNN (depthwise
    conv, Upsample) and a 1-D CNN, 2 tiles, SGD and AdamW: losses, gathered gradients and
    parameters + buffers equal eager's after every step."""
    pytest.importorskip("transformers")
    _assert_no_failures(_launch(_foreign_rank, 2))


# ============================================================================ the plan
@pytest.mark.timeout(120)
def test_spatial_constraint_round_trips_and_plan_describes_it():
    """`Constraints(spatial=...)` keeps what it was given; a plan pinned to it records
    the tiling, says so in its description, and reads back from JSON equal."""
    assert ah.Constraints(spatial=(2,)).pinned()["spatial"] == (2,)
    assert ah.Constraints(tp=4, pp=1, spatial=(2, 2)).pinned()["spatial"] == (2, 2)
    assert ah.Constraints(tp=2).pinned().get("spatial") is None
    assert ah.Constraints(tp=2, spatial=[2]).spatial == (2,)   # a list (from JSON) too
    torch.manual_seed(0)
    model = Cnn2d().double()
    (x,), y = _batches((4, 3, 19, 23), steps=1)[0]
    plan = ah.plan(model, ah.Cluster.local(2), (x,), loss_fn=F.cross_entropy,
                   example_targets=y, constraints=_pinned(1, (2,)))
    assert (plan.mesh.tp, plan.mesh.dp, plan.mesh.pp, plan.mesh.sp) == (2, 1, 1, False)
    assert _spatial_of(plan) == (2,)
    assert "spatial" in plan.to_json()
    assert "spatial2" in plan.mesh.describe() and "spatial2" in plan.summary(), plan.summary()
    again = ah.Plan.from_json(plan.to_json())
    assert again == plan and _spatial_of(again) == (2,)
    assert again.to_json() == plan.to_json()
    # a plan file edited to tiles that do not multiply to tp is refused on reading
    data = json.loads(plan.to_json())
    data["mesh"]["spatial"] = [3]
    with pytest.raises(ah.PlanError, match="spatial"):
        ah.Plan.from_json(json.dumps(data))


@pytest.mark.parametrize("kwargs,words", [
    (dict(tp=2, spatial=(3,)), "spatial"),          # the product must equal tp
    (dict(tp=4, spatial=(2, 3)), "spatial"),
    (dict(tp=2, sp=True, spatial=(2,)), "sp"),     # sequence parallelism also uses tp
    (dict(spatial=(0,)), "spatial"),
    (dict(spatial=(1,)), "spatial"),                # a tile count of 1 tiles nothing
    (dict(spatial=(2, 0)), "spatial"),
    (dict(spatial=(-2,)), "spatial"),
    (dict(tp=8, spatial=(2, 2, 2)), "spatial"),     # at most 2 tiled dims
], ids=["product-not-tp", "2d-product-not-tp", "with-sp", "zero", "one", "2d-zero", "negative",
        "three-dims"])
def test_bad_spatial_constraints_are_refused(kwargs, words):
    with pytest.raises(ah.PlanError, match=words):
        ah.Constraints(**kwargs)
