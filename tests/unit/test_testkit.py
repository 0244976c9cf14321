"""The test kit's parts that start nothing: the SSE client's reading of a stream (and the client
against an in-process server: an answer, a refusal, a connection that breaks), and the etcd
starter's plan of its members."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import BaseTestServer, TestServer

from testkit.etcd import Etcd, EtcdTls
from testkit.sse import Streamed, completion_body, stream, stream_completion


def event(payload: object) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n"


def chunk(text: str, finish: str | None = None) -> bytes:
    return event({"choices": [{"index": 0, "text": text, "finish_reason": finish}], "usage": None})


USAGE = event({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3,
                                        "prompt_tokens_details": {"cached_tokens": 4}}})
DONE = b"data: [DONE]\n"


def test_a_streams_chunks_give_its_text_finish_usage_ttft_and_gaps() -> None:
    s = Streamed(started=10.0)
    lines = [chunk("a"), b"\n", chunk("b"), b": keep-alive\n", chunk("c", "length"), USAGE, DONE]
    arrivals = [s.feed(line, 11.0 + i) for i, line in enumerate(lines)]
    assert arrivals == [True, False, True, False, True, False, False]
    assert (s.text, s.pieces, s.finish) == ("abc", ["a", "b", "c"], "length")
    assert (s.prompt_tokens, s.completion_tokens, s.cached_tokens) == (7, 3, 4)
    assert s.ttft_s == 1.0 and s.gaps_s == [2.0, 2.0] and s.mean_itl_s == 2.0
    assert s.done and s.error is None
    s.status = 200
    assert s.ok and s.complete


def test_an_error_event_a_missing_done_and_a_usage_without_details_are_told() -> None:
    s = Streamed(status=200, started=0.0)
    for line in (chunk("a"), event({"error": {"message": "failed mid-stream", "code": 500}}), DONE, chunk("late")):
        s.feed(line, 1.0)
    assert s.error == "failed mid-stream"
    assert not s.done, "[DONE] was not the last event"
    assert not s.ok and not s.complete
    bare = Streamed(status=200, started=0.0)
    bare.feed(event({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}), 1.0)
    assert (bare.prompt_tokens, bare.cached_tokens) == (5, 0)
    assert math.isnan(bare.ttft_s) and not bare.ok, "no chunk came: not an answer"


def test_a_chat_stream_reads_its_deltas_and_text_lines_read_as_bytes_do() -> None:
    s = Streamed(started=0.0)
    s.feed('data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}', 1.0)
    s.feed('data: {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]}', 2.0)
    s.feed("data: [DONE]", 3.0)
    assert (s.text, s.finish, s.done, len(s.arrivals)) == ("hi", "stop", True, 2)


def test_a_malformed_event_is_an_error_not_an_exception() -> None:
    s = Streamed()
    assert not s.feed(b"data: {not json\n", 1.0)
    assert s.error is not None and "malformed" in s.error


def test_a_completion_body_asks_for_the_usage_and_exact_length_unless_told_otherwise() -> None:
    assert completion_body((1, 2), 5, seed=3) == {
        "model": "kvmesh-demo", "prompt": [1, 2], "max_tokens": 5, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True, "seed": 3}
    assert completion_body("hi", 2, usage=False, ignore_eos=False, model="m") == {
        "model": "m", "prompt": "hi", "max_tokens": 2, "stream": True}


async def _answer(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Kvmesh-Worker": "w1"})
    await response.prepare(request)
    for i in range(body["max_tokens"]):
        await response.write(chunk(f"t{i}", "length" if i == body["max_tokens"] - 1 else None) + b"\n")
    await response.write(USAGE + b"\n" + DONE + b"\n")
    return response


async def _refuse(_: web.Request) -> web.Response:
    return web.json_response({"error": {"code": "overloaded"}}, status=429, headers={"Retry-After": "1"})


async def _break(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(chunk("t0") + b"\n")
    assert request.transport is not None
    request.transport.close()  # mid-stream, without the end of the chunked body
    return response


@pytest.fixture
async def server() -> AsyncIterator[BaseTestServer]:
    app = web.Application()
    app.router.add_post("/v1/completions", _answer)
    app.router.add_post("/refused", _refuse)
    app.router.add_post("/broken", _break)
    async with TestServer(app) as srv:
        yield srv


async def test_the_client_reads_an_answer_a_refusal_and_a_broken_stream_without_raising(server: BaseTestServer) -> None:
    async with aiohttp.ClientSession(str(server.make_url(""))) as session:
        seen: list[int] = []
        answered = await stream(session, "/v1/completions", completion_body("p", 3),
                                on_chunk=lambda s: seen.append(len(s.pieces)))
        shorter = await stream_completion(session, "p", 2)
        refused = await stream(session, "/refused", completion_body("p", 3))
        broken = await stream(session, "/broken", {})
    assert answered.complete and answered.text == "t0t1t2" and answered.worker == "w1", answered
    assert seen == [1, 2, 3]
    assert shorter.complete and shorter.text == "t0t1" and shorter.finish == "length"
    assert answered.ended >= answered.started + answered.ttft_s
    assert (refused.status, refused.headers["retry-after"], json.loads(refused.body)["error"]["code"]) == (
        429, "1", "overloaded")
    assert not refused.ok and not refused.arrivals
    assert broken.status == 200 and broken.pieces == ["t0"] and broken.broken is not None and not broken.ok


def test_the_etcd_starter_plans_a_single_member_a_cluster_and_tls() -> None:
    single = Etcd()
    cluster = Etcd(3, extra=("--logger", "zap"))
    tls = Etcd(tls=EtcdTls(Path("c.pem"), Path("k.pem"), Path("ca.pem")), name="etcd-tls")
    try:
        assert [m.cluster for m in single.members] == [()] and single.endpoints == [single.endpoint]
        assert single.endpoint.startswith("http://127.0.0.1:")
        assert [m.name for m in cluster.members] == ["m0", "m1", "m2"]
        assert all(m.cluster == tuple((n.name, n.peer_url) for n in cluster.members) for m in cluster.members)
        assert all(m.extra == ("--logger", "zap", "--initial-cluster-state", "new") for m in cluster.members)
        assert len({m.client_port for m in cluster.members}) == 3
        assert tls.endpoint.startswith("https://") and "--client-cert-auth" in tls.members[0].extra
        assert tls.members[0].extra[:2] == ("--cert-file", "c.pem")
    finally:
        for etcd in (single, cluster, tls):
            etcd.stop()
