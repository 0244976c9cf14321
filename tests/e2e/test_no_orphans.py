"""A worker killed by SIGKILL takes its vLLM engine processes with it; nothing runs on orphaned."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.worker.reaper import descendants
from tests.procs import Etcd, service, wait_until

pytestmark = pytest.mark.vllm


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def alive(pid: int) -> bool:
    try:
        state = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("State:"))
    except (OSError, StopIteration):
        return False
    return "zombie" not in state


@pytest.mark.parametrize("module", ["services.prefill_worker", "services.decode_worker"])
def test_a_sigkilled_vllm_worker_leaves_no_engine_process_behind(etcd: Etcd, module: str) -> None:
    worker = service(module, "--etcd-endpoints", etcd.endpoint, "--namespace", f"orphans-{module[9:]}",
                     "--engine", "vllm", "--kv-transfer", "nixl", name=module)
    try:
        worker.wait_for(r"ready: ", 300)
        # vLLM's engine processes, not the reaper the worker started beside them.
        engine_processes = {p for p in descendants(worker.popen.pid) if "reaper" not in cmdline(p)}
        assert engine_processes, "vLLM runs its engine in child processes"
        worker.kill()
        assert wait_until(lambda: not any(alive(p) for p in engine_processes), 15), \
            [p for p in engine_processes if alive(p)]
    finally:
        worker.stop()
