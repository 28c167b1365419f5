"""/proc helpers shared by the tests that check no process is left behind."""
from __future__ import annotations

from pathlib import Path


def live_children(pid: int) -> list[int]:
    """Non-zombie processes whose parent is `pid`, except multiprocessing's resource
    tracker (started once per interpreter by spawn, not by launch)."""
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
        if int(fields[1]) == pid and fields[0] != "Z" and b"resource_tracker" not in cmdline:
            out.append(int(entry.name))
    return out


def is_dead(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"
