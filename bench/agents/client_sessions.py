"""Agent sessions in the shapes real clients send: Claude Code's and Codex's recorded requests
(tests/fixtures/agents/), played as many sessions over the Messages and Responses APIs.

Each recorded session is three requests: the task (tens of thousands of tokens of system prompt
and tools before the first user word), the turn after two tool calls (their results, one an
error), and a follow-up. A session here is one of them made its own: its working directory and
notes differ (so sessions share the clients' static prefix, the system prompt and tools, and
diverge after it, as users in different repositories do), its conversation id differs (Claude
Code's `metadata.user_id` session_id, Codex's `prompt_cache_key`: the session the gateway routes
by, with no header), and after the recorded turns it goes on with EXTRA_TURNS more tool turns in
the client's own shape (a call, its result of `min_result`-`max_result` words), so the history
grows as an agent's does. Tool gaps are drawn log-uniformly.

`ideal_cached` of a turn is the longest prefix, in whole KV blocks, its prompt shares with any
prompt sent before it (the gateway's own rendering and tokenization, run here in process):
across sessions that is the clients' static prefix, within one the history so far.
"""

from __future__ import annotations

import copy
import gzip
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from bench.agents.workload import log_uniform
from testkit.proc import ROOT

FIXTURES = ROOT / "tests" / "fixtures" / "agents"
WORDS = ("the", "deploy", "moved", "migration", "review", "function", "returns", "value", "error", "test", "file",
         "line", "import", "class", "self", "config", "route", "worker", "cache", "token", "block", "prefix")


@dataclass(frozen=True)
class ClientWorkload:
    sessions_per_client: int = 16
    extra_turns: int = 4
    min_result_words: int = 200
    max_result_words: int = 1500
    min_gap_s: float = 1.0
    max_gap_s: float = 10.0
    start_spread_s: float = 20.0
    answer_tokens: int = 40  # the mocker's answers end after this many (--answer-tokens)

    def __post_init__(self) -> None:
        if self.sessions_per_client < 1 or self.extra_turns < 0:
            raise ValueError("sessions_per_client must be >= 1 and extra_turns >= 0")
        if not 0 < self.min_result_words <= self.max_result_words or not 0 < self.min_gap_s <= self.max_gap_s:
            raise ValueError("need 0 < min <= max for result words and gaps")


@dataclass(frozen=True, slots=True)
class ClientTurn:
    path: str  # /v1/messages or /v1/responses
    body: dict[str, Any]
    gap_after_s: float


@dataclass(frozen=True, slots=True)
class ClientSession:
    id: str
    client: str  # "claude-code" | "codex"
    start_s: float
    turns: tuple[ClientTurn, ...]


def recorded(client: str) -> list[dict]:
    [path] = FIXTURES.glob(f"{client}-*.jsonl.gz")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _made_own(body: dict, workdir: str, new_dir: str, notes: str, new_notes: str) -> dict:
    text = json.dumps(body, ensure_ascii=False).replace(workdir, new_dir).replace(notes, new_notes)
    return json.loads(text)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _claude_turn(body: dict, rng: random.Random, w: ClientWorkload, k: int) -> dict:
    """The next request after one more tool call: the last request's messages, the call (an
    assistant turn) and its result (a user turn)."""
    out = copy.deepcopy(body)
    call_id = f"toolu_{rng.getrandbits(64):016x}{k:04d}"
    out["messages"].append({"role": "assistant", "content": [
        {"type": "tool_use", "id": call_id, "name": "Read", "input": {"file_path": f"src/module_{k}.py"}}]})
    out["messages"].append({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": call_id,
         "content": _words(rng, rng.randint(w.min_result_words, w.max_result_words))}]})
    return out


def _codex_turn(body: dict, rng: random.Random, w: ClientWorkload, k: int) -> dict:
    out = copy.deepcopy(body)
    call_id = f"call_{rng.getrandbits(64):016x}{k:04d}"
    out["input"].append({"type": "function_call", "call_id": call_id, "name": "exec_command",
                         "arguments": json.dumps({"cmd": f"cat src/module_{k}.py"})})
    out["input"].append({"type": "function_call_output", "call_id": call_id,
                         "output": _words(rng, rng.randint(w.min_result_words, w.max_result_words))})
    return out


def _with_id(client: str, body: dict, session: str) -> dict:
    out = copy.deepcopy(body)
    if client == "claude-code":
        user = json.loads(out["metadata"]["user_id"])
        user["session_id"] = session
        out["metadata"]["user_id"] = json.dumps(user)
    else:
        out["prompt_cache_key"] = session
    return out


def sessions(w: ClientWorkload, seed: int) -> list[ClientSession]:
    out = []
    for client, next_turn in (("claude-code", _claude_turn), ("codex", _codex_turn)):
        exchanges = recorded(client)
        workdir = "/tmp/cap/cc/work" if client == "claude-code" else "/tmp/cap/cx/work"
        notes = "The deploy moved to Tuesday because the database migration needs another review."
        for i in range(w.sessions_per_client):
            rng = random.Random(f"clients-{seed}-{client}-{i}")
            sid = f"{client}-{seed}-{i:03d}-{rng.getrandbits(32):08x}"
            own = [_made_own(e["body"], workdir, f"/home/dev/repo-{i:03d}", notes,
                             f"Session {i}: " + _words(rng, 12)) for e in exchanges]
            bodies = [_with_id(client, b, sid) for b in own]
            for k in range(w.extra_turns):
                bodies.append(next_turn(bodies[-1], rng, w, k))
            path = exchanges[0]["path"].split("?")[0]
            turns = tuple(ClientTurn(path, b, log_uniform(rng, w.min_gap_s, w.max_gap_s) if j < len(bodies) - 1
                                     else 0.0) for j, b in enumerate(bodies))
            out.append(ClientSession(sid, client, rng.uniform(0.0, w.start_spread_s), turns))
    return out


class Prompts:
    """Renders and tokenizes requests as the gateway and processor do, in process; a prompt as
    the chained hashes of its whole blocks."""

    def __init__(self, model_dir: Path, model: str, block_size: int) -> None:
        from services.processor.tokenizer import ModelTokenizer

        self.tok = ModelTokenizer(str(model_dir))
        self.model = model
        self.block_size = block_size

    def token_ids(self, path: str, body: dict) -> list[int]:
        from services.frontend.endpoints import processor_requests
        from services.frontend.messages_api import chat_body as messages_chat_body
        from services.frontend.messages_schemas import MessagesRequest, parse_messages
        from services.frontend.responses_input import chat_body
        from services.frontend.schemas import ChatCompletionRequest, parse
        from services.processor.chat_render import chat_prompt

        body = {**body, "model": self.model}
        chat = messages_chat_body(parse_messages(MessagesRequest, body)) if path == "/v1/messages" else chat_body(body)
        [msg] = processor_requests("bench", parse(ChatCompletionRequest, chat))
        return self.tok.encode_chat(chat_prompt(msg.chat))

    def chain(self, ids: list[int]) -> list[int]:
        """The prompt's whole blocks as chained hashes (a block's hash covers all before it)."""
        bs, parent, out = self.block_size, 0, []
        for start in range(0, len(ids) - bs + 1, bs):
            parent = xxhash.xxh3_64_intdigest(b"".join(t.to_bytes(4, "little") for t in ids[start:start + bs]), parent)
            out.append(parent)
        return out



class SeenBlocks:
    """The blocks of every prompt sent so far: a new prompt's ideal reuse is its longest prefix
    among them."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.seen: set[int] = set()

    def ideal(self, chain: list[int]) -> int:
        """Tokens a prefix cache could hold of a prompt (its `chain`) from the prompts seen before;
        then remembers it. Called as each prompt is sent, so "before" is the run's own order."""
        shared = 0
        while shared < len(chain) and chain[shared] in self.seen:
            shared += 1
        self.seen.update(chain)
        return shared * self.block_size
