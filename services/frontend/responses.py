"""OpenAI response bodies and stream chunks built from the processor's messages."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from gen.kvmesh.v1 import common_pb2, processor_pb2

# A choice's finish reason as OpenAI's APIs name it (None: still running).
FINISH_NAMES: dict[int, str | None] = {common_pb2.FINISH_REASON_UNSPECIFIED: None,
                                       common_pb2.FINISH_REASON_STOP: "stop",
                                       common_pb2.FINISH_REASON_LENGTH: "length",
                                       common_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls"}


def finish_name(reason: common_pb2.FinishReason) -> str | None:
    # A reason this gateway does not know yet (a newer processor's) still ends the choice.
    return FINISH_NAMES.get(reason, "stop")


@dataclass
class ChoiceAccumulator:
    """One choice of a non-streamed response, assembled from its deltas."""

    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    # The stop string that ended it (vLLM's `stop_reason`), when one did.
    stop_sequence: str | None = None
    tokens: list[processor_pb2.ChoiceDelta] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    # Tool calls by index: id, name and the arguments' pieces.
    calls: dict[int, tuple[str, str, list[str]]] = field(default_factory=dict)

    def add_agent_parts(self, d: processor_pb2.ChoiceDelta) -> None:
        self.reasoning.append(d.reasoning)
        for c in d.tool_calls:
            call_id, name, args = self.calls.setdefault(c.index, (c.id, c.name, []))
            self.calls[c.index] = (call_id or c.id, name or c.name, args)
            args.append(c.arguments)

    def message(self, text: str) -> dict:
        """The chat message: content (None when the model only called tools), its reasoning and
        tool calls when it has them."""
        message: dict = {"role": "assistant", "content": text if text or not self.calls else None}
        reasoning = "".join(self.reasoning)
        if reasoning:
            message["reasoning_content"] = reasoning
        if self.calls:
            message["tool_calls"] = [tool_call(call_id, name, "".join(args))
                                     for call_id, name, args in (self.calls[i] for i in sorted(self.calls))]
        return message


def tool_call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def add_agent_delta(delta: dict, d: processor_pb2.ChoiceDelta) -> None:
    """A streamed chat delta's reasoning and tool calls, in OpenAI's shape: a call's id, type and
    name on its first piece, its arguments in pieces."""
    if d.reasoning:
        delta["reasoning_content"] = d.reasoning
    if d.tool_calls:
        delta["tool_calls"] = [_call_delta(c) for c in d.tool_calls]
    if not d.text:
        delta["content"] = None


def _call_delta(c: processor_pb2.ToolCallDelta) -> dict:
    out: dict = {"index": c.index}
    if c.id:
        out["id"] = c.id
        out["type"] = "function"
    function: dict = {"arguments": c.arguments}
    if c.name:
        function["name"] = c.name
    out["function"] = function
    return out


def usage_body(usage: processor_pb2.Usage, hide_cached: bool = False) -> dict:
    """OpenAI's usage object; `hide_cached` leaves out the prefix-cache hit (an optional field)."""
    body: dict = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }
    if not hide_cached:
        body["prompt_tokens_details"] = {"cached_tokens": usage.cached_tokens}
    return body


def _token_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def chat_logprobs(deltas: list[processor_pb2.ChoiceDelta]) -> dict:
    content = []
    for d in deltas:
        for lp, text in zip(d.logprobs, d.token_texts):
            content.append({
                "token": text, "logprob": lp.logprob, "bytes": _token_bytes(text),
                "top_logprobs": [{"token": t.text, "logprob": t.logprob, "bytes": _token_bytes(t.text)} for t in lp.top],
            })
    return {"content": content}


def completion_logprobs(deltas: list[processor_pb2.ChoiceDelta], offset: int = 0) -> dict:
    tokens, token_logprobs, top, text_offset = [], [], [], []
    for d in deltas:
        for lp, text in zip(d.logprobs, d.token_texts):
            tokens.append(text)
            token_logprobs.append(lp.logprob)
            top.append({t.text: t.logprob for t in lp.top})
            text_offset.append(offset)
            offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": text_offset}


# One SSE event per chunk on the streaming hot path: msgspec encodes a chunk ~10x faster than
# json.dumps (compact, UTF-8, the same JSON).
_ENCODE = msgspec.json.Encoder().encode


def sse(obj: dict) -> bytes:
    return b"data: " + _ENCODE(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"

# Stands for a delta's text while a template is made: a string no encoder writes any other way.
_HOLE = "\x00"
_ENCODED_HOLE = _ENCODE(_HOLE)


class TextEvents:
    """A stream's plain text events (text only: no finish, logprobs, reasoning or tool calls) from
    a template per choice: the chunk is encoded once with a placeholder for the text, so each event
    is two concatenations and the text's own encoding, byte for byte what `sse(chunk)` gives
    (measured here: 0.30 µs against 1.34 µs per event). `chunk(index, text)` builds the chunk the
    template mirrors."""

    __slots__ = ("_chunk", "_templates")

    def __init__(self, chunk: Callable[[int, str], dict]) -> None:
        self._chunk = chunk
        self._templates: dict[int, tuple[bytes, bytes]] = {}

    def event(self, index: int, text: str) -> bytes:
        template = self._templates.get(index)
        if template is None:
            head, hole, tail = sse(self._chunk(index, _HOLE)).partition(_ENCODED_HOLE)
            if not hole or _ENCODED_HOLE in tail:
                raise ValueError("TextEvents: the chunk must hold the text exactly once")
            template = self._templates[index] = (head, tail)
        head, tail = template
        return head + _ENCODE(text) + tail


def prefill_header(location: common_pb2.PrefillLocation) -> str:
    """The `x-kvmesh-prefill` header: `remote:<prefill worker id>`, or `local` (also when unset)."""
    if location.site == common_pb2.PrefillLocation.SITE_REMOTE:
        return f"remote:{location.prefill_worker_id}"
    return "local"
