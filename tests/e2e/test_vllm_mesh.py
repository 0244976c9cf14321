"""The mesh on the real engine: vLLM (CPU build here) with the demo model."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.conftest import MESH_CONTEXT
from tests.procs import Mesh, find_matches, wait_until

pytestmark = pytest.mark.vllm
MODEL = "kvmesh-demo"
SYSTEM = ("You are the assistant of kvmesh, a serving system that splits prefill and decode across worker "
          "pools and routes each request to the worker holding the longest cached prefix of its prompt. ")


def test_openai_client_streams_a_chat_completion_through_all_services(vllm_client: openai.OpenAI) -> None:
    stream = vllm_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello!"}], max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[-1].usage.completion_tokens == 16


def test_greedy_streamed_and_whole_answers_agree(vllm_client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, prompt="Prefill reads the whole prompt at once", max_tokens=12, temperature=0)
    whole = vllm_client.completions.create(**kwargs)
    streamed = "".join(c.choices[0].text for c in vllm_client.completions.create(stream=True, **kwargs) if c.choices)
    assert whole.choices[0].text == streamed
    assert whole.usage.completion_tokens == 12


def test_repeated_prefix_reports_cached_tokens_from_the_engine(vllm_client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": SYSTEM * 2}, {"role": "user", "content": "What is a KV block?"}]
    first = vllm_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    second = vllm_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens > 64
    assert second.usage.prompt_tokens_details.cached_tokens >= 32  # at least one full 32-token block
    assert second.choices[0].message.content == first.choices[0].message.content


def test_stop_strings_n_and_seed_on_vllm(vllm_client: openai.OpenAI) -> None:
    reply = vllm_client.completions.create(model=MODEL, prompt="Numbers: 1 2 3", max_tokens=8, n=2, seed=3,
                                           temperature=1.0)
    assert sorted(c.index for c in reply.choices) == [0, 1]
    assert reply.usage.completion_tokens <= 16
    full = vllm_client.completions.create(model=MODEL, prompt="stop here", max_tokens=30, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].text
    stop = full[10:12]
    cut = vllm_client.completions.create(model=MODEL, prompt="stop here", max_tokens=30, temperature=0, stop=stop)
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == full[: full.index(stop)]


def test_logprobs_come_from_the_engine(vllm_client: openai.OpenAI) -> None:
    reply = vllm_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=3, logprobs=True, top_logprobs=2, temperature=0)
    content = reply.choices[0].logprobs.content
    assert len(content) == 3
    assert all(entry.logprob <= 0 and len(entry.top_logprobs) >= 2 for entry in content)


def test_bad_request_on_vllm_is_400_and_the_next_one_is_served(vllm_mesh: Mesh, vllm_client: openai.OpenAI) -> None:
    # The limit is the one the vLLM workers serve (--max-model-len), not the demo model's 131072.
    r = httpx.post(f"{vllm_mesh.base_url}/completions",
                   json={"model": MODEL, "prompt": [5] * MESH_CONTEXT, "max_tokens": 1}, timeout=30)
    assert r.status_code == 400 and f"context length is {MESH_CONTEXT} tokens" in r.json()["error"]["message"]
    assert vllm_client.completions.create(model=MODEL, prompt="ok", max_tokens=2).usage.completion_tokens == 2


def test_models_and_health_on_vllm(vllm_mesh: Mesh, vllm_client: openai.OpenAI) -> None:
    assert [(m.id, m.max_model_len) for m in vllm_client.models.list().data] == [(MODEL, MESH_CONTEXT)]
    assert httpx.get(vllm_mesh.base_url.removesuffix("/v1") + "/health", timeout=10).status_code == 200


def test_vllm_kv_events_reach_the_router_and_steer_the_next_request(vllm_mesh: Mesh) -> None:
    tokens = [(i * 7) % 900 + 20 for i in range(3 * 32 + 5)]  # three full 32-token blocks and a tail
    url = f"{vllm_mesh.base_url}/completions"
    first = httpx.post(url, json={"model": MODEL, "prompt": tokens, "max_tokens": 1}, timeout=60)
    assert first.status_code == 200
    home = first.headers["x-kvmesh-worker"]
    assert wait_until(lambda: find_matches(vllm_mesh.etcd, vllm_mesh.namespace, tokens) == {home: 3}, 10), \
        find_matches(vllm_mesh.etcd, vllm_mesh.namespace, tokens)
    for tail in ([1, 2], [3, 4, 5]):
        again = httpx.post(url, json={"model": MODEL, "prompt": tokens + tail, "max_tokens": 1}, timeout=60)
        assert again.headers["x-kvmesh-worker"] == home
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 3 * 32


def test_a_resumed_greedy_request_continues_the_unbroken_output_on_vllm(vllm_mesh: Mesh) -> None:
    """What a migration sends a vLLM worker — the prompt plus the tokens already generated — gives
    the rest of the greedy output the unbroken run gave, on the other worker."""
    import grpc

    from gen.kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
    from tests.procs import registered

    first, second = registered(vllm_mesh.etcd, vllm_mesh.namespace, "decode-worker")[:2]
    prompt = [(i * 37) % 900 + 20 for i in range(90)]

    def generate(address: str, rid: str, tokens: list[int], max_tokens: int, resumed: int) -> list[int]:
        sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        with grpc.insecure_channel(address) as channel:
            replies = worker_pb2_grpc.WorkerStub(channel).Generate(worker_pb2.WorkerGenerateRequest(
                request_id=rid, token_ids=tokens, sampling=sampling, resumed_tokens=resumed), timeout=120)
            return [t for reply in replies for t in reply.token_ids]

    with pytest.raises(grpc.RpcError) as refused:
        generate(first.address, "out-of-vocabulary", [999_999], 4, 0)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    whole = generate(first.address, "unbroken", prompt, 40, 0)
    assert len(whole) == 40
    rest = generate(second.address, "unbroken~1", prompt + whole[:16], 24, 16)
    assert whole[:16] + rest == whole
