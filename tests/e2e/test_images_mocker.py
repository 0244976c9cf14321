"""Images on a mocker mesh serving the demo vision-language model (real processes, real etcd):
all three APIs take them through the official clients; the same screenshot resent reuses the
cache on the worker that holds it, another image with the same text reuses nothing past it; the
same screenshot behind other words goes to the worker whose encoder cache keeps it; a text
model refuses images by name; a bad image is a 400 naming its part."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest
from PIL import Image

from services.mesh.discovery import ROUTER
from testkit.metrics import metrics_url, scrape, total
from tests.procs import Etcd, Mesh, registered, wait_until

VLM = "demo-vlm"
SYSTEM = "You are a careful assistant that reads screenshots. " * 8  # a few blocks of prefix before the image


def png(shade: int, size: tuple[int, int] = (320, 200)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, (shade, 90, 160)).save(out, "PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def vlm_mesh(etcd: Etcd) -> Iterator[Mesh]:
    mesh = Mesh.launch(etcd.endpoint, "vlm", "mocker", "--model", ".cache/models/kvmesh-demo-vlm",
                       "--served-model-name", VLM, "--speedup", "20", "--decode-workers", "2", "--allow-explain")
    yield mesh
    assert mesh.stop() == 0, mesh.launcher.tail()


def chat(mesh: Mesh, image: bytes, text: str = "what is on this screen?") -> httpx.Response:
    body = {"model": VLM, "max_tokens": 4, "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": [{"type": "text", "text": text},
                                     {"type": "image_url", "image_url": {"url": data_url(image)}}]}]}
    response = httpx.post(f"{mesh.base_url}/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response


def cached(response: httpx.Response) -> int:
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_the_three_apis_take_images_with_the_official_clients(vlm_mesh: Mesh) -> None:
    image = png(10)
    client = openai.OpenAI(base_url=vlm_mesh.base_url, api_key="unused", max_retries=0, timeout=60)
    completion = client.chat.completions.create(model=VLM, max_tokens=4, messages=[{"role": "user", "content": [
        {"type": "text", "text": "describe"}, {"type": "image_url", "image_url": {"url": data_url(image)}}]}])
    text_only = client.chat.completions.create(model=VLM, max_tokens=4,
                                               messages=[{"role": "user", "content": "describe"}])
    # The 18 tokens of the image (16 image tokens between two markers) count in the prompt.
    assert completion.usage.prompt_tokens >= text_only.usage.prompt_tokens + 18
    response = client.responses.create(model=VLM, max_output_tokens=4, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "describe"}, {"type": "input_image", "image_url": data_url(image)}]}])
    assert response.usage.input_tokens == completion.usage.prompt_tokens
    claude = anthropic.Anthropic(base_url=vlm_mesh.base_url.removesuffix("/v1"), api_key="unused", max_retries=0, timeout=60)
    message = claude.messages.create(model=VLM, max_tokens=4, messages=[{"role": "user", "content": [
        {"type": "text", "text": "describe"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": base64.b64encode(image).decode()}}]}])
    # Anthropic's input_tokens leave out what was read from the cache.
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == completion.usage.prompt_tokens
    counted = claude.messages.count_tokens(model=VLM, messages=[{"role": "user", "content": [
        {"type": "text", "text": "describe"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": base64.b64encode(image).decode()}}]}])
    assert counted.input_tokens == completion.usage.prompt_tokens


def test_a_resent_screenshot_is_cached_and_another_is_not(vlm_mesh: Mesh) -> None:
    first = chat(vlm_mesh, png(40))
    again = chat(vlm_mesh, png(40))
    # Routed to the worker that holds it, which reuses every full block (the image's too).
    assert again.headers["x-kvmesh-worker"] == first.headers["x-kvmesh-worker"]
    prompt = again.json()["usage"]["prompt_tokens"]
    assert cached(again) >= prompt - prompt % 16 - 16, again.json()["usage"]
    # The same ids with another image: only the blocks before the image match.
    other = chat(vlm_mesh, png(41))
    assert other.json()["usage"]["prompt_tokens"] == prompt
    assert cached(other) < cached(again) - 16, (cached(other), cached(again))


def test_the_same_screenshot_behind_other_words_goes_to_the_worker_that_keeps_its_features(vlm_mesh: Mesh) -> None:
    image = png(230)

    def ask(text: str) -> httpx.Response:
        # No system prompt: the two prompts share no full block, so no KV overlap draws either.
        body = {"model": VLM, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": data_url(image)}}]}]}
        response = httpx.post(f"{vlm_mesh.base_url}/chat/completions", json=body, headers={"x-kvmesh-explain": "1"},
                              timeout=60)
        assert response.status_code == 200, response.text
        return response

    first = ask("Tell me what this window shows, in a few plain words please.")
    worker = first.headers["x-kvmesh-worker"]
    # Until the worker's load says it took the first request, the router counts it as queued there.
    (router,) = registered(vlm_mesh.etcd, vlm_mesh.namespace, ROUTER)
    assert wait_until(lambda: total(scrape(metrics_url(router.metrics_port)), "kvmesh_router_pending_requests",
                                    worker_id=worker) == 0, 10)
    again = ask("Which colours stand out here? Answer briefly and exactly.")
    assert again.headers["x-kvmesh-worker"] == worker, again.headers["x-kvmesh-route"]
    assert cached(again) == 0  # no KV reused: the encoder cache drew it
    chosen = again.headers["x-kvmesh-route"].split("; ")[1]
    assert " encoder=" in chosen and " encoder=" not in again.headers["x-kvmesh-route"].split("; ")[2], \
        again.headers["x-kvmesh-route"]  # the chosen worker's encoder cache was weighed, and no other's


def test_bad_images_are_400s_naming_the_part(vlm_mesh: Mesh) -> None:
    def refused(url: str) -> dict:
        body = {"model": VLM, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": url}}]}]}
        response = httpx.post(f"{vlm_mesh.base_url}/chat/completions", json=body, timeout=30)
        assert response.status_code == 400, response.text
        return response.json()["error"]

    not_image = refused("data:image/png;base64," + base64.b64encode(b"plain text, no pixels").decode())
    assert not_image["param"] == "messages.0.content.1" and "not a PNG" in not_image["message"]
    assert refused("https://example.com/cat.png")["code"] == "image_url_not_allowed"


def test_a_text_model_refuses_images(mocker_mesh: Mesh) -> None:
    body = {"model": "kvmesh-demo", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": data_url(png(1))}}]}]}
    response = httpx.post(f"{mocker_mesh.base_url}/chat/completions", json=body, timeout=30)
    assert response.status_code == 400 and "takes text only" in response.json()["error"]["message"], response.text
