"""Effects beyond a graph's values that a split batch would change (passes/batch_effects.py).

Each model here computes per-sample values, so the loss-decomposition proof
(passes/batch_flow.py) alone accepts it, yet each trains differently from eager when the
batch is split over data-parallel ranks or microbatches: `nn.Embedding(scale_grad_by_freq
=True)` divides each row's gradient by its id's count in the whole batch, `max_norm`
renormalizes in place the rows the batch reads, `nn.InstanceNorm1d(track_running_stats=
True)` averages its running statistics over the batch, and a counter buffer is written
with `index_put_` from the batch's ids. Under a split batch each is refused before it
runs, naming the module and the fix; the planner's own choice keeps the batch whole and
trains like eager (2 ranks, float64).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autohybrid as ah
from autohybrid.capture import capture
from autohybrid.passes import run_passes
from autohybrid.passes.global_loss import global_loss

from _equiv import Failures, report, train_and_compare
from _limits import guard
from _pool import launch as pool_launch
from test_passes import make_plan, train_context

VOCAB, HIDDEN, BATCH, SEQ = 12, 8, 4, 6


class Tokens(nn.Module):
    """Token embedding → optional middle → vocabulary projection."""

    def __init__(self, middle: nn.Module | None = None, **embedding: object) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN, **embedding)
        self.middle = middle
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        if self.middle is not None:
            h = self.middle(h.transpose(1, 2)).transpose(1, 2)
        return self.head(h)


class Counter(nn.Module):
    """Counts the ids it has seen in a buffer (`index_put_(accumulate=True)`)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(VOCAB, dtype=torch.float64))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        ids = h.detach().argmax(1).flatten()
        self.seen.index_put_((ids,), torch.ones_like(ids, dtype=self.seen.dtype),
                             accumulate=True)
        return h


class RunningMean(nn.Module):
    """A running mean of its input kept in a buffer, updated under `torch.no_grad()`."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(HIDDEN, dtype=torch.float64))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.mean.mul_(0.9).add_(0.1 * h.mean((0, 2)))
        return h - self.mean[:, None]


class Bag(nn.Module):
    """`nn.EmbeddingBag` over each sequence (one bag per sample)."""

    def __init__(self, **embedding: object) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(VOCAB, HIDDEN, mode="sum", **embedding)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.bag(tokens))[:, None].expand(-1, tokens.shape[1], -1)


#: name → (model factory, the module path the refusal must name, words of its fix)
MODELS = {
    "scale_grad_by_freq": (lambda: Tokens(scale_grad_by_freq=True), "embed",
                           "scale_grad_by_freq=False"),
    "max_norm": (lambda: Tokens(max_norm=1.0), "embed", "without max_norm"),
    "instance_norm_running_stats": (
        lambda: Tokens(nn.InstanceNorm1d(HIDDEN, affine=True, track_running_stats=True)),
        "middle", "track_running_stats=False"),
    "counter_buffer": (lambda: Tokens(Counter()), "middle", "outside the model"),
}
#: more of the same kinds, checked without processes
GRAPH_ONLY = {
    "running_mean_under_no_grad": (lambda: Tokens(RunningMean()), "middle",
                                   "outside the model"),
    "embedding_bag_scale_grad_by_freq": (lambda: Bag(scale_grad_by_freq=True), "bag",
                                         "scale_grad_by_freq=False"),
    "embedding_bag_max_norm": (lambda: Bag(max_norm=1.0), "bag", "without max_norm"),
}


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _batches(steps: int = 3) -> list:
    g = torch.Generator().manual_seed(7)
    return [((torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),),
             torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)) for _ in range(steps)]


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return {**MODELS, **GRAPH_ONLY}[name][0]().double()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", [*MODELS, *GRAPH_ONLY])
def test_split_batch_effects_are_refused_naming_the_module(name: str) -> None:
    """dp=2 or 2 microbatches: PlanError naming the module and the fix (before: the
    scale_grad_by_freq and InstanceNorm graphs were accepted, max_norm and the counter
    refused as "combines the samples ... before the loss", naming neither)."""
    _, module, fix = {**MODELS, **GRAPH_ONLY}[name]
    (tokens,), targets = _batches(1)[0]
    cap = capture(_model(name), (tokens,), _loss, targets)
    for dp, count in [(2, 1), (1, 2)]:
        ctx = train_context(cap, make_plan(dp=dp, num_microbatches=count))
        with pytest.raises(ah.PlanError) as info:
            run_passes(cap.gm, ctx, [("global_loss", global_loss)])
        text = str(info.value)
        assert f"module {module!r}" in text and fix in text, text
        assert "dp=1" in text and "one microbatch" in text, text
    run_passes(cap.gm, train_context(cap, make_plan()), [("global_loss", global_loss)])


SPLIT = {"dp2": ah.Constraints(dp=2, tp=1, pp=1),
         "pp2x2": ah.Constraints(dp=1, tp=1, pp=2, num_microbatches=2)}
#: plans that keep the batch whole and must train like eager (tp keeps the embedding
#: tables that need the whole batch replicated: search/sharding.whole_table_embeddings)
WHOLE = {"tp2": ah.Constraints(dp=1, tp=2, pp=1, sp=False), "auto": None}


def test_hidden_running_statistics_block_pipeline_stages() -> None:
    """`aten.instance_norm` writes its running statistics although its schema does not
    say so: every pp stage holds its own copy of the buffers, so pp is refused (before:
    the planner chose pp2 for this model, and rank 1 reported the buffers it never
    updated)."""
    from autohybrid.passes.pipeline_split import pipeline_blockers

    (tokens,), targets = _batches(1)[0]
    cap = capture(_model("instance_norm_running_stats"), (tokens,), _loss, targets)
    blockers = pipeline_blockers(cap.gm)
    assert blockers and "instance_norm" in blockers[0] and "model.middle" in blockers[0]
    eval_mode = capture(_model("instance_norm_running_stats").eval(), (tokens,), _loss,
                        targets)
    assert not pipeline_blockers(eval_mode.gm)


def _rank(rank: int) -> list[str]:
    """Each model: pinned dp=2, and pp=2 with 2 microbatches, refused before they run
    (else: how they train against eager); tp=2 and the unconstrained plan keep the batch
    whole and train like eager."""
    fails = Failures()
    batches = _batches()
    for name, (_, module, _fix) in MODELS.items():
        for split, constraints in SPLIT.items():
            try:
                train_and_compare(fails, f"{name}/{split}", _model(name), batches, 2,
                                  loss_fn=_loss, constraints=constraints)
                fails.append(f"{name}/{split}: not refused (a split batch; the lines "
                             "above say how it trained against eager)")
            except ah.PlanError as exc:
                fails.check(f"{name}/{split} refused without naming {module!r}: {exc}",
                            repr(module) in str(exc) or f"in model.{module}" in str(exc))
        for whole, constraints in WHOLE.items():
            try:
                compiled, _ = train_and_compare(fails, f"{name}/{whole}", _model(name),
                                                batches, 2, loss_fn=_loss,
                                                constraints=constraints)
            except ah.AutohybridError as exc:
                fails.append(f"{name}/{whole}: no plan ran: {type(exc).__name__}: {exc}")
                continue
            plan = compiled.plan
            fails.check(f"{name}/{whole} splits the batch: {plan.mesh.describe()} × "
                        f"{plan.num_microbatches} microbatches",
                        plan.mesh.dp == 1 and plan.num_microbatches == 1)
    return fails


@pytest.mark.procs
@pytest.mark.timeout(200)
def test_split_batch_effects_train_like_eager_or_are_refused() -> None:
    results = pool_launch(_rank, 2, timeout_s=guard(180))
    assert not any(results), report(results)
