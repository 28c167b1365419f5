"""/proc helpers shared by the tests that check no process is left behind."""
from __future__ import annotations

from pathlib import Path


def live_children(pid: int) -> list[int]:
    """Non-zombie processes whose parent is `pid`, except multiprocessing's resource
    tracker (started once per interpreter by spawn, not by launch) and the warm test
    ranks (tests/_pool.py, kept for the session on purpose)."""
    from _pool import pids as pool_pids

    warm = set(pool_pids())
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z" and b"resource_tracker" not in cmdline \
                and int(entry.name) not in warm:
            out.append(int(entry.name))
    return out


def is_dead(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def torchrun_main(main, label: str) -> None:
    """The body of a script torchrun starts on each rank (tests/scripts/*_train.py): run
    `main(rank, cluster)` → (lines, mismatches) under `ah.launch` on `Cluster.from_env()`,
    write the lines prefixed with `label`, the rank and its node, in one write (the ranks
    of a node share torchrun's stdout; print writes "\\n" apart), and exit 1 on a mismatch."""
    torchrun_mains({label: main})


def _each(rank: int, cluster, mains: dict) -> dict:
    return {label: main(rank, cluster) for label, main in mains.items()}


def torchrun_mains(mains: dict) -> None:
    """`torchrun_main` for several checks in one job (one start of the ranks, one process
    group), in order: label → main; each check's lines under its own label."""
    import os
    import sys

    import autohybrid as ah

    cluster = ah.Cluster.from_env()
    [results] = ah.launch(_each, cluster, args=(cluster, mains))
    rank, node = int(os.environ["RANK"]), int(os.environ["GROUP_RANK"])
    out, failed = [], False
    for label, (lines, fails) in results.items():
        prefix = f"{label} rank {rank} node {node} local {os.environ['LOCAL_RANK']}:"
        lines = lines + ([f"MISMATCH {line}" for line in fails] or ["OK"])
        out += [f"{prefix} {line}\n" for line in lines]
        failed = failed or bool(fails)
    os.write(sys.stdout.fileno(), "".join(out).encode())
    sys.exit(1 if failed else 0)
