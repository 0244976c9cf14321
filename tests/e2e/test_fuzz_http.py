"""The HTTP API fuzzed from its own OpenAPI document (schemathesis), against the live mocker mesh.

Bodies that fit the published schemas (positive) and bodies that break them (negative) go to both
POST endpoints; /v1/models and /health get their share. Whatever is sent, the gateway answers
with no 5xx but a 503 carrying Retry-After (a 429 carries it too), every 4xx has the OpenAI error
body, every 200 is a whole answer, and afterwards nothing is left in flight. Seeded and
derandomized: the same few hundred cases on every run. Generated answers are kept short (see
`_quick`) so the run takes seconds; the hand-written corpus in test_bad_input.py covers the
values this leaves out.
"""

from __future__ import annotations

import json
import time
from functools import partial

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import Case, GenerationMode

from testkit.metrics import scrape, value
from tests.conftest import MESH_CONTEXT as CONTEXT  # the mocker mesh's served context length
from tests.procs import Mesh

MODEL = "kvmesh-demo"
# Cases per (operation, mode), about 600 in all (~10 s here). The GETs take no input: hypothesis
# sends their one possible case once.
BUDGET = {
    ("POST", "/v1/chat/completions", GenerationMode.POSITIVE): 150,
    ("POST", "/v1/chat/completions", GenerationMode.NEGATIVE): 150,
    ("POST", "/v1/completions", GenerationMode.POSITIVE): 150,
    ("POST", "/v1/completions", GenerationMode.NEGATIVE): 150,
    ("GET", "/v1/models", GenerationMode.POSITIVE): 5,
    ("GET", "/health", GenerationMode.POSITIVE): 5,
}
ERROR_FIELDS = {"message", "type", "param", "code"}


def _quick(mode: GenerationMode, case: Case) -> Case:
    """Caps the work a generated body asks for, not its validity: token limits and `n` that would
    be served (in range) are made small; values past the limits stay, they get a fast 400. Bodies
    that fit the schema name the served model, or nearly all would be a 404."""
    body = case.body
    if case.method != "POST" or not isinstance(body, dict):
        return case
    if mode is GenerationMode.POSITIVE:
        body["model"] = MODEL
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 4  # absent or null means the rest of the context
    for field, cap in (("max_tokens", 4), ("max_completion_tokens", 4), ("min_tokens", 2), ("n", 2)):
        value = body.get(field)
        if isinstance(value, int | float) and not isinstance(value, bool) and cap < value < CONTEXT:
            body[field] = cap
    return case


def _check(case: Case, response: schemathesis.Response) -> None:
    status, text = response.status_code, response.content.decode("utf-8", errors="replace")
    headers = {name: values[-1] for name, values in response.headers.items()}
    where = f"{case.method} {case.path} -> {status}\nsent: {case.body!r:.2000}\ngot: {text[:2000]}"
    if status >= 500:
        assert status == 503 and headers.get("retry-after"), f"a server error: {where}"
    if status == 429:
        assert headers.get("retry-after"), f"429 without Retry-After: {where}"
    if case.path == "/health":
        assert status in (200, 503) and set(json.loads(text)) == {"status", "reason"}, where
        return
    if 400 <= status < 600:
        body = json.loads(text)
        assert isinstance(body, dict) and set(body) == {"error"}, where
        error = body["error"]
        assert set(error) == ERROR_FIELDS, where
        assert isinstance(error["message"], str) and error["message"], where
        assert isinstance(error["type"], str), where
        assert error["param"] is None or isinstance(error["param"], str), where
        assert error["code"] is None or isinstance(error["code"], str), where
        return
    assert status == 200, where
    if headers.get("content-type", "").startswith("text/event-stream"):
        assert not response.stream_cut_short, where
        events = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", where
        assert not any('"error"' in e and "choices" not in e for e in events[:-1]), where
    else:
        assert isinstance(json.loads(text), dict), where


def _fuzz(operation: schemathesis.APIOperation, mode: GenerationMode, examples: int, root: str,
          session: requests.Session) -> int:
    """Sends up to `examples` generated cases for one operation; returns how many were sent."""
    sent = 0

    # No shrinking: a failure is reported as generated, and the run's time stays bounded.
    @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode).map(partial(_quick, mode)))
    def run(case: Case) -> None:
        nonlocal sent
        sent += 1
        _check(case, case.call(base_url=root, session=session, timeout=60))

    run()
    return sent


def _inflight(root: str) -> float:
    return value(scrape(f"{root}/metrics"), "kvmesh_frontend_inflight_requests")


def test_the_openapi_document_describes_the_request_bodies(mocker_mesh: Mesh) -> None:
    root = mocker_mesh.base_url.removesuffix("/v1")
    doc = httpx.get(f"{root}/openapi.json", timeout=10).json()
    schemas = doc["components"]["schemas"]
    for path, model in (("/v1/chat/completions", "ChatCompletionRequest"), ("/v1/completions", "CompletionRequest")):
        body = doc["paths"][path]["post"]["requestBody"]
        assert body["required"] is True
        assert body["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{model}"}
        assert "model" in schemas[model]["required"]
        for status in ("400", "401", "404", "413", "429", "503"):
            error = doc["paths"][path]["post"]["responses"][status]["content"]["application/json"]["schema"]
            assert error == {"$ref": "#/components/schemas/ErrorBody"}
    # The bounds the gateway enforces are published: a client's generator can stay within them.
    completion = schemas["CompletionRequest"]["properties"]
    assert {"maximum": 2**32 - 1, "minimum": 1, "type": "integer"} in completion["max_tokens"]["anyOf"]
    assert {"maximum": 2**63 - 1, "minimum": -(2**63), "type": "integer"} in completion["seed"]["anyOf"]
    # References resolve within the document.
    refs = {v for v in _values(doc, "$ref")}
    assert all(ref.removeprefix("#/components/schemas/") in schemas for ref in refs), refs


def _values(node: object, key: str) -> list[str]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == key] + [x for v in node.values() for x in _values(v, key)]
    if isinstance(node, list):
        return [x for v in node for x in _values(v, key)]
    return []


@pytest.mark.timeout(180)
def test_fuzzed_requests_get_no_server_error_and_openai_shaped_errors(mocker_mesh: Mesh) -> None:
    root = mocker_mesh.base_url.removesuffix("/v1")
    # Streams are read to their end (schemathesis stops at 20 events by default): [DONE] is checked.
    config = schemathesis.Config.from_dict({"max-stream-events": 100_000})
    schema = schemathesis.openapi.from_url(f"{root}/openapi.json", config=config, timeout=10)
    operations = {(op.method.upper(), op.path): op for op in (result.ok() for result in schema.get_all_operations())}
    assert {(method, path) for method, path, _ in BUDGET} <= set(operations)
    started = time.monotonic()
    sent = {}
    with requests.Session() as session:
        for (method, path, mode), examples in BUDGET.items():
            sent[(method, path, mode.value)] = _fuzz(operations[(method, path)], mode, examples, root, session)
    elapsed = time.monotonic() - started
    print(f"fuzzed {sum(sent.values())} requests in {elapsed:.1f}s: {sent}")
    assert sum(sent.values()) >= 600, sent
    assert _inflight(root) == 0
