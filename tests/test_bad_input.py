"""Bad input gets the contract's status and OpenAI error body, never a 500, and the mesh serves on."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.procs import Mesh, free_port, service

MODEL = "kvmesh-demo"


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
    assert error["param"] is not None and error["param"].startswith(param.split(".")[0])
    assert error["type"] == "invalid_request_error"


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
    near_limit = {"model": MODEL, "prompt": [10] * 4000, "max_tokens": 500}
    assert "context length" in assert_error(post(mocker_mesh, "/completions", json.dumps(near_limit)), 400)["message"]
    assert_still_serving(mocker_mesh)


def test_token_ids_outside_the_vocabulary_are_400(mocker_mesh: Mesh) -> None:
    error = assert_error(post(mocker_mesh, "/completions", json.dumps({"model": MODEL, "prompt": [5, 10_000_000]})), 400)
    assert "vocabulary" in error["message"]


def test_body_over_the_limit_is_413(mocker_mesh: Mesh) -> None:
    huge = json.dumps({"model": MODEL, "prompt": "x" * (17 * 1024 * 1024)})
    assert_error(post(mocker_mesh, "/completions", huge), 413)
    assert_still_serving(mocker_mesh)


def test_unknown_path_and_method_use_the_error_body(mocker_mesh: Mesh) -> None:
    assert_error(httpx.get(f"{mocker_mesh.base_url}/nothing-here", timeout=10), 404)
    assert_error(httpx.get(f"{mocker_mesh.base_url}/completions", timeout=10), 405)


def test_api_key_is_required_when_configured(mocker_mesh: Mesh) -> None:
    port = free_port()
    frontend = service("services.frontend", "--etcd-endpoints", mocker_mesh.etcd, "--namespace", mocker_mesh.namespace,
                       "--http-port", str(port), env={"KVMESH_API_KEY": "s3cret"})
    try:
        frontend.wait_for("listening on", 60)
        url = f"http://127.0.0.1:{port}/v1/completions"
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        assert_error(httpx.post(url, json=body, timeout=30), 401)
        assert_error(httpx.post(url, json=body, headers={"authorization": "Bearer wrong"}, timeout=30), 401)
        ok = httpx.post(url, json=body, headers={"authorization": "Bearer s3cret"}, timeout=30)
        assert ok.status_code == 200, ok.text
    finally:
        assert frontend.stop() == 0, frontend.tail()
