"""Anthropic's Messages API on the mocker mesh, with the official `anthropic` client.

A second gateway joins the session's mocker mesh with an API key (which the client sends as
`x-api-key`) and --session-from-user; whole and streamed messages, a tool conversation,
count_tokens, refusals naming the field and errors in Anthropic's shape. The same client on vLLM,
where forced tool calls are honoured, is in test_messages_vllm.py."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import json

import anthropic
import httpx
import pytest

from services.mesh.net import free_port
from tests.procs import MODEL, Mesh, Proc, service, wait_until

pytestmark = pytest.mark.timeout(180)

KEY = "messages-key"
WEATHER = {"name": "get_weather", "description": "the weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@dataclass
class Gateway:
    proc: Proc
    url: str


@pytest.fixture(scope="module")
def gateway(mocker_mesh: Mesh) -> Iterator[Gateway]:
    port = free_port()
    proc = service("services.frontend", "--etcd-endpoints", mocker_mesh.etcd, "--namespace", mocker_mesh.namespace,
                   "--http-port", str(port), "--api-key", KEY, "--session-from-user", name="messages-frontend")
    try:
        proc.wait_for("listening on", 60)
        gw = Gateway(proc, f"http://127.0.0.1:{port}")
        assert wait_until(lambda: httpx.get(f"{gw.url}/health", timeout=5).status_code == 200, 30)
        yield gw
    finally:
        assert proc.stop() == 0, proc.tail()


@pytest.fixture(scope="module")
def client(gateway: Gateway) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway.url, api_key=KEY, max_retries=0, timeout=60)


def test_a_message_answers_whole_and_streamed_with_the_same_text(client: anthropic.Anthropic, gateway: Gateway) -> None:
    kwargs = dict(model=MODEL, max_tokens=8, system="be brief", messages=ASK)
    whole = client.messages.create(**kwargs)
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert whole.model == MODEL and whole.stop_reason == "max_tokens" and whole.stop_sequence is None
    [block] = whole.content
    assert block.type == "text" and block.text
    assert whole.usage.output_tokens == 8 and whole.usage.input_tokens > 0
    events = list(client.messages.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == block.text
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 8
    # The client's own accumulation of the events is the whole answer.
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == (
        whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0))
    # On the wire a ping follows message_start (the client skips pings).
    with httpx.stream("POST", f"{gateway.url}/v1/messages", json={**kwargs, "stream": True},
                      headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"}, timeout=60) as reply:
        names = [line.removeprefix("event: ") for line in reply.iter_lines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-1] == "message_stop"


def test_metadata_user_id_names_the_agent_session(client: anthropic.Anthropic, gateway: Gateway) -> None:
    client.messages.create(model=MODEL, max_tokens=2, messages=ASK, metadata={"user_id": "agent-7"})
    gateway.proc.wait_for("session 'agent-7'", 10)


def test_a_tool_conversation_goes_around_and_count_tokens_counts_each_turn(client: anthropic.Anthropic) -> None:
    first = client.messages.create(model=MODEL, max_tokens=4, tools=[WEATHER], messages=ASK)
    # The mocker has no tool-call parser: the model's answer stays text. The client runs the tool
    # it would have called and sends its result back, with the call, in the next turn.
    history = ASK + [
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "toolu_01", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": "21 C, sunny"}]}]
    second = client.messages.create(model=MODEL, max_tokens=4, tools=[WEATHER], messages=history)
    assert second.content[0].type == "text"

    def prompt(message: anthropic.types.Message) -> int:
        return message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)

    assert prompt(second) > prompt(first) + 10
    for message, messages in ((first, ASK), (second, history)):
        counted = client.messages.count_tokens(model=MODEL, tools=[WEATHER], messages=messages)
        assert counted.input_tokens == prompt(message)


@pytest.mark.parametrize(("fields", "opening"), [
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image", "source": {"type": "url", "url": "http://example.com/y.png"}}]}]},
     "image URLs are not fetched from this address"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type: server tools"),
    ({"system": [{"type": "text", "text": "be brief", "cache_control": {"type": "permanent"}}]},
     "system.0.cache_control: only"),
    # A beta field this client version has no argument for.
    ({"extra_body": {"mcp_servers": [{"type": "url", "url": "http://example.com/mcp", "name": "x"}]}},
     "mcp_servers: "),
], ids=["image", "server-tool", "cache-control", "mcp"])
def test_what_cannot_be_honoured_is_a_400_naming_the_field(client: anthropic.Anthropic, fields: dict,
                                                           opening: str) -> None:
    kwargs = {"model": MODEL, "max_tokens": 4, "messages": ASK, **fields}
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(**kwargs)
    error = caught.value.body["error"]
    assert error["type"] == "invalid_request_error" and error["message"].startswith(opening), error


def test_a_forced_tool_the_mocker_cannot_constrain_is_refused_and_ephemeral_cache_control_is_a_no_op(
        client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=MODEL, max_tokens=4, messages=ASK, tools=[WEATHER], tool_choice={"type": "any"})
    assert "tool_choice" in caught.value.body["error"]["message"], caught.value.body
    cached = client.messages.create(model=MODEL, max_tokens=2, messages=ASK,
                                    system=[{"type": "text", "text": "be brief",
                                             "cache_control": {"type": "ephemeral", "ttl": "1h"}}])
    assert cached.stop_reason == "max_tokens"


def test_errors_come_in_anthropics_shape(client: anthropic.Anthropic, gateway: Gateway) -> None:
    with pytest.raises(anthropic.NotFoundError) as unknown:
        client.messages.create(model="no-such-model", max_tokens=4, messages=ASK)
    assert unknown.value.body["type"] == "error" and unknown.value.body["error"]["type"] == "not_found_error"
    stranger = anthropic.Anthropic(base_url=gateway.url, api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(anthropic.AuthenticationError):
        stranger.messages.create(model=MODEL, max_tokens=4, messages=ASK)
    with pytest.raises(anthropic.AuthenticationError):
        stranger.messages.count_tokens(model=MODEL, messages=ASK)
    missing = httpx.post(f"{gateway.url}/v1/messages", json={"model": MODEL, "messages": ASK},
                         headers={"x-api-key": KEY}, timeout=30)
    assert missing.status_code == 400 and missing.json() == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: Field required"}}


def test_a_stop_sequence_ends_the_message_and_is_named(client: anthropic.Anthropic) -> None:
    kwargs = dict(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Count with me."}])
    text = client.messages.create(**kwargs).content[0].text  # the mocker answers the same prompt alike
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), text
    whole = client.messages.create(stop_sequences=["never-seen", stop], **kwargs)
    assert (whole.stop_reason, whole.stop_sequence) == ("stop_sequence", stop)
    assert whole.content[0].text == text[:text.find(stop)]
    events = list(client.messages.create(stream=True, stop_sequences=[stop], **kwargs))
    assert (events[-2].delta.stop_reason, events[-2].delta.stop_sequence) == ("stop_sequence", stop)


def test_context_editing_clears_old_tool_results_and_reports_what_it_cleared(client: anthropic.Anthropic,
                                                                             gateway: Gateway) -> None:
    """Anthropic's context editing, applied by the gateway: the older of two tool results is
    cleared, the prompt shrinks by what the processor counts, and the answer (whole and
    streamed) says so."""
    result = "sunny, 21 degrees, light wind from the west " * 40
    history = [*ASK]
    for n in (1, 2):
        history += [{"role": "assistant", "content": [{"type": "tool_use", "id": f"toolu_{n}", "name": "get_weather",
                                                       "input": {"city": "Paris"}}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{n}",
                                                  "content": result}]}]
    edits = {"edits": [{"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 2},
                        "keep": {"type": "tool_uses", "value": 1}}]}
    body = {"model": MODEL, "max_tokens": 2, "tools": [WEATHER], "messages": history, "context_management": edits}
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    whole = httpx.post(f"{gateway.url}/v1/messages", json=body, headers=headers, timeout=60)
    assert whole.status_code == 200, whole.text
    [applied] = whole.json()["context_management"]["applied_edits"]
    unedited = client.messages.count_tokens(model=MODEL, tools=[WEATHER], messages=history).input_tokens
    usage = whole.json()["usage"]
    prompt = usage["input_tokens"] + usage.get("cache_read_input_tokens", 0)
    assert applied["type"] == "clear_tool_uses_20250919" and applied["cleared_tool_uses"] == 1
    assert applied["cleared_input_tokens"] == unedited - prompt > 200  # the long result is gone
    counted = httpx.post(f"{gateway.url}/v1/messages/count_tokens", json={k: v for k, v in body.items()
                                                                           if k != "max_tokens"}, headers=headers)
    assert counted.json()["input_tokens"] == prompt  # count_tokens applies the edits too
    streamed = httpx.post(f"{gateway.url}/v1/messages", json={**body, "stream": True}, headers=headers, timeout=60)
    [delta] = [json.loads(line[5:]) for line in streamed.text.splitlines()
               if line.startswith("data:") and '"message_delta"' in line]
    assert delta["context_management"]["applied_edits"] == [applied]
    # Nothing to clear (one tool use, kept): no count asked, nothing reported but the empty list.
    one = httpx.post(f"{gateway.url}/v1/messages", json={**body, "messages": history[:3]}, headers=headers, timeout=60)
    assert one.json()["context_management"] == {"applied_edits": []}
