"""Live role switching on real processes: a mocker worker moves between the decode and the
prefill pool under load, no request is lost, and the router routes to it in its new pool."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from gen.kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.mesh.discovery import DECODE_WORKER, PREFILL_WORKER, ROUTER
from services.contract.worker_roles import ROLE_OF
from testkit.metrics import value
from testkit.sse import completion_body, stream_sync
from tests.procs import MODEL, Etcd, ServiceMesh, registered, wait_until

# A real decode step (12 ms), so streams are still running when the switch comes.
SLOW = ("--kv-bytes-per-token", "1024", "--speedup", "1")
REQUESTS = 48
MAX_TOKENS = 40


def route(mesh: ServiceMesh, role: int, exclude: list[str]) -> str | None:
    (router,) = registered(mesh.etcd, mesh.namespace, ROUTER)
    with grpc.insecure_channel(router.address) as channel:
        try:
            reply = router_pb2_grpc.RouterStub(channel).Route(
                router_pb2.RouteRequest(request_id="probe", model=MODEL, token_ids=list(range(100, 164)), role=role,
                                        exclude_worker_ids=exclude), timeout=5)
        except grpc.RpcError:
            return None
    return reply.worker_id


def switch(mesh: ServiceMesh, worker_id: str, role: str, drain_timeout_s: float) -> worker_pb2.SwitchRoleResponse:
    info = next(i for c in (DECODE_WORKER, PREFILL_WORKER) for i in registered(mesh.etcd, mesh.namespace, c)
                if i.instance_id == worker_id)
    assert info.switchable
    with grpc.insecure_channel(info.address) as channel:
        return worker_pb2_grpc.RoleControlStub(channel).SwitchRole(
            worker_pb2.SwitchRoleRequest(role=ROLE_OF[role], drain_timeout_s=drain_timeout_s), timeout=60)


def running(mesh: ServiceMesh, worker_id: str) -> int:
    """Requests running on the worker now, from its load stream."""
    info = next(i for i in registered(mesh.etcd, mesh.namespace, DECODE_WORKER) if i.instance_id == worker_id)
    with grpc.insecure_channel(info.address) as channel:
        call = worker_pb2_grpc.WorkerStub(channel).SubscribeMetrics(worker_pb2.SubscribeMetricsRequest(), timeout=5)
        first = next(call)
        call.cancel()
    return first.request_active_slots


def stream(mesh: ServiceMesh, i: int) -> tuple[int, int, str]:
    """(status, completion tokens per the usage or -1, "data: [DONE]" where that was the last event)."""
    s = stream_sync(mesh.url("/v1/completions"), completion_body([20 + (i * 7 + j) % 900 for j in range(48)],
                                                                 MAX_TOKENS), timeout_s=60)
    assert s.broken is None, s.broken
    return s.status, s.usage.completion_tokens if s.usage else -1, "data: [DONE]" if s.done else f"not [DONE]: {s.error}"


@pytest.fixture
def mesh(etcd: Etcd):
    with ServiceMesh(etcd.endpoint) as m:
        yield m


def test_a_worker_switches_roles_under_load_and_loses_no_request(mesh: ServiceMesh) -> None:
    _, (mover, stayer) = mesh.switchable_worker("decode", *SLOW, "--num-workers", "2")
    _, (prefiller,) = mesh.switchable_worker("prefill", *SLOW)
    assert {i.instance_id for i in registered(mesh.etcd, mesh.namespace, PREFILL_WORKER)} == {prefiller}
    assert wait_until(lambda: route(mesh, common_pb2.WORKER_ROLE_DECODE, [stayer]) == mover, 10)

    with ThreadPoolExecutor(8) as pool:
        results = [pool.submit(stream, mesh, i) for i in range(REQUESTS)]
        assert wait_until(lambda: running(mesh, mover) > 0, 20, interval_s=0.05), "no stream ever ran on the worker"
        reply = switch(mesh, mover, "prefill", drain_timeout_s=0.3)
        switched_at = time.monotonic()
        assert wait_until(lambda: route(mesh, common_pb2.WORKER_ROLE_PREFILL, [prefiller]) == mover, 1.0,
                          interval_s=0.02), "the router did not route to the worker in its new pool within 1 s"
        seen_after_s = time.monotonic() - switched_at
        outcomes = [r.result() for r in results]

    assert (reply.previous_role, reply.role) == (common_pb2.WORKER_ROLE_DECODE, common_pb2.WORKER_ROLE_PREFILL)
    assert reply.finished + reply.ended + reply.handed_over > 0, "the switch found no work in flight"
    # Its decode streams were handed over with their KV (a switchable worker moves them), each
    # once; none of them recomputed (a call not yet in the engine may still end at the deadline).
    assert reply.handed_over > 0
    assert value(mesh.metrics("processor"), "kvmesh_processor_handoffs_total") == reply.handed_over
    assert all(status == 200 for status, _, _ in outcomes), outcomes
    assert [completion for _, completion, _ in outcomes] == [MAX_TOKENS] * REQUESTS
    assert all(last == "data: [DONE]" for _, _, last in outcomes)
    assert seen_after_s <= 1.0
    decoders = {i.instance_id for i in registered(mesh.etcd, mesh.namespace, DECODE_WORKER)}
    assert decoders == {stayer}
    # The old pool no longer routes to it; back to decode, it is routed to there again.
    assert route(mesh, common_pb2.WORKER_ROLE_DECODE, [stayer]) is None
    back = switch(mesh, mover, "decode", drain_timeout_s=1.0)
    assert (back.previous_role, back.role) == (common_pb2.WORKER_ROLE_PREFILL, common_pb2.WORKER_ROLE_DECODE)
    assert wait_until(lambda: route(mesh, common_pb2.WORKER_ROLE_DECODE, [stayer]) == mover, 1.0, interval_s=0.02)
    assert mesh.complete(max_tokens=5).status_code == 200


def test_a_call_of_the_other_role_is_refused_as_retryable(mesh: ServiceMesh) -> None:
    mesh.switchable_worker("prefill", *SLOW)
    (info,) = registered(mesh.etcd, mesh.namespace, PREFILL_WORKER)
    with grpc.insecure_channel(info.address) as channel:
        calls = worker_pb2_grpc.WorkerStub(channel).Generate(
            worker_pb2.WorkerGenerateRequest(request_id="r1", token_ids=[1, 2, 3]), timeout=10)
        with pytest.raises(grpc.RpcError) as refused:
            list(calls)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as bad:
            worker_pb2_grpc.RoleControlStub(channel).SwitchRole(worker_pb2.SwitchRoleRequest(), timeout=10)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_workers_log_lines_name_the_role_it_serves_now(mesh: ServiceMesh) -> None:
    proc, (worker_id,) = mesh.switchable_worker("prefill", *SLOW)
    serving = proc.wait_for(r" (\S+) \S+: \S+ \S+ serving ", 10)
    assert serving.group(1) == "prefill-worker", serving.group(0)
    switch(mesh, worker_id, "decode", drain_timeout_s=0.5)
    switched = proc.wait_for(r" (\S+) \S+: worker \S+ switched from prefill to decode", 10)
    assert switched.group(1) == "decode-worker", switched.group(0)
