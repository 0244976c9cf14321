"""`POST /v1/responses`, OpenAI's Responses API, stateless, over the chat path: the answer.

A request becomes a chat completions body (responses_input.py) and runs like any chat request;
its deltas become the Response object or its stream of typed events. Output items are numbered in
the order they start (reasoning, then the message, then each call, as models write them); a call
to a namespaced function carries `name` and `namespace` apart; a reasoning item carries its text,
and with `include: ["reasoning.encrypted_content"]` the same text as a token the next turn can
send back (responses_input.encode_reasoning).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from gen.kvmesh.v1 import processor_pb2
from services.frontend.errors import ApiError
from services.frontend.responses import SSE_DONE, finish_name, sse
from services.frontend.responses_input import encode_reasoning, namespaced, wants_encrypted_reasoning


@dataclass
class ResponseBuilder:
    """The Response object, built from the chat answer's deltas (whole or as a stream of events)."""

    rid: str
    model: str
    request: dict
    created: int = field(default_factory=lambda: int(time.time()))
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: dict[int, dict] = field(default_factory=dict)
    finish: str = ""
    usage: dict | None = None
    # The output items in the order a stream opened them ("reasoning", "message", a call's index).
    order: list[str | int] = field(default_factory=list)

    @property
    def id(self) -> str:
        return "resp_" + self.rid

    def add(self, d: processor_pb2.ChoiceDelta) -> None:
        self.text.append(d.text)
        self.reasoning.append(d.reasoning)
        for c in d.tool_calls:
            call = self.calls.get(c.index)
            if call is None:
                call = self.calls[c.index] = function_call(c.id or self.rid, c.id, c.name, "")
            call["arguments"] += c.arguments
        if d.finish_reason:
            self.finish = finish_name(d.finish_reason) or ""

    def output(self) -> list[dict]:
        """The output items: in the order a stream announced them, else as models write them
        (reasoning, the message when it has text or nothing else came, each call)."""
        keys = self.order
        if not keys:
            keys = ["reasoning"] if "".join(self.reasoning) else []
            if "".join(self.text) or not self.calls:
                keys.append("message")
            keys += sorted(self.calls)
        return [self.item(key) for key in keys]

    def item(self, key: str | int) -> dict:
        """One output item, whole: "reasoning", "message", or a call's index."""
        if key == "reasoning":
            return self.reasoning_item("".join(self.reasoning))
        if key == "message":
            return self.message("".join(self.text), "completed")
        assert isinstance(key, int)
        return self.calls[key]

    def reasoning_item(self, text: str) -> dict:
        item = {"id": f"rs_{self.rid}", "type": "reasoning", "summary": [],
                "content": [{"type": "reasoning_text", "text": text}]}
        if wants_encrypted_reasoning(self.request):
            item["encrypted_content"] = encode_reasoning(text)
        return item

    def message(self, text: str, status: str) -> dict:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
        return {"id": f"msg_{self.rid}", "type": "message", "status": status, "role": "assistant", "content": content}

    def body(self, status: str | None = None) -> dict:
        done = status is None
        incomplete = done and self.finish == "length"
        return {
            "id": self.id, "object": "response", "created_at": self.created, "model": self.model,
            "status": status or ("incomplete" if incomplete else "completed"),
            "output": self.output() if done else [], "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": self.request.get("instructions"), "max_output_tokens": self.request.get("max_output_tokens"),
            "parallel_tool_calls": self.request.get("parallel_tool_calls", True), "previous_response_id": None,
            "store": False, "temperature": self.request.get("temperature"), "top_p": self.request.get("top_p"),
            "tool_choice": self.request.get("tool_choice", "auto"), "tools": self.request.get("tools", []),
            "text": self.request.get("text", {"format": {"type": "text"}}), "truncation": "disabled",
            "metadata": self.request.get("metadata") or {}, "usage": self.usage if done else None,
        }

    def from_chat(self, chat: dict) -> dict:
        """The Response for a whole chat completion body."""
        choice = chat["choices"][0]
        message = choice["message"]
        self.text.append(message.get("content") or "")
        self.reasoning.append(message.get("reasoning_content") or "")
        for i, call in enumerate(message.get("tool_calls") or ()):
            self.calls[i] = function_call(call["id"], call["id"], call["function"]["name"], call["function"]["arguments"])
        self.finish = choice["finish_reason"] or ""
        u = chat["usage"]
        self.usage = {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
                      "total_tokens": u["total_tokens"],
                      "input_tokens_details": {"cached_tokens": u.get("prompt_tokens_details", {}).get("cached_tokens", 0)},
                      "output_tokens_details": {"reasoning_tokens": 0}}
        return self.body()

    def set_usage(self, usage: processor_pb2.Usage) -> None:
        self.usage = {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
                      "total_tokens": usage.prompt_tokens + usage.completion_tokens,
                      "input_tokens_details": {"cached_tokens": usage.cached_tokens},
                      "output_tokens_details": {"reasoning_tokens": 0}}


def function_call(item_id: str, call_id: str, name: str, arguments: str) -> dict:
    """A function_call output item; a namespaced function's name split back (responses_input)."""
    function, namespace = namespaced(name)
    item = {"id": f"fc_{item_id}", "type": "function_call", "status": "completed", "call_id": call_id,
            "name": function, "arguments": arguments}
    if namespace is not None:
        item["namespace"] = namespace
    return item


async def response_events(builder: ResponseBuilder, deltas: AsyncIterator[processor_pb2.ChoiceDelta],
                          usage: processor_pb2.Usage) -> AsyncIterator[bytes]:
    """The Responses stream: created, the message's text deltas, each tool call's argument
    deltas, every item's done event, then completed with the whole Response."""
    seq = 0

    def event(kind: str, **fields: Any) -> bytes:
        nonlocal seq
        seq += 1
        return b"event: " + kind.encode() + b"\n" + sse({"type": kind, "sequence_number": seq, **fields})

    yield event("response.created", response=builder.body("in_progress"))
    yield event("response.in_progress", response=builder.body("in_progress"))
    msg_id, rs_id = f"msg_{builder.rid}", f"rs_{builder.rid}"
    # Output indexes in the order items start: "reasoning", "message", or a call's index.
    opened: dict[str | int, int] = {}
    empty = builder.message("", "in_progress")
    try:
        async for d in deltas:
            builder.add(d)
            if d.reasoning:
                if "reasoning" not in opened:
                    opened["reasoning"] = len(opened)
                    yield event("response.output_item.added", output_index=opened["reasoning"],
                                item={"id": rs_id, "type": "reasoning", "summary": []})
                yield event("response.reasoning_text.delta", item_id=rs_id, output_index=opened["reasoning"],
                            content_index=0, delta=d.reasoning)
            if d.text:
                if "message" not in opened:
                    opened["message"] = len(opened)
                    yield event("response.output_item.added", output_index=opened["message"],
                                item=builder.message("", "in_progress"))
                    yield event("response.content_part.added", item_id=msg_id, output_index=opened["message"],
                                content_index=0, part={"type": "output_text", "text": "", "annotations": []})
                yield event("response.output_text.delta", item_id=msg_id, output_index=opened["message"],
                            content_index=0, delta=d.text, logprobs=[])
            for c in d.tool_calls:
                call = builder.calls[c.index]
                if c.index not in opened:
                    opened[c.index] = len(opened)
                    yield event("response.output_item.added", output_index=opened[c.index],
                                item={**call, "arguments": "", "status": "in_progress"})
                if c.arguments:
                    yield event("response.function_call_arguments.delta", item_id=call["id"],
                                output_index=opened[c.index], delta=c.arguments)
    except ApiError as exc:
        yield event("error", code=exc.code, message=exc.message, param=exc.param)
        yield SSE_DONE
        return
    builder.set_usage(usage)
    if "message" not in opened and not builder.calls:
        # No text and no call: the answer is an empty message, announced like any item.
        opened["message"] = len(opened)
        yield event("response.output_item.added", output_index=opened["message"], item=empty)
        yield event("response.content_part.added", item_id=msg_id, output_index=opened["message"], content_index=0,
                    part={"type": "output_text", "text": "", "annotations": []})
    builder.order = list(opened)
    for key, index in opened.items():
        for kind, fields in _item_done(builder, key, index):
            yield event(kind, **fields)
    body = builder.body()
    yield event("response.completed" if body["status"] == "completed" else "response.incomplete", response=body)


def _item_done(builder: ResponseBuilder, key: str | int, index: int) -> list[tuple]:
    """The events that end one output item: (event type, fields); the last, output_item.done,
    carries the item whole."""
    item = builder.item(key)
    ids = {"item_id": item["id"], "output_index": index}
    if key == "reasoning":
        events = [("response.reasoning_text.done", {**ids, "content_index": 0, "text": item["content"][0]["text"]})]
    elif key == "message":
        part = item["content"][0]
        events = [("response.output_text.done", {**ids, "content_index": 0, "text": part["text"], "logprobs": []}),
                  ("response.content_part.done", {**ids, "content_index": 0, "part": part})]
    else:
        events = [("response.function_call_arguments.done", {**ids, "name": item["name"],
                                                             "arguments": item["arguments"]})]
    return [*events, ("response.output_item.done", {"output_index": index, "item": item})]
