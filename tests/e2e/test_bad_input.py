"""Bad input gets the contract's status and OpenAI error body, never a 500, and the mesh serves on.

Besides the hand-picked cases, `NASTY` is a fixed corpus of hostile bodies (numbers past their
protobuf field's width, NaN, deep nesting, lone surrogates, too many prompts or stop strings,
prompts that can never fit): each must be a 4xx naming the right field. A second gateway with an
API key and a small in-flight limit shows the key check and the in-flight accounting.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from gen.kvmesh.v1 import common_pb2, processor_pb2, processor_pb2_grpc
from services.mesh.discovery import PROCESSOR
from services.processor.service import ProcessorConfig, ProcessorMetrics, ProcessorServicer
from services.processor.tokenizer import ModelTokenizer
from tests.procs import ROOT, Mesh, Proc, free_port, registered, service, wait_until

MODEL = "kvmesh-demo"
CONTEXT = 4096  # the demo model's
API_KEY = "s3cret"
GUARDED_INFLIGHT = 4
MSG = [{"role": "user", "content": "x"}]


def post(mesh: Mesh, path: str, content: bytes | str, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{mesh.base_url}{path}", content=content,
                      headers={"content-type": "application/json", **(headers or {})}, timeout=30)


def assert_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    return error


def assert_still_serving(mesh: Mesh) -> None:
    r = post(mesh, "/completions", json.dumps({"model": MODEL, "prompt": "still there?", "max_tokens": 2}))
    assert r.status_code == 200, r.text


def inflight(metrics_url: str) -> float:
    text = httpx.get(metrics_url, timeout=10).text
    return next(s.value for family in text_string_to_metric_families(text) for s in family.samples
                if s.name == "kvmesh_frontend_inflight_requests")


def requests_total(metrics_url: str, endpoint: str, status: str) -> float:
    text = httpx.get(metrics_url, timeout=10).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "kvmesh_frontend_requests_total" and s.labels == {"endpoint": endpoint, "status": status})


def inflight_returns_to_zero(metrics_url: str, timeout_s: float = 15) -> bool:
    return wait_until(lambda: inflight(metrics_url) == 0, timeout_s, 0.05)


def mesh_metrics_url(mesh: Mesh) -> str:
    return mesh.base_url.removesuffix("/v1") + "/metrics"


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


def completion(**fields: object) -> str:
    return json.dumps({"model": MODEL, "prompt": "x", **fields})


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


# -- the processor's own checks (any caller of the internal RPC) ---------------------------------


def generate_request(**overrides: object) -> processor_pb2.GenerateRequest:
    fields: dict = dict(request_id="direct", model=MODEL, text="hello", n=1,
                        sampling=common_pb2.SamplingParams(max_tokens=2))
    fields.update(overrides)
    return processor_pb2.GenerateRequest(**fields)


@pytest.mark.parametrize("name, request_, code, says", [
    ("n = 0", generate_request(n=0), grpc.StatusCode.INVALID_ARGUMENT, "n must be"),
    ("n = 129", generate_request(n=129), grpc.StatusCode.INVALID_ARGUMENT, "n must be"),
    ("choice_offset overflows", generate_request(n=2, choice_offset=2**32 - 1), grpc.StatusCode.INVALID_ARGUMENT,
     "overflows"),
    ("empty model", generate_request(model=""), grpc.StatusCode.INVALID_ARGUMENT, "model is empty"),
    ("another model", generate_request(model="other"), grpc.StatusCode.NOT_FOUND, "not served"),
    ("no prompt", processor_pb2.GenerateRequest(model=MODEL, n=1), grpc.StatusCode.INVALID_ARGUMENT, "no prompt"),
    ("empty token list", generate_request(tokens=processor_pb2.TokenIds()), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    ("min_tokens above max_tokens", generate_request(sampling=common_pb2.SamplingParams(max_tokens=2, min_tokens=3)),
     grpc.StatusCode.INVALID_ARGUMENT, "min_tokens"),
    ("min_tokens above the room left", generate_request(sampling=common_pb2.SamplingParams(min_tokens=CONTEXT)),
     grpc.StatusCode.INVALID_ARGUMENT, "min_tokens"),
    ("max_tokens at uint32 max", generate_request(sampling=common_pb2.SamplingParams(max_tokens=2**32 - 1)),
     grpc.StatusCode.OUT_OF_RANGE, "context length"),
    ("seed + n overflows", generate_request(n=3, sampling=common_pb2.SamplingParams(seed=2**63 - 2)),
     grpc.StatusCode.INVALID_ARGUMENT, "seed"),
    ("NaN temperature", generate_request(sampling=common_pb2.SamplingParams(temperature=math.nan)),
     grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    ("negative temperature", generate_request(sampling=common_pb2.SamplingParams(temperature=-1)),
     grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    ("top_p of 0", generate_request(sampling=common_pb2.SamplingParams(top_p=0)), grpc.StatusCode.INVALID_ARGUMENT,
     "top_p"),
    ("infinite top_p", generate_request(sampling=common_pb2.SamplingParams(top_p=math.inf)),
     grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    ("top_k below -1", generate_request(sampling=common_pb2.SamplingParams(top_k=-5)), grpc.StatusCode.INVALID_ARGUMENT,
     "top_k"),
    ("21 logprobs", generate_request(sampling=common_pb2.SamplingParams(logprobs=21)), grpc.StatusCode.INVALID_ARGUMENT,
     "logprobs"),
    ("17 stop strings", generate_request(stop=[str(i) for i in range(17)]), grpc.StatusCode.INVALID_ARGUMENT, "stop"),
    ("a 257-character stop string", generate_request(stop=["s" * 257]), grpc.StatusCode.INVALID_ARGUMENT, "stop"),
    ("token id outside the vocabulary", generate_request(tokens=processor_pb2.TokenIds(ids=[1, 2**32 - 1])),
     grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
    ("as many token ids as the context", generate_request(tokens=processor_pb2.TokenIds(ids=[5] * CONTEXT)),
     grpc.StatusCode.OUT_OF_RANGE, "context length"),
    ("text over 32 characters per context token", generate_request(text="x" * (32 * CONTEXT + 1)),
     grpc.StatusCode.OUT_OF_RANGE, "characters"),
    ("more messages than context tokens", generate_request(chat=processor_pb2.ChatInput(
        messages=[processor_pb2.ChatMessage(role="user")] * (CONTEXT + 1))), grpc.StatusCode.OUT_OF_RANGE, "messages"),
])
def test_the_processor_checks_every_generate_call(mocker_mesh: Mesh, name: str, request_: processor_pb2.GenerateRequest,
                                                 code: grpc.StatusCode, says: str) -> None:
    (processor,) = registered(mocker_mesh.etcd, mocker_mesh.namespace, PROCESSOR)
    with grpc.insecure_channel(processor.address) as channel:
        with pytest.raises(grpc.RpcError) as raised:
            list(processor_pb2_grpc.ProcessorStub(channel).Generate(request_, timeout=30))
    status, details = raised.value.code(), raised.value.details() or ""  # type: ignore[attr-defined]
    assert status == code, (name, status, details)
    assert says in details, (name, details)
    assert "\n" not in details, "one-line messages"


def test_a_huge_prompt_is_tokenized_off_the_event_loop(mocker_mesh: Mesh) -> None:
    """The processor's loop keeps running while a prompt far past the threshold is tokenized
    (the mesh fixture only makes sure the demo model exists)."""
    tokenizer = ModelTokenizer(str(ROOT / ".cache" / "models" / MODEL))
    servicer = ProcessorServicer(ProcessorConfig(MODEL), tokenizer, None, None,  # type: ignore[arg-type]
                                 ProcessorMetrics(CollectorRegistry()))
    text = "The quick brown fox jumps over the lazy dog. " * 40_000  # 1.8M characters

    async def largest_loop_gap() -> tuple[float, int]:
        gaps: list[float] = []

        async def tick() -> None:
            last = time.perf_counter()
            while True:
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0.01)
        tokens = await servicer._tokenize(processor_pb2.GenerateRequest(text=text))
        ticker.cancel()
        return max(gaps), len(tokens)

    gap, n_tokens = asyncio.run(largest_loop_gap())
    assert n_tokens > 300_000
    # Encoded on the loop this text stalls it for about a second; off it, ticks go on (~2 ms apart).
    assert gap < 0.2, gap


# -- a gateway with an API key and a small in-flight limit ---------------------------------------


@pytest.fixture(scope="module")
def guarded(mocker_mesh: Mesh) -> Iterator[str]:
    """Its base URL (`http://host:port`): same mesh, key `s3cret`, at most 4 streams in flight."""
    port = free_port()
    frontend: Proc = service("services.frontend", "--etcd-endpoints", mocker_mesh.etcd,
                             "--namespace", mocker_mesh.namespace, "--http-port", str(port),
                             "--max-inflight", str(GUARDED_INFLIGHT), env={"KVMESH_API_KEY": API_KEY})
    try:
        frontend.wait_for("listening on", 60)
        base = f"http://127.0.0.1:{port}"
        assert wait_until(lambda: httpx.get(f"{base}/health", timeout=5).status_code == 200, 30)
        yield base
    finally:
        assert frontend.stop() == 0, frontend.tail()


AUTH = {"authorization": f"Bearer {API_KEY}"}


@pytest.mark.parametrize("header", [
    None, "", "Bearer wrong", "Bearer", "Basic czNjcmV0", API_KEY, f"Token {API_KEY}", f"Bearer {API_KEY} x",
    f"Bearer {API_KEY}x", "Bearer s\u00e9cret".encode(), b"Bearer \xff\xfe\x80", "Bearer \u00e9".encode("latin-1"),
    b"\xc3\xa9\xc3\xa9 " + API_KEY.encode(),
], ids=repr)
def test_a_missing_wrong_or_malformed_key_is_401(guarded: str, header: str | bytes | None) -> None:
    headers = {} if header is None else {"authorization": header}
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    for r in (httpx.post(f"{guarded}/v1/completions", json=body, headers=headers, timeout=30),
              httpx.post(f"{guarded}/v1/chat/completions", json={"model": MODEL, "messages": MSG}, headers=headers,
                         timeout=30),
              httpx.get(f"{guarded}/v1/models", headers=headers, timeout=30)):
        error = assert_error(r, 401)
        assert error["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("header", [f"Bearer {API_KEY}", f"bearer {API_KEY}", f"BEARER  {API_KEY}"])
def test_the_right_key_is_accepted(guarded: str, header: str) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    r = httpx.post(f"{guarded}/v1/completions", json=body, headers={"authorization": header}, timeout=30)
    assert r.status_code == 200, r.text
    assert httpx.get(f"{guarded}/v1/models", headers={"authorization": header}, timeout=30).status_code == 200


def test_each_prompt_and_choice_counts_against_the_inflight_limit(guarded: str) -> None:
    metrics = f"{guarded}/metrics"
    url = f"{guarded}/v1/completions"
    long_stream = {"model": MODEL, "prompt": "a long answer", "max_tokens": 4000, "stream": True}
    with httpx.stream("POST", url, json=long_stream, headers=AUTH, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept referenced: a dropped iterator would close the response early
        assert next(line for line in lines if line)
        assert inflight(metrics) == 1
        # 1 + 2 prompts x n=2 > 4: too busy now, worth a retry.
        busy = httpx.post(url, json={"model": MODEL, "prompt": ["a", "b"], "n": 2, "max_tokens": 2}, headers=AUTH,
                          timeout=30)
        assert assert_error(busy, 429)["code"] == "overloaded"
        assert busy.headers["retry-after"]
        # 1 + 3 prompts = 4: fits.
        fits = httpx.post(url, json={"model": MODEL, "prompt": ["a", "b", "c"], "max_tokens": 2}, headers=AUTH,
                          timeout=30)
        assert fits.status_code == 200, fits.text
        assert len(fits.json()["choices"]) == 3
    # 5 streams can never fit a limit of 4: no retry would help.
    never = httpx.post(url, json={"model": MODEL, "prompt": "a", "n": 5, "max_tokens": 2}, headers=AUTH, timeout=30)
    assert assert_error(never, 400)["param"] == "n"
    assert inflight_returns_to_zero(metrics)


def test_inflight_returns_to_zero_after_every_kind_of_failure(guarded: str) -> None:
    metrics = f"{guarded}/metrics"
    url = f"{guarded}/v1/completions"

    def failing(body: str | bytes, status: int, headers: dict[str, str] = AUTH) -> None:
        r = httpx.post(url, content=body, headers={"content-type": "application/json", **headers}, timeout=30)
        assert_error(r, status)
        assert inflight_returns_to_zero(metrics, 5), f"in flight after a {status}: {inflight(metrics)}"

    failing(completion(), 401, headers={})
    failing("[" * 100_000, 400)
    failing(completion(max_tokens=2**32), 400)
    failing(json.dumps({"model": "gpt-17", "prompt": "a"}), 404)
    failing(completion(prompt=["a", "b", "c"], max_tokens=2**32 - 1), 400)  # refused by the processor, after admission
    failing(completion(prompt=[[1, 2], [5, 2**32 - 1]], max_tokens=2), 400)  # one prompt of two refused
    failing(completion(prompt="a", n=5), 400)  # heavier than the limit

    # The client leaves a streamed answer after its first chunk.
    before = requests_total(metrics, "completions", "200")
    body = {"model": MODEL, "prompt": "nobody reads this", "max_tokens": 4000, "stream": True, "n": 2}
    with httpx.stream("POST", url, json=body, headers=AUTH, timeout=30) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line)
        assert inflight(metrics) == 2
    assert inflight_returns_to_zero(metrics), "in flight after an abandoned stream"
    assert requests_total(metrics, "completions", "200") == before + 1

    # The client gives up on a non-streamed answer: the gateway notices and cancels it.
    gone_before = requests_total(metrics, "completions", "499")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, json={"model": MODEL, "prompt": "too slow", "max_tokens": 4000}, headers=AUTH, timeout=1.0)
    assert inflight_returns_to_zero(metrics), "in flight after an abandoned request"
    assert wait_until(lambda: requests_total(metrics, "completions", "499") == gone_before + 1, 10)

    # Normal ends, streamed and not.
    assert httpx.post(url, json={"model": MODEL, "prompt": "ok", "max_tokens": 2}, headers=AUTH,
                      timeout=30).status_code == 200
    with httpx.stream("POST", url, json={"model": MODEL, "prompt": "ok", "max_tokens": 2, "stream": True},
                      headers=AUTH, timeout=30) as r:
        assert [line for line in r.iter_lines() if line][-1] == "data: [DONE]"
    assert inflight_returns_to_zero(metrics, 5)
