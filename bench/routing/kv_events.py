"""Routing with KV events on, off, and with a worker whose events go silent, against NVIDIA Dynamo 1.6.1.

Workload (one per seed, the same trace for every system): 16 shared prefixes of 400 words (text, random
words of a fixed vocabulary), each request one of them (Zipf-skewed, s = ZIPF_S) plus a unique 30-word
suffix, OUTPUT_TOKENS output tokens, Poisson arrivals at RATE_PER_S for LOAD_S seconds, after a warm-up of
every prefix once (not counted). 4 mocker workers of NUM_GPU_BLOCKS blocks of 16 tokens each: about 7
prompts fit on a worker, so all 16 prefixes fit only where the router partitions them.

Scenarios:
- (a) kvmesh, KV events on;
- (b) kvmesh, `--kv-events off`: the router predicts each worker's cache from the prompts it routed there;
- (c) kvmesh, events on, one worker's publication silenced halfway through the load (SIGUSR2 to its
  process: the stream stays open and says nothing) and turned on again PUBLISH_BEFORE_END_S before the end;
  the router's metrics sampled every SAMPLE_EVERY_S (kv_source and recent index accuracy per worker) give
  when the fallback to prediction engaged and when it released;
- (d) Dynamo with KV events; (e) Dynamo `--no-router-kv-events` (its approximate routing).

kvmesh's mocker workers share one process under the launcher, so the mesh runs 3 of them under the
launcher and the fourth in a process of its own (same command line, `--num-workers 1`), the one the drill
silences; (a) and (b) run the same layout. Reuse is the share of prompt tokens the workers report cached
(usage.prompt_tokens_details.cached_tokens), TTFT is measured by the client, both over the requests
after the warm-up.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench.common.client import ReuseTally
from bench.common.mesh_metrics import metrics_urls
from testkit import metrics
from testkit.mesh import READY, LaunchedMesh, launched_mesh
from testkit.proc import Proc
from testkit.sse import stream_completion
from bench.common.report import percentile
from bench.common.side_venv import Unavailable
from bench.hot_path import dynamo
from services.mesh.discovery import DECODE_WORKER, ROUTER
from services.tools.make_demo_model import ensure_demo_model
from testkit.proc_stat import argv as proc_argv

MODEL = "kvmesh-demo"
WORKERS = 4
PREFIXES = 16
PREFIX_WORDS = 400
SUFFIX_WORDS = 30
ZIPF_S = 0.8
OUTPUT_TOKENS = 4
BLOCK_SIZE = 16
# A prompt is about 500 tokens (31 blocks): 224 blocks hold about 7 of them.
NUM_GPU_BLOCKS = 224
SPEEDUP = 1.0
RATE_PER_S = 8.0
LOAD_S = 60.0
WARMUP_CONCURRENCY = 4
REQUEST_TIMEOUT_S = 30.0
SEEDS = (0, 1)
# Dynamo's runs for the second seed only while the part is within this budget.
TIME_BUDGET_S = 13 * 60
SILENCE_AT_S = LOAD_S / 2
PUBLISH_BEFORE_END_S = 14.0
SAMPLE_EVERY_S = 0.5
ENGAGE_GOAL_S = 10.0
REUSE_TOLERANCE = 0.05
VOCABULARY = Path(__file__).resolve().parents[2] / "services" / "tools" / "corpus.txt"

KVMESH, DYNAMO = "kvmesh", "Dynamo 1.6.1"
SCENARIOS = {
    "a": (KVMESH, "events on"),
    "b": (KVMESH, "--kv-events off"),
    "c": (KVMESH, "events on, 1 worker silenced"),
    "d": (DYNAMO, "KV events"),
    "e": (DYNAMO, "--no-router-kv-events"),
}


# -- the workload ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    seed: int
    warmup: list[str]
    # (seconds after the load's start, prompt)
    arrivals: list[tuple[float, str]]


def vocabulary() -> list[str]:
    return sorted(set(re.findall(r"[a-z]+", VOCABULARY.read_text().lower())))


def workload(seed: int) -> Workload:
    words = vocabulary()
    rng = random.Random(seed)
    prefixes = [" ".join(rng.choice(words) for _ in range(PREFIX_WORDS)) for _ in range(PREFIXES)]
    weights = [1 / (rank + 1) ** ZIPF_S for rank in range(PREFIXES)]
    rng.shuffle(prefixes)  # which prefix is the popular one depends on the seed too

    def prompt(prefix: str, n: int) -> str:
        # The request number first: no two suffixes share a block.
        return f"{prefix} request {n} " + " ".join(rng.choice(words) for _ in range(SUFFIX_WORDS))

    warmup = [prompt(p, -1 - i) for i, p in enumerate(prefixes)]
    arrivals: list[tuple[float, str]] = []
    t = rng.expovariate(RATE_PER_S)
    while t < LOAD_S:
        arrivals.append((t, prompt(rng.choices(prefixes, weights)[0], len(arrivals))))
        t += rng.expovariate(RATE_PER_S)
    return Workload(seed, warmup, arrivals)


# -- one run --------------------------------------------------------------------------------------


@dataclass
class Sample:
    t_s: float  # after the load's start
    source: dict[str, float]  # kvmesh_router_kv_source per worker (0 events, 1 predicted)
    accuracy: dict[str, float]  # kvmesh_router_index_recent_accuracy per worker
    switches: dict[str, float]  # kvmesh_router_kv_source_switches "worker source reason" -> count


@dataclass
class Run:
    scenario: str
    seed: int
    tally: ReuseTally = field(default_factory=ReuseTally)
    usage_reports_cache: bool = False  # some response's usage carried prompt_tokens_details.cached_tokens
    samples: list[Sample] = field(default_factory=list)
    workers: list[str] = field(default_factory=list)
    silenced: str = ""
    silenced_at_s: float | None = None
    published_at_s: float | None = None
    wall_s: float = 0.0

    @property
    def system(self) -> str:
        return SCENARIOS[self.scenario][0]

    def figures(self) -> dict[str, float]:
        return {"reuse": self.tally.hit_rate, "ttft_p50_ms": percentile(self.tally.ttft_ms, 50),
                "ttft_p99_ms": percentile(self.tally.ttft_ms, 99)}

    def _first(self, after: float | None, until: float | None, predicted: bool) -> float | None:
        if after is None:
            return None
        for s in self.samples:
            if s.t_s >= after and (until is None or s.t_s < until) and s.source.get(self.silenced) == predicted:
                return s.t_s - after
        return None

    @property
    def engaged_after_s(self) -> float | None:
        """Seconds from the silence to the first sample with the silenced worker predicted."""
        return self._first(self.silenced_at_s, self.published_at_s, True)

    @property
    def released_after_s(self) -> float | None:
        """Seconds from publishing again to the first sample with the worker back on its events."""
        return self._first(self.published_at_s, None, False)

    def switch_reasons(self) -> list[str]:
        last = self.samples[-1].switches if self.samples else {}
        return sorted(f"{k} x{v:g}" for k, v in last.items() if k.startswith(self.silenced) and v)


Action = Callable[[], None]


async def drive(base: str, load: Workload, run: Run, metrics_url: str | None = None,
                actions: Sequence[tuple[float, Action]] = ()) -> None:
    """The warm-up, then the load's arrivals on their clock; `actions` at their times; the router's
    metrics sampled meanwhile when `metrics_url` is given."""
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(base, timeout=timeout) as session:
        warm = asyncio.Semaphore(WARMUP_CONCURRENCY)

        async def warmup(prompt: str) -> None:
            async with warm:
                await stream_completion(session, prompt, OUTPUT_TOKENS, model=MODEL)

        await asyncio.wait_for(asyncio.gather(*(warmup(p) for p in load.warmup)), 4 * REQUEST_TIMEOUT_S)

        async def one(prompt: str) -> None:
            run.tally.add(await stream_completion(session, prompt, OUTPUT_TOKENS, model=MODEL))

        t0 = time.monotonic()
        background = [asyncio.create_task(_act(t0, actions))]
        if metrics_url is not None:
            background.append(asyncio.create_task(_sample(session, metrics_url, t0, run)))
        tasks: list[asyncio.Task[None]] = []
        for at, prompt in load.arrivals:
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            tasks.append(asyncio.create_task(one(prompt)))
        done, pending = await asyncio.wait(tasks, timeout=REQUEST_TIMEOUT_S + 5) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        run.tally.failures += len(pending)
        run.wall_s = time.monotonic() - t0
        await asyncio.sleep(SAMPLE_EVERY_S * 2)  # a last sample after the load
        for task in background:
            task.cancel()
        await asyncio.gather(*background, *pending, return_exceptions=True)
        run.usage_reports_cache = run.usage_reports_cache or run.tally.cached_tokens > 0


async def _act(t0: float, actions: Sequence[tuple[float, Action]]) -> None:
    for at, action in sorted(actions, key=lambda a: a[0]):
        await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
        action()


async def _sample(session: aiohttp.ClientSession, url: str, t0: float, run: Run) -> None:
    while True:
        t = time.monotonic() - t0
        try:
            async with session.get(url) as r:
                text = await r.text()
            run.samples.append(parse_sample(t, text))
        except (aiohttp.ClientError, TimeoutError, ValueError):
            pass
        await asyncio.sleep(max(0.0, t0 + t + SAMPLE_EVERY_S - time.monotonic()))


def parse_sample(t_s: float, text: str) -> Sample:
    samples = metrics.parse(text)

    def per_worker(name: str) -> dict[str, float]:
        return {worker: v for (worker,), v in metrics.by_labels(samples, name, "worker_id").items()}

    switches = metrics.by_labels(samples, "kvmesh_router_kv_source_switches_total", "worker_id", "source", "reason")
    return Sample(t_s, per_worker("kvmesh_router_kv_source"), per_worker("kvmesh_router_index_recent_accuracy"),
                  {" ".join(key): v for key, v in switches.items()})


# -- the systems ----------------------------------------------------------------------------------


@dataclass
class KvMesh:
    base: str
    router_metrics: str
    solo_pid: int  # the process of the fourth worker, alone (the drill's target)
    solo_id: str
    workers: list[str]


@contextmanager
def kvmesh(kv_events: str, seed: int) -> Iterator[KvMesh]:
    """3 mocker workers under the launcher, the fourth in a process of its own on the same command line."""
    with launched_mesh("--engine", "mocker", "--decode-workers", str(WORKERS - 1), "--num-gpu-blocks",
                       str(NUM_GPU_BLOCKS), "--block-size", str(BLOCK_SIZE), "--speedup", str(SPEEDUP),
                       "--router-mode", "kv", "--kv-events", kv_events, "--seed", str(seed)) as mesh:
        argv = solo_argv(mesh)
        solo = Proc(argv, "decode-worker (alone)")
        try:
            ids = solo.wait_for(READY[DECODE_WORKER], 120).group(1).split()
            urls = metrics_urls(mesh, (ROUTER,)).get(ROUTER, [])
            if not urls:
                raise RuntimeError("found no /metrics of the kv-router")
            workers = _wait_for_workers(urls[0], WORKERS, 60)
            yield KvMesh(mesh.base, urls[0], solo.popen.pid, ids[0], workers)
        finally:
            code = solo.stop(30)
            if code not in (0, -signal.SIGTERM):
                print(f"note: the lone worker exited {code}:\n{solo.tail(20)}", flush=True)


def solo_argv(mesh: LaunchedMesh) -> list[str]:
    """The launcher's mocker worker process's command line, for one worker."""
    pids = mesh.pids(DECODE_WORKER)
    if not pids:
        raise RuntimeError(f"the launcher started no {DECODE_WORKER}: {mesh.children}")
    argv = proc_argv(pids[0])
    if "--num-workers" not in argv:
        raise RuntimeError(f"no --num-workers in the worker's command line: {argv}")
    argv[argv.index("--num-workers") + 1] = "1"
    return argv


def _wait_for_workers(url: str, count: int, timeout_s: float) -> list[str]:
    """The workers the router follows (its kv_source gauge's), once there are `count`."""
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(url, timeout=5) as r:
            workers = sorted(parse_sample(0, r.read().decode()).source)
        if len(workers) >= count:
            return workers
        if time.monotonic() > deadline:
            raise TimeoutError(f"the router follows {len(workers)} workers, not {count}, after {timeout_s:g}s")
        time.sleep(0.25)


def run_kvmesh(scenario: str, load: Workload) -> Run:
    run = Run(scenario, load.seed)
    with kvmesh("off" if scenario == "b" else "on", load.seed) as mesh:
        run.workers, run.silenced = mesh.workers, mesh.solo_id
        actions: list[tuple[float, Action]] = []
        if scenario == "c":

            def silence() -> None:
                run.silenced_at_s = SILENCE_AT_S
                os.kill(mesh.solo_pid, signal.SIGUSR2)

            def publish() -> None:
                run.published_at_s = LOAD_S - PUBLISH_BEFORE_END_S
                os.kill(mesh.solo_pid, signal.SIGUSR2)

            actions = [(SILENCE_AT_S, silence), (LOAD_S - PUBLISH_BEFORE_END_S, publish)]
        asyncio.run(drive(mesh.base, load, run, mesh.router_metrics, actions))
    return run


def run_dynamo(scenario: str, load: Workload) -> Run:
    run = Run(scenario, load.seed)
    flags = ["--no-router-kv-events"] if scenario == "e" else []
    with dynamo.served(ensure_demo_model(), MODEL, workers=WORKERS, speedup=SPEEDUP, num_gpu_blocks=NUM_GPU_BLOCKS,
                       frontend_flags=flags) as base:
        asyncio.run(drive(base, load, run))
    return run


# -- the report -----------------------------------------------------------------------------------


def measure() -> tuple[list[Run], str]:
    """Every scenario's runs, and why any were left out (kv_events_report.py reports them)."""
    started = time.monotonic()
    runs: list[Run] = []
    skipped = ""
    for seed in SEEDS:
        load = workload(seed)
        for scenario in ("a", "b", "c"):
            print(f"kv events: ({scenario}) {SCENARIOS[scenario][1]}, seed {seed} ...", flush=True)
            runs.append(run_kvmesh(scenario, load))
        if skipped:
            continue
        if seed != SEEDS[0] and time.monotonic() - started > TIME_BUDGET_S:
            skipped = f"Dynamo's runs for seed {seed} left out: the part is over its {TIME_BUDGET_S:g} s budget"
            continue
        for scenario in ("d", "e"):
            print(f"kv events: ({scenario}) Dynamo {SCENARIOS[scenario][1]}, seed {seed} ...", flush=True)
            try:
                runs.append(run_dynamo(scenario, load))
            except Unavailable as exc:
                skipped = f"Dynamo {dynamo.VERSION} unavailable, kvmesh reported alone: {exc}"
                print(f"note: {skipped}", flush=True)
                break
    print(f"kv events: {time.monotonic() - started:.0f} s", flush=True)
    return runs, skipped

