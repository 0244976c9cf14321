"""A benchmark's side virtual environment (a baseline such as NVIDIA Dynamo, or a server kvmesh
does not depend on), made under .cache/bench on first use and kept; and its processes (the test
kit's `Proc`), started in a session of their own and stopped with it.

Not a dependency of kvmesh: where it cannot be installed (no package index, another CPU
architecture) `Unavailable` says why and the benchmark reports kvmesh alone.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from testkit.proc import ROOT, Proc

INSTALL_TIMEOUT_S = 900


class Unavailable(RuntimeError):
    """The side environment, or what runs in it, cannot run here; the message says why."""


def side_venv(name: str, installs: list[list[str]], what: str) -> Path:
    """The interpreter of .cache/bench/`name`, made by one `pip install` per list of arguments in
    `installs` the first time (printed: it may take minutes)."""
    venv = ROOT / ".cache" / "bench" / name
    interpreter = venv / "bin" / "python"
    stamp = venv / ".installed"
    if stamp.exists():
        return interpreter
    print(f"{what}: installing into {venv} (first run only) ...", flush=True)
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    steps = [[sys.executable, "-m", "venv", str(venv)],
             *([str(interpreter), "-m", "pip", "install", "-q", *args] for args in installs)]
    for step in steps:
        try:
            done = subprocess.run(step, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            raise Unavailable(f"installing {what} took over {INSTALL_TIMEOUT_S}s") from exc
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise Unavailable(f"cannot install {what}: " + " / ".join(tail))
    stamp.touch()
    return interpreter


@contextmanager
def started(argv: list[str], env: dict[str, str] | None, name: str, cwd: Path | None = None) -> Iterator[Proc]:
    """`argv` running in a process group of its own (its output kept apart, in a temporary log
    file); Unavailable when it exits at once; the group stopped (SIGTERM, then SIGKILL) at the end."""
    handle, log = tempfile.mkstemp(prefix=f"kvmesh-bench-{name}-", suffix=".log")
    os.close(handle)
    try:
        proc = Proc(argv, name, env, log=Path(log), cwd=cwd, group=True)
        try:
            time.sleep(0.2)
            if not proc.alive:
                raise Unavailable(f"{name} exited at start: {proc.tail(20)[-500:]}")
            yield proc
        finally:
            proc.stop(15)
    finally:
        os.unlink(log)
