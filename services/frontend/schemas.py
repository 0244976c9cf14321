"""Request bodies of the OpenAI API, validated strictly but accepting what official clients send.

OpenAI fields the mesh does not implement are refused by name (agent_schemas.REFUSED); fields
nobody defined are accepted and ignored (clients send `user`, `metadata`, ...); known fields
must have the right JSON type (strict mode: "5" is not an integer, `true` is not 1; 16.0 is the
integer 16, as in JSON Schema) and a value that fits where it goes: every number is bounded by
the protobuf field that carries it (uint32 token counts and ids, int32 top_k, int64 seed), floats
must be finite, strings valid Unicode. Anything else is a 400 naming the field, never an error
further in.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, ValidationError
from pydantic_core import ErrorDetails

from services.frontend.agent_schemas import (
    REFUSED,
    Bias,
    NamedToolChoice,
    Penalty,
    ResponseFormat,
    StructuredOutputsIn,
    Text,
    Tool,
    ToolChoiceIn,
    valid_unicode,
)
from services.frontend.errors import ApiError
from services.frontend.images import ImageRef
from services.contract.request_limits import INT64_MAX, MAX_LOGPROBS, MAX_N, MAX_STOP_CHARS, MAX_STOP_STRINGS, UINT32_MAX

INT32_MAX = 2**31 - 1
INT64_MIN = -(2**63)
# Prompts in one completions request, and the streams (prompts x n) it may open.
MAX_PROMPTS = 64
MAX_STREAMS = 128


def _integral(value: object) -> object:
    """JSON has one number type: 16.0 is the integer 16 (JSON Schema agrees); 16.5 stays a float
    and fails the strict integer check."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# The bounds go before the validator, so they show in the JSON schema as minimum/maximum.
Integral = BeforeValidator(_integral)
StopText = Annotated[str, Field(max_length=MAX_STOP_CHARS), AfterValidator(valid_unicode)]
TokenCount = Annotated[int, Field(ge=1, le=UINT32_MAX), Integral]
TokenId = Annotated[int, Field(ge=0, le=UINT32_MAX), Integral]
UnitFloat = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class ImageUrl(_Strict):
    # A data: URL, or an http(s) URL under an allowed prefix (images.py).
    url: Annotated[str, Field(min_length=1)]
    # OpenAI's resolution hint: the model's own processor decides the resolution here.
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageUrl


def _part_kind(part: object) -> str:
    kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
    return "image-part" if kind == "image_url" else "text-part"


# A content part: text or an image (every other type was refused by name before validation). The
# tags hold a dash, so an error's `param` leaves them out (`_is_union_tag`).
ContentPart = Annotated[Annotated[TextPart, Tag("text-part")] | Annotated[ImagePart, Tag("image-part")],
                        Discriminator(_part_kind)]


class CalledFunction(_Strict):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: Text
    arguments: Text


class ToolCallIn(_Strict):
    model_config = ConfigDict(extra="forbid", strict=True)
    id: Text
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessageIn(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: Text | None = None
    # An earlier answer's reasoning, for templates that render it (vLLM's name, and the newer one).
    reasoning_content: Text | None = None
    reasoning: Text | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    def images(self) -> list[tuple[int, str]]:
        """Its image parts: (part index, URL)."""
        if not isinstance(self.content, list):
            return []
        return [(j, part.image_url.url) for j, part in enumerate(self.content) if isinstance(part, ImagePart)]


class GenerationRequest(_Strict):
    model: Annotated[str, Field(min_length=1), AfterValidator(valid_unicode)]
    max_tokens: TokenCount | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] | None = None
    top_p: UnitFloat | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX), Integral] | None = None
    seed: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX), Integral] | None = None
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOP_STRINGS)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N), Integral] = 1
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0, le=UINT32_MAX), Integral] = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0, allow_inf_nan=False)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = None
    # Token id (as a JSON object key) -> bias.
    logit_bias: dict[Annotated[str, Field(pattern=r"^[0-9]{1,10}$")], Bias] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=256)] | None = None
    bad_words: Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS),
                                        AfterValidator(valid_unicode)]],
                         Field(max_length=256)] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsIn | None = None
    # vLLM's: lower is served sooner (the mesh's queue bands; services/routing/admission/).
    priority: Annotated[int, Field(ge=-(2**31), le=INT32_MAX), Integral] | None = None
    # OpenAI's end-user id: the agent session's id with --session-from-user (frontend/sessions.py).
    user: Annotated[str, Field(max_length=256), AfterValidator(valid_unicode)] | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def streams(self) -> int:
        """How many generation streams the request opens: what it weighs against --max-inflight."""
        return self.n

    def token_limit(self) -> int | None:
        """The most tokens to generate per choice; None: as many as the context leaves room for."""
        return self.max_tokens

    def logprobs_k(self) -> int | None:
        """Alternatives to report per token (0: only the chosen one's); None: no logprobs."""
        raise NotImplementedError

    def check_combined(self) -> None:
        """Rules across fields (pydantic names no single field for them): 400 naming the later one."""
        if any(int(token) > UINT32_MAX for token in self.logit_bias or ()):
            raise _invalid("logit_bias", "logit_bias keys must be token ids (at most 4294967295)")
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_schema" and fmt.json_schema is None:
            raise _invalid("response_format.json_schema", "response_format of type json_schema needs `json_schema`")
        if self.structured_outputs is not None:
            kinds = self.structured_outputs.kinds()
            if len(kinds) != 1:
                raise _invalid("structured_outputs", f"structured_outputs needs exactly one of json, regex, choice, "
                                                     f"grammar, json_object; got {kinds or 'none'}")
            if fmt is not None and fmt.type != "text":
                raise _invalid("structured_outputs", "send either response_format or structured_outputs, not both")
        if self.ignore_eos and self.constrained():
            # Once the grammar is complete the engine stops constraining, so generating past the
            # end of the structure would append free text: an invalid answer.
            raise _invalid("ignore_eos", "ignore_eos cannot be combined with structured outputs or a forced tool "
                                         "call: output past the end of the structure would be unconstrained")

    def constrained(self) -> bool:
        """Whether the output must follow a grammar."""
        return self.structured_outputs is not None or (self.response_format is not None
                                                       and self.response_format.type != "text")


class ChatCompletionRequest(GenerationRequest):
    messages: Annotated[list[ChatMessageIn], Field(min_length=1)]
    max_completion_tokens: TokenCount | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), Integral] | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: ToolChoiceIn | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # For reasoning models whose template takes it (passed to the template like chat_template_kwargs).
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None

    def image_refs(self) -> list[ImageRef]:
        """Every image part, in prompt order."""
        return [ImageRef((i, j), url) for i, m in enumerate(self.messages) for j, url in m.images()]

    def check_combined(self) -> None:
        super().check_combined()
        for i, message in enumerate(self.messages):
            if message.role != "user" and message.images():
                raise _invalid(f"messages.{i}.content.{message.images()[0][0]}",
                               "image parts are taken in user messages only")
        if self.top_logprobs and not self.logprobs:
            raise _invalid("top_logprobs", "top_logprobs requires logprobs to be true")
        self._check_tools()
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise _invalid("continue_final_message", "continue_final_message needs add_generation_prompt: false")
            if self.messages[-1].role != "assistant":
                raise _invalid("continue_final_message", "continue_final_message needs a last assistant message")

    def _check_tools(self) -> None:
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not self.tools:
            raise _invalid("tool_choice", "tool_choice requires `tools`")
        if isinstance(choice, NamedToolChoice):
            names = {t.function.name for t in self.tools or []}
            if choice.function.name not in names:
                raise _invalid("tool_choice", f"tool_choice names {choice.function.name!r}, which is not in `tools`")
        if self.forces_tool_call() and super().constrained():
            raise _invalid("tool_choice", "a required or named tool_choice cannot be combined with response_format "
                                          "or structured_outputs: the tool's schema constrains the output")

    def forces_tool_call(self) -> bool:
        return bool(self.tools) and (self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice))

    def constrained(self) -> bool:
        return super().constrained() or self.forces_tool_call()

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


TokenList = Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(GenerationRequest):
    prompt: (Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)] | TokenList
             | Annotated[list[TokenList], Field(min_length=1, max_length=MAX_PROMPTS)])
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), Integral] | None = None
    echo: Literal[False] = False
    # OpenAI's default for the legacy completions endpoint.
    max_tokens: TokenCount | None = 16

    def check_combined(self) -> None:
        super().check_combined()
        if self.streams() > MAX_STREAMS:
            raise _invalid("n", f"{self._prompt_count()} prompts x n={self.n} would open {self.streams()} "
                                f"completions; at most {MAX_STREAMS} are allowed per request")

    def streams(self) -> int:
        return self._prompt_count() * self.n

    def logprobs_k(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str) or self._is_one_id_list():
            return [self.prompt]  # type: ignore[list-item]
        return list(self.prompt)  # type: ignore[arg-type]

    def _is_one_id_list(self) -> bool:
        # Validated, so a list is all ids, all strings or all id lists: its first item tells which
        # (without a pass over a prompt of a million ids).
        return isinstance(self.prompt, list) and isinstance(self.prompt[0], int)

    def _prompt_count(self) -> int:
        return 1 if isinstance(self.prompt, str) or self._is_one_id_list() else len(self.prompt)


def parse(model: type[GenerationRequest], body: object) -> GenerationRequest:
    """The validated request, or a 400 naming the first offending field (`param`)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    refuse_unsupported(body)
    try:
        req = model.model_validate(body)
    except ValidationError as exc:
        error = _most_telling(exc)
        param = _param(error["loc"])
        raise _invalid(param, f"invalid field {param}: {error['msg']}") from None
    req.check_combined()
    return req


def refuse_unsupported(body: dict) -> None:
    """A 400 naming an OpenAI field the mesh cannot honour (REFUSED), or a non-text content part:
    checked before validation, so the error names the real cause, not a missing `text`."""
    for name, (reason, refuses) in REFUSED.items():
        if name in body and (refuses is None or refuses(body[name])):
            raise ApiError(400, reason, param=name, code="unsupported_parameter")
    messages = body.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind not in ("text", "image_url"):
                raise ApiError(400, f"content parts of type {kind[:40]!r} are not supported: text and image_url "
                                    f"parts are", param=f"messages.{i}.content.{j}", code="unsupported_content")


def _invalid(param: str | None, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


# pydantic reports a type mismatch in every member of a union (`prompt` is a string, a list of
# strings, a list of ids or a list of lists); the error that passed the type check says more.
_TYPE_ERRORS = frozenset({"string_type", "int_type", "float_type", "bool_type", "list_type", "dict_type",
                          "model_type", "none_required", "literal_error", "is_instance_of", "model_attributes_type"})


def _most_telling(exc: ValidationError) -> ErrorDetails:
    errors = exc.errors(include_url=False, include_input=False)
    return next((e for e in errors if e["type"] not in _TYPE_ERRORS), errors[0])


def _param(loc: tuple[int | str, ...]) -> str | None:
    """`messages.0.content`: field names and list indexes, without pydantic's union-member tags."""
    parts = [str(p) for p in loc if isinstance(p, int) or not _is_union_tag(p)]
    return ".".join(parts) or None


def _is_union_tag(part: str) -> bool:
    return any(c in part for c in "[(-") or part in {"str", "int", "float", "bool", "none", "nullable"}
