"""A worker killed by SIGKILL takes its vLLM engine processes with it; nothing runs on orphaned.

The prefill worker here; the decode worker's case is test_vllm_fresh_worker.py's last step, which
SIGKILLs a vLLM decode worker anyway (one engine start less).
"""

from __future__ import annotations

import pytest

from tests.procs import Etcd, alive, engine_processes, service, wait_until

pytestmark = pytest.mark.vllm


def test_a_sigkilled_vllm_prefill_worker_leaves_no_engine_process_behind(etcd: Etcd) -> None:
    worker = service("services.prefill_worker", "--etcd-endpoints", etcd.endpoint, "--namespace", "orphans-prefill",
                     "--engine", "vllm", "--kv-transfer", "nixl", name="prefill-worker")
    try:
        worker.wait_for(r"ready: ", 300)
        engines = engine_processes(worker.popen.pid)
        assert engines, "vLLM runs its engine in child processes"
        worker.kill()
        assert wait_until(lambda: not any(alive(p) for p in engines), 15), [p for p in engines if alive(p)]
    finally:
        worker.stop()
