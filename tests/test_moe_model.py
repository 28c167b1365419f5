"""The MoE zoo model and Hugging Face MoE experts in capture (process-free).

- the zoo's MoE decoder: presets at published sizes (parameter counts of Mixtral 8×7B and
  DeepSeek-V3), its experts initialized, its balance loss per sequence;
- its captured graph holds one `autohybrid::moe_experts` per MoE layer and is proven
  per-sample, balance loss included: the shards of any split of the batch add up to
  eager's loss (what data and expert parallelism and microbatches need); also captured
  on the meta device (planning at scale);
- Hugging Face Mixtral and Qwen2-MoE experts are captured as the op whatever experts
  implementation the model was built with, and the model's setting is restored; experts
  the op cannot compute are left alone, with the reason.
"""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import autohybrid as ah
from autohybrid import capture_moe
from autohybrid.capture import capture
from autohybrid.models import coverage
from autohybrid.models.moe import moe_loss
from autohybrid.passes import PassContext, run_passes
from autohybrid.passes.global_loss import global_loss
from autohybrid.plan import Mesh, Plan, RankPlacement

MOE_OP = "autohybrid.moe_experts.default"


def _op_nodes(gm) -> list:
    return [n for n in gm.graph.nodes if str(n.target) == MOE_OP]


def _tiny(**overrides):
    torch.manual_seed(0)
    return ah.models.preset("moe-tiny", **overrides).double()


def test_presets_have_the_published_sizes():
    sizes = {name: sum(p.numel() for p in ah.models.preset(name, device="meta").parameters())
             for name in ("mixtral-8x7b", "mixtral-8x22b", "deepseek-v3-style")}
    assert round(sizes["mixtral-8x7b"] / 1e9, 1) == 46.7        # Mistral AI: 46.7B
    assert round(sizes["mixtral-8x22b"] / 1e9) == 141           # Mistral AI: 141B
    assert 660e9 < sizes["deepseek-v3-style"] < 690e9           # DeepSeek-V3: 671B (MLA)


def test_experts_are_initialized_and_the_balance_loss_is_per_sequence():
    model = _tiny()
    experts = model.blocks[0].mlp.experts
    for w in (experts.gate_up_proj, experts.down_proj):
        assert torch.isfinite(w).all() and 0.015 < float(w.std()) < 0.025
    (ids,), targets = ah.models.example_batch("moe-tiny", 6)
    logits, aux = model(ids)
    assert aux.shape == (6,) and (aux > 0).all()
    for b in range(6):       # a sequence's balance loss does not depend on the others
        _, alone = model(ids[b:b + 1])
        torch.testing.assert_close(alone, aux[b:b + 1], rtol=1e-12, atol=1e-14)
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 96), targets.reshape(-1))
    torch.testing.assert_close(moe_loss((logits, aux), targets), ce + aux.mean())
    assert isinstance(_tiny(aux_loss_coef=0.0)(ids), torch.Tensor)


def test_routes_past_an_experts_capacity_in_a_sequence_are_dropped():
    """capacity = ceil(1.0 · T=4 · k=2 / E=4) = 2 routes per expert and sequence; first
    choices queue before second ones, each in token order."""
    moe = _tiny(capacity_factor=1.0).blocks[0].mlp
    index = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0],      # sequence 0
                          [1, 0], [1, 0], [2, 3], [2, 3]])     # sequence 1
    weights = torch.full((8, 2), 0.5, dtype=torch.float64)
    routed, kept = moe._within_capacity(index, weights, 2, 4)
    # sequence 0: expert 0's third first choice (token 2) and token 3's second choice drop
    assert routed.tolist() == [[0, 1], [0, 2], [4, 1], [3, 4],
                               [1, 0], [1, 0], [2, 3], [2, 3]]
    assert kept.tolist() == [[0.5, 0.5], [0.5, 0.5], [0.0, 0.5], [0.5, 0.0]] + [[0.5] * 2] * 4
    with pytest.raises(ah.ModelError, match="capacity_factor"):
        _tiny(capacity_factor=0)


def _plan(dp: int, count: int) -> Plan:
    return Plan(model_hash="test", cluster="test", cluster_hash="test", mesh=Mesh(dp=dp),
                placement=tuple(RankPlacement(rank=r, node=0, device=r) for r in range(dp)),
                global_batch=dp * count * 2, microbatch_size=2, num_microbatches=count)


def test_captured_graph_splits_over_the_batch_like_eager():
    model = _tiny(shared=1, score="sigmoid", routed_scale=2.0)
    (ids,), targets = ah.models.example_batch("moe-tiny", 8, seed=3)
    cap = capture(model, (ids[:4],), moe_loss, targets[:4])
    assert len(_op_nodes(cap.gm)) == 2
    rewritten = None
    for dp, count in [(2, 1), (1, 2), (2, 2)]:
        plan = _plan(dp, count)
        ctx = PassContext(plan=plan, rank=0, coords=plan.mesh.coords(0), graph_kind="train")
        ctx.notes["loss_output_index"] = cap.user_outputs[0]
        rewritten = run_passes(cap.gm, ctx, [("global_loss", global_loss)])
        assert ctx.notes["loss_kind"] == "mean"
    outputs = [*cap.user_outputs, len(cap.mutated_buffers) + len(cap.user_outputs)]
    program = dataclasses.replace(cap, gm=rewritten, user_outputs=outputs)
    state = cap.default_state(model)
    want = moe_loss(copy.deepcopy(model)(ids), targets).detach()
    for split in ([slice(0, 8)], [slice(0, 3), slice(3, 8)], [slice(0, 1), slice(1, 6),
                                                               slice(6, 8)]):
        parts = [program.run(state, (ids[s],), (targets[s],)) for s in split]
        got = sum(n for n, _ in parts) / sum(d for _, d in parts)
        torch.testing.assert_close(got.detach(), want, rtol=1e-12, atol=1e-12)


def test_captures_on_the_meta_device():
    model = ah.models.preset("moe-tiny", device="meta", layers=3)
    (ids,), targets = ah.models.example_batch("moe-tiny", 4, device="meta")
    cap = capture(model, (ids,), moe_loss, targets)
    assert len(_op_nodes(cap.gm)) == 3


needs_hf = pytest.mark.skipif(not coverage.have_transformers(), reason="transformers")


@needs_hf
@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_hugging_face_experts_are_captured_as_the_op(name):
    case = coverage._hf_case(name)
    model = case.model.double()
    inputs, targets = case.batches[0]
    before = model.config._experts_implementation
    assert capture_moe.skipped(model) == {}
    cap = capture(model, inputs, None, targets)
    assert len(_op_nodes(cap.gm)) == model.config.num_hidden_layers
    assert model.config._experts_implementation == before       # restored
    ids = inputs[0]
    torch.testing.assert_close(cap.run(cap.default_state(model), (ids,), (targets,)),
                               model(ids, labels=targets).loss)


@needs_hf
def test_experts_the_op_cannot_compute_are_left_as_they_are():
    case = coverage._hf_case("mixtral")
    model = case.model.double()
    inputs, targets = case.batches[0]
    first = model.model.layers[0].mlp.experts
    first.has_bias = True                # as if its projections had biases
    assert capture_moe.skipped(model) == {
        "model.layers.0.mlp.experts": "its projections have biases"}
    with capture_moe.routed_experts(model) as routed:
        # both layers read one config: switching it would route the biased one too
        assert routed == 0
        assert model.config._experts_implementation == "batched_mm"


def _ep_context(cap, dp: int, ep: int, zero: int = 0, rank: int = 1, tp: int = 1,
                sp: bool = False) -> PassContext:
    plan = dataclasses.replace(_plan(dp, 1), mesh=Mesh(dp=dp, tp=tp, sp=sp, ep=ep), zero=zero,
                               placement=tuple(RankPlacement(rank=r, node=0, device=r)
                                               for r in range(dp * tp)))
    ctx = PassContext(plan=plan, rank=rank, coords=plan.mesh.coords(rank), graph_kind="train")
    ctx.notes["loss_output_index"] = cap.user_outputs[0]
    return ctx


def test_expert_parallel_pass_slices_the_experts_and_names_the_axis():
    from autohybrid.passes.expert_parallel import expert_parallel
    model = _tiny()
    (ids,), targets = ah.models.example_batch("moe-tiny", 4)
    cap = capture(model, (ids,), moe_loss, targets)
    ctx = _ep_context(cap, dp=4, ep=2, rank=3)          # dp rank 3: ep rank 1
    gm = expert_parallel(copy.deepcopy(cap.gm), ctx)
    nodes = _op_nodes(gm)
    assert [n.args[7] for n in nodes] == ["ep", "ep"]
    specs = ctx.notes["param_shards"]
    assert sorted(specs) == sorted(f"blocks.{i}.mlp.experts.{w}" for i in range(2)
                                   for w in ("gate_up_proj", "down_proj"))
    assert {(s.axis, s.dim, s.ways, s.index, s.size) for s in specs.values()} == {
        ("ep", 0, 2, 1, 4)}
    for n in nodes:
        assert n.args[3].meta["val"].shape == (2, 48, 32)   # 2 of 4 experts, 2·24 rows
        assert n.args[4].meta["val"].shape == (2, 32, 24)


def test_under_ep_tensor_parallelism_slices_each_ranks_experts_again():
    """dp=2 × tp=2, ep=2, no sp: rank 3 (dp 1, tp 1) holds experts 2..3, of each the
    second half of the intermediate size; the op exchanges over ep and all-reduces over
    tp."""
    from autohybrid.passes.expert_parallel import expert_parallel
    model = _tiny()
    (ids,), targets = ah.models.example_batch("moe-tiny", 4)
    cap = capture(model, (ids,), moe_loss, targets)
    ctx = _ep_context(cap, dp=2, ep=2, rank=3, tp=2)
    assert ctx.coords == (0, 1, 1)
    gm = expert_parallel(copy.deepcopy(cap.gm), ctx)
    assert [(n.args[7], n.args[9]) for n in _op_nodes(gm)] == [("ep", "tp")] * 2
    specs = ctx.notes["param_shards"]
    assert {(s.axis, s.index, s.inner.axis, s.inner.dim, s.inner.index)
            for s in specs.values()} == {("ep", 1, "tp", 1, 1), ("ep", 1, "tp", 2, 1)}
    full = dict(model.named_parameters())["blocks.0.mlp.experts.gate_up_proj"].detach()
    local = specs["blocks.0.mlp.experts.gate_up_proj"].local(full)
    assert torch.equal(local, torch.cat([full[2:, 12:24], full[2:, 36:48]], 1))
    for n in _op_nodes(gm):
        assert n.args[3].meta["val"].shape == (2, 24, 32)
        assert n.args[4].meta["val"].shape == (2, 32, 12)
    # under sp the tp ranks hold other tokens: each ep rank's experts stay whole over tp
    whole = _ep_context(cap, dp=2, ep=2, rank=3, tp=2, sp=True)
    expert_parallel(copy.deepcopy(cap.gm), whole)
    assert all(s.inner is None for s in whole.notes["param_shards"].values())


def test_tensor_parallelism_slices_every_expert_where_its_ranks_share_the_tokens():
    """tp=2 without sp: tp rank 1 holds the second half of every expert's gate rows, of
    its up rows and of its down columns, and the op all-reduces over tp. Under sp (each
    tp rank its own tokens) or a tp not dividing the intermediate size (24): whole."""
    from autohybrid.passes.expert_parallel import expert_parallel
    model = _tiny()
    (ids,), targets = ah.models.example_batch("moe-tiny", 4)
    cap = capture(model, (ids,), moe_loss, targets)
    ctx = _ep_context(cap, dp=1, ep=1, rank=1, tp=2)
    gm = expert_parallel(copy.deepcopy(cap.gm), ctx)
    nodes = _op_nodes(gm)
    assert [(n.args[7], n.args[8], n.args[9]) for n in nodes] == [("", 1, "tp")] * 2
    specs = ctx.notes["param_shards"]
    assert {(k.rsplit(".", 1)[1], s.axis, s.dim, s.chunks, s.ways, s.index, s.size)
            for k, s in specs.items()} == {("gate_up_proj", "tp", 1, 2, 2, 1, 48),
                                           ("down_proj", "tp", 2, 1, 2, 1, 24)}
    full = dict(model.named_parameters())["blocks.0.mlp.experts.gate_up_proj"]
    local = specs["blocks.0.mlp.experts.gate_up_proj"].local(full.detach())
    assert torch.equal(local, torch.cat([full[:, 12:24], full[:, 36:48]], 1))
    for n in nodes:
        assert n.args[3].meta["val"].shape == (4, 24, 32)
        assert n.args[4].meta["val"].shape == (4, 32, 12)
    for whole in (_ep_context(cap, dp=1, ep=1, tp=2, sp=True),
                  _ep_context(cap, dp=1, ep=1, tp=5)):
        gm = expert_parallel(copy.deepcopy(cap.gm), whole)
        assert "param_shards" not in whole.notes
        assert all(n.args[3].meta["val"].shape == (4, 48, 32) for n in _op_nodes(gm))
    # an expert weight another op reads too: refused with the reason and what to pin
    gm = copy.deepcopy(cap.gm)
    weight = _op_nodes(gm)[0].args[3]
    with gm.graph.inserting_after(weight):
        gm.graph.call_function(torch.ops.aten.sum.default, (weight,))
    with pytest.raises(ah.PlanError, match=r"tensor parallelism of the experts \(tp=2\): the "
                                           r"gate_up weights .* also read by .*pin sp=True"):
        expert_parallel(gm, _ep_context(cap, dp=1, ep=1, tp=2))


def test_expert_slices_are_what_the_planner_counts():
    """A dry run of rank 1's program under ep=2, under tp=2 without sp (the experts
    split), both (ep's slices split again over tp) and under dp=2 (whole): every parameter's shape is its ShardSpec's, the
    elements are the planner's count, and the MoE layers exchange (a `moe_experts`
    collective each) exactly where ep or tp splits their experts; under tp the loss's
    cross-entropy over (batch, classes, seq) logits is vocabulary-parallel, as priced."""
    from autohybrid.runtime.dry_run import dry_run
    model = ah.models.preset("moe-tiny", device="meta")
    (ids,), targets = ah.models.example_batch("moe-tiny", 4, device="meta")
    for pinned, exchanging in ((dict(dp=2, ep=2, tp=1), True), (dict(dp=1, tp=2, sp=False),
                                                                 True),
                               (dict(dp=2, ep=1, tp=1), False),
                               (dict(dp=2, ep=2, tp=2, sp=False), True)):
        world = pinned["dp"] * pinned["tp"]
        report = dry_run(model, ah.Cluster.local(world), (ids,), moe_loss, (targets,), rank=1,
                         constraints=ah.Constraints(**pinned, pp=1, zero=0,
                                                    recompute="none", num_microbatches=1))
        assert report.bytes_match and not report.shape_mismatches, report.summary()
        moe = report.collectives.get("moe_experts", 0)
        assert moe == report.expected_collectives.get("moe_experts", 0), report.summary()
        assert (moe > 0) is exchanging and report.ok, report.summary()


def test_expert_tensor_parallelism_is_priced_as_it_runs(monkeypatch):
    """tp=2 without sp (2 local ranks), against the same plan priced as if tp left the
    experts whole: half the experts' parameters per rank, less compute, and the op's
    all-reduces."""
    from autohybrid.search import space
    model = ah.models.preset("moe-tiny", device="meta")
    (ids,), targets = ah.models.example_batch("moe-tiny", 8, device="meta")
    pinned = ah.Constraints(dp=1, tp=2, sp=False, pp=1, ep=1, zero=0, recompute="none",
                            num_microbatches=1)

    def plan():
        return ah.plan(model, ah.Cluster.local(2, device_type="cpu"), (ids,),
                       loss_fn=moe_loss, example_targets=targets, constraints=pinned)

    chosen = plan()
    split = chosen.predicted
    monkeypatch.setattr(space, "tensor_parallel_experts", lambda *a: False)
    whole = plan().predicted
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    width = torch.empty(0, dtype=getattr(torch, chosen.dtype)).element_size()
    assert whole.memory.params - split.memory.params == pytest.approx(
        experts / 2 * width, rel=1e-6)     # half the experts' elements per rank
    assert split.compute_s < whole.compute_s
    assert split.comm_s > whole.comm_s


@pytest.mark.parametrize("dp, ep, zero, why", [
    (3, 3, 0, "4 experts, which do not split over ep=3"),
    (2, 2, 3, "ZeRO-3"),
])
def test_expert_parallel_pass_refuses_with_a_reason(dp, ep, zero, why):
    from autohybrid.passes.expert_parallel import expert_parallel
    model = _tiny()
    (ids,), targets = ah.models.example_batch("moe-tiny", 6)
    cap = capture(model, (ids,), moe_loss, targets)
    with pytest.raises(ah.PlanError, match=why):
        expert_parallel(copy.deepcopy(cap.gm), _ep_context(cap, dp, ep, zero, rank=0))


def test_expert_parallelism_of_a_model_without_experts_is_refused():
    from autohybrid.passes.expert_parallel import expert_parallel
    torch.manual_seed(0)
    model = ah.models.preset("llama-tiny")
    (ids,), targets = ah.models.example_batch("llama-tiny", 4)
    cap = capture(model, (ids,), ah.models.spec.zoo_loss, targets)
    with pytest.raises(ah.PlanError, match="no MoE layer"):
        expert_parallel(copy.deepcopy(cap.gm), _ep_context(cap, 2, 2))


def test_all_to_all_is_priced_per_link_it_crosses():
    from autohybrid.cost import comm
    cluster = ah.Cluster.preset("dgx-h100", nodes=2)     # 8 GPUs and 8 NICs per node
    n = 64 * 2**20
    inside = comm.all_to_all(cluster, tuple(range(8)), n)
    alpha, beta = comm._link(cluster, tuple(range(8)), "all_to_all")
    assert inside == pytest.approx(7 * alpha + 7 / 8 * n * beta)
    both = comm.all_to_all(cluster, tuple(range(16)), n)
    a_out, b_out = comm._link(cluster, tuple(range(16)), "all_to_all")
    a_in, b_in = comm._link(cluster, tuple(range(8)), "all_to_all")
    # half the bytes cross the NICs while the other half stays in the node: the slower
    assert both == pytest.approx(max(7 * a_in + 7 / 16 * n * b_in, 8 * a_out + n / 2 * b_out))
    assert both > inside      # the network is the slower link
    assert comm.all_to_all(cluster, (0,), n) == 0.0


def test_chunks_hide_the_exchange_behind_the_experts_as_far_as_the_link_hides_it():
    from autohybrid.search.pricing import moe_exchange
    cluster = ah.Cluster.preset("dgx-h100", nodes=1)
    ranks, n = tuple(range(8)), 256 * 2**20
    one = moe_exchange(cluster, ranks, n, 0.01, pinned=1)
    d = __import__("autohybrid.cost.comm", fromlist=["x"]).all_to_all(cluster, ranks, n)
    assert one == (1, pytest.approx(2 * d), pytest.approx(2 * d))   # nothing overlaps
    chunks, forward, backward = moe_exchange(cluster, ranks, n, 0.01)
    assert chunks > 1 and forward < one[1] and backward < one[2]
    # a link that hides nothing: one chunk is best (more only pays latency)
    opaque = type("Opaque", (), {"link_for": cluster.link_for, "hidden_share":
                                 lambda self, r, k: 0.0,
                                 "devices_per_node": cluster.devices_per_node})()
    assert moe_exchange(opaque, ranks, n, 0.01)[0] == 1


def _ep4_plan(**extra):
    """A small moe-tiny planned at dp4 × ep4 on one H100 node (`extra`: ah.plan's)."""
    model = ah.models.preset("moe-tiny", device="meta", layers=2, hidden=64, heads=4,
                             experts=8, expert_hidden=256)
    (ids,), targets = ah.models.example_batch("moe-tiny", 16, device="meta")
    return ah.plan(model, ah.Cluster.preset("dgx-h100", nodes=1), (ids,), loss_fn=moe_loss,
                   example_targets=targets, constraints=ah.Constraints(dp=4, ep=4), **extra)


def test_a_skewed_router_makes_expert_parallelism_dearer():
    fair = _ep4_plan().predicted.step_time_s
    skewed = _ep4_plan(moe_load_skew=0.5).predicted.step_time_s
    assert skewed > fair
    with pytest.raises(ah.InputError, match="moe_load_skew"):
        _ep4_plan(moe_load_skew=-1)


def test_a_balanced_routers_sampling_noise_is_priced(monkeypatch):
    """routing_skew: the busiest of ep ranks' share of uniformly random routes over the
    mean, against a simulation of the multinomial; and the pricing charges it under ep
    even with `moe_load_skew=0` (more with fewer routes per rank)."""
    import numpy as np

    from autohybrid.search import pricing
    rng = np.random.default_rng(0)
    for ep, routes in ((2, 16), (2, 64), (4, 256), (8, 64), (8, 8192), (64, 128)):
        counts = rng.multinomial(ep * routes, [1 / ep] * ep, size=4000)
        simulated = counts.max(1).mean() / routes - 1
        assert pricing.routing_skew(routes, ep) == pytest.approx(simulated, rel=0.1), \
            (ep, routes)
    assert pricing.routing_skew(100, 1) == pricing.routing_skew(0, 8) == 0.0
    noisy = _ep4_plan().predicted.step_time_s
    monkeypatch.setattr(pricing, "routing_skew", lambda routes, ep: 0.0)
    exact = _ep4_plan().predicted.step_time_s
    assert noisy > exact


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_mixtral_on_64_gpus_is_planned_with_expert_parallelism_and_says_why():
    from autohybrid.report.text import format_plan
    model = ah.models.preset("mixtral-8x7b", device="meta")
    (ids,), targets = ah.models.example_batch("mixtral-8x7b", 64, device="meta")
    plan = ah.plan(model, ah.Cluster.preset("dgx-h100", nodes=8), (ids,), loss_fn=moe_loss,
                   example_targets=targets)
    assert plan.mesh.ep > 1 and plan.executable
    line = next(line for line in format_plan(plan).splitlines() if "experts" in line)
    assert f"split over ep = {plan.mesh.ep}" in line
    assert "the best plan without expert parallelism" in line and "% step time" in line


def test_expert_parallel_plans_round_trip_and_other_plans_keep_their_json():
    from autohybrid.plan import Constraints as C
    plain = _plan(4, 1)
    assert '"ep"' not in plain.to_json() and '"moe_chunks"' not in plain.to_json()
    plan = dataclasses.replace(plain, mesh=Mesh(dp=4, ep=2), moe_chunks=4)
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.hash() == plan.hash() != plain.hash()
    assert again.mesh.describe() == "pp1×dp4(ep2)×tp1"
    with pytest.raises(ah.PlanError, match="must divide mesh.dp"):
        Mesh(dp=4, ep=3)
    with pytest.raises(ah.PlanError, match="moe_chunks"):
        C(moe_chunks=0)
