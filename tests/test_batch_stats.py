"""Loss terms over the whole batch: `loss = per-sample loss + term` (passes/batch_stats.py).

A term without a batch dim — a weight regularizer, or a load-balancing loss computed from
sums over every sample — is added once to the loss; each shard back-propagates its
numerator plus the term weighted by its share of the denominator. Process-free: a
regularizer (no statistic of the batch) splits over any shards, sequentially, with
eager's loss and gradients, and the refusals (a statistic that is not a sum, a count not
proportional to the batch, microbatches with a whole-batch statistic). On 2 gloo ranks: a
balance-style term from batch sums and the batch's size trains like eager under dp (SGD
and AdamW, an uneven split of the batch, ignored targets).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import autohybrid as ah
from _equiv import OPTIMIZERS, Failures, train_and_compare
from _limits import guard
from _pool import launch as pool_launch
from autohybrid.capture import capture
from autohybrid.passes import run_passes
from autohybrid.passes.global_loss import global_loss
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


def test_a_whole_batch_term_is_summed_over_dp_and_refused_with_microbatches() -> None:
    g = torch.Generator().manual_seed(5)
    model = Net().double()
    x, t = _inputs(g)
    cap = capture(model, (x[:4],), _balance, (t[:4],))
    ctx = train_context(cap, make_plan(dp=2))
    gm = run_passes(cap.gm, ctx, [("global_loss", global_loss)])
    sums = [n for n in gm.graph.nodes if n.target is torch.ops.autohybrid.batch_sum.default]
    # the class counts, the probability sums, and the batch size (twice)
    assert len(sums) == 4 and all(n.args[1] == "dp" for n in sums), sums
    assert ctx.notes["loss_kind"] == "mean"
    for plan in (make_plan(dp=2, num_microbatches=2), make_plan(num_microbatches=2)):
        with pytest.raises(ah.PlanError, match="statistics of the whole batch.*one microbatch"):
            run_passes(cap.gm, train_context(cap, plan), [("global_loss", global_loss)])


def _rank(rank: int, cases: list[tuple[str, int]]) -> Failures:
    fails = Failures()
    for optimizer, batch in cases:
        torch.manual_seed(0)
        model = Net().double()
        g = torch.Generator().manual_seed(batch)
        batches = [((x,), t) for x, t in (_inputs(g, batch) for _ in range(2))]
        example = _inputs(g, 8)    # planned for 8 samples, trained on `batch`
        train_and_compare(fails, f"balance term, batch {batch}, {optimizer}", model, batches,
                          2, loss_fn=_balance, optimizer=OPTIMIZERS[optimizer],
                          constraints=ah.Constraints(dp=2),
                          example=((example[0],), example[1]))
    return fails


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_a_whole_batch_term_trains_like_eager_under_data_parallelism():
    results = pool_launch(_rank, 2, args=([("sgd", 12), ("adamw", 12), ("sgd", 7)],),
                          timeout_s=guard(150))
    assert results == [[], []], "\n".join(line for r in results for line in r)
