"""`compiled.fit(dataset, sampler=ah.data.HidingSampler(...), shuffle=ah.data.PartialShuffle(...))`
on 4 gloo ranks (autohybrid/data/fit.py).

- Exact: under dp2×tp2, fit with hiding and partial shuffling trains what a plain eager
  loop over the same parts trains — every loss, the statistics the sampler holds, the
  parts after every exchange, and the parameters at the end, under SGD with momentum
  (the learning rate scaled by 1/(1 − F_e)) — and a resume from its epoch checkpoint
  continues as the uninterrupted run. Under dp4, fit with distillation against the
  previous epoch's model trains what an eager distillation loop (F.kl_div) trains; under
  dp2×tp2, with impact factors and distillation, what an eager loop weighting each
  worker's samples by them trains, the factors equal to autograd's formula (and, on one
  rank, by central differences against autograd).
- Useful: on scikit-learn's bundled digits and on synthetic 10-class data, hiding
  (F = 0.3, τ = 0.7) trains at least 15 % fewer samples at held-out accuracy within 1
  point of training on all of them; on shards partitioned by class, partial shuffling
  with Q = 0.1 reaches the held-out accuracy of a global reshuffle (Q = 1) within 1 point.
- Refused, before anything trains: a shuffle of another worker count than dp, epochs
  missing, a sampler of another dataset size.
"""
from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autohybrid as ah
from _datasets import by_class, clusters, digits
from _limits import guard
from _pool import launch as pool_launch
from autohybrid.data import HidingSampler, PartialShuffle, sample_stats
from autohybrid.errors import TrainingArgumentError


def _sgd(ps):
    return torch.optim.SGD(ps, lr=0.1, momentum=0.9)


def _compile(model: nn.Module, x: torch.Tensor, y: torch.Tensor, constraints, optimizer=_sgd):
    return ah.compile(model, ah.Cluster.local(4), (x[:32],), loss_fn=F.cross_entropy,
                      example_targets=y[:32], optimizer=optimizer, constraints=constraints)


# ============================================================================ exact
def _eager_replay(model: nn.Module, x, y, sampler: HidingSampler, shuffle: PartialShuffle,
                  epochs: int, batch: int) -> list[dict]:
    """What fit(sampler=, shuffle=) must compute, by a plain loop on one process: every
    worker's visible samples in its local order, the workers' batches joined into the
    global one; statistics from the training forward; the hidden forward in eval mode.
    Per epoch: its losses, and after it the parts, the sampler's losses and the state."""
    opt, scale, out = _sgd(model.parameters()), 1.0, []
    per = batch // shuffle.workers
    for epoch in range(epochs):
        if epoch > 0:   # the exchange before this epoch
            shuffle.advance(epoch)
        sampler.set_epoch(epoch)
        for group in opt.param_groups:
            group["lr"] *= sampler.lr_scale(epoch) / scale
        scale = sampler.lr_scale(epoch)
        orders = [[i for i in shuffle.local_order(w) if not sampler.hidden[i]]
                  for w in range(shuffle.workers)]
        losses = []
        for s in range(min(map(len, orders)) // per):
            idx = torch.tensor([i for o in orders for i in o[s * per:(s + 1) * per]])
            logits = model(x[idx])
            sampler.record(idx, *sample_stats(logits, y[idx]))
            loss = F.cross_entropy(logits, y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        hidden = sampler.hidden_indices()
        model.eval()
        with torch.no_grad():
            sampler.record(hidden, *sample_stats(model(x[hidden]), y[hidden]))
        model.train()
        out.append({"losses": losses, "parts": [list(p) for p in shuffle.parts],
                    "recorded": sampler.loss.clone(), "hidden": sampler.hidden.clone(),
                    "state": copy.deepcopy(model.state_dict())})
    return out


def _but_the_last(rank: int, save_dir: str, result) -> str:
    """`save_dir`/run's checkpoints but the last, as `save_dir`/resume (rank 0 copies,
    every rank waits): what a job stopped one epoch early left."""
    if rank == 0:
        shutil.copytree(f"{save_dir}/run", f"{save_dir}/resume")
        shutil.rmtree(f"{save_dir}/resume/{Path(result.checkpoints[-1]).name}")
    torch.distributed.barrier()
    return f"{save_dir}/resume"


def _parts():
    return (HidingSampler(400, 32, fraction=0.3, threshold=0.7, seed=3, drop_last=True),
            PartialShuffle(400, 2, q=0.25, seed=5))


def _exact_rank(rank: int, world: int, save_dir: str) -> list[str]:
    problems: list[str] = []
    (xt, yt), _ = digits()
    x, y = xt[:400], yt[:400]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    ref = copy.deepcopy(model)
    compiled = _compile(model, x, y, ah.Constraints(dp=2, tp=2))
    sampler, shuffle = _parts()
    result = compiled.fit((x, y), epochs=3, sampler=sampler, shuffle=shuffle,
                          save_dir=f"{save_dir}/run", save_every=2, log_every=None)
    ref_sampler, ref_shuffle = _parts()
    replay = _eager_replay(ref, x, y, ref_sampler, ref_shuffle, 4, 32)

    def close(what, a, b, tol=1e-5):
        a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
        if a.shape != b.shape or not torch.allclose(a, b, atol=tol, rtol=tol):
            problems.append(f"rank {rank}: {what}: {a.flatten()[:6].tolist()} != "
                            f"{b.flatten()[:6].tolist()} (shapes {tuple(a.shape)}, "
                            f"{tuple(b.shape)})")

    def same_as_replay(what, compiled, fitted, epochs, sampler, shuffle):
        """`fitted` ran `epochs` (of the replay's) and ended where the replay's last did."""
        close(f"{what} losses", fitted.losses,
              [l for e in epochs for l in replay[e]["losses"]])
        end = replay[epochs[-1]]
        close(f"{what} recorded losses", sampler.loss, end["recorded"], 1e-4)
        if not torch.equal(sampler.hidden, end["hidden"]):
            problems.append(f"rank {rank}: {what}: hidden sets differ")
        if shuffle.parts != end["parts"]:
            problems.append(f"rank {rank}: {what}: the parts differ from the plan's")
        state = compiled.full_state_dict()
        for name, value in end["state"].items():
            close(f"{what} parameter {name}", state[name], value)

    same_as_replay("fit", compiled, result, [0, 1, 2], sampler, shuffle)
    hidden = [log["hidden"] for log in result.epochs_log]
    if hidden[0] != 0 or not any(hidden) or result.exchanged != 2 * 2 * 50:
        problems.append(f"rank {rank}: hidden per epoch {hidden}, exchanged "
                        f"{result.exchanged} (expected none hidden in warm-up, some after, "
                        "50 per worker before epochs 1 and 2)")
    if result.samples != sum(log["trained"] for log in result.epochs_log) or \
            result.samples != len(result.losses) * 32:
        problems.append(f"rank {rank}: {result.samples} samples counted for "
                        f"{len(result.losses)} steps of 32")
    # a new job resumes from the epoch-2 checkpoint and trains epoch 2 as the first did;
    # then a longer fit continues from the end of epoch 3 (its exchange not made ahead)
    torch.manual_seed(0)
    again = _compile(nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)), x, y,
                     ah.Constraints(dp=2, tp=2))
    s2, sh2 = _parts()
    resumed = again.fit((x, y), epochs=3, sampler=s2, shuffle=sh2,
                        save_dir=_but_the_last(rank, save_dir, result), resume=True,
                        log_every=None)
    if resumed.resumed_from is None or len(resumed.epochs_log) != 1:
        problems.append(f"rank {rank}: resume ran {len(resumed.epochs_log)} epochs from "
                        f"{resumed.resumed_from}")
    same_as_replay("resumed", again, resumed, [2], s2, sh2)
    more = again.fit((x, y), epochs=4, sampler=s2, shuffle=sh2,
                     save_dir=f"{save_dir}/resume", resume=True, log_every=None)
    same_as_replay("continued", again, more, [3], s2, sh2)
    return problems


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_fit_with_hiding_and_partial_shuffling_trains_exactly_what_an_eager_loop_does(tmp_path):
    results = pool_launch(_exact_rank, 4, args=(4, str(tmp_path)), timeout_s=guard(280))
    assert not any(results), results


def _distill_rank(rank: int, world: int) -> list[str]:
    """fit(sampler=, distill=) under dp4 against an eager loop: from epoch 1 on the loss is
    (1 − γ)·CE + γ·T²·KL against the logits the model gave (eval mode) at the end of the
    previous epoch, written here with F.kl_div; hidden samples' statistics come from that
    forward."""
    problems: list[str] = []
    (xt, yt), _ = digits()
    x, y = xt[:256], yt[:256]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    ref = copy.deepcopy(model)
    compiled = _compile(model, x, y, ah.Constraints(dp=4))
    gamma, t = 0.4, 3.0

    def sampler():
        return HidingSampler(256, 32, fraction=0.3, seed=4, drop_last=True)

    fitted = sampler()
    result = compiled.fit((x, y), epochs=3, sampler=fitted, log_every=None,
                          distill=ah.data.Distillation(gamma, t))
    eager, opt, teacher, losses, scale = sampler(), _sgd(ref.parameters()), None, [], 1.0
    for epoch in range(3):
        eager.set_epoch(epoch)
        for group in opt.param_groups:
            group["lr"] *= eager.lr_scale(epoch) / scale
        scale = eager.lr_scale(epoch)
        for batch in eager:
            idx = torch.tensor(batch)
            logits = ref(x[idx])
            eager.record(idx, *sample_stats(logits, y[idx]))
            loss = F.cross_entropy(logits, y[idx])
            if teacher is not None:
                kl = F.kl_div(F.log_softmax(logits / t, -1), F.log_softmax(teacher[idx] / t, -1),
                              log_target=True, reduction="none").sum(-1).mean()
                loss = (1 - gamma) * loss + gamma * t * t * kl
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        ref.eval()
        with torch.no_grad():
            teacher = ref(x)
            hidden = eager.hidden_indices()
            eager.record(hidden, *sample_stats(teacher[hidden], y[hidden]))
        ref.train()
    got, want = torch.tensor(result.losses), torch.tensor(losses)
    if got.shape != want.shape or not torch.allclose(got, want, atol=1e-5, rtol=1e-5):
        problems.append(f"rank {rank}: losses {got[:5].tolist()} != {want[:5].tolist()}")
    if not torch.allclose(fitted.loss, eager.loss, atol=1e-4, equal_nan=True):
        problems.append(f"rank {rank}: recorded statistics differ")
    state = compiled.full_state_dict()
    for name, value in ref.state_dict().items():
        if not torch.allclose(state[name], value, atol=1e-5, rtol=1e-5):
            problems.append(f"rank {rank}: parameter {name} differs")
    if [log["distilled"] for log in result.epochs_log] != [False, True, True] or \
            result.forwarded != 3 * 256:
        problems.append(f"rank {rank}: distilled {result.epochs_log}, forwarded "
                        f"{result.forwarded}")
    compiled.train_step(x[:32], y[:32])   # after fit: the compiled loss again
    return problems


@pytest.mark.procs
@pytest.mark.timeout(200)
def test_fit_with_distillation_trains_what_an_eager_distillation_loop_does():
    results = pool_launch(_distill_rank, 4, args=(4,), timeout_s=guard(180))
    assert not any(results), results


def _impact_rank(rank: int, world: int, save_dir: str) -> list[str]:
    """fit(shuffle=, impact=, distill=) under dp2×tp2 against an eager loop that trains
    each worker's samples with weight M·α_w (α as fit logged it, checked against the
    autograd formula at the same parameters) and distils from epoch 1 on; then a new job
    resumed from its epoch-2 checkpoint (teacher, factors, parts restored) trains epoch 2
    as it did."""
    problems: list[str] = []
    (xt, yt), _ = digits()
    x, y = xt[:400], yt[:400]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    ref = copy.deepcopy(model)
    compiled = _compile(model, x, y, ah.Constraints(dp=2, tp=2, zero=0))
    impact, gamma, t = ah.data.ImpactFactors(shared=32, seed=1), 0.3, 2.0

    def parts():
        return PartialShuffle(400, 2, q=0.1, partition=by_class(y, 2), seed=6)

    def run(compiled, where, resume=False):
        return compiled.fit((x, y), epochs=3, shuffle=parts(), batch_size=32, impact=impact,
                            distill=ah.data.Distillation(gamma, t), log_every=None,
                            save_dir=where, save_every=2, resume=resume)

    result = run(compiled, f"{save_dir}/run")
    shuffle, opt, teacher, losses = parts(), _sgd(ref.parameters()), None, []
    shared = impact.shared_indices(400)
    for epoch in range(3):
        if epoch > 0:
            shuffle.advance(epoch)
        orders = [shuffle.local_order(w) for w in range(2)]
        alpha = result.epochs_log[epoch]["impact"]
        if epoch == 0:
            if alpha is not None:
                problems.append(f"rank {rank}: impact factors in epoch 0: {alpha}")
            alpha = [0.5, 0.5]
        else:
            exact = _exact_impact(ref, x, y, shared, [o[:16] for o in orders], 0.1)
            if not torch.allclose(torch.tensor(alpha), exact, atol=2e-3):
                problems.append(f"rank {rank}: epoch {epoch} factors {alpha} != {exact}")
        for s in range(min(map(len, orders)) // 16):
            idx = torch.tensor([i for o in orders for i in o[s * 16:(s + 1) * 16]])
            weight = torch.tensor([2 * alpha[w] for w in range(2) for _ in range(16)])
            logits = ref(x[idx])
            per = F.cross_entropy(logits, y[idx], reduction="none")
            if teacher is not None:
                kl = F.kl_div(F.log_softmax(logits / t, -1), F.log_softmax(teacher[idx] / t, -1),
                              log_target=True, reduction="none").sum(-1)
                per = (1 - gamma) * per + gamma * t * t * kl
            loss = (weight * per).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        ref.eval()
        with torch.no_grad():
            teacher = ref(x)
        ref.train()
    got, want = torch.tensor(result.losses), torch.tensor(losses)
    if got.shape != want.shape or not torch.allclose(got, want, atol=1e-4, rtol=1e-4):
        problems.append(f"rank {rank}: losses {got[:5].tolist()} != {want[:5].tolist()}")
    state = compiled.full_state_dict()
    for name, value in ref.state_dict().items():
        if not torch.allclose(state[name], value, atol=1e-4, rtol=1e-4):
            problems.append(f"rank {rank}: parameter {name} differs by "
                            f"{(state[name] - value).abs().max():.2e}")
    torch.manual_seed(0)
    again = _compile(nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)), x, y,
                     ah.Constraints(dp=2, tp=2, zero=0))
    resumed = run(again, _but_the_last(rank, save_dir, result), resume=True)
    tail = result.losses[-len(resumed.losses):]
    if resumed.resumed_from is None or resumed.epochs_log[0]["impact"] != \
            result.epochs_log[2]["impact"] or not torch.allclose(
                torch.tensor(resumed.losses), torch.tensor(tail), atol=1e-6):
        problems.append(f"rank {rank}: resumed epoch 2 {resumed.losses[:3]} "
                        f"{resumed.epochs_log[0]['impact']} != {tail[:3]} "
                        f"{result.epochs_log[2]['impact']}")
    again_state = again.full_state_dict()
    for name, value in state.items():
        if not torch.allclose(again_state[name], value, atol=1e-6):
            problems.append(f"rank {rank}: resumed {name} differs")
    return problems


@pytest.mark.procs
@pytest.mark.timeout(200)
def test_fit_with_impact_factors_weights_each_workers_samples_as_an_eager_loop_does(tmp_path):
    results = pool_launch(_impact_rank, 4, args=(4, str(tmp_path)), timeout_s=guard(180))
    assert not any(results), results


# ============================================================================ useful
def _accuracy(compiled, x, y) -> float:
    compiled.model.eval()
    with torch.no_grad():
        return (compiled(x).argmax(-1) == y).double().mean().item()


def _hiding_run(data, fraction: float, epochs: int, lr: float) -> tuple[int, float]:
    (xt, yt), (xv, yv) = data
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(xt.shape[1], 64), nn.ReLU(), nn.Linear(64, 10))
    compiled = _compile(model, xt, yt, ah.Constraints(dp=4),
                        lambda ps: torch.optim.SGD(ps, lr=lr, momentum=0.9))
    sampler = HidingSampler(len(xt), 64, fraction=fraction, milestones=(epochs - 4,),
                            seed=1, drop_last=True)
    result = compiled.fit((xt, yt), epochs=epochs, sampler=sampler, log_every=None)
    return result.samples, _accuracy(compiled, xv, yv)


def _shuffle_run(data, q: float, epochs: int) -> float:
    (xt, yt), (xv, yv) = data
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(xt.shape[1], 64), nn.BatchNorm1d(64), nn.ReLU(),
                          nn.Linear(64, 10))
    compiled = _compile(model, xt, yt, ah.Constraints(dp=4),
                        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9))
    shuffle = PartialShuffle(len(xt), 4, q, partition=by_class(yt, 4), seed=2)
    compiled.fit((xt, yt), epochs=epochs, shuffle=shuffle, batch_size=64, log_every=None)
    return _accuracy(compiled, xv, yv)


def _useful_rank(rank: int, world: int) -> dict:
    out = {}
    for name, data, epochs, lr in (("digits", digits(), 8, 0.1),
                                   ("clusters", (clusters(1, 1600), clusters(2, 1000)), 8,
                                    0.05)):
        out[name] = {"all": _hiding_run(data, 0.0, epochs, lr),
                     "hiding": _hiding_run(data, 0.3, epochs, lr)}
    out["shuffle"] = {q: _shuffle_run(digits(), q, 6) for q in (1.0, 0.1)}
    return out


@pytest.mark.procs
@pytest.mark.timeout(400)
def test_hiding_trains_fewer_samples_at_the_same_accuracy_and_partial_shuffling_keeps_it():
    results = pool_launch(_useful_rank, 4, args=(4,), timeout_s=guard(380))
    assert all(r == results[0] for r in results), results   # every rank the same figures
    figures = results[0]
    for name in ("digits", "clusters"):
        (everything, baseline), (hiding, accuracy) = (figures[name]["all"],
                                                      figures[name]["hiding"])
        assert hiding <= 0.85 * everything, (name, hiding, everything)
        assert accuracy >= baseline - 0.01 and baseline > 0.85, (name, accuracy, baseline)
    shuffled = figures["shuffle"]
    assert shuffled[0.1] >= shuffled[1.0] - 0.01 and shuffled[1.0] > 0.9, shuffled


# ============================================================================ refused
def test_fit_refuses_data_parts_that_do_not_fit_the_plan_before_training():
    (xt, yt), _ = digits()
    x, y = xt[:64], yt[:64]
    compiled = ah.compile(nn.Linear(64, 10), ah.Cluster.local(1), (x[:8],),
                          loss_fn=F.cross_entropy, example_targets=y[:8],
                          optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    with pytest.raises(TrainingArgumentError, match="workers=1"):
        compiled.fit((x, y), epochs=1, shuffle=PartialShuffle(64, 2), batch_size=8)
    with pytest.raises(TrainingArgumentError, match="epochs must be"):
        compiled.fit((x, y), sampler=HidingSampler(64, 8))
    with pytest.raises(TrainingArgumentError, match="dataset holds 64"):
        compiled.fit((x, y), epochs=1, sampler=HidingSampler(60, 8))
    with pytest.raises(TrainingArgumentError, match="not steps"):
        compiled.fit((x, y), steps=3, sampler=HidingSampler(64, 8))
    with pytest.raises(TrainingArgumentError, match="go with sampler"):
        compiled.fit([((x,), y)], batch_size=8)
    assert compiled.step == 0


def _exact_impact(model: nn.Module, x, y, shared, probes, lr: float) -> torch.Tensor:
    """The impact factors by autograd: ℓ_w = L_S − η·⟨∇L_S, ∇L_w⟩, α ∝ 1/ℓ_w (eval mode
    for the probes, as fit measures them)."""
    params = [p for p in model.parameters()]
    loss_s = F.cross_entropy(model(x[shared]), y[shared])
    g_s = torch.autograd.grad(loss_s, params)
    model.eval()
    lookahead = []
    for probe in probes:
        idx = torch.tensor(probe)
        g_w = torch.autograd.grad(F.cross_entropy(model(x[idx]), y[idx]), params)
        dot = sum((a * b).sum() for a, b in zip(g_s, g_w))
        lookahead.append(loss_s.detach() - lr * dot)
    model.train()
    inverse = 1.0 / torch.stack(lookahead).double()
    return (inverse / inverse.sum()).float()


def test_impact_factors_by_central_differences_equal_autograd_ones():
    """ah.data.ImpactFactors' factors (data/remedies.py) against the same formula by
    autograd, on one rank: three class-skewed probe batches, a shared batch."""
    from autohybrid.data.fit import Samples
    from autohybrid.data.remedies import impact_factors

    (xt, yt), _ = digits()
    x, y = xt[:200], yt[:200]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    ref = copy.deepcopy(model)
    compiled = ah.compile(model, ah.Cluster.local(1), (x[:32],), loss_fn=F.cross_entropy,
                          example_targets=y[:32],
                          optimizer=lambda ps: torch.optim.SGD(ps, lr=5.0))
    by = by_class(y, 3)
    probes = [part[:16] for part in by]
    shared = torch.arange(100, 164)
    got = impact_factors(compiled, Samples((x, y)), shared, probes, 1e-2)
    want = _exact_impact(ref, x, y, shared, probes, 5.0)
    assert got.shape == (3,) and abs(float(got.sum()) - 1.0) < 1e-5, got
    # central differences of a ReLU network (steps of 1 % of the parameters' norm cross
    # a few kinks): 1e-3 here, 3e-4 at steps of 1e-4 in float64
    assert torch.allclose(got, want, atol=2e-3), (got, want)
    assert float(want.max() - want.min()) > 0.01, want   # the workers differ: a real check
    state = compiled.full_state_dict()   # the parameters are back where they were
    for name, value in ref.state_dict().items():
        assert torch.allclose(state[name], value, atol=1e-6), name
