"""The OpenAI surface of the mesh, driven by the official client, on the mocker engine."""

from __future__ import annotations

import httpx
import openai

from tests.procs import Mesh

MODEL = "kvmesh-demo"
MESSAGES = [{"role": "user", "content": "Tell me about prefix caching."}]


def test_models_lists_the_served_model(mocker_client: openai.OpenAI) -> None:
    assert [m.id for m in mocker_client.models.list().data] == [MODEL]


def test_chat_completion_returns_text_usage_and_length_finish(mocker_client: openai.OpenAI) -> None:
    reply = mocker_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12)
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 12
    assert reply.usage.prompt_tokens > 5
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 12
    assert reply.usage.prompt_tokens_details.cached_tokens >= 0


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
    assert len(events) >= 2


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
    chunks = list(mocker_client.completions.create(model=MODEL, prompt="abc", max_tokens=6, n=2, stream=True))
    per_choice: dict[int, str] = {}
    for c in chunks:
        for ch in c.choices:
            per_choice[ch.index] = per_choice.get(ch.index, "") + ch.text
    assert set(per_choice) == {0, 1}


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
    assert len(r.headers["x-kvmesh-worker"]) == 16


def test_repeated_prompt_reports_cached_tokens(mocker_client: openai.OpenAI) -> None:
    prompt = "A long shared system prompt that spans several KV blocks. " * 8
    mocker_client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    second = mocker_client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert second.usage.prompt_tokens_details.cached_tokens >= 16


def test_metrics_count_requests_and_latency(mocker_mesh: Mesh, mocker_client: openai.OpenAI) -> None:
    mocker_client.completions.create(model=MODEL, prompt="count me", max_tokens=2)
    text = httpx.get(mocker_mesh.base_url.removesuffix("/v1") + "/metrics", timeout=10).text
    for name in ("kvmesh_frontend_requests_total", "kvmesh_frontend_inflight_requests",
                 "kvmesh_frontend_time_to_first_token_seconds_bucket",
                 "kvmesh_frontend_inter_token_latency_seconds_bucket",
                 "kvmesh_frontend_request_duration_seconds_count"):
        assert name in text, name
    assert 'kvmesh_frontend_requests_total{endpoint="completions",status="200"}' in text


def test_health_is_ok_when_router_and_worker_serve(mocker_mesh: Mesh) -> None:
    r = httpx.get(mocker_mesh.base_url.removesuffix("/v1") + "/health", timeout=10)
    assert r.status_code == 200
    assert "kvmesh-demo" in r.json()["reason"]
