"""`POST /v1/responses`, OpenAI's Responses API, stateless, over the chat path.

A request becomes a chat completions body (input items to messages, `instructions` to a system
message, Responses-shaped tools and `text.format` to their chat forms) and runs like any chat
request; its deltas become the Response object or its stream of typed events. The mesh keeps no
responses: `store: true`, `previous_response_id`, `conversation` and `background` are refused by
name (a 400 with `param`), and an absent `store` is taken as false.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from gen.kvmesh.v1 import processor_pb2
from services.frontend.errors import ApiError
from services.frontend.responses import SSE_DONE, finish_name, sse

# Responses fields that need state or features the mesh does not have.
_REFUSED = {
    "store": ("the mesh keeps no responses: send store: false", lambda v: v not in (False, None)),
    "previous_response_id": ("the mesh keeps no responses: send the whole conversation as input", None),
    "conversation": ("the mesh keeps no conversations: send the whole conversation as input", None),
    "background": ("background responses are not supported", lambda v: v not in (False, None)),
    "include": ("`include` is not supported", lambda v: v not in ([], None)),
    "prompt": ("stored prompt templates are not supported", None),
}
# Fields passed on to the chat body under the same name.
_SAME = ("model", "temperature", "top_p", "top_k", "seed", "stream", "parallel_tool_calls", "user", "metadata",
         "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logit_bias", "stop",
         "structured_outputs", "chat_template_kwargs")


def chat_body(body: dict) -> dict:
    """The chat completions body a Responses request means; a 400 naming what cannot be served."""
    for name, (reason, refuses) in _REFUSED.items():
        if name in body and (refuses is None or refuses(body[name])):
            raise ApiError(400, reason, param=name, code="unsupported_parameter")
    out: dict[str, Any] = {k: body[k] for k in _SAME if k in body}
    out["messages"] = _messages(body)
    if "max_output_tokens" in body:
        out["max_completion_tokens"] = body["max_output_tokens"]
    if "tools" in body:
        out["tools"] = [_tool(t, i) for i, t in enumerate(_list(body["tools"], "tools"))]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise ApiError(400, "tool_choice must be auto, none, required or {type: function, name}",
                           param="tool_choice", code="invalid_value")
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        out["tool_choice"] = choice
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        out["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    elif isinstance(fmt, dict):
        out["response_format"] = fmt
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort") is not None:
        out["reasoning_effort"] = reasoning["effort"]
    return out


def _list(value: object, param: str) -> list:
    if not isinstance(value, list):
        raise ApiError(400, f"{param} must be a list", param=param, code="invalid_value")
    return value


def _tool(tool: object, i: int) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise ApiError(400, f"only function tools are supported, not {str(kind)[:40]!r}", param=f"tools.{i}",
                       code="unsupported_parameter")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": function}


def _messages(body: dict) -> list[dict]:
    messages: list[dict] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        return messages + [{"role": "user", "content": items}]
    for i, item in enumerate(_list(items, "input")):
        if not isinstance(item, dict):
            raise ApiError(400, "each input item must be an object", param=f"input.{i}", code="invalid_value")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _content(item.get("content"), i)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": item.get("output")})
        elif kind != "reasoning":  # an earlier answer's reasoning is not sent back to the model
            raise ApiError(400, f"input items of type {str(kind)[:40]!r} are not supported", param=f"input.{i}",
                           code="unsupported_parameter")
    return messages


def _content(content: object, i: int) -> object:
    if not isinstance(content, list):
        return content
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise ApiError(400, f"content parts of type {str(kind)[:40]!r} are not supported: this model takes "
                                f"text only", param=f"input.{i}.content.{j}", code="unsupported_content")
        parts.append({"type": "text", "text": part.get("text")})
    return parts


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

    @property
    def id(self) -> str:
        return "resp_" + self.rid

    def add(self, d: processor_pb2.ChoiceDelta) -> None:
        self.text.append(d.text)
        self.reasoning.append(d.reasoning)
        for c in d.tool_calls:
            call = self.calls.setdefault(c.index, {"id": f"fc_{c.id or self.rid}", "type": "function_call",
                                                   "status": "completed", "call_id": c.id, "name": c.name,
                                                   "arguments": ""})
            call["arguments"] += c.arguments
        if d.finish_reason:
            self.finish = finish_name(d.finish_reason) or ""

    def output(self) -> list[dict]:
        out: list[dict] = []
        reasoning = "".join(self.reasoning)
        if reasoning:
            out.append({"id": f"rs_{self.rid}", "type": "reasoning", "summary": [],
                        "content": [{"type": "reasoning_text", "text": reasoning}]})
        text = "".join(self.text)
        if text or not self.calls:
            out.append(self.message(text, "completed"))
        out.extend(self.calls[i] for i in sorted(self.calls))
        return out

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
            self.calls[i] = {"id": f"fc_{call['id']}", "type": "function_call", "status": "completed",
                             "call_id": call["id"], "name": call["function"]["name"],
                             "arguments": call["function"]["arguments"]}
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
    msg_id, text_open, opened_calls = f"msg_{builder.rid}", False, set()
    try:
        async for d in deltas:
            builder.add(d)
            if d.text:
                if not text_open:
                    text_open = True
                    yield event("response.output_item.added", output_index=0, item=builder.message("", "in_progress"))
                    yield event("response.content_part.added", item_id=msg_id, output_index=0, content_index=0,
                                part={"type": "output_text", "text": "", "annotations": []})
                yield event("response.output_text.delta", item_id=msg_id, output_index=0, content_index=0,
                            delta=d.text, logprobs=[])
            for c in d.tool_calls:
                call = builder.calls[c.index]
                index = 1 + c.index
                if c.index not in opened_calls:
                    opened_calls.add(c.index)
                    yield event("response.output_item.added", output_index=index,
                                item={**call, "arguments": "", "status": "in_progress"})
                if c.arguments:
                    yield event("response.function_call_arguments.delta", item_id=call["id"], output_index=index,
                                delta=c.arguments)
    except ApiError as exc:
        yield event("error", code=exc.code, message=exc.message, param=exc.param)
        yield SSE_DONE
        return
    builder.set_usage(usage)
    text = "".join(builder.text)
    if text_open:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        yield event("response.output_text.done", item_id=msg_id, output_index=0, content_index=0, text=text, logprobs=[])
        yield event("response.content_part.done", item_id=msg_id, output_index=0, content_index=0, part=part)
        yield event("response.output_item.done", output_index=0, item=builder.message(text, "completed"))
    for i in sorted(builder.calls):
        call = builder.calls[i]
        yield event("response.function_call_arguments.done", item_id=call["id"], output_index=1 + i,
                    name=call["name"], arguments=call["arguments"])
        yield event("response.output_item.done", output_index=1 + i, item=call)
    body = builder.body()
    yield event("response.completed" if body["status"] == "completed" else "response.incomplete", response=body)
