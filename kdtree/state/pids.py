"""Whether the process that wrote a record is still alive: pids are comparable only inside one pid namespace, and a
pid may be reused (the start time in clock ticks tells them apart)."""

from __future__ import annotations

import os
from pathlib import Path


def own_pid_ns() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def pid_exists(pid: int) -> bool:
    """The process exists (a signal 0 reaches it, or it is another user's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks since boot) of a pid in our namespace; None when gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2 :].split()  # the command name may hold spaces and parentheses
    return fields[0].decode(), int(fields[19])


def pid_alive(pid: int, start_ticks: int | None) -> bool:
    """The process is there, not a zombie, and (when start_ticks is known) the same one as recorded."""
    stat = proc_stat(pid)
    if stat is None:
        if Path("/proc/self/stat").exists():
            return False
        return pid_exists(pid)  # no procfs: a plain existence check
    state, ticks = stat
    if state in ("Z", "X"):
        return False
    return start_ticks is None or ticks == start_ticks
