"""Nothing lost when a decode worker goes away mid-stream: the request moves to another worker
and the client sees one uninterrupted stream, and a drained worker finishes what it started."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator

import pytest

from testkit.metrics import find, value
from testkit.sse import Streamed, completion_body, stream_sync
from tests.procs import Etcd, Proc, ServiceMesh, registered, wait_until

# 48 ms per decode step: a 120-token answer streams for about 6 s, long enough to act mid-stream.
SLOW = ("--speedup", "0.25")
MAX_TOKENS = 120
# NIXL on every worker, so a drained one hands its streams over with their KV; no prefill pool.
MOVABLE = ("--kv-transfer", "nixl", "--no-remote-prefill")


def stream(mesh: ServiceMesh, prompt: str, on_chunk: Callable[[Streamed], None] = lambda s: None,
           max_tokens: int = MAX_TOKENS, **fields: object) -> Streamed:
    """A streamed completion, read chunk by chunk; `on_chunk` is called after each text chunk.
    `fields` go into the request body as they are."""
    out = stream_sync(mesh.url("/v1/completions"), {**completion_body(prompt, max_tokens, ignore_eos=False), **fields},
                      on_chunk=on_chunk)
    assert out.status == 200, out.body
    assert out.broken is None, out.broken
    assert out.worker, out.headers
    return out


@pytest.fixture
def mesh(etcd: Etcd, request: pytest.FixtureRequest) -> Iterator[ServiceMesh]:
    with ServiceMesh(etcd.endpoint, processor_flags=getattr(request, "param", ())) as m:
        yield m


def two_workers(mesh: ServiceMesh, *extra: str) -> dict[str, Proc]:
    procs = {}
    for _ in range(2):
        proc, (worker_id,) = mesh.worker(*SLOW, *extra)
        procs[worker_id] = proc
    assert wait_until(lambda: mesh.complete("warm up", 1).status_code == 200, 30)
    return procs


def act_after(chunks: int, action: Callable[[Streamed], None]) -> Callable[[Streamed], None]:
    """Runs `action` once, after the stream has delivered `chunks` text chunks."""
    fired = threading.Event()

    def on_chunk(s: Streamed) -> None:
        if len(s.pieces) >= chunks and not fired.is_set():
            fired.set()
            action(s)

    return on_chunk


def test_a_worker_killed_mid_stream_is_invisible_to_the_client(mesh: ServiceMesh) -> None:
    workers = two_workers(mesh)
    broken = stream(mesh, "migrate me please", act_after(10, lambda s: workers[s.worker].kill()))
    assert broken.error is None
    assert broken.finish == "length"
    assert broken.completion_tokens == MAX_TOKENS
    assert value(mesh.metrics("processor"), "kvmesh_processor_migrations_total") == 1
    # The same request, served start to finish by the surviving worker, gives the same text:
    # no token repeated, none missing.
    unbroken = stream(mesh, "migrate me please")
    assert unbroken.worker != broken.worker
    assert "".join(broken.text) == "".join(unbroken.text)


@pytest.mark.parametrize("mesh", [("--migration-limit", "0")], indirect=True)
def test_with_migration_off_a_mid_stream_failure_ends_the_stream_with_an_error(mesh: ServiceMesh) -> None:
    workers = two_workers(mesh)
    broken = stream(mesh, "do not migrate me", act_after(10, lambda s: workers[s.worker].kill()))
    assert broken.error is not None and "failed mid-stream" in broken.error
    assert value(mesh.metrics("processor"), "kvmesh_processor_migrations_total") == 0


def test_a_drained_worker_finishes_its_stream_then_exits_0(mesh: ServiceMesh) -> None:
    workers = two_workers(mesh, "--drain-timeout", "60")
    sent = threading.Event()

    def drain(s: Streamed) -> None:
        workers[s.worker].popen.send_signal(signal.SIGTERM)
        sent.set()

    drained = stream(mesh, "finish me where I started", act_after(10, drain))
    assert sent.is_set()
    assert drained.error is None and drained.completion_tokens == MAX_TOKENS
    assert value(mesh.metrics("processor"), "kvmesh_processor_migrations_total") == 0
    assert workers[drained.worker].popen.wait(30) == 0
    # New work goes to the worker that stayed.
    survivor = next(w for w in workers if w != drained.worker)
    assert mesh.complete("after the drain", 2).headers["x-kvmesh-worker"] == survivor


def test_a_drained_worker_hands_its_stream_over_with_its_kv_and_nothing_is_recomputed(mesh: ServiceMesh) -> None:
    # NIXL on both workers (the KV moves between them); no prefill pool to ask.
    workers = two_workers(mesh, *MOVABLE, "--drain-timeout", "60")
    exited = threading.Event()

    def drain(s: Streamed) -> None:
        workers[s.worker].popen.send_signal(signal.SIGTERM)

    def on_chunk(s: Streamed) -> None:
        fire(s)
        if workers[s.worker].popen.poll() is not None:
            exited.set()  # before the stream's end: a drain that waited for it would still be running

    fire = act_after(5, drain)
    moved = stream(mesh, "hand me over with my cache", on_chunk)
    assert moved.error is None and moved.completion_tokens == MAX_TOKENS and moved.finish == "length"
    assert workers[moved.worker].popen.wait(30) == 0
    assert "handed over" in workers[moved.worker].tail()
    processor = mesh.metrics("processor")
    assert value(processor, "kvmesh_processor_handoffs_total") == 1
    assert value(processor, "kvmesh_processor_migrations_total") == 0
    assert value(processor, "kvmesh_processor_resumed_tokens_recomputed_total") == 0
    # The survivor decoded from the pulled KV: nothing recomputed.
    survivor = mesh.metrics("decode-worker")
    assert value(survivor, "kvmesh_decode_moved_in_total", kv="pulled") == 1
    assert find(survivor, "kvmesh_decode_moved_in_total", kv="recomputed") in (None, 0)
    assert exited.is_set()
    # The same request, never moved, gives the same text.
    assert "".join(moved.text) == "".join(stream(mesh, "hand me over with my cache").text)


def test_a_drain_deadline_moves_what_is_still_running(mesh: ServiceMesh) -> None:
    workers = two_workers(mesh, "--drain-timeout", "1")
    moved = stream(mesh, "move me at the deadline",
                   act_after(5, lambda s: workers[s.worker].popen.send_signal(signal.SIGTERM)))
    assert moved.error is None and moved.completion_tokens == MAX_TOKENS
    processor = mesh.metrics("processor")
    assert value(processor, "kvmesh_processor_migrations_total") == 1
    # Recomputed there: the prompt and the tokens so far (nothing of it cached on that worker).
    assert value(processor, "kvmesh_processor_resumed_tokens_recomputed_total") > 5
    assert workers[moved.worker].popen.wait(30) == 0
    assert "".join(moved.text) == "".join(stream(mesh, "move me at the deadline").text)


def test_a_rolling_restart_of_every_decode_worker_under_load_loses_nothing(mesh: ServiceMesh) -> None:
    # Each drained worker hands its streams over with their KV (the default --drain-mode move).
    old = two_workers(mesh, *MOVABLE, "--drain-timeout", "5")
    results: list[tuple[str, Streamed]] = []
    stop = threading.Event()

    def load(client: int) -> None:
        for i in range(200):
            if stop.is_set():
                return
            prompt = f"rolling {client}-{i % 3}"
            results.append((prompt, stream(mesh, prompt)))

    clients = [threading.Thread(target=load, args=(c,)) for c in range(3)]
    for c in clients:
        c.start()
    try:
        for worker_id, proc in old.items():
            mesh.worker(*SLOW, *MOVABLE, "--drain-timeout", "5")
            proc.popen.send_signal(signal.SIGTERM)
            assert proc.popen.wait(60) == 0, proc.tail()
            assert wait_until(lambda w=worker_id: w not in {i.instance_id for i in registered(
                mesh.etcd, mesh.namespace, "decode-worker")}, 15)
    finally:
        stop.set()
        for c in clients:
            c.join(120)
    assert len(results) >= 3
    assert [s.error for _, s in results if s.error] == []
    # The rolls met streams, and moved them (each drained worker had some: the load never paused).
    assert value(mesh.metrics("processor"), "kvmesh_processor_handoffs_total") >= 1
    assert all(s.completion_tokens == MAX_TOKENS and s.finish == "length" for _, s in results)
    # A prompt answered several times, by whichever workers, got the same text every time.
    texts: dict[str, set[str]] = {}
    for prompt, s in results:
        texts.setdefault(prompt, set()).add("".join(s.text))
    assert all(len(t) == 1 for t in texts.values()), texts
