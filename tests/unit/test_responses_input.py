"""OpenAI's Responses API to the chat path and back, in process (responses_input.py and
responses_api.py): namespaced and hosted tools, what is refused by name, roles, and reasoning
that travels to the client and back inside `encrypted_content`."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.budget import examples

from services.frontend.client_fields import NESTED_ACCEPTED
from services.frontend.errors import ApiError
from gen.kvmesh.v1 import processor_pb2
from services.frontend.responses_api import ResponseBuilder, function_call, response_events
from services.frontend.responses_input import (
    ENCRYPTED_REASONING,
    HOSTED_TOOLS,
    REASONING_TOKEN,
    chat_body,
    decode_reasoning,
    encode_reasoning,
    nested_accepted,
)
from services.frontend.schemas import ChatCompletionRequest, parse

MODEL = "kvmesh-demo"
PARAMS = {"type": "object", "properties": {"cmd": {"type": "string"}}}
SHELL = {"type": "function", "name": "shell", "description": "run a command", "parameters": PARAMS}
AGENTS = {"type": "namespace", "name": "multi_agent_v1", "description": "sub-agents", "tools": [
    {"type": "function", "name": "spawn_agent", "parameters": PARAMS},
    {"type": "function", "name": "close_agent", "parameters": PARAMS, "strict": False}]}


def body(**fields: object) -> dict:
    return {"model": MODEL, "input": "hi", **fields}


def chat_of(request: dict) -> dict:
    out = chat_body(request)
    assert isinstance(parse(ChatCompletionRequest, out), ChatCompletionRequest)  # the chat path takes it
    return out


def refused(request: dict) -> ApiError:
    with pytest.raises(ApiError) as caught:
        chat_body(request)
    assert caught.value.status == 400
    return caught.value


def user(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def assistant(text: str) -> dict:
    return {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}


def reasoning(text: str) -> dict:
    return {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": encode_reasoning(text)}


def call(call_id: str, name: str = "shell", **extra: str) -> dict:
    return {"type": "function_call", "call_id": call_id, "name": name, "arguments": '{"cmd": "ls"}', **extra}


def output(call_id: str, value: object = "ok") -> dict:
    return {"type": "function_call_output", "call_id": call_id, "output": value}


# Tools


def test_a_namespaces_functions_are_chat_functions_named_within_it() -> None:
    chat = chat_of(body(tools=[SHELL, AGENTS]))
    assert [t["function"]["name"] for t in chat["tools"]] == ["shell", "multi_agent_v1.spawn_agent",
                                                               "multi_agent_v1.close_agent"]
    assert chat["tools"][2]["function"] == {"name": "multi_agent_v1.close_agent", "parameters": PARAMS,
                                            "strict": False}


def test_hosted_tools_are_left_out_and_named_as_accepted() -> None:
    request = body(tools=[{"type": "web_search", "external_web_access": False}, SHELL],
                   reasoning={"effort": "medium", "summary": "auto"})
    chat = chat_of(request)
    assert [t["function"]["name"] for t in chat["tools"]] == ["shell"]
    assert nested_accepted(request) == ["reasoning.summary", "tools.web_search"]
    only_hosted = chat_of(body(tools=[{"type": "web_search"}], tool_choice="auto"))
    assert "tools" not in only_hosted and "tool_choice" not in only_hosted


@pytest.mark.parametrize("kind", ["web_search", "file_search", "code_interpreter", "image_generation"])
def test_a_hosted_tool_is_dropped_and_reported_under_its_stated_effect(kind: str) -> None:
    request = body(tools=[{"type": kind}, SHELL])
    assert [t["function"]["name"] for t in chat_of(request)["tools"]] == ["shell"]
    assert nested_accepted(request) == [f"tools.{kind}"]
    assert f"tools.{kind}" in NESTED_ACCEPTED["responses"]


def test_every_hosted_tool_dropped_has_a_stated_effect() -> None:
    reported = [path for kind in sorted(HOSTED_TOOLS) for path in nested_accepted(body(tools=[{"type": kind}]))]
    assert len(reported) == len(HOSTED_TOOLS)
    assert [path for path in reported if path not in NESTED_ACCEPTED["responses"]] == []


def test_a_deferred_function_is_refused_by_name() -> None:
    exc = refused(body(tools=[SHELL, {**SHELL, "name": "later", "defer_loading": True}]))
    assert exc.param == "tools.1.defer_loading" and exc.code == "unsupported_parameter"
    inner = {**AGENTS, "tools": [AGENTS["tools"][0], {**SHELL, "defer_loading": True}]}
    assert refused(body(tools=[inner])).param == "tools.0.tools.1.defer_loading"
    assert "tools" in chat_of(body(tools=[{**SHELL, "defer_loading": False}]))


@pytest.mark.parametrize(("tools", "param"), [
    ([SHELL, {"type": "custom", "name": "apply_patch"}], "tools.1"),
    ([{"type": "tool_search"}], "tools.0"),
    (["shell"], "tools.0"),
    ([{**AGENTS, "tools": [{**AGENTS, "name": "inner"}]}], "tools.0.tools.0"),
    ([{**AGENTS, "name": "a.b"}], "tools.0.name"),
])
def test_a_tool_that_cannot_be_offered_is_refused_naming_it(tools: list, param: str) -> None:
    assert refused(body(tools=tools)).param == param


def test_include_is_accepted_and_must_be_a_list_of_strings() -> None:
    assert chat_of(body(include=[ENCRYPTED_REASONING]))["messages"] == [{"role": "user", "content": "hi"}]
    assert "include" not in chat_of(body(include=[]))
    assert refused(body(include="reasoning.encrypted_content")).param == "include"
    assert refused(body(include=[1])).param == "include"


# State the mesh does not keep


@pytest.mark.parametrize(("fields", "param"), [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
])
def test_what_needs_kept_state_is_refused_by_name(fields: dict, param: str) -> None:
    exc = refused(body(**fields))
    assert exc.param == param and exc.code == "unsupported_parameter"


def test_store_false_or_null_is_served() -> None:
    assert chat_of(body(store=False))["messages"]
    assert chat_of(body(store=None))["messages"]


def test_a_null_previous_response_id_is_served() -> None:
    assert chat_of(body(previous_response_id=None))["messages"]


# Input items


def test_developer_is_system_and_instructions_come_first() -> None:
    chat = chat_of(body(instructions="be useful", input=[
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "sandbox: on"}]},
        user("hi")]))
    assert [(m["role"], m["content"]) for m in chat["messages"]] == [
        ("system", "be useful"), ("system", [{"type": "text", "text": "sandbox: on"}]),
        ("user", [{"type": "text", "text": "hi"}])]


def test_a_namespaced_call_renders_as_its_chat_functions_name() -> None:
    chat = chat_of(body(tools=[AGENTS, SHELL], input=[
        user("spawn one"), call("c1", "spawn_agent", namespace="multi_agent_v1"), call("c2"),
        output("c1"), output("c2")]))
    [turn] = [m for m in chat["messages"] if m["role"] == "assistant"]
    assert [c["function"]["name"] for c in turn["tool_calls"]] == ["multi_agent_v1.spawn_agent", "shell"]
    assert [c["id"] for c in turn["tool_calls"]] == ["c1", "c2"]
    assert [m["tool_call_id"] for m in chat["messages"] if m["role"] == "tool"] == ["c1", "c2"]


def test_reasoning_joins_the_assistant_turn_after_it() -> None:
    chat = chat_of(body(input=[user("hi"), reasoning("thinking about a call"), call("c1"), output("c1"),
                               reasoning("thinking about the answer"), assistant("done")]))
    turns = [m for m in chat["messages"] if m["role"] == "assistant"]
    assert [t.get("reasoning_content") for t in turns] == ["thinking about a call", "thinking about the answer"]


def test_reasoning_last_in_its_turn_joins_the_assistant_turn_before_it() -> None:
    chat = chat_of(body(input=[user("hi"), assistant("hello"), reasoning("afterthought"), user("again")]))
    [turn] = [m for m in chat["messages"] if m["role"] == "assistant"]
    assert turn["reasoning_content"] == "afterthought"
    assert chat["messages"][-1]["role"] == "user" and "reasoning_content" not in chat["messages"][-1]


def test_reasoning_in_plain_content_is_read_too() -> None:
    item = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "plain "},
                                                             {"type": "reasoning_text", "text": "text"}]}
    chat = chat_of(body(input=[user("hi"), item, assistant("ok")]))
    assert chat["messages"][-1]["reasoning_content"] == "plain text"


def test_another_providers_encrypted_reasoning_is_ignored() -> None:
    foreign = {"type": "reasoning", "summary": [], "encrypted_content": "gAAAAABoZ3xyfoo-bar_baz=="}
    chat = chat_of(body(input=[user("hi"), foreign, assistant("ok")]))
    assert "reasoning_content" not in chat["messages"][-1]
    assert decode_reasoning("gAAAAABoZ3xyfoo-bar_baz==") is None and decode_reasoning(None) is None


@pytest.mark.parametrize("damaged", [
    REASONING_TOKEN + "!!!not base64!!!",
    REASONING_TOKEN + "aGVsbG8=",  # base64, not deflated
    encode_reasoning("a long enough reasoning text")[:-6],
    REASONING_TOKEN,
])
def test_a_damaged_token_of_ours_is_a_400(damaged: str) -> None:
    item = {"type": "reasoning", "summary": [], "encrypted_content": damaged}
    exc = refused(body(input=[user("hi"), item, assistant("ok")]))
    assert exc.param is not None and exc.param.startswith("input") and exc.code == "invalid_value"


def test_two_reasoning_items_of_one_turn_are_both_kept() -> None:
    chat = chat_of(body(input=[user("hi"), reasoning("first thought"), call("c1"), reasoning("second thought"),
                               call("c2"), output("c1"), output("c2")]))
    [turn] = [m for m in chat["messages"] if m["role"] == "assistant"]
    assert len(turn["tool_calls"]) == 2
    assert "first thought" in turn["reasoning_content"] and "second thought" in turn["reasoning_content"]


def test_a_function_call_output_of_text_parts_is_joined() -> None:
    parts = [{"type": "input_text", "text": "line one\n"}, {"type": "input_text", "text": "line two"}]
    chat = chat_of(body(input=[user("hi"), call("c1"), output("c1", parts)]))
    assert chat["messages"][-1] == {"role": "tool", "tool_call_id": "c1", "content": "line one\nline two"}
    image = [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]
    assert refused(body(input=[user("hi"), call("c1"), output("c1", image)])).param == "input.2.output.0"


# The answer


def test_a_namespaced_call_comes_back_with_name_and_namespace_apart() -> None:
    item = function_call("x1", "call_1", "multi_agent_v1.close_agent", '{"id": 3}')
    assert (item["name"], item["namespace"], item["call_id"], item["arguments"]) == (
        "close_agent", "multi_agent_v1", "call_1", '{"id": 3}')
    plain = function_call("x2", "call_2", "shell", "{}")
    assert plain["name"] == "shell" and "namespace" not in plain


def chat_answer() -> dict:
    return {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None, "reasoning_content": "I will close it",
        "tool_calls": [{"id": "call_9", "type": "function",
                        "function": {"name": "multi_agent_v1.close_agent", "arguments": "{}"}}]}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}


def test_the_response_carries_encrypted_reasoning_only_when_included() -> None:
    plain = ResponseBuilder("r1", MODEL, body()).from_chat(chat_answer())
    [thought, fc] = plain["output"]
    assert thought["type"] == "reasoning" and "encrypted_content" not in thought
    assert thought["content"] == [{"type": "reasoning_text", "text": "I will close it"}]
    assert (fc["name"], fc["namespace"], fc["call_id"]) == ("close_agent", "multi_agent_v1", "call_9")
    other = ResponseBuilder("r1", MODEL, body(include=["message.output_text.logprobs"])).from_chat(chat_answer())
    assert "encrypted_content" not in other["output"][0]
    wanted = ResponseBuilder("r1", MODEL, body(include=[ENCRYPTED_REASONING])).from_chat(chat_answer())
    token = wanted["output"][0]["encrypted_content"]
    assert token.startswith(REASONING_TOKEN) and decode_reasoning(token) == "I will close it"


def test_a_turn_sent_back_with_its_token_has_its_reasoning() -> None:
    answer = ResponseBuilder("r1", MODEL, body(include=[ENCRYPTED_REASONING])).from_chat(chat_answer())
    chat = chat_of(body(input=[user("close it"), *answer["output"], output("call_9", "closed")]))
    [turn] = [m for m in chat["messages"] if m["role"] == "assistant"]
    assert turn["reasoning_content"] == "I will close it"
    assert turn["tool_calls"][0]["function"]["name"] == "multi_agent_v1.close_agent"


@settings(max_examples=examples(300), deadline=None)
@given(st.text())
def test_a_reasoning_token_gives_back_the_text_it_was_made_of(text: str) -> None:
    token = encode_reasoning(text)
    assert token.startswith(REASONING_TOKEN) and token.isascii()
    assert decode_reasoning(token) == text


# Shapes that must be a 400, never a 500


@pytest.mark.parametrize(("fields", "param"), [
    ({"reasoning": {"effort": ["high"]}}, "reasoning.effort"),
    ({"tools": [{"type": ["web_search"]}]}, "tools.0"),
    ({"input": [{"type": "reasoning", "content": [{"type": "reasoning_text", "text": None}]}, user("go")]},
     "input.0.content.0.text"),
    ({"input": [call("c1"), output("c1", [{"type": "input_text", "text": 1}])]}, "input.1.output.0.text"),
], ids=["effort", "tool-type", "reasoning-text", "output-text"])
def test_a_wrong_json_type_is_a_400_naming_it(fields: dict, param: str) -> None:
    assert nested_accepted(body(**fields)) is not None  # counting the fields never fails either
    assert refused(body(**fields)).param == param


def test_a_requests_reasoning_tokens_share_one_inflate_budget() -> None:
    big = reasoning("x" * (3 << 20))  # 3 MiB each, a few KB as tokens
    one = chat_of(body(input=[user("go"), big, assistant("a")]))
    assert len(one["messages"][-1]["reasoning_content"]) == 3 << 20
    error = refused(body(input=[user("go"), big, assistant("a"), user("more"), big, assistant("b")]))
    assert error.param == "input.4.encrypted_content" and "MiB" in error.message


def test_reasoning_joins_the_assistant_item_after_it_not_a_preamble_before() -> None:
    chat = chat_of(body(input=[user("go"), assistant("let me look"), reasoning("think"), call("c1"), output("c1")]))
    preamble, called = [m for m in chat["messages"] if m["role"] == "assistant"]
    assert "reasoning_content" not in preamble and called["reasoning_content"] == "think"


# The answer's stream


def stream_events(deltas: list) -> list[dict]:
    async def items():  # noqa: ANN202
        for d in deltas:
            yield d

    async def run() -> list[bytes]:
        builder = ResponseBuilder("r1", MODEL, body())
        return [e async for e in response_events(builder, items(), processor_pb2.Usage(prompt_tokens=3))]

    return [json.loads(line[5:]) for e in asyncio.run(run()) for line in e.decode().splitlines()
            if line.startswith("data:")]


def test_the_completed_output_lists_items_at_the_indexes_the_stream_announced() -> None:
    events = stream_events([processor_pb2.ChoiceDelta(text="hello"), processor_pb2.ChoiceDelta(reasoning="hmm")])
    added = {e["output_index"]: e["item"]["type"] for e in events if e["type"] == "response.output_item.added"}
    assert added == {0: "message", 1: "reasoning"}
    final = events[-1]["response"]["output"]
    assert [item["type"] for item in final] == ["message", "reasoning"]
    assert final[1]["content"][0]["text"] == "hmm"


def test_an_empty_answer_announces_its_empty_message() -> None:
    events = stream_events([])
    kinds = [e["type"] for e in events]
    assert "response.output_item.added" in kinds and "response.output_item.done" in kinds
    [item] = events[-1]["response"]["output"]
    assert item["type"] == "message" and item["content"][0]["text"] == ""


def test_a_spent_reasoning_budget_inflates_nothing_more() -> None:
    size = 1 << 20
    token = encode_reasoning("y" * size)
    assert decode_reasoning(token, "p", size) == "y" * size  # exactly the budget
    with pytest.raises(ApiError):
        decode_reasoning(token, "p", size - 1)
    with pytest.raises(ApiError):
        decode_reasoning(encode_reasoning("z"), "p", 0)  # nothing left: not even one byte
    assert decode_reasoning(encode_reasoning(""), "p", 0) == ""
    # Four tokens of a quarter of the request's budget each spend it exactly; a fifth is refused.
    quarter = reasoning("q" * (1 << 20))
    turns = [item for _ in range(4) for item in (user("go"), quarter, assistant("a"))]
    assert len(chat_of(body(input=turns))["messages"]) == 8
    assert refused(body(input=[*turns, user("go"), quarter, assistant("a")])).param == "input.13.encrypted_content"
