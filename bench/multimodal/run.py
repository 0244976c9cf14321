"""Images and routing: media-aware routing against media-blind routing on an agent-like image trace.

Mesh: the launcher with WORKERS mocker decode workers (default timing: an 8B model on an H100-class
GPU, with the encoder terms of a ~600M ViT: 2 ms + 15 us a patch) serving a demo vision-language
model built for the benchmark at a real model's image size (448-pixel images: 1,024 patches, 256
image tokens). Trace (workload.py): sessions that resend their screenshots turn after turn behind one
shared agent system prompt, and background one-image requests.

Modes, each on a fresh mesh, its router seeded with the run's seed:
- aware: kv routing; the blocks that hold an image hash with it, at the router as at the workers;
  each decode worker encodes the images it prefills (aggregated encoding);
- aware + encode stage (E/P/D): the same, with ENCODE_WORKERS encode workers: the decode workers
  have each image they would encode encoded there and pull its features over NIXL;
- blind (the baseline): `--no-media-aware-routing`: the router hashes the tokens alone, so no block
  with an image matches and a session's turn sees every worker that served the shared system
  prompt as equally good (what a router that knows nothing of images scores);
- each of the three again with `--cost-model dynamo` (NVIDIA Dynamo's block-count cost, which
  weighs a worker's queued prefill against the blocks a prompt would reuse there; the default
  cached-share rule lets a session's own cached history outweigh any queue, so sessions pile up
  on the workers that hold them).

Figures: prefix reuse (cached over prompt tokens, as the responses' usage says) and its share of the
ideal (one worker with an endless cache, requests in their sending order: every full block seen
before counts); images encoded over images sent (the workers' encoder counters); TTFT p50/p99.
Seeds are paired (both modes get the very same requests); shown as median [min-max] over SEEDS.
Goals: reuse >= 0.9 of ideal; TTFT p99 <= 0.5x blind.
"""

from __future__ import annotations

import asyncio
import random
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench.common.mesh_metrics import metrics_urls
from bench.common.report import bar_plot, median, median_range, save_json, table
from bench.multimodal.workload import Request, Workload, background, session_turns
from testkit import metrics
from testkit.mesh import LaunchedMesh, launched_mesh
from testkit.proc import ROOT
from testkit.sse import Streamed, stream

WORKERS = 4
# KV blocks a worker holds (12,288 tokens): the trace's distinct tokens fill about two workers, so
# sessions must spread and a router must know where each one's screenshots are cached.
GPU_BLOCKS = 768
SEEDS = (1, 2, 3)
BLOCK_SIZE = 16  # the mocker's default
MODEL = "bench-vlm"
MODEL_DIR = ROOT / ".cache" / "bench-multimodal" / "vlm-448"
ENCODE_WORKERS = 2
DYNAMO_COST = ("--cost-model", "dynamo")
ENCODE_STAGE = ("--encode-workers", str(ENCODE_WORKERS))
MODES = {"aware": ("--media-aware-routing",), "blind": ("--no-media-aware-routing",),
         "aware + encode stage": ("--media-aware-routing", *ENCODE_STAGE),
         "aware, dynamo cost": ("--media-aware-routing", *DYNAMO_COST),
         "blind, dynamo cost": ("--no-media-aware-routing", *DYNAMO_COST),
         "aware + encode stage, dynamo cost": ("--media-aware-routing", *ENCODE_STAGE, *DYNAMO_COST)}
BASELINE = "blind"
OUTPUT_TOKENS = 8
LIMIT_S = 120.0
ENCODER_COUNTERS = ("kvmesh_worker_images_encoded_total", "kvmesh_worker_image_encoder_cache_hits_total",
                    "kvmesh_worker_image_kv_hits_total", "kvmesh_worker_image_features_taken_total")


@dataclass
class Run:
    mode: str
    seed: int
    outcomes: dict[str, Streamed] = field(default_factory=dict)
    encoder: dict[str, float] = field(default_factory=dict)

    def ttft_ms(self, q: float) -> float:
        ttfts = sorted(o.ttft_s * 1000 for o in self.outcomes.values() if o.ok)
        return ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] if ttfts else float("nan")

    @property
    def reuse(self) -> float:
        ok = [o for o in self.outcomes.values() if o.ok]
        return sum(o.cached_tokens for o in ok) / max(1, sum(o.prompt_tokens for o in ok))

    @property
    def failures(self) -> int:
        return sum(not o.ok for o in self.outcomes.values())


def ideal_reuse(requests: list[Request], order: list[str]) -> float:
    """Cached over prompt tokens for one worker with an endless cache, in the order sent; each
    prompt made as the mesh makes it (the gateway's request and images, the processor's tokens)."""
    from services.frontend.endpoints import processor_requests
    from services.frontend.images import ImageLimits, ImageLoader
    from services.frontend.schemas import ChatCompletionRequest, parse
    from services.kv_protocol.hashing import chain_from, local_block_hashes
    from services.kv_protocol.media import MediaSpan
    from services.processor.prompt_input import tokenize_now
    from services.processor.tokenizer import ModelTokenizer

    tokenizer = ModelTokenizer(str(MODEL_DIR))
    loader = ImageLoader(ImageLimits())
    by_key = {r.key: r for r in requests}
    seen: set[int] = set()
    cached = total = 0
    for key in order:
        req = parse(ChatCompletionRequest, {"model": MODEL, "messages": by_key[key].messages})
        [msg] = processor_requests(key, req, images=asyncio.run(loader.load(req.image_refs())))
        ids, media = tokenize_now(tokenizer, msg)
        spans = [MediaSpan(m.span.digest, m.span.offset, m.span.length) for m in media]
        chain = chain_from(local_block_hashes(ids, BLOCK_SIZE, media=spans))
        hit = next((i for i, h in enumerate(chain) if h not in seen), len(chain))
        cached += hit * BLOCK_SIZE
        total += len(ids)
        seen.update(chain)
    return cached / max(1, total)


async def drive(base: str, workload: Workload, seed: int, run: Run, order: list[str]) -> None:
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=LIMIT_S)
    async with aiohttp.ClientSession(base, timeout=timeout) as http:

        async def send(request: Request) -> None:
            order.append(request.key)
            body = {"model": MODEL, "messages": request.messages, "max_tokens": OUTPUT_TOKENS, "stream": True,
                    "stream_options": {"include_usage": True}, "ignore_eos": True}
            run.outcomes[request.key] = await stream(http, "/v1/chat/completions", body)

        async def one_session(index: int, start_s: float) -> None:
            await asyncio.sleep(start_s)
            for request in session_turns(workload, seed, index):
                await send(request)
                await asyncio.sleep(workload.think_s)

        async def one_background(request: Request, start_s: float) -> None:
            await asyncio.sleep(start_s)
            await send(request)

        starts = [rng.expovariate(workload.rate_per_s) for _ in range(workload.sessions + workload.background)]
        clock = [sum(starts[: i + 1]) for i in range(len(starts))]
        tasks = [one_session(i, clock[i]) for i in range(workload.sessions)]
        tasks += [one_background(r, clock[workload.sessions + i]) for i, r in enumerate(background(workload, seed))]
        await asyncio.wait_for(asyncio.gather(*tasks), LIMIT_S)


def encoder_counts(mesh: LaunchedMesh) -> dict[str, float]:
    """The decode workers' image counters; `encoded` counts the encode pool's encodings too."""
    found = metrics_urls(mesh, ("decode-worker", "encode-worker"))
    decode = [s for url in found.get("decode-worker", []) for s in metrics.scrape(url)]
    pool = [s for url in found.get("encode-worker", []) for s in metrics.scrape(url)]
    counts = {name: metrics.total(decode, name) for name in ENCODER_COUNTERS}
    counts["encoded"] = counts[ENCODER_COUNTERS[0]] + metrics.total(pool, ENCODER_COUNTERS[0])
    return counts


def one_run(workload: Workload, mode: str, seed: int, order: list[str]) -> Run:
    run = Run(mode, seed)
    flags = ["--engine", "mocker", "--model", str(MODEL_DIR), "--served-model-name", MODEL, "--decode-workers",
             str(WORKERS), "--num-gpu-blocks", str(GPU_BLOCKS), "--seed", str(seed), *MODES[mode]]
    with launched_mesh(*flags) as mesh:
        asyncio.run(drive(mesh.base, workload, seed, run, order))
        run.encoder = encoder_counts(mesh)
    return run


def run() -> None:
    from services.tools.make_demo_vlm import write_demo_vlm

    if not (MODEL_DIR / "config.json").exists():
        write_demo_vlm(Path(MODEL_DIR), image_size=448)
    workload = Workload()
    runs: list[Run] = []
    ideals: dict[int, float] = {}
    for seed in SEEDS:
        for mode in MODES:
            order: list[str] = []
            runs.append(one_run(workload, mode, seed, order))
            if mode == BASELINE:
                requests = [r for s in range(workload.sessions) for r in session_turns(workload, seed, s)]
                ideals[seed] = ideal_reuse(requests + background(workload, seed), order)
    report(runs, ideals)


def report(runs: list[Run], ideals: dict[int, float]) -> None:
    blind_p99 = {r.seed: r.ttft_ms(0.99) for r in runs if r.mode == BASELINE}
    rows = []
    for mode in MODES:
        mine = [r for r in runs if r.mode == mode]
        # Every image of every prompt a decode worker prefilled is one of: encoded there, in its
        # encoder cache (features it took from the encode pool included), or in cached blocks.
        sent = [sum(r.encoder[name] for name in ENCODER_COUNTERS[:3]) for r in mine]
        rows.append([
            mode,
            median_range([r.reuse for r in mine], "{:.2f}"),
            median_range([r.reuse / ideals[r.seed] for r in mine], "{:.2f}"),
            median_range([r.encoder["encoded"] / max(1, s) for r, s in zip(mine, sent, strict=True)], "{:.2f}"),
            median_range([r.ttft_ms(0.5) for r in mine], "{:.0f}"),
            median_range([r.ttft_ms(0.99) for r in mine], "{:.0f}"),
            median_range([r.ttft_ms(0.99) / blind_p99[r.seed] for r in mine], "{:.2f}"),
            sum(r.failures for r in mine),
        ])
    table(f"multimodal: {WORKERS} mocker workers, seeds {list(SEEDS)}, median [min-max]; ideal reuse "
          f"{statistics.median(ideals.values()):.2f}; goals: reuse >= 0.9 of ideal, TTFT p99 <= 0.5x blind",
          ["mode", "reuse", "of ideal", "images encoded / sent", "TTFT p50 ms", "TTFT p99 ms", "p99 vs blind",
           "failed"], rows)
    bar_plot("multimodal_ttft", "TTFT by routing mode (median over seeds)", ["p50", "p99"],
             {mode: [median([r.ttft_ms(q) for r in runs if r.mode == mode]) for q in (0.5, 0.99)] for mode in MODES},
             "ms")
    save_json("multimodal", {"ideal": ideals, "runs": [
        {"mode": r.mode, "seed": r.seed, "reuse": r.reuse, "ttft_p50_ms": r.ttft_ms(0.5),
         "ttft_p99_ms": r.ttft_ms(0.99), "encoder": r.encoder, "failures": r.failures} for r in runs]})
