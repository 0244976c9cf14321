"""A freshly started vLLM decode worker (its own mesh, no other worker at first), in three steps,
in this order: its very first request; a second worker joins and the one serving a stream is
drained, handing the stream over with its KV; the death of the one left under a structured-output
stream. Two engine starts serve all three (the suite's time goes to vLLM starts).

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
class FreshWorker:
    mesh: ServiceMesh
    worker: Proc
    instance_id: str
    # Every worker started, by instance id (the second joins in step 2).
    workers: dict[str, Proc]

    def start_worker(self) -> tuple[Proc, str]:
        mesh = self.mesh
        worker = service("services.decode_worker", "--etcd-endpoints", mesh.etcd, "--namespace", mesh.namespace,
                         "--engine", "vllm", "--kv-transfer", "nixl", "--no-remote-prefill", "--drain-timeout", "8",
                         name="decode-worker")
        mesh.procs.append(worker)
        (instance,) = worker.wait_for(r"decode-worker ready: (.+)$", 240).group(1).split()
        self.workers[instance] = worker
        return worker, instance


@pytest.fixture(scope="module")
def fresh(etcd: Etcd) -> Iterator[FreshWorker]:
    mesh = ServiceMesh(etcd.endpoint)
    try:
        started = FreshWorker(mesh, None, "", {})  # type: ignore[arg-type]
        started.worker, started.instance_id = started.start_worker()
        yield started
    finally:
        mesh.stop()


def test_a_fresh_vllm_workers_first_request_of_two_tokens_is_answered(fresh: FreshWorker) -> None:
    mesh, worker = fresh.mesh, fresh.worker
    first = httpx.post(mesh.url("/v1/completions"), json={"model": MODEL, "prompt": "ab", "max_tokens": 4}, timeout=60)
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["usage"]["prompt_tokens"] == 2, body["usage"]
    assert body["usage"]["completion_tokens"] == 4 and body["choices"][0]["finish_reason"] == "length", body
    assert first.headers["x-kvmesh-worker"] == fresh.instance_id

    # The engine lived through it: the worker still serves (1 token now) and is still registered.
    again = httpx.post(mesh.url("/v1/completions"), json={"model": MODEL, "prompt": "a", "max_tokens": 2}, timeout=60)
    assert again.status_code == 200, again.text
    assert [w.instance_id for w in registered(mesh.etcd, mesh.namespace, "decode-worker")] == [fresh.instance_id]
    assert worker.popen.poll() is None

    # The warm-up ran, and before the worker registered.
    lines = list(worker.lines)
    warmed = [i for i, line in enumerate(lines) if "vLLM warm-up: a 64-token prompt, then prompts of 1 and 2" in line]
    ready = [i for i, line in enumerate(lines) if "decode-worker ready: " in line]
    assert warmed and warmed[0] < ready[0], worker.tail()


def test_a_drained_vllm_worker_hands_its_stream_over_with_its_kv(fresh: FreshWorker) -> None:
    fresh.start_worker()
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


def test_a_structured_stream_whose_worker_dies_ends_with_an_error_never_invalid_text(fresh: FreshWorker) -> None:
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
