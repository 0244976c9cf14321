"""Two freshly started vLLM decode workers (their own mesh, started side by side), in three steps,
in this order: their very first requests; the one serving a stream is drained, handing the
stream over with its KV; the death of the one left under a structured-output stream. Two engine
starts serve all three (the suite's time goes to vLLM starts).

1. The first request is a 2-token prompt, and it is answered. On a CPU with AMX tiles such a first
   request killed the engine (vLLM's attention used AMX before anything had asked Linux for it;
   see services/engines/vllm_warmup.py): the worker left etcd and every request was a 503. The
   worker now warms its engine up before it registers. On a machine without AMX the old code
   answered too; the log assertions say the warm-up ran, and ran first.
2. A drained worker hands its greedy stream over (services/engines/vllm_moves.py): vLLM aborts
   it, prefills its tokens again from its prefix cache (only the last, partial block is
   computed) and holds the KV for the other worker, which pulls it over NIXL; the text equals the
   unmoved one's, and the processor counts no token recomputed.
3. A structured-output stream whose worker dies mid-output: the grammar cannot be resumed on
   another worker (vLLM starts a request's grammar at the beginning of its output), so the stream
   ends with an error event, and every character the client got still fits the grammar. The
   worker (with the NIXL connector, as a disaggregated decode worker has it) dies by SIGKILL, and
   takes its vLLM engine processes with it (test_no_orphans.py has the prefill worker's case).
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from testkit.metrics import value
from testkit.sse import Streamed
from tests.e2e.test_migration import act_after, stream
from tests.procs import MODEL, Etcd, Proc, ServiceMesh, alive, engine_processes, registered, service, wait_until

pytestmark = pytest.mark.vllm
# At least 300 characters before the model may end it: a few hundred tokens, well past the cut.
PATTERN = "[ab]{300,}"
# A greedy answer long enough to be drained mid-way.
MOVED_TOKENS = 120


@dataclass
class FreshWorkers:
    mesh: ServiceMesh
    # The workers still running, by instance id.
    workers: dict[str, Proc]


@pytest.fixture(scope="module")
def fresh(etcd: Etcd) -> Iterator[FreshWorkers]:
    mesh = ServiceMesh(etcd.endpoint)
    try:
        procs = [service("services.decode_worker", "--etcd-endpoints", mesh.etcd, "--namespace", mesh.namespace,
                         "--engine", "vllm", "--kv-transfer", "nixl", "--no-remote-prefill", "--drain-timeout", "8",
                         name=f"decode-worker-{i}") for i in range(2)]
        mesh.procs += procs
        ids = [proc.wait_for(r"decode-worker ready: (.+)$", 300).group(1).split()[0] for proc in procs]
        yield FreshWorkers(mesh, dict(zip(ids, procs, strict=True)))
    finally:
        mesh.stop()


def test_fresh_vllm_workers_first_requests_of_two_tokens_and_one_are_answered(fresh: FreshWorkers) -> None:
    mesh = fresh.mesh
    first = httpx.post(mesh.url("/v1/completions"), json={"model": MODEL, "prompt": "ab", "max_tokens": 4}, timeout=60)
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["usage"]["prompt_tokens"] == 2, body["usage"]
    assert body["usage"]["completion_tokens"] == 4 and body["choices"][0]["finish_reason"] == "length", body
    assert first.headers["x-kvmesh-worker"] in fresh.workers

    # The engines lived through it: the workers still serve (1 token now) and are still registered.
    again = httpx.post(mesh.url("/v1/completions"), json={"model": MODEL, "prompt": "a", "max_tokens": 2}, timeout=60)
    assert again.status_code == 200, again.text
    assert {w.instance_id for w in registered(mesh.etcd, mesh.namespace, "decode-worker")} == set(fresh.workers)
    assert all(worker.popen.poll() is None for worker in fresh.workers.values())

    # The warm-up ran, and before the worker registered.
    for worker in fresh.workers.values():
        lines = list(worker.lines)
        warmed = [i for i, line in enumerate(lines) if "vLLM warm-up: a 64-token prompt, then prompts of 1 and 2" in line]
        ready = [i for i, line in enumerate(lines) if "decode-worker ready: " in line]
        assert warmed and warmed[0] < ready[0], worker.tail()


def test_a_drained_vllm_worker_hands_its_stream_over_with_its_kv(fresh: FreshWorkers) -> None:
    prompt = "the stream that moves between vLLM workers"

    def drain(s: Streamed) -> None:
        fresh.workers[s.worker].popen.send_signal(signal.SIGTERM)

    moved = stream(fresh.mesh, prompt, act_after(5, drain), max_tokens=MOVED_TOKENS, temperature=0, ignore_eos=True)
    assert moved.error is None and moved.completion_tokens == MOVED_TOKENS, moved.error
    drained = fresh.workers.pop(moved.worker)
    processor = fresh.mesh.metrics("processor")
    assert value(processor, "kvmesh_processor_handoffs_total") == 1
    assert value(processor, "kvmesh_processor_resumed_tokens_recomputed_total") == 0
    (survivor,) = registered(fresh.mesh.etcd, fresh.mesh.namespace, "decode-worker")
    assert value(fresh.mesh.metrics("decode-worker"), "kvmesh_decode_moved_in_total", kv="pulled") == 1
    # Served start to finish by the survivor (while the drained worker exits), the same text.
    unmoved = stream(fresh.mesh, prompt, max_tokens=MOVED_TOKENS, temperature=0, ignore_eos=True)
    assert unmoved.worker == survivor.instance_id and "".join(moved.text) == "".join(unmoved.text)
    assert drained.popen.wait(60) == 0, drained.tail()
    recomputed = [int(m.group(1)) for line in drained.lines if (m := re.search(r"(\d+) of its \d+ tokens computed", line))]
    assert len(recomputed) == 1 and recomputed[0] < 32, drained.tail()  # its last, partial block (32 on CPU)


def test_a_structured_stream_whose_worker_dies_ends_with_an_error_never_invalid_text(fresh: FreshWorkers) -> None:
    (worker,) = fresh.workers.values()  # the one step 2 left
    engines = engine_processes(worker.popen.pid)
    assert engines, "vLLM runs its engine in child processes"
    broken = stream(fresh.mesh, "ab", act_after(5, lambda s: worker.kill()), max_tokens=3000,
                    structured_outputs={"regex": PATTERN})
    assert broken.error is not None and "grammar cannot be resumed" in broken.error, broken.error
    assert broken.finish is None
    text = "".join(broken.text)
    assert text and re.fullmatch("[ab]+", text), text  # a prefix of what the grammar allows
    # SIGKILLed, the worker left no engine process running on.
    assert wait_until(lambda: not any(alive(p) for p in engines), 15), [p for p in engines if alive(p)]
