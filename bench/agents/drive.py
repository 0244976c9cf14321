"""One run's client: every session's turns in order, a tool gap after each answer, and the background
prompts open-loop beside them; what each response says kept per request.

A session sends its turns one after another, each with the header `x-session-id: <session>`, waiting for
the answer and then the turn's tool gap before the next. A failed turn does not end the session: the
next turn's prompt is the trace's all the same. Background prompts carry no session header and arrive
on the trace's clock until every session has ended. Bounded: a session sends no turn after
`send_limit_s` (the rest count as not sent), every request has REQUEST_TIMEOUT_S, background requests
in flight at once are at most MAX_INFLIGHT, and what is still open GRACE_S after the sessions end is
cut and counted as failed.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import aiohttp

from bench.agents.workload import Session, Trace, ideal_cached_tokens
from testkit.sse import stream_completion

SESSION_HEADER = "x-session-id"
MAX_INFLIGHT = 128
REQUEST_TIMEOUT_S = 60.0
GRACE_S = 30.0
BACKGROUND = ""  # the session of a background request: none


@dataclass(frozen=True, slots=True)
class Outcome:
    session: str  # BACKGROUND for a background request
    turn: int  # 0-based; 0 for a background request
    ok: bool
    sent_s: float  # since the run's start
    ttft_ms: float = float("nan")
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ideal_cached: int = 0  # what the trace allows a prefix cache to reuse of it (turns only)
    worker: str = ""
    error: str = ""  # why it failed: the status and the start of the answer, or the exception


@dataclass
class Driven:
    outcomes: list[Outcome] = field(default_factory=list)
    turns_not_sent: int = 0
    background_not_sent: int = 0
    cut: int = 0  # requests still open at the end, counted as failed
    seconds: float = 0.0

    def turns(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.session != BACKGROUND]

    def background(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.session == BACKGROUND]


async def _send(client: aiohttp.ClientSession, prompt: list[int], max_tokens: int, model: str, session: str,
                turn: int, ideal: int, started: float) -> Outcome:
    sent = time.monotonic() - started
    r = await stream_completion(client, prompt, max_tokens, model=model)
    if not r.ok:
        return Outcome(session, turn, False, sent, worker=r.worker)
    return Outcome(session, turn, True, sent, r.ttft_s * 1000, r.prompt_tokens, r.cached_tokens, ideal, r.worker)


async def _session(client: aiohttp.ClientSession, session: Session, model: str, block_size: int, started: float,
                   send_limit_s: float, driven: Driven) -> None:
    await asyncio.sleep(max(0.0, started + session.start_s - time.monotonic()))
    for k, turn in enumerate(session.turns):
        if time.monotonic() - started > send_limit_s:
            driven.turns_not_sent += len(session.turns) - k
            return
        driven.outcomes.append(await _send(client, turn.prompt, turn.output_tokens, model, session.id, k,
                                           ideal_cached_tokens(turn, block_size), started))
        await asyncio.sleep(turn.gap_after_s)


async def _background(client: aiohttp.ClientSession, trace: Trace, model: str, started: float,
                      sessions_done: asyncio.Event, driven: Driven, tasks: set[asyncio.Task[None]]) -> None:
    limit = asyncio.Semaphore(MAX_INFLIGHT)
    output = trace.workload.background_output

    async def one(prompt: list[int]) -> None:
        async with limit:
            driven.outcomes.append(await _send(client, prompt, output, model, BACKGROUND, 0, 0, started))

    for n, request in enumerate(trace.background):
        try:
            await asyncio.wait_for(sessions_done.wait(), max(0.0, started + request.at_s - time.monotonic()))
        except TimeoutError:
            task = asyncio.create_task(one(request.prompt))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            continue
        driven.background_not_sent = len(trace.background) - n  # the sessions ended: arrivals stop
        return


async def wind_down(sessions: list[asyncio.Task[None]], feeder: asyncio.Task[None], sessions_done: asyncio.Event,
                    open_background: set[asyncio.Task[None]], send_limit_s: float) -> int:
    """Waits for the sessions (a session sends nothing after send_limit_s and each request ends
    within REQUEST_TIMEOUT_S), then stops the background's arrivals and gives what is still open
    GRACE_S; cuts the rest and returns how many were cut."""
    _, late = await asyncio.wait(sessions, timeout=send_limit_s + REQUEST_TIMEOUT_S + GRACE_S)
    sessions_done.set()
    await feeder
    pending = set(open_background) | late
    if pending:
        _, pending = await asyncio.wait(pending, timeout=GRACE_S)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return len(pending)


async def drive(base: str, trace: Trace, model: str, block_size: int, send_limit_s: float) -> Driven:
    """Sends `trace` to the mesh at `base` (http://HOST:PORT); returns what came back."""
    driven = Driven()
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    # One pool of connections; each session's client adds its header to every request.
    connector = aiohttp.TCPConnector(limit=MAX_INFLIGHT + len(trace.sessions))
    clients = [aiohttp.ClientSession(base, timeout=timeout, connector=connector, connector_owner=False,
                                     headers={SESSION_HEADER: s.id}) for s in trace.sessions]
    background = aiohttp.ClientSession(base, timeout=timeout, connector=connector, connector_owner=False)
    started = time.monotonic()
    sessions_done = asyncio.Event()
    open_background: set[asyncio.Task[None]] = set()
    try:
        feeder = asyncio.create_task(_background(background, trace, model, started, sessions_done, driven,
                                                 open_background))
        sessions = [asyncio.create_task(_session(c, s, model, block_size, started, send_limit_s, driven))
                    for c, s in zip(clients, trace.sessions)]
        driven.cut = await wind_down(sessions, feeder, sessions_done, open_background, send_limit_s)
    finally:
        for client in (*clients, background):
            await client.close()
        await connector.close()
    driven.seconds = time.monotonic() - started
    return driven
