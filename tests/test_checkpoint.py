"""Checkpoints: save under plan A at step 3, stop, load under plan B, train to step 6 —
the losses and gathered parameters equal the uninterrupted run under A.

Pairs cover dp ↔ tp ↔ pp, ZeRO 0 ↔ 3, world size 4 ↔ 2, a schedule with virtual
stages, SGD and AdamW, gpt-tiny and llama-tiny, and a resume under the same plan with
dropout on (the random generators are restored: tp draws eager's masks on every rank).
A's run and B's run are different launches where the world size changes, so nothing
survives between them but the directory.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import autohybrid as ah
from _equiv import OPTIMIZERS, Failures, lm_loss, report, zoo_batches, zoo_model
from _limits import guard
from _pool import launch

pytestmark = pytest.mark.procs

C = ah.Constraints
STEPS, SAVE_AT, BATCH = 6, 3, 8

# name: (model, optimizer, (world, constraints) of A, (world, constraints) of B, dropout)
CASES = {
    "dp2-to-tp2": ("gpt-tiny", "sgd", (2, C(dp=2, tp=1, pp=1)), (2, C(dp=1, tp=2, pp=1)), 0.0),
    "tp2-to-pp2": ("llama-tiny", "adamw", (2, C(dp=1, tp=2, pp=1)),
                   (2, C(dp=1, tp=1, pp=2, schedule="1f1b")), 0.0),
    "pp2-to-dp2-zero3": ("gpt-tiny", "adamw", (2, C(dp=1, tp=1, pp=2, schedule="gpipe")),
                         (2, C(dp=2, tp=1, pp=1, zero=3)), 0.0),
    "zero3-to-zero0": ("llama-tiny", "sgd", (2, C(dp=2, tp=1, pp=1, zero=3)),
                       (2, C(dp=2, tp=1, pp=1, zero=0)), 0.0),
    "dp2tp2-zero1-to-pp2": ("gpt-tiny", "adamw", (4, C(dp=2, tp=2, pp=1, zero=1)),
                            (2, C(dp=1, tp=1, pp=2, schedule="gpipe")), 0.0),
    "tp2-to-pp2dp2-interleaved": ("llama-tiny", "adamw", (2, C(dp=1, tp=2, pp=1)),
                                  (4, C(dp=2, tp=1, pp=2, schedule="interleaved",
                                        virtual_stages=2)), 0.0),
    "same-plan-dropout-tp2": ("gpt-dropout", "adamw", (2, C(dp=1, tp=2, pp=1)),
                              (2, C(dp=1, tp=2, pp=1)), 0.1),
}


def _model(name: str):
    if name == "gpt-dropout":
        torch.manual_seed(0)
        return ah.models.gpt(layers=2, hidden=32, heads=4, vocab=96, seq=16,
                             dropout=0.1).double()
    return zoo_model(name)


def _compile(name, optimizer, world, constraints, check=False):
    model = _model(name)
    batches = zoo_batches("gpt-tiny" if name == "gpt-dropout" else name, BATCH, steps=STEPS)
    inputs, targets = batches[0]
    compiled = ah.compile(model, ah.Cluster.local(world), inputs, loss_fn=lm_loss,
                          example_targets=targets, optimizer=OPTIMIZERS[optimizer],
                          constraints=constraints, check=check)
    return compiled, batches


def _state(compiled):
    return {k: v.detach().cpu().clone() for k, v in compiled.full_state_dict().items()}


def _run_a(rank, case, directory):
    """Plan A: train STEPS steps, saving after SAVE_AT; what B must reproduce."""
    name, optimizer, (world, constraints), _, _ = CASES[case]
    compiled, batches = _compile(name, optimizer, world, constraints)
    losses = []
    for step, (inputs, targets) in enumerate(batches):
        if step == SAVE_AT:
            compiled.save(directory, extra={"case": case})
        losses.append(compiled.train_step(inputs, targets).item())
    return {"losses": losses[SAVE_AT:], "state": _state(compiled)}


def _run_b(rank, case, directory):
    """Plan B: a new model (another seed), loaded from A's checkpoint, trained on."""
    name, optimizer, _, (world, constraints), _ = CASES[case]
    torch.manual_seed(1234)  # the generator's state must come from the checkpoint
    # check=True compares B's first step with eager from the loaded values
    compiled, batches = _compile(name, optimizer, world, constraints,
                                 check=case == "dp2-to-tp2")
    extra = compiled.load(directory)
    assert extra == {"case": case} and compiled.step == SAVE_AT, (extra, compiled.step)
    losses = [compiled.train_step(*batch).item() for batch in batches[SAVE_AT:]]
    return {"losses": losses, "state": _state(compiled)}


def _many(rank, jobs):
    return [(fn(rank, case, directory)) for fn, case, directory in jobs]


def test_resume_under_another_plan_equals_the_uninterrupted_run(tmp_path):
    dirs = {case: str(tmp_path / case) for case in CASES}
    a_results, b_results = {}, {}

    def run(world, jobs):
        out = launch(_many, world, args=(jobs,), timeout_s=guard(240))
        return out[0]

    # the launches: A at 2 ranks (and B where both are 2), A and B at 4, then B at 2
    first = [(_run_a, c, dirs[c]) for c, spec in CASES.items() if spec[2][0] == 2]
    first_b = [(_run_b, c, dirs[c]) for c, spec in CASES.items()
               if spec[2][0] == 2 and spec[3][0] == 2]
    for (fn, case, _), result in zip(first + first_b, run(2, first + first_b)):
        (a_results if fn is _run_a else b_results)[case] = result
    second = [(_run_a, c, dirs[c]) for c, spec in CASES.items() if spec[2][0] == 4]
    second_b = [(_run_b, c, dirs[c]) for c, spec in CASES.items() if spec[3][0] == 4]
    for (fn, case, _), result in zip(second + second_b, run(4, second + second_b)):
        (a_results if fn is _run_a else b_results)[case] = result
    third = [(_run_b, c, dirs[c]) for c, spec in CASES.items()
             if spec[2][0] == 4 and spec[3][0] == 2]
    for (_, case, _), result in zip(third, run(2, third)):
        b_results[case] = result

    fails = Failures()
    for case in CASES:
        a, b = a_results[case], b_results[case]
        fails.close(f"{case} losses after the resume", torch.tensor(b["losses"]),
                    torch.tensor(a["losses"]))
        fails.close_dict(f"{case} parameters at step {STEPS}", b["state"], a["state"])
    assert not fails, report([fails])


def _whole_state_loads(rank):
    """model.load_state_dict after compile reaches tp and ZeRO shards (the first loss and
    every later step as eager with the loaded values); another plan's optimizer state
    dict is refused by name."""
    from _equiv import compare_training, default_eager_loss
    import copy
    fails = Failures()
    other = zoo_model("gpt-tiny", seed=7).state_dict()
    optimizer_states = {}
    for layout in (C(dp=1, tp=2, pp=1), C(dp=2, tp=1, pp=1, zero=1),
                   C(dp=2, tp=1, pp=1, zero=3)):
        compiled, batches = _compile("gpt-tiny", "adamw", 2, layout, check=layout.tp == 2)
        compiled.model.load_state_dict(other)
        ref = zoo_model("gpt-tiny")
        ref.load_state_dict(other)
        compare_training(fails, f"load_state_dict under {layout}", compiled, ref,
                         OPTIMIZERS["adamw"](list(ref.parameters())), batches[:2],
                         default_eager_loss(lm_loss))
        optimizer_states[layout.zero] = compiled.optimizer.state_dict()
        if layout.zero == 1:
            try:
                compiled.optimizer.load_state_dict(optimizer_states[None])  # tp2's
                fails.append("a tp2 plan's optimizer state was accepted under dp2 zero1")
            except ah.CheckpointError as exc:
                fails.check(f"the refusal names the parameter: {exc}", "of parameter" in str(exc))
    return fails


def test_model_load_state_dict_reaches_the_shards():
    fails = launch(_whole_state_loads, 2, timeout_s=guard(180))
    assert not any(fails), report(fails)


def _hf_interchange(rank, directory):
    """A Hugging Face Llama trained under tp2 leaves as safetensors that
    LlamaForCausalLM.from_pretrained reads (same weights, same logits); a pretrained one
    (save_pretrained) comes in under dp2 × ZeRO-3, each rank reading only its slices."""
    import torch.distributed as dist
    import transformers
    from autohybrid.models import coverage
    fails = Failures()
    torch.manual_seed(0)
    case = coverage.build("llama")
    inputs, targets = case.batches[0]
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    compiled = ah.compile(case.model, ah.Cluster.local(2), inputs, loss_fn=None,
                          example_targets=targets, optimizer=sgd,
                          constraints=C(dp=1, tp=2, pp=1))
    for batch in case.batches[:2]:
        compiled.train_step(*batch)
    out = Path(directory) / "exported"
    compiled.export_safetensors(out)
    trained = compiled.full_state_dict()
    back = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float64).train()
    fails.close_dict("from_pretrained's weights", back.state_dict(),
                     {k: v for k, v in trained.items() if k in back.state_dict()})
    with torch.no_grad():
        case.model.load_state_dict(trained)
        fails.close("from_pretrained's logits", back(*inputs).logits, case.model(*inputs).logits)

    torch.manual_seed(5)
    pretrained = coverage.build("llama").model
    source = Path(directory) / "pretrained"
    if rank == 0:
        pretrained.save_pretrained(source)
    dist.barrier()
    torch.manual_seed(0)
    fresh = coverage.build("llama")
    compiled = ah.compile(fresh.model, ah.Cluster.local(2), inputs, loss_fn=None,
                          example_targets=targets, optimizer=sgd,
                          constraints=C(dp=2, tp=1, pp=1, zero=3))
    compiled.load_safetensors(source)
    fails.close_dict("load_safetensors under ZeRO-3", compiled.full_state_dict(),
                     pretrained.state_dict())
    try:
        other = ah.compile(zoo_model("gpt-tiny"), ah.Cluster.local(2), *zoo_batches(
            "gpt-tiny", 4, steps=1)[0][:1], loss_fn=lm_loss,
            example_targets=zoo_batches("gpt-tiny", 4, steps=1)[0][1], optimizer=sgd)
        other.load_safetensors(source)
        fails.append("another model's safetensors were accepted")
    except ah.CheckpointError as exc:
        fails.check(f"the refusal names the tensor: {exc}", "holds no tensor" in str(exc))
    return fails


def test_safetensors_with_hugging_face_names(tmp_path):
    fails = launch(_hf_interchange, 2, args=(str(tmp_path),), timeout_s=guard(240))
    assert not any(fails), report(fails)
