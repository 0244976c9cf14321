"""Where a request's and a token's CPU go, by process and by step (steps.py), sampled while the
mesh serves: part of `make bench ARGS="--only hot-path"`, alone `--only request-profile`.

Per mesh layout (the kv-router service; the processor routing in-process; a gateway hosting its
processor and routing in-process), a zero-compute mocker worker and:
- 1-token completions at concurrency 16 for `SAMPLE_S`: every process's CPU per request, from
  /proc, split by the share of its py-spy samples (`--nonblocking`, 250 Hz, idle samples left
  out) that each step has;
- streamed completions, 64 at a time, 128 tokens each, for as long: the same per token.
Sampling reads the processes' memory without stopping them; what it costs them is inside the
spread of runs. NVIDIA Dynamo's per-process CPU per request and per token are measured in the same
harness (its Rust is not sampled by step).
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench.common.report import save_json, table
from bench.hot_path import dynamo
from bench.hot_path.steps import step_names, steps_of
from bench.hot_path.stream_load import one_stream, one_token_completion
from testkit.mesh import LaunchedMesh, launched_mesh
from services.tools.make_demo_model import ensure_demo_model
from testkit.proc_stat import cpu_seconds

SAMPLE_S = 12.0
RATE_HZ = 250
CONCURRENCY = 16
STREAMS, STREAM_TOKENS = 64, 128
MODEL = "kvmesh-demo"
# (label, launcher flags after the zero-compute mocker's)
LAYOUTS = (
    ("kv-router service", ()),
    ("local routing", ("--routing", "local")),
    ("embedded processor, local routing", ("--embed-processors", "--routing", "local")),
)


@dataclass
class Profile:
    """CPU µs per unit (a request or a token) of each process, and of each step within it."""

    unit: str
    units: int = 0
    per_process: dict[str, float] = field(default_factory=dict)
    per_step: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.per_process.values())


def py_spy() -> str | None:
    found = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    return found if Path(found).exists() else None


async def _for(seconds: float, one: Callable[[], Awaitable[int]], concurrency: int) -> int:
    """Calls of `one` by `concurrency` clients until `seconds` pass; the units they report."""
    deadline = time.monotonic() + seconds
    done = 0

    async def client() -> None:
        nonlocal done
        while time.monotonic() < deadline:
            units = await one()  # not `done += await one()`: that reads `done` before the await
            done += units

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return done


async def _requests(base: str, seconds: float) -> int:
    async with aiohttp.ClientSession(base, connector=aiohttp.TCPConnector(limit=64)) as session:
        async def one() -> int:
            await one_token_completion(session, MODEL)
            return 1

        return await _for(seconds, one, CONCURRENCY)


async def _tokens(base: str, seconds: float) -> int:
    async with aiohttp.ClientSession(base, connector=aiohttp.TCPConnector(limit=STREAMS * 2)) as session:
        async def one() -> int:
            tokens, _, _ = await one_stream(session, MODEL, STREAM_TOKENS)
            return tokens

        return await _for(seconds, one, STREAMS)


LOADS: dict[str, Callable[[str, float], Awaitable[int]]] = {"request": _requests, "token": _tokens}


def measure(pids: dict[str, list[int]], base: str, unit: str, sample: bool) -> Profile:
    """One load for SAMPLE_S (after a short warm-up) with the CPU of `pids`, by process name,
    and, where `sample`, their samples by step."""
    load = LOADS[unit]
    asyncio.run(load(base, 1.0))
    profile = Profile(unit)
    spy = py_spy() if sample else None
    with tempfile.TemporaryDirectory(prefix="kvmesh-profile-") as out:
        spies = [] if spy is None else [
            (name, subprocess.Popen([spy, "record", "--pid", str(pid), "--format", "raw", "--rate", str(RATE_HZ),
                                     "--nonblocking", "--duration", str(int(SAMPLE_S) + 30), "--output",
                                     f"{out}/{name}-{pid}.txt"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            for name, group in pids.items() for pid in group]
        if spies:
            time.sleep(0.5)  # attached before the load starts
        before = {name: sum(cpu_seconds(p) for p in group) for name, group in pids.items()}
        profile.units = asyncio.run(load(base, SAMPLE_S))
        used = {name: sum(cpu_seconds(p) for p in group) - before[name] for name, group in pids.items()}
        for _, proc in spies:
            proc.send_signal(signal.SIGINT)  # py-spy writes what it sampled and exits
            proc.wait(timeout=60)
        for name, seconds in used.items():
            profile.per_process[name] = seconds / max(profile.units, 1) * 1e6
        for name in pids:
            counts = sum((steps_of(path.read_text().splitlines()) for path in Path(out).glob(f"{name}-*.txt")),
                         start=steps_of([]))
            samples = sum(counts.values())
            if samples:
                profile.per_step[name] = {step: profile.per_process[name] * n / samples for step, n in counts.items()}
    return profile


def mesh_pids(mesh: LaunchedMesh) -> dict[str, list[int]]:
    names = [name for name, _ in mesh.children if name != "etcd"]
    return {name: mesh.pids(name) for name in dict.fromkeys(names)}


def profile_layout(flags: tuple[str, ...]) -> dict[str, Profile]:
    with launched_mesh("--engine", "mocker", "--speedup", "inf", "--decode-workers", "1", *flags) as mesh:
        pids = mesh_pids(mesh)
        return {unit: measure(pids, mesh.base, unit, sample=True) for unit in LOADS}


def print_profile(label: str, profile: Profile, dynamo: Profile | None) -> None:
    processes = list(profile.per_process)
    rows = []
    for step in step_names():
        cells = [profile.per_step.get(name, {}).get(step, 0.0) for name in processes]
        if sum(cells) >= 0.5:
            rows.append([step, *cells, sum(cells)])
    rows.append(["all (from /proc)", *[profile.per_process[n] for n in processes], profile.total])
    if dynamo is not None:
        rows.append([f"NVIDIA Dynamo ({', '.join(f'{n} {v:.0f}' for n, v in dynamo.per_process.items())})",
                     *["" for _ in processes], dynamo.total])
    table(f"CPU us per {profile.unit} by process and step: {label} ({profile.units} {profile.unit}s sampled)",
          ["step", *processes, "mesh"], rows)


def dynamo_profiles() -> dict[str, Profile]:
    """NVIDIA Dynamo's CPU per request and per token by process, in the same harness ({} when it
    cannot run here; it says why)."""
    try:
        with dynamo.serving(ensure_demo_model(), MODEL) as served:
            return {unit: measure(served.pids, served.base, unit, sample=False) for unit in LOADS}
    except dynamo.Unavailable as exc:
        print(f"request profile: Dynamo skipped: {exc}", flush=True)
        return {}


def run() -> dict:
    """Every layout's profile, printed beside Dynamo's per-process figures."""
    print("request profile: NVIDIA Dynamo ...", flush=True)
    theirs = dynamo_profiles()
    if py_spy() is None:
        print("request profile: py-spy is not installed (make install puts it in .venv); CPU by process only")
    results: dict[str, dict] = {}
    for label, flags in LAYOUTS:
        print(f"request profile: {label} ...", flush=True)
        profiles = profile_layout(flags)
        for unit, profile in profiles.items():
            print_profile(label, profile, theirs.get(unit))
        results[label] = {unit: profile.__dict__ for unit, profile in profiles.items()}
    results["dynamo"] = {unit: profile.__dict__ for unit, profile in theirs.items()}
    save_json("request_profile", results)
    return results
