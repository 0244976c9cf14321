"""Bad input over HTTP gets the status docs/reference.md gives and OpenAI's error body, never a 500, and the mesh
serves on. Besides the hand-picked cases, `NASTY` is a fixed corpus of hostile bodies (numbers past
their protobuf field's width, NaN, deep nesting, lone surrogates, too many prompts or stop strings,
prompts that can never fit): each must be a 4xx naming the right field."""

from __future__ import annotations

import json
from dataclasses import dataclass

import httpx
import pytest

from tests.procs import Mesh
from tests.e2e.bad_input import (
    completion,
    MODEL,
    MSG,
    assert_error,
    assert_still_serving,
    inflight_returns_to_zero,
    mesh_metrics_url,
    post,
)


@pytest.mark.parametrize("path", ["/chat/completions", "/completions"])
def test_malformed_json_is_400(mocker_mesh: Mesh, path: str) -> None:
    assert_error(post(mocker_mesh, path, '{"model": "kvmesh-demo", "prompt": '), 400)
    assert_error(post(mocker_mesh, path, b"\xff\xfe not utf-8"), 400)
    assert_error(post(mocker_mesh, path, "[1, 2, 3]"), 400)
    assert_still_serving(mocker_mesh)


@pytest.mark.parametrize("body, param", [
    ({"model": MODEL, "messages": "hello"}, "messages"),
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": "5"}, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -3}, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stop": 5}, "stop"),
    ({"model": 42, "messages": [{"role": "user", "content": "x"}]}, "model"),
])
def test_chat_fields_of_the_wrong_type_or_range_are_400_with_the_param(mocker_mesh: Mesh, body: dict, param: str) -> None:
    error = assert_error(post(mocker_mesh, "/chat/completions", json.dumps(body)), 400)
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"


@dataclass(frozen=True)
class Nasty:
    """One hostile body: where it goes, the status it must get, and the `param` or message it must name."""

    name: str
    path: str
    body: str | bytes
    status: int = 400
    param: str | None = None
    says: str = ""


def chat(**fields: object) -> str:
    return json.dumps({"model": MODEL, "messages": MSG, **fields})


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


NASTY = [
    # Integers past the width of the protobuf field that carries them.
    Nasty("max_tokens past uint64", "/completions", completion(max_tokens=99999999999999), param="max_tokens"),
    Nasty("max_tokens past uint32", "/completions", completion(max_tokens=2**32), param="max_tokens"),
    Nasty("max_tokens at uint32 max exceeds the context", "/completions", completion(max_tokens=2**32 - 1),
          says="context length"),
    Nasty("max_completion_tokens past uint32", "/chat/completions", chat(max_completion_tokens=2**32),
          param="max_completion_tokens"),
    Nasty("min_tokens past uint32", "/completions", completion(min_tokens=2**40), param="min_tokens"),
    Nasty("min_tokens above max_tokens", "/completions", completion(min_tokens=10, max_tokens=5), says="min_tokens"),
    Nasty("seed past int64", "/completions", completion(seed=2**63), param="seed"),
    Nasty("seed below int64", "/chat/completions", chat(seed=-(2**63) - 1), param="seed"),
    Nasty("seed + n overflows int64", "/completions", completion(seed=2**63 - 1, n=2), says="seed"),
    Nasty("top_k past int32", "/completions", completion(top_k=2**31), param="top_k"),
    Nasty("top_k below -1", "/chat/completions", chat(top_k=-2), param="top_k"),
    Nasty("logprobs past 20", "/completions", completion(logprobs=21), param="logprobs"),
    Nasty("top_logprobs without logprobs", "/chat/completions", chat(top_logprobs=2), param="top_logprobs"),
    Nasty("n past 128", "/chat/completions", chat(n=129), param="n"),
    Nasty("token id past uint32", "/completions", completion(prompt=[1, 2**32]), param="prompt.1"),
    Nasty("token id negative", "/completions", completion(prompt=[[1], [-1]]), param="prompt.1.0"),
    Nasty("token id outside the vocabulary", "/completions", completion(prompt=[5, 2**32 - 1]), says="vocabulary"),
    Nasty("integer of 5000 digits", "/completions", '{"model": "kvmesh-demo", "prompt": "x", "seed": ' + "9" * 5000 + "}",
          says="JSON"),
    Nasty("boolean as an integer", "/completions", completion(max_tokens=True), param="max_tokens"),
    Nasty("a fraction as an integer", "/completions", completion(max_tokens=2.5), param="max_tokens"),
    Nasty("a string as an integer", "/chat/completions", chat(n="2"), param="n"),
    # Floats: Python's json reads NaN and Infinity, JSON does not have them; 1e400 parses to inf.
    Nasty("NaN literal", "/completions", '{"model": "kvmesh-demo", "prompt": "x", "temperature": NaN}', says="NaN"),
    Nasty("Infinity literal", "/chat/completions",
          '{"model": "kvmesh-demo", "messages": [], "top_p": Infinity}', says="Infinity"),
    Nasty("-Infinity in an unknown field", "/completions", '{"model": "kvmesh-demo", "prompt": "x", "x": -Infinity}',
          says="Infinity"),
    Nasty("temperature overflowing to inf", "/completions", '{"model": "kvmesh-demo", "prompt": "x", "temperature": 1e400}',
          param="temperature"),
    Nasty("top_p overflowing to inf", "/chat/completions",
          '{"model": "kvmesh-demo", "messages": [{"role": "user", "content": "x"}], "top_p": -1e999}', param="top_p"),
    # Structure.
    Nasty("100,000 nested arrays", "/completions", "[" * 100_000, says="nested too deeply"),
    Nasty("100,000 nested arrays, closed", "/chat/completions", nested(100_000), says="nested too deeply"),
    Nasty("100,000 nested objects in a field", "/completions",
          '{"model": "kvmesh-demo", "prompt": ' + '{"a": ' * 100_000 + "1" + "}" * 100_001, says="nested too deeply"),
    Nasty("nested prompt lists", "/completions", completion(prompt=[[[1]]]), param="prompt"),
    Nasty("JSON null", "/completions", "null", says="JSON object"),
    Nasty("empty body", "/chat/completions", "", says="JSON"),
    Nasty("UTF-8 byte-order mark", "/completions", b"\xef\xbb\xbf" + completion().encode(), says="JSON"),
    Nasty("not UTF-8", "/completions", b'{"model": "kvmesh-demo", "prompt": "\xc3\x28"}', says="UTF-8"),
    # Strings no UTF-8 wire can carry.
    Nasty("lone surrogate in a prompt", "/completions", completion(prompt="a\ud800b"), param="prompt"),
    Nasty("lone surrogate in a message", "/chat/completions",
          chat(messages=[{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]),
          param="messages.0.content.0.text"),
    Nasty("lone surrogate in a stop string", "/completions", completion(stop=["ok", "\ud83d"]), param="stop.1"),
    Nasty("lone surrogate in the model", "/completions", json.dumps({"model": "m\ud800", "prompt": "x"}), param="model"),
    Nasty("lone surrogate in a tool's parameters", "/chat/completions",
          chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"d": "\ud800"}}}]), param="tools"),
    Nasty("lone surrogate in chat_template_kwargs", "/chat/completions", chat(chat_template_kwargs={"\udfff": 1}),
          param="chat_template_kwargs", says="surrogate"),
    Nasty("empty model", "/completions", json.dumps({"model": "", "prompt": "x"}), param="model"),
    Nasty("a 1 MB unknown model", "/completions", json.dumps({"model": "m" * 1_000_000, "prompt": "x"}), status=404),
    # Stop strings: at most 16, each at most 256 characters.
    Nasty("17 stop strings", "/completions", completion(stop=[str(i) for i in range(17)]), param="stop"),
    Nasty("a 257-character stop string", "/chat/completions", chat(stop="s" * 257), param="stop"),
    Nasty("a 100k-character stop string in a list", "/completions", completion(stop=["ok", "s" * 100_000]), param="stop.1"),
    # Prompts in one completions request: at most 64, and prompts x n at most 128.
    Nasty("65 prompts", "/completions", completion(prompt=["p"] * 65, max_tokens=1), param="prompt"),
    Nasty("65 token prompts", "/completions", completion(prompt=[[1]] * 65, max_tokens=1), param="prompt"),
    Nasty("64 prompts x n=3", "/completions", completion(prompt=["p"] * 64, n=3, max_tokens=1), param="n"),
    # Prompts that can never fit the context are refused before or after tokenizing.
    Nasty("200k characters of text", "/completions", completion(prompt="x" * 200_000, max_tokens=1),
          says="context length"),
    Nasty("5000 chat messages", "/chat/completions", chat(messages=[{"role": "user", "content": ""}] * 5000),
          says="context"),
    Nasty("5000 token ids", "/completions", completion(prompt=[5] * 5000), says="context length"),
]


@pytest.mark.parametrize("case", NASTY, ids=[c.name for c in NASTY])
def test_nasty_bodies_get_a_4xx_with_the_openai_error_body(mocker_mesh: Mesh, case: Nasty) -> None:
    error = assert_error(post(mocker_mesh, case.path, case.body), case.status)
    if case.param is not None:
        assert error["param"] == case.param, error
    assert case.says.lower() in error["message"].lower(), error
    assert "\n" not in error["message"]
    assert len(error["message"]) < 1000, "errors quote no whole input"


def test_after_the_nasty_corpus_the_mesh_serves_and_nothing_is_in_flight(mocker_mesh: Mesh) -> None:
    assert_still_serving(mocker_mesh)
    assert inflight_returns_to_zero(mesh_metrics_url(mocker_mesh))


def test_many_chat_messages_are_served(mocker_mesh: Mesh) -> None:
    # More than 64 messages: the processor renders the template off its event loop.
    r = post(mocker_mesh, "/chat/completions", chat(messages=[{"role": "user", "content": "hi"}] * 100, max_tokens=2))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 100


def test_integral_floats_are_integers(mocker_mesh: Mesh) -> None:
    # JSON has one number type; JSON Schema (and so the published OpenAPI) calls 2.0 an integer.
    r = post(mocker_mesh, "/completions", completion(prompt=[5.0, 6.0], max_tokens=2.0, n=2.0))
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2 and r.json()["usage"]["completion_tokens"] == 4


def test_negative_max_tokens_on_completions_is_400(mocker_mesh: Mesh) -> None:
    error = assert_error(post(mocker_mesh, "/completions", json.dumps({"model": MODEL, "prompt": "a", "max_tokens": -1})), 400)
    assert error["param"] == "max_tokens"
    assert_still_serving(mocker_mesh)


def test_unknown_model_is_404(mocker_mesh: Mesh) -> None:
    error = assert_error(post(mocker_mesh, "/completions", json.dumps({"model": "gpt-17", "prompt": "a"})), 404)
    assert error["code"] == "model_not_found"


def test_prompt_longer_than_the_context_is_400(mocker_mesh: Mesh) -> None:
    too_long = {"model": MODEL, "prompt": [10 + i % 1000 for i in range(5000)], "max_tokens": 1}
    error = assert_error(post(mocker_mesh, "/completions", json.dumps(too_long)), 400)
    assert "context length" in error["message"]
    assert error["code"] == "context_length_exceeded"
    near_limit = {"model": MODEL, "prompt": [10] * 4000, "max_tokens": 500}
    assert "context length" in assert_error(post(mocker_mesh, "/completions", json.dumps(near_limit)), 400)["message"]
    assert_still_serving(mocker_mesh)


def test_token_ids_outside_the_vocabulary_are_400(mocker_mesh: Mesh) -> None:
    error = assert_error(post(mocker_mesh, "/completions", json.dumps({"model": MODEL, "prompt": [5, 10_000_000]})), 400)
    assert "vocabulary" in error["message"]
    assert error["code"] == "invalid_request"


def test_body_over_the_limit_is_413(mocker_mesh: Mesh) -> None:
    huge = json.dumps({"model": MODEL, "prompt": "x" * (17 * 1024 * 1024)})
    assert_error(post(mocker_mesh, "/completions", huge), 413)
    assert_still_serving(mocker_mesh)


def test_unknown_path_and_method_use_the_error_body(mocker_mesh: Mesh) -> None:
    assert_error(httpx.get(f"{mocker_mesh.base_url}/nothing-here", timeout=10), 404)
    assert_error(httpx.get(f"{mocker_mesh.base_url}/completions", timeout=10), 405)


def test_a_client_request_id_is_echoed_but_never_reused_inside(mocker_mesh: Mesh) -> None:
    # Two clients may send the same id at once; the engines need their own.
    same = {"x-request-id": "dup-id"}
    bodies = [completion(max_tokens=2), completion(max_tokens=2, stream=True)]
    for body in bodies:
        r = post(mocker_mesh, "/completions", body, same)
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == "dup-id"
        assert "dup-id" not in r.text
