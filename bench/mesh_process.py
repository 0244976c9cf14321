"""Starting and stopping a whole local mesh (services.launch) for a benchmark."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from services.mesh.net import free_port


@contextmanager
def launched(*flags: str, timeout_s: float = 180) -> Iterator[str]:
    """Yields the mesh's base URL (http://127.0.0.1:PORT) once it is READY; stops it afterwards."""
    port = free_port()
    argv = [sys.executable, "-m", "services.launch", "--http-port", str(port), "--log-level", "WARNING",
            "--prefill-workers", "0", *flags]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    try:
        for line in proc.stdout:
            if line.startswith("READY"):
                break
            if time.monotonic() > deadline:
                raise RuntimeError("the mesh did not become ready in time")
        else:
            raise RuntimeError(f"the mesh exited before READY (code {proc.wait()})")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
