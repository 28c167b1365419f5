"""Pipeline pricing: pp × v stages placed by the schedule, per-schedule bubbles and memory,
and the planner's schedule enumeration and pinned stage boundaries."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import autohybrid as ah
from autohybrid.capture import capture
from autohybrid.plan import Mesh, schedule_problem
from autohybrid.features import unsupported
from autohybrid.search import planner, pricing
from autohybrid.search.pricing import Layout, LayerTimes, bubble, price
from autohybrid.search.space import profile
from autohybrid.search.stages import stage_costs

#: Every pipeline schedule with the virtual stages the planner tries for it.
PIPELINED = [(name, v) for name, depths in planner.VIRTUAL_STAGES.items() for v in depths]


def _gpt_profile(layers: int = 6, vocab: int = 512, hidden: int = 64, seq: int = 64):
    """The costed GPT (embedding, position embedding, blocks, ln_f, tied head + loss)."""
    model = ah.models.gpt(layers=layers, hidden=hidden, heads=4, vocab=vocab, seq=seq,
                          device="meta")
    tokens = torch.zeros(2, seq, dtype=torch.long, device="meta")
    cap = capture(model, (tokens,),
                  lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten()), tokens)
    return cap, profile(cap.gm, cap.dim_roles)


@pytest.fixture(scope="module")
def gpt():
    return _gpt_profile()


def _price(prof, layout: Layout, **kwargs):
    return price(prof, ah.Cluster.preset("dgx-h100"), layout, 64, "bfloat16", 4, "adam",
                 layout.mesh.dp * layout.microbatch_size * layout.num_microbatches, **kwargs)


def _request(model_hash: str, **pinned) -> planner.PlanRequest:
    return planner.PlanRequest(model_hash=model_hash, global_batch=16, seq=64,
                               dtype="bfloat16", graph_dtype_bytes=4,
                               constraints=ah.Constraints(**pinned))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule,v", PIPELINED)
def test_every_schedule_splits_into_pp_times_v_stages(gpt, schedule, v):
    cap, prof = gpt
    priced = _price(prof, Layout(Mesh(pp=2, dp=4), 2, 8, schedule, v))
    starts = priced.stage_starts
    assert len(starts) == 2 * v and starts[0] == 0 and list(starts) == sorted(set(starts))
    plan = planner.search(prof, ah.Cluster.preset("dgx-h100"),
                          _request(cap.hash, pp=2, schedule=schedule, virtual_stages=v),
                          unsupported, executable_only=False)
    assert (plan.schedule, plan.virtual_stages, plan.num_stages) == (schedule, v, 2 * v)
    names = [layer.name for layer in prof.layers]
    cuts = [names.index(b) for b in plan.stage_boundaries]
    assert len(cuts) == plan.num_stages - 1 and cuts == sorted(set(cuts)) and cuts[0] > 0


def plan_starts(plan, prof) -> tuple[int, ...]:
    names = [layer.name for layer in prof.layers]
    return (0, *sorted(names.index(b) for b in plan.stage_boundaries))


@pytest.mark.timeout(120)
def test_a_heavy_head_moves_the_split_off_equal_layer_counts():
    """A 256k vocabulary makes the tied head and loss cost about three blocks: the balanced
    split gives the last stage fewer layers and a faster slowest stage than equal counts."""
    _, prof = _gpt_profile(vocab=262144)
    n = len(prof.layers)
    for schedule, v in (("1f1b", 1), ("interleaved", 2), ("zbv", 2)):
        layout = Layout(Mesh(pp=2, dp=4), 2, 8, schedule, v)
        stages = 2 * v
        equal = tuple(k * n // stages for k in range(stages))
        balanced = _price(prof, layout)
        even = _price(prof, layout, stage_starts=equal)
        assert even.stage_starts == equal
        assert balanced.stage_starts != equal, schedule
        assert balanced.prediction.compute_s < even.prediction.compute_s, schedule
        assert balanced.prediction.step_time_s < even.prediction.step_time_s, schedule


def test_balance_ranks_evens_out_the_ranks_of_a_v():
    """V-shaped: rank 0 runs the first and the last stage; the stage-balanced split puts
    both heavy ends on it, the rank-aware one shifts layers to rank 1."""
    costs = [4, 1, 1, 1, 1, 1, 1, 4]
    placement = (0, 1, 1, 0)
    starts = (0, 2, 4, 6)  # stages cost 5, 2, 2, 5: ranks 10 and 4
    better = pricing.balance_ranks(costs, starts, placement)
    bounds = stage_costs(costs, better)
    loads = [bounds[0] + bounds[3], bounds[1] + bounds[2]]
    assert max(loads) < 10 and sum(loads) == sum(costs)


def _times(forward: float, recompute: float = 0.0) -> LayerTimes:
    """A rank's summed times with the backward twice the forward."""
    return LayerTimes(forward, 2 * forward, recompute, 0.0, 0.0, 0.0)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_bubbles_follow_the_schedule_formulas(p):
    one = _times(1.0)  # t_f = 1, t_b = 2, t_w = 1, t = 3

    def idle(schedule, v, times=one):
        return bubble(Layout(Mesh(pp=p), 1, 4 * p, schedule, v), times)

    assert idle("gpipe", 1) == idle("1f1b", 1) == p - 1
    assert idle("interleaved", 2) == idle("looped-bfs", 2) == pytest.approx((p - 1) / 2)
    assert idle("zero-bubble", 1) == pytest.approx((p - 1) / 3)        # ZB-H1: t_f / t
    assert idle("zero-bubble", 2) == pytest.approx((p - 1) / 6)
    assert idle("zbv", 2) == 0.0                                            # t_b = 2 t_w = 2 t_f
    assert idle("dualpipev", 2) == pytest.approx((p - 1) / 3)             # (F + 2B − 3W) / 2t
    # full recomputation adds a forward to the backward: ZB-V's idle slot reopens
    assert idle("zbv", 2, _times(1.0, 1.0)) == pytest.approx((p - 1) / 2 * 1 / 4)
    assert bubble(Layout(Mesh(pp=1), 1, 4), one) == 0.0


def test_too_few_microbatches_are_bounded_by_one_microbatchs_trip():
    one = _times(1.0)  # t_f = 1, t_b = 2, t_w = 1, t = 3
    # interleaving cannot split one microbatch's trip through all 4 ranks
    assert bubble(Layout(Mesh(pp=4), 1, 1, "interleaved", 2), one) == 3
    # ZB-H1, p = 2, m = 1: F, F, B, B, then the last W: 5 units = 3 + 2
    assert bubble(Layout(Mesh(pp=2), 1, 1, "zero-bubble", 1), one) == pytest.approx(2 / 3)


@pytest.mark.timeout(120)
def test_v_shaped_schedules_price_a_smaller_bubble_than_1f1b(gpt):
    _, prof = gpt
    for p in (2, 4):
        m = 2 * p
        base = _price(prof, Layout(Mesh(pp=p, dp=8 // p), 1, m, "1f1b", 1)).prediction
        for schedule in ("zbv", "dualpipev"):
            v_shaped = _price(prof, Layout(Mesh(pp=p, dp=8 // p), 1, m, schedule, 2))
            assert v_shaped.prediction.bubble_fraction < base.bubble_fraction, (p, schedule)


def test_in_flight_per_schedule_and_rank():
    def flight(schedule, v, rank, p=4, m=16):
        return pricing.in_flight(Layout(Mesh(pp=p), 1, m, schedule, v), rank)

    assert flight("gpipe", 1, 3) == flight("looped-bfs", 2, 3) == 16   # every microbatch
    assert [flight("1f1b", 1, r) for r in range(4)] == [4, 3, 2, 1]
    assert flight("interleaved", 2, 0) == pytest.approx(4 + 3 / 2)   # Korthikanti et al.
    assert flight("interleaved", 2, 3) == pytest.approx(4 - 3 / 2)
    assert flight("zbv", 2, 0) == flight("zbv", 2, 3) == 4
    assert flight("dualpipev", 2, 1) == 4.5
    assert flight("1f1b", 1, 0, m=2) == 2                             # never more than m


def test_a_tied_parameter_counts_once_per_rank_that_holds_it(gpt):
    """The embedding is tied to the head: a V's rank 0 runs both (held once); with 1F1B
    the first and last ranks each hold a copy."""
    _, prof = gpt
    n, half = len(prof.layers), len(prof.layers) // 2
    tied = pricing._rank_params(prof, ((0, 1),), 1, {})[0]
    assert pricing._rank_params(prof, ((n - 1, n),), 1, {})[0] == tied  # the head's weight
    ends = pricing._rank_params(prof, ((0, 1), (n - 1, n)), 1, {})[0]
    assert ends == tied
    total = prof.local_params(prof.layers, 1)
    first = pricing._rank_params(prof, ((0, half),), 1, {})[0]
    last = pricing._rank_params(prof, ((half, n),), 1, {})[0]
    assert first + last == pytest.approx(total + tied)


@pytest.mark.parametrize("pinned", [{}, dict(schedule="interleaved"), dict(virtual_stages=2),
                                    dict(schedule="zbv", virtual_stages=2)])
def test_planner_never_yields_a_schedule_torch_cannot_run(pinned):
    constraints = ah.Constraints(**pinned)
    seen = set()
    for pp in range(1, 9):
        for count in range(1, 21):
            for blocks in (3, 8, 40):
                skipped: list[str] = []
                for name, v in planner._schedules(pp, count, blocks, constraints, skipped):
                    assert schedule_problem(name, pp, v, count) is None, (name, pp, v, count)
                    assert pp * v <= blocks
                    seen.add(name)
    if not pinned:
        assert seen == {"none", *planner.VIRTUAL_STAGES}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("boundaries,match", [
    (("model.blocks.9",), "not a layer of the model"),
    (("model.blocks.3", "model.blocks.1", "model.ln_f"), "in model order"),
    (("model.tok_emb",), "in model order"),
    (("model.blocks.2", "model.blocks.4"), "names 2 boundaries"),
])
def test_bad_pinned_boundaries_raise_plan_error(gpt, boundaries, match):
    cap, prof = gpt
    request = _request(cap.hash, pp=2, schedule="1f1b", stage_boundaries=boundaries)
    with pytest.raises(ah.PlanError, match=match) as err:
        planner.search(prof, ah.Cluster.preset("dgx-h100"), request, unsupported,
                       executable_only=False)
    assert not isinstance(err.value, ah.NotExecutableError)


@pytest.mark.timeout(120)
def test_pinned_boundaries_are_priced_and_kept(gpt):
    cap, prof = gpt
    cuts = ("model.blocks.1", "model.blocks.3", "model.blocks.5")
    plan = planner.search(prof, ah.Cluster.preset("dgx-h100"),
                          _request(cap.hash, pp=2, stage_boundaries=cuts), unsupported,
                          executable_only=False)
    assert plan.stage_boundaries == cuts and plan.num_stages == 4
    layout = Layout(plan.mesh, plan.microbatch_size, plan.num_microbatches, plan.schedule,
                    plan.virtual_stages, plan.recompute, plan.zero, plan.bucket_mb)
    priced = _price(prof, layout, stage_starts=plan_starts(plan, prof))
    assert plan.predicted.step_time_s == pytest.approx(priced.prediction.step_time_s)


def test_batch_norm_models_are_not_pipelined():
    cluster = ah.Cluster.preset("dgx-h100")
    request = replace(_request(""), has_batch_norm=True)
    checker = planner._Executability(cluster, request, lambda plan: [])
    piped = checker.reasons(Layout(Mesh(pp=2, dp=4), 4, 1, "gpipe", 1), None)
    assert any("BatchNorm in training mode" in r for r in piped)
    flat = checker.reasons(Layout(Mesh(pp=1, dp=8), 2, 1), None)
    assert not flat
