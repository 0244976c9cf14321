"""The decode worker's remote-prefill plan (services/decode_worker/remote_prefill.py), branch by branch.

The router client is a stand-in with an async `route(...)` (our own interface), scripted to answer
or to raise; the prefill worker is a real in-process `grpc.aio` server implementing `Prefiller`
(its `Session` through a real SessionHub, as the prefill worker serves it), scripted per case;
sessions and channels come from a real `SessionPool` and `ChannelPool`. Counters are read back from the fresh
Prometheus registry each test hands to `DisaggMetrics`. No etcd, no child process.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import grpc
import pytest
from prometheus_client import CollectorRegistry

from gen.kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.decode_worker.disagg_decision import DisaggConfig
from services.decode_worker.remote_prefill import DisaggMetrics, RemotePrefill, RemotePrefiller
from services.mesh.channels import ChannelPool
from services.mesh.net import free_port
from services.mesh.session_client import SessionPool
from services.mesh.session_kind import PREFILL_SESSION, CallError, CallInfo
from services.mesh.session_server import SessionHub
from services.worker.kv_pull import kv_pull_to_proto
from services.routing.router_client import NoWorkerError, RouteChoice, RoutingUnavailable

MODEL = "kvmesh-demo"
PREFILL_ID = "prefill-7"
# Integers (block ids, ports) must come back as integers.
KV_PULL = {"engine_id": "prefill-7", "blocks": [3, 4, 5], "checksum": 1234567, "ratio": 0.5, "remote": True,
           "nested": {"port": 5600}}
LONG, SHORT = 1000, 100  # prompt lengths either side of max_local_prefill_length (512)
SAMPLING = common_pb2.SamplingParams(max_tokens=8, seed=42)
# Long enough for an answering prefill worker on a loaded machine, short for one that never answers.
DEADLINE_TIMEOUT_S = 0.5
# Every reason the decode worker counts a fallback under ("transfer" is the decode side's own, after a pull).
FALLBACK_REASONS = ("no_prefill_worker", "no_router", "error", "deadline", "busy", "transfer")


class ScriptedPrefiller(worker_pb2_grpc.PrefillerServicer):
    """A prefill answers with KV_PULL, ends with an outcome, or never answers; ReleaseKv likewise."""

    def __init__(self, prefill: str = "ok", release: str = "ok") -> None:
        self.prefill, self.release = prefill, release
        self.prefills: list[worker_pb2.PrefillRequest] = []
        self.releases: list[str] = []
        self.sessions = SessionHub(PREFILL_SESSION, self.prefill_call)

    async def Session(self, frames: AsyncIterator[worker_pb2.PrefillSessionDown],  # noqa: N802
                      context: grpc.aio.ServicerContext) -> None:
        await self.sessions.serve(frames, context)

    async def prefill_call(self, request: worker_pb2.PrefillRequest,
                           call: CallInfo) -> AsyncIterator[worker_pb2.PrefillResponse]:
        self.prefills.append(request)
        if self.prefill == "error":
            raise CallError(common_pb2.OUTCOME_PEER_FAILED, "scripted engine failure")
        if self.prefill == "busy":
            raise CallError(common_pb2.OUTCOME_NO_CAPACITY, "scripted: no room to hold more KV")
        if self.prefill == "hangs":
            await asyncio.Event().wait()  # cancelled at the client's deadline or when the server stops
        yield worker_pb2.PrefillResponse(kv_pull=kv_pull_to_proto(KV_PULL), cached_tokens=32)

    async def ReleaseKv(self, request: worker_pb2.ReleaseKvRequest,  # noqa: N802
                        context: grpc.aio.ServicerContext) -> worker_pb2.ReleaseKvResponse:
        self.releases.append(request.request_id)
        if self.release == "error":
            await context.abort(grpc.StatusCode.INTERNAL, "scripted release failure")
        return worker_pb2.ReleaseKvResponse(released=True)


@dataclass
class StandInRouters:
    """Our RouterClient's interface: `route(...)` answers with a prefill worker, or raises."""

    address: str
    pool_waiting: int = 0
    raises: Exception | None = None
    calls: list[dict] = field(default_factory=list)

    async def route(self, request_id: str, model: str, token_ids: list[int], role: int,
                    exclude: tuple[str, ...] = (), lora_name: str = "", media: Sequence = ()) -> RouteChoice:
        self.calls.append(dict(request_id=request_id, model=model, token_ids=list(token_ids), role=role,
                               exclude=tuple(exclude), lora_name=lora_name, media=list(media)))
        if self.raises is not None:
            raise self.raises
        return RouteChoice(PREFILL_ID, self.address, overlap_blocks=2, prefix_hit_rate=0.1,
                           pool_waiting=self.pool_waiting)


@dataclass
class Setup:
    prefiller: RemotePrefiller
    routers: StandInRouters
    worker: ScriptedPrefiller
    registry: CollectorRegistry

    def count(self, name: str, **labels: str) -> float:
        """A counter's value; a labelled child never incremented reads 0."""
        return self.registry.get_sample_value(name + "_total", labels) or 0.0

    def counts(self) -> dict[str, float]:
        return {
            "local": self.count("kvmesh_decode_local_prefill"),
            "remote": self.count("kvmesh_decode_remote_prefill"),
            **{f"fallback:{reason}": self.count("kvmesh_decode_prefill_fallback", reason=reason)
               for reason in FALLBACK_REASONS},
        }


@asynccontextmanager
async def remote_prefill(config: DisaggConfig | None = None, worker: ScriptedPrefiller | None = None,
                         pool_waiting: int = 0, router_raises: Exception | None = None) -> AsyncIterator[Setup]:
    worker = worker or ScriptedPrefiller()
    server = grpc.aio.server()
    worker_pb2_grpc.add_PrefillerServicer_to_server(worker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channels = ChannelPool()
    sessions = SessionPool(channels)
    registry = CollectorRegistry()
    routers = StandInRouters(f"127.0.0.1:{port}", pool_waiting, router_raises)
    prefiller = RemotePrefiller(config or DisaggConfig(), MODEL, routers, sessions, channels,  # type: ignore[arg-type]
                                DisaggMetrics(registry))
    try:
        yield Setup(prefiller, routers, worker, registry)
    finally:
        await sessions.close()
        await channels.close()
        await server.stop(None)


def counts(local: float = 0, remote: float = 0, **fallbacks: float) -> dict[str, float]:
    expected = {"local": local, "remote": remote,
                **{f"fallback:{r}": 0.0 for r in FALLBACK_REASONS}}
    expected.update({f"fallback:{reason}": n for reason, n in fallbacks.items()})
    return expected


def prompt(n: int) -> list[int]:
    return [(i * 7) % 30000 + 10 for i in range(n)]


@pytest.mark.parametrize("config, length, prefix_hit_rate", [
    pytest.param(DisaggConfig(), SHORT, 0.0, id="short-prompt"),
    pytest.param(DisaggConfig(), 512, 0.0, id="exactly-max-local-length"),
    pytest.param(DisaggConfig(), LONG, 0.6, id="mostly-cached-here"),
    pytest.param(DisaggConfig(remote_prefill=False), LONG, 0.0, id="remote-prefill-off"),
])
async def test_a_prompt_not_worth_moving_prefills_locally_without_asking_the_router(
        config: DisaggConfig, length: int, prefix_hit_rate: float) -> None:
    async with remote_prefill(config) as s:
        assert await s.prefiller.plan("r1", prompt(length), SAMPLING, prefix_hit_rate) is None
        assert s.routers.calls == [] and s.worker.prefills == []
        assert s.counts() == counts(local=1)


async def test_a_long_uncached_prompt_is_prefilled_remotely_and_its_kv_params_returned() -> None:
    tokens = prompt(LONG)
    async with remote_prefill(pool_waiting=1) as s:
        plan = await s.prefiller.plan("r-remote", tokens, SAMPLING, 0.0)
        assert plan == RemotePrefill(worker_id=PREFILL_ID, address=s.routers.address, kv_pull=KV_PULL)
        assert s.counts() == counts(remote=1)
        assert s.registry.get_sample_value("kvmesh_prefill_queue_size") == 1
        # The router was asked for the prefill pool, and the prefill worker got the prompt as sent.
        assert s.routers.calls == [dict(request_id="r-remote", model=MODEL, token_ids=tokens,
                                        role=common_pb2.WORKER_ROLE_PREFILL, exclude=(), lora_name="", media=[])]
        (sent,) = s.worker.prefills
        assert (sent.request_id, list(sent.token_ids), sent.sampling) == ("r-remote", tokens, SAMPLING)
        assert sent.lora_name == ""


async def test_a_lora_prompt_asks_for_a_prefill_worker_with_its_adapter_and_sends_the_adapter() -> None:
    async with remote_prefill() as s:
        plan = await s.prefiller.plan("r-lora", prompt(LONG), SAMPLING, 0.0, lora_name="sql-lora")
        assert plan is not None and plan.worker_id == PREFILL_ID
        assert [c["lora_name"] for c in s.routers.calls] == ["sql-lora"]
        (sent,) = s.worker.prefills
        assert sent.lora_name == "sql-lora"


@pytest.mark.parametrize("pool_waiting", [0, 5])
async def test_without_conditional_disagg_even_a_short_prompt_goes_remote_whatever_the_queue(
        pool_waiting: int) -> None:
    config = DisaggConfig(conditional_disagg=False, max_prefill_queue_size=2)
    async with remote_prefill(config, pool_waiting=pool_waiting) as s:
        plan = await s.prefiller.plan("r-short", prompt(10), SAMPLING, 0.9)
        assert plan is not None and plan.worker_id == PREFILL_ID
        assert len(s.worker.prefills) == 1
        assert s.counts() == counts(remote=1)


@pytest.mark.parametrize("pool_waiting", [2, 3])
async def test_a_full_prefill_queue_prefills_locally_without_calling_the_prefill_worker(pool_waiting: int) -> None:
    async with remote_prefill(DisaggConfig(max_prefill_queue_size=2), pool_waiting=pool_waiting) as s:
        assert await s.prefiller.plan("r-busy", prompt(LONG), SAMPLING, 0.0) is None
        assert len(s.routers.calls) == 1 and s.worker.prefills == []
        # A busy pool is a decision, not a failure: no fallback is counted.
        assert s.counts() == counts(local=1)
        assert s.registry.get_sample_value("kvmesh_prefill_queue_size") == pool_waiting


@pytest.mark.parametrize("router_raises, reason", [
    pytest.param(NoWorkerError("no prefill worker serves kvmesh-demo"), "no_prefill_worker", id="no-prefill-worker"),
    pytest.param(RoutingUnavailable("routing failed: router r0: UNAVAILABLE"), "no_router", id="no-router"),
])
async def test_a_routing_failure_falls_back_to_local_with_its_reason(router_raises: Exception, reason: str) -> None:
    async with remote_prefill(router_raises=router_raises) as s:
        assert await s.prefiller.plan("r-unrouted", prompt(LONG), SAMPLING, 0.0) is None
        assert len(s.routers.calls) == 1 and s.worker.prefills == []
        assert s.counts() == counts(local=1, **{reason: 1})


async def test_a_failed_prefill_falls_back_to_local_as_error() -> None:
    async with remote_prefill(worker=ScriptedPrefiller(prefill="error")) as s:
        assert await s.prefiller.plan("r-err", prompt(LONG), SAMPLING, 0.0) is None
        assert len(s.worker.prefills) == 1
        assert s.counts() == counts(local=1, error=1)


async def test_a_prefill_worker_with_no_room_falls_back_to_local_as_busy_and_stays_in_routing() -> None:
    async with remote_prefill(worker=ScriptedPrefiller(prefill="busy")) as s:
        assert await s.prefiller.plan("r-busy", prompt(LONG), SAMPLING, 0.0) is None
        await s.prefiller.plan("r-busy-2", prompt(LONG), SAMPLING, 0.0)
        assert s.counts() == counts(local=2, busy=2)
        assert [c["exclude"] for c in s.routers.calls] == [(), ()]  # full for now, not gone


async def test_an_unreachable_prefill_worker_falls_back_to_local_as_error() -> None:
    async with remote_prefill() as s:
        s.routers.address = f"127.0.0.1:{free_port()}"  # the router's choice died since it was chosen
        assert await s.prefiller.plan("r-gone", prompt(LONG), SAMPLING, 0.0) is None
        assert s.counts() == counts(local=1, error=1)


async def test_a_prefill_past_its_deadline_falls_back_to_local_as_deadline() -> None:
    config = DisaggConfig(prefill_timeout_s=DEADLINE_TIMEOUT_S)
    async with remote_prefill(config, worker=ScriptedPrefiller(prefill="hangs")) as s:
        assert await s.prefiller.plan("r-slow", prompt(LONG), SAMPLING, 0.0) is None
        assert len(s.worker.prefills) == 1
        assert s.counts() == counts(local=1, deadline=1)


async def test_release_asks_the_prefill_worker_to_free_the_requests_kv() -> None:
    async with remote_prefill() as s:
        await s.prefiller.release("r-abandoned", RemotePrefill(PREFILL_ID, s.routers.address, KV_PULL))
        assert s.worker.releases == ["r-abandoned"]


async def test_release_swallows_an_rpc_error() -> None:
    async with remote_prefill(worker=ScriptedPrefiller(release="error")) as s:
        await s.prefiller.release("r-abandoned", RemotePrefill(PREFILL_ID, s.routers.address, KV_PULL))
        assert s.worker.releases == ["r-abandoned"]
        # Nothing listening at all is swallowed too: the KV expires on the prefill worker.
        await s.prefiller.release("r-orphan", RemotePrefill(PREFILL_ID, f"127.0.0.1:{free_port()}", KV_PULL))
        assert s.worker.releases == ["r-abandoned"]
        assert s.counts() == counts()


@pytest.mark.parametrize("failure", ["unreachable", "hangs"])
async def test_a_prefill_worker_that_failed_is_kept_out_of_the_next_routes(failure: str) -> None:
    config = DisaggConfig(prefill_timeout_s=DEADLINE_TIMEOUT_S)
    worker = ScriptedPrefiller(prefill="hangs" if failure == "hangs" else "ok")
    async with remote_prefill(config, worker=worker) as s:
        if failure == "unreachable":
            s.routers.address = f"127.0.0.1:{free_port()}"
        assert await s.prefiller.plan("r-1", prompt(LONG), SAMPLING, 0.0) is None
        worker.prefill = "ok"  # what the next route asks for is the point, not another deadline
        await s.prefiller.plan("r-2", prompt(LONG), SAMPLING, 0.0)
        assert [c["exclude"] for c in s.routers.calls] == [(), (PREFILL_ID,)]


async def test_a_worker_that_refused_one_request_is_not_set_aside() -> None:
    # PEER_FAILED: the worker answered (its engine failed this prefill); it is not gone.
    async with remote_prefill(worker=ScriptedPrefiller(prefill="error")) as s:
        await s.prefiller.plan("r-1", prompt(LONG), SAMPLING, 0.0)
        await s.prefiller.plan("r-2", prompt(LONG), SAMPLING, 0.0)
        assert [c["exclude"] for c in s.routers.calls] == [(), ()]
