"""Hierarchical and segmented dp all-reduce on two nodes: run on every node under torchrun.

    python -m torch.distributed.run --nnodes 2 --nproc-per-node 2 --node-rank N \\
        --master-addr HOST --master-port PORT tests/scripts/hierarchical_train.py

(tests/test_hierarchical.py starts two such "nodes" on loopback.) The cluster comes from
torchrun's environment (`ah.Cluster.from_env`: 2 nodes × 2). First the collectives of
autohybrid/runtime/collectives.py on a dp = 4 plan: the subgroups each rank gets (the
ranks of its node; the ranks with its local index on every node, checked against where
the ranks really run), then bit-for-bit equality with `dist.all_reduce` on integer-valued
tensors of several sizes and dtypes, synchronously and with several all-reduces in flight
as the reducer's buckets are. Then gpt-tiny in float64 compiled with dp over the 2 × 2
ranks and `collective_algorithm` "hierarchical" and "segmented", 3 steps of SGD and of
AdamW each, compared with eager (losses, gathered gradients and parameters).

Prints one line per rank and check; exits non-zero on any mismatch.
"""
from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/_equiv.py

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import autohybrid as ah  # noqa: E402
from autohybrid.plan import Mesh, Plan, RankPlacement  # noqa: E402
from autohybrid.runtime import collectives  # noqa: E402
from _procs import torchrun_main  # noqa: E402
from _equiv import (OPTIMIZERS, Failures, compare_training, default_eager_loss,  # noqa: E402
                    lm_loss, zoo_batches, zoo_model)

#: sizes not divisible by the node size (2), nor by the segments (4), nor by both × each
SIZES = (1, 2, 3, 5, 7, 8, 13, 100, 1001, 4099)
DTYPES = (torch.float32, torch.float64, torch.bfloat16)
#: (name, algorithm, segments): the hierarchical one, the plan's segmented one, and
#: segment counts that leave remainders
ALGORITHMS = (("hierarchical", "hierarchical", 1), ("segmented", "segmented", 4),
              ("segmented3", "segmented", 3))
#: (case, algorithm, optimizer, bucket MB): small buckets put several in flight at once
TRAIN = (("hier-sgd", "hierarchical", "sgd", 0.05), ("hier-adamw", "hierarchical", "adamw", 25.0),
         ("seg-sgd", "segmented", "sgd", 25.0), ("seg-adamw", "segmented", "adamw", 0.05))


def dp4_plan(cluster: ah.Cluster, algorithm: str) -> Plan:
    """A dp = 4 plan placed as the cluster places ranks (torchrun's order)."""
    return Plan(model_hash="", cluster=cluster.describe(), cluster_hash="", mesh=Mesh(dp=4),
                placement=tuple(RankPlacement(r, *cluster.rank_location(r))
                                for r in range(cluster.world_size)),
                global_batch=4, microbatch_size=1, num_microbatches=1,
                collective_algorithm=algorithm)


def _values(rank: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Integers in [-30, 30): their sums over 4 ranks are exact in every dtype."""
    g = torch.Generator().manual_seed(seed * 7919 + rank * 104729 + n)
    return torch.randint(-30, 30, (n,), generator=g).to(dtype)


def check_collectives(fails: Failures, cluster: ah.Cluster, rank: int,
                      node_of: list[int]) -> list[str]:
    """Subgroups and bit-for-bit sums; the log lines."""
    plan = dp4_plan(cluster, "hierarchical")
    h = collectives.build_hierarchy(plan, dist.group.WORLD)
    intra = dist.get_process_group_ranks(h.intra)
    inter = dist.get_process_group_ranks(h.inter)
    local = [r for r in range(len(node_of)) if node_of[r] == node_of[rank]]
    mine = local.index(rank)
    across = [[r for r in range(len(node_of)) if node_of[r] == n][mine]
              for n in sorted(set(node_of))]
    fails.check(f"intra-node group {intra}, expected the ranks of node {node_of[rank]}: {local}",
                sorted(intra) == local == list(h.intra_ranks))
    fails.check(f"inter-node group {inter}, expected local index {mine} of every node: {across}",
                sorted(inter) == across == list(h.inter_ranks))
    again = collectives.build_hierarchy(plan, dist.group.WORLD)  # built once, then reused
    fails.check("build_hierarchy made new groups the second time",
                again.intra is h.intra and again.inter is h.inter)
    checked = 0
    for name, algorithm, segments in ALGORITHMS:
        run = collectives.AllReduce(h, algorithm, segments)
        for dtype in DTYPES:
            for n in SIZES:
                t = _values(rank, n, dtype, 1)
                expected = t.clone()
                dist.all_reduce(expected)
                run(t)
                checked += 1
                fails.check(f"{name} {dtype} n={n}: differs from dist.all_reduce "
                            f"(max diff {(t.double() - expected.double()).abs().max()})",
                            torch.equal(t, expected))
        # several in flight, as the reducer's buckets: started in order, waited at the end
        tensors = [_values(rank, n, torch.float64, 2) for n in SIZES]
        expected = [t.clone() for t in tensors]
        for t in expected:
            dist.all_reduce(t)
        works = [run.start(t) for t in tensors]
        for w in works:
            w.wait()
        fails.check(f"{name}: all-reduces in flight together differ from dist.all_reduce",
                    all(torch.equal(a, b) for a, b in zip(tensors, expected)))
        # a 2-d, non-contiguous tensor
        t = _values(rank, 35, torch.float64, 3).view(5, 7).t()
        expected = t.contiguous()   # (collectives take contiguous tensors: NCCL's rule)
        dist.all_reduce(expected)
        collectives.hierarchical_all_reduce(t, h, segments)
        fails.check(f"{name}: non-contiguous tensor differs", torch.equal(t, expected))
    return [f"intra {sorted(intra)}", f"inter {sorted(inter)}",
            f"sums {checked} tensors bit-for-bit" + ("" if not fails else " MISMATCH")]


def train(fails: Failures, cluster: ah.Cluster, case: str, algorithm: str, optimizer: str,
          bucket_mb: float) -> str:
    batches = zoo_batches("gpt-tiny", 8)
    model = zoo_model("gpt-tiny")
    ref = copy.deepcopy(model)
    inputs0, targets0 = batches[0]
    compiled = ah.compile(model, cluster, inputs0, loss_fn=lm_loss, example_targets=targets0,
                          optimizer=OPTIMIZERS[optimizer],
                          constraints=ah.Constraints(dp=4, tp=1, pp=1, zero=0,
                                                     bucket_mb=bucket_mb,
                                                     collective_algorithm=algorithm))
    before = len(fails)
    compare_training(fails, case, compiled, ref, OPTIMIZERS[optimizer](list(ref.parameters())),
                     batches, default_eager_loss(lm_loss))
    numbers = "equal to eager" if len(fails) == before else "DIFFERS from eager"
    reducer = compiled.executor.reducer
    run = reducer.all_reduce
    fails.check(f"{case}: plan records {compiled.plan.collective_algorithm!r}",
                compiled.plan.collective_algorithm == algorithm)
    fails.check(f"{case}: the reducer runs the flat all-reduce",
                run is not None and run.algorithm == algorithm and not run.hierarchy.flat)
    where = (f"intra{list(run.hierarchy.intra_ranks)} inter{list(run.hierarchy.inter_ranks)}"
             if run is not None else "flat")
    return (f"{case} ({compiled.plan.mesh.describe()} {compiled.plan.collective_algorithm}, "
            f"{len(reducer.buckets)} buckets): {where}; {numbers}")


def main(rank: int, cluster: ah.Cluster) -> tuple[list[str], list[str]]:
    fails = Failures()
    node_of: list[int] = [-1] * dist.get_world_size()
    dist.all_gather_object(node_of, int(os.environ["GROUP_RANK"]))
    fails.check(f"cluster.rank_location disagrees with where ranks run: {node_of}",
                all(cluster.rank_location(r)[0] == n for r, n in enumerate(node_of)))
    lines = [f"cluster {cluster.name}: {cluster.nodes} nodes × {cluster.devices_per_node}"]
    lines += check_collectives(fails, cluster, rank, node_of)
    for case in TRAIN:
        lines.append(train(fails, cluster, *case))
    return lines, fails


if __name__ == "__main__":
    torchrun_main(main, "hierarchical")
