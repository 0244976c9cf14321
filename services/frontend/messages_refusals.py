"""What the Messages API refuses by name before validation (messages_schemas.py says why): a
field or content block the mesh cannot honour gets a 400 whose message opens with its path
(`messages.0.content.1.type: ...`), rather than pydantic's complaint about a key another block
type lacks."""

from __future__ import annotations

from typing import Any

from services.frontend.errors import ApiError

# Content block types the mesh reads; every other Anthropic block type is refused by name.
BLOCK_TYPES = frozenset({"text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking"})
# Why a known block type is not served (anything else: "unknown content block type").
_UNSERVED_BLOCKS = {
    "document": "documents are not supported: send their text, or their pages as images",
    "search_result": "search result blocks are not supported",
    "container_upload": "the mesh has no containers",
}
_SERVER_BLOCK = "server tool blocks are not supported: the mesh runs no server tools"
# Top-level fields that ask for what the mesh does not have (None: refused whatever the value).
_REFUSED: dict[str, tuple[str, Any]] = {
    "container": ("the mesh has no containers", None),
    "mcp_servers": ("MCP servers are not supported: send client tools", None),
    "inference_geo": ("the mesh does not choose a geography", None),
    "service_tier": ("only auto and standard_only are served", lambda v: v not in ("auto", "standard_only", None)),
}


def refused(param: str | None, reason: str, code: str) -> ApiError:
    return ApiError(400, f"{param}: {reason}" if param else reason, param=param, code=code)


def refuse_unsupported(body: dict) -> None:
    """A 400 naming what the mesh cannot honour (see messages_schemas.py's docstring)."""
    for name, (reason, refuses) in _REFUSED.items():
        if name in body and body[name] is not None and (refuses is None or refuses(body[name])):
            raise refused(name, reason, "unsupported_parameter")
    _refuse_cache_control(body.get("cache_control"), "cache_control")
    system = body.get("system")
    for j, block in enumerate(system if isinstance(system, list) else ()):
        _refuse_block(block, f"system.{j}", ("text",))
    messages = body.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        content = message.get("content") if isinstance(message, dict) else None
        role = message.get("role") if isinstance(message, dict) else None
        for j, block in enumerate(content if isinstance(content, list) else ()):
            where = f"messages.{i}.content.{j}"
            _refuse_block(block, where, ("text",) if role == "system" else BLOCK_TYPES)
            misplaced = _MISPLACED.get(role, ()) if isinstance(role, str) else ()
            if isinstance(block, dict) and block.get("type") in misplaced:
                # Dropped, the turn would render as something else than the client sent.
                article = "an" if role == "assistant" else "a"
                raise refused(f"{where}.type", f"{block['type']} blocks are not allowed in {article} {role} message",
                              "invalid_value")
            inner = block.get("content") if isinstance(block, dict) and block.get("type") == "tool_result" else None
            for k, part in enumerate(inner if isinstance(inner, list) else ()):
                _refuse_block(part, f"{where}.content.{k}", ("text", "tool_reference", "image"))
    tools = body.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else ()):
        if isinstance(tool, dict):
            kind = tool.get("type")
            if kind not in (None, "custom"):
                raise refused(f"tools.{i}.type", f"server tools ({str(kind)[:60]}) are not supported: the mesh runs "
                                                  f"client tools only (a tool with name and input_schema)",
                              "unsupported_parameter")
            _refuse_cache_control(tool.get("cache_control"), f"tools.{i}.cache_control")


# The blocks a turn of each role cannot hold: the model's tool calls come from the assistant, their
# results (and images) from the user.
_MISPLACED = {"user": ("tool_use",), "assistant": ("tool_result", "image")}


def _refuse_block(block: object, where: str, served: frozenset[str] | tuple[str, ...]) -> None:
    if not isinstance(block, dict):
        return  # validation names it
    kind = block.get("type")
    if isinstance(kind, str) and kind not in served:
        if kind in _UNSERVED_BLOCKS:
            reason = f"{kind} blocks are not supported: {_UNSERVED_BLOCKS[kind]}"
        elif kind in BLOCK_TYPES:
            reason = f"{kind} blocks are not allowed here"
        elif kind.endswith("_tool_result") or kind == "server_tool_use":
            reason = _SERVER_BLOCK
        else:
            reason = f"unknown content block type {kind[:60]!r}"
        raise refused(f"{where}.type", reason, "unsupported_content")
    _refuse_cache_control(block.get("cache_control"), f"{where}.cache_control")


def _refuse_cache_control(value: object, where: str) -> None:
    """`{type: ephemeral[, ttl]}` is a no-op; any other kind of breakpoint is refused by name
    (validation checks the ttl's values)."""
    if value is None:
        return
    if not isinstance(value, dict) or value.get("type") != "ephemeral" or not set(value) <= {"type", "ttl"}:
        raise refused(where, "only {type: ephemeral, ttl} is accepted (a no-op: every prefix is cached)",
                      "unsupported_parameter")
