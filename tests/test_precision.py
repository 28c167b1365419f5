"""Mixed precision: bf16/fp16 compute over fp32 master weights equals eager
`torch.autocast` training within the compute dtype's tolerance, and fp16 loss scaling
takes GradScaler's decisions step for step.

Each case compiles an fp32 zoo model with `dtype=torch.bfloat16` (or float16) and trains
it 3 steps next to an eager copy whose forward runs under `torch.autocast` (with a
`torch.amp.GradScaler` of the same settings for fp16), comparing the loss, the gathered
gradients and the parameters after every step: at dp 2 (with ZeRO), pp 2, tp 2 + sp,
and with the gradient reduction in bf16. fp16 cases start from a loss scale that
overflows, so the skipped steps, the back-off and the growth are exercised. One case at
pp 2 × dp 2 freezes the first stage's parameters: its ranks hold no gradient and no
trained parameter through fp16 loss scaling, clipping and local=True batches.
"""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import autohybrid as ah
from _limits import guard
from _pool import launch as pool_launch
from _equiv import Failures, grads_of, lm_loss, report, state_of
from autohybrid.errors import AutohybridError, NotExecutableError
from autohybrid.runtime.precision import LossScaler

LAUNCH_TIMEOUT_S = guard(300)
C = ah.Constraints
#: assert_close tolerances of values computed in each dtype (fp32 results of 16-bit math)
TOLERANCE = {torch.bfloat16: dict(rtol=2e-2, atol=2e-3),
             torch.float16: dict(rtol=5e-3, atol=5e-4)}
#: fp16 loss scaling that overflows at the first step, then backs off far enough to train
#: and grows after two clean steps
SCALER = dict(init_scale=2.0 ** 24, backoff_factor=2.0 ** -8, growth_interval=2)


def _loss(name: str):
    return F.cross_entropy if name == "mlp-tiny" else lm_loss


def _case(fails: Failures, world: int, name: str, dtype: torch.dtype, constraints,
          optimizer, steps: int = 3, frozen: tuple[str, ...] = (), clip: float | None = None,
          local: bool = False) -> Any:
    """`frozen`: prefixes of parameters made requires_grad=False; `clip`: max_grad_norm
    (eager: unscale_, clip_grad_norm_, step); `local`: each rank passes its own shard
    (train_step(..., local=True))."""
    torch.manual_seed(0)
    model = ah.models.preset(name)
    for n, p in model.named_parameters():
        p.requires_grad_(not n.startswith(frozen) if frozen else True)
    ref = copy.deepcopy(model)
    batches = [ah.models.example_batch(name, 8, seed=100 + s) for s in range(steps)]
    loss_fn = _loss(name)
    fp16 = dtype == torch.float16
    compiled = ah.compile(model, ah.Cluster.local(world), batches[0][0], loss_fn=loss_fn,
                          example_targets=batches[0][1], optimizer=optimizer,
                          constraints=constraints, dtype=dtype,
                          grad_scaler=torch.amp.GradScaler("cpu", **SCALER) if fp16 else None)
    where = f"{name} {dtype} {compiled.plan.mesh.describe()} zero{compiled.plan.zero}"
    fails.check(f"{where}: plan dtype {compiled.plan.dtype}",
                compiled.plan.dtype == str(dtype).removeprefix("torch."))
    fails.check(f"{where}: master weights are fp32",
                all(p.dtype == torch.float32 for g in compiled.optimizer.param_groups
                    for p in g["params"]))
    ref_opt = optimizer([p for p in ref.parameters() if p.requires_grad])
    scaler = torch.amp.GradScaler("cpu", **SCALER) if fp16 else None
    tol = TOLERANCE[dtype]
    skipped = 0
    for step, (inputs, targets) in enumerate(batches):
        if local:
            loss = compiled.train_step(compiled.local_slice(inputs),
                                       compiled.local_slice(targets), local=True,
                                       max_grad_norm=clip)
        else:
            loss = compiled.train_step(inputs, targets, max_grad_norm=clip)
        for p in ref.parameters():
            p.grad = None
        with torch.autocast("cpu", dtype=dtype):
            expected = loss_fn(ref(*inputs), targets)
        trained = [p for p in ref.parameters() if p.requires_grad]
        if scaler is None:
            expected.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(trained, clip)
            ref_opt.step()
        else:
            scaler.scale(expected).backward()
            scaler.unscale_(ref_opt)
            inf = sum(v.item() for v in scaler._found_inf_per_device(ref_opt).values()) > 0
            if clip is not None and not inf:
                torch.nn.utils.clip_grad_norm_(trained, clip)
            scaler.step(ref_opt)
            scaler.update()
            fails.check(f"{where} step {step}: skipped {compiled.found_inf}, eager {inf}",
                        compiled.found_inf == inf)
            fails.check(f"{where} step {step}: scale {compiled.loss_scale} vs eager "
                        f"{scaler.get_scale()}", compiled.loss_scale == scaler.get_scale())
            skipped += inf
        _close(fails, f"{where} step {step} loss", loss, expected.detach(), tol)
        grads, ref_grads = compiled.full_grads(), grads_of(ref)
        if not compiled.found_inf:
            for key, g in ref_grads.items():
                _close(fails, f"{where} step {step} grad {key}", grads[key], g, tol)
        state = compiled.full_state_dict()
        for key, value in state_of(ref).items():
            _close(fails, f"{where} step {step} {key}", state[key], value, tol)
    if fp16:
        fails.check(f"{where}: {skipped} steps skipped (the first should overflow)",
                    0 < skipped < steps)
    return compiled


def _close(fails: Failures, what: str, actual, expected, tol) -> None:
    try:
        torch.testing.assert_close(actual, expected, **tol)
    except AssertionError as exc:
        fails.append(f"{what}: {exc}")


def _precision_rank(rank: int, world: int, cases) -> list[str]:
    fails = Failures()
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1)
    # (Adam moves every weight by about lr whatever its gradient: with a small lr a tiny
    # gradient whose 16-bit rounding flips its sign stays within the tolerance)
    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.05)
    for name, dtype, constraints, optimizer in cases:
        _case(fails, world, name, dtype, constraints, {"sgd": sgd, "adamw": adamw}[optimizer])
    return fails


@pytest.mark.procs
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
def test_mixed_precision_matches_eager_autocast():
    cases = [
        ("gpt-tiny", torch.bfloat16, C(dp=2, tp=1, pp=1, zero=1), "adamw"),
        ("llama-tiny", torch.float16, C(dp=2, tp=1, pp=1, zero=2, num_microbatches=2), "sgd"),
        ("gpt-tiny", torch.float16, C(dp=1, tp=2, pp=1, sp=True), "adamw"),
        ("llama-tiny", torch.bfloat16, C(dp=1, tp=2, pp=1, sp=True), "adamw"),
        ("gpt-tiny", torch.bfloat16, C(dp=1, tp=1, pp=2, schedule="1f1b",
                                       num_microbatches=2), "sgd"),
        ("mlp-tiny", torch.bfloat16, C(dp=2, tp=1, pp=1, zero=3), "adamw"),
        ("gpt-tiny", torch.bfloat16, C(dp=2, tp=1, pp=1, zero=3,
                                       grad_reduce_dtype="bfloat16"), "sgd"),
        ("gpt-tiny", torch.bfloat16, C(dp=2, tp=1, pp=1, grad_reduce_dtype="bfloat16"),
         "sgd"),
    ]
    results = pool_launch(_precision_rank, 2, args=(2, cases),
                        timeout_s=LAUNCH_TIMEOUT_S)
    assert not any(results), report(results)


#: gpt-tiny's embeddings and first block: the first pp stage holds no trained parameter
FIRST_STAGE = ("tok_emb.", "pos_emb.", "blocks.0.")


def _no_gradient_stage_rank(rank: int, world: int) -> list[str]:
    """pp 2 × dp 2, the first stage's parameters all frozen: its ranks hold no gradient
    and no trained parameter, yet join every collective of an fp16 step (the nonfinite
    flag, the clipping norm's pp sum, the global count of local=True batches, the dp
    reducer's bucket counts) on the compiled model's device (the device check is on)."""
    fails = Failures()
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1)
    compiled = _case(fails, world, "gpt-tiny", torch.float16,
                     C(dp=2, tp=1, pp=2, schedule="1f1b", num_microbatches=2), sgd,
                     frozen=FIRST_STAGE, clip=0.5, local=True)
    first = compiled.coords[0] == compiled.plan.stage_ranks()[0]
    trained = [n for n, p in compiled._trained_params().items() if p.requires_grad]
    fails.check(f"rank {rank} (pp {compiled.coords[0]}) trains {trained}: the first stage "
                "none, the last some", bool(trained) != first)
    fails.check("the device check ran", ah.runtime.device_check.enabled())
    return fails


@pytest.mark.procs
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
def test_a_pp_stage_without_gradients_runs_fp16_clipping_and_local_batches():
    results = pool_launch(_no_gradient_stage_rank, 4, args=(4,), timeout_s=LAUNCH_TIMEOUT_S)
    assert not any(results), report(results)


# ============================================================================ no processes
@pytest.mark.timeout(60)
def test_loss_scaler_follows_grad_scaler():
    """The same inf/finite sequence moves LossScaler's scale as GradScaler's."""
    p = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([p], lr=0.1)
    eager = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    ours = LossScaler.like(eager)
    for inf in (True, False, False, False, True, False, False, False, False):
        eager.scale(torch.ones(()))
        p.grad = torch.tensor([float("inf") if inf else 1.0, 0.0])
        eager.unscale_(optimizer)
        eager.step(optimizer)
        eager.update()
        ours.update(inf)
        assert ours.scale == eager.get_scale()


@pytest.mark.timeout(60)
def test_compile_refuses_mixed_precision_it_cannot_run():
    torch.manual_seed(0)
    model = ah.models.preset("mlp-tiny").double()
    inputs, targets = ah.models.example_batch("mlp-tiny", 4, dtype=torch.float64)
    with pytest.raises(NotExecutableError, match="float32 parameters"):
        ah.compile(model, ah.Cluster.local(1), inputs, loss_fn=F.cross_entropy,
                   example_targets=targets, dtype=torch.bfloat16)
    model = ah.models.preset("mlp-tiny")
    inputs, targets = ah.models.example_batch("mlp-tiny", 4)
    with pytest.raises(AutohybridError, match="grad_scaler is for float16"):
        ah.compile(model, ah.Cluster.local(1), inputs, loss_fn=F.cross_entropy,
                   example_targets=targets, dtype=torch.bfloat16,
                   grad_scaler=torch.amp.GradScaler("cpu"))


@pytest.mark.timeout(60)
def test_mixed_precision_graph_computes_in_bf16_over_fp32_parameters(monkeypatch):
    monkeypatch.setenv("AUTOHYBRID_DISABLE_PASSES", "fusion")  # the norms stay visible ops
    torch.manual_seed(0)
    model = ah.models.preset("gpt-tiny")
    inputs, targets = ah.models.example_batch("gpt-tiny", 4)
    compiled = ah.compile(model, ah.Cluster.local(1), inputs, loss_fn=lm_loss,
                          example_targets=targets, dtype=torch.bfloat16,
                          optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    gm = compiled.graphs["train"]
    dtypes = {str(n.target): n.meta["val"].dtype for n in gm.graph.nodes
              if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor)}
    assert dtypes["aten.linear.default"] == torch.bfloat16
    assert dtypes["aten.layer_norm.default"] == torch.float32   # autocast's fp32 ops stay
    params = [n for n in gm.graph.nodes if n.meta.get("ah_role") == "param"]
    assert all(n.meta["val"].dtype == torch.float32 for n in params)
    loss = compiled.train_step(inputs, targets)
    assert loss.dtype == torch.float32 and compiled.loss_scale is None
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
