"""A streamed Message's typed events, in-process: each event is one the official client parses, they
come in Anthropic's order, and the message they add up to is the whole answer's."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pydantic
from anthropic.types import Message, RawMessageStreamEvent

from gen.kvmesh.v1 import common_pb2, processor_pb2
from services.frontend.errors import ApiError
from services.frontend.messages_api import message_body
from services.frontend.messages_events import message_events

EVENTS = pydantic.TypeAdapter(RawMessageStreamEvent)
STOP, LENGTH, TOOLS = common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_TOOL_CALLS


def delta(text: str = "", reasoning: str = "", calls: tuple[tuple[int, str, str, str], ...] = (),
          finish: int = 0) -> processor_pb2.ChoiceDelta:
    d = processor_pb2.ChoiceDelta(text=text, reasoning=reasoning, finish_reason=finish)
    d.tool_calls.extend(processor_pb2.ToolCallDelta(index=i, id=c, name=n, arguments=a) for i, c, n, a in calls)
    return d


async def stream(deltas: list[processor_pb2.ChoiceDelta], fail: ApiError | None = None,
                 cached: int = 4, hide: bool = False) -> list[tuple[str, dict]]:
    totals = processor_pb2.Usage()

    async def items() -> AsyncIterator[processor_pb2.ChoiceDelta]:
        for d in deltas:
            yield d
        if fail is not None:
            raise fail
        totals.MergeFrom(processor_pb2.Usage(prompt_tokens=12, completion_tokens=len(deltas), cached_tokens=cached))

    out = []
    async for chunk in message_events("r1", "kvmesh-demo", 12, items(), totals, hide):
        head, data = chunk.decode().split("\n", 1)
        assert head.startswith("event: ") and data.startswith("data: ") and data.endswith("\n\n"), chunk
        body = json.loads(data.removeprefix("data: "))
        assert body["type"] == head.removeprefix("event: ")
        if body["type"] not in ("error", "ping"):  # the client reads those two before parsing events
            EVENTS.validate_python(body)  # the client's own event types
        out.append((body["type"], body))
    return out


def added_up(events: list[tuple[str, dict]]) -> dict:
    """The message the events make, block by block (as a client accumulates it)."""
    message = events[0][1]["message"]
    partial: dict[int, str] = {}
    for kind, e in events[1:]:
        if kind == "content_block_start":
            assert e["index"] == len(message["content"])
            message["content"].append(dict(e["content_block"]))
        elif kind == "content_block_delta":
            block, d = message["content"][e["index"]], e["delta"]
            if d["type"] == "input_json_delta":
                partial[e["index"]] = partial.get(e["index"], "") + d["partial_json"]
            else:
                field = "text" if d["type"] == "text_delta" else "thinking"
                block[field] += d[field]
        elif kind == "message_delta":
            message.update(e["delta"])
            message["usage"].update(e["usage"])
    for index, text in partial.items():
        message["content"][index]["input"] = json.loads(text)
    return message


async def test_reasoning_text_and_tool_calls_stream_as_blocks_in_order_and_add_up_to_the_whole_answer() -> None:
    deltas = [delta(reasoning="Weather "), delta(reasoning="wanted."), delta(text="Let me "), delta(text="look."),
              delta(calls=((0, "call_a", "get_weather", '{"city": '),)), delta(calls=((0, "", "", '"Oslo"}'),)),
              delta(calls=((1, "call_b", "get_weather", '{"city": "Rome"}'),), finish=TOOLS)]
    events = await stream(deltas)
    kinds = [k for k, _ in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [e["content_block"]["type"] for k, e in events if k == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use", "tool_use"]
    # One block open at a time: each stops before the next starts.
    opened = [k for k in kinds if k in ("content_block_start", "content_block_stop")]
    assert opened == ["content_block_start", "content_block_stop"] * 4
    start = events[0][1]["message"]
    assert start["usage"]["input_tokens"] == 12 and start["content"] == [] and start["stop_reason"] is None
    message = Message.model_validate(added_up(events))
    whole = message_body("r1", "kvmesh-demo", {
        "choices": [{"finish_reason": "tool_calls", "message": {
            "content": "Let me look.", "reasoning_content": "Weather wanted.", "tool_calls": [
                {"id": "call_a", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
                {"id": "call_b", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]}}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 4}}})
    assert message.model_dump() == Message.model_validate(whole).model_dump()
    assert message.stop_reason == "tool_use" and message.usage.cache_read_input_tokens == 4


async def test_a_plain_answer_cut_by_max_tokens_and_an_empty_one() -> None:
    events = await stream([delta(text="Hel"), delta(text="lo", finish=LENGTH)], hide=True)
    message = added_up(events)
    assert message["content"] == [{"type": "text", "text": "Hello"}] and message["stop_reason"] == "max_tokens"
    # Hidden routing details: no cache split anywhere.
    assert "cache_read_input_tokens" not in events[0][1]["message"]["usage"]
    assert message["usage"] == {"input_tokens": 12, "output_tokens": 2, "cache_creation_input_tokens": 0}
    empty = added_up(await stream([delta(finish=STOP)]))
    assert empty["content"] == [{"type": "text", "text": ""}] and empty["stop_reason"] == "end_turn"


async def test_a_failure_mid_stream_is_an_anthropic_error_event_and_the_stream_ends() -> None:
    events = await stream([delta(text="par")], fail=ApiError(503, "worker w1 at 10.0.0.7 vanished", code="unavailable"))
    kind, body = events[-1]
    assert kind == "error" and "message_stop" not in [k for k, _ in events]
    assert body == {"type": "error", "error": {"type": "overloaded_error", "message": "worker w1 at 10.0.0.7 vanished"}}
    hidden = await stream([], fail=ApiError(503, "worker w1 at 10.0.0.7 vanished", code="unavailable"), hide=True)
    assert "10.0.0.7" not in hidden[-1][1]["error"]["message"]
