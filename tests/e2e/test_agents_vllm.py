"""What agents send, on vLLM with the demo model and the official client: tool calls, structured
outputs and logit bias are enforced by the engine, so even random weights give valid results."""

from __future__ import annotations

import json

import jsonschema
import openai
import pydantic
import pytest

from tests.e2e.test_agents_api import WEATHER

pytestmark = pytest.mark.vllm
MODEL = "kvmesh-demo"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# Bounded so that even random weights finish it well within max_tokens.
REPORT = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "rain": {"type": "boolean"}},
          "required": ["unit", "rain"], "additionalProperties": False}
CITY_ENUM = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
             "additionalProperties": False}
TOOL = {"type": "function", "function": {**WEATHER["function"], "parameters": CITY_ENUM}}


def _streamed_calls(stream) -> tuple[dict[int, dict], str | None]:  # noqa: ANN001
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for c in choice.delta.tool_calls or ():
            call = calls.setdefault(c.index, {"id": None, "name": None, "arguments": ""})
            if c.id:
                assert call["id"] is None, "a call's id comes once"
                call["id"] = c.id
            if c.function and c.function.name:
                call["name"] = c.function.name
            call["arguments"] += (c.function.arguments or "") if c.function else ""
    return calls, finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_forced_tool_calls_validate_and_stream_the_same(vllm_client: openai.OpenAI, tool_choice: object) -> None:
    kwargs = dict(model=MODEL, messages=ASK, tools=[TOOL], tool_choice=tool_choice, max_tokens=60, temperature=0,
                  extra_body={"ignore_eos": False})
    whole = vllm_client.chat.completions.create(**kwargs)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls, choice.message
    for call in choice.message.tool_calls:
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), CITY_ENUM)
    calls, finish = _streamed_calls(vllm_client.chat.completions.create(stream=True, **kwargs))
    assert finish == "tool_calls"
    # Another request, so other call ids; the same calls.
    assert all(c["id"] and c["id"].startswith("call_") for c in calls.values())
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_a_strict_json_schema_is_enforced_whole_and_streamed(vllm_client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "report", "schema": REPORT, "strict": True}}
    kwargs = dict(model=MODEL, messages=ASK, response_format=fmt, max_tokens=60, temperature=0)
    whole = vllm_client.chat.completions.create(**kwargs).choices[0].message.content
    jsonschema.validate(json.loads(whole), REPORT)
    streamed = "".join(c.choices[0].delta.content or "" for c in vllm_client.chat.completions.create(stream=True, **kwargs)
                       if c.choices)
    assert streamed == whole


def test_structured_outputs_regex_and_choice(vllm_client: openai.OpenAI) -> None:
    regex = vllm_client.completions.create(model=MODEL, prompt="code:", max_tokens=12, temperature=0,
                                           extra_body={"structured_outputs": {"regex": "[a-c]{3}-[0-9]{2}"}})
    assert regex.choices[0].text[:3].strip("abc") == "" and regex.choices[0].text[3] == "-"
    picked = vllm_client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0,
                                                 extra_body={"structured_outputs": {"choice": ["sunny", "rainy"]}})
    assert picked.choices[0].message.content in ("sunny", "rainy")


def test_the_client_parses_into_a_pydantic_model(vllm_client: openai.OpenAI) -> None:
    class Report(pydantic.BaseModel):
        unit: bool
        rain: bool

    parsed = vllm_client.chat.completions.parse(model=MODEL, messages=ASK, response_format=Report, max_tokens=60,
                                                temperature=0)
    assert isinstance(parsed.choices[0].message.parsed, Report)


def test_logit_bias_of_100_on_one_token_makes_greedy_pick_only_it(vllm_client: openai.OpenAI) -> None:
    plain = vllm_client.completions.create(model=MODEL, prompt="The weather", max_tokens=6, temperature=0,
                                           extra_body={"return_tokens_as_token_ids": False})
    biased = vllm_client.completions.create(model=MODEL, prompt="The weather", max_tokens=6, temperature=0,
                                            logit_bias={"300": 100}, logprobs=0)
    tokens = biased.choices[0].logprobs.tokens
    assert len(tokens) == 6 and len(set(tokens)) == 1, tokens
    assert biased.choices[0].text != plain.choices[0].text


def test_penalties_reach_the_engine(vllm_client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, prompt="one one one one", max_tokens=24, temperature=0)
    plain = vllm_client.completions.create(**kwargs).choices[0].text
    penalised = vllm_client.completions.create(frequency_penalty=2.0, presence_penalty=2.0, **kwargs).choices[0].text
    assert penalised != plain


def test_the_responses_api_calls_a_tool_on_vllm(vllm_client: openai.OpenAI) -> None:
    tool = {"type": "function", "name": "get_weather", "parameters": CITY_ENUM, "strict": True}
    response = vllm_client.responses.create(model=MODEL, input="Weather in Oslo?", tools=[tool],
                                            tool_choice="required", max_output_tokens=60, temperature=0)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and all(c.name == "get_weather" for c in calls), response.output
    jsonschema.validate(json.loads(calls[0].arguments), CITY_ENUM)
    events = list(vllm_client.responses.create(model=MODEL, input="Weather in Oslo?", tools=[tool],
                                               tool_choice="required", max_output_tokens=60, temperature=0,
                                               stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [d.arguments for d in done] == [c.arguments for c in calls]
