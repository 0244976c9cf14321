"""Agent sessions on a mesh of mocker workers (real processes, real etcd): a session's next turn
goes back to the worker that holds its history and finds it still cached after other traffic
(retained while the session was idle), a sub-agent is placed with its parent, bindings hold across
router replicas (they live in etcd), and a migrated request takes its session's binding along."""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from services.mesh.discovery import ROUTER
from testkit.proc import Proc
from testkit.metrics import metrics_url, routers_heard_every_worker, scrape, total
from tests.procs import MODEL, Etcd, ServiceMesh, registered, wait_until

BLOCK = 16
# Device blocks per worker: other traffic evicts all that is not kept.
DEVICE_BLOCKS = 64
PIN_BLOCKS = 40


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(20, 1000) for _ in range(n)]


def turn(mesh: ServiceMesh, prompt: list[int], session: str | None = None, parent: str | None = None,
         max_tokens: int = 2) -> httpx.Response:
    headers = {"x-kvmesh-explain": "1"}
    if session is not None:
        headers["x-session-id"] = session
    if parent is not None:
        headers["x-parent-session-id"] = parent
    reply = httpx.post(mesh.url("/v1/completions"), headers=headers, timeout=60,
                       json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens})
    assert reply.status_code == 200, reply.text
    return reply


def cached(reply: httpx.Response) -> int:
    return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def session_route(reply: httpx.Response) -> str:
    """`bound`, `new`, ... from x-kvmesh-route's first section (`mode=kv session=bound; ...`)."""
    first = reply.headers["x-kvmesh-route"].split(";")[0]
    return dict(part.split("=", 1) for part in first.split())["session"]


def other_traffic(mesh: ServiceMesh, seed: int, requests: int = 24) -> None:
    """Unrelated 256-token prompts, no session: together several times both workers' caches."""
    for i in range(requests):
        turn(mesh, tokens(seed * 1000 + i, 256))


def router_metric(mesh: ServiceMesh, name: str, **labels: str) -> dict[str, float]:
    """The metric's value on each registered router."""
    return {info.instance_id: total(scrape(metrics_url(info.metrics_port)), name, **labels)
            for info in registered(mesh.etcd, mesh.namespace, ROUTER)}


def settle(mesh: ServiceMesh) -> None:
    """Waits until every router has heard every worker's next load report and counts no request
    it sent as pending: the loads it weighs now are the workers' own, with what the last request
    left (its session's pinned blocks)."""
    assert wait_until(routers_heard_every_worker(mesh.etcd, mesh.namespace), 10)


@dataclass
class SessionsMesh:
    mesh: ServiceMesh
    # Each worker's process, by instance id: the migration test kills one.
    workers: dict[str, Proc]


@pytest.fixture(scope="module")
def sessions(etcd: Etcd) -> Iterator[SessionsMesh]:
    """Two router replicas and two worker processes with small caches."""
    with ServiceMesh(etcd.endpoint, frontend_flags=("--allow-explain",), router_flags=("--session-ttl", "120")) as mesh:
        mesh.procs.append(mesh._start(ROUTER, "--router-mode", "kv", "--session-ttl", "120", name="router-2"))
        workers = {}
        for _ in range(2):
            proc, (worker_id,) = mesh.worker("--speedup", "1", "--num-gpu-blocks", str(DEVICE_BLOCKS),
                                             "--session-pin-blocks", str(PIN_BLOCKS))
            workers[worker_id] = proc
        assert wait_until(lambda: len(registered(mesh.etcd, mesh.namespace, ROUTER)) == 2, 30)
        assert wait_until(lambda: mesh.complete().status_code == 200, 20)
        yield SessionsMesh(mesh, workers)


def test_a_bound_sessions_next_turn_finds_its_history_on_its_worker_after_other_traffic(
        sessions: SessionsMesh) -> None:
    mesh = sessions.mesh
    # One session per worker: each worker then reports as much cache kept (pinned blocks count as
    # used), so the traffic below spreads over both instead of keeping off the one that keeps more.
    agents = [f"agent-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    histories = [tokens(1, 512), tokens(2, 512)]
    firsts = []
    for agent, history in zip(agents, histories):
        firsts.append(turn(mesh, history, agent))
        settle(mesh)  # every router hears the worker's next load report (its pinned blocks)
    assert [session_route(r) for r in firsts] == ["new", "new"]
    assert len({r.headers["x-kvmesh-worker"] for r in firsts}) == 2
    # In no session: what the traffic does to a prefix nobody keeps. Small enough to fit beside the
    # sessions' pinned blocks (a request that fits nowhere else makes pins give way).
    plain = tokens(3, 384)
    turn(mesh, plain)
    other_traffic(mesh, 4)
    for agent, history, first in zip(agents, histories, firsts):
        second = turn(mesh, history + tokens(5, 64), agent)
        assert second.headers["x-kvmesh-worker"] == first.headers["x-kvmesh-worker"]
        assert session_route(second) == "bound"
        # The whole first prompt was kept (its last partial block is never cached).
        assert cached(second) >= len(history) // BLOCK * BLOCK - BLOCK, second.json()["usage"]
    assert cached(turn(mesh, plain + tokens(6, 64))) < len(plain) // 2  # evicted: nothing kept it


def test_a_sub_agent_is_placed_with_its_parent(sessions: SessionsMesh) -> None:
    mesh = sessions.mesh
    parent = f"parent-{uuid.uuid4().hex[:8]}"
    first = turn(mesh, tokens(10, 128), parent)
    settle(mesh)  # the router counts the parent's request as pending until the worker's next report
    child = turn(mesh, tokens(11, 128), f"child-{uuid.uuid4().hex[:8]}", parent=parent)
    assert session_route(child) == "parent"
    assert child.headers["x-kvmesh-worker"] == first.headers["x-kvmesh-worker"]


def test_a_parent_session_needs_a_session_of_its_own(sessions: SessionsMesh) -> None:
    reply = httpx.post(sessions.mesh.url("/v1/completions"), headers={"x-parent-session-id": "p"}, timeout=30,
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "x-parent-session-id"
    bad = httpx.post(sessions.mesh.url("/v1/completions"), headers={"x-session-id": "a/b"}, timeout=30,
                     json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-session-id"


def test_bindings_hold_across_router_replicas(sessions: SessionsMesh) -> None:
    mesh = sessions.mesh
    before = router_metric(mesh, "kvmesh_router_session_routes_total", route="bound")
    # Bindings of this module's earlier sessions stay live meanwhile (--session-ttl 120).
    known_before = router_metric(mesh, "kvmesh_router_session_bindings")
    session = f"agent-{uuid.uuid4().hex[:8]}"
    history = tokens(20, 128)
    workers = []
    for i in range(6):
        reply = turn(mesh, history, session)
        workers.append(reply.headers["x-kvmesh-worker"])
        history += tokens(21 + i, 64)
        # The binding's write reaches the other replica through etcd: every router knows one more.
        assert wait_until(lambda: all(n > known_before[r] for r, n in
                                      router_metric(mesh, "kvmesh_router_session_bindings").items()), 10)
    assert len(set(workers)) == 1, workers
    bound = router_metric(mesh, "kvmesh_router_session_routes_total", route="bound")
    # The processor takes the routers in turn: each replica routed some of the later turns to the
    # binding the first one made.
    assert len(bound) == 2 and all(bound[r] > before.get(r, 0) for r in bound), (before, bound)


def test_a_migrated_request_takes_its_sessions_binding_along(sessions: SessionsMesh) -> None:
    """Last: it kills a worker."""
    mesh = sessions.mesh
    session = f"agent-{uuid.uuid4().hex[:8]}"
    history = tokens(30, 128)
    first = turn(mesh, history, session)
    holder = first.headers["x-kvmesh-worker"]
    with httpx.stream("POST", mesh.url("/v1/completions"), timeout=60,
                      headers={"x-session-id": session, "x-kvmesh-explain": "1"},
                      json={"model": MODEL, "prompt": history + tokens(31, 32), "max_tokens": 120,
                            "stream": True, "ignore_eos": True}) as stream:
        assert stream.headers["x-kvmesh-worker"] == holder
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        sessions.workers[holder].kill()  # mid-stream: the rest of the answer comes from the other worker
        assert [line for line in lines if line.startswith("data: ")][-1] == "data: [DONE]"
    third = turn(mesh, history + tokens(32, 64), session)
    assert third.headers["x-kvmesh-worker"] != holder
    assert session_route(third) == "bound"  # the migration bound it to where it went
