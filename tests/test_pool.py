"""The warm test ranks themselves (tests/_pool.py): process i serves rank i of every
world, a failed run ends every process of that run, and a process whose autohybrid code
a run patched is replaced before its next run (and only that one)."""
from __future__ import annotations

import os

import pytest

import autohybrid as ah
from _limits import guard
from _pool import launch, pids


def _whoami(rank: int, patch_rank: int = -1, fail_rank: int = -1) -> tuple:
    import torch.distributed as dist

    from autohybrid.runtime import launch as rt_launch

    if rank == fail_rank:
        raise ValueError("injected failure")
    patched = getattr(rt_launch.free_port, "_injected", False)
    if rank == patch_rank:
        def free_port():   # a function of an autohybrid module replaced, as bug tests do
            return 0
        free_port._injected = True
        rt_launch.free_port = free_port
    return (os.getpid(), rank, dist.get_world_size(), int(os.environ["WORLD_SIZE"]),
            patched)


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_one_set_of_warm_processes_serves_every_world_and_replaces_only_what_it_must():
    two = launch(_whoami, 2, timeout_s=guard(30))
    assert [r[1:4] for r in two] == [(0, 2, 2), (1, 2, 2)]
    three = launch(_whoami, 3, timeout_s=guard(30))
    assert [r[1:4] for r in three] == [(0, 3, 3), (1, 3, 3), (2, 3, 3)]
    assert [r[0] for r in three[:2]] == [r[0] for r in two]   # ranks 0, 1 reused
    assert set(pids()) >= {r[0] for r in three}

    launch(_whoami, 2, args=(1,), timeout_s=guard(30))          # rank 1 patches autohybrid
    after = launch(_whoami, 2, timeout_s=guard(30))
    assert after[0][0] == two[0][0] and after[1][0] != two[1][0]  # only rank 1 replaced
    assert [r[4] for r in after] == [False, False]                 # and the patch is gone

    with pytest.raises(ah.RankFailure) as failed:
        launch(_whoami, 3, args=(-1, 2), timeout_s=guard(30))     # rank 2 raises
    assert failed.value.rank == 2 and "injected failure" in str(failed.value)
    fresh = launch(_whoami, 3, timeout_s=guard(30))
    ended = {after[0][0], after[1][0], three[2][0]}       # the failed run's processes
    assert not {r[0] for r in fresh} & ended and not ended & set(pids())
