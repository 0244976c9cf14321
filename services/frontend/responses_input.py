"""A Responses API request as the chat completions body it means (responses_api.py answers it).

- `instructions` is the first system message; input messages keep their roles, `developer` as
  `system` (the role chat templates know).
- `function_call` items are the assistant's tool calls, `function_call_output` items tool
  messages; a `reasoning` item is the reasoning of the assistant turn it belongs to (the next
  assistant message or call of its turn, else the turn's last one), read from its `content`, or from its
  `encrypted_content` when that is a REASONING_TOKEN this gateway wrote (`include:
  ["reasoning.encrypted_content"]`: the mesh keeps nothing, so the reasoning travels to the
  client and back inside the token; other tokens, e.g. OpenAI's, say nothing a model here reads).
- function tools are chat tools; a `namespace` tool's functions are chat tools named
  `namespace.function` (NAMESPACE_SEP), and a call to one is answered as a function_call with
  `name` and `namespace` apart; hosted tools (web_search, file_search, ...) are not offered to the
  model (the mesh runs none; counted: client_fields.py). Tools with `defer_loading` and the
  hosted `tool_search` are refused by name: the gateway runs no tool search on this API yet.
- `prompt_cache_key` is the request's session for routing (sessions.py) when no header names one.
- `store: true`, `previous_response_id`, `conversation`, `background` and `prompt` are refused
  by name (a 400 with `param`): they need state the mesh does not keep.
"""

from __future__ import annotations

import base64
import zlib
from typing import Any

from services.frontend.agent_schemas import template_effort
from services.frontend.errors import ApiError

# Responses fields that need state or features the mesh does not have.
_REFUSED = {
    "store": ("the mesh keeps no responses: send store: false", lambda v: v not in (False, None)),
    "previous_response_id": ("the mesh keeps no responses: send the whole conversation as input", None),
    "conversation": ("the mesh keeps no conversations: send the whole conversation as input", None),
    "background": ("background responses are not supported", lambda v: v not in (False, None)),
    "prompt": ("stored prompt templates are not supported", None),
}
# Fields passed on to the chat body under the same name.
_SAME = ("model", "temperature", "top_p", "top_k", "seed", "stream", "parallel_tool_calls", "user", "metadata",
         "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logit_bias", "stop",
         "structured_outputs", "chat_template_kwargs", "priority")
HOSTED_TOOLS = frozenset({"web_search", "web_search_preview", "file_search", "code_interpreter", "image_generation",
                          "computer_use_preview", "mcp", "local_shell"})
ENCRYPTED_REASONING = "reasoning.encrypted_content"
NAMESPACE_SEP = "."
# The encrypted_content this gateway writes: a prefix, then the reasoning text deflated and
# base64url-encoded. Not a secret (the client already has the reasoning it asked for).
REASONING_TOKEN = "kvmesh-r1:"
MAX_REASONING_BYTES = 4 << 20


def chat_body(body: dict) -> dict:
    """The chat completions body a Responses request means; a 400 naming what cannot be served."""
    for name, (reason, refuses) in _REFUSED.items():
        if body.get(name) is not None and (refuses is None or refuses(body[name])):
            raise ApiError(400, reason, param=name, code="unsupported_parameter")
    out: dict[str, Any] = {k: body[k] for k in _SAME if k in body}
    out["messages"] = _messages(body)
    if "max_output_tokens" in body:
        out["max_completion_tokens"] = body["max_output_tokens"]
    if "tools" in body:
        tools = [t for i, tool in enumerate(_list(body["tools"], "tools")) for t in _tools(tool, f"tools.{i}")]
        if tools:
            out["tools"] = tools
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise ApiError(400, "tool_choice must be auto, none, required or {type: function, name}",
                           param="tool_choice", code="invalid_value")
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None and (choice != "auto" or "tools" in out):
        out["tool_choice"] = choice
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        out["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    elif isinstance(fmt, dict):
        out["response_format"] = fmt
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort") is not None:
        effort = reasoning["effort"]
        if not isinstance(effort, str):
            raise ApiError(400, "reasoning.effort must be a string", param="reasoning.effort", code="invalid_value")
        out["reasoning_effort"] = template_effort(effort)
    _check_include(body.get("include"))
    return out


def wants_encrypted_reasoning(body: dict) -> bool:
    include = body.get("include")
    return isinstance(include, list) and ENCRYPTED_REASONING in include


def agent_session(body: dict) -> tuple[str, str] | None:
    """Codex's conversation id: `prompt_cache_key`, the session its turns are routed by."""
    key = body.get("prompt_cache_key")
    return (key, "prompt_cache_key") if isinstance(key, str) and key else None


def nested_accepted(body: dict) -> list[str]:
    """The parts of the request taken without effect (client_fields.NESTED_ACCEPTED)."""
    out = []
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("summary") not in (None, "none"):
        out.append("reasoning.summary")
    tools = body.get("tools")
    for tool in tools if isinstance(tools, list) else ():
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind in HOSTED_TOOLS:
            out.append(f"tools.{kind}")
    return out


def encode_reasoning(text: str) -> str:
    return REASONING_TOKEN + base64.urlsafe_b64encode(zlib.compress(text.encode("utf-8"))).decode("ascii")


def decode_reasoning(token: object, param: str = "input", limit: int = MAX_REASONING_BYTES) -> str | None:
    """The reasoning inside a token this gateway wrote; None for any other (another provider's).
    The text inflates to at most `limit` bytes (a token is the client's to forge; a request's
    tokens share MAX_REASONING_BYTES)."""
    if not isinstance(token, str) or not token.startswith(REASONING_TOKEN):
        return None
    try:
        inflater = zlib.decompressobj()
        # One byte past the limit, so a spent budget (0) still inflates nothing: zlib reads a
        # max_length of 0 as no limit at all.
        raw = inflater.decompress(base64.urlsafe_b64decode(token[len(REASONING_TOKEN):]), max(limit, 0) + 1)
        if len(raw) > limit or inflater.unconsumed_tail or not inflater.eof:
            raise ValueError("too large or cut short")
        return raw.decode("utf-8")
    except (ValueError, zlib.error, UnicodeDecodeError):
        raise ApiError(400, f"this encrypted_content is damaged, or the request's reasoning inflates past "
                            f"{MAX_REASONING_BYTES >> 20} MiB: send items back as they were received",
                       param=param, code="invalid_value") from None


def namespaced(name: str) -> tuple[str, str | None]:
    """A chat tool's name as the Responses API's (name, namespace)."""
    namespace, sep, function = name.partition(NAMESPACE_SEP)
    return (function, namespace) if sep else (name, None)


def _check_include(include: object) -> None:
    if include is None:
        return
    if not isinstance(include, list) or not all(isinstance(v, str) for v in include):
        raise ApiError(400, "include must be a list of strings", param="include", code="invalid_value")


def _list(value: object, param: str) -> list:
    if not isinstance(value, list):
        raise ApiError(400, f"{param} must be a list", param=param, code="invalid_value")
    return value


def _tools(tool: object, where: str, namespace: str | None = None) -> list[dict]:
    """The chat tools one Responses tool stands for (none for a hosted tool)."""
    kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
    if isinstance(tool, dict) and kind == "function":
        if tool.get("defer_loading"):
            raise ApiError(400, "deferred tools (defer_loading) are not supported on this API: send the tool "
                                "without it", param=f"{where}.defer_loading", code="unsupported_parameter")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        if namespace is not None and isinstance(function.get("name"), str):
            function["name"] = namespace + NAMESPACE_SEP + function["name"]
        return [{"type": "function", "function": function}]
    if isinstance(tool, dict) and kind == "namespace" and namespace is None:
        name = tool.get("name")
        if not isinstance(name, str) or NAMESPACE_SEP in name:
            raise ApiError(400, f"a namespace needs a name without {NAMESPACE_SEP!r}", param=f"{where}.name",
                           code="invalid_value")
        return [t for j, inner in enumerate(_list(tool.get("tools"), f"{where}.tools"))
                for t in _tools(inner, f"{where}.tools.{j}", name)]
    if isinstance(kind, str) and kind in HOSTED_TOOLS:
        return []
    raise ApiError(400, f"tools of type {str(kind)[:40]!r} are not supported: send function or namespace tools",
                   param=where, code="unsupported_parameter")


def _messages(body: dict) -> list[dict]:
    messages: list[dict] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        return messages + [{"role": "user", "content": items}]
    pending: list[str] = []  # reasoning read, waiting for the assistant item it belongs to
    budget = _Budget(MAX_REASONING_BYTES)
    for i, item in enumerate(_list(items, "input")):
        if not isinstance(item, dict):
            raise ApiError(400, "each input item must be an object", param=f"input.{i}", code="invalid_value")
        kind = item.get("type", "message")
        if kind == "reasoning":
            if (text := _reasoning_text(item, i, budget)) is not None:
                pending.append(text)
            continue
        if kind == "message":
            role = item.get("role")
            if role != "assistant":
                _attach_back(messages, pending)  # a turn ended: its reasoning joins its last assistant item
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _content(item.get("content"), i)})
        elif kind == "function_call":
            name = item.get("name")
            if isinstance(item.get("namespace"), str) and isinstance(name, str):
                name = item["namespace"] + NAMESPACE_SEP + name
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": name, "arguments": item.get("arguments")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            _attach_back(messages, pending)
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": _output(item.get("output"), i)})
        else:
            raise ApiError(400, f"input items of type {str(kind)[:40]!r} are not supported", param=f"input.{i}",
                           code="unsupported_parameter")
        if pending and messages[-1]["role"] == "assistant":
            # Reasoning joins the assistant item after it (a turn's second reasoning, before its
            # second call, joins the first).
            messages[-1]["reasoning_content"] = messages[-1].get("reasoning_content", "") + "".join(pending)
            pending.clear()
    _attach_back(messages, pending)
    return messages


def _attach_back(messages: list[dict], pending: list[str]) -> None:
    """Reasoning with no assistant item after it in its turn joins the turn's last one (none:
    dropped, nothing renders reasoning outside an assistant message)."""
    if pending and messages and messages[-1]["role"] == "assistant":
        messages[-1]["reasoning_content"] = messages[-1].get("reasoning_content", "") + "".join(pending)
    pending.clear()


class _Budget:
    """What a request's reasoning tokens may inflate to, all of them together."""

    def __init__(self, limit: int) -> None:
        self.left = limit


def _reasoning_text(item: dict, i: int, budget: _Budget) -> str | None:
    content = item.get("content")
    if isinstance(content, list):
        parts = [p for p in content if isinstance(p, dict) and p.get("type") == "reasoning_text"]
        for j, p in enumerate(parts):
            if not isinstance(p.get("text"), str):
                raise ApiError(400, "a reasoning_text part's text must be a string", param=f"input.{i}.content.{j}.text",
                               code="invalid_value")
        if joined := "".join(p["text"] for p in parts):
            return joined
    decoded = decode_reasoning(item.get("encrypted_content"), f"input.{i}.encrypted_content", budget.left)
    if decoded is not None:
        budget.left -= len(decoded.encode("utf-8"))
    return decoded


def _output(output: object, i: int) -> object:
    """A function call's output: a string, or a list of content parts (text only here) joined."""
    if not isinstance(output, list):
        return output
    texts = [part["text"] for part in _text_parts(output, f"input.{i}.output", "output")]
    for j, text in enumerate(texts):
        if not isinstance(text, str):
            raise ApiError(400, "an output part's text must be a string", param=f"input.{i}.output.{j}.text",
                           code="invalid_value")
    return "".join(texts)


def _content(content: object, i: int) -> object:
    """A message's content: text parts and `input_image` parts (as the chat path's image_url
    parts; frontend/images.py reads them)."""
    if not isinstance(content, list):
        return content
    out = []
    for j, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "input_image":
            out.append(_image(part, f"input.{i}.content.{j}"))
        else:
            out.extend(_text_parts([part], f"input.{i}.content", "content", first=j))
    return out


def _image(part: dict, where: str) -> dict:
    url = part.get("image_url")
    if part.get("file_id") is not None:
        raise ApiError(400, "input_image by file_id is not supported (the mesh keeps no files): send image_url",
                       param=f"{where}.file_id", code="unsupported_content")
    if not isinstance(url, str) or not url.startswith(("data:", "http://", "https://")):
        raise ApiError(400, "an input_image needs image_url: a data: URL (or an http(s) URL the operator allowed)",
                       param=f"{where}.image_url", code="invalid_value")
    return {"type": "image_url", "image_url": {"url": url}}


def _text_parts(parts: list, where: str, what: str, first: int = 0) -> list[dict]:
    """Text parts as the chat path's; any other kind is a 400 naming it (`where.N`, counted from
    `first`)."""
    out = []
    for j, part in enumerate(parts, first):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise ApiError(400, f"{what} parts of type {str(kind)[:40]!r} are not supported: text parts are "
                                f"(and input_image in a message)", param=f"{where}.{j}", code="unsupported_content")
        out.append({"type": "text", "text": part.get("text")})
    return out
