"""Tests of the Plan (autohybrid.plan), `ah.plan` / the planner, and the cost model.

The Plan's JSON round trip and validation, Constraints validation, planning on meta
models, the memory and FLOP models against closed forms (hardware_and_formulas.md and the
zoo GPT's structure), the choice of microbatches under a tight memory, NoPlanFitsError,
alternatives, determinism, and what `ah.compile` does with features it cannot execute and
with saved plans. `ah.compile` runs in this process: a world of one rank needs no
torch.distributed.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import re

import pytest
import torch
import torch.nn.functional as F

import autohybrid as ah
from autohybrid import models, planning
from autohybrid.planning import make_plan
from autohybrid.capture import capture
from autohybrid.checks import params_hash
from autohybrid.search.space import profile
from autohybrid.cost.memory import MEMORY_HEADROOM, training_state, usable_bytes
from autohybrid.plan import FORMAT_VERSION, Mesh, Plan, RankPlacement

GiB = 2**30


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, -2), target.flatten())


def _unique_param_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() skips tied duplicates


def _with_memory(cluster: ah.Cluster, memory_bytes: int) -> ah.Cluster:
    """The same cluster, read back from JSON with another device memory."""
    data = json.loads(cluster.to_json())
    data["device"]["memory_bytes"] = int(memory_bytes)
    return ah.Cluster.from_json(json.dumps(data))


@pytest.fixture(scope="module")
def tiny_plan() -> Plan:
    model = models.preset("gpt-tiny")
    inputs, _ = models.example_batch("gpt-tiny", 8)
    return ah.plan(model, ah.Cluster.local(4), inputs)


# --------------------------------------------------------------------------- JSON


@pytest.mark.timeout(60)
def test_plan_json_round_trip_is_byte_identical(tiny_plan: Plan, tmp_path) -> None:
    assert tiny_plan.world_size == 4 and tiny_plan.mesh.world_size == 4
    text = tiny_plan.to_json()
    assert Plan.from_json(text) == tiny_plan
    path = tmp_path / "plan.json"
    tiny_plan.to_json(path)
    first = path.read_bytes()
    loaded = Plan.from_json(path)
    loaded.to_json(path)
    assert path.read_bytes() == first == text.encode()
    assert loaded == tiny_plan and loaded.hash() == tiny_plan.hash()
    assert loaded.alternatives == tiny_plan.alternatives  # nested tuples of dataclasses
    assert isinstance(loaded.placement, tuple) and isinstance(loaded.placement[0], RankPlacement)


def _edited(plan: Plan, edit) -> dict:
    data = json.loads(plan.to_json())
    edit(data)
    return data


def _set(path: str, value):
    def edit(data: dict) -> None:
        *parents, last = path.split(".")
        for key in parents:
            data = data[int(key)] if isinstance(data, list) else data[key]
        data[last] = value
    return edit


def _delete(path: str):
    def edit(data: dict) -> None:
        *parents, last = path.split(".")
        for key in parents:
            data = data[int(key)] if isinstance(data, list) else data[key]
        del data[last]
    return edit


BAD_PLANS = [
    # (what, edit, words the PlanError must contain)
    ("wrong version", _set("version", FORMAT_VERSION + 1), ["version", str(FORMAT_VERSION + 1)]),
    ("no version", _delete("version"), ["version"]),
    ("unknown top-level field", _set("colour", "red"), ["plan.colour"]),
    ("unknown mesh field", _set("mesh.cp", 2), ["plan.mesh.cp"]),
    ("unknown placement field", _set("placement.0.gpu", 0), ["plan.placement[0].gpu"]),
    ("unknown prediction field", _set("predicted.memory.kv_cache", 0),
     ["plan.predicted.memory.kv_cache"]),
    ("missing required field", _delete("model_hash"), ["plan.model_hash"]),
    ("missing defaulted field", _delete("zero"), ["plan.zero"]),
    ("missing mesh degree", _delete("mesh.dp"), ["plan.mesh.dp"]),
    ("string for int", _set("global_batch", "8"), ["plan.global_batch", "int"]),
    ("float for int", _set("mesh.dp", 4.0), ["plan.mesh.dp", "int"]),
    ("bool for int", _set("num_microbatches", True), ["plan.num_microbatches"]),
    ("int for bool", _set("collective_matmul", 0), ["plan.collective_matmul", "bool"]),
    ("object for list", _set("placement", {"rank": 0}), ["plan.placement", "list"]),
    ("string for object", _set("mesh", "dp4"), ["plan.mesh", "object"]),
    ("unknown schedule", _set("schedule", "pipedream"), ["plan.schedule", "pipedream"]),
    ("zero stage 4", _set("zero", 4), ["plan.zero"]),
    ("non-positive degree", _set("mesh.tp", 0), ["mesh.tp"]),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("what,edit,words", BAD_PLANS, ids=[b[0] for b in BAD_PLANS])
def test_invalid_plan_json_names_the_field(tiny_plan: Plan, what, edit, words) -> None:
    data = _edited(tiny_plan, edit)
    with pytest.raises(ah.PlanError) as err:
        Plan.from_json(json.dumps(data))
    for word in words:
        assert word in str(err.value), (what, str(err.value))


@pytest.mark.timeout(60)
def test_plan_degrees_and_placement_must_match(tiny_plan: Plan) -> None:
    def check(edit, field: str) -> None:
        with pytest.raises(ah.PlanError, match=re.escape(field)):
            Plan.from_dict(_edited(tiny_plan, edit))

    # twice the dp degree with a consistent batch, but the placement still lists 4 ranks
    def dp2(data: dict) -> None:
        data["mesh"]["dp"] *= 2
        data["global_batch"] = data["mesh"]["dp"] * data["microbatch_size"] \
            * data["num_microbatches"]
    check(dp2, "plan.placement")
    check(lambda d: d["placement"].pop(), "plan.placement")             # 3 ranks for 4
    check(lambda d: d["placement"][1].update(rank=0), "plan.placement")  # rank 0 twice
    check(lambda d: d["placement"][1].update(device=0), "plan.placement")  # one device twice
    check(_set("global_batch", 12), "plan.global_batch")                 # != dp × local
    with pytest.raises(ah.PlanError, match="JSON object"):
        Plan.from_dict([])
    with pytest.raises(ah.PlanError, match="not valid JSON"):
        Plan.from_json("{not json")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kwargs,field", [
    (dict(dp=0), "Constraints.dp"), (dict(tp=-2), "Constraints.tp"),
    (dict(pp=1.5), "Constraints.pp"),
    (dict(microbatch_size=True), "Constraints.microbatch_size"),
    (dict(num_microbatches="4"), "Constraints.num_microbatches"),
    (dict(virtual_stages=0), "Constraints.virtual_stages"),
    (dict(schedule="pipedream"), "Constraints.schedule"),
    (dict(recompute="some"), "Constraints.recompute"), (dict(zero=4), "Constraints.zero"),
    (dict(zero=True), "Constraints.zero"), (dict(bucket_mb=0), "Constraints.bucket_mb"),
    (dict(bucket_mb="25"), "Constraints.bucket_mb"),
    (dict(collective_algorithm="tree"), "Constraints.collective_algorithm"),
    (dict(sp="yes"), "Constraints.sp"),
    (dict(collective_matmul=1), "Constraints.collective_matmul"),
    (dict(stage_boundaries="blocks.1"), "Constraints.stage_boundaries"),
])
def test_constraints_validation_names_the_field(kwargs, field) -> None:
    with pytest.raises(ah.PlanError, match=re.escape(field)):
        ah.Constraints(**kwargs)


@pytest.mark.timeout(30)
def test_constraints_accept_valid_choices() -> None:
    c = ah.Constraints(dp=2, zero=0, bucket_mb=1, sp=False, schedule="1f1b",
                       stage_boundaries=("blocks.1",))
    assert c.pinned() == dict(dp=2, zero=0, bucket_mb=1, sp=False, schedule="1f1b",
                              stage_boundaries=("blocks.1",))


# --------------------------------------------------------------------------- planning


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "mlp-tiny", "resnet-tiny"])
def test_plan_on_meta_models(name: str) -> None:
    meta = models.preset(name, device="meta")
    inputs, _ = models.example_batch(name, 8, device="meta")
    plan = ah.plan(meta, ah.Cluster.local(2), inputs, executable_only=True,
                   constraints=ah.Constraints(tp=1, pp=1, zero=0))  # data-parallel memory
    assert plan.executable and plan.mesh == Mesh(dp=2) and plan.global_batch == 8
    state = training_state(_unique_param_count(meta), "float32", "adam", 0, 2)
    memory = plan.predicted.memory
    assert (memory.params, memory.grads, memory.optimizer) == \
        (state.params, state.grads, state.optimizer)
    assert memory.activations > 0 and plan.predicted.step_time_s > 0
    # the plan is for the same graph as the real model's
    real_inputs, _ = models.example_batch(name, 8)
    assert plan.model_hash == capture(models.preset(name), real_inputs, with_loss=False).hash


@pytest.mark.timeout(60)
def test_plan_of_a_large_meta_model_follows_sixteen_bytes_per_parameter() -> None:
    meta = models.preset("gpt3-125m", device="meta")
    ids = torch.empty(8, 2048, dtype=torch.long, device="meta")
    cluster = ah.Cluster.preset("dgx-a100-80gb", nodes=1)
    forward = capture(meta, (ids,), with_loss=False)  # once, for the four plans below
    count = _unique_param_count(meta)
    for zero, per_param in [(0, 16), (1, 4 + 12 / 8), (2, 2 + 14 / 8), (3, 16 / 8)]:
        plan = make_plan(forward, None, meta, cluster, (ids,), None, torch.bfloat16,
                         ah.Constraints(zero=zero, num_microbatches=1, tp=1, pp=1), "adam",
                         executable_only=False)
        m = plan.predicted.memory
        assert plan.executable and plan.zero == zero and plan.dtype == "bfloat16"
        assert m.params + m.grads + m.optimizer == pytest.approx(per_param * count, abs=3)


def _needs(model, inputs, cluster, counts, recompute=None) -> dict[int, int]:
    """Predicted bytes per rank at each pinned microbatch count (roomy memory)."""
    return {k: ah.plan(model, cluster, inputs,
                       constraints=ah.Constraints(num_microbatches=k, zero=0,
                                                  recompute=recompute),
                       executable_only=True).predicted.memory_per_rank_bytes for k in counts}


@pytest.mark.timeout(60)
def test_plan_picks_the_fewest_microbatches_that_fit() -> None:
    model = models.preset("gpt-tiny")
    inputs, _ = models.example_batch("gpt-tiny", 8)
    roomy = ah.Cluster.local(1)
    needs = _needs(model, inputs, roomy, [1, 2, 4, 8])
    assert needs[1] > needs[2] > needs[4] > needs[8]
    assert ah.plan(model, roomy, inputs, executable_only=True).num_microbatches == 1  # fewest is fastest

    def memory_between(low: int, high: int) -> int:
        """Device memory whose usable part lies in [low, high)."""
        memory = math.ceil(low / (1 - MEMORY_HEADROOM)) + 1
        assert low <= usable_bytes(memory) < high
        return memory

    for count in (2, 4, 8):
        tight = _with_memory(roomy, memory_between(needs[count], needs[count // 2]))
        plan = ah.plan(model, tight, inputs, executable_only=True)
        assert plan.num_microbatches == count and plan.microbatch_size == 8 // count
        assert plan.predicted.memory_per_rank_bytes <= usable_bytes(tight.device.memory_bytes)
        assert plan.predicted.device_memory_bytes == tight.device.memory_bytes
        assert any(not a.fits and "does not fit" in a.reason for a in plan.alternatives)


@pytest.mark.timeout(60)
def test_no_plan_fits_error_gives_the_numbers() -> None:
    model = models.preset("gpt-tiny")
    inputs, _ = models.example_batch("gpt-tiny", 8)
    # the smallest executable need: most microbatches, full recomputation
    need = _needs(model, inputs, ah.Cluster.local(1), [8], recompute="full")[8]
    memory = int(need * 0.5)
    with pytest.raises(ah.NoPlanFitsError) as err:
        ah.plan(model, _with_memory(ah.Cluster.local(1), memory), inputs, executable_only=True)
    text = str(err.value)
    needs_gib = float(re.search(r"needs ([0-9.e+-]+) GiB per rank", text).group(1))
    usable_gib = float(re.search(r"> ([0-9.e+-]+) GiB usable", text).group(1))
    assert needs_gib == pytest.approx(need / GiB, rel=5e-3)
    assert usable_gib == pytest.approx(usable_bytes(memory) / GiB, rel=5e-3)
    for part in ("parameters", "gradients", "optimizer state", "activations"):
        assert part in text


@pytest.mark.timeout(60)
def test_alternatives_carry_reasons(tiny_plan: Plan) -> None:
    assert tiny_plan.alternatives
    best = tiny_plan.predicted.step_time_s
    for alt in tiny_plan.alternatives:
        assert alt.reason and alt.summary != tiny_plan.summary()
        if not alt.fits:
            assert alt.reason.startswith("does not fit")
        else:
            if alt.executable is None:  # its passes were not run
                assert alt.reason.endswith("; not tried by the passes")
            elif not alt.executable:
                assert ("; not executable yet: " in alt.reason
                        or "; rejected by the passes: " in alt.reason)
            delta = float(re.match(r"([+-][0-9.]+) % step time", alt.reason).group(1))
            assert delta == pytest.approx((alt.step_time_s / best - 1) * 100, abs=0.06)
            assert alt.step_time_s >= best


@pytest.mark.timeout(60)
def test_an_alternatives_constraints_make_that_plan_again(tiny_plan: Plan) -> None:
    """`alt.constraints` pin its whole layout: planning under them prices that layout
    alone, to the same prediction (benchmarks/plan_choice.py runs alternatives so); they
    survive the JSON round trip, and a plan written before the field reads as None."""
    model = models.preset("gpt-tiny")
    inputs, _ = models.example_batch("gpt-tiny", 8)
    tried = 0
    for alt in tiny_plan.alternatives:
        if not alt.fits or alt.executable is False:
            continue
        again = ah.plan(model, ah.Cluster.local(4), inputs, constraints=alt.constraints)
        assert again.predicted.step_time_s == alt.step_time_s, (alt.summary, again.summary())
        assert again.mesh.describe() in alt.summary and not again.alternatives
        assert f"microbatch {again.microbatch_size}×{again.num_microbatches}" in alt.summary
        assert f" zero{again.zero} recompute={again.recompute}" in alt.summary
        if again.mesh.pp > 1:
            assert f" {again.schedule}" in alt.summary
        tried += 1
        if tried == 3:
            break
    assert tried == 3
    back = Plan.from_json(tiny_plan.to_json())
    assert back.alternatives == tiny_plan.alternatives
    data = tiny_plan.to_dict()
    for alt in data["alternatives"]:
        del alt["constraints"]
    assert all(a.constraints is None for a in Plan.from_dict(data).alternatives)


@pytest.mark.timeout(60)
def test_planning_is_deterministic(tiny_plan: Plan) -> None:
    torch.manual_seed(123)  # other parameter values: the same plan
    model = models.preset("gpt-tiny")
    inputs, _ = models.example_batch("gpt-tiny", 8, seed=5)
    again = ah.plan(model, ah.Cluster.local(4), inputs)
    assert again.to_json() == tiny_plan.to_json()


@pytest.mark.timeout(60)
def test_zero_gradient_sync_moves_the_bytes_of_the_zero_paper() -> None:
    """ZeRO-1/2: reduce-scatter + all-gather = one all-reduce (2Ψ); ZeRO-3: 3Ψ, plus the
    latency of 3 collectives for each further gather: gpt-tiny's fp32 layers make 2
    (embedding, position table and first block, 64 KiB, then the rest: the local link
    moves 50 KB in its latency, so smaller ones merge; tests/test_zero.py sees the same
    2 in the graph). That on a ring link (the local one without its gloo figures); on
    gloo's placeholder link a reduce-scatter runs, and is priced, as an all-reduce."""
    model = models.preset("gpt-tiny")
    inputs, _ = models.example_batch("gpt-tiny", 8)
    gloo = ah.Cluster.local(4)
    ring = dataclasses.replace(gloo, intra_link=dataclasses.replace(gloo.intra_link,
                                                                    collectives=()))
    assert gloo.intra_link.figures("reduce_scatter") != ring.intra_link.figures("reduce_scatter")
    p, n = 4, _unique_param_count(model) * 4  # fp32 gradients
    alpha, beta = gloo.intra_link.latency_s, 1 / gloo.intra_link.bandwidth
    all_reduce = 2 * (p - 1) * alpha + 2 * (p - 1) / p * n * beta
    for cluster, scatter in ((ring, 0.5), (gloo, 1.0)):   # a reduce-scatter, in all-reduces
        for zero, factor, more in [(0, 1.0, 0), (1, scatter + 0.5, 0), (2, scatter + 0.5, 0),
                                   (3, scatter + 1.0, 3 * (p - 1))]:
            plan = ah.plan(model, cluster, inputs,
                           constraints=ah.Constraints(zero=zero, num_microbatches=1, tp=1, pp=1))
            want = factor * all_reduce + more * alpha
            assert plan.predicted.comm_s == pytest.approx(want, rel=1e-9), (cluster, zero)


# --------------------------------------------------------------------------- cost model


@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtype,split", [("float32", (4, 4, 8)), ("bfloat16", (2, 2, 12))])
def test_training_state_bytes_follow_the_closed_forms(dtype: str, split) -> None:
    count = 2**20 * 105  # divisible by every d below
    w, g, o = split
    assert w + g + o == 16
    for d in (1, 2, 4, 8):
        expected = {0: (w, g, o), 1: (w, g, o / d), 2: (w, g / d, o / d), 3: (w / d, g / d, o / d)}
        for zero, per_param in expected.items():
            m = training_state(count, dtype, "adam", zero, d)
            assert (m.params, m.grads, m.optimizer) == tuple(int(b * count) for b in per_param)
        if dtype == "bfloat16":  # hardware_and_formulas.md: 16, 4 + 12/d, 2 + 14/d, 16/d
            totals = [16, 4 + 12 / d, 2 + 14 / d, 16 / d]
            for zero, total in enumerate(totals):
                assert training_state(count, dtype, "adam", zero, d).total == total * count
        quarter = training_state(count, dtype, "adam", 0, d, tp=2, pp=2)
        assert quarter.total == 16 * count // 4
    sgd = training_state(count, dtype, "sgd", 0, 1)
    assert sgd.optimizer == (4 + 4 if dtype == "bfloat16" else 4) * count  # momentum (+ master)
    assert training_state(count, dtype, "none", 0, 1).optimizer == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("layers,hidden,heads,vocab,seq", [
    (2, 256, 4, 1000, 128), (3, 384, 6, 5000, 64), (1, 512, 8, 2048, 256)])
def test_graph_flops_of_the_zoo_gpt_match_the_closed_form(layers, hidden, heads, vocab,
                                                          seq) -> None:
    """Forward FLOPs of the zoo GPT, derived from its structure.

    Per layer: qkv (h→3h) 6·B·s·h², proj 2·B·s·h², MLP (h→4h→h) 16·B·s·h²,
    attention QKᵀ and AV 4·B·s²·h (counted in full, causal or not); head (tied) 2·B·s·h·V:
    24·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)) — a third of the reference's
    72·B·s·l·h²·(…) for forward + backward.
    """
    model = models.gpt(layers, hidden, heads, vocab, seq, device="meta")
    ids = torch.empty(2, seq, dtype=torch.long, device="meta")
    cap = capture(model, (ids,), with_loss=False)
    prof = profile(cap.gm, cap.dim_roles)  # what the planner prices
    l, h, V = layers, hidden, vocab
    assert prof.param_count == 12 * l * h * h + 13 * l * h + (V + seq) * h + 2 * h
    for B, s in [(1, seq), (3, seq // 2), (8, 16)]:
        forward = 24 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))
        assert prof.forward_flops(B, s, matmul_only=True) == pytest.approx(forward, rel=1e-9)
        assert prof.forward_flops(B, s) == pytest.approx(forward, rel=0.03)
        reference = 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))
        assert prof.step_flops(B, s) == pytest.approx(reference, rel=0.03)


# --------------------------------------------------------------------------- compile


@pytest.fixture()
def gpt_tiny():
    torch.manual_seed(0)
    model = models.preset("gpt-tiny")
    inputs, targets = models.example_batch("gpt-tiny", 4)
    return model, inputs, targets


@pytest.fixture()
def no_full_recompute(monkeypatch):
    """A runtime that cannot run full recomputation: every feature runs today, so the
    refusal path (features.py → planning) is exercised with a stand-in."""
    def unsupported(plan):
        return ["recompute='full' is not executable here"] if plan.recompute == "full" else []

    monkeypatch.setattr(planning, "unsupported", unsupported)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pinned", [dict(recompute="full"),
                                    dict(recompute="full", collective_algorithm="hierarchical")])
def test_compile_refuses_features_the_runtime_cannot_execute(gpt_tiny, no_full_recompute,
                                                             pinned) -> None:
    model, inputs, targets = gpt_tiny
    with pytest.raises(ah.NotExecutableError) as err:
        ah.compile(model, ah.Cluster.local(1), inputs, loss_fn=_loss, example_targets=targets,
                   constraints=ah.Constraints(**pinned))
    assert "recompute='full'" in str(err.value)
    assert "hierarchical" not in str(err.value)  # executable: only what is not


@pytest.mark.timeout(60)
def test_plan_marks_unexecutable_features(gpt_tiny, no_full_recompute) -> None:
    model, inputs, _ = gpt_tiny
    plan = ah.plan(model, ah.Cluster.local(1), inputs,
                   constraints=ah.Constraints(recompute="full"))
    assert plan.recompute == "full" and plan.executable is False
    assert any("recompute='full'" in r for r in plan.not_executable_because)
    assert Plan.from_json(plan.to_json()).executable is False
    with pytest.raises(ah.NotExecutableError, match="recompute='full'"):
        ah.compile(model, ah.Cluster.local(1), inputs, loss_fn=_loss, plan=plan)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("planned_on", ["cpu", "meta"])
def test_saved_plan_is_reused_by_compile(gpt_tiny, tmp_path, planned_on) -> None:
    model, inputs, targets = gpt_tiny
    eager = copy.deepcopy(model)
    planner_model = models.preset("gpt-tiny", device=None if planned_on == "cpu" else "meta")
    planner_inputs, _ = models.example_batch("gpt-tiny", 4, device=planned_on)
    plan = ah.plan(planner_model, ah.Cluster.local(1), planner_inputs,
                   constraints=ah.Constraints(num_microbatches=2))
    path = tmp_path / "plan.json"
    plan.to_json(path)
    compiled = ah.compile(model, ah.Cluster.local(1), inputs, loss_fn=_loss,
                          example_targets=targets, plan=Plan.from_json(path),
                          optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert compiled.plan == plan and compiled.plan.num_microbatches == 2
    loss = compiled.train_step(inputs, targets)
    want = _loss(eager(*inputs), targets)
    torch.testing.assert_close(loss, want.detach())
    want.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p.detach(), (q - 0.1 * q.grad).detach(), msg=name)


@pytest.mark.timeout(60)
def test_plan_for_another_model_is_refused_naming_both_hashes(gpt_tiny) -> None:
    model, inputs, targets = gpt_tiny
    other = models.preset("gpt-tiny", hidden=64)
    plan = ah.plan(other, ah.Cluster.local(1), inputs)
    mine = capture(model, inputs, with_loss=False).hash
    assert plan.model_hash != mine
    # refused before capture, by the parameter names and shapes the plan records
    with pytest.raises(ah.PlanError) as err:
        ah.compile(model, ah.Cluster.local(1), inputs, loss_fn=_loss, example_targets=targets,
                   plan=plan)
    assert plan.model_hash in str(err.value) and plan.params_hash in str(err.value)
    assert params_hash(model) in str(err.value)
    # a plan without them (written before they were recorded): by the graph hashes
    with pytest.raises(ah.PlanError) as err:
        ah.compile(model, ah.Cluster.local(1), inputs, loss_fn=_loss, example_targets=targets,
                   plan=dataclasses.replace(plan, params_hash=None))
    assert plan.model_hash in str(err.value) and mine in str(err.value)


@pytest.mark.timeout(60)
def test_plan_for_another_world_size_is_refused(gpt_tiny) -> None:
    model, inputs, targets = gpt_tiny
    plan = ah.plan(model, ah.Cluster.local(2), inputs)
    with pytest.raises(ah.PlanError) as err:
        ah.compile(model, ah.Cluster.local(1), inputs, loss_fn=_loss, example_targets=targets,
                   plan=plan)
    assert "2 ranks" in str(err.value) and "cluster has 1" in str(err.value)
    with pytest.raises(ah.PlanError, match="must be an ah.Plan"):
        ah.compile(model, ah.Cluster.local(1), inputs, loss_fn=_loss, plan=plan.to_dict())
