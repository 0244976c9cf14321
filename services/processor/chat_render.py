"""A chat request as its template sees it, and the constraint a forced tool call puts on the output.

The template gets what Hugging Face chat templates expect (the same as vLLM hands them): each
message's role, content (None for an assistant message that only calls tools), name, tool calls
with their arguments as objects, the tool call a tool message answers, an earlier answer's
reasoning; `tools` as OpenAI's list; `chat_template_kwargs` as extra keyword arguments.

`tool_choice` "required" and a named function are enforced by structured output, so any model,
even one with random weights, produces calls that parse:
- required: a JSON array of one or more `{"name", "parameters"}` objects, each naming a tool and
  holding arguments valid for its schema (at most one item without parallel tool calls);
- named: the function's arguments object itself.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gen.kvmesh.v1 import common_pb2, json_value_pb2, processor_pb2
from services.contract.json_value import from_json_value
from services.processor.images import PromptImage, open_image
from services.processor.prompt_errors import PromptError

Mode = processor_pb2.ToolChoice.Mode
# Keyword arguments the renderer sets itself: a request may not override them.
RESERVED_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "continue_final_message", "tokenize",
                             "conversation", "chat_template"})


@dataclass(frozen=True)
class ChatPrompt:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # The images of the messages' `{"type": "image"}` parts, in prompt order.
    images: tuple[PromptImage, ...] = ()


def chat_prompt(chat: processor_pb2.ChatInput, decoded: Callable[[int], bool] | None = None) -> ChatPrompt:
    """The chat as the template takes it; `decoded`: whether an image (by digest) was decoded whole
    before (images.py `open_image`)."""
    tools = openai_tools(chat) or None
    kwargs = _json(chat.template_kwargs, "chat_template_kwargs") if chat.HasField("template_kwargs") else {}
    if not isinstance(kwargs, dict):
        raise PromptError("chat_template_kwargs must be a JSON object", param="chat_template_kwargs")
    clash = RESERVED_KWARGS.intersection(kwargs)
    if clash:
        raise PromptError(f"chat_template_kwargs may not set {sorted(clash)}", param="chat_template_kwargs")
    images: list[PromptImage] = []
    messages = [_message(m, i, images, decoded) for i, m in enumerate(chat.messages)]
    return ChatPrompt(messages, tools, kwargs, chat.add_generation_prompt, chat.continue_final_message, tuple(images))


def _message(m: processor_pb2.ChatMessage, index: int, images: list[PromptImage],
             decoded: Callable[[int], bool] | None) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": _content(m, index, images, decoded)}
    if m.name:
        out["name"] = m.name
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.reasoning:
        out["reasoning_content"] = m.reasoning
    if m.tool_calls:
        out["tool_calls"] = [_tool_call(c) for c in m.tool_calls]
    return out


def _content(m: processor_pb2.ChatMessage, index: int, images: list[PromptImage],
             decoded: Callable[[int], bool] | None) -> str | list[dict] | None:
    """A message's content; one with images as Hugging Face templates take it: a list of
    `{"type": "text", "text": ...}` and `{"type": "image"}` parts (the image itself is in
    `images`, in order)."""
    if not m.parts:
        return None if m.no_content else m.content
    out: list[dict] = []
    for j, part in enumerate(m.parts):
        if part.WhichOneof("part") == "image":
            images.append(open_image(part.image, f"messages.{index}.content.{j}", decoded))
            out.append({"type": "image"})
        else:
            out.append({"type": "text", "text": part.text})
    return out


def _tool_call(call: processor_pb2.ToolCall) -> dict[str, Any]:
    # Templates render arguments as an object (`arguments | tojson`); a string that is not JSON
    # stays as sent.
    arguments: Any = call.arguments
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        pass
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}


def openai_tools(chat: processor_pb2.ChatInput) -> list[dict[str, Any]]:
    """The request's `tools` as OpenAI's list, each with the fields the client gave, in its order."""
    out = []
    for i, tool in enumerate(chat.tools):
        function: dict[str, Any] = {"name": tool.name}
        if tool.HasField("description"):
            function["description"] = tool.description
        if tool.HasField("parameters"):
            function["parameters"] = _json(tool.parameters, f"tools.{i}.function.parameters")
        if tool.HasField("strict"):
            function["strict"] = tool.strict
        out.append({"type": "function", "function": function})
    return out


def _json(value: json_value_pb2.JsonValue, param: str) -> Any:
    try:
        return from_json_value(value)
    except ValueError as exc:
        raise PromptError(f"{param} is not a JSON value: {exc}", param=param) from None


def forced_tool_output(chat: processor_pb2.ChatInput) -> common_pb2.StructuredOutput | None:
    """The structured output that enforces a required or named tool_choice; None otherwise."""
    choice = chat.tool_choice
    if not chat.tools or choice.mode not in (Mode.MODE_REQUIRED, Mode.MODE_NAMED):
        return None
    functions = {t["function"]["name"]: t["function"].get("parameters") for t in openai_tools(chat)}
    if choice.mode == Mode.MODE_NAMED:
        if choice.function not in functions:
            raise PromptError(f"tool_choice names {choice.function!r}, which is not in tools", param="tool_choice")
        schema: dict[str, Any] = _parameters(functions[choice.function])
    else:
        schema = {"type": "array", "minItems": 1,
                  "items": {"type": "object", "anyOf": [
                      {"properties": {"name": {"type": "string", "enum": [name]}, "parameters": _parameters(params)},
                       "required": ["name", "parameters"]} for name, params in functions.items()]}}
        if not choice.parallel:
            schema["maxItems"] = 1
    return common_pb2.StructuredOutput(json_schema=json.dumps(schema), param="tool_choice")


def _parameters(params: dict[str, Any] | None) -> dict[str, Any]:
    return params if params else {"type": "object", "properties": {}}
