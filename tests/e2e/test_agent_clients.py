"""Claude Code and Codex CLI, the real clients, against a mocker mesh: a task, then a follow-up in
the same session, every request answered 2xx; and their recorded tool-using sessions replayed.

The CLIs are installed on first use, pinned, under .cache/agent-clients/ (npm; ~760 MB, kept
between runs, never part of what `make run` installs). A recording proxy (testkit/recorder.py)
sits between each CLI and the gateway, so a failure shows every exchange. A random-weights model
calls no tools by itself: the tool turns are covered by the fixtures in tests/fixtures/agents/,
the same CLIs' requests recorded against a scripted model (testkit/scripted_model.py), replayed
here to the gateway (and through its translation in process: tests/unit/test_agent_fixtures.py).

To record fresh fixtures after a client update: KVMESH_RECORD_AGENT_FIXTURES=1 and run this module;
the tool sessions are recorded against the scripted model and written to tests/fixtures/agents/.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from testkit.metrics import by_labels, scrape
from testkit.proc import Proc, python_module
from services.mesh.net import free_port
from tests.procs import MODEL, Mesh

pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).parents[2]
CLIENTS = ROOT / ".cache" / "agent-clients"
FIXTURES = ROOT / "tests" / "fixtures" / "agents"
# Pinned: what the CLIs send is the specification, so a new version is a deliberate change
# (record its fixtures, see the module's docstring).
CLAUDE = ("@anthropic-ai/claude-code", "2.1.328", "claude")
CODEX = ("@openai/codex", "0.169.0", "codex")
NOTES = "The deploy moved to Tuesday because the database migration needs another review.\n"
TASK = "Read notes.txt and summarise it in one line"
FOLLOW_UP = "Now say it in five words"
RUN_TIMEOUT_S = 300


def installed(package: str, version: str, binary: str) -> Path:
    """The CLI's executable, installed under .cache/agent-clients/ on first use."""
    prefix = CLIENTS / f"{binary}-{version}"
    exe = prefix / "node_modules" / ".bin" / binary
    if not exe.exists():
        prefix.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["npm", "install", "--prefix", str(prefix), "--no-audit", "--no-fund",
                               f"{package}@{version}"], capture_output=True, text=True, timeout=900)
        assert done.returncode == 0 and exe.exists(), f"npm install {package}@{version} failed:\n{done.stderr[-3000:]}"
    return exe


@dataclass
class Recording:
    """A recorder in front of an upstream; `exchanges()` reads what it wrote so far."""

    proc: Proc
    url: str
    out: Path

    @classmethod
    def start(cls, upstream: str, out: Path) -> Recording:
        port = free_port()
        proc = Proc(python_module("testkit.recorder", "--upstream", upstream, "--port", str(port), "--out", str(out)),
                    "recorder")
        proc.wait_for(r"^READY", 30)
        return cls(proc, f"http://127.0.0.1:{port}", out)

    def exchanges(self) -> list[dict]:
        return [json.loads(line) for line in self.out.read_text().splitlines()] if self.out.exists() else []

    def stop(self) -> None:
        assert self.proc.stop(10) == 0, self.proc.tail()


@pytest.fixture(scope="module")
def agent_mesh(etcd) -> Iterator[Mesh]:  # noqa: ANN001
    # A context as long as agents need, and answers that end: a mocker answer is otherwise as long
    # as max_tokens (32,000 for Claude Code), which it continues until its context is full.
    mesh = Mesh.launch(etcd.endpoint, "agents", "mocker", "--speedup", "inf", "--max-model-len", "200000",
                       "--answer-tokens", "40", "--decode-workers", "1")
    yield mesh
    assert mesh.stop() == 0, mesh.launcher.tail()


@pytest.fixture(scope="module")
def claude() -> Path:
    return installed(*CLAUDE)


@pytest.fixture(scope="module")
def codex() -> Path:
    return installed(*CODEX)


def workdir(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text(NOTES)
    (tmp_path / "home").mkdir()
    return work


def claude_env(home: Path, url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE_", "DISABLE_"))}
    # Its defaults otherwise: telemetry, error reports and updates off, which change nothing it
    # sends the gateway (checked: the same requests, its `HEAD /api/hello` included), where
    # CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC would also drop that check.
    env.update(HOME=str(home), ANTHROPIC_BASE_URL=url, ANTHROPIC_API_KEY="sk-kvmesh", ANTHROPIC_MODEL=MODEL,
               ANTHROPIC_SMALL_FAST_MODEL=MODEL, ANTHROPIC_DEFAULT_HAIKU_MODEL=MODEL,
               ANTHROPIC_DEFAULT_SONNET_MODEL=MODEL, ANTHROPIC_DEFAULT_OPUS_MODEL=MODEL, DISABLE_TELEMETRY="1",
               DISABLE_ERROR_REPORTING="1", DISABLE_AUTOUPDATER="1")
    return env


def codex_env(home: Path, url: str) -> dict[str, str]:
    codex_home = home / ".codex"
    codex_home.mkdir(exist_ok=True)
    (codex_home / "config.toml").write_text(
        f'model_provider = "kvmesh"\nmodel = "{MODEL}"\n[model_providers.kvmesh]\nname = "kvmesh"\n'
        f'base_url = "{url}/v1"\nenv_key = "KVMESH_API_KEY"\nwire_api = "responses"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "CODEX_"))}
    env.update(HOME=str(home), CODEX_HOME=str(codex_home), KVMESH_API_KEY="sk-kvmesh")
    return env


def run(argv: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                          stdin=subprocess.DEVNULL)


def claude_result(done: subprocess.CompletedProcess) -> dict:
    """The JSON result `claude -p --output-format json` prints last."""
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, f"claude printed no result (exit {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return json.loads(lines[-1])


def summary(exchanges: list[dict]) -> str:
    return "\n".join(f"{e['method']} {e['path']} {e['status']} {e['answer'][:300]!r}" for e in exchanges)


def assert_all_answered(exchanges: list[dict], path: str) -> list[dict]:
    calls = [e for e in exchanges if e["path"].split("?")[0] == path]
    assert calls, f"no request to {path}:\n{summary(exchanges)}"
    assert all(200 <= e["status"] < 300 for e in exchanges), summary(exchanges)
    return calls


def unknown_fields(mesh: Mesh) -> dict[tuple[str, ...], float]:
    samples = scrape(f"{mesh.base}/metrics")
    fields = by_labels(samples, "kvmesh_frontend_client_fields_total", "api", "field", "effect")
    return {k: v for k, v in fields.items() if k[2] == "unknown"}


def test_claude_code_runs_a_task_and_its_follow_up(agent_mesh: Mesh, claude: Path, tmp_path: Path) -> None:
    work = workdir(tmp_path)
    recording = Recording.start(agent_mesh.base, tmp_path / "exchanges.jsonl")
    try:
        env = claude_env(tmp_path / "home", recording.url)
        first = claude_result(run([str(claude), "-p", TASK, "--output-format", "json"], work, env))
        assert first["is_error"] is False, (first, summary(recording.exchanges()))
        second = claude_result(run([str(claude), "-p", FOLLOW_UP, "--continue", "--output-format", "json"], work, env))
        assert second["is_error"] is False, (second, summary(recording.exchanges()))
        assert second["session_id"] == first["session_id"]
        exchanges = recording.exchanges()
        calls = assert_all_answered(exchanges, "/v1/messages")
        assert any(e["path"] == "/api/hello" for e in exchanges), summary(exchanges)  # its check, answered
    finally:
        recording.stop()
    # The follow-up carries the first turn: one conversation, routed as one session.
    last = calls[-1]["body"]
    assert TASK in json.dumps(last["messages"]) and FOLLOW_UP in json.dumps(last["messages"])
    sessions = {json.loads(c["body"]["metadata"]["user_id"])["session_id"] for c in calls}
    assert sessions == {first["session_id"]}
    assert unknown_fields(agent_mesh) == {}


def test_codex_runs_a_task_and_resumes_it(agent_mesh: Mesh, codex: Path, tmp_path: Path) -> None:
    work = workdir(tmp_path)
    recording = Recording.start(agent_mesh.base, tmp_path / "exchanges.jsonl")
    try:
        env = codex_env(tmp_path / "home", recording.url)
        exec_ = [str(codex), "exec", "--skip-git-repo-check", "-m", MODEL]
        first = run([*exec_, TASK], work, env)
        assert first.returncode == 0, (first.stderr[-3000:], summary(recording.exchanges()))
        second = run([*exec_, "resume", "--last", FOLLOW_UP], work, env)
        assert second.returncode == 0, (second.stderr[-3000:], summary(recording.exchanges()))
        calls = assert_all_answered(recording.exchanges(), "/v1/responses")
    finally:
        recording.stop()
    last = calls[-1]["body"]
    assert TASK in json.dumps(last["input"]) and FOLLOW_UP in json.dumps(last["input"])
    assert len({c["body"]["prompt_cache_key"] for c in calls}) == 1
    for c in calls:
        assert '"response.completed"' in c["answer"] or '"response.incomplete"' in c["answer"], c["answer"][-500:]
    assert unknown_fields(agent_mesh) == {}


def fixture_exchanges() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(FIXTURES.glob("*.jsonl.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            out += [(f"{path.name.split('.jsonl')[0]}#{i}", json.loads(line)) for i, line in enumerate(f)]
    return out


@pytest.mark.parametrize("exchange", [e for _, e in fixture_exchanges()], ids=[n for n, _ in fixture_exchanges()])
def test_a_recorded_tool_session_replays_with_every_turn_answered(agent_mesh: Mesh, exchange: dict) -> None:
    headers = {k: v for k, v in exchange["headers"].items() if k.startswith("anthropic-")}
    with httpx.stream(exchange["method"], agent_mesh.base + exchange["path"], json=exchange["body"],
                      headers=headers, timeout=120) as answer:
        text = "".join(answer.iter_text())
    assert answer.status_code == 200, text[:2000]
    last = "message_stop" if exchange["path"].startswith("/v1/messages") else "response.completed"
    assert f'"type":"{last}"' in text.replace(" ", ""), text[-1000:]
