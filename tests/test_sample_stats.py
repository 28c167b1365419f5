"""Per-sample statistics from the compiled training forward (autohybrid/sample_stats.py,
`compiled.record_sample_stats`): what KAKURENBO's hiding reads, with no extra pass.

On 4 gloo ranks, for a classifier and a language model under dp, tp (vocabulary-parallel
head), pp (the last stage computes them) and ZeRO: every rank holds the statistics of the
whole global batch, equal to eager's `sample_stats` of the model before the step, while
losses, gradients and parameters still equal eager training's (the statistics are
detached: they change nothing). Process-free: the refusals and the capture memo."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autohybrid as ah
from _equiv import (OPTIMIZERS, Failures, default_eager_loss, eager_step, grads_of,
                    lm_loss, state_of, zoo_batches, zoo_model)
from _limits import guard
from _pool import launch as pool_launch
from autohybrid.errors import CaptureError
from autohybrid.sample_stats import StatsLoss, sample_stats


def _stats(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    loss, correct, prob = sample_stats(logits, targets)
    return torch.stack([loss.float(), correct.float(), prob.float()], 1)


def _check(fails: Failures, name: str, model: nn.Module, batches, world: int, loss_fn,
           constraints: ah.Constraints, optimizer: str = "sgd", *, stats_fn=None,
           eager_loss=None, tol: float | None = None) -> None:
    """Train `model` compiled and eagerly; from the second step on the compiled one also
    records statistics, compared with eager's (`stats_fn` or sample_stats of the logits
    the model gives before the step); then losses, gradients and parameters."""
    ref = copy.deepcopy(model)
    eager_loss = eager_loss or default_eager_loss(loss_fn)
    stats_of = stats_fn or sample_stats
    compiled = ah.compile(model, ah.Cluster.local(world), batches[0][0], loss_fn=loss_fn,
                          example_targets=batches[0][1], optimizer=OPTIMIZERS[optimizer],
                          constraints=constraints)
    compiled.train_step(*batches[0])     # captured without statistics, then with them
    ref_opt = OPTIMIZERS[optimizer](list(ref.parameters()))
    eager_step(ref, ref_opt, eager_loss, *batches[0], None)
    fails.check(f"{name}: no statistics before asked", compiled.last_sample_stats is None)
    compiled.record_sample_stats(stats_fn)
    for step, (inputs, targets) in enumerate(batches[1:], 1):
        with torch.no_grad():
            out = ref(*inputs)
            loss, correct, prob = stats_of(getattr(out, "logits", out), targets)
            expected = torch.stack([loss.float(), correct.float(), prob.float()], 1)
        loss = compiled.train_step(inputs, targets)
        eager = eager_step(ref, ref_opt, eager_loss, inputs, targets, None)
        where = f"{name} step {step}"
        got = compiled.last_sample_stats
        fails.check(f"{where} statistics shape {None if got is None else tuple(got.shape)}",
                    got is not None and got.shape == expected.shape)
        if got is not None and got.shape == expected.shape:
            if tol is None:
                fails.close(f"{where} statistics", got.double(), expected.double())
            else:
                fails.check(f"{where} statistics within {tol}: largest difference "
                            f"{(got.double() - expected.double()).abs().max():.2e}",
                            torch.allclose(got.double(), expected.double(), atol=tol, rtol=tol))
        fails.close(f"{where} loss", loss, eager)
        fails.close_dict(f"{where} grads", compiled.full_grads(), grads_of(ref))
        fails.close_dict(f"{where} state", compiled.full_state_dict(), state_of(ref))


def _ranks(rank: int, world: int) -> list[str]:
    fails = Failures()
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 5)).double()
    x = torch.randn(3, 12, 6, dtype=torch.float64)
    y = torch.randint(0, 5, (3, 12))
    mlp_batches = [((x[i],), y[i]) for i in range(3)]
    for name, c in (("mlp dp4", ah.Constraints(dp=4)), ("mlp tp2xdp2", ah.Constraints(dp=2, tp=2)),
                    ("mlp dp4 zero3", ah.Constraints(dp=4, zero=3))):
        _check(fails, name, copy.deepcopy(mlp), mlp_batches, world, F.cross_entropy, c)
    gpt = zoo_model("gpt-tiny").double()
    lm_batches = zoo_batches("gpt-tiny", 8, steps=3)
    for name, c, opt in (("gpt tp4", ah.Constraints(tp=4), "adamw"),
                         ("gpt pp2xdp2", ah.Constraints(pp=2, dp=2, num_microbatches=2), "sgd")):
        _check(fails, name, copy.deepcopy(gpt), lm_batches, world, lm_loss, c, opt)
    # Hugging Face GPT-2 computing its own (shifted) loss from labels=: statistics by a
    # stats_fn that shifts alike (float32, as its loss casts the logits)
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=96, n_positions=16,
                        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, use_cache=False,
                        bos_token_id=0, eos_token_id=0)
    _check(fails, "HF GPT2 labels= tp2xdp2", GPT2LMHeadModel(config).float(), lm_batches,
           world, None, ah.Constraints(dp=2, tp=2),
           stats_fn=lambda logits, t: sample_stats(logits[:, :-1], t[:, 1:]),
           eager_loss=lambda m, i, t: m(input_ids=i[0], labels=t).loss, tol=1e-4)
    return list(fails)


@pytest.mark.procs
@pytest.mark.timeout(420)
def test_per_sample_statistics_of_the_training_forward_equal_eager_under_every_layout():
    results = pool_launch(_ranks, 4, args=(4,), timeout_s=guard(400))
    assert not any(results), results


# ---------------------------------------------------------------------------- no processes
def test_statistics_refuse_a_language_model_that_shifts_its_own_labels():
    with pytest.raises(CaptureError, match="stats_fn"):
        StatsLoss(None).stats(torch.zeros(2, 4, 7), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(CaptureError, match="one target tensor"):
        StatsLoss(F.cross_entropy).stats(torch.zeros(2, 7), (torch.zeros(2), torch.zeros(2)))
    shifted = StatsLoss(None, lambda logits, t: sample_stats(logits[:, :-1], t[:, 1:]))
    out = shifted.stats(torch.zeros(2, 4, 7), torch.zeros(2, 4, dtype=torch.long))
    assert out.shape == (2, 3) and torch.allclose(out[:, 2], torch.full((2,), 1 / 7))


def test_a_compiled_classifier_records_eager_statistics_in_its_training_forward():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    x, y = torch.randn(12, 8), torch.randint(0, 5, (12,))
    compiled = ah.compile(model, ah.Cluster.local(1), (x,), loss_fn=F.cross_entropy,
                          example_targets=y)
    compiled.record_sample_stats()
    expected = _stats(model(x).detach(), y)
    compiled.train_step(x, y)
    assert torch.equal(compiled.last_sample_stats, expected)
    compiled.record_sample_stats(enabled=False)
    compiled.train_step(x, y)
    assert compiled.last_sample_stats is None
