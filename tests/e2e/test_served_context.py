"""The context length a mesh serves is its workers', not the model's config.json: a mocker started
with `--max-model-len` past the model's `max_position_embeddings` takes a prompt longer than the
config says, refuses one longer than its own limit with a message naming that limit, and
`/v1/models` and the processor's record say it (issue 44: an agent's 34,147-token prompt was
refused with "this model's context length is 4096 tokens")."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.mesh.discovery import PROCESSOR
from services.tools.make_demo_model import CORPUS, ensure_demo_model
from tests.procs import Etcd, Mesh, registered, wait_until

MODEL = "kvmesh-demo"
CONFIG_CONTEXT = 4096  # what the model's config.json says
SERVED = 200_000  # what its workers serve (--max-model-len)
AGENT_PROMPT_TOKENS = 34_147


@pytest.fixture(scope="module")
def short_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model, with a config.json that gives it 4096 positions."""
    out = tmp_path_factory.mktemp("models") / MODEL
    shutil.copytree(ensure_demo_model(), out)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = CONFIG_CONTEXT
    (out / "config.json").write_text(json.dumps(config))
    return out


def published(mesh: Mesh) -> list[object]:
    """The context length each processor of the mesh publishes in its record."""
    return [p.extra.get("max_model_len") for p in registered(mesh.etcd, mesh.namespace, PROCESSOR)]


@pytest.fixture(scope="module")
def served_mesh(etcd: Etcd, short_model: Path) -> Iterator[Mesh]:
    mesh = Mesh.launch(etcd.endpoint, "served-context", "mocker", "--model", str(short_model),
                       "--max-model-len", str(SERVED), "--speedup", "inf")
    try:
        # The processor started before the worker (the launcher's order), with the config's limit;
        # it enforces and publishes the worker's once it heard the worker join.
        assert wait_until(lambda: published(mesh) == [SERVED], 30), published(mesh)
        yield mesh
    finally:
        assert mesh.stop() == 0, mesh.launcher.tail()


def complete(mesh: Mesh, prompt: list[int], max_tokens: int) -> httpx.Response:
    return httpx.post(f"{mesh.base_url}/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens},
                      timeout=60)


def test_a_prompt_past_the_models_config_is_served_within_the_workers_limit(served_mesh: Mesh) -> None:
    r = complete(served_mesh, [10 + i % 1000 for i in range(AGENT_PROMPT_TOKENS)], 4)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (AGENT_PROMPT_TOKENS, 4)
    # A chat of more characters than 32 per config token (refused untokenized under that limit).
    text = CORPUS.read_text() * (32 * CONFIG_CONTEXT // len(CORPUS.read_text()) + 1)
    chat = httpx.post(f"{served_mesh.base_url}/chat/completions", timeout=60,
                      json={"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 2})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] > CONFIG_CONTEXT


def test_a_prompt_past_the_workers_limit_is_refused_naming_that_limit(served_mesh: Mesh) -> None:
    r = complete(served_mesh, [10] * SERVED, 1)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["message"] == f"the prompt has {SERVED} tokens; this model's context length is {SERVED} tokens"
    overflow = complete(served_mesh, [10] * AGENT_PROMPT_TOKENS, SERVED)
    assert overflow.status_code == 400
    assert f"exceed this model's context length of {SERVED} tokens" in overflow.json()["error"]["message"]


def test_the_model_list_reports_the_served_context_length(served_mesh: Mesh) -> None:
    cards = httpx.get(f"{served_mesh.base_url}/models", timeout=10).json()["data"]
    assert [(c["id"], c["max_model_len"]) for c in cards] == [(MODEL, SERVED)]
