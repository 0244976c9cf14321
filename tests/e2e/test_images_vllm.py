"""Images on real vLLM: the demo vision-language model (a tiny random Idefics3) served by an
E/P/D mesh (an encode worker, whose encoder-only engine writes each image's features to the run's
directory; a prefill worker that reads them and prefills; a decode worker that pulls the KV over
NIXL), compared with one plain vLLM (tests/e2e/plain_vllm.py: vLLM's own `LLM.chat` renders,
widens and encodes the same messages in one process).

Equal greedy answers say the mesh's prompt is vLLM's: the processor's widening of each image,
the engine's collapse back to one image token, the image's features (encoded on the encode
worker), and the KV computed on the prefill worker and pulled by the decode worker. Another image
gives another answer, so the model sees the pixels; a resent image is a cache hit on the worker
that holds it."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator

import anthropic
import openai
import pytest
from PIL import Image

from services.processor.tokenizer import ModelTokenizer
from tests.conftest import TEST_DRAIN_S
from tests.e2e.plain_vllm import PlainVllm
from services.mesh.discovery import PREFILL_WORKER
from testkit.metrics import metrics_url, scrape, total
from tests.procs import Etcd, Mesh, registered

pytestmark = pytest.mark.vllm
VLM_DIR = ".cache/models/kvmesh-demo-vlm"
VLM = "demo-vlm"
MAX_TOKENS = 8
# Prompts of more than this many uncached tokens prefill on the prefill worker: every prompt here.
MAX_LOCAL_PREFILL = 32
SYSTEM = "You read screenshots and say what is on them, briefly and exactly."


def png(shade: int, size: tuple[int, int]) -> bytes:
    out = io.BytesIO()
    image = Image.new("RGB", size, (shade, 60, 200 - shade))
    image.paste((255 - shade, shade, 30), (size[0] // 4, size[1] // 4, size[0] // 2, size[1] // 2))
    image.save(out, "PNG")
    return out.getvalue()


IMAGES = {"a": png(20, (320, 200)), "b": png(220, (96, 160))}


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def chat(name: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": [{"type": "text", "text": "What is on this screen? "},
                                         {"type": "image_url", "image_url": {"url": data_url(IMAGES[name])}}]}]


@pytest.fixture(scope="module")
def reference() -> Iterator[PlainVllm]:
    run = PlainVllm(VLM_DIR, {"max_tokens": MAX_TOKENS, "max_model_len": 2048, "chats": [chat(n) for n in IMAGES]})
    yield run
    run.stop()


@pytest.fixture(scope="module")
def vlm_mesh(etcd: Etcd, vllm_stops: list[Mesh], reference: PlainVllm) -> Iterator[Mesh]:
    mesh = Mesh.launch(etcd.endpoint, "vlm-vllm", "vllm", "--model", VLM_DIR, "--served-model-name", VLM,
                       "--encode-workers", "1", "--prefill-workers", "1", "--decode-workers", "1", "--max-model-len", "2048",
                       "--max-local-prefill-length", str(MAX_LOCAL_PREFILL), "--drain-timeout", str(TEST_DRAIN_S),
                       timeout_s=400)
    yield mesh
    mesh.launcher.terminate()
    vllm_stops.append(mesh)


@pytest.fixture(scope="module")
def client(vlm_mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=vlm_mesh.base_url, api_key="unused", max_retries=0, timeout=120)


def answer(client: openai.OpenAI, name: str) -> tuple[str, dict, str]:
    raw = client.chat.completions.with_raw_response.create(model=VLM, messages=chat(name), max_tokens=MAX_TOKENS,
                                                           temperature=0, extra_body={"ignore_eos": True})
    completion = raw.parse()
    return completion.choices[0].message.content or "", completion.usage.model_dump(), raw.headers["x-kvmesh-prefill"]


def counted(mesh: Mesh, component: str, name: str, **labels: str) -> float:
    return sum(total(scrape(metrics_url(w.metrics_port)), name, **labels)
               for w in registered(mesh.etcd, mesh.namespace, component))


def test_disaggregated_answers_are_one_plain_vllm_s_for_each_image(vlm_mesh: Mesh, client: openai.OpenAI,
                                                                   reference: PlainVllm) -> None:
    tokenizer = ModelTokenizer(VLM_DIR)
    expected = [tokenizer.decode(out["token_ids"]) for out in reference.outputs()]
    got = {}
    for name, want in zip(IMAGES, expected, strict=True):
        text, _, prefill = answer(client, name)
        assert prefill.startswith("remote:"), prefill  # prefilled on the prefill worker
        assert text == want, (name, text, want)
        got[name] = text
    assert got["a"] != got["b"]  # the answer depends on the pixels, not only on the placeholders
    # Each image encoded on the encode worker, its features read by the prefill worker.
    assert counted(vlm_mesh, PREFILL_WORKER, "kvmesh_remote_encodes_total", outcome="remote") == 2


def test_a_resent_image_is_a_cache_hit(client: openai.OpenAI) -> None:
    first, _, _ = answer(client, "a")
    again, usage, prefill = answer(client, "a")
    assert again == first
    # Every full block of the prompt, the image's included, is reused on the decode worker.
    assert prefill == "local" and usage["prompt_tokens_details"]["cached_tokens"] >= 32, (prefill, usage)


def test_the_three_apis_give_the_same_answer(vlm_mesh: Mesh, client: openai.OpenAI) -> None:
    chat_text, _, _ = answer(client, "b")
    claude = anthropic.Anthropic(base_url=vlm_mesh.base_url.removesuffix("/v1"), api_key="unused", max_retries=0,
                                 timeout=120)
    # This client version has no `temperature` argument; the API field goes as it is.
    message = claude.messages.create(model=VLM, max_tokens=MAX_TOKENS, extra_body={"temperature": 0}, system=SYSTEM,
                                     messages=[
        {"role": "user", "content": [
            {"type": "text", "text": "What is on this screen? "},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(IMAGES["b"]).decode()}}]}])
    response = client.responses.create(model=VLM, max_output_tokens=MAX_TOKENS, temperature=0, instructions=SYSTEM,
                                       input=[{"role": "user", "content": [
                                           {"type": "input_text", "text": "What is on this screen? "},
                                           {"type": "input_image", "image_url": data_url(IMAGES["b"])}]}])
    # Without ignore_eos (neither API has it) an answer may end early at the end-of-sequence token.
    for text in ("".join(b.text for b in message.content if b.type == "text"), response.output_text):
        assert text and chat_text.startswith(text), (text, chat_text)
