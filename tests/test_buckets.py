"""Gradient bucket sizes chosen by the cost model (search/pricing.py), pinned by Constraints.

Buckets launched during backward hide all but the last behind the backward still to run;
each bucket is one more collective and pays its latency. The planner prices the sizes of
`BUCKET_CHOICES_MB` and records the one that exposes least in `plan.bucket_mb`: the
chosen size's predicted exposed communication is no more than any pinned size's, a big
model on a fast link gets small buckets (its last bucket is what stays exposed), a tiny
model gets one bucket (latency dominates), and `Constraints(bucket_mb=...)` is kept as
given. The reducer's buckets follow the plan (tests/test_dp_equivalence.py pins a tiny
size and checks the number of buckets launched during backward).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import autohybrid as ah
from autohybrid.search.pricing import BUCKET_CHOICES_MB

DP = dict(tp=1, pp=1, zero=0, recompute="none")


@pytest.fixture(scope="module")
def big():
    """A wide 2-layer GPT on the meta device: 0.66 GB of fp32 gradients, quick to plan."""
    from autohybrid.models.gpt import GPT

    model = GPT(layers=2, hidden=2048, heads=16, vocab=32000, seq=1024, device="meta")
    return model, (torch.zeros(8, 1024, dtype=torch.long, device="meta"),)


def _plan(model, inputs, cluster, **pinned) -> ah.Plan:
    return ah.plan(model, cluster, inputs, global_batch=64,
                   constraints=ah.Constraints(**DP, microbatch_size=8, **pinned))


def test_chosen_bucket_size_exposes_least(big):
    model, inputs = big
    cluster = ah.Cluster.preset("dgx-a100-80gb", nodes=1)
    chosen = _plan(model, inputs, cluster)
    assert chosen.bucket_mb in BUCKET_CHOICES_MB
    exposed = {size: _plan(model, inputs, cluster, bucket_mb=size).predicted.exposed_comm_s
               for size in BUCKET_CHOICES_MB}
    assert chosen.predicted.exposed_comm_s == pytest.approx(min(exposed.values()))
    # most of a second of backward against 0.66 GB of gradients: small buckets leave only
    # the last one exposed; one huge bucket would expose its whole sum
    assert chosen.bucket_mb < max(BUCKET_CHOICES_MB)
    assert exposed[max(BUCKET_CHOICES_MB)] > 2 * chosen.predicted.exposed_comm_s
    assert ah.Plan.from_json(chosen.to_json()).bucket_mb == chosen.bucket_mb


def test_tiny_model_gets_one_bucket_and_pins_are_kept():
    model = ah.models.preset("gpt-tiny")
    inputs, _ = ah.models.example_batch("gpt-tiny", 8)
    plan = ah.plan(model, ah.Cluster.local(4), inputs,
                   constraints=ah.Constraints(dp=4, **DP))
    assert plan.bucket_mb == max(BUCKET_CHOICES_MB)      # a few MB: one collective is best
    pinned = ah.plan(model, ah.Cluster.local(4), inputs,
                     constraints=ah.Constraints(dp=4, bucket_mb=0.5, **DP))
    assert pinned.bucket_mb == 0.5
    assert pinned.predicted.exposed_comm_s >= plan.predicted.exposed_comm_s
    assert dataclasses.replace(plan, bucket_mb=2.0).bucket_mb == 2.0


def test_zero3_gathers_hide_behind_the_layer_before():
    """ZeRO-3 prices each layer's gather prefetched one layer ahead (passes/overlap.py):
    with no compute everything is exposed, as without prefetch; with compute longer
    than every gather only the first gather of forward and of backward stays. The
    reduce-scatters (issued asynchronously outside a pipeline: ops/zero.py) hide in what
    each layer's backward leaves after its gather, all but the last; in a pipeline they
    stay exposed whatever the compute."""
    from autohybrid.cost import comm
    from autohybrid.plan import Mesh
    from autohybrid.search.pricing import Layout, _dp_sync, dp_ranks

    cluster = ah.Cluster.preset("dgx-a100-80gb", nodes=2)
    layout = Layout(Mesh(dp=16), 1, 2, zero=3)
    ranks, nbytes, k, m = dp_ranks(layout), 2e9, 10, 2
    gather = comm.all_gather(cluster, ranks, nbytes)
    scatter = comm.reduce_scatter(cluster, ranks, nbytes)
    latency = comm.ring_latency(cluster, ranks)
    total = m * (scatter + 2 * gather + 3 * (k - 1) * latency)

    def exposed(forward: float, backward: float) -> float:
        sync, times, fixed, hidden = _dp_sync(cluster, layout, nbytes, k, forward, backward)
        assert (sync, times) == (0.0, 1) and fixed == pytest.approx(total)
        return fixed - hidden

    assert exposed(0.0, 0.0) == pytest.approx(total)
    one = (gather + (k - 1) * latency) / k
    summed = (scatter + (k - 1) * latency) / k   # one layer's reduce-scatter
    ample = exposed(10.0, 20.0)
    assert ample == pytest.approx(m * (summed + 2 * one))
    # half a gather of compute per layer hides half of each later gather, and leaves
    # nothing to hide a reduce-scatter in
    half = exposed(k * one / 2, k * one / 2)
    exposed_gathers = 2 * (one + (k - 1) * one / 2)
    assert half == pytest.approx(m * (scatter + (k - 1) * latency + exposed_gathers))
    assert ample < half < total
    # a layer's backward one gather and half a reduce-scatter long hides half of each
    partly = exposed(10.0, k * (one + summed / 2))
    assert partly == pytest.approx(m * (summed + (k - 1) * summed / 2 + 2 * one))

    piped = Layout(Mesh(dp=8, pp=2), 1, 2, zero=3)   # synchronous in a pipeline
    ranks = dp_ranks(piped)
    gather = comm.all_gather(cluster, ranks, nbytes)
    scatter = comm.reduce_scatter(cluster, ranks, nbytes)
    latency = comm.ring_latency(cluster, ranks)
    one = (gather + (k - 1) * latency) / k
    sync, times, fixed, hidden = _dp_sync(cluster, piped, nbytes, k, 10.0, 20.0)
    assert fixed - hidden == pytest.approx(m * (scatter + (k - 1) * latency + 2 * one))
