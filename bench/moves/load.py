"""The moves run's load: agent sessions, long contexts and short answers.

A fixed number of clients, each an agent session sending greedy streaming /v1/completions back to
back, `ignore_eos`, `MAX_TOKENS` out: its context (token ids) opens at a seeded random length in
[8k, 32k] tokens and grows by a seeded [TURN_MIN, TURN_MAX] tokens a turn, as an agent's does
(the previous turn's context is the prefix of the next, so KV routing keeps a session where its
context is cached and each turn prefills its new part only); past 64k the session starts over. Every
request is bounded in time (`REQUEST_TIMEOUT_S`) and the load in count (`MAX_REQUESTS` per client)
and time (until `stop` is set, and `LOAD_LIMIT_S` at most). What each client saw is kept
(`Sent`: the stream, with its chunks' arrival times, and the request id the mesh gave it), for
the run to read per window and per rolled worker afterwards.

The bodies are encoded with msgspec: a 64k-token prompt is 400 kB of JSON, and the stdlib encoder
would hold the event loop (where the chunk timestamps are taken) for tens of milliseconds.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

import aiohttp
import msgspec
import numpy as np

from testkit.sse import Streamed, completion_body, stream

CLIENTS = 8
MIN_PROMPT, MAX_PROMPT = 8192, 65536
# A session's opening context is at most this long; each turn adds TURN_MIN..TURN_MAX tokens.
MAX_OPENING = 32768
TURN_MIN, TURN_MAX = 200, 800
# Answers long enough that a rolled worker has streams running past its drain's propagation delay.
MAX_TOKENS = 1536
# Token ids past the demo model's special tokens and below its vocabulary (1114).
TOKEN_LOW, TOKEN_HIGH = 10, 1100
REQUEST_TIMEOUT_S = 120.0
MAX_REQUESTS = 400
LOAD_LIMIT_S = 240.0


@dataclass
class Sent:
    """One request: its client, its prompt length and what came back."""

    client: int
    prompt_tokens: int
    out: Streamed

    @property
    def request_id(self) -> str:
        return self.out.headers.get("x-request-id", "")

    @property
    def exact(self) -> bool:
        """Completed with every token asked for and no error."""
        return self.out.complete and self.out.completion_tokens == MAX_TOKENS

    def running_at(self, t: float) -> bool:
        return self.out.started <= t < self.out.ended

    def tokens_between(self, start: float, end: float) -> float:
        """Its output tokens delivered within [start, end), if it completed exactly: each chunk
        with text counts completion_tokens / chunks (a chunk may carry several tokens)."""
        arrivals = self.out.content_arrivals
        if not self.exact or not arrivals:
            return 0.0
        return MAX_TOKENS / len(arrivals) * sum(start <= t < end for t in arrivals)

    def longest_gap_s(self, start: float = -math.inf, end: float = math.inf) -> float:
        """The longest wait between two chunks, of the gaps that overlap [start, end) (NaN: none);
        the wait for the first chunk is the prefill's, not a gap."""
        times = self.out.arrivals
        gaps = [b - a for a, b in zip(times, times[1:]) if b > start and a < end]
        return max(gaps) if gaps else math.nan

    def resumed_after_s(self, t: float) -> float:
        """From `t` to the next chunk, for a stream that had chunks before `t` (NaN otherwise):
        how long a stream given up mid-stream at `t` waited to go on."""
        times = self.out.arrivals
        if not times or times[0] > t:
            return math.nan
        return next((a - t for a in times if a > t), math.nan)


class Load:
    """The clients; `sent` every request so far, in the order they started."""

    def __init__(self, base_url: str, seed: int, request_ids: bool = False) -> None:
        """`request_ids`: each request carries an x-request-id of its own (Dynamo logs it beside
        the worker it chose; kvmesh echoes a client's id and logs its own, which it sends back
        when the client sent none)."""
        self.base_url = base_url
        self.seed = seed
        self.request_ids = request_ids
        self.sent: list[Sent] = []
        self.stop = asyncio.Event()

    async def run(self) -> None:
        """Until `stop` is set (or the limits): each client's requests back to back; returns once
        the requests in flight have ended (each bounded by its timeout)."""
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        connector = aiohttp.TCPConnector(limit=CLIENTS)
        async with aiohttp.ClientSession(self.base_url, timeout=timeout, connector=connector,
                                         json_serialize=lambda o: msgspec.json.encode(o).decode()) as session:
            try:
                async with asyncio.timeout(LOAD_LIMIT_S):
                    await asyncio.gather(*(self._client(session, i) for i in range(CLIENTS)))
            except TimeoutError:
                pass  # the load's own bound: what was in flight is kept as it stood

    async def _client(self, session: aiohttp.ClientSession, client: int) -> None:
        # numpy: 64k tokens drawn one by one in Python would hold the loop for tens of ms.
        rng = np.random.default_rng(self.seed * 1000 + client)
        prompt: list[int] = []
        for _ in range(MAX_REQUESTS):
            if self.stop.is_set():
                return
            if not prompt or len(prompt) + TURN_MAX > MAX_PROMPT:  # a new session
                prompt = rng.integers(TOKEN_LOW, TOKEN_HIGH, int(rng.integers(MIN_PROMPT, MAX_OPENING + 1))).tolist()
            else:  # the session's next turn: its context so far, and a new part
                prompt = prompt + rng.integers(TOKEN_LOW, TOKEN_HIGH, int(rng.integers(TURN_MIN, TURN_MAX + 1))).tolist()
            n = len(prompt)
            sent = Sent(client, n, Streamed())
            self.sent.append(sent)
            headers = {"x-request-id": f"moves-{self.seed}-{client}-{len(self.sent)}"} if self.request_ids else None
            # The record is filled as it streams: a load cut off by its bound keeps what came.
            await stream(session, "/v1/completions", completion_body(prompt, MAX_TOKENS, temperature=0),
                         headers=headers, out=sent.out)
