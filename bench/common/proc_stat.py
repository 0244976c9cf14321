"""A process's /proc/<pid>/stat, read the one safe way: its command name may hold spaces and
parentheses, so the fields are those after the last ')' (the state first, then the parent)."""

from __future__ import annotations


def stat_fields(pid: int) -> list[str] | None:
    """The fields after the command name (index 0 the state, 1 the parent pid, 11 and 12 user
    and system CPU ticks); None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[-1].split()
    return fields or None


def running(pid: int) -> bool:
    """The process exists and has not exited (a zombie has)."""
    fields = stat_fields(pid)
    return fields is not None and fields[0] != "Z"
