"""Tests of autohybrid.runtime.launch: results, collectives, failures, cleanup, torchrun."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest
from _limits import guard
import torch
import torch
import torch.distributed as dist

from autohybrid.errors import ClusterError, RankFailure, RuntimeFailure
from autohybrid.runtime.launch import free_port, launch

from _procs import is_dead as _is_dead
from _procs import live_children as _live_children

REPO = Path(__file__).resolve().parents[1]


def _cluster(ws: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(world_size=ws, backend="gloo", device_type="cpu",
                                 is_local=True)


def _assert_all_dead(pids: list[int]) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not all(_is_dead(p) for p in pids):
        time.sleep(0.05)
    assert all(_is_dead(p) for p in pids), [p for p in pids if not _is_dead(p)]
    assert _live_children(os.getpid()) == []


def _record_pid(tmp: str, rank: int, name: str = "rank") -> None:
    Path(tmp, f"{name}{rank}.pid").write_text(str(os.getpid()))


def _recorded_pids(tmp: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(tmp.glob("*.pid"))]


# ---- rank functions (module level, so that spawn can pickle them) ----

def _info(rank: int, tag: str = "") -> dict:
    return {"rank": rank, "tag": tag, "pid": os.getpid(),
            "env": {k: os.environ.get(k) for k in
                    ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                     "MASTER_PORT", "AUTOHYBRID_LAUNCHED", "OMP_NUM_THREADS")},
            "threads": torch.get_num_threads(),
            "dist": (dist.get_rank(), dist.get_world_size(), dist.get_backend())}


def _all_reduce(rank: int) -> float:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _raise_on_rank2(rank: int, tmp: str) -> None:
    _record_pid(tmp, rank)
    if rank == 0:  # a grandchild that must die too
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        _record_pid(tmp, 0, "grandchild")
        Path(tmp, "grandchild0.pid").write_text(str(child.pid))
    if rank == 2:
        time.sleep(0.3)
        raise ValueError("boom from rank 2")
    if rank == 3:
        time.sleep(60)
    dist.all_reduce(torch.ones(1))  # blocks: rank 2 never joins
    time.sleep(60)


def _die_on_rank1(rank: int, how: str, tmp: str) -> int:
    _record_pid(tmp, rank)
    if rank == 1:
        if how == "exit3":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
    return rank


def _hang_on_rank1(rank: int, tmp: str) -> int:
    _record_pid(tmp, rank)
    if rank == 1:
        time.sleep(60)
    return rank


def _unpicklable(rank: int):
    return lambda: rank


# ---- tests ----

@pytest.mark.procs
@pytest.mark.timeout(60)
def test_results_in_rank_order_and_child_setup():
    out = launch(_info, _cluster(4), args=("x",))
    assert [o["rank"] for o in out] == [0, 1, 2, 3]
    assert all(o["tag"] == "x" for o in out)
    pids = {o["pid"] for o in out}
    assert len(pids) == 4 and os.getpid() not in pids
    for r, o in enumerate(out):
        env = o["env"]
        assert env["RANK"] == env["LOCAL_RANK"] == str(r)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "4"
        assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
        assert env["AUTOHYBRID_LAUNCHED"] == "1" and env["OMP_NUM_THREADS"] == "1"
        assert o["threads"] == 1
        assert o["dist"] == (r, 4, "gloo")
    assert len({o["env"]["MASTER_PORT"] for o in out}) == 1
    assert _live_children(os.getpid()) == []


@pytest.mark.procs
@pytest.mark.timeout(60)
@pytest.mark.parametrize("ws", [2, 4])
def test_all_reduce(ws):
    assert launch(_all_reduce, _cluster(ws)) == [ws * (ws + 1) / 2] * ws


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_int_world_size_one_still_uses_a_child():
    (out,) = launch(_info, 1)
    assert out["pid"] != os.getpid() and out["dist"] == (0, 1, "gloo")
    assert not dist.is_initialized()


@pytest.mark.timeout(60)
def test_inprocess_world_of_one(monkeypatch):
    monkeypatch.setenv("AUTOHYBRID_INPROCESS", "1")
    (out,) = launch(_info, 1, args=("y",))
    assert out["pid"] == os.getpid() and out["dist"] == (0, 1, "gloo")
    assert out["env"]["RANK"] == "0" and out["tag"] == "y"
    assert not dist.is_initialized() and "AUTOHYBRID_LAUNCHED" not in os.environ


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_a_fork_after_an_in_process_launch_does_not_free_the_parents_groups(monkeypatch,
                                                                           tmp_path):
    """The in-process launch's group (registered for the first-step bound,
    runtime/timeouts.py) must not be freed in the forked ranks of the next launch: a
    gloo group's destructor run there hung every rank before `main`."""
    monkeypatch.setenv("AUTOHYBRID_INPROCESS", "1")
    launch(_info, 1, args=("y",))
    monkeypatch.delenv("AUTOHYBRID_INPROCESS")
    with pytest.raises(RankFailure) as info:
        launch(_die_on_rank1, _cluster(2), args=("exit3", str(tmp_path)),
               timeout_s=guard(20))
    assert info.value.rank == 1 and info.value.exitcode == 3


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_spawn_start_method():
    assert launch(_all_reduce, _cluster(2), start_method="spawn") == [3.0, 3.0]


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_rank_exception_is_reported_fast_and_everything_is_killed(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        launch(_raise_on_rank2, _cluster(4), args=(str(tmp_path),))
    assert time.monotonic() - t0 < 15
    err = info.value
    assert err.rank == 2 and err.exitcode == 1
    assert "ValueError: boom from rank 2" in err.traceback_text
    assert "rank 2" in str(err) and "boom from rank 2" in str(err)
    pids = _recorded_pids(tmp_path)
    assert len(pids) == 5  # 4 ranks + rank 0's grandchild
    _assert_all_dead(pids)


@pytest.mark.procs
@pytest.mark.timeout(60)
@pytest.mark.parametrize("how,code", [("exit3", 3), ("sigkill", -signal.SIGKILL)])
def test_rank_death_reports_exit_code(tmp_path, how, code):
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        launch(_die_on_rank1, _cluster(3), args=(how, str(tmp_path)))
    assert time.monotonic() - t0 < 15
    assert info.value.rank == 1 and info.value.exitcode == code
    assert str(code) in str(info.value)
    _assert_all_dead(_recorded_pids(tmp_path))


@pytest.mark.procs
@pytest.mark.timeout(60)
@pytest.mark.parametrize("via_env", [False, True])
def test_timeout_kills_hanging_rank(tmp_path, monkeypatch, via_env):
    kwargs = {}
    if via_env:
        monkeypatch.setenv("AUTOHYBRID_LAUNCH_TIMEOUT_S", "1.5")
    else:
        kwargs["timeout_s"] = 1.5
    t0 = time.monotonic()
    with pytest.raises(RuntimeFailure) as info:
        launch(_hang_on_rank1, _cluster(2), args=(str(tmp_path),), **kwargs)
    assert time.monotonic() - t0 < 10
    assert not isinstance(info.value, RankFailure)
    assert "timed out" in str(info.value) and "[1]" in str(info.value)
    _assert_all_dead(_recorded_pids(tmp_path))


def _tensor_result(rank: int):
    return {"rank": rank, "grads": torch.full((3,), float(rank), requires_grad=True) * 2}


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_tensors_come_back_after_the_rank_exits():
    """A rank's tensors travel as bytes, not as handles to its shared memory (which went
    with the rank, so the parent got nothing: "exited with code 0 without reporting")."""
    results = launch(_tensor_result, 2)
    for rank, out in enumerate(results):
        assert out["rank"] == rank
        torch.testing.assert_close(out["grads"].detach(), torch.full((3,), 2.0 * rank))


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_unpicklable_result_is_a_rank_failure():
    with pytest.raises(RankFailure) as info:
        launch(_unpicklable, 2)
    assert info.value.rank in (0, 1) and "pickle" in info.value.traceback_text.lower()
    assert _live_children(os.getpid()) == []


@pytest.mark.timeout(60)
def test_world_size_mismatch_under_torchrun_env(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ClusterError, match=r"WORLD_SIZE=2.*world_size=4"):
        launch(_all_reduce, _cluster(4))
    assert not dist.is_initialized()


@pytest.mark.timeout(60)
def test_torchrun_like_env_runs_in_this_process(monkeypatch):
    monkeypatch.delenv("AUTOHYBRID_LAUNCHED", raising=False)
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(k, v)
    (out,) = launch(_info, _cluster(1))
    assert out["pid"] == os.getpid() and out["dist"] == (0, 1, "gloo")
    assert not dist.is_initialized()


TORCHRUN_SCRIPT = """
    import os, types
    import torch, torch.distributed as dist
    from autohybrid.errors import ClusterError
    from autohybrid.runtime.launch import launch

    def main(rank):
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        return (rank, t.item())

    cluster = types.SimpleNamespace(world_size=2, backend="gloo", device_type="cpu",
                                    is_local=True)
    rank = int(os.environ["RANK"])
    out = launch(main, cluster)
    assert out == [(rank, 3.0)], out
    try:
        launch(main, 3)
        mismatch = "no error"
    except ClusterError as e:
        mismatch = str(e)
    with open(f"rank{rank}.txt", "w") as f:  # one file per rank: stdout interleaves
        f.write(f"RESULT {out[0][1]}\\nMISMATCH {mismatch}\\n")
"""


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_same_script_under_torchrun(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(TORCHRUN_SCRIPT))
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOHYBRID_")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1",
               AUTOHYBRID_CHECK_COLLECTIVE_DEVICES="1")  # as in every multi-process test
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         "--nproc-per-node", "2", str(script)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=guard(50))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for r in (0, 1):
        text = (tmp_path / f"rank{r}.txt").read_text()
        assert "RESULT 3.0" in text
        assert "MISMATCH launch under torchrun: WORLD_SIZE=2" in text
        assert "world_size=3" in text


# ----------------------------------------------------------------------------- from_rank_zero
class _Unpicklable(Exception):
    def __reduce__(self):
        raise TypeError("not picklable")


def _from_rank_zero_rank(rank: int) -> dict:
    from autohybrid.blame import PassFailure
    from autohybrid.runtime.groups import from_rank_zero

    calls = []
    value = from_rank_zero(lambda: calls.append(rank) or {"rank": rank})
    out = {"value": value, "calls": calls, "raised": []}
    for exc in (PassFailure("pass 'zero' failed", "zero", "mm_3", "layers.0"),
                _Unpicklable("odd")):
        try:
            from_rank_zero(lambda exc=exc: (_ for _ in ()).throw(exc))
        except Exception as got:
            out["raised"].append((type(got).__name__, str(got),
                                  getattr(got, "pass_name", None), getattr(got, "node", None)))
    return out


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_from_rank_zero_runs_once_and_every_rank_gets_its_result_or_its_error():
    """What ah.compile's plan search runs through: computed on rank 0 only, its value
    on every rank; what it raises, raised on every rank with the same type and fields
    (or, when it cannot travel, an AutohybridError naming it)."""
    from _pool import launch as pool_launch

    results = pool_launch(_from_rank_zero_rank, 3, timeout_s=guard(30))
    assert [r["value"] for r in results] == [{"rank": 0}] * 3
    assert [r["calls"] for r in results] == [[0], [], []]
    for r in results:
        assert r["raised"] == [
            ("PassFailure", "pass 'zero' failed", "zero", "mm_3"),
            ("AutohybridError", "rank 0: _Unpicklable: odd", None, None)]
