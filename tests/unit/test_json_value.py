"""A tool's schema and the chat-template arguments cross from the gateway to the processor typed
(`JsonValue`, `Tool`, `ToolCall`) and arrive as the client sent them: the same keys in the same
order, the same numbers, the same fields given or not, at any depth the body may have."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.budget import examples

from gen.kvmesh.v1 import json_value_pb2, processor_pb2
from services.contract.json_value import from_json_value, to_json_value
from services.frontend.endpoints import processor_requests
from services.frontend.errors import ApiError
from services.frontend.schemas import ChatCompletionRequest, parse
from services.processor.chat_render import chat_prompt, openai_tools

SCALARS = (st.none() | st.booleans() | st.integers() | st.integers(min_value=2**63, max_value=2**200)
           | st.floats(allow_nan=False) | st.text())
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner,
                                                                                         max_size=4), max_leaves=40)


def over_the_wire(value: Any) -> Any:
    sent = to_json_value(value).SerializeToString()
    return from_json_value(json_value_pb2.JsonValue.FromString(sent))


def same(a: Any, b: Any) -> bool:
    """Equal, with every int still an int, every float a float and every object's keys in order."""
    return json.dumps(a) == json.dumps(b) and repr(a) == repr(b)


@settings(max_examples=examples(300), deadline=None)
@given(JSON.filter(lambda v: not _has_surrogate(v)))
def test_a_json_value_arrives_as_json_loads_gave_it(value: Any) -> None:
    assert same(over_the_wire(value), value)


def _has_surrogate(value: Any) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return True
    return False


def test_integers_floats_and_key_order_survive_which_struct_would_change() -> None:
    schema = {"type": "object", "properties": {"zeta": {"minItems": 1}, "alpha": {"multipleOf": 2.0}},
              "maximum": 2**70, "minimum": -(2**63), "x": -0.0, "y": float("inf")}
    assert same(over_the_wire(schema), schema)


def test_nesting_costs_no_protobuf_depth() -> None:
    # Struct nests protobuf three levels per JSON level: a parser refuses it some 30 JSON levels down.
    deep: Any = {}
    for _ in range(3000):
        deep = {"k": [deep]}
    arrived = over_the_wire(deep)
    depth = 0
    while arrived:
        arrived, depth = arrived["k"][0], depth + 1
    assert depth == 3000


def test_a_lone_surrogate_cannot_be_written() -> None:
    for value in ({"a": "x\ud800"}, {"\udfff": 1}, ["\ud83d"]):
        with pytest.raises(UnicodeEncodeError):
            to_json_value(value)


@pytest.mark.parametrize("nodes", [
    [],
    [json_value_pb2.JsonNode(object_size=2), json_value_pb2.JsonNode(key="a", integer_value=1)],
    [json_value_pb2.JsonNode(integer_value=1), json_value_pb2.JsonNode(integer_value=2)],
    [json_value_pb2.JsonNode()],
])
def test_nodes_that_are_not_one_whole_value_are_refused(nodes: list[json_value_pb2.JsonNode]) -> None:
    with pytest.raises(ValueError):
        from_json_value(json_value_pb2.JsonValue(nodes=nodes))


# -- from the gateway's request to what the chat template gets ---------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "city": {"type": "string"}},
                   "required": ["city"], "minProperties": 1}, "strict": True}}
BARE = {"type": "function", "function": {"name": "now"}}
EMPTY = {"type": "function", "function": {"name": "noop", "description": "", "parameters": {}, "strict": False}}


def _chat(body: dict[str, Any]) -> processor_pb2.ChatInput:
    req = parse(ChatCompletionRequest, {"model": "m", **body})
    [msg] = processor_requests("r1", req)
    return processor_pb2.GenerateRequest.FromString(msg.SerializeToString()).chat


def test_tools_reach_the_template_with_the_fields_the_client_gave_in_its_order() -> None:
    tools = [WEATHER, BARE, EMPTY]
    chat = _chat({"messages": [{"role": "user", "content": "hi"}], "tools": tools})
    assert same(openai_tools(chat), tools)
    assert same(chat_prompt(chat).tools, tools)


def test_an_earlier_tool_call_reaches_the_template_with_its_arguments_as_an_object_when_they_parse() -> None:
    calls = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
             {"id": "c2", "type": "function", "function": {"name": "now", "arguments": "not json"}}]
    chat = _chat({"messages": [{"role": "user", "content": "hi"},
                               {"role": "assistant", "content": None, "tool_calls": calls}]})
    assert [(c.id, c.name, c.arguments) for c in chat.messages[1].tool_calls] == [
        ("c1", "get_weather", '{"city": "Oslo"}'), ("c2", "now", "not json")]
    rendered = chat_prompt(chat).messages[1]["tool_calls"]
    assert same(rendered[0]["function"]["arguments"], {"city": "Oslo"})
    assert rendered[1]["function"]["arguments"] == "not json"


def test_template_kwargs_arrive_as_given_with_reasoning_effort_added() -> None:
    kwargs = {"enable_thinking": False, "budget": 1024, "ratio": 2.0, "nested": {"b": [1, None], "a": "x"}}
    chat = _chat({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": kwargs,
                  "reasoning_effort": "low"})
    assert same(chat_prompt(chat).kwargs, {**kwargs, "reasoning_effort": "low"})
    assert not _chat({"messages": [{"role": "user", "content": "hi"}]}).HasField("template_kwargs")


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"description": "a\ud800"}}}]}, "tools"),
    ({"chat_template_kwargs": {"\ud800": 1}}, "chat_template_kwargs"),
])
def test_a_lone_surrogate_in_free_json_is_a_400_naming_its_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as refused:
        _chat({"messages": [{"role": "user", "content": "hi"}], **body})
    assert (refused.value.status, refused.value.param, refused.value.code) == (400, param, "invalid_request")
    assert "unpaired surrogate" in refused.value.message
