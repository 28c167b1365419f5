"""Dry run at scale: rank 517's program for GPT-3 175B on 1024 GPUs, built in this process
(meta model, fake process group) and checked against the Plan; and, on gpt-tiny at tp 2,
the dry run's program equals the one the real runtime builds on each rank.
"""
from __future__ import annotations

import math
import time

import pytest
import torch
import torch.distributed as dist

import autohybrid as ah
from _limits import guard
from _pool import launch as pool_launch
from autohybrid.errors import AutohybridError, PlanError
from autohybrid.graph import VAL, op_name
from autohybrid.runtime.dry_run import dry_run, lm_loss, run_preset

LAYERS, HIDDEN, VOCAB = 96, 12288, 51200


@pytest.fixture(scope="module")
def gpt3():
    start = time.perf_counter()
    report = run_preset("gpt3-175b", ah.Cluster.preset("dgx-a100-80gb", nodes=128),
                        rank=517, global_batch=1536, tp=8)
    return report, time.perf_counter() - start


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_gpt3_175b_on_1024_gpus_is_built_in_one_process(gpt3):
    """The dry run's time is printed, not asserted (a benchmark's figure: ~35 s on a
    2-core VM); the timeout only catches a hang."""
    report, elapsed = gpt3
    print(report.summary(), f"\nbuilt in {elapsed:.1f} s")
    assert not dist.is_initialized()  # the fake process group is gone
    plan = report.plan
    assert (plan.world_size, plan.mesh.tp, plan.mesh.pp, plan.mesh.sp) == (1024, 8, 1, False)
    assert plan.dtype == "bfloat16" and report.coords == (0, 64, 5)
    assert report.ok, report.summary()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_gpt3_175b_rank_holds_the_planned_parameter_bytes(gpt3):
    report, _ = gpt3
    # the planner's local_params × 2 bytes, exactly (V = 51200 splits 8 ways unpadded)
    assert report.param_bytes == report.predicted_param_bytes
    assert report.param_bytes == report.graph_param_bytes  # captured in bfloat16
    assert report.param_elements == report.predicted_param_elements
    if report.plan.zero < 3:  # ZeRO-3 would also split the weights over dp
        assert report.predicted_memory_params == report.param_bytes
    # by hand: per block qkv, fc (+ biases) and both proj weights split 8 ways; proj
    # biases and LayerNorms whole; embedding (tied head) 6400 rows; positions whole
    h = HIDDEN
    block = (3 * h * h + 3 * h + h * h + 4 * h * h + 4 * h + 4 * h * h) // 8 + 2 * h + 4 * h
    assert report.param_elements == LAYERS * block + VOCAB // 8 * h + 2048 * h + 2 * h


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_gpt3_175b_rank_holds_shards_only(gpt3):
    report, _ = gpt3
    assert report.shape_mismatches == []
    shapes = report.local_shapes
    specs = report.program.param_shards
    assert shapes["blocks.0.attn.qkv.weight"] == (3 * HIDDEN // 8, HIDDEN)
    assert shapes["blocks.95.mlp.proj.weight"] == (HIDDEN, 4 * HIDDEN // 8)
    assert shapes["tok_emb.weight"] == (VOCAB // 8, HIDDEN)
    assert specs["tok_emb.weight"].index == 5  # rank 517 is tp rank 5
    full_qkv = 3 * HIDDEN * HIDDEN
    two_dim = {k: s for k, s in shapes.items() if len(s) == 2}
    # no whole weight matrix remains except the position embedding (2048 × h, replicated)
    assert set(two_dim) - set(specs) == {"pos_emb.weight"}
    largest = max(math.prod(s) for s in shapes.values())
    assert report.largest_full_param == ("tok_emb.weight", (VOCAB, HIDDEN))
    assert largest == VOCAB * HIDDEN // 8 < full_qkv / 5  # 1/8 of the largest weight
    assert max(math.prod(s) for k, s in shapes.items() if k != "tok_emb.weight") \
        == 4 * HIDDEN * HIDDEN // 8  # an MLP shard: 1/8 of the largest block weight


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_gpt3_175b_collectives_are_megatron_s(gpt3):
    report, _ = gpt3
    expected = {"tp_copy": 2 * LAYERS + 1,           # attention, MLP inputs; the head's input
                "tp_reduce": 2 * LAYERS + 1,         # attention, MLP outputs; the embedding
                "vocab_parallel_embedding": 1, "vocab_parallel_cross_entropy": 1}
    assert report.collectives == expected
    assert report.expected_collectives == expected
    assert "tp_gather" not in report.collectives  # the logits are never gathered
    reduces = [n for n in report.gm.graph.nodes if op_name(n) == "autohybrid.tp_reduce.default"]
    assert all(int(n.meta[VAL].shape[-1]) == HIDDEN for n in reduces)


# ---------------------------------------------------------------------- vs the runtime
def _runtime_program(rank: int, world: int):
    """What ah.compile builds on this rank of a real gloo job: plan and op list."""
    model = ah.models.preset("gpt-tiny")
    ids = torch.randint(0, 96, (4, 16))
    compiled = ah.compile(model, ah.Cluster.local(world), (ids,), loss_fn=lm_loss,
                          example_targets=(ids,), constraints=ah.Constraints(tp=2, sp=False))
    gm = compiled.graphs["train"]
    shapes = {n.meta.get("ah_param"): tuple(n.meta[VAL].shape) for n in gm.graph.nodes
              if n.op == "placeholder" and n.meta.get("ah_role") == "param"}
    return compiled.plan.to_json(), _ops(gm), shapes


def _ops(gm) -> list[str]:
    return [op_name(n) for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_gpt_tiny_dry_run_builds_the_runtime_s_program():
    world = 2
    results = pool_launch(_runtime_program, world, args=(world,),
                        timeout_s=guard(100))
    model = ah.models.preset("gpt-tiny", device="meta")
    ids = torch.zeros(1, 16, dtype=torch.long, device="meta")
    for rank, (plan_json, ops, shapes) in enumerate(results):
        report = dry_run(model, ah.Cluster.local(world), (ids,), lm_loss, (ids,),
                         plan=ah.Plan.from_json(plan_json), rank=rank)
        assert not dist.is_initialized()
        assert _ops(report.gm) == ops
        assert report.local_shapes == shapes
        assert report.ok, report.summary()
        assert report.collectives["tp_copy"] == 2 * 2 + 1


def test_dry_run_refuses_a_live_process_group_and_pipeline_plans():
    model = ah.models.preset("gpt-tiny", device="meta")
    ids = torch.zeros(1, 16, dtype=torch.long, device="meta")
    with pytest.raises(PlanError, match="pipeline or sequence"):
        dry_run(model, ah.Cluster.local(4), (ids,), lm_loss, (ids,), global_batch=4,
                constraints=ah.Constraints(tp=2, pp=2, sp=False))
    assert not dist.is_initialized()
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        with pytest.raises(AutohybridError, match="without a process group"):
            dry_run(model, ah.Cluster.local(2), (ids,), lm_loss, (ids,))
        assert dist.is_initialized()  # the caller's group is left alone
    finally:
        dist.destroy_process_group()
