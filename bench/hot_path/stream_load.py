"""Many concurrent streamed completions against a mesh, measured as a client sees them.

Shared by the hot-path benchmark's scale runs: the time to the first token, the time between
tokens in the steady state (after every stream has its first token: the ramp-up of thousands of
prompts tokenized and routed at once is TTFT's business, not ITL's), the tokens delivered per
second against what the engines produce, and the CPU the mesh and this client (the load
generator) spend per token, from /proc.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import aiohttp

from bench.common.report import median, percentile
from testkit.mesh import LaunchedMesh
from testkit.sse import stream_completion

PROMPT = "The router keeps a tree of the cached blocks of every worker."
# Every stream must be done by then: a stuck stream fails the run instead of hanging it.
STREAM_TIMEOUT_S = 300


@dataclass
class StreamLoad:
    streams: int
    tokens_per_stream: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    # The worst stream's largest gap over its median gap.
    worst_stream_ratio: float
    delivered_tokens_per_s: float
    mesh_cpu_us_per_token: float
    client_cpu_us_per_token: float


async def one_stream(session: aiohttp.ClientSession, model: str, max_tokens: int,
                     prompt: str = PROMPT) -> tuple[int, float, list[float]]:
    """One streamed completion: (completion tokens per usage, start time, content chunk arrivals)."""
    s = await stream_completion(session, prompt, max_tokens, model=model)
    if s.status != 200 or s.broken is not None:
        raise RuntimeError(s.broken or f"{s.status}: {s.body[:200]}")
    return s.completion_tokens, s.started, s.content_arrivals


async def one_token_completion(session: aiohttp.ClientSession, model: str) -> None:
    """One 1-token completion of PROMPT, read to its end; raises unless it is a 200."""
    async with session.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 1}) as r:
        await r.read()
        if r.status != 200:
            raise RuntimeError(f"{r.status}: {(await r.text())[:200]}")


async def _run(base: str, model: str, streams: int, tokens: int) -> list[tuple[int, float, list[float]]]:
    connector = aiohttp.TCPConnector(limit=streams + 16)
    timeout = aiohttp.ClientTimeout(total=STREAM_TIMEOUT_S)
    async with aiohttp.ClientSession(base, connector=connector, timeout=timeout) as session:
        await one_stream(session, model, 4)  # warm-up: connections, sessions, tokenizer
        # Distinct prompts, so no stream waits for another's identical prefill.
        return await asyncio.gather(*(one_stream(session, model, tokens, f"{i} {PROMPT}") for i in range(streams)))


def stream_load(mesh: LaunchedMesh, model: str, streams: int, tokens: int, all_started: bool = True) -> StreamLoad:
    """`all_started`: ITL from the gaps after every stream has its first token (the steady state);
    otherwise from each stream's gaps after its own first token (for loads whose ramp-up lasts
    longer than a stream)."""
    mesh_before = mesh.cpu()
    client_before = time.process_time()
    results = asyncio.run(_run(mesh.base, model, streams, tokens))
    client_cpu = time.process_time() - client_before
    mesh_cpu = mesh.cpu() - mesh_before
    delivered = sum(t for t, _, _ in results)
    if delivered != streams * tokens:
        raise RuntimeError(f"expected {streams * tokens} tokens, usage says {delivered}")
    ttfts = [(arrivals[0] - started) * 1000 for _, started, arrivals in results if arrivals]
    steady_from = max(arrivals[0] for _, _, arrivals in results if arrivals) if all_started else 0.0
    gaps_all: list[float] = []
    worst = 0.0
    for _, _, arrivals in results:
        steady = [t for t in arrivals if t >= steady_from]
        gaps = [(b - a) * 1000 for a, b in zip(steady, steady[1:])]
        if len(gaps) < 2:
            continue
        gaps_all += gaps
        worst = max(worst, max(gaps) / max(median(gaps), 1e-6))
    # Every token over the time from the first token anywhere to the last one anywhere: streams
    # that start late or straggle lower it, as they lower what a user gets.
    first = min(arrivals[0] for _, _, arrivals in results if arrivals)
    last = max(arrivals[-1] for _, _, arrivals in results if arrivals)
    rate = delivered / (last - first) if last > first else float("nan")
    total = streams * tokens + 4
    return StreamLoad(streams, tokens, percentile(ttfts, 50), percentile(ttfts, 99), percentile(gaps_all, 50),
                      percentile(gaps_all, 99), worst, rate, mesh_cpu / total * 1e6, client_cpu / total * 1e6)
