"""A failed rank ends the whole job within a bound, naming that rank and its last step.

Process-free first: which rank `culprit` blames from what the ranks reported
(runtime/failures.py), which exceptions count as communication errors, and the errors'
messages. Then jobs on 4 gloo ranks whose rank 2 fails in its second train_step (gpt-tiny
compiled under pp2×dp2 or dp2×tp2: meshes with axes smaller than the world, whose groups
once waited torch's 30-minute default for a rank that stopped responding), with
AUTOHYBRID_COLLECTIVE_TIMEOUT_S at 10 s:

- rank 2 sleeps: `RankUnresponsive` for rank 2 (not rank 0, whose timeout arrived
  first), after 1 completed train_step, with its stack at the sleep;
- rank 2 exits (`os._exit(1)`) or is SIGKILLed: `RankFailure` for rank 2 with its exit
  code (not rank 1, whose "Connection reset by peer" arrived first);
- `max_restarts`: a job failing on its first attempt only returns the second's results,
  (AUTOHYBRID_RESTART_COUNT 1); one failing every time raises after N + 1 attempts;
- under torchrun, a script using ah.launch/ah.compile ends when rank 2 is SIGKILLed or
  sleeps (the others' collective timeouts end a sleeping rank's peers; torchrun the rest).

Every job leaves no process behind (recorded pids, and /proc for the test's children).
Time limits are hang guards (tests/_limits.guard): without the fixes the sleeping rank's
peers wait 30 minutes and the guard fails the test.
"""
from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import autohybrid as ah
from _limits import guard
from _pool import launch
from _procs import is_dead, live_children
from autohybrid.runtime.failures import Failure, culprit, in_collective, is_peer_error

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = "10"  # AUTOHYBRID_COLLECTIVE_TIMEOUT_S for the jobs here
MESHES = {"pp2xdp2": dict(pp=2, dp=2, tp=1), "dp2xtp2": dict(pp=1, dp=2, tp=2)}


# ---------------------------------------------------------------------- process-free
def _f(rank: int, when: float, kind: str) -> Failure:
    return Failure(rank, when, kind, f"rank {rank} {kind}")


def test_culprit_prefers_a_rank_own_failure_over_earlier_peer_errors():
    failures = [_f(1, 1.0, "peer"), _f(3, 1.5, "peer"), _f(2, 2.0, "died")]
    assert culprit(failures, [], {}).rank == 2
    failures = [_f(0, 1.0, "peer"), _f(2, 3.0, "error"), _f(1, 4.0, "error")]
    verdict = culprit(failures, [3], {})
    assert (verdict.rank, verdict.unresponsive, verdict.failure.kind) == (2, False, "error")


def test_culprit_blames_a_running_rank_when_all_failures_are_peer_errors():
    failures = [_f(0, 1.0, "peer"), _f(3, 1.1, "peer")]
    # fewest completed steps first, then a rank not waiting in a collective, then rank
    assert culprit(failures, [1, 2], {1: 4, 2: 3}).rank == 2
    assert culprit(failures, [1, 2], {1: 3, 2: 3}, waiting=[1]).rank == 2
    assert culprit(failures, [1, 2], {1: 3, 2: 3}).rank == 1
    assert culprit(failures, [2], {}).unresponsive
    # nobody left running: every rank timed out alike, the earliest is named
    verdict = culprit([_f(2, 2.0, "peer"), _f(1, 1.0, "peer")], [], {})
    assert (verdict.rank, verdict.unresponsive) == (1, False)


def test_peer_errors_are_told_from_a_rank_own_errors():
    reset = RuntimeError("[gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:1234: "
                         "Connection reset by peer")
    timed_out = RuntimeError("[gloo/unbound_buffer.cc:78] Timed out waiting 10000ms for recv")
    assert is_peer_error(reset) and is_peer_error(timed_out)
    try:  # wrapped, as train_step wraps torch's errors in StepFailure
        try:
            raise timed_out
        except RuntimeError as exc:
            raise ah.AutohybridError("train_step failed at node 'all_reduce'") from exc
    except ah.AutohybridError as wrapped:
        assert is_peer_error(wrapped)
    assert not is_peer_error(ValueError("boom")) and not is_peer_error(None)
    assert in_collective('  File "/x/torch/distributed/distributed_c10d.py", line 3 in wait')
    assert not in_collective('  File "/tmp/main.py", line 22 in main')


def test_rank_failure_names_rank_and_last_step_and_survives_pickling():
    err = ah.RankFailure(2, "Traceback ...\nValueError: boom", 1, last_step=3)
    assert str(err).startswith("rank 2 failed after 3 completed train_steps:")
    hung = ah.RankUnresponsive(2, "its stack", None, last_step=1)
    assert isinstance(hung, ah.RankFailure)
    assert str(hung).startswith("rank 2 stopped responding after 1 completed train_step:")
    back = pickle.loads(pickle.dumps(hung))
    assert type(back) is ah.RankUnresponsive and (back.rank, back.last_step) == (2, 1)
    assert str(ah.RankFailure(0, "x")).startswith("rank 0 failed:")


# ---------------------------------------------------------------------- helpers
def _record_pid(tmp: str, rank: int) -> None:
    attempt = os.environ.get("AUTOHYBRID_RESTART_COUNT", "x")
    Path(tmp, f"a{attempt}-rank{rank}.pid").write_text(str(os.getpid()))


def _assert_no_process_left(tmp: Path) -> None:
    pids = [int(p.read_text()) for p in tmp.glob("*.pid")]
    assert pids
    deadline = time.monotonic() + guard(5)
    while time.monotonic() < deadline and not all(is_dead(p) for p in pids):
        time.sleep(0.05)
    assert [p for p in pids if not is_dead(p)] == []
    assert live_children(os.getpid()) == []


def _fail(rank: int, how: str) -> None:
    if rank != 2:
        return
    if how == "sleep":
        time.sleep(600)
    elif how == "exit":
        os._exit(1)
    elif how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)


def _train_and_fail(rank: int, mesh: dict, how: str, tmp: str) -> int:
    """gpt-tiny under `mesh`; rank 2 fails `how` at the start of its second step."""
    import torch.nn.functional as F

    _record_pid(tmp, rank)
    torch.manual_seed(0)
    model = ah.models.preset("gpt-tiny")
    inputs, targets = ah.models.example_batch("gpt-tiny", 8)
    compiled = ah.compile(
        model, ah.Cluster.local(4), inputs,
        loss_fn=lambda y, t: F.cross_entropy(y.flatten(0, 1), t.flatten()),
        example_targets=targets, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
        constraints=ah.Constraints(**mesh))
    for step in range(3):
        if step == 1:
            _fail(rank, how)
        compiled.train_step(inputs, targets)
    return compiled.step


def _launch_failing(tmp_path: Path, monkeypatch, mesh: str, how: str) -> ah.RankFailure:
    monkeypatch.setenv("AUTOHYBRID_COLLECTIVE_TIMEOUT_S", TIMEOUT_S)
    with pytest.raises(ah.RankFailure) as info:
        ah.launch(_train_and_fail, ah.Cluster.local(4),
                  args=(MESHES[mesh], how, str(tmp_path)), timeout_s=guard(60))
    _assert_no_process_left(tmp_path)
    return info.value


# ---------------------------------------------------------------------- local launches
@pytest.mark.procs
@pytest.mark.timeout(90)
@pytest.mark.parametrize("mesh", ["pp2xdp2", "dp2xtp2"])
def test_a_rank_that_stops_responding_is_named_and_every_rank_ends(tmp_path, monkeypatch,
                                                                   mesh):
    err = _launch_failing(tmp_path, monkeypatch, mesh, "sleep")
    assert isinstance(err, ah.RankUnresponsive), err
    assert err.rank == 2 and err.last_step == 1, err
    assert str(err).startswith("rank 2 stopped responding after 1 completed train_step")
    assert "in _fail" in err.traceback_text  # its stack, at the sleep
    assert "AUTOHYBRID_COLLECTIVE_TIMEOUT_S" in str(err)


@pytest.mark.procs
@pytest.mark.timeout(90)
@pytest.mark.parametrize("mesh,how,code", [("pp2xdp2", "exit", 1),
                                           ("dp2xtp2", "sigkill", -signal.SIGKILL)])
def test_a_rank_that_exits_or_is_killed_is_named_not_its_neighbour(tmp_path, monkeypatch,
                                                                   mesh, how, code):
    err = _launch_failing(tmp_path, monkeypatch, mesh, how)
    assert type(err) is ah.RankFailure and err.rank == 2, err
    assert err.exitcode == code and err.last_step == 1, err
    assert "without reporting" in err.traceback_text and str(code) in str(err)


def _flaky(rank: int, tmp: str, always: bool) -> tuple[int, str, float]:
    """Rank 1 exits on the first attempt (every attempt if `always`); else an
    all-reduce, with the attempt number main saw."""
    _record_pid(tmp, rank)
    attempt = os.environ["AUTOHYBRID_RESTART_COUNT"]
    if rank == 1 and (always or attempt == "0"):
        time.sleep(0.2)
        raise ValueError(f"boom on attempt {attempt}")
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return rank, attempt, t.item()


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_max_restarts_starts_the_job_again_and_returns_the_run_that_succeeds(tmp_path):
    results = ah.launch(_flaky, ah.Cluster.local(3), args=(str(tmp_path), False),
                        max_restarts=2, timeout_s=guard(40))
    assert results == [(r, "1", 6.0) for r in range(3)]
    names = sorted(p.name for p in tmp_path.glob("*.pid"))
    assert names == [f"a{a}-rank{r}.pid" for a in (0, 1) for r in range(3)]
    _assert_no_process_left(tmp_path)


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_max_restarts_raises_the_last_failure_after_every_attempt(tmp_path):
    with pytest.raises(ah.RankFailure) as info:
        ah.launch(_flaky, ah.Cluster.local(3), args=(str(tmp_path), True),
                  max_restarts=2, timeout_s=guard(40))
    assert info.value.rank == 1 and "boom on attempt 2" in info.value.traceback_text
    assert "every attempt failed: 3 runs, max_restarts=2" in str(info.value)
    assert len({p.name.split("-")[0] for p in tmp_path.glob("*.pid")}) == 3
    _assert_no_process_left(tmp_path)
    with pytest.raises(ah.ClusterError, match="max_restarts"):
        ah.launch(_flaky, 2, max_restarts=-1)


# ---------------------------------------------------------------------- torchrun
TORCHRUN_SCRIPT = """
    import json, sys
    sys.path.insert(0, {tests!r})
    import autohybrid as ah
    from test_failures import MESHES, _fit_with_restarts, _train_and_fail

    how, tmp = sys.argv[1], sys.argv[2]
    if how == "sleep":
        ah.launch(_train_and_fail, ah.Cluster.from_env(), args=(MESHES["pp2xdp2"], how, tmp))
    else:  # rank 2 SIGKILLed in step 4 of the first attempt; torchrun restarts the job
        out = ah.launch(_fit_with_restarts, ah.Cluster.from_env(), args=(tmp, 4))[0]
        if out["rank"] == 0:
            json.dump({{k: out[k] for k in ("attempt", "start", "losses")}},
                      open(tmp + "/result.json", "w"))
"""


@pytest.mark.procs
@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["sigkill-restart", "sleep"])
def test_under_torchrun_a_killed_or_sleeping_rank_ends_the_job(tmp_path, how, straight_run):
    """A sleeping rank: the peers end by their collectives' bound and torchrun exits
    non-zero. A SIGKILLed rank under --max-restarts=1: torchrun ends the other ranks
    and starts the job again, whose fit(resume=True) resumes from the last complete
    checkpoint to the uninterrupted run's losses."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(TORCHRUN_SCRIPT.format(tests=str(REPO / "tests"))))
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOHYBRID_")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1",
               AUTOHYBRID_COLLECTIVE_TIMEOUT_S=TIMEOUT_S,
               AUTOHYBRID_CHECK_COLLECTIVE_DEVICES="1")  # as in every multi-process test
    pids = tmp_path / "pids"
    pids.mkdir()
    restarts = ["--max-restarts", "1"] if how == "sigkill-restart" else []
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", *restarts,
         "--nproc-per-node", "4", str(script), how, str(pids)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=guard(160))
    _assert_no_process_left(pids)
    if how == "sleep":  # the peers ended themselves, by their collectives' bound
        assert proc.returncode != 0, proc.stdout + proc.stderr
        assert len(list(pids.glob("*.pid"))) == 4
        assert "Timed out" in proc.stderr or "timed out" in proc.stderr.lower()
        return
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(list(pids.glob("a0-*.pid"))) == len(list(pids.glob("a1-*.pid"))) == 4
    resumed = json.loads((pids / "result.json").read_text())
    assert resumed["attempt"] == "1" and 1 <= resumed["start"] <= 4, resumed
    torch.testing.assert_close(torch.tensor(resumed["losses"]),
                               torch.tensor(straight_run()["losses"][resumed["start"]:]))


# ---------------------------------------------------------------------- restart + resume
class _KillingLoader:
    """The batches; on the first attempt rank 2 is SIGKILLed during the step of batch
    `kill_at` (a timer fires while train_step runs)."""

    def __init__(self, batches, rank: int, kill_at: int):
        self.batches, self.rank, self.kill_at = batches, rank, kill_at

    def __iter__(self):
        import threading
        for i, batch in enumerate(self.batches):
            if (i == self.kill_at and self.rank == 2
                    and os.environ.get("AUTOHYBRID_RESTART_COUNT") == "0"):
                threading.Timer(0.01, os.kill, (os.getpid(), signal.SIGKILL)).start()
            yield batch


def _fit_with_restarts(rank: int, tmp: str, kill_at: int | None) -> dict:
    Path(tmp).mkdir(exist_ok=True)
    """gpt-tiny under dp2×tp2 with AdamW and a schedule, fit to 6 steps with a checkpoint
    every step and resume=True: what a restarted job runs again from the start."""
    import torch.nn.functional as F
    from _equiv import zoo_batches

    _record_pid(tmp, rank)
    torch.manual_seed(0)
    model = ah.models.preset("gpt-tiny")
    batches = zoo_batches("gpt-tiny", 8, steps=6)
    compiled = ah.compile(
        model, ah.Cluster.local(4), batches[0][0],
        loss_fn=lambda y, t: F.cross_entropy(y.flatten(0, 1), t.flatten()),
        example_targets=batches[0][1], optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2),
        scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5),
        constraints=ah.Constraints(dp=2, tp=2, pp=1))
    loader = batches if kill_at is None else _KillingLoader(batches, rank, kill_at)
    result = compiled.fit(loader, steps=6, save_every=1, save_dir=Path(tmp, "ckpt"),
                          resume=True, log_every=None)
    return {"attempt": os.environ.get("AUTOHYBRID_RESTART_COUNT"), "rank": rank,
            "start": result.start_step, "losses": result.losses,
            "state": {k: v.detach().clone() for k, v in compiled.full_state_dict().items()}}


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """The uninterrupted run both restart tests compare with (on warm ranks), made once
    for the module, on first use."""
    made: list[dict] = []

    def run() -> dict:
        if not made:
            tmp = tmp_path_factory.mktemp("straight")
            made.append(launch(_fit_with_restarts, 4, args=(str(tmp), None),
                               timeout_s=guard(120))[0])
        return made[0]
    return run


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_a_killed_rank_restarts_the_job_which_resumes_to_the_uninterrupted_run(
        tmp_path, monkeypatch, straight_run):
    monkeypatch.setenv("AUTOHYBRID_COLLECTIVE_TIMEOUT_S", TIMEOUT_S)
    (tmp_path / "killed").mkdir()
    straight = straight_run()
    resumed = ah.launch(_fit_with_restarts, ah.Cluster.local(4),
                        args=(str(tmp_path / "killed"), 4), timeout_s=guard(200),
                        max_restarts=1)[0]
    _assert_no_process_left(tmp_path / "killed")
    assert resumed["attempt"] == "1" and straight["start"] == 0
    assert 1 <= resumed["start"] <= 4, resumed["start"]  # the last complete checkpoint
    torch.testing.assert_close(torch.tensor(resumed["losses"]),
                               torch.tensor(straight["losses"][resumed["start"]:]))
    for key, value in straight["state"].items():
        torch.testing.assert_close(resumed["state"][key], value)
