"""The client of the recorded-clients run: every session's turns in order over the Messages or
Responses API, streamed, a tool gap after each answer; the background prompts beside them as in
drive.py. Bounded as drive.py is (a send limit, a deadline per request, a grace period).

Per turn it keeps what the answer's events say: the time to the first output event (TTFT), the
prompt tokens and those read from the prefix cache (Messages: message_delta's usage,
`input_tokens` + `cache_read_input_tokens`; Responses: response.completed's
`input_tokens_details.cached_tokens`), and the worker (x-kvmesh-worker).
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from bench.agents.client_sessions import ClientSession, ClientTurn, SeenBlocks
from bench.agents.drive import MAX_INFLIGHT, REQUEST_TIMEOUT_S, Driven, Outcome, _background, wind_down
from bench.agents.workload import Trace

# The first event that carries output, per API.
_FIRST = (b'"content_block_delta"', b'"response.output_text.delta"', b'"response.output_item.added"')


async def _send(client: aiohttp.ClientSession, session: ClientSession, k: int, turn: ClientTurn, model: str,
                ideal: int, started: float) -> Outcome:
    sent = time.monotonic() - started
    t0 = time.perf_counter()
    ttft = float("nan")
    prompt = cached = 0
    try:
        async with client.post(turn.path, json={**turn.body, "model": model}) as r:
            worker = r.headers.get("x-kvmesh-worker", "")
            if r.status != 200:
                return Outcome(session.id, k, False, sent, worker=worker,
                               error=f"{r.status} {(await r.text())[:200]}")
            last = b""
            async for line in r.content:
                if not line.startswith(b"data:"):
                    continue
                last = line
                if ttft != ttft and any(kind in line for kind in _FIRST):
                    ttft = (time.perf_counter() - t0) * 1000
                if b'"message_delta"' in line or b'"response.completed"' in line:
                    prompt, cached = _usage(json.loads(line[5:]))
    except (aiohttp.ClientError, TimeoutError) as exc:
        return Outcome(session.id, k, False, sent, error=f"{type(exc).__name__} {exc}"[:200])
    error = "" if prompt else f"the stream ended without usage: {last[:200]!r}"
    return Outcome(session.id, k, prompt > 0, sent, ttft, prompt, cached, ideal, worker, error)


def _usage(event: dict) -> tuple[int, int]:
    """(prompt tokens, of them read from the prefix cache) from the event that ends an answer."""
    if event.get("type") == "message_delta":
        u = event["usage"]
        cached = u.get("cache_read_input_tokens", 0)
        return u["input_tokens"] + cached, cached
    u = event["response"]["usage"]
    return u["input_tokens"], u["input_tokens_details"]["cached_tokens"]


async def _session(client: aiohttp.ClientSession, session: ClientSession, chains: list[list[int]], prompts: SeenBlocks,
                   model: str, started: float, send_limit_s: float, driven: Driven) -> None:
    await asyncio.sleep(max(0.0, started + session.start_s - time.monotonic()))
    for k, turn in enumerate(session.turns):
        if time.monotonic() - started > send_limit_s:
            driven.turns_not_sent += len(session.turns) - k
            return
        driven.outcomes.append(await _send(client, session, k, turn, model, prompts.ideal(chains[k]), started))
        await asyncio.sleep(turn.gap_after_s)


async def drive_clients(base: str, sessions: list[ClientSession], chains: dict[str, list[list[int]]],
                        prompts: SeenBlocks, background: Trace, model: str, send_limit_s: float) -> Driven:
    """Sends the sessions (their prompts' block chains in `chains`, by session) and the
    background of `background` to the mesh at `base`; returns what came back."""
    driven = Driven()
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=MAX_INFLIGHT + len(sessions))
    client = aiohttp.ClientSession(base, timeout=timeout, connector=connector, connector_owner=False)
    started = time.monotonic()
    sessions_done = asyncio.Event()
    open_background: set[asyncio.Task[None]] = set()
    try:
        feeder = asyncio.create_task(_background(client, background, model, started, sessions_done, driven,
                                                 open_background))
        tasks = [asyncio.create_task(_session(client, s, chains[s.id], prompts, model, started, send_limit_s, driven))
                 for s in sessions]
        driven.cut = await wind_down(tasks, feeder, sessions_done, open_background, send_limit_s)
    finally:
        await client.close()
        await connector.close()
    driven.seconds = time.monotonic() - started
    return driven
