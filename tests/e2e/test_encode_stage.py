"""The encode stage (E/P/D) on a mocker mesh serving the demo vision-language model (real
processes, real etcd, real NIXL): the decode workers have every image encoded by the encode pool
and pull its features over NIXL, so they encode nothing themselves; the pool encodes each image
once (the image's digest picks the encode worker, whose encoder cache then holds it); an encode
pool that stops answering costs the request nothing but an encoding in place."""

from __future__ import annotations

import base64
import io
import os
import signal
from collections.abc import Iterator

import httpx
import pytest
from PIL import Image

from services.mesh.discovery import DECODE_WORKER, ENCODE_WORKER
from testkit.metrics import metrics_url, scrape, total
from tests.procs import Etcd, Mesh, registered, wait_until

VLM = "demo-vlm"


def png(shade: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (200, 120), (shade, 30, 90)).save(out, "PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def epd_mesh(etcd: Etcd) -> Iterator[Mesh]:
    mesh = Mesh.launch(etcd.endpoint, "epd", "mocker", "--model", ".cache/models/kvmesh-demo-vlm",
                       "--served-model-name", VLM, "--speedup", "20", "--decode-workers", "2",
                       "--prefill-workers", "0", "--encode-workers", "2", "--encode-timeout", "2")
    yield mesh
    assert mesh.stop() == 0, mesh.launcher.tail()


def ask(mesh: Mesh, image: bytes, text: str) -> dict:
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    body = {"model": VLM, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]}]}
    response = httpx.post(f"{mesh.base_url}/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def counted(mesh: Mesh, component: str, name: str, **labels: str) -> float:
    # The mocker's workers of one role share a process, and so its /metrics page: read once.
    ports = {w.metrics_port for w in registered(mesh.etcd, mesh.namespace, component)}
    return total([s for port in ports for s in scrape(metrics_url(port))], name, **labels)


def test_the_decode_workers_encode_nothing_and_the_pool_each_image_once(epd_mesh: Mesh) -> None:
    a, b = png(10), png(200)
    for text in ("first look", "another look, longer, so the prompt starts differently", "a third"):
        ask(epd_mesh, a, text)
    ask(epd_mesh, b, "first look")
    assert counted(epd_mesh, DECODE_WORKER, "kvmesh_worker_images_encoded_total") == 0
    assert counted(epd_mesh, DECODE_WORKER, "kvmesh_worker_image_features_taken_total") >= 2
    # Two distinct images: each encoded once on the pool, resends found in an encoder cache.
    assert counted(epd_mesh, ENCODE_WORKER, "kvmesh_worker_images_encoded_total") == 2
    assert counted(epd_mesh, DECODE_WORKER, "kvmesh_remote_encodes_total", outcome="remote") == 2


def test_a_stopped_encode_pool_costs_an_encoding_in_place(epd_mesh: Mesh) -> None:
    (pid,) = epd_mesh.pids("encode-worker")  # the mocker's encode workers share one process
    before = counted(epd_mesh, DECODE_WORKER, "kvmesh_worker_images_encoded_total")
    os.kill(pid, signal.SIGSTOP)
    try:
        answer = ask(epd_mesh, png(77), "while the encode pool is stopped")
    finally:
        os.kill(pid, signal.SIGCONT)
    assert answer["usage"]["prompt_tokens"] > 18
    assert counted(epd_mesh, DECODE_WORKER, "kvmesh_worker_images_encoded_total") == before + 1
    fallbacks = sum(counted(epd_mesh, DECODE_WORKER, "kvmesh_remote_encodes_total", outcome=reason)
                    for reason in ("timeout", "encode_failed", "no_encode_worker"))
    assert fallbacks >= 1
    # Back: a new image is encoded on the pool again once its workers answer.
    assert wait_until(lambda: len(registered(epd_mesh.etcd, epd_mesh.namespace, ENCODE_WORKER)) == 2, 30)
    ask(epd_mesh, png(150), "the pool is back")
    assert counted(epd_mesh, DECODE_WORKER, "kvmesh_worker_images_encoded_total") == before + 1
