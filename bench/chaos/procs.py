"""Child processes for the chaos run: services and etcd, each a `Proc` of the test kit with its
output in a log file the run keeps (testkit/proc.py), waited for on the event loop: the load, the
faults and the metrics scraper share one loop. Every child gets the environment variable
`KVMESH_CHAOS_RUN=<namespace>`, so `leftovers` can find anything of the run still alive at the
end, even a grandchild that was reparented to init.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from testkit.proc import Proc
from testkit.proc_stat import argv as proc_argv
from testkit.proc_stat import stat_fields

RUN_MARKER = "KVMESH_CHAOS_RUN"


def spawn(name: str, role: str, argv: list[str], run_dir: Path, namespace: str,
          env: dict[str, str] | None = None) -> Proc:
    """Starts `argv` in the repository root with stdout and stderr in `run_dir/<name>.log`, with
    the run's marker and `env` on top of this process's environment."""
    return Proc(argv, name, {RUN_MARKER: namespace, **(env or {})}, log=run_dir / f"{name}.log", role=role)


@dataclass(frozen=True)
class Leftover:
    pid: int
    cmdline: str
    why: str


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def _ppid_and_state(pid: int) -> tuple[int, str]:
    fields = stat_fields(pid)
    return (int(fields[1]), fields[0]) if fields is not None and len(fields) > 1 else (0, "?")


def leftovers(namespace: str, our_pids: set[int]) -> list[Leftover]:
    """Live processes of this run: the namespace in their command line, the run's marker in
    their environment, or a parent that was one of our children."""
    found = []
    marker = f"{RUN_MARKER}={namespace}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        pid = int(entry.name)
        ppid, state = _ppid_and_state(pid)
        if state in ("Z", "X", "?"):
            continue
        cmdline = " ".join(proc_argv(pid))
        why = ""
        if namespace in cmdline:
            why = "command line names the run's namespace"
        elif marker in _read(entry / "environ").split(b"\0"):
            why = "environment carries the run's marker"
        elif ppid in our_pids:
            why = f"child of our process {ppid}"
        if why:
            found.append(Leftover(pid, cmdline[:200], why))
    return found
