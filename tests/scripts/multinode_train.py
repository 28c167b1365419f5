"""One training script for one node or several: run unchanged on every node under torchrun.

    python -m torch.distributed.run --nnodes 2 --nproc-per-node 2 --node-rank N \\
        --master-addr HOST --master-port PORT tests/scripts/multinode_train.py

(tests/test_multinode.py starts two such "nodes" on loopback.) The cluster comes from
torchrun's environment (`ah.Cluster.from_env`); each case compiles gpt-tiny in float64,
trains 3 SGD steps and compares losses, gathered gradients and parameters with eager
training of a copy on the whole batch. Then the placement: every rank gathers where each
rank really runs (torchrun's GROUP_RANK) and checks that the Plan's placement table says
the same, that each mesh axis group holds the ranks the Plan's mesh coordinates give, that
tp groups stay inside one node and that the axis the case names (dp or pp) crosses nodes.

Prints one line per rank and case; exits non-zero on any mismatch.
"""
from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/_equiv.py

import torch.distributed as dist  # noqa: E402

import autohybrid as ah  # noqa: E402
from _procs import torchrun_main  # noqa: E402
from _equiv import (OPTIMIZERS, Failures, compare_training, default_eager_loss,  # noqa: E402
                    lm_loss, zoo_batches, zoo_model)

AXES = ("pp", "dp", "tp")

#: (name, constraints, the axis whose groups must span nodes); None: the planner's choice.
CASES: tuple[tuple[str, ah.Constraints | None, str | None], ...] = (
    ("dp2×tp2", ah.Constraints(pp=1, dp=2, tp=2), "dp"),
    ("pp2×tp2", ah.Constraints(pp=2, dp=1, tp=2, schedule="1f1b", num_microbatches=2), "pp"),
    ("planner", None, None),
)


def expected_group(plan: ah.Plan, rank: int, axis: str) -> list[int]:
    """The ranks sharing every mesh coordinate of `rank` except `axis`'s."""
    keep = [i for i, a in enumerate(AXES) if a != axis]
    mine = plan.mesh.coords(rank)
    return [p.rank for p in plan.placement
            if all(plan.mesh.coords(p.rank)[i] == mine[i] for i in keep)]


def placement_problems(plan: ah.Plan, rank: int, groups: dict[str, Sequence[int]],
                       node_of: Sequence[int], cross: str | None) -> list[str]:
    """What is wrong with where `rank`'s mesh groups run (empty when nothing is).

    `groups`: axis -> the ranks of this rank's process group on that axis; `node_of[r]`:
    the node rank r really runs on; `cross`: an axis whose groups must span nodes.
    """
    problems = [f"plan places rank {p.rank} on node {p.node} but it runs on node "
                f"{node_of[p.rank]}" for p in plan.placement if node_of[p.rank] != p.node]
    for axis in AXES:
        expected = expected_group(plan, rank, axis)
        if sorted(groups[axis]) != expected:
            problems.append(f"{axis} group of rank {rank} is {sorted(groups[axis])}, the "
                            f"plan's mesh says {expected}")
    tp_nodes = {node_of[r] for r in groups["tp"]}
    if len(tp_nodes) != 1:
        problems.append(f"tp group {sorted(groups['tp'])} spans nodes {sorted(tp_nodes)}")
    if cross is not None and len({node_of[r] for r in groups[cross]}) < 2:
        problems.append(f"{cross} group {sorted(groups[cross])} stays on node "
                        f"{node_of[groups[cross][0]]}; it should span nodes")
    return problems


def _case(fails: Failures, cluster: ah.Cluster, rank: int, node_of: list[int], name: str,
          constraints: ah.Constraints | None, cross: str | None) -> str:
    """Compile, train and compare one case, check its placement; one line for the log."""
    batches = zoo_batches("gpt-tiny", 8)
    model = zoo_model("gpt-tiny")
    ref = copy.deepcopy(model)
    inputs0, targets0 = batches[0]
    compiled = ah.compile(model, cluster, inputs0, loss_fn=lm_loss, example_targets=targets0,
                          optimizer=OPTIMIZERS["sgd"], constraints=constraints)
    before = len(fails)
    compare_training(fails, name, compiled, ref, OPTIMIZERS["sgd"](list(ref.parameters())),
                     batches, default_eager_loss(lm_loss))
    numbers = "equal to eager" if len(fails) == before else "DIFFERS from eager"
    groups = {axis: dist.get_process_group_ranks(compiled.mesh.get_group(axis))
              for axis in AXES}
    for problem in placement_problems(compiled.plan, rank, groups, node_of, cross):
        fails.append(f"{name}: {problem}")
    where = " ".join(f"{axis}{sorted(groups[axis])}" for axis in AXES)
    return f"{name} ({compiled.plan.mesh.describe()}): {where}; {numbers}"


def main(rank: int, cluster: ah.Cluster) -> tuple[list[str], list[str]]:
    """This rank's log lines and failures."""
    fails = Failures()
    node_of: list[int] = [-1] * dist.get_world_size()
    dist.all_gather_object(node_of, int(os.environ["GROUP_RANK"]))
    nodes = sorted(set(node_of))
    per_node = {n: [r for r, m in enumerate(node_of) if m == n] for n in nodes}
    fails.check(f"Cluster.from_env() says {cluster.nodes} nodes × {cluster.devices_per_node} "
                f"but ranks run on nodes {per_node}",
                (cluster.nodes, cluster.devices_per_node) == (len(nodes), len(per_node[0]))
                and all(len(rs) == cluster.devices_per_node for rs in per_node.values()))
    fails.check(f"cluster.rank_location disagrees with where ranks run: {per_node}",
                all(cluster.rank_location(r)[0] == n for r, n in enumerate(node_of)))
    lines = [f"cluster {cluster.name}: {cluster.nodes} nodes × {cluster.devices_per_node}"]
    for name, constraints, cross in CASES:
        lines.append(_case(fails, cluster, rank, node_of, name, constraints, cross))
    return lines, fails


if __name__ == "__main__":
    torchrun_main(main, "multinode")
