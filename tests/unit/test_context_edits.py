"""Anthropic's context editing (services/frontend/context_edits.py), applied in process to parsed
Messages requests: what each edit clears, what it reports, and when it counts tokens (a count costs
a render and a tokenization on a processor, so it is asked for only when an edit has something to
clear). The count here is a stand-in: one token per character of the messages' JSON, times a
factor, recording every call."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from services.frontend.context_edits import CLEARED_RESULT, DEFAULT_TRIGGER_TOKENS, apply_edits
from services.frontend.messages_api import chat_body
from services.frontend.messages_schemas import (
    CountTokensRequest,
    MessagesRequest,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
    parse_messages,
)

MODEL = "kvmesh-demo"
THINKING = "clear_thinking_20251015"
TOOL_USES = "clear_tool_uses_20250919"


@dataclass
class Counting:
    """A token count proportional to the messages' JSON, with every answer recorded."""

    per_char: int = 1
    answers: list[int] = field(default_factory=list)

    async def __call__(self, req: CountTokensRequest) -> int:
        tokens = len(req.model_dump_json(include={"messages"})) * self.per_char
        self.answers.append(tokens)
        return tokens

    @property
    def calls(self) -> int:
        return len(self.answers)


def request(messages: list[dict], *edits: dict) -> MessagesRequest:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 64, "messages": messages}
    if edits:
        body["context_management"] = {"edits": list(edits)}
    req = parse_messages(MessagesRequest, body)
    assert isinstance(req, MessagesRequest)
    return req


def edit(req: MessagesRequest, count: Counting) -> tuple[MessagesRequest, list[dict]]:
    edited, applied = asyncio.run(apply_edits(req, count))
    assert isinstance(edited, MessagesRequest)
    return edited, applied


def thinking_turns(n: int) -> list[dict]:
    """A conversation of `n` assistant turns, each with its thinking, answered by the user."""
    out: list[dict] = [{"role": "user", "content": "start"}]
    for i in range(n):
        out.append({"role": "assistant", "content": [
            {"type": "thinking", "thinking": f"thought number {i} " * 20, "signature": "sig"},
            {"type": "text", "text": f"answer {i}"}]})
        out.append({"role": "user", "content": f"next {i}"})
    return out


def tool_turns(names: list[str], thinking: bool = False) -> list[dict]:
    """One tool call per assistant turn (ids toolu_0, toolu_1, ...), each answered by its result."""
    out: list[dict] = [{"role": "user", "content": "do the work"}]
    for i, name in enumerate(names):
        blocks: list[dict] = []
        if thinking:
            blocks.append({"type": "thinking", "thinking": f"I should call {name} " * 10, "signature": ""})
        blocks.append({"type": "tool_use", "id": f"toolu_{i}", "name": name, "input": {"path": f"/src/file_{i}.py"}})
        out.append({"role": "assistant", "content": blocks})
        out.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": f"contents of file {i} " * 30}]})
    return out


def results(req: CountTokensRequest) -> dict[str, object]:
    return {b.tool_use_id: b.content for m in req.messages if not isinstance(m.content, str)
            for b in m.content if isinstance(b, ToolResultBlock)}


def inputs(req: CountTokensRequest) -> dict[str, dict]:
    return {b.id: b.input for m in req.messages if not isinstance(m.content, str)
            for b in m.content if isinstance(b, ToolUseBlock)}


def thoughts(req: CountTokensRequest) -> list[int]:
    """Indexes of the messages that still hold thinking."""
    return [i for i, m in enumerate(req.messages) if not isinstance(m.content, str)
            and any(isinstance(b, ThinkingBlock) for b in m.content)]


def test_without_context_management_the_request_is_untouched_and_never_counted() -> None:
    req = request(tool_turns(["read"] * 6, thinking=True))
    count = Counting()
    edited, applied = edit(req, count)
    assert edited is req and applied == [] and count.calls == 0


def test_keep_all_clears_no_thinking_and_never_counts() -> None:
    req = request(thinking_turns(3), {"type": THINKING, "keep": "all"})
    count = Counting()
    edited, applied = edit(req, count)
    assert applied == [] and count.calls == 0
    assert thoughts(edited) == [1, 3, 5]


def test_the_default_keeps_the_last_turns_thinking_and_reports_the_tokens_cleared() -> None:
    req = request(thinking_turns(3), {"type": THINKING})
    count = Counting()
    edited, applied = edit(req, count)
    assert thoughts(edited) == [5]  # only the last assistant turn keeps its thinking
    assert count.calls == 2
    before, after = count.answers
    assert before > after
    assert applied == [{"type": THINKING, "cleared_thinking_turns": 2, "cleared_input_tokens": before - after}]
    # The rest of each turn stays, and the kept turn's thinking reaches the chat body.
    assert [b.type for b in edited.messages[1].content] == ["text"]  # type: ignore[union-attr]
    chat = chat_body(edited)
    assistants = [m for m in chat["messages"] if m["role"] == "assistant"]
    assert [("reasoning_content" in m) for m in assistants] == [False, False, True]


def test_keep_thinking_turns_keeps_that_many() -> None:
    req = request(thinking_turns(4), {"type": THINKING, "keep": {"type": "thinking_turns", "value": 3}})
    edited, applied = edit(req, Counting())
    assert thoughts(edited) == [3, 5, 7]
    assert applied[0]["cleared_thinking_turns"] == 1


def test_a_single_thinking_turn_is_kept_by_the_default_and_not_counted() -> None:
    req = request(thinking_turns(1), {"type": THINKING})
    count = Counting()
    edited, applied = edit(req, count)
    assert applied == [] and count.calls == 0 and thoughts(edited) == [1]


def test_tool_uses_past_a_tool_use_trigger_give_way_to_the_placeholder_but_the_last_kept() -> None:
    req = request(tool_turns(["read"] * 4), {"type": TOOL_USES, "trigger": {"type": "tool_uses", "value": 3},
                                             "keep": {"type": "tool_uses", "value": 1}})
    count = Counting()
    edited, applied = edit(req, count)
    got = results(edited)
    assert [got[f"toolu_{i}"] == CLEARED_RESULT for i in range(4)] == [True, True, True, False]
    assert got["toolu_3"] == results(req)["toolu_3"]
    assert inputs(edited) == inputs(req)  # without clear_tool_inputs the calls stay whole
    assert count.calls == 2
    before, after = count.answers
    assert applied == [{"type": TOOL_USES, "cleared_tool_uses": 3, "cleared_input_tokens": before - after}]
    assert before - after > 0


def test_a_tool_use_trigger_not_reached_clears_nothing_and_counts_nothing() -> None:
    req = request(tool_turns(["read"] * 4), {"type": TOOL_USES, "trigger": {"type": "tool_uses", "value": 5},
                                             "keep": {"type": "tool_uses", "value": 1}})
    count = Counting()
    edited, applied = edit(req, count)
    assert applied == [] and count.calls == 0
    assert CLEARED_RESULT not in results(edited).values()


def test_below_the_default_token_trigger_nothing_is_cleared_after_one_count() -> None:
    req = request(tool_turns(["read"] * 5), {"type": TOOL_USES})
    count = Counting()
    edited, applied = edit(req, count)
    assert count.answers[0] < DEFAULT_TRIGGER_TOKENS
    assert applied == [] and count.calls == 1
    assert edited.model_dump() == req.model_dump()


def test_past_the_default_token_trigger_all_but_three_are_cleared_on_the_count_already_made() -> None:
    req = request(tool_turns(["read"] * 5), {"type": TOOL_USES})
    count = Counting(per_char=1000)
    edited, applied = edit(req, count)
    assert count.answers[0] >= DEFAULT_TRIGGER_TOKENS
    assert count.calls == 2  # the trigger's count is the "before" of the report
    assert [v == CLEARED_RESULT for v in results(edited).values()] == [True, True, False, False, False]
    before, after = count.answers
    assert applied == [{"type": TOOL_USES, "cleared_tool_uses": 2, "cleared_input_tokens": before - after}]


def test_an_input_token_trigger_is_compared_with_the_count() -> None:
    messages = tool_turns(["read"] * 5)
    size = asyncio.run(Counting()(request(messages)))
    trigger = {"type": TOOL_USES, "keep": {"type": "tool_uses", "value": 1}}
    _, over = edit(request(messages, {**trigger, "trigger": {"type": "input_tokens", "value": size}}), Counting())
    _, under = edit(request(messages, {**trigger, "trigger": {"type": "input_tokens", "value": size + 1}}), Counting())
    assert [e["cleared_tool_uses"] for e in over] == [4]
    assert under == []


def test_excluded_tools_are_never_cleared() -> None:
    names = ["read", "bash", "read", "bash", "read"]
    req = request(tool_turns(names), {"type": TOOL_USES, "trigger": {"type": "tool_uses", "value": 1},
                                      "keep": {"type": "tool_uses", "value": 1}, "exclude_tools": ["bash"]})
    edited, applied = edit(req, Counting())
    cleared = {k for k, v in results(edited).items() if v == CLEARED_RESULT}
    assert cleared == {"toolu_0", "toolu_2"}  # read's older two; bash's results all stay
    assert applied[0]["cleared_tool_uses"] == 2


def test_only_excluded_tool_uses_leave_nothing_to_clear_and_nothing_is_counted() -> None:
    req = request(tool_turns(["bash"] * 6), {"type": TOOL_USES, "trigger": {"type": "tool_uses", "value": 1},
                                             "keep": {"type": "tool_uses", "value": 1}, "exclude_tools": ["bash"]})
    count = Counting()
    _, applied = edit(req, count)
    assert applied == [] and count.calls == 0


def test_clear_tool_inputs_blanks_the_inputs_of_the_cleared_calls_only() -> None:
    req = request(tool_turns(["read"] * 4), {"type": TOOL_USES, "trigger": {"type": "tool_uses", "value": 1},
                                             "keep": {"type": "tool_uses", "value": 2}, "clear_tool_inputs": True})
    edited, _ = edit(req, Counting())
    got = inputs(edited)
    assert [got[f"toolu_{i}"] for i in range(4)] == [{}, {}, {"path": "/src/file_2.py"}, {"path": "/src/file_3.py"}]
    chat = chat_body(edited)
    arguments = [c["function"]["arguments"] for m in chat["messages"] for c in m.get("tool_calls") or ()]
    assert arguments[:2] == ["{}", "{}"]


def test_clear_tool_inputs_naming_tools_blanks_only_theirs() -> None:
    req = request(tool_turns(["read", "bash", "read", "bash"]),
                  {"type": TOOL_USES, "trigger": {"type": "tool_uses", "value": 1},
                   "keep": {"type": "tool_uses", "value": 1}, "clear_tool_inputs": ["bash"]})
    edited, _ = edit(req, Counting())
    got = inputs(edited)
    assert got["toolu_1"] == {}  # a cleared bash call
    assert got["toolu_0"] == {"path": "/src/file_0.py"} and got["toolu_2"] == {"path": "/src/file_2.py"}
    assert got["toolu_3"] == {"path": "/src/file_3.py"}  # kept
    assert {k for k, v in results(edited).items() if v == CLEARED_RESULT} == {"toolu_0", "toolu_1", "toolu_2"}


def test_clear_at_least_not_met_leaves_the_request_as_it_was() -> None:
    req = request(tool_turns(["read"] * 4), {"type": TOOL_USES, "trigger": {"type": "tool_uses", "value": 1},
                                             "keep": {"type": "tool_uses", "value": 1},
                                             "clear_at_least": {"type": "input_tokens", "value": 10**9}})
    count = Counting()
    edited, applied = edit(req, count)
    assert applied == [] and count.calls == 2
    assert edited.model_dump() == req.model_dump()


def test_clear_at_least_met_applies() -> None:
    req = request(tool_turns(["read"] * 4), {"type": TOOL_USES, "trigger": {"type": "tool_uses", "value": 1},
                                             "keep": {"type": "tool_uses", "value": 1},
                                             "clear_at_least": {"type": "input_tokens", "value": 1}})
    count = Counting()
    _, applied = edit(req, count)
    before, after = count.answers
    assert applied == [{"type": TOOL_USES, "cleared_tool_uses": 3, "cleared_input_tokens": before - after}]


def test_fewer_tool_uses_than_keep_is_never_counted_even_with_a_zero_token_trigger() -> None:
    for trigger in (None, {"type": "input_tokens", "value": 0}, {"type": "tool_uses", "value": 0}):
        spec: dict = {"type": TOOL_USES}
        if trigger is not None:
            spec["trigger"] = trigger
        count = Counting()
        edited, applied = edit(request(tool_turns(["read"] * 2), spec), count)
        assert applied == [] and count.calls == 0, trigger
        assert CLEARED_RESULT not in results(edited).values()


def test_the_cleared_results_reach_the_prompt_as_the_placeholder() -> None:
    req = request(tool_turns(["read"] * 3), {"type": TOOL_USES, "trigger": {"type": "tool_uses", "value": 1},
                                             "keep": {"type": "tool_uses", "value": 1}})
    edited, _ = edit(req, Counting())
    tools = [m for m in chat_body(edited)["messages"] if m["role"] == "tool"]
    assert [m["content"] for m in tools[:2]] == [CLEARED_RESULT, CLEARED_RESULT]
    assert tools[2]["content"].startswith("contents of file 2")
    assert [m["tool_call_id"] for m in tools] == ["toolu_0", "toolu_1", "toolu_2"]


def test_edits_run_in_order_each_counted_from_where_the_last_left_off() -> None:
    req = request(tool_turns(["read"] * 4, thinking=True),
                  {"type": THINKING},
                  {"type": TOOL_USES, "trigger": {"type": "tool_uses", "value": 1},
                   "keep": {"type": "tool_uses", "value": 2}})
    count = Counting()
    edited, applied = edit(req, count)
    assert [e["type"] for e in applied] == [THINKING, TOOL_USES]
    assert applied[0]["cleared_thinking_turns"] == 3 and applied[1]["cleared_tool_uses"] == 2
    assert count.calls == 3  # before, after the thinking, after the tool uses
    first, middle, last = count.answers
    assert applied[0]["cleared_input_tokens"] == first - middle
    assert applied[1]["cleared_input_tokens"] == middle - last
    assert thoughts(edited) == [7]


def test_the_original_request_is_not_changed() -> None:
    req = request(tool_turns(["read", "bash"] * 3, thinking=True),
                  {"type": THINKING},
                  {"type": TOOL_USES, "trigger": {"type": "tool_uses", "value": 1},
                   "keep": {"type": "tool_uses", "value": 1}, "clear_tool_inputs": True})
    dumped = req.model_dump()
    messages, blocks = list(req.messages), [list(m.content) for m in req.messages]
    edited, applied = edit(req, Counting())
    assert len(applied) == 2 and edited is not req
    assert req.model_dump() == dumped
    assert list(req.messages) == messages and [list(m.content) for m in req.messages] == blocks
    assert CLEARED_RESULT not in results(req).values() and {} not in inputs(req).values()
    assert len(thoughts(req)) == 6


def test_a_tool_use_trigger_counts_the_excluded_tools_uses_too() -> None:
    names = ["bash", "read", "bash", "read", "bash", "read"]
    req = request(tool_turns(names), {"type": TOOL_USES, "trigger": {"type": "tool_uses", "value": 5},
                                      "keep": {"type": "tool_uses", "value": 1}, "exclude_tools": ["read"]})
    edited, applied = edit(req, Counting())
    assert [e["cleared_tool_uses"] for e in applied] == [2]  # six uses reach the trigger; bash's older two go
    assert {k for k, v in results(edited).items() if v == CLEARED_RESULT} == {"toolu_0", "toolu_2"}


def test_a_second_identical_edit_finds_nothing_left_to_clear() -> None:
    clear = {"type": TOOL_USES, "trigger": {"type": "tool_uses", "value": 1}, "keep": {"type": "tool_uses", "value": 1}}
    _, applied = edit(request(tool_turns(["read"] * 4), clear, clear, clear), Counting())
    assert [e["cleared_tool_uses"] for e in applied] == [3]


def test_a_cleared_result_keeps_the_tools_its_search_loaded() -> None:
    messages = tool_turns(["search", "read", "read"])
    messages[2]["content"][0]["content"] = [{"type": "text", "text": "found it"},
                                            {"type": "tool_reference", "tool_name": "read"}]
    req = request(messages, {"type": TOOL_USES, "trigger": {"type": "tool_uses", "value": 1},
                             "keep": {"type": "tool_uses", "value": 1}})
    edited, _ = edit(req, Counting())
    [cleared] = [v for k, v in results(edited).items() if k == "toolu_0"]
    assert isinstance(cleared, list)
    assert [getattr(p, "text", None) or p.tool_name for p in cleared] == [CLEARED_RESULT, "read"]
