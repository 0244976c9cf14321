"""`POST /v1/messages`, Anthropic's Messages API, over the chat path.

A request (messages_schemas.py) becomes a chat completions body and runs like any chat request:
the same processor, chat template, tool-call and reasoning parsers, and structured decoding (a
forced tool, `any` or `{type: tool}`, constrains the output exactly as OpenAI's `required` or a
named function does). The chat answer becomes a Message, whole (`message_body`) or as Anthropic's
typed events (messages_events.py).

How the two APIs meet:
- `system` is the first (system) message; text blocks are joined as the chat path joins parts. A
  message with role `system` later in the conversation (Claude Code sends its environment so) is
  a system message where it stands.
- a user message's `tool_result` blocks are tool messages (`tool_call_id` = the block's
  `tool_use_id`), ahead of its text, as Anthropic requires them first; `is_error: true` opens the
  tool message's content with "Error: " (chat templates have no flag for it).
- deferred tools (`defer_loading: true`) are left out of the template's tool list; a
  `tool_reference` block in a tool_result (a client-side tool search's answer) loads the tool it
  names: its definition is written into that tool message, where the search returned it, so the
  prompt before it (the tool list included) stays what the prefix cache holds. A tool_choice that
  names a deferred tool puts it in the tool list.
- an assistant message's text, `thinking` (as `reasoning_content`) and `tool_use` blocks (as
  tool calls, their `input` as JSON arguments) are one assistant message; `redacted_thinking`
  is dropped (nothing another model can read). A last assistant message is a prefill: the answer
  continues it (`continue_final_message`).
- tool_use ids are the chat path's tool call ids, unchanged both ways, so an id sent back in a
  tool_result is the id the template rendered the call with.
- `metadata.user_id` is the chat request's `user` (the agent session with --session-from-user);
  `stop_sequences` its `stop`; `tool_choice` any/tool/none its required/named/none, with
  `disable_parallel_tool_use` as `parallel_tool_calls: false`; `thinking` enabled or disabled
  sets the template's `enable_thinking` and `thinking` switches (adaptive leaves its default);
  `output_config.effort` is `reasoning_effort` (xhigh and max as high), `output_config.format` (or the beta's
  top-level `output_format`) a strict JSON schema.
- usage follows Anthropic's split: `input_tokens` are the prompt tokens not read from the prefix
  cache, `cache_read_input_tokens` those that were (with --hide-routing-details both are left
  whole: input_tokens is the prompt, no cache field), `cache_creation_input_tokens` is 0 (caching
  costs nothing extra here).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from services.frontend.agent_schemas import ABOVE_HIGH_EFFORTS, template_effort
from services.frontend.endpoints import Kind
from services.frontend.messages_schemas import (
    CountTokensRequest,
    CustomTool,
    ImageBlock,
    MessageIn,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    ThinkingDisabled,
    ThinkingEnabled,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
)
from services.frontend.schemas import ChatCompletionRequest

log = logging.getLogger(__name__)

# The Messages API: a chat request underneath. Its metrics and logs say "messages".
MESSAGES = Kind("messages", ChatCompletionRequest, "message", "message", "msg_")
COUNT_TOKENS = Kind("count_tokens", ChatCompletionRequest, "message_tokens_count", "", "")

# A chat finish reason as Anthropic's stop_reason ("stop" may also be a stop sequence: `stop_reason`).
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
TOOL_ERROR_PREFIX = "Error: "
# How a loaded deferred tool reads in the tool message that loaded it.
TOOL_LOADED = "Tool loaded, callable from now on: "
TOOL_UNKNOWN = "No such tool: "
TOOL_OFFERED = "Tool already available: "


def chat_body(req: CountTokensRequest) -> dict[str, Any]:
    """The chat completions body a Messages (or count_tokens) request means."""
    tools = {t.name: t for t in req.tools or ()}
    out: dict[str, Any] = {"model": req.model, "messages": _messages(req, tools)}
    if req.messages[-1].role == "assistant":
        out["add_generation_prompt"] = False
        out["continue_final_message"] = True
    named = req.tool_choice.name if isinstance(req.tool_choice, ToolChoiceTool) else None
    offered = [t for t in req.tools or () if not t.defer_loading or t.name == named]
    if offered:
        out["tools"] = [{"type": "function", "function": _function(t)} for t in offered]
    choice = req.tool_choice
    if choice is not None:
        if isinstance(choice, ToolChoiceTool):
            out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if not isinstance(choice, ToolChoiceNone) and choice.disable_parallel_tool_use:
            out["parallel_tool_calls"] = False
    if isinstance(req.thinking, ThinkingEnabled | ThinkingDisabled):
        on = isinstance(req.thinking, ThinkingEnabled)
        # The switches reasoning models' templates read (Qwen3's, DeepSeek's); others ignore them.
        out["chat_template_kwargs"] = {"enable_thinking": on, "thinking": on}
    config = req.output_config
    if config is not None and config.effort is not None:
        out["reasoning_effort"] = template_effort(config.effort)
    fmt = config.format if config is not None and config.format is not None else req.output_format
    if fmt is not None:
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_,
                                                                         "strict": True}}
    if isinstance(req, MessagesRequest):
        out["max_tokens"] = req.max_tokens
        out["stream"] = req.stream
        for name in ("temperature", "top_p", "top_k"):
            if (value := getattr(req, name)) is not None:
                out[name] = value
        if req.stop_sequences:
            out["stop"] = req.stop_sequences
        if req.metadata is not None and req.metadata.user_id:
            out["user"] = req.metadata.user_id
    # vLLM's extensions the chat path takes, when a client sends them (the admission band).
    extra = req.model_extra or {}
    for name in ("priority", "seed"):
        if name in extra:
            out[name] = extra[name]
    return out


def _function(tool: CustomTool) -> dict[str, Any]:
    return {"name": tool.name, **({"description": tool.description} if tool.description is not None else {}),
            "parameters": tool.input_schema, **({"strict": tool.strict} if tool.strict is not None else {})}


def _messages(req: CountTokensRequest, tools: dict[str, CustomTool]) -> list[dict]:
    out: list[dict] = []
    if req.system:
        out.append({"role": "system", "content": _text(req.system)})
    for message in req.messages:
        if message.role == "assistant":
            out.extend(_assistant(message))
        elif message.role == "system":
            out.append({"role": "system", "content": _text(message.content)})  # type: ignore[arg-type]
        else:
            out.extend(_user(message, tools))
    return out


def agent_session(req: CountTokensRequest) -> tuple[str, str] | None:
    """The session an agent names in `metadata.user_id` without being asked: Claude Code sends
    a JSON object there whose `session_id` is its conversation's id."""
    user_id = req.metadata.user_id if isinstance(req, MessagesRequest) and req.metadata is not None else None
    if not user_id or not user_id.startswith("{"):
        return None
    try:
        value = json.loads(user_id)
    except ValueError:
        return None
    session = value.get("session_id") if isinstance(value, dict) else None
    return (session, "metadata.user_id") if isinstance(session, str) and session else None


def nested_accepted(req: CountTokensRequest) -> list[str]:
    """The parts of the request taken without effect (client_fields.NESTED_ACCEPTED)."""
    out = []
    if req.thinking is not None and getattr(req.thinking, "display", None) == "summarized":
        out.append("thinking.display")
    if any(t.eager_input_streaming is not None for t in req.tools or ()):
        out.append("tools.eager_input_streaming")
    if req.output_config is not None and req.output_config.effort in ABOVE_HIGH_EFFORTS:
        out.append("output_config.effort.xhigh")
    return out


def _text(content: str | list[TextBlock]) -> str | list[dict]:
    if isinstance(content, str):
        return content
    return [{"type": "text", "text": block.text} for block in content]


def _user(message: MessageIn, tools: dict[str, CustomTool]) -> list[dict]:
    if isinstance(message.content, str):
        return [{"role": "user", "content": message.content}]
    out: list[dict] = []
    parts: list[dict] = []
    for block in message.content:
        if isinstance(block, ToolResultBlock):
            text = _result_text(block, tools)
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": TOOL_ERROR_PREFIX + text if block.is_error else text})
            # A tool message holds text only (as OpenAI's): a result's images follow it, in the
            # user turn that comes next.
            if isinstance(block.content, list):
                parts.extend(_image_part(p) for p in block.content if isinstance(p, ImageBlock))
        elif isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ImageBlock):
            parts.append(_image_part(block))
        # thinking blocks belong to assistant turns; a client that puts one in a user turn gets it
        # dropped, as Anthropic's API does (a tool_use block there is refused: messages_schemas).
    if parts or not out:
        out.append({"role": "user", "content": parts})
    return out


def _image_part(block: ImageBlock) -> dict:
    return {"type": "image_url", "image_url": {"url": block.url()}}


def _result_text(block: ToolResultBlock, tools: dict[str, CustomTool]) -> str:
    """A tool result as the tool message's text; each tool_reference as the definition of the
    deferred tool it loads, a tool already offered as named, and one the request does not define
    as unknown."""
    if block.content is None or isinstance(block.content, str):
        return block.content or ""
    pieces = []
    for part in block.content:
        if isinstance(part, TextBlock):
            pieces.append(part.text)
        elif isinstance(part, ImageBlock):
            continue  # follows the tool message (_user)
        elif (tool := tools.get(part.tool_name)) is None:
            pieces.append(f"{TOOL_UNKNOWN}{part.tool_name}")
        elif tool.defer_loading:
            definition = {"type": "function", "function": _function(tool)}
            pieces.append(TOOL_LOADED + json.dumps(definition, ensure_ascii=False))
        else:
            pieces.append(f"{TOOL_OFFERED}{part.tool_name}")
    return "\n".join(pieces)


def _assistant(message: MessageIn) -> list[dict]:
    if isinstance(message.content, str):
        return [{"role": "assistant", "content": message.content}]
    text: list[dict] = []
    reasoning: list[str] = []
    calls: list[dict] = []
    for block in message.content:
        if isinstance(block, TextBlock):
            text.append({"type": "text", "text": block.text})
        elif isinstance(block, ThinkingBlock):
            reasoning.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        # redacted_thinking: nothing a template renders (a tool_result here is refused: messages_schemas).
    out: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if reasoning:
        out["reasoning_content"] = "".join(reasoning)
    if calls:
        out["tool_calls"] = calls
    return [out]


def stop_reason(finish: str | None, stop_sequence: str | None = None) -> str | None:
    """Anthropic's stop_reason for a chat finish reason, and the stop string that ended the
    choice if one did (the processor says which: ChoiceDelta.stop_sequence)."""
    if stop_sequence and finish != "tool_calls":
        return "stop_sequence"
    return _STOP_REASONS.get(finish or "", "end_turn") if finish is not None else None


def tool_input(arguments: str, rid: str) -> dict:
    """A tool call's arguments as the tool_use block's `input` (an object)."""
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        value = None
    if not isinstance(value, dict):
        # The tool-call parser hands on only calls it read as JSON; a model cut off by max_tokens
        # mid-call is the case left.
        log.warning("request %s: a tool call's arguments are not a JSON object; input is {}", rid)
        return {}
    return value


def usage(prompt: int, completion: int, cached: int | None) -> dict:
    """Anthropic's usage; `cached` None: the cache hit is hidden (--hide-routing-details)."""
    if cached is None:
        return {"input_tokens": prompt, "output_tokens": completion, "cache_creation_input_tokens": 0}
    return {"input_tokens": prompt - cached, "output_tokens": completion, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached}


@dataclass(frozen=True)
class MessageShape:
    """What a request asks of its answer's form beside the chat answer: thinking blocks without
    their text (`thinking.display: omitted`), and the context edits applied, when it asked for
    context management (reported as `context_management.applied_edits`)."""

    omit_thinking: bool = False
    applied_edits: list[dict] | None = None

    @classmethod
    def of(cls, req: CountTokensRequest, applied: list[dict]) -> MessageShape:
        display = getattr(req.thinking, "display", None)
        return cls(display == "omitted", applied if req.context_management is not None else None)

    def reported(self) -> dict:
        return {} if self.applied_edits is None else {"context_management": {"applied_edits": self.applied_edits}}


def message_body(rid: str, model: str, chat: dict, shape: MessageShape = MessageShape()) -> dict:
    """The Message for a whole chat completion body (`Answer.collect`'s)."""
    choice = chat["choices"][0]
    message = choice["message"]
    content: list[dict] = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": "" if shape.omit_thinking else message["reasoning_content"],
                        "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": tool_input(call["function"]["arguments"], rid)})
    if not content:
        content.append({"type": "text", "text": ""})
    u = chat["usage"]
    cached = u["prompt_tokens_details"]["cached_tokens"] if "prompt_tokens_details" in u else None
    return {"id": "msg_" + rid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason(choice["finish_reason"], choice.get("stop_reason")),
            "stop_sequence": choice.get("stop_reason"),
            "usage": usage(u["prompt_tokens"], u["completion_tokens"], cached), **shape.reported()}
