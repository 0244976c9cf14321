"""What agents send, on the mocker mesh: every field the mesh cannot honour is a 400 naming it,
tools reach the chat template, and the Responses API answers; the output parsers in-process.

The same requests on vLLM, where they are honoured, are in test_agents_vllm.py."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from gen.kvmesh.v1 import common_pb2, processor_pb2
from services.contract.json_value import to_json_value
from services.mesh.channels import ChannelPool
from services.routing.router_client import RouteChoice
from services.mesh.session_client import SessionPool
from services.processor.choice_stream import ChoiceContext, ChoiceFailure, ChoiceLimits, ChoiceSpec, ChoiceStream
from services.processor.output_parsers import OutputParsers, Parsed, call_id
from services.processor.tokenizer import ModelTokenizer
from services.tools.make_demo_model import ensure_demo_model
from tests.procs import Mesh

MODEL = "kvmesh-demo"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
HI = [{"role": "user", "content": "hi"}]

REFUSED = [
    # The mocker's tokens are not sampled: whatever reshapes a distribution is refused by name.
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"min_p": 0.1}, "min_p"),
    ({"logit_bias": {"5": 100}}, "logit_bias"),
    ({"bad_words": ["x"]}, "bad_words"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"structured_outputs": {"regex": "[ab]+"}}, "structured_outputs"),
    ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),
    # Refused on any engine.
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"functions": [WEATHER["function"]]}, "functions"),
    ({"store": True}, "store"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                                {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     "messages.0.content.1"),
    # Malformed agent fields.
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}, "extra": 1}}]},
     "tools.0.function.extra"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ({"continue_final_message": True}, "continue_final_message"),
    # Past the end of the structure the engine would generate free text.
    ({"ignore_eos": True, "structured_outputs": {"regex": "[ab]+"}}, "ignore_eos"),
    ({"ignore_eos": True, "tools": [WEATHER], "tool_choice": "required"}, "ignore_eos"),
]


@pytest.mark.parametrize("fields, param", REFUSED, ids=[p for _, p in REFUSED])
def test_a_field_the_mesh_cannot_honour_is_a_400_naming_it(mocker_mesh: Mesh, fields: dict, param: str) -> None:
    body = {"model": MODEL, "messages": HI, "max_tokens": 4, **fields}
    r = httpx.post(f"{mocker_mesh.base_url}/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_completions_refuse_what_the_mocker_cannot_sample_and_what_no_engine_implements(mocker_mesh: Mesh) -> None:
    for fields, param in (({"frequency_penalty": 1.0}, "frequency_penalty"), ({"suffix": "x"}, "suffix"),
                          ({"best_of": 3}, "best_of")):
        r = httpx.post(f"{mocker_mesh.base_url}/completions",
                       json={"model": MODEL, "prompt": "a", "max_tokens": 2, **fields}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_tools_are_rendered_by_the_chat_template(mocker_client: openai.OpenAI) -> None:
    question = [{"role": "user", "content": "weather in Paris?"}]
    bare = mocker_client.chat.completions.create(model=MODEL, messages=question, max_tokens=2)
    tooled = mocker_client.chat.completions.create(model=MODEL, messages=question, max_tokens=2, tools=[WEATHER])
    assert tooled.usage.prompt_tokens > bare.usage.prompt_tokens + 20
    # Without a --tool-call-parser the text stays content; tool_choice none asks for nothing more.
    assert tooled.choices[0].message.tool_calls is None and tooled.choices[0].message.content
    history = question + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"}]
    answered = mocker_client.chat.completions.create(model=MODEL, messages=history, max_tokens=2, tools=[WEATHER],
                                                     tool_choice="none")
    assert answered.usage.prompt_tokens > tooled.usage.prompt_tokens


def test_the_responses_api_answers_whole_and_streamed(mocker_client: openai.OpenAI, mocker_mesh: Mesh) -> None:
    whole = mocker_client.responses.create(model=MODEL, input="hello there", instructions="be brief",
                                           max_output_tokens=6)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.output_text and whole.usage.output_tokens == 6
    events = list(mocker_client.responses.create(model=MODEL, input="hello there", instructions="be brief",
                                                 max_output_tokens=6, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text
    for fields, param in (({"store": True}, "store"), ({"previous_response_id": "resp_1"}, "previous_response_id"),
                          ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                           "input.0.content.0.image_url")):
        r = httpx.post(f"{mocker_mesh.base_url}/responses", json={"model": MODEL, "input": "hi", **fields}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# -- the output parsers, in-process ---------------------------------------------------------------

RECORDED = 'Let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def _chat_request(mode: int, function: str = "") -> processor_pb2.GenerateRequest:
    request = processor_pb2.GenerateRequest(request_id="r1")
    weather = WEATHER["function"]
    request.chat.tools.add(name=weather["name"], description=weather["description"],
                           parameters=to_json_value(weather["parameters"]))
    request.chat.tool_choice.mode = mode
    request.chat.tool_choice.function = function
    return request


def _run(parser, pieces: list[str]) -> tuple[str, dict[int, list[str]], dict[int, str]]:  # noqa: ANN001
    content, args, names = [], {}, {}
    outs = [parser.push(p, [1]) for p in pieces] + [parser.finish()]
    for out in outs:
        assert isinstance(out, Parsed)
        content.append(out.content)
        for c in out.calls:
            args.setdefault(c.index, []).append(c.arguments)
            if c.name:
                assert c.index not in names, "a call's name comes once"
                names[c.index] = c.name
    return "".join(content), args, names


@pytest.fixture(scope="module")
def tokenizer() -> ModelTokenizer:
    return ModelTokenizer(str(ensure_demo_model()))


@pytest.mark.parametrize("size", [1, 3, 7, len(RECORDED)])
def test_a_recorded_hermes_tool_call_is_parsed_however_it_is_split(tokenizer: ModelTokenizer, size: int) -> None:
    factory = OutputParsers(tokenizer.hf, "hermes").for_request(_chat_request(processor_pb2.ToolChoice.MODE_AUTO))
    assert factory is not None
    parser = factory("r1", 0)
    content, args, names = _run(parser, [RECORDED[i:i + size] for i in range(0, len(RECORDED), size)])
    assert parser.called
    assert content.strip() == "Let me look."
    assert names == {0: "get_weather"}
    assert json.loads("".join(args[0])) == {"city": "Paris"}


def test_forced_tool_calls_come_whole_or_in_pieces_with_ids_that_survive_a_takeover(tokenizer: ModelTokenizer) -> None:
    parsers = OutputParsers(tokenizer.hf)
    required = parsers.for_request(_chat_request(processor_pb2.ToolChoice.MODE_REQUIRED))("r1", 2)
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    _, args, names = _run(required, [text[:9], text[9:]])
    assert names == {0: "get_weather"} and json.loads("".join(args[0])) == {"city": "Oslo"}
    named = parsers.for_request(_chat_request(processor_pb2.ToolChoice.MODE_NAMED, "get_weather"))("r1", 2)
    first = named.push('{"city"', [1])
    assert first.calls[0].id == call_id("r1", 2, 0) and first.calls[0].name == "get_weather"
    _, args, names = _run(named, [': "Rome"}'])
    assert "".join(args[0]) == ': "Rome"}' and not names
    # Cut short by max_tokens: the text as content, never half a call.
    cut = parsers.for_request(_chat_request(processor_pb2.ToolChoice.MODE_REQUIRED))("r1", 0)
    content, args, _ = _run(cut, ['[{"name": "get_wea'])
    assert content == '[{"name": "get_wea' and not args and not cut.called
    assert parsers.for_request(_chat_request(processor_pb2.ToolChoice.MODE_NONE)) is None


async def _never_routes(rid: str, tokens: list[int], tried: list[str]) -> RouteChoice:
    raise AssertionError("no worker may be asked")


async def test_a_structured_choice_is_not_taken_over_mid_output(tokenizer: ModelTokenizer) -> None:
    """Its grammar would start again on the next worker: an error, never invalid output."""
    sampling = common_pb2.SamplingParams(max_tokens=8, structured=common_pb2.StructuredOutput(json_object=True))
    channels = ChannelPool()
    choice = ChoiceStream(spec=ChoiceSpec("r", 0, [5, 6], sampling, []),
                          ctx=ChoiceContext(tokenizer, SessionPool(channels), ChoiceLimits(10, 3, 3), _never_routes,
                                            lambda w: None, lambda: None))
    with pytest.raises(ChoiceFailure, match="structured-output"):
        async for _ in choice.run(RouteChoice("w1", "127.0.0.1:1", 0, 0.0, 0), [94, 5]):
            pass
    await channels.close()


def test_a_parser_the_model_cannot_use_is_refused_at_start_with_one_line(tokenizer: ModelTokenizer) -> None:
    from services.config_error import ConfigError

    with pytest.raises(ConfigError, match="--tool-call-parser 'nope' is not one of vLLM's"):
        OutputParsers(tokenizer.hf, "nope")
    # The demo tokenizer has no <think> token for this parser to find.
    with pytest.raises(ConfigError, match="--reasoning-parser 'deepseek_r1' cannot read this model's output"):
        OutputParsers(tokenizer.hf, reasoning_parser="deepseek_r1")


def test_reasoning_is_split_from_the_answer_by_vllms_parser() -> None:
    """The demo tokenizer with the markers a reasoning model's has (`<think>`, `</think>`)."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(ensure_demo_model()))
    hf.add_tokens(["<think>", "</think>"], special_tokens=True)
    request = processor_pb2.GenerateRequest(request_id="r1")
    request.chat.messages.add(role="user", content="hi")
    factory = OutputParsers(hf, reasoning_parser="deepseek_r1").for_request(request)
    assert factory is not None
    parser = factory("r1", 0)
    reasoning, content = [], []
    for piece in ("<think>", "the user", " says hi", "</think>", "Hello", " there"):
        out = parser.push(piece, hf.encode(piece, add_special_tokens=False))
        reasoning.append(out.reasoning)
        content.append(out.content)
    assert "".join(reasoning) == "the user says hi"
    assert "".join(content) == "Hello there"
