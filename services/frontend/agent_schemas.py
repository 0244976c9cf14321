"""What agents send beside the prompt: tools, structured outputs, penalties, template options.

Every object here forbids fields it does not know: inside `tools` or `response_format` an unknown
key changes what the model is asked to do, so dropping it would be a silent wrong answer. OpenAI
fields the mesh does not implement at all are refused by name (`REFUSED`), as a 400 whose `param`
is the field; fields nobody defined still pass at the top level (vendor extensions; the README
lists the ones known to be ignored).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from gen.kvmesh.v1 import common_pb2, processor_pb2



# Effort levels above the highest a chat template knows (`reasoning_effort` high): Anthropic's
# xhigh and max, OpenAI's xhigh, served as high.
ABOVE_HIGH_EFFORTS = frozenset({"xhigh", "max"})


def template_effort(level: str) -> str:
    """A client's effort level as the template's `reasoning_effort`."""
    return "high" if level in ABOVE_HIGH_EFFORTS else level


def valid_unicode(value: str) -> str:
    """JSON may escape a lone surrogate (\\ud800); no UTF-8 wire format can carry one."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode text (it has an unpaired surrogate escape)") from None
    return value


Text = Annotated[str, AfterValidator(valid_unicode)]
FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]

# OpenAI fields that would change the answer but that the mesh does not implement: each is a
# 400 naming it, never a silent drop. A value of None refuses the field whatever its value; a
# callable refuses only the values it returns True for (`store: false` asks for nothing).
REFUSED: dict[str, tuple[str, Any]] = {
    "audio": ("audio output is not supported: this mesh serves text models", None),
    "prediction": ("predicted outputs are not supported", None),
    "web_search_options": ("web search is not supported", None),
    "functions": ("the legacy `functions` field is not supported; send `tools`", None),
    "function_call": ("the legacy `function_call` field is not supported; send `tool_choice`", None),
    "modalities": ("only text output is supported", lambda v: v not in (["text"], None)),
    "store": ("stored completions are not supported (the mesh keeps no responses); send store: false",
              lambda v: v not in (False, None)),
    "verbosity": ("`verbosity` is not supported", None),
    "suffix": ("`suffix` (insertion) is not supported", None),
    "best_of": ("`best_of` is not supported; use `n`", lambda v: v not in (None, 1)),
    **{name: (f"`{name}` was removed from vLLM's API; send `structured_outputs`", None)
       for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
                    "guided_whitespace_pattern")},
}


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class FunctionDef(_Closed):
    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Closed):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Closed):
    name: FunctionName


class NamedToolChoice(_Closed):
    type: Literal["function"]
    function: NamedFunction


ToolChoiceIn = Literal["none", "auto", "required"] | NamedToolChoice


class JsonSchemaFormat(_Closed):
    name: FunctionName
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Closed):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsIn(_Closed):
    """vLLM's `structured_outputs`: exactly one constraint."""

    json_: dict[str, Any] | Text | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: Annotated[list[Text], Field(min_length=1)] | None = None
    grammar: Text | None = None
    json_object: bool | None = None

    def kinds(self) -> list[str]:
        return [k for k, v in (("json", self.json_), ("regex", self.regex), ("choice", self.choice),
                               ("grammar", self.grammar), ("json_object", self.json_object)) if v is not None]


def structured_from_format(fmt: ResponseFormat) -> common_pb2.StructuredOutput | None:
    """`response_format` as a constraint; None for plain text."""
    if fmt.type == "json_object":
        return common_pb2.StructuredOutput(json_object=True, param="response_format")
    if fmt.type == "json_schema":
        assert fmt.json_schema is not None  # checked by the request
        schema = fmt.json_schema.schema_ if fmt.json_schema.schema_ is not None else {"type": "object"}
        return common_pb2.StructuredOutput(json_schema=json.dumps(schema), param="response_format")
    return None


def structured_from_vllm(so: StructuredOutputsIn) -> common_pb2.StructuredOutput:
    out = common_pb2.StructuredOutput(param="structured_outputs")
    if so.json_ is not None:
        out.json_schema = so.json_ if isinstance(so.json_, str) else json.dumps(so.json_)
    elif so.regex is not None:
        out.regex = so.regex
    elif so.choice is not None:
        out.choice.choices.extend(so.choice)
    elif so.grammar is not None:
        out.grammar = so.grammar
    else:
        out.json_object = True
    return out


def tool_choice_of(choice: ToolChoiceIn | None, parallel: bool | None) -> processor_pb2.ToolChoice:
    out = processor_pb2.ToolChoice(parallel=parallel is not False)
    if isinstance(choice, NamedToolChoice):
        out.mode = processor_pb2.ToolChoice.MODE_NAMED
        out.function = choice.function.name
    elif choice == "none":
        out.mode = processor_pb2.ToolChoice.MODE_NONE
    elif choice == "required":
        out.mode = processor_pb2.ToolChoice.MODE_REQUIRED
    return out
