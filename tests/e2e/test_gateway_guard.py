"""A gateway with an API key and a small in-flight limit: the key check, and in-flight accounting
that returns to zero after every kind of failure."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.procs import Mesh, Proc, free_port, service, wait_until
from tests.e2e.bad_input import (
    completion,
    API_KEY,
    GUARDED_INFLIGHT,
    MODEL,
    MSG,
    assert_error,
    inflight,
    inflight_returns_to_zero,
    requests_total,
)



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
