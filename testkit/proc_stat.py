"""A process's /proc/<pid>/stat, read the one safe way: its command name may hold spaces and
parentheses, so the fields are those after the last ')' (the state first, then the parent).
Also its command line, its context switches and listening ports, for the tests and benchmarks."""

from __future__ import annotations

import os


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


def argv(pid: int) -> list[str]:
    """The process's command line, an argument each ([] when it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return []
    return raw.decode(errors="replace").split("\0")[:-1]


def running(pid: int) -> bool:
    """The process exists and has not exited (a zombie has)."""
    fields = stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def context_switches(pid: int) -> int:
    """Voluntary plus involuntary context switches of the process's threads so far (0 when gone)."""
    total = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                        total += int(line.split()[1])
    except OSError:
        return total
    return total


def listening_ports(pid: int) -> list[int]:
    """The TCP ports the process listens on (IPv4 and IPv6), from its sockets' inodes."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        return []
    ports = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                next(f)
                for line in f:
                    fields = line.split()
                    if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                        ports.append(int(fields[1].rsplit(":", 1)[1], 16))
        except OSError:
            continue
    return sorted(set(ports))


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time a process has used so far."""
    fields = stat_fields(pid)
    if fields is None:
        raise ProcessLookupError(f"process {pid} is gone")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def group_cpu_seconds(pid: int) -> float:
    """`cpu_seconds` of the process and of its children still running (a server that runs its
    work in a worker process, as granian does)."""
    total = cpu_seconds(pid)
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := stat_fields(int(entry))) is not None and fields[1] == str(pid):
            try:
                total += cpu_seconds(int(entry))
            except ProcessLookupError:
                continue  # exited since
    return total
