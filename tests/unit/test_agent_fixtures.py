"""What Claude Code and Codex really send, replayed through the gateway's translation in process.

The fixtures (tests/fixtures/agents/) are the request bodies the two CLIs sent in a recorded
session with tool calls, their results (one an error) and a follow-up turn (how they were made:
tests/e2e/test_agent_clients.py). Every field in them must have a stated effect
(services/frontend/client_fields.py): a client update that sends something new fails here, naming
the field, without the CLIs. tests/e2e/test_agent_clients.py replays the same bodies to a
running gateway.
"""

from __future__ import annotations

import asyncio
import gzip
import json
from pathlib import Path

import pytest


from services.frontend.client_fields import NESTED_ACCEPTED, Effect, effect_of
from services.frontend.context_edits import apply_edits
from services.frontend.messages_api import agent_session as messages_session
from services.frontend.messages_api import chat_body as messages_chat_body
from services.frontend.messages_schemas import CountTokensRequest, MessagesRequest, parse_messages
from services.frontend.responses_input import agent_session as responses_session
from services.frontend.responses_input import chat_body, nested_accepted
from services.frontend.schemas import ChatCompletionRequest, parse

FIXTURES = Path(__file__).parents[1] / "fixtures" / "agents"
# Keys of Responses input items and tools the translation reads or knowingly passes over
# (ids and statuses of earlier output, phase labels).
ITEM_KEYS = {"type", "role", "content", "id", "status", "call_id", "name", "arguments", "output", "namespace",
             "summary", "encrypted_content", "phase"}
TOOL_KEYS = {"type", "name", "description", "parameters", "strict", "tools", "external_web_access"}


def exchanges(client: str) -> list[dict]:
    [path] = FIXTURES.glob(f"{client}-*.jsonl.gz")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def unknown_fields(api: str, body: dict) -> list[str]:
    return [name for name in body if effect_of(api, name) is Effect.UNKNOWN]


async def no_count(_: CountTokensRequest) -> int:
    raise AssertionError("nothing in these sessions should need counting")


def test_the_fixtures_hold_tool_turns_and_a_follow_up() -> None:
    claude = [e["body"] for e in exchanges("claude-code")]
    blocks = [b.get("type") for body in claude for m in body["messages"] if isinstance(m["content"], list)
              for b in m["content"]]
    assert {"tool_use", "tool_result", "thinking"} <= set(blocks)
    assert sum(b == "tool_use" for b in blocks) >= 2  # two calls at once
    codex = [e["body"] for e in exchanges("codex")]
    kinds = [i.get("type") for body in codex for i in body["input"]]
    assert {"function_call", "function_call_output", "reasoning"} <= set(kinds)


@pytest.mark.parametrize("index", range(3))
def test_claude_code_requests_translate_with_every_field_known(index: int) -> None:
    body = exchanges("claude-code")[index]["body"]
    assert unknown_fields("messages", body) == [], "Claude Code sends a field with no stated effect"
    message = parse_messages(MessagesRequest, body)
    edited, applied = asyncio.run(apply_edits(message, no_count))
    assert applied == []  # clear_thinking with keep: all
    chat = parse(ChatCompletionRequest, messages_chat_body(edited))
    roles = [m.role for m in chat.messages]
    assert roles[0] == "system" and "system" in roles[1:]  # its environment, mid-conversation
    offered = {t.function.name for t in chat.tools or ()}
    deferred = {t["name"] for t in body["tools"] if t.get("defer_loading")}
    assert offered and not offered & deferred  # deferred tools stay out of the prompt
    session = messages_session(message)
    assert session is not None and session[0] == json.loads(body["metadata"]["user_id"])["session_id"]


def test_claude_code_tool_results_and_errors_reach_the_prompt() -> None:
    body = exchanges("claude-code")[1]["body"]
    chat = messages_chat_body(parse_messages(MessagesRequest, body))
    tool_messages = [m for m in chat["messages"] if m["role"] == "tool"]
    assert len(tool_messages) == 2
    assert any("Tuesday" in m["content"] for m in tool_messages)
    assert any(m["content"].startswith("Error: ") for m in tool_messages)  # is_error: the missing file
    [calls] = [m["tool_calls"] for m in chat["messages"] if m.get("tool_calls")]
    # Claude Code answers parallel calls in the order they finish, not the order they were made.
    assert sorted(c["id"] for c in calls) == sorted(m["tool_call_id"] for m in tool_messages)


@pytest.mark.parametrize("index", range(3))
def test_codex_requests_translate_with_every_field_known(index: int) -> None:
    body = exchanges("codex")[index]["body"]
    assert unknown_fields("responses", body) == [], "Codex sends a field with no stated effect"
    for item in body["input"]:
        assert set(item) <= ITEM_KEYS, f"an input item's keys {sorted(set(item) - ITEM_KEYS)} have no stated effect"
    for tool in body["tools"]:
        assert set(tool) <= TOOL_KEYS, f"a tool's keys {sorted(set(tool) - TOOL_KEYS)} have no stated effect"
    for path in nested_accepted(body):
        assert path in NESTED_ACCEPTED["responses"]
    chat = parse(ChatCompletionRequest, chat_body(body))
    names = {t.function.name for t in chat.tools or ()}
    assert "multi_agent_v1.close_agent" in names  # a namespace's functions, named within it
    assert not any(t.get("type") == "web_search" for t in chat_body(body).get("tools", []))
    assert responses_session(body) == (body["prompt_cache_key"], "prompt_cache_key")
    assert chat.messages[0].role == "system"  # developer instructions


def test_codex_reasoning_comes_back_through_its_token() -> None:
    body = exchanges("codex")[2]["body"]
    [item] = [i for i in body["input"] if i.get("type") == "reasoning"]
    assert item["encrypted_content"].startswith("kvmesh-r1:")
    chat = chat_body(body)
    [answer] = [m for m in chat["messages"] if m["role"] == "assistant" and m.get("content")]
    assert answer["reasoning_content"]  # the reasoning joined the turn it was written in
    outputs = [m for m in chat["messages"] if m["role"] == "tool"]
    assert len(outputs) == 2 and any("Tuesday" in str(m["content"]) for m in outputs)
