"""Several nodes without change: one script under `torchrun --nnodes 2`, placement checked.

Two torchrun invocations on loopback (node ranks 0 and 1, two processes each) run the
same tests/scripts/multinode_train.py, which trains gpt-tiny on dp 2 × tp 2, pp 2 × tp 2
and the planner's own choice, compares with eager and checks that tp groups stay inside
a node and dp / pp groups cross nodes as the Plan says (in one job with
tests/test_hierarchical.py's check: tests/scripts/two_nodes_train.py, run once by
tests/conftest.py's `two_nodes_logs`). Before that, without processes:
how `Cluster.from_env` reads torchrun's environment on two nodes, where a plan made for
that cluster puts its groups, and that the script's placement check catches a bad one.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

import autohybrid as ah
from _limits import guard
from autohybrid.errors import ClusterError
from autohybrid.runtime.launch import free_port

from _equiv import lm_loss, wait_dead
from _procs import is_dead, live_children

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "multinode_train.py"
#: this file's check and tests/test_hierarchical.py's in one job (tests/conftest.py)
BOTH_SCRIPT = REPO / "tests" / "scripts" / "two_nodes_train.py"
NODES, PER_NODE = 2, 2
RUN_TIMEOUT_S = guard(100)  # both torchruns together; a normal run takes about 20 s on 2 cores
BOTH_TIMEOUT_S = guard(200)  # the two checks in one job: about 35 s on 2 cores
TAG = "AUTOHYBRID_TEST_MULTINODE_TAG"  # marks every process a run starts (for cleanup)


def _script():
    spec = importlib.util.spec_from_file_location("multinode_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


mt = _script()


def _torchrun_env(monkeypatch, rank: int, world: int = NODES * PER_NODE,
                  per_node: int = PER_NODE) -> None:
    """The variables torchrun gives worker `rank` of a node-by-node numbering."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name, value in {"RANK": rank, "LOCAL_RANK": rank % per_node, "WORLD_SIZE": world,
                        "LOCAL_WORLD_SIZE": per_node, "GROUP_RANK": rank // per_node,
                        "GROUP_WORLD_SIZE": world // per_node}.items():
        monkeypatch.setenv(name, str(value))


# ============================================================================ environment
@pytest.mark.parametrize("rank", range(NODES * PER_NODE))
def test_from_env_two_nodes_of_two(monkeypatch, rank):
    _torchrun_env(monkeypatch, rank)
    c = ah.Cluster.from_env()
    assert (c.nodes, c.devices_per_node, c.world_size) == (2, 2, 4)
    assert (c.name, c.backend, c.is_local) == ("torchrun:2x2", "gloo", False)
    assert c.rank_location(rank) == (rank // 2, rank % 2)
    assert c.same_node([2, 3]) and not c.same_node([1, 2])
    assert c.inter_link is not None and c.nics_per_node == 1
    monkeypatch.delenv("GROUP_WORLD_SIZE")  # nodes = WORLD_SIZE / LOCAL_WORLD_SIZE
    assert ah.Cluster.from_env() == c


def test_from_env_refuses_ranks_not_numbered_node_by_node(monkeypatch):
    _torchrun_env(monkeypatch, 1)
    monkeypatch.setenv("GROUP_RANK", "1")  # round-robin: rank 1 on node 1
    with pytest.raises(ClusterError, match=r"RANK=1 is not GROUP_RANK=1 × LOCAL_WORLD_SIZE=2"
                                           r" \+ LOCAL_RANK=1.*consecutive ranks"):
        ah.Cluster.from_env()
    monkeypatch.setenv("GROUP_RANK", "2")  # no node 2 of 2
    with pytest.raises(ClusterError, match="GROUP_RANK=2"):
        ah.Cluster.from_env()
    monkeypatch.setenv("GROUP_RANK", "-1")
    with pytest.raises(ClusterError, match=r"GROUP_RANK='-1' is not an integer >= 0"):
        ah.Cluster.from_env()
    monkeypatch.delenv("GROUP_RANK")  # not torchrun's full set: nothing to check
    assert ah.Cluster.from_env().nodes == 2


# ============================================================================ plans
def _plan(monkeypatch, constraints=None, **sizes) -> ah.Plan:
    _torchrun_env(monkeypatch, 0)
    model = ah.models.preset("gpt-tiny", device="meta", **sizes)
    (x,), y = ah.models.example_batch("gpt-tiny", 8, seq=sizes.get("seq"))
    return ah.plan(model, ah.Cluster.from_env(), (x,), loss_fn=lm_loss, example_targets=y,
                   constraints=constraints)


def _groups(plan: ah.Plan, rank: int) -> dict[str, list[int]]:
    return {axis: mt.expected_group(plan, rank, axis) for axis in mt.AXES}


def _node_ranks(node: int) -> list[int]:
    return list(range(node * PER_NODE, (node + 1) * PER_NODE))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("constraints,cross", [(ah.Constraints(pp=1, dp=2, tp=2), "dp"),
                                               (ah.Constraints(pp=2, dp=1, tp=2), "pp")],
                         ids=["dp2xtp2", "pp2xtp2"])
def test_pinned_plans_keep_tp_in_a_node(monkeypatch, constraints, cross):
    plan = _plan(monkeypatch, constraints)
    node_of = [rank // PER_NODE for rank in range(4)]
    assert [(p.rank, p.node, p.device) for p in plan.placement] == [
        (0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    for rank in range(4):
        groups = _groups(plan, rank)
        assert groups["tp"] == _node_ranks(rank // PER_NODE)
        assert mt.placement_problems(plan, rank, groups, node_of, cross) == []


@pytest.mark.timeout(60)
def test_the_planners_own_tp_stays_in_a_node(monkeypatch):
    """A GPT wide enough that the planner, unpinned, picks tp 2 on 2 nodes × 2: its tp
    groups are the two ranks of one node and its other axis (dp or pp) crosses nodes."""
    plan = _plan(monkeypatch, hidden=1024, heads=8, layers=4, vocab=4096, seq=128)
    assert plan.mesh.tp == 2, (f"the planner chose {plan.mesh.describe()} without tp; this "
                               "test needs a model for which it picks tp (a wider one?)")
    node_of = [rank // PER_NODE for rank in range(4)]
    cross = "dp" if plan.mesh.dp > 1 else "pp"
    for rank in range(4):
        assert mt.placement_problems(plan, rank, _groups(plan, rank), node_of, cross) == []


@pytest.mark.timeout(60)
def test_placement_check_catches_tp_across_nodes(monkeypatch):
    """What the script reports when ranks run elsewhere than the Plan says, when a group
    differs from the mesh, and when the axis that should cross nodes does not."""
    plan = _plan(monkeypatch, ah.Constraints(pp=1, dp=2, tp=2))
    round_robin = [0, 1, 0, 1]  # rank r on node r % 2
    problems = mt.placement_problems(plan, 0, _groups(plan, 0), round_robin, "dp")
    assert "plan places rank 1 on node 0 but it runs on node 1" in problems
    assert "tp group [0, 1] spans nodes [0, 1]" in problems
    assert "dp group [0, 2] stays on node 0; it should span nodes" in problems
    swapped = {"pp": [0], "dp": [0, 1], "tp": [0, 2]}
    problems = mt.placement_problems(plan, 0, swapped, [0, 0, 1, 1], "dp")
    assert "tp group of rank 0 is [0, 2], the plan's mesh says [0, 1]" in problems
    assert "tp group [0, 2] spans nodes [0, 1]" in problems


# ============================================================================ two nodes
def _tagged_pids(tag: str) -> list[int]:
    """Live processes whose environment carries `tag` (this run's torchruns and ranks)."""
    needle = f"{TAG}={tag}".encode()
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    out.append(int(entry.name))
    return [p for p in out if not is_dead(p)]


def _stop(procs: list[subprocess.Popen], tag: str) -> None:
    """SIGTERM each torchrun still running (it stops its ranks, which run in sessions of
    their own), then SIGKILL what is left: torchrun, and every process carrying this
    run's tag, by pid."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=guard(5))
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    for pid in _tagged_pids(tag):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _run_two_nodes(tmp_path: Path, script: Path = SCRIPT,
                   timeout_s: float = RUN_TIMEOUT_S) -> list[str]:
    """Start both torchruns of `script`, wait for both (or the first failure, or
    `timeout_s`), clean up; the two logs (tests/test_hierarchical.py runs its own)."""
    tag, port = uuid.uuid4().hex, free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOHYBRID_")}
    env.update({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", TAG: tag,
                "AUTOHYBRID_COLLECTIVE_TIMEOUT_S": "30",
                "AUTOHYBRID_CHECK_COLLECTIVE_DEVICES": "1"})  # as in every multi-process test
    procs: list[subprocess.Popen] = []
    try:
        for node in range(NODES):
            with open(tmp_path / f"node{node}.log", "w") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES),
                     "--nproc-per-node", str(PER_NODE), "--node-rank", str(node),
                     "--master-addr", "127.0.0.1", "--master-port", str(port), str(script)],
                    env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True))
        deadline = time.monotonic() + timeout_s
        while (any(p.poll() is None for p in procs) and time.monotonic() < deadline
               and not any(p.poll() for p in procs)):
            time.sleep(0.2)
        codes = [p.poll() for p in procs]
    finally:
        _stop(procs, tag)
    logs = [(tmp_path / f"node{node}.log").read_text() for node in range(NODES)]
    assert wait_dead(_tagged_pids(tag)) == [] and live_children(os.getpid()) == []
    assert codes == [0] * NODES, (f"torchrun exit codes {codes} (None: stopped while "
                                  f"running, after another failed or {timeout_s} s)\n"
                                  + "\n".join(
                                      f"--- node {n}:\n{_readable(log)}"
                                      for n, log in enumerate(logs)))
    return logs


def run_both_checks(tmp_path: Path) -> list[str]:
    """The two node logs of tests/scripts/two_nodes_train.py: this file's check and
    tests/test_hierarchical.py's, in one job (the fixture `two_nodes_logs` runs it once)."""
    return _run_two_nodes(tmp_path, BOTH_SCRIPT, BOTH_TIMEOUT_S)


def _readable(log: str, limit: int = 8000) -> str:
    """The log without the FutureWarnings torch prints for deprecated collectives."""
    lines = log.splitlines()
    noise = {i for i, line in enumerate(lines) if "FutureWarning" in line}
    noise |= {i + 1 for i in noise}
    return "\n".join(line for i, line in enumerate(lines) if i not in noise)[-limit:]


def _lines(log: str) -> dict[int, dict[str, str]]:
    """rank -> {"node": ..., case name or "cluster"/"OK": the rest of its line}."""
    out: dict[int, dict[str, str]] = {}
    for m in re.finditer(r"^multinode rank (\d) node (\d) local (\d): (\S+) ?(.*)$", log,
                         re.MULTILINE):
        rank, node, local, key, rest = m.groups()
        entry = out.setdefault(int(rank), {"node": node, "local": local})
        entry[key] = rest
    return out


def _group(line: str, axis: str) -> list[int]:
    return [int(r) for r in re.search(rf"\b{axis}\[([\d, ]+)\]", line).group(1).split(",")]


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_same_script_on_two_nodes_matches_eager_and_places_tp_in_a_node(two_nodes_logs):
    """Ground truth independent of the script: which torchrun printed a rank's line."""
    logs = two_nodes_logs
    for node, log in enumerate(logs):
        here = _node_ranks(node)
        ranks = _lines(log)
        assert sorted(ranks) == here, _readable(log)
        for rank, entry in ranks.items():
            assert (entry["node"], entry["local"]) == (str(node), str(rank % PER_NODE))
            assert "OK" in entry and entry["cluster"] == "torchrun:2x2: 2 nodes × 2", entry
            assert "MISMATCH" not in entry, _readable(log)
            for case, cross in (("dp2×tp2", "dp"), ("pp2×tp2", "pp"), ("planner", None)):
                line = entry[case]
                assert line.endswith("equal to eager"), line
                assert set(_group(line, "tp")) <= set(here), line
                if cross is not None:
                    assert _group(line, "tp") == here, line
                    assert {r // PER_NODE for r in _group(line, cross)} == {0, 1}, line
