"""Request bodies of Anthropic's Messages API (`POST /v1/messages` and `/v1/messages/count_tokens`).

The chat path's rule (schemas.py), in Anthropic's names: known fields are strict (JSON types,
bounds of the protobuf fields they travel in, valid Unicode) and every nested object forbids keys
it does not know (inside a content block or a tool an unknown key changes what the model is asked);
unknown top-level fields pass and are ignored. What the mesh cannot honour is refused by name
before validation (`refuse_unsupported`), so the 400 says what is not served rather than which
key a block of another type lacks: document blocks, server tools (a tool
with a `type` other than `custom`), `cache_control` other than `{type: ephemeral[, ttl]}` (accepted
as a no-op: the mesh's prefix cache needs no breakpoints), `container`, `mcp_servers`,
`inference_geo`, and a `service_tier` other than auto or standard_only. What agent clients send
beside (context editing, deferred tools, mid-conversation system messages, effort levels) is
read here and applied in messages_api.py and context_edits.py; client_fields.py says what each
top-level field does.
Every refusal's message opens with the field's path (`messages.0.content.1.type: ...`): Anthropic's
error body has no `param` of its own.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from services.contract.request_limits import MAX_STOP_CHARS, MAX_STOP_STRINGS, UINT32_MAX
from services.frontend.agent_schemas import FunctionName, Text, valid_unicode
from services.frontend.errors import ApiError
from services.frontend.messages_refusals import BLOCK_TYPES, refuse_unsupported, refused
from services.frontend.schemas import INT32_MAX, Integral, TokenCount, UnitFloat

ToolId = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,256}$")]
StopText = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS), AfterValidator(valid_unicode)]


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class CacheControl(_Closed):
    """A prompt-cache breakpoint: accepted and ignored (every prefix is cached without one)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Closed):
    type: Literal["text"]
    text: Text
    cache_control: CacheControl | None = None
    # Citations an earlier answer carried: nothing the model reads.
    citations: list[dict[str, Any]] | None = None


class ToolUseBlock(_Closed):
    type: Literal["tool_use"]
    id: ToolId
    name: FunctionName
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolReferenceBlock(_Closed):
    """A client-side tool search's answer inside a tool_result: the deferred tool it loads."""

    type: Literal["tool_reference"]
    tool_name: FunctionName
    cache_control: CacheControl | None = None


class Base64Source(_Closed):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class UrlSource(_Closed):
    type: Literal["url"]
    url: Annotated[str, Field(min_length=1)]


class ImageBlock(_Closed):
    """An image (a pasted screenshot, or a tool's: Claude Code's Read of an image file): it
    reaches the chat path as an OpenAI image_url part (frontend/images.py reads it)."""

    type: Literal["image"]
    source: Annotated[Base64Source | UrlSource, Field(discriminator="type")]
    cache_control: CacheControl | None = None

    def url(self) -> str:
        if isinstance(self.source, UrlSource):
            return self.source.url
        return f"data:{self.source.media_type};base64,{self.source.data}"


ResultPart = Annotated[TextBlock | ToolReferenceBlock | ImageBlock, Field(discriminator="type")]


class ToolResultBlock(_Closed):
    type: Literal["tool_result"]
    tool_use_id: ToolId
    content: Text | list[ResultPart] | None = None
    is_error: bool = False
    cache_control: CacheControl | None = None

    def references(self) -> list[str]:
        """The deferred tools this result loads (tool_reference blocks), in order."""
        if self.content is None or isinstance(self.content, str):
            return []
        return [part.tool_name for part in self.content if isinstance(part, ToolReferenceBlock)]


class ThinkingBlock(_Closed):
    type: Literal["thinking"]
    thinking: Text
    # Anthropic's proof that it wrote the block; the mesh neither makes nor checks one.
    signature: str = ""
    cache_control: CacheControl | None = None


class RedactedThinkingBlock(_Closed):
    """Encrypted reasoning from Anthropic's models: nothing another model can read (dropped)."""

    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
                  Field(discriminator="type")]


class MessageIn(_Closed):
    # `system` mid-conversation: Claude Code's instructions that change between turns
    # (environment, reminders) come as system messages after the first user turn.
    role: Literal["user", "assistant", "system"]
    content: Text | list[Block]


class Metadata(_Closed):
    # The agent session's id with --session-from-user (frontend/sessions.py), as OpenAI's `user`.
    user_id: Annotated[str, Field(max_length=256), AfterValidator(valid_unicode)] | None = None


class CustomTool(_Closed):
    name: FunctionName
    description: Text | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    strict: bool | None = None
    # Tool input streams as it is generated whatever this says.
    eager_input_streaming: bool | None = None
    # Kept out of the prompt until a tool_reference block loads it (messages_api.py).
    defer_loading: bool | None = None


class _ToolChoiceBase(_Closed):
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAuto(_ToolChoiceBase):
    type: Literal["auto"]


class ToolChoiceAny(_ToolChoiceBase):
    type: Literal["any"]


class ToolChoiceTool(_ToolChoiceBase):
    type: Literal["tool"]
    name: FunctionName


class ToolChoiceNone(_Closed):
    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")]


class ThinkingEnabled(_Closed):
    type: Literal["enabled"]
    # Anthropic's bounds (>= 1024, < max_tokens); the whole output is bounded by max_tokens.
    budget_tokens: Annotated[int, Field(ge=1024, le=UINT32_MAX), Integral]
    display: Literal["summarized", "omitted"] | None = None


class ThinkingDisabled(_Closed):
    type: Literal["disabled"]


class ThinkingAdaptive(_Closed):
    """The model decides: its chat template's default."""

    type: Literal["adaptive"]
    display: Literal["summarized", "omitted"] | None = None


Thinking = Annotated[ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive, Field(discriminator="type")]


class JsonOutputFormat(_Closed):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Closed):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    # The template's reasoning_effort; the two levels above high have no counterpart there and
    # are taken as high (counted: client_fields.py).
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonOutputFormat | None = None


class InputTokens(_Closed):
    type: Literal["input_tokens"]
    value: Annotated[int, Field(ge=0, le=UINT32_MAX), Integral]


class ToolUses(_Closed):
    type: Literal["tool_uses"]
    value: Annotated[int, Field(ge=0, le=UINT32_MAX), Integral]


class ClearToolUses(_Closed):
    """Anthropic's tool result clearing: past `trigger`, the oldest tool results (and with
    `clear_tool_inputs` their calls' inputs) give way to a placeholder, all but the last `keep`."""

    type: Literal["clear_tool_uses_20250919"]
    trigger: Annotated[InputTokens | ToolUses, Field(discriminator="type")] | None = None
    keep: ToolUses | None = None
    clear_at_least: InputTokens | None = None
    exclude_tools: list[FunctionName] | None = None
    clear_tool_inputs: bool | list[FunctionName] | None = None


class ThinkingTurns(_Closed):
    type: Literal["thinking_turns"]
    value: Annotated[int, Field(ge=1, le=UINT32_MAX), Integral]


class ClearThinking(_Closed):
    """Anthropic's thinking clearing: the thinking of all but the last `keep` assistant turns
    that have some is dropped (`all`: none is)."""

    type: Literal["clear_thinking_20251015"]
    keep: ThinkingTurns | Literal["all"] | None = None


ContextEdit = Annotated[ClearToolUses | ClearThinking, Field(discriminator="type")]


class ContextManagement(_Closed):
    edits: Annotated[list[ContextEdit], Field(max_length=8)] = []


class CountTokensRequest(BaseModel):
    """What `/v1/messages/count_tokens` takes: the prompt of a message, without sampling."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: Annotated[str, Field(min_length=1), AfterValidator(valid_unicode)]
    messages: Annotated[list[MessageIn], Field(min_length=1)]
    system: Text | list[TextBlock] | None = None
    tools: Annotated[list[CustomTool], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    # The structured-outputs beta's name for output_config.format, which some clients still send.
    output_format: JsonOutputFormat | None = None
    cache_control: CacheControl | None = None
    context_management: ContextManagement | None = None


class MessagesRequest(CountTokensRequest):
    """`POST /v1/messages`: a message to generate, whole or streamed."""

    max_tokens: TokenCount
    metadata: Metadata | None = None
    stop_sequences: Annotated[list[StopText], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    # Anthropic's range, narrower than OpenAI's 0-2.
    temperature: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = None
    top_p: UnitFloat | None = None
    top_k: Annotated[int, Field(ge=0, le=INT32_MAX), Integral] | None = None
    service_tier: Literal["auto", "standard_only"] | None = None


def parse_messages(model: type[CountTokensRequest], body: object) -> CountTokensRequest:
    """The validated request, or a 400 whose message opens with the offending field's path."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    refuse_unsupported(body)
    try:
        req = model.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        telling = [e for e in errors if e["type"] not in _TYPE_ERRORS] or errors
        # The deepest error: inside `content: str | list[block]`, a list's error in a block is the
        # one to name, not the str branch's "not a string".
        error = max(telling, key=lambda e: len(e["loc"]))
        param = _param(error["loc"])
        raise refused(param, error["msg"], "invalid_value") from None
    if isinstance(req, MessagesRequest) and isinstance(req.thinking, ThinkingEnabled) \
            and req.thinking.budget_tokens >= req.max_tokens:
        raise refused("thinking.budget_tokens", "must be less than max_tokens", "invalid_value")
    return req


# As schemas.py: the error that passed the type check says more than a union's type mismatches.
_TYPE_ERRORS = frozenset({"string_type", "int_type", "float_type", "bool_type", "list_type", "dict_type",
                          "model_type", "none_required", "literal_error", "model_attributes_type"})
_TAGS = BLOCK_TYPES | {"auto", "any", "tool", "none", "enabled", "disabled", "adaptive", "tool_reference",
                      "clear_tool_uses_20250919", "clear_thinking_20251015", "input_tokens", "tool_uses"}


def _param(loc: tuple[int | str, ...]) -> str | None:
    """`messages.0.content.1.input`: field names and indexes, without pydantic's union tags
    (a discriminated union's tag follows the index or field it chose for)."""
    parts: list[str] = []
    tag_dropped = False  # one tag per choice: a field named as its block's tag (`text`) stays
    for p in loc:
        if isinstance(p, str) and (any(c in p for c in "[(") or p in {"str", "int", "float", "bool", "none"}
                                   or p[:1].isupper()):  # a union member's class name (field names are lower case)
            continue
        if (isinstance(p, str) and p in _TAGS and not tag_dropped and parts and parts[-1] not in ("type",)
                and _is_tagged(parts[-1])):
            tag_dropped = True
            continue
        tag_dropped = False
        parts.append(str(p))
    return ".".join(parts) or None


def _is_tagged(previous: str) -> bool:
    """Whether the part before is where a discriminated union chose (a list index, or one of
    the fields whose value is such a union)."""
    return previous.isdigit() or previous in ("tool_choice", "thinking", "trigger")
