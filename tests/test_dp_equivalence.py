"""Data-parallel training through `ah.compile` equals single-process eager training.

DESIGN.md, "The rule that every part obeys": every plan `ah.compile` runs trains to the
same losses, gradients and parameters (buffers included) as eager PyTorch on the whole
global batch. Each test runs its cases inside one `ah.launch` (see tests/_equiv.py); every
rank trains the compiled model and, independently, an eager float64 copy on the full
batch, and returns its mismatches. SGD shows a gradient off by a constant factor, AdamW
the optimizer-state path.
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autohybrid as ah
from _limits import guard
from _pool import launch as pool_launch
from _equiv import (OPTIMIZERS, ZOO, Failures, compare_training, default_eager_loss,
                    eager_step, grads_of, head, live_children, lm_loss, record_pid, report,
                    shard_sizes, state_of, train_and_compare, wait_dead, zoo_batches, zoo_loss,
                    zoo_model)

REPO = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = guard(100)  # below every test timeout: launch then cleans up and says why
# where a test resets the model's own weights and optimizer (ZeRO would step shards)
DATA_PARALLEL = ah.Constraints(tp=1, pp=1, zero=0)


@pytest.fixture(scope="module", autouse=True)
def _warm_capture():
    """Capture once in this process, so forked ranks start with torch.export warmed up
    (its first use costs about a second in every process); speed only."""
    import transformers  # noqa: F401  (imported once here rather than in every rank)
    from autohybrid.capture import capture
    (x,), y = zoo_batches("mlp-tiny", 4, steps=1)[0]
    capture(zoo_model("mlp-tiny"), (x,), F.cross_entropy, y)


def _launch(fn, world: int, *args):
    return pool_launch(fn, world, args=(world, *args),
                     timeout_s=LAUNCH_TIMEOUT_S)


def _assert_no_failures(results) -> None:
    assert not any(results), report(results)


# ============================================================================ the zoo
def _zoo_rank(rank: int, world: int) -> list[str]:
    """Each model is compiled once, with the AdamW factory, and trained 3 steps; then its
    weights and buffers are reset in place and `compiled.optimizer` is replaced by plain
    SGD for 3 more steps (a compile is what costs time here, not a step)."""
    fails = Failures()
    for name in ZOO:
        batches = zoo_batches(name, 8)
        initial = zoo_model(name)
        model = copy.deepcopy(initial)
        case = f"{name}/adamw/dp{world}"
        compiled, ref = train_and_compare(fails, case, model, batches, world,
                                          loss_fn=zoo_loss(name), optimizer=OPTIMIZERS["adamw"],
                                          constraints=DATA_PARALLEL)
        fails.check(f"{case}: plan is {compiled.plan.mesh.describe()}, not dp={world}",
                    compiled.plan.mesh.dp == world)
        model.load_state_dict(initial.state_dict())
        compiled.optimizer = OPTIMIZERS["sgd"](list(model.parameters()))
        ref = copy.deepcopy(initial)
        case = f"{name}/sgd/dp{world}"
        compare_training(fails, case, compiled, ref, OPTIMIZERS["sgd"](list(ref.parameters())),
                         batches, default_eager_loss(zoo_loss(name)))
        # forward only: the full output on every rank (train mode: BatchNorm uses, and
        # updates, the statistics of the whole batch), then eval mode
        (x,), _ = zoo_batches(name, 8, steps=1)[0]
        fails.close(f"{case} forward (train mode)", compiled((x,)), ref(x).detach())
        fails.close_dict(f"{case} state after forward", compiled.full_state_dict(),
                         state_of(ref))
        if name in ("mlp-tiny", "resnet-tiny"):
            compiled.model.eval()
            ref.eval()
            fails.close(f"{case} forward (eval mode)", compiled((x,)), ref(x).detach())
    return fails


@pytest.mark.procs
@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 4])
def test_zoo_sgd_and_adamw_match_eager(world):
    """mlp, gpt, llama, resnet (BatchNorm) × SGD, AdamW: 3 steps, every rank. (One rank:
    the matrix's 1-rank case, and the in-process compiles of the fast tier.)"""
    _assert_no_failures(_launch(_zoo_rank, world))


# ============================================================================ torchrun
@pytest.mark.procs
@pytest.mark.timeout(120)
def test_torchrun_gpt_tiny_matches_eager():
    """The same script runs unchanged under torchrun (launch detects it)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    env.pop("AUTOHYBRID_LAUNCHED", None)
    script = REPO / "tests" / "scripts" / "dp_torchrun_gpt.py"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(script)], env=env, cwd=REPO, capture_output=True, text=True, timeout=guard(100))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "rank 0 of 2: equal to eager" in out and "rank 1 of 2: equal to eager" in out, out


# ============================================================================ training options
def _padded_lm_batches(name: str, batch: int, pads: list[int], steps: int = 3,
                       ignore_index: int = -100):
    """LM batches whose row i ends in `pads[i]` ignored targets (padding)."""
    out = []
    for (x,), y in zoo_batches(name, batch, steps):
        y = y.clone()
        for row, pad in enumerate(pads):
            if pad:
                y[row, -pad:] = ignore_index
        out.append(((x,), y))
    return out


def _decay_groups(params):
    """AdamW with weight decay on matrices only (the usual LM recipe)."""
    params = list(params)
    return torch.optim.AdamW([
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0, "lr": 2e-2},
    ], lr=1e-2)


class _PartlyFrozen(nn.Module):
    """An MLP with a frozen first layer and a layer the loss never uses."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(16, 32), nn.Linear(32, 8)
        self.unused = nn.Linear(4, 4)
        self.first.weight.requires_grad_(False)

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))


def _options_rank(rank: int, world: int) -> list[str]:
    fails = Failures()
    # Gradient accumulation: each rank splits its shard in two microbatches. gpt-tiny:
    # planned for 8 samples (2 per microbatch), trained on 10 (shards of 5: microbatches
    # of 3 and 2), padded so that every microbatch ignores a different count of targets.
    micro = ah.Constraints(num_microbatches=2)
    batches = _padded_lm_batches("gpt-tiny", 10, [0, 3, 16, 7, 1, 12, 0, 0, 5, 2])
    compiled, _ = train_and_compare(
        fails, "gpt-tiny/microbatches=2/sgd", zoo_model("gpt-tiny"), batches, world,
        loss_fn=lm_loss, constraints=micro, example=head(batches[0], 8))
    fails.check(f"microbatches: plan has {compiled.plan.num_microbatches}",
                compiled.plan.num_microbatches == 2)
    train_and_compare(fails, "mlp-tiny/microbatches=2/adamw", zoo_model("mlp-tiny"),
                      zoo_batches("mlp-tiny", 8), world, loss_fn=F.cross_entropy,
                      optimizer=OPTIMIZERS["adamw"], constraints=micro)

    # Gradient clipping inside train_step (SGD: AdamW would hide the scale); gpt-tiny's
    # tied embedding counts once in the norm.
    train_and_compare(fails, "gpt-tiny/max_grad_norm", zoo_model("gpt-tiny"),
                      zoo_batches("gpt-tiny", 8), world, loss_fn=lm_loss, max_grad_norm=0.1)

    # forward_backward + clip_grad_norm_ by hand: the same global norm as eager; the
    # middle step's limit is above the norm (nothing to clip).
    model = zoo_model("mlp-tiny")
    ref = copy.deepcopy(model)
    batches = zoo_batches("mlp-tiny", 8)
    compiled = ah.compile(model, ah.Cluster.local(world), batches[0][0], loss_fn=F.cross_entropy,
                          example_targets=batches[0][1], optimizer=OPTIMIZERS["sgd"])
    ref_opt = OPTIMIZERS["sgd"](list(ref.parameters()))
    for step, ((x,), y) in enumerate(batches):
        loss = compiled.forward_backward((x,), y)
        max_norm = (0.1, 1e3, 0.5)[step]
        norm = compiled.clip_grad_norm_(max_norm)
        compiled.optimizer.step()
        ref_opt.zero_grad()
        expected = F.cross_entropy(ref(x), y)
        expected.backward()
        expected_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        ref_opt.step()
        fails.close(f"forward_backward step {step} loss", loss, expected.detach())
        fails.close(f"clip_grad_norm_ step {step} norm", norm, expected_norm)
        fails.close_dict(f"clip_grad_norm_ step {step} grads", compiled.full_grads(),
                         grads_of(ref))
        fails.close_dict(f"clip_grad_norm_ step {step} state", compiled.full_state_dict(),
                         state_of(ref))

    # Frozen and unused parameters get no gradient, as in eager; AdamW's weight decay
    # must then leave them alone.
    # Under ZeRO-1/2 too (the reducer's buckets carry zeros for them, their shards get
    # no gradient), with two microbatches (ZeRO-2 collects after each).
    for zero in (0, 1, 2):
        torch.manual_seed(0)
        train_and_compare(fails, f"frozen + unused params/adamw/zero{zero}",
                          _PartlyFrozen().double(), zoo_batches("mlp-tiny", 8), world,
                          loss_fn=F.cross_entropy, optimizer=OPTIMIZERS["adamw"],
                          constraints=ah.Constraints(zero=zero, tp=1, pp=1,
                                                     num_microbatches=2 if zero else None))

    # Parameter groups from the factory, and an LR scheduler on compiled.optimizer.
    sched = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    compiled, ref = train_and_compare(
        fails, "gpt-tiny/param groups+scheduler", zoo_model("gpt-tiny"),
        zoo_batches("gpt-tiny", 8), world, loss_fn=lm_loss, optimizer=_decay_groups,
        scheduler=sched)
    lrs = [g["lr"] for g in compiled.optimizer.param_groups]
    fails.check(f"scheduler did not act on compiled.optimizer (lrs {lrs})",
                lrs == [1e-2 * 0.5 ** 3, 2e-2 * 0.5 ** 3])
    return fails


@pytest.mark.procs
@pytest.mark.timeout(180)
def test_accumulation_clipping_param_groups_scheduler_match_eager():
    _assert_no_failures(_launch(_options_rank, 2))


# ============================================================================ losses
class _Weighted:
    """Weighted cross-entropy; the weight is built on each rank from a fixed seed."""

    def __init__(self, classes: int, **kw):
        g = torch.Generator().manual_seed(7)
        self.weight = torch.rand(classes, generator=g, dtype=torch.float64) + 0.5
        self.kw = kw

    def __call__(self, out, target):
        return F.cross_entropy(out, target, weight=self.weight, **self.kw)


def _mlp_class_batches(batch: int, ignore_rows: list[int] = (), ignore_index: int = -100):
    out = []
    for (x,), y in zoo_batches("mlp-tiny", batch):
        y = y.clone()
        y[list(ignore_rows)] = ignore_index
        out.append(((x,), y))
    return out


def _mlp_float_batches(batch: int, kind: str = "regression"):
    g = torch.Generator().manual_seed(3)
    out = []
    for (x,), _ in zoo_batches("mlp-tiny", batch):
        if kind == "probs":
            y = torch.softmax(torch.randn(batch, 8, generator=g, dtype=torch.float64), -1)
        elif kind == "binary":
            y = (torch.rand(batch, 8, generator=g) > 0.5).double()
        else:
            y = torch.randn(batch, 8, generator=g, dtype=torch.float64)
        out.append(((x,), y))
    return out


def _losses_rank(rank: int, world: int) -> list[str]:
    """10 samples on 4 ranks: shards of 3, 3, 2, 2."""
    fails = Failures()
    n = 10
    fails.check(f"shard sizes {shard_sizes(n, world)}", shard_sizes(n, world) == [3, 3, 2, 2])
    # Padding: the shards ignore 3+0+16, 7+1+12, 0+2, 32 (all) of their 48, 48, 32, 32.
    pads = [3, 0, 16, 7, 1, 12, 0, 2, 16, 16]
    cases = [
        ("gpt-tiny", "CE(logits.transpose(1, 2)) ignore_index=-100 (padding)",
         lambda o, t: F.cross_entropy(o.transpose(1, 2), t),
         _padded_lm_batches("gpt-tiny", n, pads)),
        ("mlp-tiny", "CE ignore_index=3", lambda o, t: F.cross_entropy(o, t, ignore_index=3),
         _mlp_class_batches(n, [0, 5], ignore_index=3)),
        ("mlp-tiny", "CE label_smoothing + ignored",
         lambda o, t: F.cross_entropy(o, t, label_smoothing=0.1), _mlp_class_batches(n, [3, 4])),
        ("mlp-tiny", "weighted CE + ignored", _Weighted(8), _mlp_class_batches(n, [0, 2, 3, 8])),
        ("mlp-tiny", "weighted CE + label_smoothing + ignored",
         _Weighted(8, label_smoothing=0.2), _mlp_class_batches(n, [1, 6])),
        ("mlp-tiny", "CE reduction=sum", lambda o, t: F.cross_entropy(o, t, reduction="sum"),
         _mlp_class_batches(n, [4])),
        ("mlp-tiny", "CE probability targets", F.cross_entropy, _mlp_float_batches(n, "probs")),
        ("mlp-tiny", "nll_loss(log_softmax)",
         lambda o, t: F.nll_loss(F.log_softmax(o, -1), t), _mlp_class_batches(n, [9])),
        ("mlp-tiny", "mse_loss", F.mse_loss, _mlp_float_batches(n)),
        ("mlp-tiny", "0.5 * mse_loss", lambda o, t: 0.5 * F.mse_loss(o, t), _mlp_float_batches(n)),
        ("mlp-tiny", "mse_loss / 4", lambda o, t: F.mse_loss(o, t) / 4, _mlp_float_batches(n)),
        ("mlp-tiny", "BCE with logits", F.binary_cross_entropy_with_logits,
         _mlp_float_batches(n, "binary")),
        ("mlp-tiny", "((o - t) ** 2).mean()", lambda o, t: ((o - t) ** 2).mean(),
         _mlp_float_batches(n)),
        ("mlp-tiny", "(o - t).abs().sum()", lambda o, t: (o - t).abs().sum(),
         _mlp_float_batches(n)),
        ("mlp-tiny", "per-sample mean, then .mean()", lambda o, t: ((o - t) ** 2).mean(-1).mean(),
         _mlp_float_batches(n)),
        ("resnet-tiny", "CE (BatchNorm, uneven shards)", F.cross_entropy,
         zoo_batches("resnet-tiny", n)),
    ]
    for name, what, loss_fn, batches in cases:  # planned for 8 samples, trained on 10
        train_and_compare(fails, f"{name}/{what}", zoo_model(name), batches, world,
                          loss_fn=loss_fn, example=head(batches[0], 8))

    # A loss that combines samples before its final reduction does not split over
    # shards: pinned to dp, compile must refuse it rather than train to other numbers;
    # unconstrained, it chooses a plan that does not split the batch (the passes reject
    # the faster dp ones) and trains like eager.
    mixing = lambda o, t: ((o - t) ** 2).mean(0).sum()  # noqa: E731
    batches = _mlp_float_batches(8)
    (x,), y = batches[0]
    try:
        ah.compile(zoo_model("mlp-tiny"), ah.Cluster.local(world), (x,), example_targets=y,
                   loss_fn=mixing, constraints=DATA_PARALLEL)
        fails.append(f"loss .mean(0).sum() (mixes samples) compiled for dp={world} without "
                     "error")
    except ah.PlanError as exc:
        fails.check(f"mixing loss refused without naming the cause: {exc}",
                    "no batch dimension" in str(exc))
    compiled, _ = train_and_compare(fails, "mlp-tiny/.mean(0).sum() unconstrained",
                                    zoo_model("mlp-tiny"), batches, world, loss_fn=mixing)
    fails.check(f"mixing loss planned {compiled.plan.mesh.describe()} × "
                f"{compiled.plan.num_microbatches} microbatches: it splits the batch",
                compiled.plan.mesh.dp * compiled.plan.num_microbatches == 1)

    # forward only on uneven shards: the full batch, in order, on every rank
    model = zoo_model("mlp-tiny")
    (x,), y = zoo_batches("mlp-tiny", n, steps=1)[0]
    compiled = ah.compile(model, ah.Cluster.local(world), (x[:8],), constraints=DATA_PARALLEL)
    fails.close("mlp-tiny forward, 10 samples on 4 ranks", compiled((x,)),
                zoo_model("mlp-tiny")(x).detach())

    # local=True with compiled.local_slice(...) is the global call
    expected = shard_sizes(n, world)[rank]
    global_model, local_model = zoo_model("mlp-tiny"), zoo_model("mlp-tiny")
    batches = _mlp_class_batches(n, [2, 7])
    (x8,), y8 = head(batches[0], 8)
    c_global = ah.compile(global_model, ah.Cluster.local(world), (x8,), loss_fn=F.cross_entropy,
                          example_targets=y8, optimizer=OPTIMIZERS["adamw"],
                          constraints=DATA_PARALLEL)
    c_local = ah.compile(local_model, ah.Cluster.local(world), (x8,), loss_fn=F.cross_entropy,
                         example_targets=y8, optimizer=OPTIMIZERS["adamw"],
                         constraints=DATA_PARALLEL)
    ref = zoo_model("mlp-tiny")
    ref_opt = OPTIMIZERS["adamw"](list(ref.parameters()))
    for step, ((x,), y) in enumerate(batches):
        lx, ly = c_local.local_slice(x), c_local.local_slice(y)
        lx2, ly2 = c_local.local_slice((x, y))
        fails.check(f"local_slice gave {len(lx)} samples on rank {rank}, not {expected}",
                    len(lx) == len(ly) == expected)
        fails.check("local_slice of a tuple differs", torch.equal(lx, lx2) and torch.equal(ly, ly2))
        fails.check(f"local_slice is not rank {rank}'s torch.tensor_split chunk",
                    torch.equal(lx, torch.tensor_split(x, world)[rank]))
        loss_local = c_local.train_step((lx,), ly, local=True)
        loss_global = c_global.train_step((x,), y)
        loss_eager = eager_step(ref, ref_opt, lambda m, i, t: F.cross_entropy(m(*i), t), (x,), y)
        fails.close(f"local=True step {step} loss vs global", loss_local, loss_global)
        fails.close(f"local=True step {step} loss vs eager", loss_local, loss_eager)
        fails.close_dict(f"local=True step {step} grads", c_local.full_grads(), grads_of(ref))
        fails.close_dict(f"local=True step {step} state", c_local.full_state_dict(),
                         state_of(ref))
        fails.close_dict(f"local=True step {step} state vs global", c_local.full_state_dict(),
                         c_global.full_state_dict())
    return fails


@pytest.mark.procs
@pytest.mark.timeout(180)
def test_losses_uneven_batch_forward_and_local_slices_match_eager():
    """Every loss reduction autohybrid splits, on 10 samples over 4 ranks (3, 3, 2, 2)."""
    _assert_no_failures(_launch(_losses_rank, 4))


# ============================================================================ loss_fn=None
class NanoGPT(nn.Module):
    """nanoGPT's interface around gpt-tiny: forward(idx, targets=None) -> (logits, loss)."""

    def __init__(self):
        super().__init__()
        self.gpt = ah.models.preset("gpt-tiny")

    def forward(self, idx, targets=None):
        logits = self.gpt(idx)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                                   ignore_index=-1)
        return logits, loss


def _hf_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=96, n_positions=16,
                        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, use_cache=False,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).double()


def _model_loss_rank(rank: int, world: int) -> list[str]:
    fails = Failures()
    pads = [0, 4, 0, 16, 2, 9, 0, 1]
    torch.manual_seed(0)
    nano = NanoGPT().double()
    batches = _padded_lm_batches("gpt-tiny", 8, pads, ignore_index=-1)
    train_and_compare(fails, "nanoGPT (logits, loss)", nano, batches, world, loss_fn=None,
                      optimizer=OPTIMIZERS["adamw"], eager_loss=lambda m, i, t: m(*i, t)[1])
    # Hugging Face: targets go to `labels=`; captured at the first step (no example).
    torch.manual_seed(0)
    hf = _hf_gpt2()
    hf_batches = _padded_lm_batches("gpt-tiny", 8, pads)
    train_and_compare(fails, "HF GPT2LMHeadModel labels=", hf, hf_batches, world, loss_fn=None,
                      optimizer=OPTIMIZERS["sgd"], example_targets=False,
                      eager_loss=lambda m, i, t: m(input_ids=i[0], labels=t).loss)
    return fails


@pytest.mark.procs
@pytest.mark.timeout(180)
def test_models_that_return_their_loss_match_eager():
    """loss_fn=None: nanoGPT-style (logits, loss), and Hugging Face GPT-2 with labels=."""
    _assert_no_failures(_launch(_model_loss_rank, 2))


def _mistral_rank(rank: int, world: int) -> list[str]:
    """Hugging Face Mistral (tiny config) under dp: its causal mask indexes position ids
    by `arange(batch)` and takes `new_ones` of the result, which the batch analysis once
    refused. Compiled once with AdamW, then reset and stepped with SGD (as the zoo).

    Mistral computes its loss in float32 (`logits.float()`), so gradients match eager to
    float32 precision (~1e-8 here, dp = 1 alike); Adam's g / (|g| + eps) scales such an
    error by up to lr / eps, so eps is raised to compare at float64's tolerances."""
    from autohybrid.models import coverage

    fails = Failures()
    case = coverage.build("mistral")
    initial = copy.deepcopy(case.model)
    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.05, eps=1e-2)  # noqa: E731
    compiled, _ = train_and_compare(fails, f"mistral/adamw/dp{world}", case.model,
                                    case.batches, world, loss_fn=None, optimizer=adamw,
                                    eager_loss=case.eager_loss, constraints=DATA_PARALLEL)
    fails.check(f"mistral: plan is {compiled.plan.mesh.describe()}, not dp={world}",
                compiled.plan.mesh.dp == world)
    case.model.load_state_dict(initial.state_dict())
    compiled.optimizer = OPTIMIZERS["sgd"](list(case.model.parameters()))
    ref = copy.deepcopy(initial)
    compare_training(fails, f"mistral/sgd/dp{world}", compiled, ref,
                     OPTIMIZERS["sgd"](list(ref.parameters())), case.batches, case.eager_loss)
    return fails


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_mistral_causal_mask_trains_like_eager_under_dp():
    pytest.importorskip("transformers")
    _assert_no_failures(_launch(_mistral_rank, 2))


# ============================================================================ bucketing
def _bucket_rank(rank: int, world: int) -> dict:
    fails = Failures()
    compiled, _ = train_and_compare(fails, "gpt-tiny/bucket_mb=0.01", zoo_model("gpt-tiny"),
                                    zoo_batches("gpt-tiny", 8), world, loss_fn=lm_loss,
                                    constraints=ah.Constraints(bucket_mb=0.01, dp=2, zero=0))
    events = compiled.reducer_events
    return {"fails": fails, "bucket_mb": compiled.plan.bucket_mb,
            "buckets": len(compiled.executor.reducer.buckets),
            "events": [(e.bucket, e.time, e.pending_grads) for e in events],
            "backward_end": compiled.executor.last_backward_end,
            "params": sum(1 for p in compiled.model.parameters() if p.requires_grad)}


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_gradient_buckets_launch_during_backward():
    results = _launch(_bucket_rank, 2)
    _assert_no_failures([r["fails"] for r in results])
    for rank, r in enumerate(results):
        events = r["events"]
        assert r["bucket_mb"] == 0.01, r
        assert r["buckets"] >= 2 and len(events) == r["buckets"], (rank, r)
        assert sorted(e[0] for e in events) == list(range(r["buckets"])), (rank, events)
        first_bucket, first_time, first_pending = events[0]
        assert 0 < first_pending < r["params"], (rank, events)   # launched mid-backward
        assert first_time < r["backward_end"], (rank, events, r["backward_end"])
        pending = [e[2] for e in events]
        assert pending == sorted(pending, reverse=True), (rank, events)


# ============================================================================ failures
def _raise_on_rank1(rank: int, world: int, tmp: str) -> None:
    record_pid(tmp, rank)
    model = zoo_model("mlp-tiny")
    (x,), y = zoo_batches("mlp-tiny", 8, steps=1)[0]
    compiled = ah.compile(model, ah.Cluster.local(world), (x,), loss_fn=F.cross_entropy,
                          example_targets=y, optimizer=OPTIMIZERS["sgd"],
                          constraints=DATA_PARALLEL)  # the hook below is on the model's own
    compiled.train_step((x,), y)
    if rank == 1:  # fails inside the next step's backward; rank 0 waits in a collective

        def boom(grad):
            raise ValueError("boom from rank 1's backward")

        next(compiled.model.parameters()).register_hook(boom)
    compiled.train_step((x,), y)
    time.sleep(60)


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_rank_raising_in_train_step_is_reported_and_cleaned_up(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(ah.RankFailure) as info:
        ah.launch(_raise_on_rank1, ah.Cluster.local(2), args=(2, str(tmp_path)),
                  timeout_s=LAUNCH_TIMEOUT_S)   # launch's own clean-up, not warm ranks
    assert info.value.rank == 1
    assert "boom from rank 1's backward" in info.value.traceback_text
    assert time.monotonic() - t0 < 60
    pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
    assert len(pids) == 2
    assert wait_dead(pids) == []
    assert live_children(os.getpid()) == []
