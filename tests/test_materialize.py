"""Sharded materialization: a model on the meta device compiles and trains with every rank
allocating only its own shards, equal to eager training of the same model materialized
whole (`ah.init.materialize`, same seed); and a GPT whose training state is larger than a
per-process byte budget trains under tp × pp × ZeRO-3 without any rank's live tensors
ever passing the budget (a dispatch-mode byte counter, runtime/bytecount.py).
"""
from __future__ import annotations

import pytest
import torch

import autohybrid as ah
from _limits import guard
from _pool import launch as pool_launch
from _equiv import (OPTIMIZERS, Failures, compare_training, default_eager_loss, lm_loss,
                    report, zoo_loss)
from autohybrid.errors import NotExecutableError
from autohybrid.ops.zero import shard_of
from autohybrid.runtime.bytecount import ByteCounter, MemoryBudgetExceeded
from autohybrid.runtime.materialize import Materializer

LAUNCH_TIMEOUT_S = guard(300)
SEED = 7
C = ah.Constraints


def _meta(name: str):
    return ah.models.preset(name, device="meta").double()


def _materialize_rank(rank: int, world: int, cases) -> list[str]:
    fails = Failures()
    for name, constraints in cases:
        meta = _meta(name)
        ref = ah.init.materialize(_meta(name), seed=SEED)
        batches = [ah.models.example_batch(name, 8, seed=100 + s, dtype=torch.float64)
                   for s in range(3)]
        case = f"{name} {constraints}"
        compiled = ah.compile(meta, ah.Cluster.local(world), batches[0][0],
                              loss_fn=zoo_loss(name), example_targets=batches[0][1],
                              optimizer=OPTIMIZERS["adamw"], constraints=constraints,
                              init_seed=SEED)
        zero3 = compiled.zero is not None and compiled.zero.stage == 3
        owned = compiled._trained_params()
        for pname, p in meta.named_parameters():  # what this rank allocated
            allocated = not p.is_meta
            split = compiled.sharded is not None and pname in compiled.sharded.specs
            expected = pname in owned and not zero3 and not split
            fails.check(f"{case}: {pname} allocated whole: {allocated}, expected {expected}",
                        allocated == expected)
        compare_training(fails, case, compiled, ref,
                         OPTIMIZERS["adamw"](list(ref.parameters())), batches,
                         default_eager_loss(zoo_loss(name)))
    return fails


@pytest.mark.procs
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
def test_meta_models_materialize_their_shards_and_train_like_eager():
    cases = [("gpt-tiny", C(dp=2, tp=2, pp=1, zero=3)),
             ("llama-tiny", C(dp=1, tp=2, pp=2, schedule="1f1b", num_microbatches=2)),
             ("gpt-tiny", C(dp=2, tp=1, pp=2, zero=1, schedule="gpipe", num_microbatches=2)),
             ("mlp-tiny", C(dp=4, tp=1, pp=1))]
    results = pool_launch(_materialize_rank, 4, args=(4, cases),
                        timeout_s=LAUNCH_TIMEOUT_S)
    assert not any(results), report(results)


# ============================================================================ the budget
def _budget_model(device="meta"):
    torch.manual_seed(0)
    return ah.models.gpt(layers=8, hidden=128, heads=4, vocab=256, seq=16, device=device)


def _budget_rank(rank: int, world: int, budget: int) -> dict:
    """Compile and train 2 steps under the byte counter; the losses and the peak."""
    inputs, targets = ah.models.example_batch(_budget_model(), 8, seed=1)
    losses = []
    with ByteCounter(budget=budget) as counter:
        compiled = ah.compile(_budget_model(), ah.Cluster.local(world), inputs, loss_fn=lm_loss,
                              example_targets=targets, init_seed=SEED,
                              optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                              constraints=C(tp=2, pp=2, dp=2, zero=3, schedule="1f1b",
                                            num_microbatches=2))
        for _ in range(2):
            losses.append(compiled.train_step(inputs, targets).item())
    return {"peak": counter.peak, "losses": losses, "plan": compiled.plan.mesh.describe()}


@pytest.mark.procs
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
def test_a_model_larger_than_the_budget_trains_with_tp_pp_zero3_under_it():
    """Budget: the bytes of the model's fp32 parameters alone. Training state (parameters,
    gradients, AdamW's two moments: 16 bytes per parameter) is 4× that, so no rank may
    hold even the whole parameters once; each holds 1/8 of the state and one layer's
    gathered tp-local parameters at a time. Losses equal eager's (materialized whole)."""
    meta = _budget_model()
    count = sum(p.numel() for p in meta.parameters())
    budget = 4 * count
    results = pool_launch(_budget_rank, 8, args=(8, budget), timeout_s=LAUNCH_TIMEOUT_S)
    assert all(r["plan"].startswith("pp2×dp2×tp2") for r in results), results
    peaks = [r["peak"] for r in results]
    print(f"{count:,} parameters; budget {budget:,} B; training state {16 * count:,} B; "
          f"peak per rank {peaks}")
    assert max(peaks) <= budget < 16 * count
    ref = ah.init.materialize(_budget_model(), seed=SEED)
    optimizer = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    inputs, targets = ah.models.example_batch(ref, 8, seed=1)
    for step in range(2):
        optimizer.zero_grad()
        loss = lm_loss(ref(*inputs), targets)
        loss.backward()
        optimizer.step()
        for r in results:
            assert r["losses"][step] == pytest.approx(loss.item(), rel=1e-4)


# ============================================================================ no processes
@pytest.mark.timeout(60)
def test_byte_counter_counts_live_tensors_and_enforces_its_budget():
    with ByteCounter() as counter:
        a = torch.zeros(1000)                       # 4000 bytes
        b = a.view(10, 100)                         # a view: no new storage
        c = a + 1                                   # 4000 more
        assert counter.current == 8000 == counter.peak
        del c
        assert counter.current == 4000 and counter.peak == 8000
    del a, b
    with pytest.raises(MemoryBudgetExceeded, match="over the budget"):
        with ByteCounter(budget=1000):
            torch.ones(1000)


@pytest.mark.timeout(60)
def test_materializer_slices_equal_the_whole_model():
    model = ah.models.preset("gpt-tiny", device="meta")
    whole = ah.init.materialize(ah.models.preset("gpt-tiny", device="meta"), seed=SEED)
    m = Materializer(model, SEED, torch.device("cpu"))
    name = "blocks.0.mlp.fc.weight" if "blocks.0.mlp.fc.weight" in dict(
        model.named_parameters()) else next(n for n, p in model.named_parameters()
                                            if p.dim() == 2 and n.startswith("blocks.0"))
    full = whole.get_parameter(name)
    for rank in range(3):  # an uneven ZeRO-3 split: padded last chunk
        assert torch.equal(m.zero_shard(name, 3, rank, None), shard_of(full, 3, rank))
    assert torch.equal(m.whole(name), full)


@pytest.mark.timeout(60)
def test_compile_of_a_meta_model_needs_a_seed():
    model = ah.models.preset("mlp-tiny", device="meta")
    inputs, targets = ah.models.example_batch("mlp-tiny", 4)
    with pytest.raises(NotExecutableError, match="init_seed"):
        ah.compile(model, ah.Cluster.local(1), inputs, loss_fn=zoo_loss("mlp-tiny"),
                   example_targets=targets)
    with pytest.raises(NotExecutableError, match="mixed precision of a model on the meta"):
        ah.compile(model, ah.Cluster.local(1), inputs, loss_fn=zoo_loss("mlp-tiny"),
                   example_targets=targets, init_seed=0, dtype=torch.bfloat16)
