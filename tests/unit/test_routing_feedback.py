"""What the engine found cached goes back to the router that chose the worker (its index accuracy).

Three places, each at its own level:
- the router client (services/routing/router_client.py), against real in-process gRPC routers
  (test_router_client.py's scripted ones): feedback rides on the next call to the router that
  decided; with none within FEEDBACK_WAIT_S it goes alone on the session; close() drops it; at
  most MAX_FEEDBACK_PER_ROUTER wait per router, the oldest dropped;
- the processor's `each_routing_once` (services/processor/service.py): each routing reported once
  however many choices share it;
- a choice's worker calls (services/processor/choice_stream.py), against a scripted worker behind
  a real in-process gRPC server: each call's first output is reported, except where a prefill
  worker computed the prompt.

No assertion waits on a clock: a test that must see feedback go alone sets the wait to 0 and
awaits its arrival (with a deadline only against a hang); one that must see it ride sets the wait
far beyond the test's length.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import pytest

from gen.kvmesh.v1 import common_pb2, router_pb2, worker_pb2, worker_pb2_grpc
from services.mesh.channels import ChannelPool
from services.mesh.session_client import SessionPool
from services.mesh.session_kind import WORKER_SESSION, CallError, CallInfo
from services.mesh.session_server import SessionHub
from services.processor.choice_stream import ChoiceContext, ChoiceLimits, ChoiceSpec, ChoiceStream, Finished
from services.processor.service import each_routing_once
from services.processor.tokenizer import ModelTokenizer
from services.routing import router_client
from services.routing.router_client import MAX_FEEDBACK_PER_ROUTER, RouteChoice
from services.tools.make_demo_model import ensure_demo_model
from tests.unit.in_process_grpc import serving
from tests.unit.test_router_client import OK, Routers, route, routers

# Long enough to outlast any test here, so feedback that has not ridden stays pending.
NEVER_ALONE_S = 3600.0
# Only against a hang: an arrival that is due comes within milliseconds.
ARRIVAL_DEADLINE_S = 10.0


@dataclass
class Report:
    """One `report`, as the client or an `on_cached` hears it."""

    request_id: str
    worker_id: str
    prompt_tokens: int
    cached_tokens: int


def sent(request: router_pb2.RouteRequest) -> list[Report]:
    return [Report(f.request_id, f.worker_id, f.prompt_tokens, f.cached_tokens) for f in request.feedback]


class Arrivals(list[router_pb2.RouteRequest]):
    """A scripted router's calls, which a test can await as they arrive."""

    def __init__(self) -> None:
        super().__init__()
        self._arrived = asyncio.Event()

    def append(self, request: router_pb2.RouteRequest) -> None:
        super().append(request)
        self._arrived.set()

    async def reach(self, count: int) -> None:
        async with asyncio.timeout(ARRIVAL_DEADLINE_S):
            while len(self) < count:
                self._arrived.clear()
                await self._arrived.wait()


def awaitable_calls(mesh: Routers, instance_id: str) -> Arrivals:
    arrivals = Arrivals()
    mesh[instance_id].calls = arrivals
    return arrivals


def decided_by(mesh: Routers, instance_id: str, request_id: str, worker_id: str = "w") -> RouteChoice:
    """A routing as `instance_id` would have answered it (what `report` is told about)."""
    return RouteChoice(worker_id, "10.0.0.7:5555", 0, 0.0, 0, request_id=request_id, router=mesh[instance_id].address)


# -- the router client ---------------------------------------------------------------------------


async def test_feedback_rides_on_the_next_call_to_the_router_that_decided(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(router_client, "FEEDBACK_WAIT_S", NEVER_ALONE_S)
    async with routers(OK, OK) as mesh:
        first = await route(mesh.client, "req-0")  # r0's turn
        second = await route(mesh.client, "req-1")  # r1's
        assert (first.router, second.router) == (mesh["r0"].address, mesh["r1"].address)
        mesh.client.report(first, prompt_tokens=40, cached_tokens=32)
        mesh.client.report(second, prompt_tokens=50, cached_tokens=0)
        await route(mesh.client, "req-2")  # r0 again
        await route(mesh.client, "req-3")  # r1 again
        await route(mesh.client, "req-4")  # r0: its feedback went once
        r0, r1 = mesh["r0"].calls, mesh["r1"].calls
        await mesh.client.close()
    # No call of its own: every call a router saw was a routing.
    assert [c.request_id for c in r0] == ["req-0", "req-2", "req-4"]
    assert [c.request_id for c in r1] == ["req-1", "req-3"]
    assert sent(r0[1]) == [Report("req-0", "worker-via-r0", 40, 32)]
    assert sent(r1[1]) == [Report("req-1", "worker-via-r1", 50, 0)]
    assert sent(r0[0]) == sent(r1[0]) == sent(r0[2]) == []


async def test_feedback_stays_with_its_router_when_a_call_moves_on(monkeypatch: pytest.MonkeyPatch) -> None:
    # r0's feedback went on the call to r0, which could not answer: the retry on r1 carries none
    # of it (r1 did not decide that routing); it is lost, as best effort allows.
    monkeypatch.setattr(router_client, "FEEDBACK_WAIT_S", NEVER_ALONE_S)
    async with routers("unavailable", OK) as mesh:
        mesh.client.report(decided_by(mesh, "r0", "old"), prompt_tokens=10, cached_tokens=5)
        choice = await route(mesh.client, "req-0")
        (to_r0,), (to_r1,) = mesh["r0"].calls, mesh["r1"].calls
        await mesh.client.close()
    assert choice.worker_id == "worker-via-r1"
    assert sent(to_r0) == [Report("old", "w", 10, 5)]
    assert sent(to_r1) == []


async def test_feedback_with_no_call_to_ride_on_goes_alone_on_the_session(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(router_client, "FEEDBACK_WAIT_S", 0.0)
    async with routers(OK, OK) as mesh:
        to_r1 = awaitable_calls(mesh, "r1")
        mesh.client.report(decided_by(mesh, "r1", "req-a", "wa"), prompt_tokens=64, cached_tokens=48)
        mesh.client.report(decided_by(mesh, "r1", "req-b", "wb"), prompt_tokens=16, cached_tokens=16)
        await to_r1.reach(1)
        (alone,) = to_r1
        r0_calls = len(mesh["r0"].calls)
        await mesh.client.close()
    # Both reports in one call, which asks for no routing.
    assert sent(alone) == [Report("req-a", "wa", 64, 48), Report("req-b", "wb", 16, 16)]
    assert (alone.request_id, alone.model, list(alone.token_ids)) == ("", "", [])
    assert r0_calls == 0


async def test_feedback_is_dropped_after_close(monkeypatch: pytest.MonkeyPatch) -> None:
    # With a wait of 0 the timer would fire at the loop's next turn, which the route call below
    # gives it; a call to r0 before it would carry what is pending.
    monkeypatch.setattr(router_client, "FEEDBACK_WAIT_S", 0.0)
    async with routers(OK) as mesh:
        to_r0 = awaitable_calls(mesh, "r0")
        mesh.client.report(decided_by(mesh, "r0", "before"), prompt_tokens=8, cached_tokens=8)
        await mesh.client.close()
        await mesh.client.close()  # twice is fine
        mesh.client.report(decided_by(mesh, "r0", "after"), prompt_tokens=8, cached_tokens=0)
        await route(mesh.client, "req-0")
        # Frames of one session arrive in order: a feedback call sent before this routing's
        # would be here first.
        calls = list(to_r0)
    assert [c.request_id for c in calls] == ["req-0"]
    assert sent(calls[0]) == []


async def test_a_router_holds_its_newest_feedback_and_drops_the_oldest_past_the_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(router_client, "FEEDBACK_WAIT_S", NEVER_ALONE_S)
    async with routers(OK) as mesh:
        for i in range(MAX_FEEDBACK_PER_ROUTER + 1):
            mesh.client.report(decided_by(mesh, "r0", f"fb-{i}"), prompt_tokens=i, cached_tokens=0)
        await route(mesh.client, "req-0")
        (call,) = mesh["r0"].calls
        await mesh.client.close()
    ids = [f.request_id for f in call.feedback]
    assert len(ids) == MAX_FEEDBACK_PER_ROUTER
    assert ids[0] == "fb-1" and ids[-1] == f"fb-{MAX_FEEDBACK_PER_ROUTER}"


async def test_a_routing_without_a_router_is_not_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    # A processor routing in-process has no router to tell (its choice's router is "").
    monkeypatch.setattr(router_client, "FEEDBACK_WAIT_S", 0.0)
    async with routers(OK) as mesh:
        mesh.client.report(RouteChoice("w", "10.0.0.7:5555", 0, 0.0, 0, request_id="local"), 8, 8)
        await route(mesh.client, "req-0")
        calls = list(mesh["r0"].calls)
        await mesh.client.close()
    assert [(c.request_id, sent(c)) for c in calls] == [("req-0", [])]


# -- the processor: each routing once ------------------------------------------------------------


def test_each_routing_is_reported_once_however_many_choices_share_it() -> None:
    heard: list[Report] = []
    on_cached = each_routing_once(lambda r, prompt, cached: heard.append(Report(r.request_id, r.worker_id, prompt,
                                                                                cached)))
    first = RouteChoice("w0", "a:1", 0, 0.0, 0, request_id="req", router="r:1")
    on_cached(first, 10, 8)
    on_cached(first, 10, 10)  # a second choice of the request on the same routing: cached by the first
    moved = RouteChoice("w1", "b:1", 0, 0.0, 0, request_id="req", router="r:1")
    on_cached(moved, 13, 0)  # a choice moved to another worker: a routing of its own
    on_cached(RouteChoice("w0", "a:1", 0, 0.0, 0, request_id="req-1", router="r:1"), 10, 4)
    assert heard == [Report("req", "w0", 10, 8), Report("req", "w1", 13, 0), Report("req-1", "w0", 10, 4)]


def test_requests_do_not_share_what_they_reported() -> None:
    heard: list[str] = []
    routing = RouteChoice("w0", "a:1", 0, 0.0, 0, request_id="req", router="r:1")
    for _ in range(2):  # one `each_routing_once` per request, as the processor builds them
        each_routing_once(lambda r, prompt, cached: heard.append(r.worker_id))(routing, 10, 8)
    assert heard == ["w0", "w0"]


# -- a choice's worker calls ---------------------------------------------------------------------

PROMPT = [11, 12, 13, 14]
MAX_TOKENS = 6
LOCAL, REMOTE = common_pb2.PrefillLocation.SITE_LOCAL, common_pb2.PrefillLocation.SITE_REMOTE
UNSAID = common_pb2.PrefillLocation.SITE_UNSPECIFIED


@dataclass(frozen=True)
class Call:
    """What one worker call does: says where the prompt was prefilled and what was cached, emits
    `tokens` outputs, then finishes (or, short of MAX_TOKENS, fails as a worker gone)."""

    site: common_pb2.PrefillLocation.Site
    cached_tokens: int
    tokens: int = MAX_TOKENS


@dataclass
class ScriptedWorker(worker_pb2_grpc.WorkerServicer):
    calls: list[Call]
    served: int = 0
    address: str = ""
    hub: SessionHub = field(init=False)

    def __post_init__(self) -> None:
        self.hub = SessionHub(WORKER_SESSION, self.generate)

    async def Session(self, frames: AsyncIterator[worker_pb2.WorkerSessionDown],  # noqa: N802
                      context: grpc.aio.ServicerContext) -> None:
        await self.hub.serve(frames, context)

    async def generate(self, request: worker_pb2.WorkerGenerateRequest,
                       call: CallInfo) -> AsyncIterator[worker_pb2.WorkerGenerateResponse]:
        script = self.calls[self.served]
        self.served += 1
        left = request.sampling.max_tokens
        for i in range(min(script.tokens, left)):
            response = worker_pb2.WorkerGenerateResponse(token_ids=[300 + request.resumed_tokens + i],
                                                         cached_tokens=script.cached_tokens)
            if i == 0:
                response.prefill.site = script.site
                if script.site == REMOTE:
                    response.prefill.prefill_worker_id = "p0"
            if i == left - 1:
                response.finish_reason = common_pb2.FINISH_REASON_LENGTH
            yield response
        if script.tokens < left:
            raise CallError(common_pb2.OUTCOME_PEER_GONE, "scripted: the worker went away")


@pytest.fixture(scope="module")
def tokenizer() -> ModelTokenizer:
    return ModelTokenizer(str(ensure_demo_model()))


async def reported_by_choice(tokenizer: ModelTokenizer, calls: list[Call]) -> list[Report]:
    """Runs one choice over workers following `calls` (worker w0, w1, ...); what `on_cached` heard."""
    heard: list[Report] = []
    worker = ScriptedWorker(calls)
    channels = ChannelPool()
    sessions = SessionPool(channels)
    async with serving(worker_pb2_grpc.add_WorkerServicer_to_server, worker) as address:
        try:
            async def reroute(rid: str, tokens: list[int], tried: list[str]) -> RouteChoice:
                return RouteChoice(f"w{len(tried)}", address, 0, 0.0, 0, request_id=rid, router="r:1")

            ctx = ChoiceContext(tokenizer, sessions, ChoiceLimits(30, 3, 3), reroute, lambda w: None, lambda: None,
                                on_cached=lambda r, p, c: heard.append(Report(r.request_id, r.worker_id, p, c)))
            choice = ChoiceStream(ChoiceSpec("req", 0, PROMPT, common_pb2.SamplingParams(max_tokens=MAX_TOKENS), []),
                                  ctx)
            events = [e async for e in choice.run(await reroute("req", PROMPT, []))]
        finally:
            await sessions.close()
            await channels.close()
    assert isinstance(events[-1], Finished) and events[-1].completion_tokens == MAX_TOKENS
    return heard


@pytest.mark.parametrize("site", [LOCAL, UNSAID], ids=["local", "unsaid"])
async def test_a_worker_calls_first_output_is_reported_with_its_routing(tokenizer: ModelTokenizer,
                                                                        site: common_pb2.PrefillLocation.Site) -> None:
    assert await reported_by_choice(tokenizer, [Call(site, cached_tokens=3)]) == [Report("req", "w0", len(PROMPT), 3)]


async def test_a_prompt_prefilled_by_a_prefill_worker_reports_nothing(tokenizer: ModelTokenizer) -> None:
    # The decode engine's count includes the blocks it pulled, which no routing of the decode
    # pool predicted.
    assert await reported_by_choice(tokenizer, [Call(REMOTE, cached_tokens=4)]) == []


async def test_each_worker_call_of_a_moved_choice_reports_what_it_was_sent(tokenizer: ModelTokenizer) -> None:
    # w0 goes after 2 tokens: w1 is sent the prompt and those 2, and reports on them; a call
    # whose prompt was prefilled remotely still reports nothing when it is the second.
    assert await reported_by_choice(tokenizer, [Call(LOCAL, 1, tokens=2), Call(LOCAL, 5)]) == [
        Report("req", "w0", len(PROMPT), 1), Report("req", "w1", len(PROMPT) + 2, 5)]
    assert await reported_by_choice(tokenizer, [Call(LOCAL, 1, tokens=2), Call(REMOTE, 6)]) == [
        Report("req", "w0", len(PROMPT), 1)]
