"""Loss terms over the whole batch: `loss = per-sample loss + term` (passes/batch_stats.py).

A term without a batch dim — a weight regularizer, or a load-balancing loss computed from
sums over every sample — is added once to the loss; each shard back-propagates its
numerator plus the term weighted by its share of the denominator. Process-free: a
regularizer (no statistic of the batch) splits over any shards, sequentially, with
eager's loss and gradients; a balance-style term from batch sums does too when the sums
are added up over the microbatches first (runtime/whole_batch.py), and does not without;
a loss adding means over other counts (two cross-entropies ignoring other targets, an
element-wise mean) splits the same way, each mean's sum and count added over the shards;
the refusals (a statistic that is not a sum, a count not proportional to the batch,
a mean read twice, random draws a pipeline rank would redraw in another order); the
planner's flag for the extra forward. On 2 gloo ranks: the balance-style term and the
means train like eager under dp, with and without microbatches (SGD and AdamW, an uneven
split of the batch, ignored targets).
"""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autohybrid as ah
from _equiv import OPTIMIZERS, Failures, train_and_compare
from _limits import guard
from _pool import launch as pool_launch
from autohybrid.capture import capture
from autohybrid.passes import run_passes
from autohybrid.graph import output_node
from autohybrid.ops import groups
from autohybrid.passes.global_loss import global_loss, whole_batch_term
from autohybrid.plan import Mesh, RankPlacement
from autohybrid.runtime import whole_batch
from test_passes import Net, make_plan, rewritten, train_context

CLASSES, BATCH, IGNORE = 5, 12, -1


class _Penalized(Net):
    """Net returning (logits, an L2 penalty on its first weight): a loss term every shard
    computes whole, as a model computes its own regularizer or auxiliary loss."""

    def forward(self, x):
        return super().forward(x), 0.03 * self.a.weight.pow(2).sum()


def _regularized(out, t):
    logits, penalty = out
    return F.cross_entropy(logits, t, ignore_index=IGNORE) + penalty


def _balance(o, t):
    """Cross-entropy + a balance term as Hugging Face's MoE loss builds it: the share of
    the batch's samples whose argmax is each class (fixed-bin histc over the batch) times
    the mean probability of each class (a sum over the batch / the batch size)."""
    p = o.softmax(-1)
    counts = torch.histc(p.argmax(-1).double(), bins=CLASSES, min=0, max=CLASSES)
    term = (counts / o.shape[0] * (p.sum(0) / o.shape[0])).sum() * CLASSES
    return F.cross_entropy(o, t, ignore_index=IGNORE) + 0.5 * term


def _two_means(o, t):
    """Two cross-entropies over other targets, each ignoring its own, averaged as Hugging
    Face's question answering does, less a scaled element-wise mean: three means over
    three counts (samples kept by each target, every element)."""
    start = F.cross_entropy(o, t[:, 0], ignore_index=IGNORE)
    end = F.cross_entropy(o, t[:, 1], ignore_index=IGNORE)
    return (start + end) / 2 - 0.1 * o.pow(2).mean()


def _pair_targets(g: torch.Generator, n: int) -> torch.Tensor:
    t = torch.randint(0, CLASSES, (n, 2), generator=g)
    t[1::3, 0] = IGNORE
    t[2::5, 1] = IGNORE
    return t


def _inputs(g: torch.Generator, n: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, 6, generator=g, dtype=torch.float64)
    t = torch.randint(0, CLASSES, (n,), generator=g)
    t[1::4] = IGNORE
    return x, t


def test_a_regularizer_term_splits_over_any_shards_like_eager() -> None:
    g = torch.Generator().manual_seed(3)
    model = _Penalized().double()
    x, t = _inputs(g)
    cap = capture(model, (x[:4],), _regularized, (t[:4],))
    ctx = train_context(cap, make_plan(dp=2, num_microbatches=2))
    program = rewritten(cap, ctx, run_passes(cap.gm, ctx, [("global_loss", global_loss)]))
    assert ctx.notes["loss_kind"] == "mean"
    eager = copy.deepcopy(model)
    want = _regularized(eager(x), t)
    want.backward()
    state = cap.default_state(model)
    for bounds in ([0, 2, 12], [0, 5, 9, 12], [0, 1, 2, 3, 12]):
        model.zero_grad()
        numerator = denominator = 0.0
        for a, b in zip(bounds, bounds[1:]):
            num, den = program.run(state, (x[a:b],), (t[a:b],))
            num.backward()
            numerator, denominator = numerator + num.detach(), denominator + den.detach()
        torch.testing.assert_close(numerator / denominator, want.detach(), rtol=1e-12,
                                   atol=1e-12)
        for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
            torch.testing.assert_close(p.grad / denominator, q.grad, rtol=1e-10, atol=1e-12,
                                       msg=f"gradient of {name}, shards {bounds}")


REFUSED = {
    "a maximum over the batch": (lambda o, t: F.cross_entropy(o, t) + o.amax(0).sum(),
                                 "not proven the whole batch's value"),
    # one mean read by two addends: rewriting it to a sum would change the other's value
    "a mean added twice": (lambda o, t: (lambda c: c + 0.5 * c.detach())(
        F.cross_entropy(o, t)), "cannot split over 2 batch shards"),
    "a mean read by another term": (
        lambda o, t: (lambda a, b: a + b + b.pow(2))(F.cross_entropy(o, t), o.pow(2).mean()),
        "cannot split over 2 batch shards"),
    "a count not proportional to the batch": (
        lambda o, t: F.cross_entropy(o, t) + o.sum(0).sum() / (o.shape[0] * o.shape[0]),
        "other than in proportion"),
}


def test_a_loss_fn_reading_a_parameter_directly_is_refused_at_capture() -> None:
    """Its gradient would be lost: torch.export lifts the parameter as a constant."""
    model = Net().double()
    x, t = _inputs(torch.Generator().manual_seed(6))
    weight = model.a.weight
    with pytest.raises(ah.CaptureError, match="parameter 'a.weight'.*gradient would be lost"):
        capture(model, (x[:4],), lambda o, t: F.cross_entropy(o, t.clamp(min=0))
                + weight.pow(2).sum(), (t[:4],))


@pytest.mark.parametrize("name", list(REFUSED))
def test_terms_that_are_not_sums_over_the_batch_are_refused_when_split(name: str) -> None:
    loss_fn, why = REFUSED[name]
    g = torch.Generator().manual_seed(4)
    model = Net().double()
    x, t = _inputs(g)
    t = t.clamp(min=0)
    cap = capture(model, (x[:4],), loss_fn, (t[:4],))
    ctx = train_context(cap, make_plan())    # one shard: the loss runs as it is
    run_passes(cap.gm, ctx, [("global_loss", global_loss)])
    assert ctx.notes["loss_kind"] == "opaque"
    with pytest.raises(ah.PlanError, match=why):
        run_passes(cap.gm, train_context(cap, make_plan(dp=2)), [("global_loss", global_loss)])


def test_a_whole_batch_term_is_summed_over_dp_and_weighted_for_microbatches() -> None:
    g = torch.Generator().manual_seed(5)
    model = Net().double()
    x, t = _inputs(g)
    cap = capture(model, (x[:4],), _balance, (t[:4],))
    for plan in (make_plan(dp=2), make_plan(dp=2, num_microbatches=2)):
        ctx = train_context(cap, plan)
        gm = run_passes(cap.gm, ctx, [("global_loss", global_loss)])
        sums = [n for n in gm.graph.nodes if n.target is torch.ops.autohybrid.batch_sum.default]
        # the class counts, the probability sums, and the batch size (twice); keyed by name
        assert len(sums) == 4 and all(n.args[1:] == ("dp", n.name) for n in sums), sums
        assert ctx.notes["loss_kind"] == "mean"
        (weight,) = [n for n in gm.graph.nodes
                     if n.target is torch.ops.autohybrid.term_weight.default]
        assert weight.args[0] is output_node(gm).args[0][-1]   # of the denominator


def test_a_loss_adding_means_over_other_counts_splits_like_eager() -> None:
    """(start + end) / 2 − 0.1 · mean(o²): each mean's sum and count added over the
    shards, so any split — dp shards, microbatches (the sums added up first) — gives
    eager's loss and gradients; the planner knows it reads whole-batch statistics."""
    g = torch.Generator().manual_seed(9)
    model = Net().double()
    x, t = _inputs(g)[0], _pair_targets(g, BATCH)
    cap = capture(model, (x[:4],), _two_means, (t[:4],))
    assert whole_batch_term(cap.gm, cap.user_outputs[0])
    ctx = train_context(cap, make_plan(dp=2))
    gm = run_passes(cap.gm, ctx, [("global_loss", global_loss)])
    assert ctx.notes["loss_kind"] == "mean"
    sums = [n for n in gm.graph.nodes if n.target is torch.ops.autohybrid.batch_sum.default]
    assert len(sums) == 4, sums   # the end loss's sum and count, o²'s sum and count
    ctx = train_context(cap, make_plan(num_microbatches=2))
    program = rewritten(cap, ctx, run_passes(cap.gm, ctx, [("global_loss", global_loss)]))
    groups.bind("dp", None)
    try:
        # (halves of 6 hold as many kept targets each: their own means average to eager's)
        _check_microbatches(model, program, cap.default_state(model), x, t, _two_means,
                            control=(0, 5, 12))
    finally:
        groups.clear()


def _run_shards(program, state, x, t, bounds, sums_first: bool):
    """The shards [a, b) of `bounds` as one rank's microbatches, forward and backward in
    turn (the executor's loop); with `sums_first`, the whole-batch sums added up before
    (runtime/whole_batch.py). (Σ numerators, Σ denominators)."""
    shards = list(zip(bounds, bounds[1:]))
    sums = None
    if sums_first:
        sums = whole_batch.sums_first(
            lambda: sum(program.run(state, (x[a:b],), (t[a:b],))[-1] for a, b in shards),
            len(shards))
    numerator = denominator = 0.0
    with whole_batch.step(sums, len(shards)):
        for a, b in shards:
            num, den = program.run(state, (x[a:b],), (t[a:b],))
            num.backward()
            numerator, denominator = numerator + num.detach(), denominator + den.detach()
    return numerator, denominator


def test_a_whole_batch_term_over_microbatches_gives_eagers_loss_and_gradients() -> None:
    """One process, the shards as microbatches: with the sums added up first, eager's
    loss and gradients for any split; run as if each shard saw the whole batch (each
    microbatch's own sums), neither."""
    g = torch.Generator().manual_seed(7)
    model = Net().double()
    x, t = _inputs(g)
    cap = capture(model, (x[:4],), _balance, (t[:4],))
    ctx = train_context(cap, make_plan(num_microbatches=2))
    program = rewritten(cap, ctx, run_passes(cap.gm, ctx, [("global_loss", global_loss)]))
    groups.bind("dp", None)   # a mesh of one rank: batch_sum adds nothing over dp
    try:
        _check_microbatches(model, program, cap.default_state(model), x, t)
    finally:
        groups.clear()


def _check_microbatches(model, program, state, x, t, loss_fn=_balance,
                        control=(0, 6, 12)) -> None:
    eager = copy.deepcopy(model)
    want = loss_fn(eager(x), t)
    want.backward()
    for bounds in ([0, 6, 12], [0, 5, 9, 12], [0, 1, 2, 3, 12]):
        model.zero_grad()
        numerator, denominator = _run_shards(program, state, x, t, bounds, True)
        torch.testing.assert_close(numerator / denominator, want.detach(), rtol=1e-12,
                                   atol=1e-12)
        for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
            torch.testing.assert_close(p.grad / denominator, q.grad, rtol=1e-10, atol=1e-12,
                                       msg=f"gradient of {name}, shards {bounds}")
    model.zero_grad()   # the control: each microbatch's own statistics are not eager's
    numerator, denominator = _run_shards(program, state, x, t, list(control), False)
    assert abs(float(numerator / denominator - want.detach())) > 1e-6


def test_whole_batch_terms_microbatches_cannot_add_up_are_refused() -> None:
    """A rank holding several pipeline stages runs its forwards in another order than the
    forward adding up the sums: the random draws would differ."""
    x, t = _inputs(torch.Generator().manual_seed(5))
    drop = nn.Sequential(nn.Dropout(0.1), Net()).double()
    cap = capture(drop, (x[:4],), _balance, (t[:4],))
    two = make_plan(num_microbatches=2)
    run_passes(cap.gm, train_context(cap, two), [("global_loss", global_loss)])
    looped = dataclasses.replace(two, mesh=Mesh(pp=2), virtual_stages=2,
                                 schedule="interleaved", placement=tuple(
                                     RankPlacement(rank=r, node=0, device=r) for r in (0, 1)))
    with pytest.raises(ah.PlanError, match="draws random numbers.*2 pipeline stages per rank"):
        run_passes(cap.gm, train_context(cap, looped), [("global_loss", global_loss)])


_LOSSES = {"balance term": _balance, "two means": _two_means}


def _rank(rank: int, cases: list[tuple[str, str, int, int]]) -> Failures:
    fails = Failures()
    for loss, optimizer, batch, micro in cases:
        torch.manual_seed(0)
        model = Net().double()
        g = torch.Generator().manual_seed(batch)

        def data(n):
            x, t = _inputs(g, n)
            return x, (t if loss == "balance term" else _pair_targets(g, n))

        batches = [((x,), t) for x, t in (data(batch) for _ in range(2))]
        example = data(8)    # planned for 8 samples, trained on `batch`
        train_and_compare(fails, f"{loss}, batch {batch}, {micro} microbatches, "
                          f"{optimizer}", model, batches,
                          2, loss_fn=_LOSSES[loss], optimizer=OPTIMIZERS[optimizer],
                          constraints=ah.Constraints(dp=2, num_microbatches=micro),
                          example=((example[0],), example[1]))
    return fails


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_a_whole_batch_term_trains_like_eager_under_data_parallelism():
    results = pool_launch(_rank, 2, args=([("balance term", "sgd", 12, 1),
                                           ("balance term", "adamw", 12, 1),
                                           ("balance term", "sgd", 7, 1),
                                           ("balance term", "sgd", 12, 2),
                                           ("balance term", "adamw", 12, 4),
                                           ("two means", "sgd", 7, 1),
                                           ("two means", "adamw", 12, 2)],),
                          timeout_s=guard(180))
    assert results == [[], []], "\n".join(line for r in results for line in r)


def test_the_planner_knows_a_loss_term_reads_whole_batch_statistics() -> None:
    """passes/global_loss.whole_batch_term: the balance term reads sums over the batch
    (its plans with microbatches are priced one more forward: test_search), a
    regularizer does not, a plain loss has no term."""
    x, t = _inputs(torch.Generator().manual_seed(8))
    for model, loss_fn, want in ((Net(), _balance, True), (_Penalized(), _regularized, False),
                                 (Net(), lambda o, t: F.cross_entropy(o, t.clamp(min=0)),
                                  False)):
        cap = capture(model.double(), (x[:4],), loss_fn, (t[:4],))
        assert whole_batch_term(cap.gm, cap.user_outputs[0]) is want, loss_fn
