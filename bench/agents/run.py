"""Agent sessions: session affinity with KV retention across the tool call, against plain kv routing.

Mesh: the launcher with WORKERS mocker decode workers timed as an 8B model on an H100 (sped up SPEEDUP
times: the background keeps them busy enough that queues matter, at a request rate this 2-core machine
can send), each with NUM_GPU_BLOCKS device blocks of 16 tokens and a host tier HOST_KV_BLOCKS (3x) below
it, 128 KiB of KV per token over a 50 GB/s host link. Sizes: the sessions on one worker hold ~10-12k
blocks of history at their peak (16 of the 64, 6-12 turns of 500-2,000 tokens; ended sessions stay
bound for the TTL), so the device holds only part of it and device + host all of it with room for the
background; the background (BACKGROUND_RATE prompts of 1-3k tokens a second) pushes about as much through
each worker in a mean gap (~10 s), so under plain LRU a session idle for long is evicted from the device
and, when the gap is long, from the host tier too: about a fifth of later turns lose their prefix (the
"prefix lost" and "reused from host" columns). The mocker's own retention budgets (a quarter of the
device for pins, half the host tier for protected chains) are its defaults, not set here.

Modes (MODES), each on a fresh mesh, the same trace per seed (paired):
- sessions: the router binds each session to its worker (`--session-affinity soft`, `--session-ttl`
  default) and asks the worker to keep the session's prefix while it is idle: pinned on the device
  within the worker's pin budget, else in the host tier, and loaded back as the next turn comes;
- plain-kv (the baseline): `--session-affinity off`, plain kv routing; workers keep nothing on purpose;
- sessions-host-only (run only when named in --modes): sessions with `--session-pin-blocks 0`, retention
  in the host tier alone.

Figures (report.py): reused prompt share (cached_tokens over prompt tokens, as the responses' usage says)
of later turns (after each session's first) and overall, against the trace's ideal; TTFT p50/p99 of
later turns; completed and failed; the background's TTFT p50 (what retention costs other traffic).
Goals: sessions' reuse >= 0.9 of ideal, and later turns' TTFT p99 <= 0.5x plain-kv's (paired per seed).

Run: `make bench ARGS="--only agents"` (2 seeds, about 14 minutes, then run_clients.py's run), or
`python -m bench.agents --quick` (a small trace, one seed, about 2 minutes) / `--seeds 3` /
`--modes plain-kv` (cli.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass

from bench.agents import mesh_counters
from bench.agents.drive import drive
from bench.agents.plot import plot
from bench.agents.record import Run
from bench.agents.report import BASELINE, report
from bench.agents.workload import AgentWorkload, Trace, trace
from testkit.mesh import launched_mesh
from testkit.proc import ROOT
from bench.common.report import save_json
from bench.tiers.run import MODEL, MODEL_DIR
from services.tools.make_demo_model import DemoModelSpec, ensure_demo_model

WORKERS = 4
BLOCK_SIZE = 16
NUM_GPU_BLOCKS = 4096  # 65,536 tokens a worker
HOST_KV_BLOCKS = 3 * NUM_GPU_BLOCKS
KV_BYTES_PER_TOKEN = 131_072  # an 8B Llama: 32 layers x 8 KV heads x 128 x (K, V) x bf16
MAX_CONTEXT = 131_072  # the 128k demo model (bench/tiers' own)
SPEEDUP = 2.0
BACKGROUND_RATE = 16.0  # prompts/s, 32k tokens/s over the mesh
# Per mode, the router flags; both on kv routing.
MODES: dict[str, tuple[str, ...]] = {
    "sessions": ("--session-affinity", "soft"),
    BASELINE: ("--session-affinity", "off"),
    # Not run by default (--modes): retention in the host tier alone, no device pins.
    "sessions-host-only": ("--session-affinity", "soft", "--session-pin-blocks", "0"),
}
DEFAULT_MODES = ("sessions", BASELINE)
SEEDS = (0, 1)
SEND_LIMIT_S = 200.0  # no turn is sent later; the trace plans its last at ~170 s
RESULT = "agents_sessions"
# Every request's outcome of each run, for a closer look than the tables (not a result: kept out of git).
OUTCOMES_DIR = ROOT / ".cache" / "bench-agents"


@dataclass(frozen=True)
class Scale:
    workload: AgentWorkload
    seeds: tuple[int, ...]
    send_limit_s: float


# Background prompts of 1-3k tokens: many small ones rather than few large, so that no single one holds up a
# worker's step for long (the sessions' TTFT tail is then their own prefill, not a stranger's).
FULL = Scale(AgentWorkload(background_rate_per_s=BACKGROUND_RATE, min_background_prompt=1024,
                           max_background_prompt=3072), SEEDS, SEND_LIMIT_S)
# For development: 16 short sessions with short gaps, one seed.
QUICK = Scale(AgentWorkload(sessions=16, min_turns=3, max_turns=5, min_gap_s=1.0, max_gap_s=6.0, start_spread_s=5.0,
                            background_rate_per_s=BACKGROUND_RATE / 2, background_span_s=60.0), (0,), 60.0)


def mesh_flags(mode: str, seed: int) -> list[str]:
    return ["--engine", "mocker", "--timing", "h100-8b", "--speedup", f"{SPEEDUP:g}", "--decode-workers", str(WORKERS),
            "--num-gpu-blocks", str(NUM_GPU_BLOCKS), "--block-size", str(BLOCK_SIZE),
            "--host-kv-blocks", str(HOST_KV_BLOCKS), "--kv-bytes-per-token", str(KV_BYTES_PER_TOKEN),
            "--model", str(MODEL_DIR), "--served-model-name", MODEL, "--router-mode", "kv", *MODES[mode],
            "--seed", str(seed)]


def one_run(mode: str, sent: Trace, send_limit_s: float) -> Run:
    started = time.monotonic()
    with launched_mesh(*mesh_flags(mode, sent.seed)) as mesh:
        urls = mesh_counters.find(mesh)
        driven = asyncio.run(drive(mesh.base, sent, MODEL, BLOCK_SIZE, send_limit_s))
        counters = mesh_counters.read(urls)
        cpu = mesh.cpu_by_component()
    OUTCOMES_DIR.mkdir(parents=True, exist_ok=True)
    (OUTCOMES_DIR / f"{mode}-{sent.seed}.json").write_text(json.dumps([asdict(o) for o in driven.outcomes]))
    return Run(mode, sent.seed, driven, counters, cpu, time.monotonic() - started, BLOCK_SIZE)


def run(scale: Scale = FULL, modes: tuple[str, ...] = DEFAULT_MODES) -> dict:
    ensure_demo_model(MODEL_DIR, DemoModelSpec(max_context=MAX_CONTEXT))
    started = time.monotonic()
    runs: list[Run] = []
    for seed in scale.seeds:
        sent = trace(scale.workload, seed)
        print(f"agents: seed {seed}: {len(sent.sessions)} sessions, {sent.turns()} turns, "
              f"{len(sent.background)} background prompts planned, last turn planned at "
              f"{sent.planned_span_s():.0f} s", flush=True)
        for mode in modes:  # alternating within a seed, so a slow spell of the machine hits both
            print(f"agents: seed {seed}, {mode} ...", flush=True)
            runs.append(one_run(mode, sent, scale.send_limit_s))
            r = runs[-1]
            f = r.figures()
            print(f"  {f['turns_done']:.0f} turns done, {f['turns_failed']:.0f} failed; later turns: reuse "
                  f"{f['reuse_later']:.1%} of ideal {f['ideal_later']:.1%}, TTFT p50 {f['ttft_later_p50_ms']:.0f} ms "
                  f"p99 {f['ttft_later_p99_ms']:.0f} ms, prefix lost {f['lost_share']:.0%}; background "
                  f"{f['background_done']:.0f} done, TTFT p50 {f['background_ttft_p50_ms']:.0f} ms ({r.seconds:.0f} s; "
                  f"mesh CPU {sum(r.cpu_s.values()):.0f} s)",
                  flush=True)
    seconds = time.monotonic() - started
    section = report(runs, list(modes), scale.seeds, scale.workload, seconds, describe_mesh())
    plot(runs, list(modes))
    data = {"mesh": {"workers": WORKERS, "block_size": BLOCK_SIZE, "num_gpu_blocks": NUM_GPU_BLOCKS,
                     "host_kv_blocks": HOST_KV_BLOCKS, "kv_bytes_per_token": KV_BYTES_PER_TOKEN, "speedup": SPEEDUP},
            "modes": {m: list(MODES[m]) for m in modes}, "baseline": BASELINE, "send_limit_s": scale.send_limit_s,
            **section}
    save_json(RESULT, data)
    return data


def describe_mesh() -> str:
    return (f"{WORKERS} mocker workers (h100-8b timing / {SPEEDUP:g}), {NUM_GPU_BLOCKS} device + {HOST_KV_BLOCKS} host "
            f"blocks of {BLOCK_SIZE} tokens each")
