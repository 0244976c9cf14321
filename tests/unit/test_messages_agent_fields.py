"""What agent clients send beside the prompt, in process: the Messages API's agent fields
(mid-conversation system messages, deferred tools and the tool_reference blocks that load them,
effort levels, Claude Code's session id in metadata.user_id, thinking.display and the context
edits the answer reports), how fields without effect are counted (client_fields.py), and which
session a request lands in (sessions.py)."""

from __future__ import annotations

import json
import string

import pytest
from prometheus_client import CollectorRegistry, Counter

from services.frontend.client_fields import MAX_NAMED, NESTED_ACCEPTED, ClientFields
from services.frontend.errors import ApiError
from services.frontend.messages_api import (
    TOOL_LOADED,
    TOOL_UNKNOWN,
    MessageShape,
    agent_session,
    chat_body,
    message_body,
    nested_accepted,
)
from services.frontend.messages_schemas import (
    ClearThinking,
    ClearToolUses,
    CountTokensRequest,
    MessagesRequest,
    ThinkingAdaptive,
    parse_messages,
)
from services.frontend.schemas import ChatCompletionRequest, parse
from services.frontend.sessions import MAX_SESSION_CHARS, PARENT_SESSION_HEADER, SESSION_HEADER, request_session

MODEL = "kvmesh-demo"
HI = [{"role": "user", "content": "hi"}]
WEATHER = {"name": "get_weather", "description": "the weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
NOTEBOOK = {"name": "NotebookEdit", "description": "edit a notebook cell", "defer_loading": True,
            "input_schema": {"type": "object", "properties": {"cell": {"type": "integer"}}}}


def messages(**fields: object) -> MessagesRequest:
    body = {"model": MODEL, "max_tokens": 64, "messages": HI, **fields}
    req = parse_messages(MessagesRequest, body)
    assert isinstance(req, MessagesRequest)
    return req


def chat_of(req: CountTokensRequest) -> dict:
    body = chat_body(req)
    assert isinstance(parse(ChatCompletionRequest, body), ChatCompletionRequest)  # the chat path takes it
    return body


def search_result(*parts: dict) -> list[dict]:
    """A conversation whose tool search answered with `parts`."""
    return [{"role": "user", "content": "edit the notebook"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_s", "name": "ToolSearch",
                                               "input": {"query": "notebook"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_s", "content": list(parts)}]}]


# Messages API: the request


def test_a_mid_conversation_system_message_is_a_system_message_where_it_stands() -> None:
    req = messages(system="you are an agent", messages=[
        {"role": "user", "content": "hi"},
        {"role": "system", "content": "<env>cwd: /repo</env>"},
        {"role": "assistant", "content": "hello"},
        {"role": "system", "content": [{"type": "text", "text": "reminder: "}, {"type": "text", "text": "be brief"}]},
        {"role": "user", "content": "go"}])
    chat = chat_of(req)
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "system", "assistant", "system", "user"]
    assert chat["messages"][2]["content"] == "<env>cwd: /repo</env>"
    assert chat["messages"][4]["content"] == [{"type": "text", "text": "reminder: "},
                                              {"type": "text", "text": "be brief"}]


def test_deferred_tools_stay_out_of_the_tool_list() -> None:
    chat = chat_of(messages(tools=[WEATHER, NOTEBOOK]))
    assert [t["function"]["name"] for t in chat["tools"]] == ["get_weather"]
    only_deferred = chat_of(messages(tools=[NOTEBOOK]))
    assert "tools" not in only_deferred


def test_a_tool_choice_naming_a_deferred_tool_offers_it() -> None:
    chat = chat_of(messages(tools=[WEATHER, NOTEBOOK], tool_choice={"type": "tool", "name": "NotebookEdit"}))
    assert [t["function"]["name"] for t in chat["tools"]] == ["get_weather", "NotebookEdit"]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "NotebookEdit"}}
    other = chat_of(messages(tools=[WEATHER, NOTEBOOK], tool_choice={"type": "tool", "name": "get_weather"}))
    assert [t["function"]["name"] for t in other["tools"]] == ["get_weather"]


def test_a_tool_reference_writes_the_deferred_tools_definition_into_its_tool_message() -> None:
    req = messages(tools=[WEATHER, NOTEBOOK], messages=search_result(
        {"type": "text", "text": "found one:"}, {"type": "tool_reference", "tool_name": "NotebookEdit"}))
    chat = chat_of(req)
    [tool] = [m for m in chat["messages"] if m["role"] == "tool"]
    assert tool["tool_call_id"] == "toolu_s"
    first, second = tool["content"].split("\n")
    assert first == "found one:"
    assert second.startswith(TOOL_LOADED)
    definition = json.loads(second.removeprefix(TOOL_LOADED))
    assert definition == {"type": "function", "function": {"name": "NotebookEdit",
                                                           "description": "edit a notebook cell",
                                                           "parameters": NOTEBOOK["input_schema"]}}
    # The tool list, ahead of the conversation, is what it was before the search: the prefix holds.
    assert [t["function"]["name"] for t in chat["tools"]] == ["get_weather"]


def test_a_tool_reference_to_a_tool_the_request_does_not_define_is_named_unknown() -> None:
    req = messages(tools=[WEATHER, NOTEBOOK], messages=search_result({"type": "tool_reference", "tool_name": "Nope"}))
    [tool] = [m for m in chat_of(req)["messages"] if m["role"] == "tool"]
    assert tool["content"] == f"{TOOL_UNKNOWN}Nope"


def test_a_tool_reference_to_a_tool_already_offered_is_not_called_unknown() -> None:
    req = messages(tools=[WEATHER, NOTEBOOK], messages=search_result(
        {"type": "tool_reference", "tool_name": "get_weather"}))
    [tool] = [m for m in chat_of(req)["messages"] if m["role"] == "tool"]
    assert not tool["content"].startswith(TOOL_UNKNOWN)


@pytest.mark.parametrize(("effort", "chat_effort", "nested"), [
    ("low", "low", []), ("medium", "medium", []), ("high", "high", []),
    ("xhigh", "high", ["output_config.effort.xhigh"]), ("max", "high", ["output_config.effort.xhigh"]),
])
def test_effort_levels_above_high_are_high(effort: str, chat_effort: str, nested: list[str]) -> None:
    req = messages(output_config={"effort": effort})
    assert chat_of(req)["reasoning_effort"] == chat_effort
    assert nested_accepted(req) == nested


def test_claude_codes_user_id_names_its_session() -> None:
    user_id = json.dumps({"device_id": "d" * 64, "account_uuid": "", "session_id": "abc"})
    req = messages(metadata={"user_id": user_id})
    assert agent_session(req) == ("abc", "metadata.user_id")
    assert chat_of(req)["user"] == user_id  # the chat request's user stays what was sent


@pytest.mark.parametrize("user_id", [
    "agent-42", "{broken json", '{"device_id": "d"}', '{"session_id": ""}', '{"session_id": 7}',
    '{"session_id": null}', "", '["session_id", "abc"]',
])
def test_no_session_is_read_from_a_user_id_that_does_not_carry_one(user_id: str) -> None:
    assert agent_session(messages(metadata={"user_id": user_id})) is None


def test_no_session_without_metadata_or_on_count_tokens() -> None:
    assert agent_session(messages()) is None
    count = parse_messages(CountTokensRequest, {"model": MODEL, "messages": HI,
                                                "metadata": {"user_id": '{"session_id": "abc"}'}})
    assert agent_session(count) is None


def test_nested_accepted_names_the_parts_taken_without_effect() -> None:
    assert nested_accepted(messages()) == []
    req = messages(thinking={"type": "adaptive", "display": "summarized"},
                   tools=[{**WEATHER, "eager_input_streaming": True}], output_config={"effort": "max"})
    got = nested_accepted(req)
    assert got == ["thinking.display", "tools.eager_input_streaming", "output_config.effort.xhigh"]
    # `omitted` changes the answer (thinking without its text): implemented, not counted.
    assert nested_accepted(messages(thinking={"type": "adaptive", "display": "omitted"})) == []
    assert set(got) <= set(NESTED_ACCEPTED["messages"])
    assert nested_accepted(messages(thinking={"type": "adaptive"})) == []


def test_agent_fields_parse() -> None:
    req = messages(
        thinking={"type": "adaptive", "display": "omitted"},
        tools=[WEATHER, NOTEBOOK],
        context_management={"edits": [
            {"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 2}},
            {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 30000},
             "keep": {"type": "tool_uses", "value": 3}, "clear_at_least": {"type": "input_tokens", "value": 5000},
             "exclude_tools": ["web_search"], "clear_tool_inputs": ["Bash"]},
            {"type": "clear_thinking_20251015", "keep": "all"}]})
    assert isinstance(req.thinking, ThinkingAdaptive) and req.thinking.display == "omitted"
    assert req.tools is not None and [t.defer_loading for t in req.tools] == [None, True]
    assert req.context_management is not None
    first, second, third = req.context_management.edits
    assert isinstance(first, ClearThinking) and first.keep is not None and first.keep != "all"
    assert first.keep.value == 2
    assert isinstance(second, ClearToolUses) and second.clear_tool_inputs == ["Bash"]
    assert second.trigger is not None and second.trigger.type == "input_tokens" and second.trigger.value == 30000
    assert isinstance(third, ClearThinking) and third.keep == "all"


@pytest.mark.parametrize(("fields", "opening"), [
    ({"messages": [{"role": "user", "content": [{"type": "tool_reference", "tool_name": "NotebookEdit"}]}]},
     "messages.0.content.0.type: "),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "text", "text": "x"}, {"type": "tool_reference", "tool_name": "NotebookEdit"}]}]},
     "messages.1.content.1.type: "),
    ({"system": [{"type": "text", "text": "a"}, {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]},
     "system.1.type: image blocks are not allowed here"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]},
     "messages.1.content.0.type: image blocks are not allowed here"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "messages.1.content.0.type: tool_use blocks are not allowed here"),
    ({"thinking": {"type": "adaptive", "display": "hidden"}}, "thinking.display: "),
    ({"context_management": {"edits": [{"type": "clear_everything"}]}}, "context_management.edits.0: "),
    ({"context_management": {"edits": [{"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses",
                                                                                         "value": -1}}]}},
     "context_management.edits.0.trigger.value: "),
    ({"context_management": {"edits": [{"type": "clear_tool_uses_20250919", "keep_all": True}]}},
     "context_management.edits.0.keep_all: "),
    ({"context_management": {"edits": [{"type": "clear_thinking_20251015"}] * 9}}, "context_management.edits: "),
    ({"tools": [{**NOTEBOOK, "defer_loading": "yes"}]}, "tools.0.defer_loading: "),
], ids=lambda v: v.split(":")[0] if isinstance(v, str) else None)
def test_what_is_refused_is_a_400_opening_with_the_fields_path(fields: dict, opening: str) -> None:
    with pytest.raises(ApiError) as caught:
        messages(**fields)
    assert caught.value.status == 400
    assert caught.value.message.startswith(opening), caught.value.message
    assert caught.value.param == opening.split(":")[0]


def test_a_bad_thinking_keep_is_named_by_its_fields_path() -> None:
    with pytest.raises(ApiError) as caught:
        messages(context_management={"edits": [{"type": "clear_thinking_20251015",
                                                "keep": {"type": "thinking_turns", "value": 0}}]})
    assert caught.value.param == "context_management.edits.0.keep.value"


# Messages API: the answer


def chat_answer(reasoning: str = "the user wants a greeting", content: str = "hello") -> dict:
    return {"choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": content, "reasoning_content": reasoning}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}


@pytest.mark.parametrize(("thinking", "shown"), [
    ({"type": "adaptive", "display": "omitted"}, ""),
    ({"type": "enabled", "budget_tokens": 1024, "display": "omitted"}, ""),
    ({"type": "adaptive", "display": "summarized"}, "the user wants a greeting"),
    ({"type": "adaptive"}, "the user wants a greeting"),
])
def test_thinking_display_omitted_returns_the_block_without_its_text(thinking: dict, shown: str) -> None:
    req = messages(max_tokens=2048, thinking=thinking)
    body = message_body("r1", MODEL, chat_answer(), MessageShape.of(req, []))
    assert body["content"] == [{"type": "thinking", "thinking": shown, "signature": ""},
                               {"type": "text", "text": "hello"}]
    assert "context_management" not in body


def test_the_applied_edits_are_reported_when_context_management_was_asked_for() -> None:
    applied = [{"type": "clear_thinking_20251015", "cleared_thinking_turns": 2, "cleared_input_tokens": 120}]
    req = messages(context_management={"edits": [{"type": "clear_thinking_20251015"}]})
    body = message_body("r1", MODEL, chat_answer(), MessageShape.of(req, applied))
    assert body["context_management"] == {"applied_edits": applied}
    none_applied = message_body("r1", MODEL, chat_answer(), MessageShape.of(req, []))
    assert none_applied["context_management"] == {"applied_edits": []}
    not_asked = message_body("r1", MODEL, chat_answer(), MessageShape.of(messages(), applied))
    assert "context_management" not in not_asked


# Fields counted (client_fields.py)


def counter() -> tuple[Counter, CollectorRegistry]:
    registry = CollectorRegistry()
    return Counter("kvmesh_frontend_client_fields", "fields", ["api", "field", "effect"], registry=registry), registry


def counted(registry: CollectorRegistry, api: str, field: str, effect: str) -> float:
    value = registry.get_sample_value("kvmesh_frontend_client_fields_total",
                                      {"api": api, "field": field, "effect": effect})
    return value or 0.0


def all_counted(registry: CollectorRegistry) -> dict[tuple[str, str, str], float]:
    return {(s.labels["api"], s.labels["field"], s.labels["effect"]): s.value
            for metric in registry.collect() for s in metric.samples if s.name.endswith("_total")}


def test_accepted_and_unknown_fields_are_counted_by_name_implemented_ones_not() -> None:
    c, registry = counter()
    fields = ClientFields(c)
    fields.note("responses", {"model": MODEL, "input": "hi", "store": False, "client_metadata": {"x": "y"},
                              "truncation": "auto", "brand_new_field": 1})
    fields.note("responses", {"model": MODEL, "client_metadata": {}})
    fields.note("messages", {"model": MODEL, "messages": HI, "max_tokens": 8, "betas": ["x"], "context_management": {},
                             "other_new": True}, ["thinking.display"])
    assert all_counted(registry) == {
        ("responses", "client_metadata", "accepted"): 2.0,
        ("responses", "truncation", "accepted"): 1.0,
        ("responses", "brand_new_field", "unknown"): 1.0,
        ("messages", "betas", "accepted"): 1.0,
        ("messages", "other_new", "unknown"): 1.0,
        ("messages", "thinking.display", "accepted"): 1.0,
    }


def test_unknown_names_past_the_bound_are_other() -> None:
    c, registry = counter()
    fields = ClientFields(c)
    for i in range(MAX_NAMED):
        fields.note("responses", {f"field_{i}": 1})
    fields.note("responses", {"one_too_many": 1, "another": 2})
    fields.note("responses", {"field_0": 1})  # a name counted already keeps its own
    assert counted(registry, "responses", "one_too_many", "unknown") == 0
    assert counted(registry, "responses", "other", "unknown") == 2
    assert counted(registry, "responses", "field_0", "unknown") == 2
    assert counted(registry, "responses", f"field_{MAX_NAMED - 1}", "unknown") == 1


def test_names_with_odd_characters_are_other_and_take_no_named_place() -> None:
    c, registry = counter()
    fields = ClientFields(c)
    odd = ["has space", "quote\"d", "x" * 49, "", "ünïcode", "new\nline"]
    fields.note("messages", dict.fromkeys(odd, 1))
    assert counted(registry, "messages", "other", "unknown") == len(odd)
    for i in range(MAX_NAMED):  # every named place is still free
        fields.note("messages", {string.ascii_letters[i % 52] + str(i): 1})
    assert counted(registry, "messages", "other", "unknown") == len(odd)
    assert counted(registry, "messages", "x" * 48, "unknown") == 0
    fields.note("messages", {"x" * 48: 1})  # the longest name allowed, but past the bound now
    assert counted(registry, "messages", "other", "unknown") == len(odd) + 1


# Sessions (sessions.py)


def test_the_header_wins_over_the_agents_id_and_the_agents_id_over_user() -> None:
    agent = ("abc", "metadata.user_id")
    assert request_session({SESSION_HEADER: "hdr"}, "u1", True, agent).id == "hdr"  # type: ignore[union-attr]
    assert request_session({}, "u1", True, agent).id == "abc"  # type: ignore[union-attr]
    assert request_session({}, "u1", True, None).id == "u1"  # type: ignore[union-attr]
    assert request_session({}, "u1", False, None) is None
    assert request_session({}, None, False, ("  padded  ", "prompt_cache_key")).id == "padded"  # type: ignore[union-attr]


def test_an_agent_session_may_name_a_parent() -> None:
    session = request_session({PARENT_SESSION_HEADER: "parent-1"}, None, False, ("child-1", "prompt_cache_key"))
    assert session is not None and (session.id, session.parent_id) == ("child-1", "parent-1")
    with pytest.raises(ApiError) as caught:
        request_session({PARENT_SESSION_HEADER: "parent-1"}, None, False, None)
    assert caught.value.param == PARENT_SESSION_HEADER


@pytest.mark.parametrize("bad", ["a/b", "x" * (MAX_SESSION_CHARS + 1), "caf\u00e9", "tab\there", "\ud800"])
@pytest.mark.parametrize("where", ["metadata.user_id", "prompt_cache_key"])
def test_an_agent_id_that_is_not_a_session_id_is_used_as_its_digest(bad: str, where: str) -> None:
    session = request_session({}, "fine-user", True, (bad, where))
    assert session is not None and session.id.startswith("h-") and len(session.id) == 34
    assert request_session({}, None, False, (bad, where)) == session  # the same id every time
    assert request_session({}, None, False, (bad + "!", where)) != session


def test_a_blank_agent_id_names_no_session() -> None:
    assert request_session({}, "fine-user", True, ("   ", "prompt_cache_key")).id == "fine-user"  # type: ignore[union-attr]
    assert request_session({}, None, False, ("", "prompt_cache_key")) is None


def test_a_bad_agent_id_is_not_read_when_the_header_names_the_session() -> None:
    session = request_session({SESSION_HEADER: "hdr"}, None, False, ("a/b", "metadata.user_id"))
    assert session is not None and session.id == "hdr"
    assert request_session({}, None, False, ("x" * MAX_SESSION_CHARS, "prompt_cache_key")) is not None
