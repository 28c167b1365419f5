"""Calibration: measured figures, α–β fit, profile JSON, and plans that use a profile."""
from __future__ import annotations

import json
import random

import pytest
import torch.nn.functional as F

import autohybrid as ah
from autohybrid.calibrate import (COLLECTIVE_KINDS, OVERLAPPED_KINDS, Profile, calibrate,
                                  fit_alpha_beta)
from autohybrid.cost.compute import MATMUL_EFFICIENCY, MEMORY_EFFICIENCY
from autohybrid.errors import AutohybridError


@pytest.mark.timeout(30)
def test_alpha_beta_fit_recovers_the_ring_formula():
    rng = random.Random(3)
    for ranks in (2, 4, 8):
        alpha, beta = rng.uniform(1e-6, 1e-3), rng.uniform(1e-11, 1e-8)
        sizes = [4096, 65536, 1 << 20, 1 << 23]
        times = [2 * (ranks - 1) * alpha + 2 * (ranks - 1) / ranks * n * beta for n in sizes]
        got_alpha, got_beta = fit_alpha_beta(sizes, times, ranks)
        assert got_alpha == pytest.approx(alpha, rel=1e-6)
        assert got_beta == pytest.approx(beta, rel=1e-6)
        # each kind on its own formula: a ring all-gather, a pipeline's send
        for kind, times in (("all_gather", [(ranks - 1) * (alpha + n / ranks * beta)
                                            for n in sizes]),
                            ("send_recv", [alpha + n * beta for n in sizes])):
            assert fit_alpha_beta(sizes, times, ranks, kind) == \
                pytest.approx((alpha, beta), rel=1e-6)


@pytest.mark.timeout(30)
def test_alpha_stays_positive_when_the_largest_message_is_noisy():
    """As measured under load: the 8 MB all-reduce took 40 % longer than its bandwidth
    says, which drove the absolute least-squares intercept below zero (α reported as 0).
    The relative fit keeps α near the truth; where the intercept is lost entirely, α is
    the smallest message's time, an upper bound."""
    ranks, alpha, beta = 2, 5e-5, 1e-9
    sizes = [4096, 65536, 1 << 20, 1 << 23]
    exact = [2 * (ranks - 1) * alpha + 2 * (ranks - 1) / ranks * n * beta for n in sizes]
    noisy = exact[:3] + [exact[3] * 1.4]
    got_alpha, got_beta = fit_alpha_beta(sizes, noisy, ranks)
    assert got_alpha == pytest.approx(alpha, rel=0.1) and got_beta > beta
    lost = [2 * (ranks - 1) / ranks * n * beta for n in sizes]   # no latency visible
    lost[0] *= 0.5
    got_alpha, _ = fit_alpha_beta(sizes, lost, ranks)
    assert got_alpha == lost[0] / (2 * (ranks - 1))
    # the larger messages no slower (all-gathers under load in CI): both bounded from
    # above by whole times, never a β of 0 (which dropped the kind from the profile)
    flat = [3e-4, 2e-4, 2.5e-4, 2e-4]
    got_alpha, got_beta = fit_alpha_beta(sizes, flat, ranks, "all_gather")
    assert got_alpha == flat[0] / (ranks - 1)
    assert got_beta == flat[-1] / ((ranks - 1) / ranks * sizes[-1]) > 0


def _profile(**kw) -> Profile:
    base = dict(machine="test", matmul_flops={"float32": 5e10}, memory_bandwidth=1e10,
                world_size=2, all_reduce_latency_s=1e-4, all_reduce_bandwidth=2e9)
    return Profile(**{**base, **kw})


@pytest.mark.timeout(30)
def test_profile_json_round_trip_and_validation(tmp_path):
    profile = _profile()
    path = tmp_path / "c.json"
    profile.to_json(path)
    assert Profile.from_json(path) == profile and Profile.from_json(path).hash() == profile.hash()
    data = json.loads(path.read_text())
    with pytest.raises(AutohybridError, match="version"):
        Profile.from_json(json.dumps({**data, "version": 99}))
    with pytest.raises(AutohybridError, match="colour"):
        Profile.from_json(json.dumps({**data, "colour": "red"}))


@pytest.mark.timeout(30)
def test_apply_makes_efficiency_times_figure_equal_the_measurement():
    cluster = _profile().apply(ah.Cluster.local(2))
    assert cluster.device.peak_flops["float32"] * MATMUL_EFFICIENCY == pytest.approx(5e10)
    assert cluster.device.memory_bandwidth * MEMORY_EFFICIENCY == pytest.approx(1e10)
    assert cluster.intra_link.latency_s == 1e-4 and cluster.intra_link.bandwidth == 2e9
    assert cluster.world_size == 2
    assert cluster.device.launch_overhead_s == ah.Cluster.local(2).device.launch_overhead_s
    measured = _profile(launch_overhead_s=3e-5).apply(ah.Cluster.local(2))
    assert measured.device.launch_overhead_s == 3e-5
    again = ah.Cluster.from_json(measured.to_json())  # the figure survives the cluster JSON
    assert again.device.launch_overhead_s == 3e-5


@pytest.mark.timeout(30)
def test_collectives_measured_apart_are_priced_by_kind():
    """A profile's per-kind figures reach the link (and its JSON); cost/comm.py prices each
    kind with its own α, β and anything else with the link's; without them sequence
    parallelism's reduce-scatter + all-gather cost exactly the all-reduce they replace."""
    from autohybrid.cost import comm
    from autohybrid.hardware import LinkSpec
    from autohybrid.search.pricing import LinkCache

    kinds = {"all_reduce": [2e-3, 1e9], "all_gather": [3e-3, 5e8],
             "reduce_scatter": [5e-3, 2.5e8]}
    cluster = _profile(collectives=kinds).apply(ah.Cluster.local(2))
    assert cluster.intra_link.figures("all_gather") == (5e8, 3e-3)
    assert cluster.intra_link.figures("send_recv") == (2e9, 1e-4)  # the link's own
    assert ah.Cluster.from_json(cluster.to_json()) == cluster
    n, ranks = 1 << 20, [0, 1]
    for priced in (cluster, LinkCache(cluster)):  # directly and through the search's memo
        assert comm.all_reduce(priced, ranks, n) == pytest.approx(2 * 2e-3 + n / 1e9)
        assert comm.all_gather(priced, ranks, n) == pytest.approx(3e-3 + n / 2 / 5e8)
        assert comm.reduce_scatter(priced, ranks, n) == pytest.approx(5e-3 + n / 2 / 2.5e8)
        assert comm.send_recv(priced, ranks, n) == pytest.approx(1e-4 + n / 2e9)
    plain = _profile().apply(ah.Cluster.local(2))
    assert comm.reduce_scatter(plain, ranks, n) + comm.all_gather(plain, ranks, n) == \
        pytest.approx(comm.all_reduce(plain, ranks, n), rel=1e-12)
    # a cluster JSON written before the field reads as no per-kind figures; bad ones refused
    data = json.loads(cluster.to_json())
    del data["intra_link"]["collectives"]
    assert ah.Cluster.from_json(json.dumps(data)).intra_link.collectives == ()
    with pytest.raises(ah.ClusterError, match="collectives"):
        LinkSpec("l", 1e9, 1e-5, "s", (("all_gather", -1.0, 1e-5),))


@pytest.mark.timeout(60)
def test_a_measured_hidden_share_prices_overlapped_gradient_buckets():
    """dp buckets overlap the backward as far as the link hides a collective started
    before compute: share 1 is the uncalibrated pricing, share 0 exposes the whole sync,
    and between them the exposed time falls as the share grows."""
    from autohybrid.capture import capture
    from autohybrid.plan import Mesh
    from autohybrid.search.pricing import Layout, price
    from autohybrid.search.space import profile as model_profile

    model = ah.models.preset("gpt-tiny", device="meta")
    (tokens,), targets = ah.models.example_batch(model, 8, device="meta")
    cap = capture(model, (tokens,), lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten()),
                  targets)
    prof = model_profile(cap.gm, cap.dim_roles)
    layout = Layout(Mesh(pp=1, dp=2, tp=1), 4, 1, bucket_mb=0.05)  # several buckets

    def predicted(**kw):
        cluster = _profile(**kw).apply(ah.Cluster.local(2))
        return price(prof, cluster, layout, 16, "float32", 4, "adam", 8).prediction
    exposed = {share: predicted(hidden_share={"all_reduce": share}).exposed_comm_s
               for share in (0.0, 0.5, 1.0)}
    assert exposed[1.0] == predicted().exposed_comm_s
    assert exposed[0.0] == pytest.approx(predicted().comm_s)  # nothing hidden
    assert exposed[0.0] > exposed[0.5] > exposed[1.0]
    cluster = _profile(hidden_share={"all_reduce": 0.25}).apply(ah.Cluster.local(2))
    assert cluster.hidden_share([0, 1], "all_reduce") == 0.25
    assert cluster.hidden_share([0, 1], "all_gather") == 1.0
    assert ah.Cluster.from_json(cluster.to_json()) == cluster


@pytest.mark.timeout(60)
def test_a_calibrated_launch_overhead_prices_every_op_and_optimizer_tensor():
    """The step time grows by the overhead difference × (3 × ops per layer + AdamW's 10
    ops per parameter tensor): the only terms that use it."""
    from autohybrid.search.pricing import OPTIMIZER_OPS_PER_TENSOR, Layout, price
    from autohybrid.search.space import profile as model_profile
    from autohybrid.capture import capture
    from autohybrid.plan import Mesh
    model = ah.models.preset("gpt-tiny", device="meta")
    (tokens,), targets = ah.models.example_batch(model, 4, device="meta")
    cap = capture(model, (tokens,), lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten()),
                  targets)
    prof = model_profile(cap.gm, cap.dim_roles)
    layout = Layout(Mesh(pp=1, dp=1, tp=1), 4, 1)
    steps = {}
    for overhead in (1e-6, 2e-5):
        cluster = _profile(launch_overhead_s=overhead).apply(ah.Cluster.local(1))
        steps[overhead] = price(prof, cluster, layout, 16, "float32", 4, "adam", 4)\
            .prediction.step_time_s
    ops = sum(layer.num_ops for layer in prof.layers)
    tensors = len({name for layer in prof.layers for name, _, _ in layer.params})
    expected = (2e-5 - 1e-6) * (3 * ops + OPTIMIZER_OPS_PER_TENSOR["adam"] * tensors)
    assert steps[2e-5] - steps[1e-6] == pytest.approx(expected, rel=1e-9)


@pytest.mark.timeout(60)
def test_gemms_are_priced_at_the_calibrated_rate_of_their_size():
    """A profile's rates by GEMM size reach the device as shares of the best rate
    (DeviceSpec.gemm_curves, kept through the cluster JSON); a GEMM between two measured
    sizes is priced at the rate interpolated in log FLOPs; the block of a model whose
    GEMMs ran at half the best rate costs its matmul time twice; a tile model (a GPU's
    SMs) takes precedence."""
    from dataclasses import replace
    from autohybrid.capture import capture
    from autohybrid.cost.gemm import curve_utilization, utilization
    from autohybrid.plan import Mesh
    from autohybrid.search.pricing import Layout, layer_times
    from autohybrid.search.space import profile as model_profile

    curve = ((1e6, 0.5), (1e8, 1.0))
    assert curve_utilization(curve, 1e7) == pytest.approx(0.75)
    assert curve_utilization(curve, 1e3) == 0.5 and curve_utilization(curve, 1e12) == 1.0
    measured = _profile(matmul_curve={"float32": [[1e6, 2.5e10], [1e8, 5e10]]})
    cluster = measured.apply(ah.Cluster.local(1))
    assert cluster.device.gemm_curves == (("float32", ((1e6, 0.5), (1e8, 1.0))),)
    assert ah.Cluster.from_json(cluster.to_json()).device == cluster.device
    assert utilization(cluster.device, "float32", 1, 10, 10, 50000) == pytest.approx(0.75)
    tiled = replace(cluster.device, sm_count=108)  # one wave of 108 tiles of 128 × 128
    assert utilization(tiled, "float32", 1, 128, 108 * 128, 8) == 1

    model = ah.models.preset("gpt-tiny", device="meta")
    (tokens,), targets = ah.models.example_batch(model, 4, device="meta")
    cap = capture(model, (tokens,), lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten()),
                  targets)
    block = next(layer for layer in model_profile(cap.gm, cap.dim_roles).layers
                 if layer.gemms)
    plain = _profile().apply(ah.Cluster.local(1))   # large GEMMs at 5e10 FLOP/s
    slow = replace(plain.device, gemm_curves=(("float32", ((1.0, 0.5),)),))  # all at half
    layout = Layout(Mesh(pp=1, dp=1, tp=1), 4, 1)
    base = layer_times(block, plain, layout, 16, "float32", 4).forward
    halved = layer_times(block, replace(plain, device=slow), layout, 16, "float32", 4).forward
    flops = sum(2 * c * m * n * k for g, (c, m, n, k) in zip(block.gemms,
                                                            block.gemm_shapes(4, 16))
                if g.kind == "gemm")   # the curve times matmuls: attention keeps its rate
    assert halved - base == pytest.approx(flops / 5e10, rel=1e-9)


@pytest.mark.timeout(60)
def test_ranks_sharing_cores_price_a_pipeline_s_bubble_at_the_rate_of_fewer_busy_ranks():
    """A profile's alone speedup (a rank's matmul rate alone over beside the others)
    reaches the device and its JSON; a pipeline's step then prices its compute by
    `shared_speedup`: the busy ranks take the idle ones' cores, down to the busy time and
    no faster than alone. A plan without a bubble (dp) is priced as before."""
    from dataclasses import replace
    from autohybrid.search.pricing import shared_speedup

    assert shared_speedup(1.0, 4, 1.0) == 1.0            # each rank its own device
    assert shared_speedup(2.0, 4, 0.0) == 1.0            # nothing idles
    assert shared_speedup(2.0, 4, 1.0) == pytest.approx(5 / 4)    # down to the busy time
    assert shared_speedup(1.1, 4, 1.0) == pytest.approx(1.1)      # no faster than alone
    shared = _profile(alone_speedup={"float32": 1.9}).apply(ah.Cluster.local(4))
    assert shared.device.alone_speedup == 1.9
    assert ah.Cluster.from_json(shared.to_json()).device == shared.device
    assert _profile(alone_speedup={"float32": 0.97}).apply(
        ah.Cluster.local(4)).device.alone_speedup == 1.0   # below 1: noise
    own = replace(shared, device=replace(shared.device, alone_speedup=1.0))
    model = ah.models.preset("gpt-tiny")
    (tokens,), _ = ah.models.example_batch(model, 8)

    def predicted(cluster, **pinned):
        return ah.plan(model, cluster, (tokens,), constraints=ah.Constraints(
            tp=1, recompute="none", zero=0, **pinned)).predicted

    shared_pp, own_pp = (predicted(c, pp=2, dp=2, schedule="1f1b", num_microbatches=4)
                         for c in (shared, own))
    assert own_pp.bubble_fraction == pytest.approx(1 / 5)   # (p − 1) / (m + p − 1)
    assert shared_pp.bubble_fraction == own_pp.bubble_fraction
    # 1F1B on 2 stages, 4 microbatches: 5 slots of compute done in the time of 4 (the
    # cores oversubscribed 1.9×), the rest of the step as it was
    assert own_pp.compute_s == pytest.approx(shared_pp.compute_s * 5 / 4, rel=1e-9)
    assert own_pp.step_time_s - shared_pp.step_time_s == pytest.approx(
        own_pp.compute_s - shared_pp.compute_s, rel=1e-9)
    assert predicted(shared, pp=1, dp=4, num_microbatches=1) == \
        predicted(own, pp=1, dp=4, num_microbatches=1)


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_calibrate_measures_two_local_ranks_and_plans_use_it():
    profile = calibrate(ah.Cluster.local(2), matmul_sizes=(128, 256), repeats=3)
    assert profile.world_size == 2 and profile.matmul_flops["float32"] > 1e8
    # the rate of each size, the best of them the profile's figure
    (small, rate_small), (large, rate_large) = profile.matmul_curve["float32"]
    assert (small, large) == (2 * 128**3, 2 * 256**3)
    assert max(rate_small, rate_large) == profile.matmul_flops["float32"]
    # rank 0 alone against beside the other rank (2 ranks: about 1 where 2 cores serve)
    assert set(profile.alone_speedup) == {"float32"}
    assert 0.3 < profile.alone_speedup["float32"] < 10
    assert profile.memory_bandwidth > 1e8
    assert profile.all_reduce_latency_s is not None and len(profile.samples["all_reduce_s"]) == 4
    assert 1e-8 < profile.launch_overhead_s < 1e-3
    # every kind the runtime issues, timed between matmuls, fitted to positive α and 1/β
    assert sorted(profile.collectives) == sorted(COLLECTIVE_KINDS)
    for kind, (latency, bandwidth) in profile.collectives.items():
        assert latency >= 0 and bandwidth > 0
        assert len(profile.samples[f"{kind}_in_context_s"]) == 4
    assert Profile.from_json(profile.to_json()) == profile
    assert sorted(profile.hidden_share) == sorted(OVERLAPPED_KINDS)
    assert all(0.0 <= v <= 1.0 for v in profile.hidden_share.values())
    model = ah.models.preset("gpt-tiny")
    (tokens,), _ = ah.models.example_batch(model, 8)
    plain = ah.plan(model, ah.Cluster.local(2), (tokens,), executable_only=True)
    slow = _profile(matmul_flops={"float32": 1e9}, memory_bandwidth=1e9)
    fast = _profile(matmul_flops={"float32": 1e12}, memory_bandwidth=1e12)
    slow_plan = ah.plan(model, ah.Cluster.local(2), (tokens,), executable_only=True,
                        calibration=slow)
    fast_plan = ah.plan(model, ah.Cluster.local(2), (tokens,), executable_only=True,
                        calibration=fast)
    assert plain.calibration_hash is None and slow_plan.calibration_hash == slow.hash()
    # 1000× slower figures; per-op launch overhead (not in these profiles) is the same
    assert slow_plan.predicted.compute_s > 10 * fast_plan.predicted.compute_s


def test_cuda_calibration_times_bf16_transformer_gemms_with_cuda_events(monkeypatch):
    """On CUDA the defaults are bf16 (and fp32) matmuls of 4096-8192 squares and GPT-shaped
    (m, k, n) products, each timed by CUDA events (`cuda_time`); CPU keeps small squares."""
    import types

    import torch

    import importlib

    cal = importlib.import_module("autohybrid.calibrate")
    seen = {}

    def fake_measure(rank, sizes, dtypes, repeats, ar_sizes, device):
        seen.update(sizes=sizes, dtypes=dtypes, device=device)
        return {"bandwidth": 4e12, "launch_s": 1e-5, "rates": {"bfloat16": [5e14] * len(sizes),
                                            "float32": [5e13] * len(sizes)}}
    monkeypatch.setattr(cal, "_measure", fake_measure)
    gpu = types.SimpleNamespace(device_type="cuda", world_size=1)
    profile = calibrate(gpu)
    assert seen["device"] == "cuda" and torch.bfloat16 in seen["dtypes"]
    assert seen["sizes"] == cal.CUDA_MATMULS and 8192 in seen["sizes"]
    assert any(isinstance(s, tuple) for s in seen["sizes"])
    assert profile.matmul_flops["bfloat16"] == 5e14
    calibrate(None)
    assert seen["device"] == "cpu" and seen["sizes"] == cal.CPU_MATMULS
    timed = []
    monkeypatch.setattr(cal, "cuda_time", lambda fn, repeats: timed.append(fn) or 1e-3)
    monkeypatch.setattr(cal.torch, "randn", lambda *s, **kw: torch.ones(*s[:2]))
    assert cal.measure_matmul((64, 32, 16), torch.bfloat16, 3, "cuda") == \
        pytest.approx(2 * 64 * 32 * 16 / 1e-3)
    assert len(timed) == 1
    monkeypatch.undo()
    assert cal.measure_matmul((64, 32, 16), torch.float32, 2, "cpu") > 0
