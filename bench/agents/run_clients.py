"""Agent sessions from what clients already send: Claude Code and Codex sessions (their recorded
requests, client_sessions.py) over the Messages and Responses APIs, session routing against plain
kv routing.

The mesh is run.py's (WORKERS mocker workers timed as an 8B model on an H100, a host tier below
each device) with the served context the clients need and answers that end (--answer-tokens);
the background is run.py's too, at half its rate (these prompts are rendered and tokenized by
the processors, heavier on this machine than token ids). Sessions are routed by the ids the
clients send themselves (Claude Code's metadata session, Codex's prompt_cache_key): no header.

Figures and goals as run.py's (report.py): later turns' reuse against the ideal (here the
longest prefix each prompt shares with any prompt sent before: the clients' static prefix across
sessions, the history within one) and their TTFT, sessions against plain kv, paired per seed.

Run: `make bench ARGS="--only agents"` runs it after the synthetic trace; alone,
`python -m bench.agents --clients` (`--quick` for a small one).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, replace

from bench.agents import mesh_counters
from bench.agents.client_sessions import ClientSession, ClientWorkload, Prompts, SeenBlocks, sessions
from bench.agents.drive_clients import drive_clients
from bench.agents.plot import plot
from bench.agents.record import Run
from bench.agents.report import report
from bench.agents.run import (
    BACKGROUND_RATE,
    BLOCK_SIZE,
    DEFAULT_MODES,
    MAX_CONTEXT,
    MODEL,
    MODEL_DIR,
    OUTCOMES_DIR,
    SEEDS,
    describe_mesh,
    mesh_flags,
)
from bench.agents.workload import AgentWorkload, Trace, trace
from bench.common.report import save_json
from testkit.mesh import launched_mesh
from services.tools.make_demo_model import DemoModelSpec, ensure_demo_model

RESULT = "agents_clients"
SEND_LIMIT_S = 150.0


@dataclass(frozen=True)
class ClientScale:
    workload: ClientWorkload
    background: AgentWorkload
    seeds: tuple[int, ...]
    send_limit_s: float


FULL = ClientScale(ClientWorkload(), AgentWorkload(background_rate_per_s=BACKGROUND_RATE / 2, min_background_prompt=1024,
                                                   max_background_prompt=3072, background_span_s=SEND_LIMIT_S),
                   SEEDS, SEND_LIMIT_S)
QUICK = ClientScale(ClientWorkload(sessions_per_client=4, extra_turns=2, max_gap_s=4.0, start_spread_s=5.0),
                    AgentWorkload(background_rate_per_s=2.0, background_span_s=60.0), (0,), 60.0)


def one_run(mode: str, seed: int, planned: list[ClientSession], chains: dict[str, list[list[int]]],
            background: Trace, scale: ClientScale) -> Run:
    started = time.monotonic()
    flags = [*mesh_flags(mode, seed), "--max-model-len", str(MAX_CONTEXT),
             "--answer-tokens", str(scale.workload.answer_tokens)]
    prompts = SeenBlocks(BLOCK_SIZE)
    with launched_mesh(*flags) as mesh:
        urls = mesh_counters.find(mesh)
        driven = asyncio.run(drive_clients(mesh.base, planned, chains, prompts, background, MODEL, scale.send_limit_s))
        counters = mesh_counters.read(urls)
        cpu = mesh.cpu_by_component()
    OUTCOMES_DIR.mkdir(parents=True, exist_ok=True)
    (OUTCOMES_DIR / f"clients-{mode}-{seed}.json").write_text(json.dumps([asdict(o) for o in driven.outcomes]))
    return Run(mode, seed, driven, counters, cpu, time.monotonic() - started, BLOCK_SIZE)


def block_chains(planned: list[ClientSession]) -> dict[str, list[list[int]]]:
    """Every turn's prompt as the gateway renders and tokenizes it, as block chains (up front, so
    the client does no tokenizing while it drives)."""
    prompts = Prompts(MODEL_DIR, MODEL, BLOCK_SIZE)
    return {s.id: [prompts.chain(prompts.token_ids(t.path, t.body)) for t in s.turns] for s in planned}


def run_clients(scale: ClientScale = FULL, modes: tuple[str, ...] = DEFAULT_MODES) -> dict:
    ensure_demo_model(MODEL_DIR, DemoModelSpec(max_context=MAX_CONTEXT))
    started = time.monotonic()
    runs: list[Run] = []
    for seed in scale.seeds:
        planned = sessions(scale.workload, seed)
        chains = block_chains(planned)
        turns = sum(len(s.turns) for s in planned)
        tokens = sum(len(c[-1]) for c in chains.values()) * BLOCK_SIZE
        background = trace(replace(scale.background, sessions=1), seed)
        print(f"agents (clients): seed {seed}: {len(planned)} sessions (Claude Code and Codex), {turns} turns, last "
              f"prompts {tokens / len(planned) / 1000:.0f}k tokens on average; {len(background.background)} background "
              f"prompts planned", flush=True)
        for mode in modes:
            print(f"agents (clients): seed {seed}, {mode} ...", flush=True)
            runs.append(one_run(mode, seed, planned, chains, background, scale))
            f = runs[-1].figures()
            print(f"  {f['turns_done']:.0f} turns done, {f['turns_failed']:.0f} failed; later turns: reuse "
                  f"{f['reuse_later']:.1%} of ideal {f['ideal_later']:.1%}, TTFT p50 {f['ttft_later_p50_ms']:.0f} ms "
                  f"p99 {f['ttft_later_p99_ms']:.0f} ms", flush=True)
    w = scale.workload
    what = (f"Claude Code 2.1.328 and Codex 0.169.0 recorded sessions, {w.sessions_per_client} of each client, "
            f"3 recorded turns + {w.extra_turns} tool turns of {w.min_result_words}-{w.max_result_words} words, tool "
            f"gaps {w.min_gap_s:g}-{w.max_gap_s:g} s, over the Messages and Responses APIs")
    section = report(runs, list(modes), scale.seeds, scale.background, time.monotonic() - started, describe_mesh(),
                     sessions=what)
    plot(runs, list(modes), RESULT, "Agent clients' sessions: session routing vs plain kv routing")
    save_json(RESULT, {"client_workload": asdict(w), "send_limit_s": scale.send_limit_s, **section})
    return section
