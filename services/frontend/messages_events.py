"""A streamed Message as Anthropic's typed server-sent events, from the chat path's deltas.

The order: `message_start` (the Message without content; its usage holds the prompt's tokens as
routed), `ping`, then each content block as `content_block_start`, its deltas, `content_block_stop`,
then `message_delta` (stop_reason, and the usage in full: output tokens and the prompt's split into
uncached and cached), and `message_stop`. Blocks are numbered in the order they start and one is
open at a time: reasoning opens a thinking block (`thinking_delta`), text a text block
(`text_delta`), a tool call a tool_use block (its id and name at the start, its arguments in
`input_json_delta`s). A kind of output that comes back after another (text after a tool call)
opens a new block. A message with no output at all has one empty text block, as the whole
answer (messages_api.message_body) does. A failure mid-stream is an `error` event, and the
stream ends there.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from gen.kvmesh.v1 import processor_pb2
from services.frontend.errors import ApiError, shown
from services.frontend.messages_api import MessageShape, stop_reason, usage
from services.frontend.responses import finish_name, sse

_TEXT, _THINKING = "text", "thinking"


def event(kind: str, **fields: Any) -> bytes:
    """One typed event: its `event:` line names the type its data repeats."""
    return b"event: " + kind.encode() + b"\n" + sse({"type": kind, **fields})


class _Blocks:
    """The message's content blocks as they open and close; each method returns the events."""

    def __init__(self, omit_thinking: bool = False) -> None:
        self.omit_thinking = omit_thinking
        self.count = 0
        # The block open now: ("text" | "thinking", -1) or ("tool_use", the call's index).
        self.open: tuple[str, int] | None = None
        # A tool call's block index, by the call's index in the chat answer.
        self.calls: dict[int, int] = {}

    def ensure(self, kind: str, key: int, start: dict) -> list[bytes]:
        """The events that make (kind, key) the open block: close the open one, start this."""
        if self.open == (kind, key):
            return []
        out = self.close()
        self.open = (kind, key)
        if kind == "tool_use":
            self.calls[key] = self.count
        out.append(event("content_block_start", index=self.count, content_block=start))
        self.count += 1
        return out

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", index=self.count - 1)]

    def delta(self, d: processor_pb2.ChoiceDelta) -> list[bytes]:
        out: list[bytes] = []
        if d.reasoning:
            out += self.ensure(_THINKING, -1, {"type": "thinking", "thinking": "", "signature": ""})
            if not self.omit_thinking:  # `display: omitted`: the block, without its text
                out.append(event("content_block_delta", index=self.count - 1,
                                 delta={"type": "thinking_delta", "thinking": d.reasoning}))
        if d.text:
            out += self.ensure(_TEXT, -1, {"type": "text", "text": ""})
            out.append(event("content_block_delta", index=self.count - 1,
                             delta={"type": "text_delta", "text": d.text}))
        for c in d.tool_calls:
            if c.index not in self.calls:
                out += self.ensure("tool_use", c.index, {"type": "tool_use", "id": c.id, "name": c.name, "input": {}})
            if c.arguments:
                # Parsers give a call's pieces in order and calls one after another; a piece of
                # a call whose block was closed still goes to that block's index.
                out.append(event("content_block_delta", index=self.calls[c.index],
                                 delta={"type": "input_json_delta", "partial_json": c.arguments}))
        return out


async def message_events(rid: str, model: str, prompt_tokens: int, deltas: AsyncIterator[processor_pb2.ChoiceDelta],
                         totals: processor_pb2.Usage, hide_details: bool,
                         shape: MessageShape = MessageShape()) -> AsyncIterator[bytes]:
    """The stream of one message. `totals` is complete when `deltas` ends (Answer.items);
    `hide_details` leaves the prefix-cache hit out of the usage and a failure's internals out of
    its message (--hide-routing-details); `shape` what the request asked of the answer's form."""
    start_usage = {"input_tokens": prompt_tokens, "output_tokens": 0, "cache_creation_input_tokens": 0}
    if not hide_details:
        start_usage["cache_read_input_tokens"] = 0
    yield event("message_start", message={"id": "msg_" + rid, "type": "message", "role": "assistant", "model": model,
                                          "content": [], "stop_reason": None, "stop_sequence": None,
                                          "usage": start_usage})
    yield event("ping")
    blocks = _Blocks(shape.omit_thinking)
    finish: str | None = None
    stop_sequence: str | None = None
    try:
        async for d in deltas:
            for out in blocks.delta(d):
                yield out
            if d.finish_reason:
                finish = finish_name(d.finish_reason)
            if d.stop_sequence:
                stop_sequence = d.stop_sequence
    except ApiError as exc:
        yield event("error", error=shown(exc, hide_details).anthropic_body()["error"])
        return
    if blocks.count == 0:
        for out in blocks.ensure(_TEXT, -1, {"type": "text", "text": ""}):
            yield out
    for out in blocks.close():
        yield out
    final = usage(totals.prompt_tokens, totals.completion_tokens, None if hide_details else totals.cached_tokens)
    yield event("message_delta", delta={"stop_reason": stop_reason(finish or "stop", stop_sequence),
                                        "stop_sequence": stop_sequence},
                usage=final, **shape.reported())
    yield event("message_stop")
