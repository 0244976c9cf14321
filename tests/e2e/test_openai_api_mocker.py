"""The OpenAI surface of the mesh, driven by the official client, on the mocker engine."""

from __future__ import annotations

import json
import time
import uuid

import httpx
import openai
from prometheus_client.samples import Sample

from services.mesh.discovery import DECODE_WORKER
from testkit.metrics import find, scrape, total, value
from tests.procs import Mesh, registered

MODEL = "kvmesh-demo"
MESSAGES = [{"role": "user", "content": "Tell me about prefix caching."}]
BLOCK_SIZE = 16  # the launcher's mocker workers


def test_models_lists_the_served_model(mocker_client: openai.OpenAI) -> None:
    assert [m.id for m in mocker_client.models.list().data] == [MODEL]


def test_chat_completion_returns_text_usage_and_length_finish(mocker_client: openai.OpenAI) -> None:
    # A conversation no earlier request shared a block with: nothing of it can be cached yet.
    fresh = [{"role": "user", "content": f"{uuid.uuid4().hex} Tell me about prefix caching."}]
    reply = mocker_client.chat.completions.create(model=MODEL, messages=fresh, max_tokens=12)
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 12
    assert reply.usage.prompt_tokens > 5
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 12
    assert reply.usage.prompt_tokens_details.cached_tokens == 0


def test_streamed_chat_equals_the_non_streamed_answer(mocker_client: openai.OpenAI) -> None:
    whole = mocker_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20)
    chunks = list(mocker_client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=20, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20


def test_sse_stream_ends_with_done(mocker_mesh: Mesh) -> None:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{mocker_mesh.base_url}/completions", json=body, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert chunks and all(c["object"] == "text_completion" for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == ["length"]


def test_completion_with_string_prompt(mocker_client: openai.OpenAI) -> None:
    reply = mocker_client.completions.create(model=MODEL, prompt="The router keeps a tree", max_tokens=7)
    assert reply.object == "text_completion"
    assert reply.usage.completion_tokens == 7
    assert reply.choices[0].text


def test_completion_accepts_token_ids_and_lists_of_prompts(mocker_client: openai.OpenAI) -> None:
    reply = mocker_client.completions.create(model=MODEL, prompt=["first prompt", "second prompt"], max_tokens=4)
    assert sorted(c.index for c in reply.choices) == [0, 1]
    assert reply.usage.completion_tokens == 8
    by_ids = mocker_client.completions.create(model=MODEL, prompt=[10, 11, 12, 13], max_tokens=4)
    assert by_ids.usage.prompt_tokens == 4


def test_n_returns_n_choices_and_counts_all_their_tokens(mocker_client: openai.OpenAI) -> None:
    reply = mocker_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, n=3, seed=7)
    assert sorted(c.index for c in reply.choices) == [0, 1, 2]
    assert reply.usage.completion_tokens == 15
    # Seeded choices use seed, seed+1, ...: different but reproducible.
    texts = {c.message.content for c in reply.choices}
    assert len(texts) == 3
    again = mocker_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, n=3, seed=7)
    assert [c.message.content for c in sorted(again.choices, key=lambda c: c.index)] == \
        [c.message.content for c in sorted(reply.choices, key=lambda c: c.index)]


def test_streamed_n_delivers_every_choice(mocker_client: openai.OpenAI) -> None:
    request = dict(model=MODEL, prompt="abc", max_tokens=6, n=2, seed=11)
    whole = {c.index: c for c in mocker_client.completions.create(**request).choices}
    assert sorted(whole) == [0, 1] and whole[0].text != whole[1].text
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    for chunk in mocker_client.completions.create(**request, stream=True):
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            if ch.finish_reason:
                finishes.setdefault(ch.index, []).append(ch.finish_reason)
    assert texts == {i: whole[i].text for i in (0, 1)}
    assert finishes == {i: [whole[i].finish_reason] for i in (0, 1)}


def test_stop_string_truncates_before_it_and_reports_stop(mocker_client: openai.OpenAI) -> None:
    full = mocker_client.completions.create(model=MODEL, prompt="stop strings", max_tokens=40).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert len(stop) == 3
    reply = mocker_client.completions.create(model=MODEL, prompt="stop strings", max_tokens=40, stop=[stop, "zzzzzz"])
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].text == full[: full.index(stop)]
    streamed = mocker_client.completions.create(model=MODEL, prompt="stop strings", max_tokens=40, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == full[: full.index(stop)]


def test_every_response_carries_the_routing_headers(mocker_mesh: Mesh) -> None:
    r = httpx.post(f"{mocker_mesh.base_url}/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                   headers={"x-request-id": "my-request-42"}, timeout=30)
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "my-request-42"
    assert r.headers["x-kvmesh-prefill"] == "local"
    workers = registered(mocker_mesh.etcd, mocker_mesh.namespace, DECODE_WORKER)
    assert r.headers["x-kvmesh-worker"] in {w.instance_id for w in workers}


def test_repeated_prompt_reports_cached_tokens(mocker_client: openai.OpenAI) -> None:
    prompt = f"{uuid.uuid4().hex} " + "A long shared system prompt that spans several KV blocks. " * 8
    first = mocker_client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = mocker_client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    cached, prompt_tokens = second.usage.prompt_tokens_details.cached_tokens, second.usage.prompt_tokens
    assert prompt_tokens == first.usage.prompt_tokens > 4 * BLOCK_SIZE
    # Whole blocks only, and all the prompt's full blocks but possibly the last.
    assert cached > 0 and cached % BLOCK_SIZE == 0 and cached <= prompt_tokens, (cached, prompt_tokens)
    assert cached >= (prompt_tokens // BLOCK_SIZE - 1) * BLOCK_SIZE, (cached, prompt_tokens)


def frontend_metrics(mesh: Mesh) -> list[Sample]:
    """The gateway's /metrics samples."""
    return scrape(mesh.base_url.removesuffix("/v1") + "/metrics")


def inflight_back_to_zero(mesh: Mesh, timeout_s: float = 15) -> float:
    """Polls the in-flight gauge until it reads 0 (returns 0) or the deadline passes (returns the last value)."""
    deadline = time.monotonic() + timeout_s
    while (inflight := value(frontend_metrics(mesh), "kvmesh_frontend_inflight_requests")) != 0 and \
            time.monotonic() < deadline:
        time.sleep(0.1)
    return inflight


def test_metrics_count_requests_and_latency(mocker_mesh: Mesh, mocker_client: openai.OpenAI) -> None:
    ok = dict(endpoint="completions", status="200")
    before = frontend_metrics(mocker_mesh)
    mocker_client.completions.create(model=MODEL, prompt="count me", max_tokens=2)
    mocker_client.completions.create(model=MODEL, prompt="count me too", max_tokens=2)
    assert "".join(c.choices[0].text for c in mocker_client.completions.create(
        model=MODEL, prompt="and me, streamed", max_tokens=2, stream=True) if c.choices)
    sent = 3
    after = frontend_metrics(mocker_mesh)
    # No other test sends requests meanwhile: the counters moved by exactly what this one sent.
    assert value(after, "kvmesh_frontend_requests_total", **ok) - total(before, "kvmesh_frontend_requests_total",
                                                                       **ok) == sent
    for histogram in ("kvmesh_frontend_time_to_first_token_seconds", "kvmesh_frontend_request_duration_seconds"):
        assert value(after, histogram + "_count") - value(before, histogram + "_count") == sent, histogram
        assert value(after, histogram + "_sum") > value(before, histogram + "_sum"), histogram
        assert value(after, histogram + "_bucket", le="+Inf") == value(after, histogram + "_count"), histogram
    # How many gaps a 2-token answer has depends on how the detokenizer groups tokens: only its presence is fixed.
    assert find(after, "kvmesh_frontend_inter_token_latency_seconds_count") is not None
    assert inflight_back_to_zero(mocker_mesh) == 0


def test_an_abandoned_stream_leaves_nothing_in_flight(mocker_mesh: Mesh) -> None:
    # 4000 tokens take seconds to stream: the request is still being served when the client leaves.
    body = {"model": MODEL, "prompt": "a long answer nobody reads", "max_tokens": 4000, "stream": True}
    with httpx.stream("POST", f"{mocker_mesh.base_url}/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept referenced: a dropped iterator would close the response early
        first = next(line for line in lines if line)
        assert json.loads(first.removeprefix("data: "))["choices"]
        assert value(frontend_metrics(mocker_mesh), "kvmesh_frontend_inflight_requests") == 1
    # The client hung up after its first chunk; the gateway must notice and let the request go.
    assert inflight_back_to_zero(mocker_mesh) == 0


def test_health_is_ok_when_router_and_worker_serve(mocker_mesh: Mesh) -> None:
    r = httpx.get(mocker_mesh.base_url.removesuffix("/v1") + "/health", timeout=10)
    assert r.status_code == 200
    assert r.json() == {"status": "ok", "reason": "serving kvmesh-demo"}


def test_a_request_without_max_tokens_is_bounded_by_the_default(mocker_client: openai.OpenAI) -> None:
    # The mesh's context (4096) would allow ~4090 tokens; an unbounded request gets 2048.
    reply = mocker_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "go on"}],
                                                  extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 2048
    assert reply.choices[0].finish_reason == "length"
