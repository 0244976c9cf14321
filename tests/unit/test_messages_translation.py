"""Anthropic's Messages API to the chat path and back, in-process: what a request becomes (the chat
body and the processor's GenerateRequest), what is refused by name, and the whole Message an
answer becomes (checked against the official client's own types)."""

from __future__ import annotations

import json

import pytest
from anthropic.types import Message

from gen.kvmesh.v1 import processor_pb2
from services.frontend.endpoints import processor_requests
from services.frontend.errors import ApiError
from services.frontend.messages_api import chat_body, message_body
from services.frontend.messages_schemas import CountTokensRequest, MessagesRequest, parse_messages
from services.frontend.schemas import ChatCompletionRequest, parse

MODEL = "kvmesh-demo"
WEATHER = {"name": "get_weather", "description": "the weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def chat_of(body: dict, model: type[CountTokensRequest] = MessagesRequest) -> ChatCompletionRequest:
    req = parse(ChatCompletionRequest, chat_body(parse_messages(model, body)))
    assert isinstance(req, ChatCompletionRequest)
    return req


def generate_of(body: dict) -> processor_pb2.GenerateRequest:
    [msg] = processor_requests("r1", chat_of(body))
    return msg


def test_a_tool_conversation_becomes_the_chat_history_the_template_renders() -> None:
    body = {"model": MODEL, "max_tokens": 64, "system": [{"type": "text", "text": "be brief"}],
            "tools": [WEATHER], "messages": [
                {"role": "user", "content": "weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "I should look", "signature": "sig"},
                    {"type": "redacted_thinking", "data": "opaque"},
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "call_7", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "call_7", "content": [{"type": "text", "text": "21 C"}]},
                    {"type": "tool_result", "tool_use_id": "call_8", "content": "no such city", "is_error": True},
                    {"type": "text", "text": "and tomorrow?", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}]}
    msg = generate_of(body)
    roles = [(m.role, m.content, m.tool_call_id) for m in msg.chat.messages]
    assert roles == [("system", "be brief", ""), ("user", "weather in Paris?", ""),
                     ("assistant", "Let me look.", ""), ("tool", "21 C", "call_7"),
                     ("tool", "Error: no such city", "call_8"), ("user", "and tomorrow?", "")]
    assistant = msg.chat.messages[2]
    assert assistant.reasoning == "I should look"
    [call] = assistant.tool_calls
    assert (call.id, call.name, json.loads(call.arguments)) == ("call_7", "get_weather", {"city": "Paris"})
    assert [t.name for t in msg.chat.tools] == ["get_weather"]
    assert msg.chat.add_generation_prompt and not msg.chat.continue_final_message


@pytest.mark.parametrize(("choice", "mode", "name", "parallel"), [
    ({"type": "auto"}, processor_pb2.ToolChoice.MODE_AUTO, "", True),
    ({"type": "any"}, processor_pb2.ToolChoice.MODE_REQUIRED, "", True),
    ({"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}, processor_pb2.ToolChoice.MODE_NAMED,
     "get_weather", False),
    ({"type": "none"}, processor_pb2.ToolChoice.MODE_NONE, "", True),
], ids=["auto", "any", "tool", "none"])
def test_tool_choice_is_the_chat_paths_and_a_forced_one_constrains(choice: dict, mode: int, name: str,
                                                                   parallel: bool) -> None:
    body = {"model": MODEL, "max_tokens": 8, "tools": [WEATHER], "tool_choice": choice,
            "messages": [{"role": "user", "content": "hi"}]}
    req = chat_of(body)
    assert req.forces_tool_call() == (choice["type"] in ("any", "tool"))
    tool_choice = generate_of(body).chat.tool_choice
    assert (tool_choice.mode, tool_choice.function, tool_choice.parallel) == (mode, name, parallel)


def test_sampling_stops_metadata_and_thinking_reach_the_chat_request() -> None:
    body = {"model": MODEL, "max_tokens": 2000, "temperature": 0.5, "top_p": 0.9, "top_k": 7,
            "stop_sequences": ["END", "\n\n"], "metadata": {"user_id": "agent-42"}, "stream": True,
            "thinking": {"type": "enabled", "budget_tokens": 1024}, "unknown_vendor_field": {"x": 1},
            "service_tier": "standard_only", "messages": [{"role": "user", "content": "hi"}]}
    req = chat_of(body)
    assert (req.max_tokens, req.temperature, req.top_p, req.top_k) == (2000, 0.5, 0.9, 7)
    assert req.stop == ["END", "\n\n"] and req.stream
    assert req.user == "agent-42"  # the session id under --session-from-user
    assert req.chat_template_kwargs == {"enable_thinking": True, "thinking": True}
    off = chat_of({**body, "thinking": {"type": "disabled"}})
    assert off.chat_template_kwargs == {"enable_thinking": False, "thinking": False}
    assert chat_of({**body, "thinking": {"type": "adaptive"}}).chat_template_kwargs is None


def test_a_last_assistant_message_is_a_prefill_the_answer_continues() -> None:
    req = chat_of({"model": MODEL, "max_tokens": 8, "messages": [
        {"role": "user", "content": "Greek name for the Sun?"}, {"role": "assistant", "content": "The answer is ("}]})
    assert req.continue_final_message and not req.add_generation_prompt


def test_output_config_is_a_strict_json_schema_and_the_effort() -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    req = chat_of({"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                   "output_config": {"effort": "low", "format": {"type": "json_schema", "schema": schema}}})
    assert req.reasoning_effort == "low"
    assert req.response_format is not None and req.response_format.json_schema is not None
    assert req.response_format.json_schema.schema_ == schema and req.response_format.json_schema.strict
    beta = chat_of({"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                    "output_format": {"type": "json_schema", "schema": schema}})
    assert beta.response_format == req.response_format


def test_count_tokens_takes_the_prompt_without_max_tokens() -> None:
    req = chat_of({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]},
                  CountTokensRequest)
    assert req.max_tokens is None and req.tools


HI = [{"role": "user", "content": "hi"}]
REFUSED = [
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]},
     "messages.1.content.0.type: image blocks are not allowed in an assistant message"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     "messages.0.content.0.type: document blocks"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                 "content": [{"type": "document", "source": {}}]}]}]},
     "messages.0.content.0.content.0.type: document blocks"),
    ({"messages": [{"role": "user", "content": [{"type": "hologram"}]}]},
     "messages.0.content.0.type: unknown content block type 'hologram'"),
    ({"messages": [{"role": "assistant", "content": [{"type": "server_tool_use", "id": "s", "name": "web_search"}]}]},
     "messages.0.content.0.type: server tool blocks"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type: server tools"),
    ({"tools": [{**WEATHER, "cache_control": {"type": "persistent"}}]}, "tools.0.cache_control: only"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {"type": "forever"}}]}]},
     "messages.0.content.0.cache_control: only"),
    ({"cache_control": {"type": "ephemeral", "ttl": "5m", "scope": "org"}}, "cache_control: only"),
    ({"container": "c1"}, "container: "),
    ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers: "),
    ({"service_tier": "priority"}, "service_tier: "),
    ({"temperature": 1.5}, "temperature: "),
    ({"max_tokens": 0}, "max_tokens: "),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice.name: "),
    ({"tools": [{**WEATHER, "input_examples": [{"city": "Oslo"}]}]}, "tools.0.input_examples: "),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking.budget_tokens: must be less than max_tokens"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f"}]}]},
     "messages.0.content.0.input: "),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "messages.0.content.0.type: tool_use blocks are not allowed in a user message"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
     "messages.0.content.0.type: tool_result blocks are not allowed in an assistant message"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": []}]}]},
     "messages.0.content.0.input: "),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0.text: "),
    ({"metadata": {"user_id": "u", "tier": "gold"}}, "metadata.tier: "),
]


@pytest.mark.parametrize(("fields", "opening"), REFUSED, ids=[o.split(":")[0] for _, o in REFUSED])
def test_what_cannot_be_honoured_is_a_400_naming_the_field(fields: dict, opening: str) -> None:
    body = {"model": MODEL, "max_tokens": 16, "messages": HI, **fields}
    with pytest.raises(ApiError) as caught:
        parse_messages(MessagesRequest, body)
    assert caught.value.status == 400
    assert caught.value.message.startswith(opening), caught.value.message
    assert caught.value.param == opening.split(":")[0]


def test_a_named_tool_that_is_not_among_the_tools_is_refused_by_the_chat_paths_rule() -> None:
    with pytest.raises(ApiError) as caught:
        chat_of({"model": MODEL, "max_tokens": 8, "messages": HI, "tools": [WEATHER],
                 "tool_choice": {"type": "tool", "name": "nope"}})
    assert caught.value.status == 400 and caught.value.param == "tool_choice"


def chat_answer(content: str | None, finish: str, reasoning: str = "", calls: tuple[tuple[str, str, str], ...] = (),
                cached: int | None = 3) -> dict:
    message: dict = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [{"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                                 for i, n, a in calls]
    usage: dict = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return {"choices": [{"index": 0, "message": message, "finish_reason": finish}], "usage": usage}


def test_a_whole_answer_is_a_message_the_official_client_reads() -> None:
    body = message_body("abc", MODEL, chat_answer("Let me look.", "tool_calls", reasoning="hmm",
                                                  calls=(("call_1", "get_weather", '{"city": "Oslo"}'),)))
    message = Message.model_validate(body)
    assert message.id == "msg_abc" and message.role == "assistant" and message.model == MODEL
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    tool = message.content[2]
    assert tool.type == "tool_use" and (tool.id, tool.name, tool.input) == ("call_1", "get_weather", {"city": "Oslo"})
    assert message.stop_reason == "tool_use" and message.stop_sequence is None
    # Anthropic's split: input_tokens are the prompt tokens not read from the cache.
    assert (message.usage.input_tokens, message.usage.cache_read_input_tokens) == (7, 3)
    assert (message.usage.output_tokens, message.usage.cache_creation_input_tokens) == (5, 0)


@pytest.mark.parametrize(("finish", "reason"), [("stop", "end_turn"), ("length", "max_tokens"),
                                                ("tool_calls", "tool_use")])
def test_finish_reasons_are_anthropics_stop_reasons(finish: str, reason: str) -> None:
    assert message_body("a", MODEL, chat_answer("x", finish))["stop_reason"] == reason


def test_hidden_routing_details_leave_the_prompt_whole_and_an_empty_answer_has_one_empty_text_block() -> None:
    body = message_body("a", MODEL, chat_answer("", "length", cached=None))
    assert body["usage"] == {"input_tokens": 10, "output_tokens": 5, "cache_creation_input_tokens": 0}
    assert body["content"] == [{"type": "text", "text": ""}]
    Message.model_validate(body)
