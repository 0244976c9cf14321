"""The hot path at scale, to size a cluster (part of `make bench ARGS="--only hot-path"`).

- 4,096 streams over 8 mocker decode workers on the fixed 20 ms step (one 8-GPU node's worth of
  decode): per frontend and processor count, the ITL a client sees and what the mesh and the
  load generator spend per token, so a reader can tell how many cores such a node's mesh needs.
- Requests per second per processor on 32k-token prompts (zero-compute engine): tokenizing and
  templating long prompts is the processor's work, and adding processors must raise it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from bench.mesh_overhead import drive
from testkit.mesh import LaunchedMesh, launched_mesh
from bench.common.report import table
from bench.hot_path.stream_load import StreamLoad, stream_load
from services.tools.make_demo_model import DemoModelSpec, ensure_demo_model

WIDE_STREAMS, WIDE_WORKERS, WIDE_TOKENS = 4096, 8, 40
# (frontends, processors) tried for the wide run; the machine has 2 cores.
WIDE_LAYOUTS = ((1, 1), (2, 2))
LONG_PROMPT_TOKENS, LONG_REQUESTS, LONG_CONCURRENCY = 32_768, 48, 8
LONG_MODEL_DIR = Path(".cache/models/kvmesh-demo-40k")
LONG_PROCESSORS = (1, 2)
LONG_TIME_LIMIT_S = 120.0


@dataclass
class LongPrompts:
    processors: int
    rps: float
    p50_ms: float
    # CPU ms per request of each component (all its replicas), and of the load generator.
    cpu_ms: dict[str, float]


def wide(frontends: int, processors: int) -> StreamLoad:
    print(f"hot path: {WIDE_STREAMS} streams over {WIDE_WORKERS} workers, {frontends} frontend(s), "
          f"{processors} processor(s) ...", flush=True)
    with launched_mesh("--engine", "mocker", "--timing", "fixed-step-20ms", "--decode-workers", str(WIDE_WORKERS),
                       "--max-num-seqs", str(WIDE_STREAMS // WIDE_WORKERS), "--num-gpu-blocks", "16384",
                       "--frontends", str(frontends), "--processors", str(processors),
                       "--max-inflight", str(2 * WIDE_STREAMS), timeout_s=300) as mesh:
        # Thousands of prompts ramp up for longer than a stream lasts: each stream's own gaps count.
        return stream_load(mesh, "kvmesh-demo", WIDE_STREAMS, WIDE_TOKENS, all_started=False)


def _long_text(model_dir: Path, tokens: int) -> str:
    """A text of about `tokens` tokens under the demo tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    unit = "The router keeps a tree of the cached blocks of every worker, and a planner sizes the pools. "
    per_unit = len(tokenizer.encode(unit, add_special_tokens=False))
    return unit * (tokens // per_unit)


def long_prompts(processors: int, text: str) -> LongPrompts:
    print(f"hot path: {LONG_PROMPT_TOKENS}-token prompts, {processors} processor(s) ...", flush=True)
    with launched_mesh("--engine", "mocker", "--speedup", "inf", "--decode-workers", "1", "--model",
                       str(LONG_MODEL_DIR), "--served-model-name", "kvmesh-demo-40k", "--num-gpu-blocks", "65536",
                       "--processors", str(processors)) as mesh:
        counter = iter(range(10**9))

        async def run() -> LongPrompts:
            timeout = aiohttp.ClientTimeout(total=LONG_TIME_LIMIT_S)
            async with aiohttp.ClientSession(mesh.base, timeout=timeout) as session:
                async def one() -> None:
                    # A distinct first word: every prompt is tokenized and routed as new.
                    body = {"model": "kvmesh-demo-40k", "prompt": f"{next(counter)} {text}", "max_tokens": 1}
                    async with session.post("/v1/completions", json=body) as r:
                        if r.status != 200:
                            raise RuntimeError(f"{r.status}: {(await r.text())[:200]}")
                        await r.read()

                await one()  # warm-up
                before = _cpu(mesh)
                level = await drive(LONG_CONCURRENCY, LONG_REQUESTS, one, LONG_TIME_LIMIT_S)
                used = {k: (v - before[k]) / level.requests * 1000 for k, v in _cpu(mesh).items()}
                return LongPrompts(processors, level.rps, level.p50, used)

        return asyncio.run(run())


def _cpu(mesh: LaunchedMesh) -> dict[str, float]:
    """CPU seconds so far per component (replicas summed), and the load generator's as "client"."""
    return {"client": time.process_time(), **mesh.cpu_by_component()}


def run_scale() -> dict:
    wide_runs = [(f, p, wide(f, p)) for f, p in WIDE_LAYOUTS]
    ideal = WIDE_STREAMS / 0.020
    table(f"{WIDE_STREAMS} streams x {WIDE_TOKENS} tokens over {WIDE_WORKERS} mocker workers, 20 ms step "
          f"(ideal {ideal:,.0f} tokens/s; kvmesh on this 2-core machine)",
          ["frontends", "processors", "TTFT p50 ms", "ITL p50 ms", "ITL p99 ms", "delivered tokens/s", "of ideal",
           "mesh CPU us/token", "client CPU us/token"],
          [[f, p, r.ttft_p50_ms, r.itl_p50_ms, r.itl_p99_ms, r.delivered_tokens_per_s,
            f"{r.delivered_tokens_per_s / ideal:.2f}", r.mesh_cpu_us_per_token, r.client_cpu_us_per_token]
           for f, p, r in wide_runs])
    ensure_demo_model(LONG_MODEL_DIR, DemoModelSpec(max_context=40_960))
    started = time.perf_counter()
    text = _long_text(LONG_MODEL_DIR, LONG_PROMPT_TOKENS)
    print(f"hot path: long prompt built in {time.perf_counter() - started:.1f}s", flush=True)
    long_runs = [long_prompts(p, text) for p in LONG_PROCESSORS]
    base = long_runs[0].rps
    parts = ("frontend", "processor", "kv-router", "decode-worker", "client")
    table(f"{LONG_PROMPT_TOKENS}-token prompts, 1-token completions, concurrency {LONG_CONCURRENCY} (kvmesh); "
          "CPU ms per request per component",
          ["processors", "requests/s", "vs 1 processor", "p50 ms", *parts],
          [[r.processors, r.rps, f"{r.rps / base:.2f}x", r.p50_ms, *(r.cpu_ms.get(p, float("nan")) for p in parts)]
           for r in long_runs])
    return {"wide": [{"frontends": f, "processors": p, **r.__dict__} for f, p, r in wide_runs],
            "long_prompts": [r.__dict__ for r in long_runs]}
